"""`raygrpo plan`: what a run will cost on a cluster before it starts.

shapes.py    a model's parameter count and shape from its config.json (no weights loaded)
hardware.py  the cluster: `local` (this machine), `2x8xH100`, or a YAML of nodes; published device specs
memory.py    bytes per device: the learner's states by ZeRO stage and offload, its activations; an engine's
             weights and KV cache
profile.py   the speeds a prediction uses: measured (`raygrpo bench --calibrate`) or derived from a spec
cost.py      seconds per phase of one step, and the waits of each schedule
cores.py     on `local`: the threads each side gets and how overlapping sides share the cores
fit.py       the calibration's run fit: a real run's phases over what the profile's points predict for it
search.py    the candidates (engines x TP, learner ranks, ZeRO stage, micro-batch, schedule, colocated), weighed
command.py   the command: print, --json, --write
published.py published GRPO runs set against the prediction (docs/plan.md's table)
"""
