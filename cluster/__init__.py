"""Orchestration, on top of actors/ and learner/: the run's config (config.py), the driver loop
(trainer.py) with its batch collection (collect.py) and worker-group handles (workers.py), the
CLI (cli.py, job_entry.py for submitted jobs), and the rooms data/, run/, launch/, demo/, bench/."""
