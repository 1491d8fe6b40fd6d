"""learner/checkpoint.py without Ray or DeepSpeed: atomic commit, keep-K, verification, RNG, safe loading."""
from __future__ import annotations

import json
import os
import random
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from learner import checkpoint as ck
from learner.checkpoint import SaveError, naming_save_errors
from learner.export import export_checkpoint, export_target_problem, move_aside


def _fake_save(tmp_dir, ranks=2, payload=b"x" * 1000):
    """What the workers would write: a DeepSpeed-like folder with per-rank files."""
    d = Path(tmp_dir) / ck.LEARNER_TAG
    d.mkdir(parents=True, exist_ok=True)
    for r in range(ranks):
        (d / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(payload + bytes([r]))
        ck.write_worker_state(tmp_dir, ck.LEARNER_TAG, r, {"step": 1, "rng": ck.rng_state()})


def _save(root, step, keep=10, **state):
    tmp = ck.begin(root, step)
    _fake_save(tmp)
    return ck.commit(tmp, root, step, {"weight_version": step, **state}, keep=keep)


def test_commit_is_atomic_and_records_state(tmp_path):
    tmp = ck.begin(tmp_path, 10)
    assert tmp.endswith(".tmp-step-00000010")
    _fake_save(tmp)
    assert ck.latest_complete(tmp_path) is None  # nothing sealed yet
    final = ck.commit(tmp, tmp_path, 10, {"weight_version": 10, "data": {"pos": 160}, "rng": ck.rng_state()}, keep=2)
    assert final == str(tmp_path / "step-00000010")
    assert not (tmp_path / ".tmp-step-00000010").exists()
    state = ck.load_driver_state(final)
    assert state["step"] == 10 and state["data"] == {"pos": 160}
    manifest = json.loads((tmp_path / "step-00000010" / ck.MANIFEST).read_text())
    assert "learner/raygrpo_rank_00001.json" in manifest["files"] and ck.DRIVER_STATE in manifest["files"]
    assert all("sha256" in e for e in manifest["files"].values())
    assert ck.verify(final) == [] and ck.latest_complete(tmp_path) == final


def test_non_json_driver_state_fails_before_sealing(tmp_path):
    tmp = ck.begin(tmp_path, 1)
    _fake_save(tmp)
    with pytest.raises(TypeError):
        ck.commit(tmp, tmp_path, 1, {"sampler": object()}, keep=2)
    assert ck.list_checkpoints(tmp_path) == []


def test_keep_k_and_stale_tmp_dirs_are_pruned(tmp_path):
    stale = Path(ck.begin(tmp_path, 99))  # a save that crashed before commit
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep=2)
    assert [Path(p).name for p in ck.list_checkpoints(tmp_path)] == ["step-00000003", "step-00000004"]
    assert not stale.exists()


def test_saving_the_same_step_again_replaces_it(tmp_path):
    _save(tmp_path, 5, marker="first")
    final = _save(tmp_path, 5, marker="second")
    assert ck.load_driver_state(final)["marker"] == "second"
    assert ck.latest_complete(tmp_path) == final


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "delete_file", "no_marker", "garbage_marker",
                                    "delete_driver_state"])
def test_corrupt_or_partial_checkpoints_are_skipped_with_a_warning(tmp_path, damage):
    good = _save(tmp_path, 1)
    bad = Path(_save(tmp_path, 2))
    optim = bad / ck.LEARNER_TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    if damage == "flip_byte":
        data = bytearray(optim.read_bytes())
        data[10] ^= 1
        optim.write_bytes(bytes(data))  # same size: only the sha256 catches it
    elif damage == "truncate":
        optim.write_bytes(optim.read_bytes()[:-1])
    elif damage == "delete_file":
        optim.unlink()
    elif damage == "no_marker":
        (bad / ck.MANIFEST).unlink()
    elif damage == "garbage_marker":
        (bad / ck.MANIFEST).write_text("{not json")
    else:
        (bad / ck.DRIVER_STATE).unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ck.latest_complete(tmp_path) == good
    assert any("step-00000002" in str(w.message) for w in caught), [str(w.message) for w in caught]


def test_no_checkpoint_at_all(tmp_path):
    assert ck.latest_complete(tmp_path / "missing") is None
    assert ck.latest_complete(tmp_path) is None


def test_large_files_are_checked_by_size(tmp_path, monkeypatch):
    monkeypatch.setattr(ck, "HASH_LIMIT", 100)
    final = Path(_save(tmp_path, 1))
    manifest = json.loads((final / ck.MANIFEST).read_text())
    entry = manifest["files"]["learner/zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert entry == {"size": 1001}


def test_rng_state_round_trips_through_json():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.randn()  # leave numpy with a cached gaussian
    state = json.loads(json.dumps(ck.rng_state()))
    expected = (random.random(), np.random.randn(3).tolist(), torch.rand(3).tolist())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    ck.set_rng_state(state)
    assert (random.random(), np.random.randn(3).tolist(), torch.rand(3).tolist()) == expected


def test_worker_state_missing_rank_is_explained(tmp_path):
    ck.write_worker_state(str(tmp_path), "learner", 0, {"step": 3})
    assert ck.read_worker_state(str(tmp_path), "learner", 0) == {"step": 3}
    with pytest.raises(FileNotFoundError, match="different number of ranks"):
        ck.read_worker_state(str(tmp_path), "learner", 1)


class _NotAllowed:
    pass


def test_safe_torch_load_refuses_pickled_objects_even_when_asked(tmp_path):
    tensors, objects = tmp_path / "t.pt", tmp_path / "o.pt"
    torch.save({"w": torch.ones(2)}, tensors)
    torch.save({"obj": _NotAllowed()}, objects)
    with ck.safe_torch_load():
        assert torch.equal(torch.load(tensors, weights_only=False)["w"], torch.ones(2))
        with pytest.raises(Exception, match="[Ww]eights only load failed"):
            torch.load(objects, weights_only=False)  # what DeepSpeed passes
    assert isinstance(torch.load(objects, weights_only=False)["obj"], _NotAllowed)  # patch undone


def test_final_path_and_commit_of_a_foreign_dir(tmp_path):
    tmp = ck.begin(tmp_path, 7)
    assert ck.final_path(tmp) == str(tmp_path / "step-00000007")
    assert ck.final_path(tmp_path / "step-00000007") == str(tmp_path / "step-00000007")
    with pytest.raises(ValueError, match="not the temporary directory"):
        ck.commit(tmp, tmp_path, 8, {}, keep=1)


def test_prune_keeps_the_one_just_written_and_leaves_corrupt_ones(tmp_path):
    for step in (5, 6):
        _save(tmp_path, step)
    (tmp_path / "step-00000006" / ck.DRIVER_STATE).write_text("{}")  # corrupt: not counted, not deleted
    final = _save(tmp_path, 3, keep=1)  # resumed from an older point: its new checkpoint survives
    names = [Path(p).name for p in ck.list_checkpoints(tmp_path)]
    assert names == ["step-00000003", "step-00000006"] and Path(final).name == "step-00000003"


def test_a_full_disk_during_a_save_names_the_path():
    """/dev/full answers every write with ENOSPC: torch.save's own error says only 'unexpected pos'."""
    with pytest.raises(SaveError) as e:
        with naming_save_errors("/dev/full"):
            torch.save({"w": torch.zeros(1 << 20)}, "/dev/full")
    assert "could not write /dev/full" in str(e.value) and "free" in str(e.value)
    with pytest.raises(SaveError, match="could not write /dev/full: the disk is full"):
        with naming_save_errors("/dev/full"):
            with open("/dev/full", "w") as f:
                f.write("x" * 100_000)
                f.flush()


def test_a_save_without_zip_crc32_loads_back_equal_and_the_option_comes_back(tmp_path):
    """torch.save inside without_zip_crc32 writes no CRC32 (each record's is 0), torch.load (as resume loads, with
    weights_only) reads the same tensors, and torch's option is as before after the block, an error included."""
    w = {"w": torch.randn(1000), "step": torch.tensor(3)}
    with ck.without_zip_crc32():
        torch.save(w, tmp_path / "a.pt")
    assert torch.serialization.get_crc32_options() is True
    with zipfile.ZipFile(tmp_path / "a.pt") as z:
        assert {info.CRC for info in z.infolist()} == {0}
    with ck.safe_torch_load():
        back = torch.load(tmp_path / "a.pt")
    assert back.keys() == w.keys() and all(torch.equal(back[k], w[k]) for k in w)
    with pytest.raises(RuntimeError, match="boom"), ck.without_zip_crc32():
        raise RuntimeError("boom")
    assert torch.serialization.get_crc32_options() is True


def test_export_refuses_a_run_dir_or_the_source_checkpoint_whatever_overwrite_says(tmp_path):
    """Issue 30 case 1: `export RUN/checkpoints/step-7 RUN --overwrite` deleted the whole run."""
    run = tmp_path / "run"
    ckpt = Path(_save(run / "checkpoints", 7))
    (run / "metrics.jsonl").write_text("{}\n")
    for target, why in ((run, "is a run dir (checkpoints, metrics.jsonl)"), (tmp_path, f"holds the run dir {run}"),
                        (ckpt, "is, holds or is inside the checkpoint"), (ckpt / "learner", "is, holds or is inside"),
                        (run / "checkpoints", "holds or is inside the checkpoint")):
        with pytest.raises(FileExistsError, match="refusing to export into") as e:
            export_checkpoint(ckpt, target, overwrite=True)
        assert why in str(e.value) and "Nothing was changed" in str(e.value) and "export-step-00000007" in str(e.value)
    assert ck.verify(ckpt) == [] and (run / "metrics.jsonl").exists()
    assert export_target_problem(run / "hf_model", ckpt) is None  # inside a run dir, not one: fine


def test_permissions_follow_the_umask_for_weights_too(tmp_path):
    """Issue 30 case 11: model.safetensors came out 0600 (safetensors writes a private temp file), the rest 0644."""
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    ck.match_umask(tmp_path)
    mask = os.umask(0)
    os.umask(mask)
    assert {oct(f.stat().st_mode & 0o777) for f in tmp_path.iterdir()} == {oct(0o666 & ~mask)}
    assert move_aside(tmp_path / "config.json").name.startswith("config.json.replaced-")
