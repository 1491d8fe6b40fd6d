"""The Ray client that drives the engines' side of a weight update: one call per engine per update.

vLLM's trainer engines (our gloo one, vLLM's nccl one) drive the engines through a client with
vLLM's four engine methods; `OneTripRayClient` answers them with one Ray call per engine
(RolloutWorker.apply_weight_update), and `PendingUpdate` is that call in flight.
"""
from __future__ import annotations

from vllm.distributed.weight_transfer.base import (  # noqa: TID253 (vLLM side)
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)
from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient  # noqa: TID253 (vLLM side)

from actors.runtime.waits import calls_not_done, get_probing
from actors.transport.nccl import engine_payloads


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
    # {name: shape} of the tensors sent: each engine then reads its fingerprint of them in the same call
    # (RolloutWorker.apply_weight_update), and `last_fingerprints` holds one report per engine.
    fingerprint_shapes: dict | None = None
    last_fingerprints: list[dict] | None = None
    timeout_s: float | None = None  # per wait on the engines (WeightSync sets the init info's timeout_s)
    pending: PendingUpdate | None = None  # the update in flight (the NCCL sender watches it: nccl_trainer.py)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        """Each engine gets its own payload (actors/transport/nccl.py engine_payloads: under NCCL its own
        rank offset; vLLM's client sends one payload to all, and every engine's first worker took rank 1)."""
        import ray

        payloads = engine_payloads(init_info, len(self.handles))
        refs = [h.init_weight_transfer_engine.remote(WeightTransferInitRequest(init_info=p))
                for h, p in zip(self.handles, payloads)]
        try:
            ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            late = [i for i, r in enumerate(refs) if r not in done]
            raise TimeoutError(f"weight-transfer init: engine(s) {late} of {len(refs)} did not join the transfer "
                               f"group in {self.timeout_s:.0f}s (trainer.actor_timeout_s)") from None

    def peer_failure(self) -> str | None:
        """Why an engine's call of the update in flight failed (its error), or None while none has."""
        return self.pending.failure() if self.pending is not None else None

    def unfinished(self) -> str | None:
        """The engines whose call of the update in flight has not returned ("engine 0, 2 of 3"), or None."""
        return self.pending.unfinished() if self.pending is not None else None

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info) -> None:
        self.submit_update_weights(update_info).join(self.timeout_s)

    def submit_update_weights(self, update_info) -> PendingUpdate:
        """Issue the update on every engine without waiting (the gloo sender calls this, then
        broadcasts on the same thread)."""
        request = WeightTransferUpdateRequest(update_info=update_info)
        self.last_fingerprints = None
        self.pending = PendingUpdate(self, [h.apply_weight_update.remote(request, self.next_version,
                                                                         self.fingerprint_shapes)
                                            for h in self.handles])
        return self.pending

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

    def failure(self) -> str | None:
        """'engine i of n: its error' for the first call that failed, None while none has (never blocks)."""
        import ray

        done, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        for i, ref in enumerate(self.refs):
            if ref in done:
                try:
                    ray.get(ref, timeout=0)
                except Exception as e:  # noqa: BLE001 - described, the caller raises
                    return f"engine {i} of {len(self.refs)}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return None

    def unfinished(self) -> str | None:
        late = [str(i) for i in calls_not_done(self.refs)]
        return f"engine {', '.join(late)} of {len(self.refs)}" if late else None

    def join(self, timeout_s: float | None) -> None:
        """The engines' answers, within `timeout_s`. Past each WAITING_LINE_EVERY_S, the engines not done yet are
        sent a probe (`info()`) by actors/runtime/waits.py get_probing, as the driver's waits on a generate are: an
        update call a healed partition caught can sit on a connection that broke without a word until Ray's
        300 s keepalive, and the probe makes it fail now. The learner's sync then fails, Ray naming the
        engine's connection, and the driver checks the engines and sends the update again
        (cluster/driver/engine_weights.py)."""
        import ray

        def probe(unfinished: list[int]) -> list:
            return [self.client.handles[i].info.remote() for i in unfinished]

        try:
            answers = get_probing(self.refs, timeout_s, probe, "an engine: a probe while it received weights")
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"weight-transfer RPC did not return in {timeout_s:.0f}s") from None
        reports = [a.pop("fingerprint", None) for a in answers]
        self.client.last_fingerprints = reports if reports and all(r is not None for r in reports) else None
        self.client.last_parts = answers[0]
