"""What every process shares (engines, reference, learner ranks, driver): device rules (devices.py),
torch threads (threads.py), sockets for process groups (sockets.py), config range checks
(checks.py). It imports nothing of the generation side, nothing of learner/, nothing of cluster/,
and not actors/transport/."""
