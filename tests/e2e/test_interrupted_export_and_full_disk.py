"""Issue 36's untried cases that need a run (real Ray, vLLM, DeepSpeed), through the CLI: a driver killed
during the final export (what it leaves in hf_model/; the rerun finishes it, nothing lost). The export cases
rerun copies of the session's finished run (tests/e2e/finished_run.py), started as a user starts it (the console
script, from the user's directory).

The other untried cases are tested where they cost no stack of their own (issue 58):
  - a full disk while completions.jsonl is written (the run ends naming the path; the step's row kept): the
    driver's loop at its seam, tests/unit/test_driver_seam_halts.py, with completions.jsonl a link to /dev/full;
    the same SaveError through the CLI (exit 1, the path, no traceback): test_bad_inputs.py's full disk under
    tensorboard/;
  - a rollout worker killed in an async run then stopped by SIGTERM and resumed: test_safety.py, with the
    run-dir guards.
"""
from __future__ import annotations

import pytest
from console import run
from finished_run import STEPS, copy_run, new_users_env

from learner.hf_dir import hf_dir_problem

pytestmark = pytest.mark.timeout(900)


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
