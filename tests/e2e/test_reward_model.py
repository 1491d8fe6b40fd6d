"""`model:PATH` rewards through real Ray RewardModelActors: the scores equal transformers' own forward,
a run scored by a reward model alone logs its per-function metrics, and survives its actor SIGKILLed."""
from __future__ import annotations

import json
import os
import random
import re
import signal
import threading

import pytest
import torch

from actors.config import RewardConfig
from actors.rewards.model_actor import RewardModelActor
from cluster.data.dataset import arithmetic_examples
from cluster.driver.trainer import Trainer
from cluster.models.tinyreward import reward_model_result, wrong_completion
from cluster.run.metrics import read_metrics
from tests.e2e.test_train import config, kill_while_learning


def test_the_actor_scores_as_transformers_does(addition_rm, ray_cluster):
    """A reward model trained offline to rank sums above wrong completions, scored through its Ray actor
    (batched, sorted by length, padded), equals transformers' forward of each text alone to 1e-5."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    # it learned something to score with: chance is 0.5, and most wrong completions are near misses
    # (this small spec reaches 0.79 at 300 steps; the recipe's default spec more)
    assert reward_model_result(addition_rm)["pairwise_accuracy"] >= 0.75
    rng = random.Random(0)
    examples = arithmetic_examples("addition", 2)[:24]
    prompts = [e.prompt for e in examples]
    completions = [e.fields["answer"] if i % 2 else wrong_completion(int(e.fields["answer"]), rng)
                   for i, e in enumerate(examples)]
    actor = ray_cluster.remote(RewardModelActor).remote(str(addition_rm), RewardConfig(model_batch_size=5))
    try:
        out = ray_cluster.get(actor.score.remote(prompts, completions), timeout=300)
    finally:
        ray_cluster.kill(actor)
    tok = AutoTokenizer.from_pretrained(addition_rm)
    model = AutoModelForSequenceClassification.from_pretrained(addition_rm, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [model(**tok(p + c, return_tensors="pt")).logits[0, 0].item() for p, c in zip(prompts, completions)]
    diff = max(abs(a - b) for a, b in zip(out["values"], expected))
    print(f"reward model via its actor vs transformers: max |difference| {diff:.2e} over {len(prompts)} samples")
    assert diff <= 1e-5 and out["truncated"] == 0
    right = [v for i, v in enumerate(out["values"]) if i % 2]
    wrong = [v for i, v in enumerate(out["values"]) if not i % 2]
    assert sum(r > w for r, w in zip(right, wrong)) >= len(right) * 0.6


def test_a_run_scored_by_a_reward_model_survives_its_actor_killed(tiny_model_dir, addition_rm, ray_cluster, tmp_path,
                                                                   capsys):
    """Reward = the reward model alone. Its actor is SIGKILLed while it scores step 2: Ray restarts it, runs
    the call again, and every step is logged once with its per-function metrics.

    The same run serves the reference actor restarted in place (its host alive): SIGKILLed while step 2
    trains, Ray restarts it and step 3's call runs there; nothing fails, and the driver sees the new process
    in the answer: it says so, gives it its threads, and records it in placement.json."""
    run_dir = tmp_path / "rm-run"
    cfg = config(tiny_model_dir, run_dir, f"reward.functions=[model:{addition_rm}]", "trainer.steps=3",
                 "data.task_digits=2", "reward.model_batch_size=8", "reward.model_max_len=8",
                 "algo.beta=0.001", "reference.placement=actor")
    trainer = Trainer(cfg)
    killed: list[int] = []
    score = trainer.scorer.score

    def score_and_kill(*args, **kwargs):
        if trainer.step == 1 and not killed:  # step 2's collection: kill the actor while its call is in flight
            pid = next(p["pid"] for p in trainer.placement if p["role"] == "reward-0")
            threading.Timer(0.05, os.kill, (pid, signal.SIGKILL)).start()
            killed.append(pid)
        return score(*args, **kwargs)

    trainer.scorer.score = score_and_kill
    reference_killed = kill_while_learning(trainer, at_step=1, role="reference")
    summary = trainer.run()
    assert killed and summary["checkpoint"].endswith("step-00000003")
    assert summary["reward_model_restarts"] == 1  # the driver saw an answer come from a new process
    # placement.json names the new processes (they got their threads again), and the console says where they run
    placement = {p["role"]: p for p in json.loads((run_dir / "placement.json").read_text())}
    assert placement["reward-0"]["pid"] not in killed and placement["reward-0"]["threads"] >= 1
    out = capsys.readouterr().out
    assert re.search(rf"reward model \S*{addition_rm.name} runs again on .*, with its threads", out)
    old_pid, new_pid = reference_killed[0], placement["reference"]["pid"]
    assert new_pid != old_pid and placement["reference"]["threads"] >= 1
    assert re.search(rf"reference actor was restarted \(process {old_pid} -> {new_pid}\) on \S+ \(\S+, Ray node "
                     r"\w+\); Ray ran its call again, nothing was skipped", out), out
    assert re.search(r"network: .*reference", out.split("reference actor was restarted", 1)[1])  # said where, again
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    name = addition_rm.name
    for r in rows:
        assert r["reward_errors"] == 0 and r["reward_unscorable"] == 0
        assert r[f"rewards/{name}/mean"] == pytest.approx(r["reward_mean"]) and r[f"rewards/{name}/s"] > 0
        assert r[f"rewards/{name}/std"] > 0 and r[f"rewards/{name}/errors"] == 0
        assert r[f"rewards/{name}/truncated"] > 0  # "12+34=" + up to 6 tokens is longer than model_max_len=8

