"""GPU layouts that NCCL, vLLM or Ray refuse at start are refused when the config is read, each naming its key
(cluster/launch/gpu_layout.py), and the layouts that can start pass. No GPU needed: the rules read the config."""
from __future__ import annotations

import pytest

from cluster.cli import main
from cluster.config import ConfigError, load_config

# Whole GPUs everywhere, split placement: the layout every rule below breaks one way (examples/multinode.yaml's shape)
GPU_RUN = ["rollout.num_gpus=1", "rollout.num_workers=2", "learner.num_gpus=1", "learner.num_ranks=2",
           "trainer.prompts_per_step=8"]


def problems(*overrides: str) -> list[str]:
    try:
        load_config(None, [*GPU_RUN, *overrides], validate_paths=False)
    except ConfigError as e:
        return e.problems
    return []


def only_problem(*overrides: str) -> str:
    found = problems(*overrides)
    assert len(found) == 1, found
    return found[0]


def test_a_gpu_layout_that_can_start_passes():
    assert problems() == []
    assert problems("rollout.num_gpus=2", "rollout.tensor_parallel_size=2") == []
    assert problems("learner.num_gpus=0.5", "learner.num_ranks=1", "trainer.prompts_per_step=8") == []  # alone in its groups
    # one GPU, colocated, the weights through host memory (examples/single_gpu.yaml)
    assert problems("ray.placement=colocate", "rollout.num_gpus=0.4", "rollout.num_workers=1", "learner.num_gpus=0.5",
                    "learner.num_ranks=1", "rollout.weight_transfer_backend=gloo") == []
    assert load_config(None, ["ray.placement=colocate"], validate_paths=False)  # CPU: every default layout stands


def test_tensor_parallel_larger_than_the_engines_gpus():
    text = only_problem("rollout.tensor_parallel_size=2")
    assert text.startswith("rollout.tensor_parallel_size (2) > rollout.num_gpus (1)") and "rollout.num_gpus to" in text


def test_colocate_with_nccl_names_the_split_placement():
    text = only_problem("ray.placement=colocate")
    assert text.startswith("ray.placement=colocate with rollout.weight_transfer_backend=auto (nccl")
    assert "NCCL refuses two ranks of one communicator on the same device" in text
    assert "ray.placement=separate" in text and "rollout.weight_transfer_backend=gloo" in text


def test_colocate_with_tensor_parallel():
    found = problems("ray.placement=colocate", "rollout.num_gpus=2", "rollout.tensor_parallel_size=2",
                     "rollout.weight_transfer_backend=gloo")
    assert len(found) == 1 and found[0].startswith("ray.placement=colocate with rollout.tensor_parallel_size=2"), found


def test_learners_on_cpu_with_engines_on_gpu_resolving_to_nccl():
    text = only_problem("learner.num_gpus=0")
    assert text.startswith("learner.num_gpus=0 (learner ranks on CPU) with rollout.weight_transfer_backend=auto (nccl")
    assert "rollout.weight_transfer_backend=gloo" in text
    assert problems("learner.num_gpus=0", "rollout.weight_transfer_backend=gloo") == []


def test_nccl_named_for_engines_on_cpu():
    text = only_problem("rollout.num_gpus=0", "rollout.weight_transfer_backend=nccl")
    assert text.startswith("rollout.weight_transfer_backend=nccl needs engines on GPUs (rollout.num_gpus > 0)")


@pytest.mark.parametrize("overrides, key", [
    (["rollout.num_gpus=0.5"], "rollout.num_gpus=0.5 x 2 engine(s)"),  # two engines may share a GPU
    (["rollout.num_gpus=0.5", "rollout.num_workers=1", "learner.num_gpus=0.5", "learner.num_ranks=1"],
     "learner.num_gpus=0.5 and rollout.num_gpus=0.5 x 1 engine(s)"),  # the sender and an engine may share one
])
def test_two_ranks_of_the_weight_transfer_group_that_may_share_a_gpu(overrides, key):
    text = only_problem(*overrides)
    assert text.startswith(key) and "Ray may pack two" in text and "NCCL refuses" in text


def test_two_learner_ranks_that_may_share_a_gpu():
    text = only_problem("learner.num_gpus=0.5", "rollout.num_workers=1")  # rank 0's fraction alone is fine for the transfer
    assert text.startswith("learner.num_gpus=0.5 with learner.num_ranks=2") and "learner.num_gpus: 1" in text


def test_reference_auto_never_puts_a_gpu_runs_model_on_cpu_in_silence():
    text = only_problem("algo.beta=0.01")
    assert text.startswith("reference.placement=auto with algo.beta=0.01 and the learner on GPU")
    assert "reference.num_gpus=0 would run that model on CPU" in text and "reference.placement=learner" in text
    assert problems("algo.beta=0.01", "reference.num_gpus=1") == []
    assert problems("algo.beta=0.01", "reference.placement=learner") == []
    assert problems("algo.beta=0.01", "reference.placement=actor") == []  # on CPU on purpose
    assert load_config(None, ["algo.beta=0.01", "trainer.mode=async"], validate_paths=False)  # CPU run: the actor on CPU


def test_raygrpo_data_refuses_a_layout_with_exit_2_naming_the_key(tmp_path, tiny_chat_model_dir, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{path: {tiny_chat_model_dir}}}\ntrainer: {{run_dir: {tmp_path / 'run'}}}\n"
                   "rollout: {num_gpus: 1}\nlearner: {num_gpus: 1}\n")
    assert main(["data", str(cfg), "ray.placement=colocate"]) == 2
    err = capsys.readouterr().err
    assert "ray.placement=colocate with rollout.weight_transfer_backend=auto (nccl" in err and "Traceback" not in err
    assert main(["train", str(cfg), "rollout.tensor_parallel_size=4"]) == 2
    err = capsys.readouterr().err
    assert "rollout.tensor_parallel_size (4) > rollout.num_gpus (1)" in err
    assert not (tmp_path / "run").exists()  # nothing started, nothing written
