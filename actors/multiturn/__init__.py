"""Multi-turn rollouts: environments (envs.py: the contract, the built-ins, the checks), the isolated
processes that run them (env_pool.py), and token-exact trajectories driven turn by turn
(trajectories.py). Deliberately light: no torch import."""
