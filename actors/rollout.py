"""RolloutWorker: one vLLM engine that samples G completions per prompt, with behaviour log-probs.

A plain class: the driver (and the tests) wrap it with `ray.remote(...)`. Ray runs an actor's
calls one at a time, so a weight update never lands in the middle of a `generate`.

The engine is `vllm.LLM`, which carries vLLM's RL weight-update API; this class exposes that
API under the same names, and `apply_weight_update` runs a whole update in one call, which the
learner's client drives (actors/transport/client.py; the backends are in actors/transport/).
What generate returns is in actors/completions.py.

On CPU the engine core runs in the actor by default (`VLLM_ENABLE_V1_MULTIPROCESSING=0`,
rollout.engine_core=auto): vLLM's default would add an engine-core process per engine, which on a
2-core machine costs memory and context switches for nothing. On GPU it runs in its own process
(vLLM's default); rollout.engine_core=process gives a CPU engine that layout too. vLLM loads our
general plugin (actors/transport/vllm_plugin.py) in whichever process builds the model.
"""
from __future__ import annotations

import contextlib
import copy
import os
import socket
import time

import torch

from actors.completions import PromptRollout, completion_from_vllm, stop_token_ids
from actors.config import RolloutConfig
from actors.multiturn.env_pool import EnvPool
from actors.multiturn.trajectories import ChatTokens, run_trajectories
from actors.pipeline import EngineLoop, paused
from actors.runtime.devices import eager_cpu_engine_env, on_gpu, resolve_dtype, resolve_enforce_eager
from actors.runtime.sockets import network_view
from actors.runtime.start_ledger import ENGINE, record_start
from actors.runtime.start_up import starts_with_few_full_collections
from actors.runtime.threads import node_cores, use_threads
from actors.transport.base import LAST_UPDATE_PARTS
from actors.transport.fingerprint import WORKER_EXTENSION
from actors.transport.lora_adapter import EngineAdapter
from actors.transport.registry import backend, resolve_backend
from actors.transport.vllm_plugin import PACK_ABOVE_ENV
from actors.update_hold import UpdateHold

CPU_PREFILL_BUDGET = 4096  # tokens per engine step on CPU (vLLM's CPU default)


class RolloutWorker:
    """One vLLM engine. `worker_index` only labels it (logs, `info()`)."""

    @starts_with_few_full_collections  # its imports: actors/runtime/start_up.py
    def __init__(self, model_path: str, cfg: RolloutConfig, worker_index: int = 0, max_lora_rank: int = 0,
                 chat_template_kwargs: dict | None = None):
        """`max_lora_rank` > 0 starts the engine with vLLM's LoRA support (one adapter slot, see
        `load_adapter`); it must be a value vLLM accepts (learner/config.py VLLM_LORA_RANKS).
        `chat_template_kwargs`: how multi-turn rollouts render conversations (data.chat_template_kwargs)."""
        problems = cfg.problems()
        if problems:
            raise ValueError("invalid RolloutConfig: " + "; ".join(problems))
        record_start(ENGINE, worker_index=worker_index)  # the test suite's cost file; a no-op in a user's run
        self.cfg = cfg
        self.worker_index = worker_index
        self.model_path = str(model_path)
        gpu = on_gpu(cfg.num_gpus)
        # Before vLLM is imported: envs are read lazily, but keep it obviously first.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if cfg.engine_core_in_own_process(gpu) else "0"
        if not gpu:
            os.environ.setdefault("OMP_NUM_THREADS", str(cfg.threads or max(1, int(cfg.num_cpus))))
            os.environ[PACK_ABOVE_ENV] = str(cfg.cpu_pack_above_elements)  # read by actors/transport/vllm_plugin.py
            for k, v in eager_cpu_engine_env(cfg.enforce_eager, gpu).items():  # read where vLLM decorates
                os.environ.setdefault(k, v)
        # Until the driver's thread budget arrives (set_threads); vLLM's CPU worker turns
        # torch.set_num_threads into a no-op once it starts, use_threads goes around that.
        self._threads = cfg.threads or (0 if gpu else int(os.environ["OMP_NUM_THREADS"]))
        use_threads(self._threads)
        from vllm import LLM

        kwargs = {}
        if not gpu and cfg.cpu_kv_cache_mb > 0:
            kwargs["kv_cache_memory_bytes"] = cfg.cpu_kv_cache_mb * 1024 * 1024
        if not gpu:
            # vLLM 0.32 CPU: a seeded request whose prefill is split across steps crashes the engine
            # ("CPU Generator does not use offset": the runner rewinds a generator that CPU torch
            # cannot rewind). Whole prefills only: a prompt that does not fit waits for the next step.
            kwargs |= {"enable_chunked_prefill": False, "max_num_batched_tokens": max(CPU_PREFILL_BUDGET, cfg.max_model_len)}
        if max_lora_rank > 0:
            kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
        t0 = time.perf_counter()
        self.llm = LLM(
            model=self.model_path,
            dtype=resolve_dtype(cfg.dtype, gpu),
            max_model_len=cfg.max_model_len,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            seed=cfg.seed,
            enforce_eager=resolve_enforce_eager(cfg.enforce_eager, gpu),
            tensor_parallel_size=cfg.tensor_parallel_size,
            logprobs_mode=cfg.logprobs_mode,
            weight_transfer_config=backend(resolve_backend(cfg.weight_transfer_backend, cfg.num_gpus)).engine_config(),
            worker_extension_cls=WORKER_EXTENSION,  # weight_fingerprint reads the weights inside every worker
            **kwargs,
        )
        self._adapter = EngineAdapter(self.llm)  # LoRA adapters from the learner (adapter-mode sync)
        self._hold = UpdateHold(self.llm)  # pipeline mode: no engine step from start to finish of an update
        self.tokenizer = self.llm.get_tokenizer()
        self.stop_token_ids = stop_token_ids(self.model_path, self.tokenizer.eos_token_id)
        self._warm_up()
        self.start_seconds = time.perf_counter() - t0
        self._version = 0
        self._updating = False
        self.llm.update_weight_version("0")  # vLLM's own default is the string "default"
        self._chat = self._envs = None
        self._loop: EngineLoop | None = None  # trainer.mode=pipeline: the engine runs on (pipeline_start)
        if cfg.env:  # multi-turn: refuse a non-prefix-preserving template now, start the environment processes
            self._chat = ChatTokens(self.tokenizer, chat_template_kwargs)
            self._envs = EnvPool(cfg.env, cfg.env_num_procs, cfg.env_timeout_s)
            self._env_keys = 0

    def _warm_up(self) -> None:
        """The first seeded sampling call pays a one-off ~3 s (sampler set-up); pay it at start so
        the first training step's timing is not an outlier. One token of context: no prefix
        cache block fills, nothing leaks into later requests."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        token = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        self.llm.generate([TokensPrompt(prompt_token_ids=[token])],
                          SamplingParams(n=2, max_tokens=2, seed=0, logprobs=0), use_tqdm=False)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[list[int]] | list[str], group_size: int, seeds: list[int] | None = None,
                 greedy: bool = False, max_new_tokens: int | None = None) -> list[PromptRollout]:
        """`group_size` completions for each prompt, all prompts in one engine call.

        A prompt is its token ids, sent to the engine as they are (the driver renders and
        tokenizes every prompt once, at load time, with the model's chat template); a string
        (tools, benchmarks) is encoded with the engine's tokenizer. Generation stops at the
        tokenizer's EOS and every `eos_token_id` of the model's generation_config.json. A
        completion's text is the decode of its ids (special tokens skipped); only with
        `rollout.stop` strings is it vLLM's streaming text, cut at the stop string.

        One request per prompt with n=group_size, so the G samples share the prompt's KV cache.
        `seeds[i]` seeds prompt i's request (reproducible across restarts and resumes);
        `greedy` samples at temperature 0 (evaluation; one engine sample, repeated to fill the
        group, since vLLM allows n=1 only there). A prompt with no room for
        `max_new_tokens` is skipped and reported (`cfg.long_prompt="skip"`) or raises
        ValueError (`"error"`); it is never sent to the engine.
        """
        from vllm.inputs import TokensPrompt

        cfg = self.cfg
        self._check_not_updating()
        use_threads(self._threads)
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts")
        max_new = cfg.max_new_tokens if max_new_tokens is None else max_new_tokens
        limit = cfg.max_model_len - max_new
        if limit < 1:
            raise ValueError(f"max_new_tokens {max_new} leaves no room for a prompt (max_model_len {cfg.max_model_len})")

        detokenize = bool(cfg.stop)  # else the text is decoded here, once (sampling_params)
        rollouts, requests, params, slots = [], [], [], []
        for i, prompt in enumerate(prompts):
            ids = list(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else [int(t) for t in prompt]
            problem = None
            if not ids:
                problem = "prompt is empty after tokenization"
            elif len(ids) > limit:
                problem = (f"prompt is {len(ids)} tokens, limit {limit} "
                           f"(max_model_len {cfg.max_model_len} - max_new_tokens {max_new})")
            if problem is not None and cfg.long_prompt == "error":
                raise ValueError(f"prompt {i}: {problem}")
            rollouts.append(PromptRollout(prompt, ids, [], self._version, skipped=problem))
            if problem is None:
                requests.append(TokensPrompt(prompt_token_ids=ids))
                params.append(self.sampling_params(group_size, max_new, None if seeds is None else seeds[i], greedy))
                slots.append(i)
        if requests:
            with self._loop_idle("generate"):
                outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self._adapter.request)
            texts = None if detokenize else iter(self.tokenizer.batch_decode(
                [c.token_ids for out in outputs for c in out.outputs], skip_special_tokens=True))
            for i, out in zip(slots, outputs):
                rollouts[i].prompt_ids = list(out.prompt_token_ids)  # what the engine itself saw (== the ids sent)
                completions = [completion_from_vllm(c, None if texts is None else next(texts)) for c in out.outputs]
                if greedy:  # G identical samples: copies of the one greedy completion
                    completions = [copy.deepcopy(completions[0]) for _ in range(group_size)]
                rollouts[i].completions = completions
        return rollouts

    def generate_multiturn(self, conversations: list[list[dict]], fields: list[dict], group_size: int,
                           seeds: list[int] | None = None, greedy: bool = False) -> list:
        """`group_size` multi-turn trajectories per conversation (a list of chat messages), driven
        turn by turn with `cfg.env` answering each turn; `fields[i]` build conversation i's
        environments. Returns one actors.multiturn.trajectories.MultiTurnRollout per conversation."""
        self._check_not_updating()
        use_threads(self._threads)
        if self._envs is None:
            raise RuntimeError("generate_multiturn needs rollout.env (an environment) set when the worker starts")
        if len(fields) != len(conversations) or (seeds is not None and len(seeds) != len(conversations)):
            raise ValueError(f"{len(conversations)} conversations, {len(fields)} fields, "
                             f"{None if seeds is None else len(seeds)} seeds")

        def next_key():
            self._env_keys += 1
            return self._env_keys

        return run_trajectories(lambda requests: self._sample_turns(requests, greedy), self._chat, self._envs,
                                self.cfg, conversations, fields, group_size, seeds, self._version, next_key)

    def _sample_turns(self, requests: list[tuple], greedy: bool) -> list[tuple]:
        """One engine call for the next turn of every live trajectory: (context ids, max_tokens, seed) ->
        (sampled ids, their behaviour log-probs, finish reason)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        cfg = self.cfg
        params = [SamplingParams(
            n=1, temperature=0.0 if greedy else cfg.temperature, top_p=cfg.top_p,
            top_k=cfg.top_k if cfg.top_k > 0 else 0, max_tokens=max_tokens,
            # A turn ends at the template's end-of-turn token and only there: ignore_eos keeps vLLM from
            # adding generation_config's other eos ids (e.g. <|endoftext|>) as stops.
            ignore_eos=True, stop_token_ids=[self._chat.eos], logprobs=0, seed=seed)
            for _, max_tokens, seed in requests]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids, _, _ in requests], params,
                                    use_tqdm=False)
        out = []
        for o in outputs:
            c = completion_from_vllm(o.outputs[0])  # checks log-probs and finish reason
            out.append((c.token_ids, c.logprobs, c.finish_reason))
        return out

    def sampling_params(self, group_size: int, max_new: int, seed: int | None, greedy: bool = False):
        """One prompt's request of `generate` (also what the bench's direct-vLLM baseline sends)."""
        from vllm import SamplingParams

        cfg = self.cfg
        return SamplingParams(
            n=1 if greedy else group_size,  # vLLM refuses n > 1 at temperature 0
            temperature=0.0 if greedy else cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k if cfg.top_k > 0 else 0,
            max_tokens=max_new,
            # no EOS / stop token before min_tokens (sampling only; a shorter max_new caps it)
            min_tokens=0 if greedy else min(cfg.min_new_tokens, max_new),
            stop=list(cfg.stop) or None,
            stop_token_ids=self.stop_token_ids,
            skip_special_tokens=True,
            logprobs=0,  # just the sampled token's log-prob
            flat_logprobs=True,  # flat arrays, not a dict per token: less to build and collect
            # vLLM detokenizes every sequence at every step, and decodes each log-prob token against
            # its context: about a fifth of a short-completion call on CPU. Without stop strings
            # (which need the text as it grows) `generate` decodes the final ids once instead.
            detokenize=bool(cfg.stop),
            seed=None if seed is None else int(seed),
        )

    # ------------------------------------------------------------------ pipeline mode (actors/pipeline.py)
    def pipeline_start(self) -> None:
        """From now on the engine runs continuously: groups go in with pipeline_submit and come back
        finished from pipeline_take. Evaluation (generate) is possible while no group is in flight."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if self._loop is not None:
            return
        if self.cfg.stop or self._envs is not None:
            raise ValueError("trainer.mode=pipeline supports single-turn rollouts without rollout.stop strings")
        cfg = self.cfg

        def params():
            return SamplingParams(
                n=1, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k if cfg.top_k > 0 else 0,
                max_tokens=cfg.max_new_tokens, min_tokens=min(cfg.min_new_tokens, cfg.max_new_tokens),
                stop_token_ids=self.stop_token_ids, skip_special_tokens=True, logprobs=0, detokenize=False,
                output_kind=RequestOutputKind.DELTA)  # each step's new tokens, to stamp with their version

        self._loop = EngineLoop(self.llm, params, lambda ids: self.tokenizer.batch_decode(ids, skip_special_tokens=True),
                                lambda: self._version, cfg.kv_after_update, lambda: self._threads,
                                lora_request=self._adapter.request)

    def pipeline_submit(self, groups: list[tuple[int, list[int], int]]) -> dict:
        """groups: (key, prompt ids, G). Returns the groups in flight here and this process's pid (an
        engine Ray restarted starts its loop on the first call, and the driver sees the new pid)."""
        limit = self.cfg.max_model_len - self.cfg.max_new_tokens
        for key, ids, _ in groups:
            if not 0 < len(ids) <= limit:
                raise ValueError(f"group {key}: prompt of {len(ids)} tokens, limit {limit}")
        self.pipeline_start()
        self._loop.submit(groups)
        return {"in_flight": self._loop.in_flight(), "pid": os.getpid()}

    def pipeline_take(self) -> dict:
        """The groups finished since the last call (PromptRollout, `prompt` = the group's key, every
        completion with per-token `versions`) and the engine's counters (actors/pipeline.py stats)."""
        self.pipeline_start()
        loop = self._loop
        return {"rollouts": loop.take(), "stats": loop.stats(), "in_flight": loop.in_flight(),
                "weight_version": self._version, "pid": os.getpid()}

    def pipeline_stop(self) -> list[int]:
        """Abort the groups in flight and stop the loop; returns their keys (to submit again elsewhere)."""
        if self._loop is None:
            return []
        keys, self._loop = self._loop.stop(), None
        return keys

    @contextlib.contextmanager
    def _loop_idle(self, what: str):
        """`LLM.generate` steps the whole engine: with the pipeline's groups in it, it would step (and
        swallow) them too. So it runs paused, and only with none in flight."""
        with paused(self._loop):
            if self._loop is not None and self._loop.in_flight():
                raise RuntimeError(f"{what} while pipeline groups are in flight on this engine: stop the pipeline first")
            yield

    def _check_not_updating(self) -> None:
        if self._updating:
            raise RuntimeError("a weight update is in progress on this engine (start_weight_update without "
                               "finish_weight_update): generation must wait for finish_weight_update")

    def prompt_logprobs(self, token_ids: list[list[int]]) -> list[list[float]]:
        """vLLM's log-prob of each token given the ones before it (positions 1..L-1), computed
        by the engine's own forward: the check that synced weights really arrived."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._check_not_updating()
        use_threads(self._threads)
        for i, ids in enumerate(token_ids):
            if not 2 <= len(ids) < self.cfg.max_model_len:
                raise ValueError(f"sequence {i} has {len(ids)} tokens; need 2..{self.cfg.max_model_len - 1}")
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        with self._loop_idle("prompt_logprobs"):
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in token_ids],
                                        params, use_tqdm=False, lora_request=self._adapter.request)
        return [[float(step[tok].logprob) for tok, step in zip(ids[1:], out.prompt_logprobs[1:])]
                for ids, out in zip(token_ids, outputs)]

    # ------------------------------------------------------------------ vLLM's RL weight-update API
    # Between start_weight_update and finish_weight_update the engine holds a mix of old and new
    # weights (and on CPU the packed copies are still the old ones), so generating there would
    # sample from no real policy: `_updating` makes that an error instead.

    def init_weight_transfer_engine(self, request) -> None:
        if self._updating:
            # A trainer died mid-update; vLLM would refuse the next start_weight_update. Close the
            # stale update (a full sync follows this init) before joining the new group.
            try:
                self.llm.finish_weight_update()
            except Exception:  # noqa: BLE001 - the state is being replaced anyway
                pass
            # The hold stays: the weights are half loaded until the full sync that follows finishes.
            self._updating = False
        with paused(self._loop):
            self.llm.init_weight_transfer_engine(request)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def start_weight_update(self) -> None:
        """Pipeline mode: the engine held between two steps first (actors/update_hold.py), running requests
        kept; finish_weight_update, or a failed update, lets it go on."""
        if not self._updating:
            self._hold.hold(self._loop)
        try:
            self.llm.start_weight_update()
        except BaseException:
            self._hold.release()
            raise
        self._updating = True

    def set_threads(self, n: int) -> None:
        """The torch threads this engine computes with from now on (the driver's thread budget)."""
        self._threads = n
        use_threads(n)

    def update_weights(self, request) -> None:
        use_threads(self._threads)
        try:
            self.llm.update_weights(request)
        except BaseException:
            self._updating = False  # vLLM's worker ends the update on a failed chunk, too
            self._hold.release()
            raise

    def finish_weight_update(self, weight_version: int | str | None = None) -> dict:
        """End an update (the gloo engine re-packs vLLM's CPU layers), drop the cached prefixes and
        stamp `weight_version`; returns the seconds of those parts."""
        t0 = time.perf_counter()
        try:
            self.llm.finish_weight_update()
            self._updating = False
            t1 = time.perf_counter()
            loop = {}
            if self._loop is not None:  # requests are running: the rollout.kv_after_update choice
                loop = self._loop.after_update()
            # Cached prefixes hold K/V computed by the old weights.
            elif not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM could not reset its prefix cache after a weight update")
            if weight_version is not None:
                self.update_weight_version(weight_version)
        finally:
            self._updating = False
            self._hold.release()
        return {"engine_finish_s": t1 - t0, "prefix_reset_and_version_s": time.perf_counter() - t1, **loop}

    def apply_weight_update(self, request, weight_version: int | str, fingerprint_shapes: dict | None = None) -> dict:
        """A whole weight update in one call (one round trip from the sender instead of four):
        start, receive and load every bucket (the sender broadcasts meanwhile), finish (CPU re-pack,
        prefix-cache reset) and stamp `weight_version`. Returns the seconds of its parts and, given
        `fingerprint_shapes`, under "fingerprint" what `weight_fingerprint` would answer right after
        (the weights as they are now, read the same way), sparing the verified sync a second call."""
        LAST_UPDATE_PARTS.clear()
        t0 = time.perf_counter()
        self.start_weight_update()
        self.update_weights(request)
        t1 = time.perf_counter()
        finish = self.finish_weight_update(weight_version)
        out = {"engine_update_s": t1 - t0, **LAST_UPDATE_PARTS, **finish}
        if fingerprint_shapes is not None:
            t2 = time.perf_counter()
            out["fingerprint"] = self.weight_fingerprint(fingerprint_shapes, int(weight_version))
            out["engine_fingerprint_s"] = time.perf_counter() - t2
        return {**out, "engine_total_s": time.perf_counter() - t0}

    def update_weight_version(self, version: int | str) -> None:
        """The learner's step the weights came from (vLLM keeps it as a string, and labels the outputs of
        every step from now on with it). With the loop paused: a core in its own process is reached through
        one ZMQ socket, which the loop's thread also sends on, and a ZMQ socket is not thread-safe."""
        self._version = int(version)
        with paused(self._loop):
            self.llm.update_weight_version(str(self._version))

    def get_weight_version(self) -> str:
        with paused(self._loop):  # as update_weight_version
            return self.llm.get_weight_version()

    # ------------------------------------------------------------------ LoRA adapters (adapter-mode sync)
    def load_adapter(self, tensors: dict, adapter_config: str, version: int) -> dict:
        """Serve the learner's LoRA adapter from now on: `tensors` are peft-named adapter weights,
        `adapter_config` the text of peft's adapter_config.json. They arrive through Ray (no shared
        filesystem); actors/transport/lora_adapter.py writes them to this engine's own temp dir and
        loads them in place under one adapter id (every later generate uses it)."""
        self._adapter.check_enabled()
        self._check_not_updating()
        use_threads(self._threads)
        t0 = time.perf_counter()
        path = self._adapter.load(tensors, adapter_config, version)
        self.update_weight_version(version)
        self._adapter.drop_previous()
        return {"seconds": time.perf_counter() - t0, "path": path}

    # ------------------------------------------------------------------ the verified sync
    def weight_fingerprint(self, shapes: dict, version: int, adapter: bool = False) -> dict:
        """What this engine holds of the learner's tensors `shapes` (actors/transport/fingerprint.py),
        read inside each vLLM worker; the learner compares it with what it sent."""
        self._check_not_updating()
        with paused(self._loop):
            workers = self.llm.collective_rpc("raygrpo_weight_fingerprint", args=(shapes, int(version), adapter))
        return {"engine": f"rollout worker {self.worker_index} (pid {os.getpid()})", "version": self._version,
                "workers": workers}

    # ------------------------------------------------------------------ health
    def network(self, towards: str) -> dict:
        """This actor's host, advertised address and gloo interface (placement.json, the console)."""
        return network_view(towards)

    def info(self) -> dict:
        node_id = None
        try:
            import ray

            if ray.is_initialized():
                node_id = ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001 - info must answer even outside Ray
            pass

        return {
            "node_id": node_id,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "worker_index": self.worker_index,
            "weight_version": self._version,
            "updating": self._updating,
            "torch_threads": torch.get_num_threads(),
            "cores": node_cores(),
            "model_path": self.model_path,
            "start_seconds": round(self.start_seconds, 2),
        }
