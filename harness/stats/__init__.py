"""Pure statistics of numbers (numpy/scipy): intervals, paired deltas, correlation, the Pareto frontier."""
