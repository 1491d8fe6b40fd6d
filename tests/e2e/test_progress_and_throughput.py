"""What a cluster team reads during a run (issue 37), through the CLI as a user runs it: a console of raygrpo's
own lines (issue 25: third-party lines in the run's logs/), the progress line
with generation tokens/s and an ETA from the third step on, evaluations named as such with their cost
(eval_s), the perf/* metrics (perf/mfu with metrics.peak_tflops), TRL's `reward` beside `reward_mean`,
and one short name per reward function in metrics.jsonl, completions.jsonl, `raygrpo show` and TensorBoard.

The same run also shows W&B for real (issue 37): metrics.wandb=true and no W&B API key, as on a machine
that never ran `wandb login`. The run logs offline by itself (saying so and how to upload it), and its
files read back hold the run name, the config, every step's metrics and the completions table.

The session's finished run (tests/e2e/finished_run.py: 4 steps, an evaluation before, at step 2 and after, a
built-in and a user's Python reward function, W&B on without a key) serves every claim: each reads a
different output of it, and no stack starts here. Real Ray, vLLM, DeepSpeed, wandb; the offline tiny model.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from finished_run import STEPS, WANDB
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb_files import read_offline_run

from cluster.bench.console_lines import classify
from cluster.run.metrics import read_metrics

BIN = Path(sys.executable).parent


def test_progress_line_evaluations_throughput_reward_names_and_wandb_offline(finished_run):
    proj, run_dir, out = finished_run
    console = out.text
    assert STEPS == 4  # the claims below are about a 4-step run evaluated every 2 steps

    # the console is raygrpo's on a cluster raygrpo starts itself: no third-party line at the default level,
    # vLLM's per-step INFO in logs/ (the same on a cluster joined by address: test_external_cluster.py's run)
    third_party = [line for origin, line in classify(console.splitlines(keepends=True)) if origin == "third-party"]
    assert third_party == [], third_party
    worker_logs = "".join(p.read_text() for p in (run_dir / "logs").glob("worker-*.log"))
    assert "Successfully reset prefix cache" in worker_logs and "Successfully reset prefix cache" not in console

    # 2. evaluations named as such, with their cost
    assert "evaluating at step 0: 4 held-out prompts, greedy + pass@2 (2 samples each)\n" in console
    assert re.search(r"evaluating at step 2: 4 held-out prompts, greedy \+ pass@2 \(2 samples each\); "
                     r"the last evaluation took \d+\.\ds", console), console
    assert re.search(r"eval @ step 2 \(\d+\.\ds\): accuracy ", console), console
    evals = read_metrics(run_dir, "eval")
    assert [e["step"] for e in evals] == [0, 2, 4] and all(e["eval_s"] > 0 and "pass@2" in e for e in evals)

    # 1 and 3. the progress line: generation tokens/s on every step, an ETA from the third on
    lines = {int(m[1]): m[0] for m in re.finditer(r"^step (\d)/4 .*$", console, flags=re.M)}
    assert sorted(lines) == [1, 2, 3, 4], console
    assert all(re.search(r"  gen \d+ tok/s", line) for line in lines.values()), lines
    assert ["eta " in lines[s] for s in (1, 2, 3, 4)] == [False, False, True, True], lines

    # 3 and 4. the metrics: throughput, TRL's reward, one name per reward function
    rows = read_metrics(run_dir)
    for r in rows:
        assert r["perf/tokens_per_s"] == r["gen_tokens"] / r["gen_s"] > 0
        assert r["perf/train_tokens_per_s"] > 0 and 0 <= r["perf/engine_idle_frac"] <= 1 and 0 < r["perf/mfu"] < 1
        assert r["reward"] == r["reward_mean"] and "reward_std" in r
        assert {"rewards/exact_match/mean", "rewards/brevity/mean"} <= set(r)
        assert not [k for k in r if k.startswith("rewards/") and k.count("/") != 2]
    logged = [json.loads(x) for x in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert logged and all(set(c["rewards"]) == {"exact_match", "brevity"} for c in logged)
    shown = subprocess.run([str(BIN / "raygrpo"), "show", str(run_dir.relative_to(proj)), "-n", "1"], cwd=proj,
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"\(exact_match [\d.]+, brevity [\d.]+\)", shown.stdout) and "my_rewards.py" not in shown.stdout
    tags = EventAccumulator(str(run_dir / "tensorboard")).Reload().Tags()["scalars"]
    assert {"train/rewards/brevity/mean", "train/perf/tokens_per_s", "train/reward", "eval/eval_s"} <= set(tags)

    # 5. W&B without an API key: offline by itself, saying so and naming the command that uploads it later
    assert "no W&B API key is configured" in console and "wandb is not installed" not in console
    named = re.search(r"`wandb sync (\S+)/wandb/offline-run-\*`", console)
    assert named and (proj / named[1]).resolve() == run_dir.resolve(), console[-3000:]
    run = read_offline_run(run_dir)
    assert run["name"] == WANDB["wandb_run_name"] == "offline-try-1" and run["project"] == "raygrpo-e2e"
    assert run["config"]["trainer"]["steps"] == 4 and run["config"]["metrics"]["wandb_run_name"] == "offline-try-1"
    assert Path(run["config"]["model"]["path"]).resolve() == (proj / "model").resolve()  # made absolute
    wandb_logged = {}  # step -> every key logged at it (one wandb.log call per kind)
    for row in run["history"]:
        wandb_logged.setdefault(row["_step"], {}).update(row)
    assert [s["step"] for s in rows] == [1, 2, 3, 4]
    for s in rows:
        at = wandb_logged[s["step"]]
        assert at["train/reward_mean"] == s["reward_mean"] and at["train/gen_tokens"] == s["gen_tokens"]
        table = at["completions"]
        assert table["_type"] == "table-file" and table["nrows"] == 2
        data = json.loads((run["dir"] / "files" / table["path"]).read_text())
        assert data["columns"][:4] == ["step", "prompt", "completion", "reward"]
        assert {r[0] for r in data["data"]} == {s["step"]}
        assert sorted(r[2] for r in data["data"]) == sorted(w["completion"] for w in logged if w["step"] == s["step"])
