"""Ray: start or join a cluster, place and create the actors, wait on them with bounded waits,
and authenticate to a cluster (auth.py)."""
