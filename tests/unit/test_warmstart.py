"""The demo's warm start: it stops at a target accuracy (not a step count), records where it
stopped, and caches per spec (seed and thread count included); the demo's noise verdict."""
import dataclasses
import random

import pytest
import torch

from cluster.data.dataset import load_splits
from cluster.demo.demo import noise_verdict
from cluster.models.warmstart import WarmStartSpec, greedy_accuracy, warm_start, warm_start_result


def test_noise_verdict_compares_the_gain_with_two_standard_errors():
    # p = 0.3 (the mean of the two), 400 prompts: s.e. of the difference = sqrt(0.21 * 2 / 400) = 0.0324
    assert "above the noise: GRPO learned" in noise_verdict(0.30, 0.60, 400) and "+30.0 points" in noise_verdict(0.30, 0.60, 400)
    assert "NOT above the noise" in noise_verdict(0.30, 0.35, 400)  # +5 < 2 s.e. (~7 points)
    assert "NOT above the noise" in noise_verdict(0.40, 0.30, 400)  # a loss is never a gain
    assert "noise (2 s.e. on 400 prompts) 6.5 points" in noise_verdict(0.20, 0.40, 400)


def test_warm_start_stops_at_its_target_and_caches_per_spec(tiny_model_dir, tmp_path):
    train, _ = load_splits("task:addition", "", 64, 1, 0)  # 1-digit addition: 100 examples
    spec = WarmStartSpec(steps=6, batch_size=4, lr=1e-3, target_accuracy=0.0, checks_in_a_row=2, check_every=2, num_check=8)
    out = warm_start(tiny_model_dir, tmp_path / "w", train, spec, progress=False)
    assert warm_start_result(out) == {"steps": 4, "accuracy": 0.0}  # target 0: met at checks 2 and 4
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert warm_start(tiny_model_dir, tmp_path / "w", train, spec, progress=False) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime  # same spec: reused
    unreachable = dataclasses.replace(spec, target_accuracy=1.01, threads=2)  # another spec: trained again, to the cap
    warm_start(tiny_model_dir, tmp_path / "w", train, unreachable, progress=False)
    # run to the cap, the accuracy recorded is that of the saved model on the 8 held-out check prompts
    assert warm_start_result(out)["steps"] == 6
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check = list(train)
    random.Random(f"warm-check-{spec.seed}").shuffle(check)
    threads = torch.get_num_threads()
    torch.set_num_threads(unreachable.threads)
    try:
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        accuracy = greedy_accuracy(model, AutoTokenizer.from_pretrained(out), check[:spec.num_check])
    finally:
        torch.set_num_threads(threads)
    assert warm_start_result(out)["accuracy"] == accuracy
    with pytest.raises(ValueError, match="num_check"):
        warm_start(tiny_model_dir, tmp_path / "x", train[:10], spec, progress=False)
