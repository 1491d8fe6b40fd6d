"""The optimizer DeepSpeed builds from the learner's config (learner/rank_setup.py): torch's AdamW with its
fused kernel. DeepSpeed passes `foreach=None`, which on CPU means torch's one-tensor-at-a-time loop: 0.52 s
a step for SmolLM2's 134.5M parameters, 0.066 s fused (docs/STATUS.md, "A real pretrained model")."""
from __future__ import annotations

import torch

from learner.config import LearnerConfig
from learner.rank_setup import build_ds_config


def deepspeeds_adamw(params, ds_config: dict) -> torch.optim.Optimizer:
    """What DeepSpeedEngine._configure_basic_optimizer does with an "AdamW" config, through its own code."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    optimizer_parameters = dict(ds_config["optimizer"]["params"])
    # torch_adam short-cuts before any engine state is read
    cls, kwargs = DeepSpeedEngine.get_optimizer_configuration(None, optimizer_parameters, True)
    return cls(params, **optimizer_parameters, **kwargs)


def test_the_learners_adamw_is_torchs_fused_kernel_and_steps_like_the_plain_one():
    cfg = LearnerConfig(lr=1e-2, weight_decay=0.01)
    torch.manual_seed(0)
    w = torch.randn(1000, dtype=torch.float32)
    fused_p, plain_p = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    fused = deepspeeds_adamw([fused_p], build_ds_config(cfg, world_size=1, on_gpu=False))
    plain = torch.optim.AdamW([plain_p], lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                              weight_decay=cfg.weight_decay, foreach=False)
    assert isinstance(fused, torch.optim.AdamW) and fused.defaults["fused"] is True
    for step in range(3):
        g = torch.randn(1000, generator=torch.Generator().manual_seed(step))
        fused_p.grad, plain_p.grad = g.clone(), g.clone()
        fused.step()
        plain.step()
    assert (fused_p - w).abs().max() > 1e-3  # it moved
    torch.testing.assert_close(fused_p, plain_p, rtol=0, atol=1e-6)


def test_zero3s_persistence_threshold_reaches_deepspeeds_config_and_is_checked():
    """learner.zero3_param_persistence_threshold is DeepSpeed's stage3_param_persistence_threshold (read by
    DeepSpeed's own config class), at DeepSpeed's default unless set; only ZeRO-3 gets it; below 0 is refused."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    for threshold in (None, 0):
        cfg = LearnerConfig(zero_stage=3, **({} if threshold is None else {"zero3_param_persistence_threshold": threshold}))
        zero = build_ds_config(cfg, world_size=2, on_gpu=False)["zero_optimization"]
        expected = DeepSpeedZeroConfig().param_persistence_threshold if threshold is None else threshold
        assert DeepSpeedZeroConfig(**zero).param_persistence_threshold == expected
    assert "stage3_param_persistence_threshold" not in build_ds_config(LearnerConfig(zero_stage=2), world_size=2,
                                                                       on_gpu=False)["zero_optimization"]
    assert any("learner.zero3_param_persistence_threshold" in p
               for p in LearnerConfig(zero3_param_persistence_threshold=-1).problems())


def test_zero3s_reuse_distance_is_0_by_default_reaches_deepspeeds_config_and_is_checked():
    """learner.zero3_max_reuse_distance is DeepSpeed's stage3_max_reuse_distance (read by DeepSpeed's own config
    class): 0 unless set, not DeepSpeed's 1e9, whose look-ahead over a small model's whole trace cost 31 s at a
    LoRA step (learner/config.py); only ZeRO-3 gets it; below 0 is refused."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    assert DeepSpeedZeroConfig().max_reuse_distance == 10**9  # what the default would otherwise be
    for distance in (None, 10**9):
        cfg = LearnerConfig(zero_stage=3, **({} if distance is None else {"zero3_max_reuse_distance": distance}))
        zero = build_ds_config(cfg, world_size=2, on_gpu=False)["zero_optimization"]
        assert DeepSpeedZeroConfig(**zero).max_reuse_distance == (0 if distance is None else distance)
    assert "stage3_max_reuse_distance" not in build_ds_config(LearnerConfig(zero_stage=2), world_size=2,
                                                              on_gpu=False)["zero_optimization"]
    assert any("learner.zero3_max_reuse_distance" in p for p in LearnerConfig(zero3_max_reuse_distance=-1).problems())
