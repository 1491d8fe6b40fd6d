"""The CPU demo (demo.py): its recipes (recipes.py), how their warm starts check themselves
(checks.py) and the reward_model recipe's policy-initialised reward model (policyreward.py). The
models it trains come from cluster/models/."""
