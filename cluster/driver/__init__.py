"""The driver: the loop of a run (trainer.py), the collecting of each step's batch (collector.py),
what a batch is made of (batch.py) and the handles on the worker groups (worker_groups.py)."""
