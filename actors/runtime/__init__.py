"""What every process shares (engines, reference, learner ranks, driver): device rules (devices.py),
torch threads (threads.py), sockets for process groups (sockets.py), config range checks
(checks.py), a bounded wait on an actor (waits.py), user code named `file.py:name` (user_code.py)
and the isolated process that runs it (worker_process.py: reward functions and environments). It
imports nothing of the generation side, nothing of learner/, nothing of cluster/, and not
actors/transport/."""
