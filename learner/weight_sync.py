"""Send the learner's weights to the vLLM engines through vLLM's RL weight-transfer API.

Three parts:
  DeepSpeedWeightSource   a vLLM `WeightSource` over the DeepSpeed model. Under ZeRO-3 each
                          parameter is a shard on every rank, so a layer group is gathered
                          at a time (a collective: all ranks iterate in lockstep, rank 0's
                          tensors are the ones sent) and never the whole model at once.
                          Under ZeRO-0/1/2 every rank holds whole parameters.
  WeightSync              the trainer-side transfer engine (`gloo` on CPU from
                          actors/transport/gloo_trainer.py, vLLM's `nccl` on GPU) with a Ray client
                          over the RolloutWorkers; `send(version)` runs one full update.
  consolidated_state_dict the same group-wise gather into a CPU state dict (export, tests).

Names: the training model is a transformers model and vLLM's `load_weights` takes HF checkpoint
names, so names pass through unchanged. With tie_word_embeddings, `named_parameters()` lists
the shared tensor once (model.embed_tokens.weight), which is what vLLM's Qwen2 loader wants: it
skips lm_head.weight as an alias of the embedding anyway.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient


def _gathered(params: list[torch.nn.Parameter], zero3: bool):
    """Context in which every parameter of `params` is whole (ZeRO-3: an all-gather on every rank)."""
    if zero3:
        import deepspeed
        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    import contextlib
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

    def metadata(self) -> list[ParamMeta]:
        return list(self._meta)

    def num_bytes(self) -> int:
        return sum(torch.Size(m.shape).numel() * torch.empty((), dtype=m.dtype).element_size() for m in self._meta)

    def iter_groups(self) -> Iterator[tuple[list[str], list[torch.Tensor]]]:
        self._gathered_groups = 0
        for names in self.groups():
            with _gathered(self._group_params(names), self._zero3):
                tensors = [self._tensor(n) for n in names]
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
            from learner.lora import merged
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


class OneTripRayClient(RayVLLMWeightSyncClient):
    """The engines' side of an update in ONE Ray call per engine (RolloutWorker.apply_weight_update)
    instead of vLLM's four in a row (start, update, finish, then the version): about 3 ms of a
    24 ms update of the 1.0M bench model (docs/benchmarks.md, weight-sync parts).

    vLLM's trainer engines (our gloo one and vLLM's nccl one) call start -> update (beside their
    broadcast) -> finish; here start and finish do nothing and `update_weights` runs the whole
    update on every engine, stamping `next_version`. `last_parts` holds engine 0's timings.
    """

    next_version: str = "0"
    last_parts: dict | None = None

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info) -> None:
        self.submit_update_weights(update_info).join(None)

    def submit_update_weights(self, update_info) -> PendingUpdate:
        """Issue the update on every engine without waiting (the gloo sender calls this, then
        broadcasts on the same thread)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        request = WeightTransferUpdateRequest(update_info=update_info)
        return PendingUpdate(self, [h.apply_weight_update.remote(request, self.next_version) for h in self.handles])

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass


class PendingUpdate:
    """The engines' update calls in flight: what the gloo sender polls while it broadcasts."""

    def __init__(self, client: OneTripRayClient, refs: list):
        self.client, self.refs = client, refs

    def raise_if_failed(self) -> None:
        """Raise an engine's error as soon as its call failed (a finished call is checked)."""
        import ray

        done, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        if done:
            ray.get(done)

    def join(self, timeout_s: float | None) -> None:
        import ray

        try:
            self.client.last_parts = ray.get(self.refs, timeout=timeout_s)[0]
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"weight-transfer RPC did not return in {timeout_s:.0f}s") from None


def trainer_init_info(init_info: dict, rank: int):
    """The backend's TrainerInitInfo from the driver's plain dict ({"backend": ..., backend fields})."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    fields = dict(init_info)
    backend = fields.pop("backend")
    if backend == "gloo":
        import actors.transport.gloo_trainer  # noqa: F401  (registers the CPU backend with vLLM's factories)
    registry = WeightTransferTrainerFactory._registry  # no public lookup of a backend's classes
    if backend not in registry:
        raise ValueError(f"unknown weight-transfer backend {backend!r}; registered: {sorted(registry)}")
    return registry[backend]().init_info_cls(**fields, rank=rank)


class WeightSync:
    """Trainer side of the weight broadcast for one DeepSpeed engine (every rank builds one)."""

    def __init__(self, source: DeepSpeedWeightSource, *, rank: int, rollout_handles: list, init_info: dict):
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        self.rank = rank
        self.source = source
        self.backend = init_info["backend"]
        self.client = OneTripRayClient(list(rollout_handles))
        info = trainer_init_info(init_info, rank)
        # Rank 0 rendezvous with the engines here; the other ranks only keep the source.
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=self.source)
        from actors.transport.gloo_trainer import GlooTrainerWeightTransferEngine

        self._gloo = self.engine if isinstance(self.engine, GlooTrainerWeightTransferEngine) else None
        if rank == 0:
            # gloo: why an engine could not map the shared-memory segment (then the bytes are broadcast)
            refused = self._gloo.refused if self._gloo is not None else []
            print(f"learner: weights go to {len(rollout_handles)} engine(s) via {self.transport()}"
                  + (f" (no shared memory: {'; '.join(refused)})" if refused else ""), flush=True)

    def send(self, version: int) -> dict:
        """One full update: start, stream every parameter, finish + stamp `version`. Every rank."""
        t0 = time.perf_counter()
        self.client.next_version = str(version)
        self.source.begin_pass()
        try:
            self.engine.send_weights()
        except BaseException:
            self.source.drain()  # let the other ranks out of their gathers, then report
            raise
        return {"bytes": self.source.num_bytes() if self.rank == 0 else 0,
                "seconds": time.perf_counter() - t0, "weight_version": version, "transport": self.transport(),
                "parts": {**getattr(self.engine, "last_parts", {}), **(self.client.last_parts or {})}
                if self.rank == 0 else {}}

    def transport(self) -> str:
        """How the bytes travel: vLLM's backend name, or for gloo "shared_memory" when every engine
        is on this machine (actors/transport/shared_memory.py)."""
        return self._gloo.transport() if self._gloo is not None else self.backend

    def shutdown(self) -> None:
        try:
            self.engine.shutdown()
        except Exception:  # a dead peer (restarted rollout worker) must not block rebuilding
            pass


class AdapterSync:
    """Adapter-mode LoRA sync: only the adapter travels, through Ray (no shared filesystem, no
    transfer group). Every rank takes part in the gathers (ZeRO-3); rank 0 puts the tensors in
    the object store once and has every engine load them (RolloutWorker.load_adapter)."""

    def __init__(self, module: torch.nn.Module, *, rank: int, zero3: bool, rollout_handles: list,
                 config_json: str, timeout_s: float):
        from learner.lora import adapter_name
        self.rank, self.handles, self.config_json, self.timeout_s = rank, list(rollout_handles), config_json, timeout_s
        self.source = DeepSpeedWeightSource(module, zero3=zero3, is_sender=rank == 0, name_map=adapter_name)
        self.module, self.zero3 = module, zero3

    def send(self, version: int) -> dict:
        import ray
        t0 = time.perf_counter()
        tensors = consolidated_state_dict(self.module, zero3=self.zero3, rank=self.rank, source=self.source)
        if self.rank != 0:
            return {"bytes": 0, "seconds": time.perf_counter() - t0, "weight_version": version}
        ref = ray.put(tensors)
        ray.get([h.load_adapter.remote(ref, self.config_json, version) for h in self.handles], timeout=self.timeout_s)
        return {"bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
                "seconds": time.perf_counter() - t0, "weight_version": version}

    def shutdown(self) -> None:
        pass
