"""`model:PATH` rewards through a real Ray RewardModelActor: its scores equal transformers' own forward.

A run scored by a reward model alone, logging its per-function metrics and surviving its reward model and
reference actors SIGKILLed, is the reward_model recipe's run through the CLI:
tests/e2e/test_recipes_end_to_end.py::test_the_reward_model_recipe_is_scored_by_its_model_alone_and_survives_its_actors_killed
(it was this file's own run, one engine start more; issue 58)."""
from __future__ import annotations

from reward_samples import right_above_wrong, samples, scored_alone

from actors.config import RewardConfig
from actors.rewards.model_actor import RewardModelActor
from cluster.models.tinyreward import reward_model_result


def test_the_actor_scores_as_transformers_does(addition_rm, ray_cluster):
    """A reward model trained offline to rank sums above wrong completions, scored through its Ray actor
    (batched, sorted by length, padded), equals transformers' forward of each text alone to 1e-5."""
    # it learned something to score with: chance is 0.5, and most wrong completions are near misses
    # (this small spec reaches 0.79 at 300 steps; the recipe's default spec more)
    assert reward_model_result(addition_rm)["pairwise_accuracy"] >= 0.75
    prompts, completions = samples()
    actor = ray_cluster.remote(RewardModelActor).remote(str(addition_rm), RewardConfig(model_batch_size=5))
    try:
        out = ray_cluster.get(actor.score.remote(prompts, completions), timeout=300)
    finally:
        ray_cluster.kill(actor)
    expected = scored_alone(addition_rm, prompts, completions)
    diff = max(abs(a - b) for a, b in zip(out["values"], expected))
    print(f"reward model via its actor vs transformers: max |difference| {diff:.2e} over {len(prompts)} samples")
    assert diff <= 1e-5 and out["truncated"] == 0
    assert right_above_wrong(out["values"]) >= 0.6
