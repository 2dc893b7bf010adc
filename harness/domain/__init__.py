"""What the layers hand each other: the policy catalogue, plans, options and results of the commands, the cost
model. Frozen dataclasses and pure rules; nothing here runs a tool or touches a file but the packaged profiles."""
