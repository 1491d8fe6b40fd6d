"""What every process shares (engines, reference, learner ranks, driver): device rules (devices.py),
torch threads (threads.py), sockets for process groups (sockets.py), sequence packing and
log-probs (sequences.py), config range checks (checks.py). It imports nothing of the generation
side, nothing of learner/ but grpo.py, nothing of cluster/, and not actors/transport/."""
