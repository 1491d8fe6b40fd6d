"""A run's lifecycle on the driver: the run dir it owns (rundir.py), stop signals (stopping.py),
health guards (health.py) and the metrics it writes (metrics.py)."""
