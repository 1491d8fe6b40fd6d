"""W&B for real (issue 37): `raygrpo train` with metrics.wandb=true and no W&B API key, as on a machine
that never ran `wandb login`. The run logs offline by itself (saying so and how to upload it), and its
files read back hold the run name, the config, every step's metrics and the completions table.
Real Ray, vLLM, DeepSpeed, wandb; the offline tiny model."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from wandb_files import read_offline_run

from cluster.run.metrics import read_metrics

BIN = Path(sys.executable).parent


def test_a_run_without_an_api_key_logs_to_wandb_offline_and_its_files_hold_the_run(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "runs" / "wb"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}  # no key, no mode: a new user's
    env["HOME"] = str(tmp_path / "home")  # and no ~/.netrc from an earlier `wandb login`
    out = subprocess.run(
        [str(BIN / "raygrpo"), "train", "examples/cpu_demo.yaml", f"model.path={tiny_model_dir}",
         f"trainer.run_dir={run_dir}", "trainer.steps=2", "trainer.prompts_per_step=2", "trainer.group_size=2",
         "trainer.eval_every=0", "trainer.eval_pass_k=1", "data.num_eval=2", "data.task_digits=1",
         "trainer.dynamic_sampling=false", "checkpoint.every=0", "rollout.max_new_tokens=4",
         "rollout.gpu_memory_utilization=0.03", "learner.micro_batch_size=4", "metrics.tensorboard=false",
         "metrics.wandb=true", "metrics.wandb_project=raygrpo-e2e", "metrics.wandb_run_name=offline-try-1",
         "metrics.wandb_tags=[e2e]", "metrics.completions_per_step=2"],
        cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True, timeout=900)
    console = out.stdout + out.stderr
    assert out.returncode == 0, console[-4000:]
    assert "no W&B API key is configured" in console and f"wandb sync {run_dir}/wandb/offline-run-*" in console
    assert "wandb is not installed" not in console

    steps = read_metrics(run_dir)
    run = read_offline_run(run_dir)
    assert run["name"] == "offline-try-1" and run["project"] == "raygrpo-e2e"
    assert run["config"]["trainer"]["steps"] == 2 and run["config"]["metrics"]["wandb_run_name"] == "offline-try-1"
    assert run["config"]["model"]["path"] == str(tiny_model_dir)

    logged = {}  # step -> every key logged at it (one wandb.log call per kind)
    for row in run["history"]:
        logged.setdefault(row["_step"], {}).update(row)
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        at = logged[s["step"]]
        assert at["train/reward_mean"] == s["reward_mean"] and at["train/gen_tokens"] == s["gen_tokens"]
        table = at["completions"]
        assert table["_type"] == "table-file" and table["nrows"] == 2
        data = json.loads((run["dir"] / "files" / table["path"]).read_text())
        assert data["columns"][:4] == ["step", "prompt", "completion", "reward"]
        assert {r[0] for r in data["data"]} == {s["step"]}
        written = [json.loads(x) for x in (run_dir / "completions.jsonl").read_text().splitlines()]
        assert sorted(r[2] for r in data["data"]) == sorted(w["completion"] for w in written if w["step"] == s["step"])
