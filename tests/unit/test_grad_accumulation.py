"""bf16 on the learner: gradients accumulate over micro-batches in float32 (learner/rank_setup.py build_ds_config,
learner/config.py zero_stage). DeepSpeed 0.19.8 sums them in the model's dtype unless `data_types.grad_accum_dtype`
says otherwise, and bf16 keeps 8 mantissa bits: 64 micro-batches of gradient 2**-9 after one of 1.0 sum to 1.0."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from learner.config import LearnerConfig
from learner.rank_setup import build_ds_config

ROOT = Path(__file__).resolve().parents[2]


def test_a_gpu_learner_in_bf16_accumulates_gradients_in_fp32_at_every_zero_stage():
    one_rank = LearnerConfig(num_gpus=1)  # dtype auto: bfloat16 on GPU; zero_stage auto
    assert one_rank.zero_stage == 1  # stage 0 cannot accumulate in fp32 (DeepSpeed's sanity check refuses the mix)
    for cfg in (one_rank, LearnerConfig(num_gpus=1, num_ranks=2), LearnerConfig(num_gpus=1, num_ranks=8, zero_stage=3)):
        ds = build_ds_config(cfg, world_size=cfg.num_ranks, on_gpu=True)
        assert ds["bf16"] == {"enabled": True} and ds["data_types"] == {"grad_accum_dtype": "fp32"}, cfg.zero_stage
    cpu = LearnerConfig()
    assert cpu.zero_stage == 0 and "data_types" not in build_ds_config(cpu, world_size=1, on_gpu=False)  # float32


def test_bf16_at_zero_stage_0_is_refused_naming_the_key():
    text = " ".join(LearnerConfig(num_gpus=1, zero_stage=0).problems())
    assert "learner.zero_stage=0 with bfloat16 (learner.dtype=auto, on GPU)" in text and "learner.zero_stage=1" in text
    assert LearnerConfig(num_gpus=1, zero_stage=0, dtype="float32").problems() == []
    assert "learner.zero_stage=0 with bfloat16" in " ".join(LearnerConfig(dtype="bfloat16", zero_stage=0).problems())


# One process per run: DeepSpeed keeps its groups in module globals. The GPU config's dict runs on CPU (gloo): bf16
# and ZeRO are the same code there; on_gpu only pins offload buffers, which this config has none of.
ACCUMULATE = """
import json, os, sys
import torch, torch.distributed as dist, deepspeed
from deepspeed.utils import safe_get_full_grad
from learner.config import LearnerConfig
from learner.rank_setup import build_ds_config, skip_deepspeed_muon, skip_deepspeed_shm_op
from actors.runtime.sockets import free_port
skip_deepspeed_muon()
skip_deepspeed_shm_op()  # as a learner rank: DeepSpeed's shared-memory op, never used, is not compiled
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
dist.init_process_group("gloo", rank=0, world_size=1)
stage, drop_data_types = int(sys.argv[1]), sys.argv[2] == "1"
cfg = LearnerConfig(num_gpus=1, zero_stage=stage, micro_batch_size=1)
ds = build_ds_config(cfg, world_size=1, on_gpu=True)
if drop_data_types:
    ds.pop("data_types")
model = torch.nn.Linear(4, 1, bias=False).to(torch.bfloat16)
torch.nn.init.ones_(model.weight)
engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds)
xs = [torch.ones(1, 4)] + [torch.full((1, 4), 2.0 ** -9)] * 64  # d(sum(w.x))/dw = x
for i, x in enumerate(xs):
    engine.set_gradient_accumulation_boundary(i == len(xs) - 1)  # as LearnerWorker.train_step sets it
    engine.backward(engine(x.to(torch.bfloat16)).float().sum())
print("RESULT", json.dumps([str(t) for t in engine.get_data_types()] + [safe_get_full_grad(engine.module.weight)[0, 0].item()]))
"""


def accumulated(stage: int, drop_data_types: bool = False) -> list:
    done = subprocess.run([sys.executable, "-c", ACCUMULATE, str(stage), str(int(drop_data_types))], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and line, done.stderr[-3000:]
    return json.loads(line[0][len("RESULT "):])


@pytest.mark.parametrize("stage", [1, 2])
def test_64_small_micro_batch_gradients_survive_one_large_one(stage):
    assert accumulated(stage) == ["torch.bfloat16", "torch.float32", 1.0 + 64 * 2.0 ** -9]  # 1.125
    if stage == 1:  # what build_ds_config gave before: summed in bf16, every small gradient lost
        assert accumulated(stage, drop_data_types=True) == ["torch.bfloat16", "torch.bfloat16", 1.0]
