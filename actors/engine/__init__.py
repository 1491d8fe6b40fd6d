"""The parts a rollout actor (actors/rollout.py RolloutWorker) is made of, one concern each:
generation.py (sampling), weight_updates.py (the engine's end of a weight update) and
pipeline_loop.py (trainer.mode=pipeline's engine that never stops). None imports another."""
