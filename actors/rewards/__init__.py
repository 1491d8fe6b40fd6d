"""Rewards: every kind of `reward.functions` entry, weighted and summed, with per-function health.

scorer.py is the scorer (`RewardScorer`: weights, nulls, per-function stats), on entries.py's
`RewardEntries` (the configured entries, named and started, and the actors they call); registry.py the one
table of kinds, each a module: python.py (built-ins from functions.py, and user code run in the
worker pool, pool.py), model.py (`model:PATH`, scored by model_actor.py's RewardModelActor) and
http.py (remote verifiers); base.py what a kind is; progress.py the "waiting on" lines. Nothing
here imports torch but model_actor.py, which runs in its own Ray actor.
"""
