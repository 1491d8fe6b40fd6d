"""Orchestration, on top of actors/ and learner/: the run's config (config.py), the driver (driver/:
the loop, its collector, the batch, the worker-group handles), the CLI (cli.py, job_entry.py for
submitted jobs), and the rooms data/, run/, launch/, demo/, bench/."""
