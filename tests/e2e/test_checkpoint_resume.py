"""Checkpoint round trip with real DeepSpeed ranks: save after step 1, run step 2; fresh ranks
load the checkpoint and run step 2 again -> the same loss, LR and weights. Also: a corrupt or
partial checkpoint is skipped by latest_complete (on copies of the round trip's checkpoint, ZeRO-2
and ZeRO-3), and both exports load in transformers."""
from __future__ import annotations

import shutil
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from learner_ranks import make_batch, on_all, start_ranks, stop

from learner import checkpoint
from learner.config import AlgoConfig, LearnerConfig
from learner.export import export_checkpoint

pytestmark = pytest.mark.timeout(900)


def _hf_weights(path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return {k: v.detach() for k, v in model.named_parameters()}


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_reproduces_the_next_step(ray_cluster, tiny_model_dir, tmp_path, stage):
    ray = ray_cluster
    # Warm-up + cosine: the LR schedule's position must survive the round trip too.
    cfg = LearnerConfig(num_ranks=2, zero_stage=stage, lr=1e-3, warmup_steps=3, lr_schedule="cosine",
                        micro_batch_size=2)
    algo = AlgoConfig()
    b1, b2 = make_batch(n=6, seed=11), make_batch(n=6, seed=12)
    root = tmp_path / "ckpt"

    ranks = start_ranks(ray, tiny_model_dir, cfg, algo, total_steps=10)
    try:
        on_all(ray, ranks, "train_step", b1)
        w1 = on_all(ray, ranks, "full_state_dict")
        tmp = checkpoint.begin(root, 1)
        ray.get([w.save_checkpoint.remote(tmp, checkpoint.LEARNER_TAG) for w in ranks])
        final = checkpoint.commit(tmp, root, 1, {"weight_version": 1, "data": {"epoch": 0, "index": 6}}, keep=2)
        m2 = on_all(ray, ranks, "train_step", b2)
        w2 = on_all(ray, ranks, "full_state_dict")
        out_live = tmp_path / "export-live"
        on_all(ray, ranks, "export_hf", str(out_live))
    finally:
        stop(ray, ranks)

    assert checkpoint.latest_complete(root) == final
    assert checkpoint.load_driver_state(final)["data"] == {"epoch": 0, "index": 6}
    # DeepSpeed's files were written without torch's per-record CRC32 (checkpoint.without_zip_crc32), and load below
    for pt in (Path(final) / checkpoint.LEARNER_TAG).glob("*.pt"):
        with zipfile.ZipFile(pt) as z:
            assert {info.CRC for info in z.infolist()} == {0}, pt

    fresh = start_ranks(ray, tiny_model_dir, cfg, algo, total_steps=10)
    try:
        ray.get([w.load_checkpoint.remote(final, checkpoint.LEARNER_TAG) for w in fresh])
        assert on_all(ray, fresh, "info")["step"] == 1
        assert _max_diff(on_all(ray, fresh, "full_state_dict"), w1) == 0.0
        m2b = on_all(ray, fresh, "train_step", b2)
        w2b = on_all(ray, fresh, "full_state_dict")
    finally:
        stop(ray, fresh)
    assert m2b["lr"] == m2["lr"] == pytest.approx(cfg.lr * 2 / 3)  # mid warm-up: restored, not restarted
    assert abs(m2b["loss"] - m2["loss"]) <= 1e-6
    assert _max_diff(w2b, w2) <= 1e-6  # Adam moments restored (a reset optimizer would differ ~lr)

    # Exports: the live one (export_hf, step 2) and the offline one (export_checkpoint, step 1).
    assert _max_diff(_hf_weights(out_live), w2) == 0.0
    out = export_checkpoint(final, tmp_path / "export-offline")
    assert _max_diff(_hf_weights(out), w1) == 0.0
    assert (Path(out) / "tokenizer.json").is_file()

    _check_corrupt_and_partial_checkpoints_are_skipped(final, tmp_path)


def _check_corrupt_and_partial_checkpoints_are_skipped(final: str, tmp_path: Path) -> None:
    """A real checkpoint (the run's above, copied: nothing needs a second DeepSpeed start for it), then a newer
    copy with a truncated optimizer file and a newer one without its COMPLETE marker: resume picks the intact
    older one, with a warning for each."""
    root = tmp_path / "ckpt-damaged"
    good = root / checkpoint.step_dir_name(1)
    shutil.copytree(final, good)
    assert checkpoint.latest_complete(root) == str(good)

    corrupt = root / checkpoint.step_dir_name(2)
    shutil.copytree(good, corrupt)
    optim = sorted((corrupt / checkpoint.LEARNER_TAG).glob("*optim_states.pt"))[0]
    optim.write_bytes(optim.read_bytes()[:-100])
    partial = root / checkpoint.step_dir_name(3)
    shutil.copytree(good, partial)
    (partial / checkpoint.MANIFEST).unlink()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert checkpoint.latest_complete(root) == str(good)
    text = " ".join(str(w.message) for w in caught)
    assert "step-00000003" in text and "COMPLETE" in text
    assert "step-00000002" in text and "optim_states.pt" in text
    with pytest.raises(ValueError, match="does not verify"):
        export_checkpoint(corrupt, tmp_path / "never")
