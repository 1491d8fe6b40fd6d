"""The bench's reward part (cluster/bench/rewards.py): the HTTP verifier measurement against the example
server, and the table rows; the reward-model part needs Ray and runs with `raygrpo bench --parts rewards`."""
from __future__ import annotations

import pytest

from cluster.bench.report import resolve_setting
from cluster.bench.rewards import bench_http_verifier, bench_reward_pool, bench_samples, table_rows
from cluster.data.dataset import arithmetic_examples


def test_http_verifier_overhead_is_measured_against_the_example_server():
    prompts, completions, answers = bench_samples(arithmetic_examples("addition", 2), 16)
    assert sum(c == a for c, a in zip(completions, answers)) not in (0, 16)  # both right and wrong answers
    hv = bench_http_verifier(prompts, completions, answers, batch_size=8, repeats=3, concurrency=2)
    assert hv["batch_size"] == 8 and 0 < hv["ms_per_batch_min"] <= hv["ms_per_batch"] < 5000
    assert hv["ms_per_batch_concurrent"] > 0
    rows = table_rows({"http_verifier": hv, "reward_model": {
        "sequences": 256, "batch_size": 64, "threads": 2, "in_process_seqs_per_s": 900.0, "actor_seqs_per_s": 850.0}})
    assert [r[1] for r in rows] == ["reward model, in process", "reward model via Ray actor",
                                    "HTTP verifier, ms per batch", "HTTP verifier, 2 in flight"]


def test_the_reward_pool_is_measured_per_batch_size(tmp_path):
    rp = bench_reward_pool(tmp_path, num_procs=2, batches=(16, 64))
    assert [b["calls"] for b in rp["batches"]] == [16, 64] and all(b["calls_per_s"] > 0 for b in rp["batches"])
    assert [r[1] for r in table_rows({"reward_pool": rp})] == ["Python reward, batch of 16", "Python reward, batch of 64"]


def test_the_reward_part_is_one_of_the_bench_parts():
    assert resolve_setting("default", parts="rewards").parts == ("rewards",)  # `raygrpo bench --parts rewards`
    assert "rewards" in resolve_setting("default").parts  # and part of a plain `raygrpo bench`
    with pytest.raises(ValueError, match="choose from rollout,learner,sync,schedule,trl,lora,rewards"):
        resolve_setting("default", parts="reward")
