"""Send the learner's weights to the vLLM engines through vLLM's RL weight-transfer API.

The learner's half of weight transport (actors/transport/ holds both halves of every backend):
  DeepSpeedWeightSource   a vLLM `WeightSource` over the DeepSpeed model. Under ZeRO-3 each
                          parameter is a shard on every rank, so a layer group is gathered
                          at a time (a collective: all ranks iterate in lockstep, rank 0's
                          tensors are the ones sent) and never the whole model at once.
                          Under ZeRO-0/1/2 every rank holds whole parameters.
  consolidated_state_dict the same group-wise gather into a CPU state dict (export, tests).
  WeightSync              the trainer-side transfer engine of the backend the registry names
                          (actors/transport/registry.py: `gloo` on CPU, vLLM's `nccl` on GPU)
                          with a Ray client over the RolloutWorkers; `send(version)` runs one
                          full update.
  weight_transfer         what a rank sends with: WeightSync, or with LoRA in adapter mode the
                          adapter alone (actors/transport/lora_adapter.py AdapterSync).

Names: the training model is a transformers model and vLLM's `load_weights` takes HF checkpoint
names, so names pass through unchanged. With tie_word_embeddings, `named_parameters()` lists
the shared tensor once (model.embed_tokens.weight), which is what vLLM's Qwen2 loader wants: it
skips lm_head.weight as an alias of the embedding anyway.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource  # noqa: TID253 (vLLM side)
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory  # noqa: TID253 (vLLM side)

from actors.runtime.waits import REACH_ACTORS_S, reach_actors
from actors.transport.client import OneTripRayClient
from actors.transport.fingerprint import Recorder, check, verify_engines
from actors.transport.lora_adapter import AdapterSync
from actors.transport.registry import backend
from learner.config import LearnerConfig
from learner.lora import adapter_config_json, adapter_name, hf_name, merge_map, merged


def _gathered(params: list[torch.nn.Parameter], zero3: bool):
    """Context in which every parameter of `params` is whole (ZeRO-3: an all-gather on every rank)."""
    if zero3:
        import deepspeed
        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()


def full_shape(p: torch.nn.Parameter) -> tuple[int, ...]:
    """A ZeRO-3 parameter's .shape is its (flat) shard; ds_shape is the real one."""
    return tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)


class DeepSpeedWeightSource(WeightSource):
    """`(name, full tensor)` pairs of a (possibly ZeRO-3-partitioned) module, one gather group at a time.

    `is_sender`: whether this rank's tensors are used. Under ZeRO-3 the sender gets clones (the
    gathered storage is released when the group's gather ends, while a packing consumer may hold
    tensors of several groups until its buffer fills); the other ranks only take part in the gathers.
    """

    def __init__(self, module: torch.nn.Module, *, zero3: bool, is_sender: bool,
                 name_map: Callable[[str], str | None] = lambda n: n, lora_merge: dict | None = None):
        """`lora_merge`: {output name: (lora_A, lora_B, scaling)} (learner/lora.py merge_map): those
        weights are sent as W + scaling * B @ A, the adapters gathered together with their layer."""
        self._zero3, self._is_sender = zero3, is_sender
        self._merge = lora_merge or {}
        self._params: dict[str, torch.nn.Parameter] = {}
        for name, p in module.named_parameters():  # tied weights appear once
            out = name_map(name)
            if out is not None:
                self._params[out] = p
        self._meta = [ParamMeta(n, p.dtype, full_shape(p)) for n, p in self._params.items()]
        self._gathered_groups = 0  # groups of the current pass already gathered (see drain)
        self.recorder: Recorder | None = None  # the sender's fingerprint of the pass under way (verified sync)

    def metadata(self) -> list[ParamMeta]:
        return list(self._meta)

    def num_bytes(self) -> int:
        return sum(torch.Size(m.shape).numel() * torch.empty((), dtype=m.dtype).element_size() for m in self._meta)

    def iter_groups(self) -> Iterator[tuple[list[str], list[torch.Tensor]]]:
        self._gathered_groups = 0
        for names in self.groups():
            with _gathered(self._group_params(names), self._zero3):
                tensors = [self._tensor(n) for n in names]
            if self.recorder is not None and self._is_sender:
                for n, t in zip(names, tensors):
                    self.recorder.add(n, t)
            self._gathered_groups += 1
            yield names, tensors  # outside the gather: a consumer that stops here leaves none open

    def _group_params(self, names: list[str]) -> list[torch.nn.Parameter]:
        """What one group's gather takes: its parameters and the adapters merged into them."""
        extra = [t for n in names if n in self._merge for t in self._merge[n][:2]]
        return [self._params[n] for n in names] + extra

    def _tensor(self, name: str) -> torch.Tensor:
        """The tensor sent for `name`, inside its group's gather."""
        p = self._params[name]
        if name in self._merge:
            lora_a, lora_b, scaling = self._merge[name]
            return merged(p.data, lora_a.data, lora_b.data, scaling)  # a new tensor: outlives the gather
        t = p.data.detach()
        return t.clone() if self._zero3 and self._is_sender else t

    def begin_pass(self) -> None:
        """Mark the start of a transfer (drain() then knows every gather is still to come)."""
        self._gathered_groups = 0

    def drain(self) -> None:
        """Run the gathers of the current pass that the consumer did not get to.

        When the sender's transfer fails mid-stream (an engine died), the other ranks are
        waiting in the next ZeRO-3 all-gather; finishing the pass here releases them, so the
        failure surfaces on the driver instead of hanging every rank until the gloo timeout."""
        if not self._zero3:
            return
        for names in self.groups()[self._gathered_groups:]:
            with _gathered(self._group_params(names), True):
                pass
        self._gathered_groups = len(self.groups())

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for names, tensors in self.iter_groups():
            yield from zip(names, tensors)


def consolidated_state_dict(module: torch.nn.Module, *, zero3: bool, rank: int,
                            source: DeepSpeedWeightSource | None = None) -> dict[str, torch.Tensor]:
    """Whole weights as CPU tensors on rank 0 ({} elsewhere), gathered a layer group at a time.
    Every rank must call it (ZeRO-3 gathers are collective). `source`: another view of the
    module (LoRA: merged weights, or the adapters alone)."""
    source = source or DeepSpeedWeightSource(module, zero3=zero3, is_sender=rank == 0)
    out: dict[str, torch.Tensor] = {}
    for names, tensors in source.iter_groups():
        if rank == 0:
            out.update((n, t.detach().to("cpu", copy=True)) for n, t in zip(names, tensors))
    return out


def hf_source(module: torch.nn.Module, *, zero3: bool, rank: int, lora: bool) -> DeepSpeedWeightSource:
    """The model's weights under plain HF names (LoRA: adapters merged in, a layer group at a time)."""
    kw = {"name_map": hf_name, "lora_merge": merge_map(module)} if lora else {}
    return DeepSpeedWeightSource(module, zero3=zero3, is_sender=rank == 0, **kw)


def adapter_source(module: torch.nn.Module, *, zero3: bool, rank: int) -> DeepSpeedWeightSource:
    """The LoRA adapter alone, under peft's saved names (what vLLM and PeftModel load)."""
    return DeepSpeedWeightSource(module, zero3=zero3, is_sender=rank == 0, name_map=adapter_name)


class WeightSync:
    """Trainer side of the weight broadcast for one DeepSpeed engine (every rank builds one), over the
    backend that the driver's init info names (actors/transport/registry.py)."""

    def __init__(self, source: DeepSpeedWeightSource, *, rank: int, rollout_handles: list, init_info: dict):
        self.rank = rank
        self.source = source
        fields = dict(init_info)
        self.backend = backend(fields.pop("backend"))
        self.client = OneTripRayClient(list(rollout_handles))
        self.timeout_s = float(init_info.get("timeout_s", 600))
        self.client.timeout_s = self.timeout_s  # every wait on the engines bounded (init, update)
        info = self.backend.trainer_init_info(fields, rank)
        if rank == 0:  # a connection left stale by a healed partition fails here, not half-way into the init
            reach_actors(self.client.handles, min(self.timeout_s, REACH_ACTORS_S))
        # Rank 0 rendezvous with the engines here; the other ranks only keep the source.
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=self.source)
        if rank == 0:
            note = self.backend.fallback_note(self.engine)
            print(f"learner: weights go to {len(rollout_handles)} engine(s) via {self.transport()}"
                  + (f" ({note})" if note else ""), flush=True)

    def send(self, version: int) -> dict:
        """One full update: start, stream every parameter, finish + stamp `version`; then every engine's
        fingerprint is checked against what was sent (actors/transport/fingerprint.py). Every rank."""
        t0 = time.perf_counter()
        self.client.next_version = str(version)
        self.source.begin_pass()
        self.source.recorder = Recorder(version) if self.rank == 0 else None
        # The engines read their fingerprint at the end of the update call itself (no second round trip).
        self.client.fingerprint_shapes = {m.name: tuple(m.shape) for m in self.source.metadata()} if self.rank == 0 else None
        try:
            self.engine.send_weights()
        except BaseException:
            self.source.drain()  # let the other ranks out of their gathers, then report
            raise
        finally:
            expected, self.source.recorder = self.source.recorder, None
        verify_s = 0.0
        if expected is not None:
            reports = self.client.last_fingerprints
            if reports is not None and len(reports) == len(self.client.handles):
                t = time.perf_counter()
                check(expected, reports)
                verify_s = time.perf_counter() - t
            else:  # a backend whose engines were not updated through apply_weight_update: ask them now
                verify_s = verify_engines(self.client.handles, expected, adapter=False, timeout_s=self.timeout_s)
        return {"bytes": self.source.num_bytes() if self.rank == 0 else 0, "verified": self.rank == 0,
                "verify_s": verify_s,
                "seconds": time.perf_counter() - t0, "weight_version": version, "transport": self.transport(),
                "parts": {**getattr(self.engine, "last_parts", {}), **(self.client.last_parts or {})}
                if self.rank == 0 else {}}

    def transport(self) -> str:
        """How the bytes travel: the backend's name, or for gloo "shared_memory" when every engine is
        on this machine (actors/transport/shared_memory.py)."""
        return self.backend.transport(self.engine)

    def shutdown(self) -> None:
        try:
            self.engine.shutdown()
        except Exception:  # a dead peer (restarted rollout worker) must not block rebuilding
            pass


def weight_transfer(module: torch.nn.Module, cfg: LearnerConfig, *, rank: int, model_path: str, rollout_handles: list,
                    init_info: dict) -> WeightSync | AdapterSync:
    """What this rank sends the weights with (every rank builds one): with LoRA in adapter mode only
    the adapter, through Ray; else the whole model (LoRA: merged) through the registry's backend."""
    zero3 = cfg.zero_stage == 3
    if cfg.lora and cfg.lora_sync == "adapter":
        source = adapter_source(module, zero3=zero3, rank=rank)
        return AdapterSync(lambda: consolidated_state_dict(module, zero3=zero3, rank=rank, source=source), rank=rank,
                           rollout_handles=rollout_handles, timeout_s=init_info.get("timeout_s", 600),
                           config_json=adapter_config_json(module, model_path))
    return WeightSync(hf_source(module, zero3=zero3, rank=rank, lora=cfg.lora), rank=rank,
                      rollout_handles=rollout_handles, init_info=init_info)
