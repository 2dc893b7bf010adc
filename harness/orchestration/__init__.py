"""The commands: plan the runs, execute them through a runner (resumable), summarise, write the report."""
