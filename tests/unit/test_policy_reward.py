"""The reward_model recipe's reward model (cluster/demo/policyreward.py): it starts from the policy's own
network, samples the policy deterministically and labels the samples with exact_match, pairs a right
completion with a wrong one, and is cached by its spec and its policy."""
from __future__ import annotations

import dataclasses
import json
import random
import shutil

import pytest
import torch

from actors.rewards.functions import exact_match
from cluster.data.dataset import load_splits
from cluster.demo.policyreward import SAMPLES_FILE, PolicyRewardSpec, _pair, build_policy_reward_model, policy_reward_result, sample_policy

# 1-digit addition: 100 prompts, small enough for a unit test
TINY = PolicyRewardSpec(samples_per_prompt=2, steps=2, batch_size=4, num_check=8)


@pytest.fixture(scope="module")
def prompts():
    return load_splits("task:addition", "", 20, 1, 0)[0]


def test_sampling_the_policy_is_deterministic_and_labelled_by_exact_match(tiny_model_dir, prompts):
    first = sample_policy(tiny_model_dir, prompts[:10], TINY, batch_prompts=4)
    assert first == sample_policy(tiny_model_dir, prompts[:10], TINY, batch_prompts=4)
    assert len(first) == 20 and [s["prompt"] for s in first[:4]] == [prompts[0].prompt] * 2 + [prompts[1].prompt] * 2
    answers = {e.prompt: e.fields for e in prompts}
    assert all(s["correct"] == (exact_match(s["prompt"], s["completion"], **answers[s["prompt"]]) == 1.0) for s in first)
    other = sample_policy(tiny_model_dir, prompts[:10], dataclasses.replace(TINY, seed=1), batch_prompts=4)
    assert [s["completion"] for s in other] != [s["completion"] for s in first]  # the seed is the sampling's


def test_a_pair_is_a_right_completion_against_a_wrong_one(prompts):
    e = prompts[0]
    rng = random.Random(0)
    for own in ({True: [], False: []}, {True: [e.fields["answer"] + "+"], False: ["7", "x"]}):
        for _ in range(200):
            right, wrong = _pair(e, own, TINY, rng, prompts)
            assert exact_match(e.prompt, right, **e.fields) == 1.0
            assert exact_match(e.prompt, wrong, **e.fields) == 0.0
    mixed = [_pair(e, {True: ["R"], False: ["W"]}, TINY, rng, prompts) for _ in range(400)]
    assert 0.4 < sum(w == "W" for _, w in mixed) / 400 < 0.6  # the rest: near misses and other prompts' sums
    swapped = dataclasses.replace(TINY, swapped_fraction=1.0, synthetic_fraction=0.0)
    wrongs = [_pair(e, {True: [], False: ["W"]}, swapped, rng, prompts)[1] for _ in range(200)]
    sums = {p.fields["answer"] for p in prompts}
    assert "W" not in wrongs and sum(w in sums for w in wrongs) >= 180  # other prompts' sums (a near miss on a tie)
    assert 0.35 < sum(r == "R" for r, _ in mixed) / 400 < 0.65  # policy_positive_fraction 0.5 of the positives


def test_the_reward_model_starts_from_the_policy_and_is_cached_by_spec(tiny_model_dir, prompts, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    frozen = dataclasses.replace(TINY, lr=0.0)  # no update: the backbone is exactly the policy's
    out = build_policy_reward_model(tiny_model_dir, tmp_path / "rm", prompts, frozen, progress=False)
    rm = AutoModelForSequenceClassification.from_pretrained(out)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert type(rm).__name__ == "Qwen2ForSequenceClassification" and rm.config.num_labels == 1
    assert rm.config.pad_token_id == policy.config.pad_token_id
    policy_weights = policy.model.state_dict()
    assert all(torch.equal(w, policy_weights[k]) for k, w in rm.model.state_dict().items())
    assert rm.score.weight.shape == (1, policy.config.hidden_size) and rm.score.weight.abs().sum() > 0
    samples = [json.loads(line) for line in (out / SAMPLES_FILE).read_text().splitlines()]
    assert len(samples) == len(prompts) * TINY.samples_per_prompt
    report = policy_reward_result(out)["report"]
    assert report["check_prompts"] == 8 and report["argmax_prompts"] == 8 and 0.0 <= report["vs_policy_wrong"] <= 1.0

    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert build_policy_reward_model(tiny_model_dir, tmp_path / "rm", prompts, frozen, progress=False) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime  # same spec, same policy: reused
    build_policy_reward_model(tiny_model_dir, tmp_path / "rm", prompts, TINY, progress=False)  # another spec: rebuilt
    trained = AutoModelForSequenceClassification.from_pretrained(out)
    assert not torch.equal(trained.model.embed_tokens.weight, rm.model.embed_tokens.weight)
    policy_copy = tmp_path / "policy"  # the same directory, other weights (a warm start rebuilt in place): rebuilt
    shutil.copytree(tiny_model_dir, policy_copy)
    first = build_policy_reward_model(policy_copy, tmp_path / "rm2", prompts, TINY, progress=False)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    policy.model.embed_tokens.weight.data.mul_(2)
    policy.save_pretrained(policy_copy)
    build_policy_reward_model(policy_copy, tmp_path / "rm2", prompts, TINY, progress=False)
    assert (first / "model.safetensors").stat().st_mtime_ns != mtime
    with pytest.raises(ValueError, match="num_check"):
        build_policy_reward_model(tiny_model_dir, tmp_path / "small", prompts[:10], TINY, progress=False)
