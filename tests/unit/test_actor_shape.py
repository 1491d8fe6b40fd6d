"""The actors' shape (issue 60): classes of one concern each, and one base for what every actor answers.

- No class in actors/ or learner/ has over 15 methods (an AST count of the defs in its body).
- RolloutWorker, LearnerWorker, the reference and the reward-model actor inherit ActorBase
  (actors/runtime/actor_base.py) and none defines info, network or set_threads again.
- Ray still sees every remote method the driver calls on them: the parts are mixed into the actor
  classes (Ray finds an actor's remote methods on its class), checked with Ray's own inspection.
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from actors.rewards.model_actor import RewardModelActor
from actors.rollout import RolloutWorker
from actors.runtime import actor_base
from actors.runtime.actor_base import ActorBase
from learner.reference import ReferenceActor
from learner.worker import LearnerWorker

ROOT = Path(__file__).resolve().parents[2]
MAX_METHODS = 15
ACTORS = (RolloutWorker, LearnerWorker, ReferenceActor, RewardModelActor)

# Every method the driver, the transport client, the bench and the tests call on a handle (`.NAME.remote(`).
ROLLOUT_REMOTE = ("generate", "generate_multiturn", "prompt_logprobs", "sampling_params", "pipeline_start",
                  "pipeline_submit", "pipeline_take", "pipeline_stop", "init_weight_transfer_engine",
                  "shutdown_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update",
                  "apply_weight_update", "update_weight_version", "get_weight_version", "load_adapter",
                  "weight_fingerprint", "info", "network", "set_threads")
LEARNER_REMOTE = ("train_step", "lend_threads", "sequence_logprobs", "init_weight_sync", "sync_weights",
                  "full_state_dict", "adapter_state_dict", "export_hf", "save_checkpoint", "load_checkpoint",
                  "optimizer_state_bytes", "info", "network", "set_threads")


def method_counts(folder: str) -> dict[str, int]:
    """'path:Class' -> the functions defined directly in the class body (methods, properties, dunders)."""
    counts = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                defs = [b for b in node.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))]
                counts[f"{path.relative_to(ROOT)}:{node.name}"] = len(defs)
    return counts


@pytest.mark.parametrize("folder", ["actors", "learner"])
def test_no_class_in_actors_or_learner_has_over_15_methods(folder):
    counts = method_counts(folder)
    actor = {"actors": "actors/rollout.py:RolloutWorker", "learner": "learner/worker.py:LearnerWorker"}[folder]
    assert actor in counts, f"the scan of {folder}/ missed {actor}"
    over = {name: n for name, n in counts.items() if n > MAX_METHODS}
    assert not over, f"classes over {MAX_METHODS} methods (split them by concern): {over}"


@pytest.mark.parametrize("actor", ACTORS, ids=lambda c: c.__name__)
def test_every_actor_answers_info_network_and_threads_from_the_one_base(actor):
    assert issubclass(actor, ActorBase)
    for name in ("info", "network", "set_threads"):
        assert name not in vars(actor), f"{actor.__name__} defines {name} again: ActorBase answers it"
        assert getattr(actor, name) is getattr(ActorBase, name)


@pytest.mark.parametrize(("actor", "remote"), [(RolloutWorker, ROLLOUT_REMOTE), (LearnerWorker, LEARNER_REMOTE)],
                         ids=["rollout", "learner"])
def test_ray_sees_every_remote_method_of_the_actors_made_of_parts(actor, remote):
    """What Ray's ActorClassMethodMetadata.create reads: inherited methods are remote methods too."""
    from ray._private.inspect_util import is_function_or_method

    methods = dict(inspect.getmembers(actor, is_function_or_method))
    assert set(remote) <= set(methods), sorted(set(remote) - set(methods))
    own = {name for name in remote if name in vars(actor)}
    assert not own - {"__init__"}, f"the remote methods come from the parts and the base, not the class body: {own}"


class Probe(ActorBase):
    def own_info(self):
        return {"kind": "probe", "pid": -1}  # an actor's own field wins over the base's


def test_the_base_answers_info_with_the_actors_own_fields(monkeypatch):
    monkeypatch.setattr(actor_base, "node_cores", lambda: 7)
    info = Probe().info()
    assert info["kind"] == "probe" and info["pid"] == -1 and info["cores"] == 7 and info["node_id"] is None
    assert info["torch_threads"] == torch.get_num_threads() and isinstance(info["hostname"], str) and info["hostname"]


def test_set_threads_keeps_the_count_and_applies_it(monkeypatch):
    used = []
    monkeypatch.setattr(actor_base, "use_threads", used.append)
    probe = Probe()
    probe.set_threads(3)
    assert probe.threads == 3 and used == [3]


def test_network_passes_the_pinned_interface_or_none_for_the_environments(monkeypatch):
    seen = []
    monkeypatch.setattr(actor_base, "network_view", lambda towards, pinned: seen.append((towards, pinned)) or {})
    Probe().network("10.0.0.1")
    pinned = Probe()
    pinned.pinned_ifname = ""  # a learner rank that found GLOO_SOCKET_IFNAME unset before its group set it
    pinned.network("10.0.0.1")
    assert seen == [("10.0.0.1", None), ("10.0.0.1", "")]


def test_a_learner_rank_adds_its_own_fields_to_the_base_info():
    rank = SimpleNamespace(rank=1, world_size=2, device=torch.device("cpu"), cfg=SimpleNamespace(zero_stage=2, lora_rank=0),
                           init_seconds=1.5, step=4, master_addr="10.0.0.1", param_counts={"total_params": 9})
    assert LearnerWorker.own_info(rank) == {"rank": 1, "world_size": 2, "device": "cpu", "zero_stage": 2,
                                            "init_seconds": 1.5, "step": 4, "lora_rank": 0,
                                            "listen_address": "10.0.0.1", "total_params": 9}
