"""Issue 30 through the CLI on a run that finished: rerunning it, exporting it, resuming it from another model,
a full disk under an export. (Copying a run dir, tearing its metrics and resuming it, case 3 and case 10: the
rerun of tests/e2e/test_safety.py's SIGTERM test resumes such a copy, so no test here starts a stack of its own.)

One real run (Ray, vLLM, DeepSpeed) for the session (tests/e2e/finished_run.py), started as a user starts
it: the console script, from the user's directory, with a config there whose paths are relative to it
(they cross into the actors, so they must be made absolute first). Its model declares no EOS (case 7), so
the same run shows the warning. The tests that change a run, or rerun one, work on copies of it: under
`make test` the tests of test_interrupted_export_and_full_disk.py and test_progress_and_throughput.py read
and copy the same run from the other pytest worker at the same time.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from console import full_disk_wrapper, run
from finished_run import STEPS, copy_run, new_users_env

from cluster.models.tinymodel import TinyModelSpec, build_tiny_model
from learner import checkpoint

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def finished(finished_run):
    return finished_run


def test_a_model_without_eos_is_warned_about_and_weights_get_the_runs_permissions(finished):
    """Case 7: a tokenizer without an EOS ran every completion to max_new_tokens with no warning.
    Case 11: model.safetensors was written 0600 while everything else of the run was 0644."""
    _, run_dir, out = finished
    assert "warning: the model declares no end-of-sequence token" in out.text
    assert "every completion runs to rollout.max_new_tokens=6 and the model cannot learn to stop" in out.text
    modes = {f.relative_to(run_dir): oct(f.stat().st_mode & 0o777) for f in run_dir.rglob("*")
             if f.is_file() and f.name != "raygrpo.lock"}
    assert len(set(modes.values())) == 1, modes
    assert modes[Path("hf_model/model.safetensors")] == modes[Path("config.yaml")]


def test_a_finished_run_rerun_says_so_and_redoes_nothing(finished):
    """Case 11: rerunning a finished run restarted every actor, redid the final evaluation (logged twice)
    and rewrote hf_model. Rerun on a copy (a copied run dir is the same run, case 10): a rerun takes the run
    dir's lock and saves its config.yaml again, while other tests may be copying the session's run."""
    home, finished_dir, _ = finished
    run_dir = copy_run(home, finished_dir, "rerun")
    before = {f: f.stat().st_mtime_ns for f in run_dir.rglob("*") if f.is_file() and f.name != "config.yaml"}
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    out = run(["train", "run.yaml", f"trainer.run_dir={run_dir.relative_to(home)}"], home, env=new_users_env(home))
    out.report("rerun of a finished run")
    assert out.returncode == 0, out.text[-3000:]
    assert f"run dir {run_dir} already finished its {STEPS} steps" in out.text and "nothing to do" in out.text
    assert "Started a local Ray instance" not in out.text and "waiting on" not in out.text  # no cluster, no actor
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics
    assert {f: f.stat().st_mtime_ns for f in before} == before  # nothing rewritten


def test_export_never_deletes_a_run_and_overwrite_moves_the_old_target_aside(finished, tmp_path):
    """Case 1: `raygrpo export RUN/checkpoints/step-1 RUN --overwrite` deleted the whole run and exited 0.
    On a copy of the run in a user's directory of this test's own: the listing of the directory holding the
    run must stay as it was, and other tests add copies beside the session's run meanwhile."""
    _, finished_dir, _ = finished
    home = tmp_path / "user"
    run_dir = home / "runs" / "first"
    shutil.copytree(finished_dir, run_dir)
    first = run_dir / "checkpoints" / checkpoint.step_dir_name(STEPS - 1)  # one kept beside the final (checkpoint.keep)
    listing = sorted(str(p.relative_to(home)) for p in home.rglob("*"))
    for target in (run_dir, home, first, run_dir / "checkpoints"):  # a run dir, one holding it, the checkpoint
        out = run(["export", first, target, "--overwrite"], home)
        assert out.returncode == 2 and "refusing to export into" in out.text and "Nothing was changed" in out.text, \
            out.text
    assert sorted(str(p.relative_to(home)) for p in home.rglob("*")) == listing
    assert checkpoint.verify(first) == []

    mine = tmp_path / "exported"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    out = run(["export", first, mine, "--overwrite"], home)
    assert out.returncode == 0, out.text
    [aside] = [p for p in tmp_path.iterdir() if p.name.startswith("exported.replaced-")]
    assert (aside / "notes.txt").read_text() == "mine" and f"moved the previous contents of {mine}" in out.text
    assert (mine / "model.safetensors").is_file() and not (mine / "notes.txt").exists()
    assert oct((mine / "model.safetensors").stat().st_mode & 0o777) == oct((mine / "config.json").stat().st_mode & 0o777)


def test_a_full_disk_under_an_export_names_the_path_and_keeps_the_target(finished, tmp_path):
    """Case 8, export: the target's filesystem is full."""
    home, run_dir, _ = finished
    disk = tmp_path / "disk"
    disk.mkdir()
    wrap = full_disk_wrapper(disk)
    if wrap is None:
        pytest.skip("this machine cannot mount a private tmpfs (no root and no user namespaces)")
    out = run(["export", run_dir / "checkpoints" / checkpoint.step_dir_name(STEPS), disk / "model"], home, wrap=wrap)
    assert out.returncode == 1, out.text
    assert f"could not write {disk / 'model'}: the disk is full" in out.text and "0 MiB free" in out.text, out.text
    assert "the export's target is left as it was" in out.text and "Traceback" not in out.text


def test_a_checkpoint_of_another_model_is_refused_before_any_actor(finished, tmp_path, tiny_model_dir):
    """Case 9: checkpoint.resume pointing at another model's checkpoint failed 27 s in, in the learner
    (a state_dict size mismatch)."""
    home, run_dir, _ = finished
    other = build_tiny_model(tmp_path / "wider", TinyModelSpec(hidden_size=256, num_layers=2, seed=0))
    ckpt = run_dir / "checkpoints" / checkpoint.step_dir_name(STEPS)
    out = run(["train", "run.yaml", f"model.path={other}", f"checkpoint.resume={ckpt}", "trainer.run_dir=runs/other",
               f"trainer.steps={STEPS + 1}"], home)
    assert out.returncode == 2, out.text[-3000:]
    assert f"{ckpt} was trained from another model than model.path {other}" in out.text
    assert "hidden_size 128 vs 256" in out.text and "waiting on" not in out.text and "Traceback" not in out.text
    assert not (home / "runs" / "other" / "config.yaml").exists()  # refused before anything was written
    # The same architecture with other weights (another seed): the run's KL term (algo.beta 0.05) would take its
    # reference from them, so the resume would not continue the run; the checkpoint's fingerprint of its
    # model.path's weights finds it.
    same_shape = build_tiny_model(tmp_path / "reseeded", TinyModelSpec(hidden_size=128, num_layers=2, seed=1))
    out = run(["train", "run.yaml", f"model.path={same_shape}", f"checkpoint.resume={ckpt}", "trainer.run_dir=runs/other",
               f"trainer.steps={STEPS + 1}"], home)
    assert out.returncode == 2, out.text[-3000:]
    assert f"{ckpt} cannot be resumed from model.path as it is: {same_shape} no longer holds the weights the run " \
           "trained from (model.safetensors holds other weights), and the resumed run takes the reference model of " \
           "the KL term (algo.beta > 0) from there" in " ".join(out.text.split()), out.text[-3000:]
    assert "waiting on" not in out.text and "Traceback" not in out.text
    assert not (home / "runs" / "other" / "config.yaml").exists()
