"""Issue 36's untried cases that need a run (real Ray, vLLM, DeepSpeed), through the CLI: a driver killed
during the final export (what it leaves in hf_model/; the rerun finishes it, nothing lost) and a full disk
while completions.jsonl is written (a clear error naming the path). The third, a rollout worker killed in an
async run then stopped by SIGTERM and resumed, shares its run with the run-dir guards: test_safety.py.

The export cases rerun copies of the session's finished run (tests/e2e/finished_run.py); the other runs start
as a user starts them (the console script, from the user's directory).
"""
from __future__ import annotations

import json
import shutil

import pytest
import yaml
from console import full_disk_wrapper, run
from finished_run import STEPS, copy_run, new_users_env

from learner.hf_dir import hf_dir_problem

pytestmark = pytest.mark.timeout(900)


def config(run_dir: str) -> dict:
    return {"model": {"path": "model"}, "data": {"num_eval": 0, "task_digits": 1},
            "trainer": {"steps": 1, "prompts_per_step": 4, "group_size": 4, "run_dir": run_dir, "actor_timeout_s": 300},
            "rollout": {"max_model_len": 48, "max_new_tokens": 6, "gpu_memory_utilization": 0.03},
            "learner": {"lr": 1.0e-3, "micro_batch_size": 8}, "reward": {"functions": ["exact_match"]},
            "metrics": {"tensorboard": False}}


@pytest.fixture(scope="module")
def home(tmp_path_factory, tiny_model_dir):
    home = tmp_path_factory.mktemp("user")
    shutil.copytree(tiny_model_dir, home / "model")
    return home


@pytest.mark.parametrize("torn", ["weights cut short", "config only"])
def test_a_driver_killed_during_the_final_export_is_finished_by_the_rerun(finished_run, torn):
    """Untried case: the driver killed during the final export. The final checkpoint is written first (marked
    finished), so what a kill can leave is an hf_model/ whose weights are cut short or not yet written; the
    rerun used to see its config.json and call the run done. Now it exports again; the torn copy is kept aside.
    On a copy of the session's finished run (tests/e2e/finished_run.py)."""
    home, finished, _ = finished_run
    run_dir = copy_run(home, finished, f"torn-{torn.replace(' ', '-')}")
    hf = run_dir / "hf_model"
    assert hf_dir_problem(hf) is None
    weights = (hf / "model.safetensors").read_bytes()
    if torn == "weights cut short":
        (hf / "model.safetensors").write_bytes(weights[: len(weights) // 3])
    else:
        (hf / "model.safetensors").unlink()
    out = run(["train", "run.yaml", f"trainer.run_dir={run_dir.relative_to(home)}"], home, env=new_users_env(home))
    out.report(f"rerun after an export killed ({torn})")
    assert out.returncode == 0, out.text[-3000:]
    assert "(the run stopped during its final export?): exporting it again from" in out.text, out.text[-3000:]
    assert f"already finished its {STEPS} steps" in out.text
    assert hf_dir_problem(hf) is None and (hf / "model.safetensors").read_bytes() == weights  # the same export
    assert len(list(run_dir.glob("hf_model.replaced-*"))) >= 1  # the torn one moved aside, nothing deleted


def test_a_full_disk_while_completions_jsonl_is_written_names_the_path(home, tmp_path):
    """Untried case: completions.jsonl on a full disk (a link into a full 64 KiB tmpfs, mounted in a private
    mount namespace: nothing outside sees it). The run ends with the path, the cause and the free space; the
    step's metrics row, written before, is kept."""
    disk = tmp_path / "disk"
    disk.mkdir()
    wrap = full_disk_wrapper(disk)
    if wrap is None:
        pytest.skip("this machine cannot mount a tmpfs in a private mount namespace (needs root or user namespaces)")
    run_dir = home / "runs" / "full"
    run_dir.mkdir(parents=True)
    (run_dir / "completions.jsonl").symlink_to(disk / "completions.jsonl")
    (home / "full.yaml").write_text(yaml.safe_dump(config("runs/full")))
    out = run(["train", "full.yaml"], home, wrap=wrap)
    out.report("completions.jsonl on a full disk")
    assert out.returncode == 1, out.text[-3000:]
    assert f"could not write {run_dir / 'completions.jsonl'}: the disk is full" in out.text, out.text[-3000:]
    assert "MiB free on that filesystem" in out.text and "Traceback" not in out.text
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1]
