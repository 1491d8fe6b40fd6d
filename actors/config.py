"""Config of the generation side. Every default lives here; cluster/config.py composes these."""
from __future__ import annotations

from dataclasses import dataclass, field

from actors.runtime.checks import at_least
from actors.transport.cpu_packing import DEFAULT_PACK_ABOVE_ELEMENTS
from actors.transport.registry import BACKENDS

ENGINE_CORE_CHOICES = ("auto", "process", "in_actor")  # rollout.engine_core


@dataclass
class RolloutConfig:
    """vLLM rollout engines (one per RolloutWorker actor)."""

    num_workers: int = 1
    # The fewest engines the run generates with: after a host holding some of them was lost, and at start
    # when there is no room for all (the rest join when a node with room does; README, "When a host dies or
    # joins"). None: num_workers, i.e. every engine placed at start and a lost one waited for (ray.node_wait_s).
    min_workers: int | None = None
    tensor_parallel_size: int = 1  # GPU only: vLLM's own TP across the GPUs of one node
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    max_model_len: int = 256  # prompt + completion tokens the engine accepts
    max_new_tokens: int = 32
    # Sampled completions are not allowed to end (EOS / stop token ids) before this many tokens
    # (vLLM's SamplingParams.min_tokens); greedy evaluation is not affected. 0: off. The bench's
    # long-completion setting sets it to max_new_tokens, so a random model cannot stop early.
    min_new_tokens: int = 0
    gpu_memory_utilization: float = 0.1  # on CPU vLLM reads this as the fraction of RAM for KV cache
    # CPU only: an explicit KV-cache size. vLLM-CPU's gpu_memory_utilization must cover the whole
    # process (its ~0.7 GiB RSS included), which breaks in small fractions; a fixed size does not,
    # and it also skips the warm-up pass at start (eager mode). 0: use gpu_memory_utilization.
    cpu_kv_cache_mb: int = 256
    seed: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    # What the behaviour log-probs are: "raw_logprobs" = log-softmax of the model's logits (what the
    # learner recomputes), "processed_logprobs" = after temperature/top-k/top-p (the distribution
    # actually sampled from). Only differs from raw when temperature != 1 or top-k/top-p are set.
    logprobs_mode: str = "raw_logprobs"
    long_prompt: str = "skip"  # a prompt longer than max_model_len - max_new_tokens: "skip" (counted) or "error"
    # auto: "nccl" (vLLM's) when num_gpus > 0, else "gloo" (ours); actors/transport/registry.py
    weight_transfer_backend: str = "auto"
    bucket_mb: int = 64  # size of the packed buffers the weights travel in
    enforce_eager: bool | None = None  # None: eager on CPU, CUDA graphs on GPU (actors/runtime/devices.py)
    # CPU, float32: linear weights with more elements than this compute from a oneDNN-packed copy
    # (20-40% faster GEMMs at decode from 2048 x 256 up), rebuilt after every weight update at
    # ~0.4 ms per layer; smaller ones compute from the weight itself, which is as fast for them
    # and needs no rebuild (actors/transport/vllm_plugin.py). 0: pack every layer (vLLM's own behaviour).
    cpu_pack_above_elements: int = DEFAULT_PACK_ABOVE_ELEMENTS  # 128 * 1024
    num_cpus: float = 0.5  # Ray resources per worker; fractional so a 2-core machine runs everything
    num_gpus: float = 0.0
    threads: int = 0  # torch threads per engine; 0: the thread budget (cluster/launch/thread_budget.py) decides
    max_restarts: int = 3  # Ray restarts a dead worker this many times
    # Multi-turn rollouts (actors/multiturn/trajectories.py): an environment answers each assistant turn.
    # "" = single-turn completions. A built-in name (actors/multiturn/envs.py ENVS, e.g. "calculator") or
    # user code as "path/to/file.py:ClassName"; one instance per trajectory, Env(**example_fields).
    env: str = ""
    max_turns: int = 1  # assistant turns per trajectory (multi-turn); max_model_len caps its tokens
    env_timeout_s: float = 10.0  # per environment call (constructor+reset, or one step)
    env_num_procs: int = 2  # isolated processes that run environment code (per rollout worker)
    # trainer.mode=pipeline: what a weight update landing mid-request does to the running requests' KV
    # cache (actors/pipeline.py): "recompute" (prefilled again by the new weights; the new tokens'
    # log-probs are the new policy's) or "keep" (no re-prefill; the new tokens come from new weights over
    # old-weight keys/values). Measured in docs/DESIGN.md (issue 40); recompute is the default.
    kv_after_update: str = "recompute"
    # Where vLLM's engine core (its scheduler and its busy loop of model steps) runs: "process" (its own
    # process, vLLM's default and what a GPU engine needs), "in_actor" (inside the rollout actor: on a 2-core
    # CPU machine a process more per engine costs memory and context switches for nothing) or "auto"
    # (in_actor on CPU, process on GPU). Set through VLLM_ENABLE_V1_MULTIPROCESSING before vLLM starts.
    engine_core: str = "auto"

    def engine_core_in_own_process(self, gpu: bool) -> bool:
        """rollout.engine_core resolved for an engine on a GPU (`gpu`) or on CPU."""
        return {"process": True, "in_actor": False}.get(self.engine_core, gpu)

    def min_live_workers(self) -> int:
        """The fewest engines the run generates with (rollout.min_workers; unset: num_workers)."""
        return self.num_workers if self.min_workers is None else self.min_workers

    def model_token_cap(self) -> int:
        """The most tokens the model samples for one completion: max_new_tokens, or for a multi-turn
        trajectory every turn's (bounded by the whole budget). Dr. GRPO's normaliser, DAPO's overlong cap."""
        if not self.env:
            return self.max_new_tokens
        return min(self.max_turns * self.max_new_tokens, self.max_model_len)

    def problems(self) -> list[str]:
        p = []
        at_least(p, "rollout.threads", self.threads, 0, " (0: the thread budget decides)")
        at_least(p, "rollout.cpu_pack_above_elements", self.cpu_pack_above_elements, 0, " (0: pack every layer)")
        at_least(p, "rollout.max_turns", self.max_turns, 1)
        if self.kv_after_update not in ("recompute", "keep"):
            p.append(f"rollout.kv_after_update must be recompute|keep, got {self.kv_after_update!r}")
        if self.engine_core not in ENGINE_CORE_CHOICES:
            p.append(f"rollout.engine_core must be {'|'.join(ENGINE_CORE_CHOICES)}, got {self.engine_core!r} "
                     "(auto: in the actor on CPU, its own process on GPU)")
        if self.env and self.env_timeout_s <= 0:
            p.append(f"rollout.env_timeout_s must be > 0, got {self.env_timeout_s}")
        if self.env and self.env_num_procs < 1:
            p.append(f"rollout.env_num_procs must be >= 1, got {self.env_num_procs}")
        if self.env and self.stop:
            p.append("rollout.stop (stop strings) cannot be used with rollout.env: a multi-turn turn ends at the "
                     "chat template's end-of-turn token, so the sampled tokens stay exact; remove rollout.stop")
        at_least(p, "rollout.num_workers", self.num_workers, 1)
        if self.min_workers is not None and not 1 <= self.min_workers <= self.num_workers:
            p.append(f"rollout.min_workers must be in [1, rollout.num_workers ({self.num_workers})], got "
                     f"{self.min_workers} (leave it unset to mean rollout.num_workers)")
        at_least(p, "rollout.max_new_tokens", self.max_new_tokens, 1)
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            p.append(f"rollout.min_new_tokens must be in [0, rollout.max_new_tokens ({self.max_new_tokens})], "
                     f"got {self.min_new_tokens}")
        if self.env and self.min_new_tokens:
            p.append("rollout.min_new_tokens applies to single-turn completions only: with rollout.env set a turn "
                     "ends at the chat template's end-of-turn token; set rollout.min_new_tokens=0")
        if self.max_new_tokens >= self.max_model_len:
            p.append(f"rollout.max_new_tokens ({self.max_new_tokens}) must be < rollout.max_model_len ({self.max_model_len})")
        if not 0 < self.gpu_memory_utilization <= 1:
            p.append(f"rollout.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        at_least(p, "rollout.temperature", self.temperature, 0)
        if self.long_prompt not in ("skip", "error"):
            p.append(f"rollout.long_prompt must be 'skip' or 'error', got {self.long_prompt!r}")
        if self.weight_transfer_backend not in ("auto", *BACKENDS):  # actors/transport/registry.py
            p.append(f"rollout.weight_transfer_backend must be {'|'.join(('auto', *BACKENDS))}, "
                     f"got {self.weight_transfer_backend!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            p.append(f"rollout.dtype must be auto|float32|bfloat16|float16, got {self.dtype!r}")
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            p.append(f"rollout.logprobs_mode must be raw_logprobs|processed_logprobs, got {self.logprobs_mode!r}")
        at_least(p, "rollout.cpu_kv_cache_mb", self.cpu_kv_cache_mb, 0)
        at_least(p, "rollout.tensor_parallel_size", self.tensor_parallel_size, 1)
        if not 0 < self.top_p <= 1:
            p.append(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            p.append(f"rollout.top_k must be -1 (off) or >= 1, got {self.top_k}")
        at_least(p, "rollout.max_model_len", self.max_model_len, 2)
        at_least(p, "rollout.bucket_mb", self.bucket_mb, 1)
        if self.num_cpus < 0 or self.num_gpus < 0:
            p.append(f"rollout.num_cpus and rollout.num_gpus must be >= 0, got {self.num_cpus} and {self.num_gpus}")
        if self.max_restarts < -1:
            p.append(f"rollout.max_restarts must be >= 0 (or -1: unlimited), got {self.max_restarts}")
        return p


@dataclass
class RewardConfig:
    """Reward functions, summed with weights: built-ins, `path/to/file.py:function`, `model:PATH`
    (a reward model), `http(s)://...` (a remote verifier); actors/rewards/registry.py."""

    # gsm8k | math_verify | exact_match | format | overlong_penalty | path/to/file.py:fn (per-sample or
    # TRL-style) | model:PATH | http://HOST[:PORT]/PATH
    functions: list[str] = field(default_factory=lambda: ["exact_match"])
    weights: list[float] = field(default_factory=list)  # empty: 1.0 each
    # Metric names, one per function (rewards/<name>/mean, ...); empty: the built-in's name, the Python
    # function's __name__, the reward model directory's basename, the URL's host and path.
    names: list[str] = field(default_factory=list)
    timeout_s: float = 10.0  # per call of user code; a call past it counts as a reward error
    # reward of a sample a working function failed on, or that every function failed on (a function that
    # failed a prompt's every sample is left out of it instead: actors/rewards/scorer.py, "Errors")
    fallback: float = 0.0
    num_procs: int = 2  # isolated processes that run user reward code
    # DAPO soft overlong punishment (used by the `overlong_penalty` built-in)
    overlong_buffer: int = 8
    answer_key: str = "answer"  # the column the answer checkers (gsm8k, math_verify, exact_match) compare against
    # model:PATH entries: one RewardModelActor each (a Ray actor like the reference), batched forward passes
    model_num_cpus: float = 0.25
    model_num_gpus: float = 0.0
    model_batch_size: int = 16  # sequences per forward pass
    model_dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    model_max_len: int = 2048  # tokens of prompt + completion; longer inputs keep their last tokens (counted)
    model_max_restarts: int = 3  # Ray restarts a dead reward-model actor (and retries its call) this many times
    # http(s):// entries: POST {"prompts", "completions", <columns>} batches, read {"rewards": [float | null]}
    http_timeout_s: float = 30.0  # per request; a request past it counts as an error for its samples
    http_max_retries: int = 3  # on connection errors, 5xx and 429, with backoff; never on other 4xx
    http_max_batch: int = 64  # samples per request
    http_concurrency: int = 4  # requests in flight at once, per verifier
    # The most a verifier's answer may hold (its {"rewards": [...]} for http_max_batch samples is a few KB):
    # a larger one is an error for that request's samples, read no further than this + 1 byte.
    http_max_response_mb: float = 8.0
    # https:// verifiers are checked against the system's CA certificates; a PEM file here replaces them (the
    # CA that signed an internal verifier's certificate). Read by the driver, relative to where it runs.
    http_ca_file: str = ""
    # A verifier that requires a client certificate (mutual TLS): raygrpo presents this PEM certificate, with
    # the private key in http_client_key (or in this same file). Read by the driver, relative to where it runs.
    http_client_cert: str = ""
    http_client_key: str = ""
    # code_tests (actors/rewards/code.py): programs run against the row's tests in a sandbox (actors/runtime/sandbox/)
    code_format: str = "auto"  # humaneval | mbpp | auto (read per row from its columns: test_list -> mbpp)
    code_tests_key: str = ""  # the tests column; "": `test` (humaneval), `test_list` (mbpp)
    code_entry_point_key: str = "entry_point"  # humaneval: the column naming the function under test
    code_score: str = "fraction"  # fraction of the tests passed | all (1.0 only if every test passed)
    # strict: fresh user/network/mount/pid namespaces, a built root, no capabilities (probed at start; refused
    # where the machine cannot give it) | process: the weaker level, a process group with rlimits only
    code_sandbox: str = "strict"
    code_timeout_s: float = 10.0  # wall clock for one program's tests together; then its sandbox is killed
    code_workers: int = 2  # programs run at once
    code_memory_mb: int = 512  # address space of a test's process (and the size of its writable /tmp)
    code_max_output_kb: int = 1024  # stdout + stderr of one test; past it the test is output_limit

    def problems(self) -> list[str]:
        p = []
        # reward.functions may be empty when rollout.env supplies the rewards (checked by the run's config)
        if self.weights and len(self.weights) != len(self.functions):
            p.append(f"reward.weights has {len(self.weights)} entries but reward.functions has {len(self.functions)}")
        if self.names and len(self.names) != len(self.functions):
            p.append(f"reward.names has {len(self.names)} entries but reward.functions has {len(self.functions)}")
        if self.timeout_s <= 0:
            p.append(f"reward.timeout_s must be > 0, got {self.timeout_s}")
        at_least(p, "reward.num_procs", self.num_procs, 1)
        at_least(p, "reward.overlong_buffer", self.overlong_buffer, 0)
        if not self.answer_key:
            p.append("reward.answer_key is empty: name the answer column")
        if self.model_num_cpus < 0 or self.model_num_gpus < 0:
            p.append(f"reward.model_num_cpus and reward.model_num_gpus must be >= 0, got {self.model_num_cpus} "
                     f"and {self.model_num_gpus}")
        at_least(p, "reward.model_batch_size", self.model_batch_size, 1)
        at_least(p, "reward.model_max_len", self.model_max_len, 2)
        if self.model_dtype not in ("auto", "float32", "bfloat16", "float16"):
            p.append(f"reward.model_dtype must be auto|float32|bfloat16|float16, got {self.model_dtype!r}")
        if self.model_max_restarts < -1:
            p.append(f"reward.model_max_restarts must be >= 0 (or -1: unlimited), got {self.model_max_restarts}")
        if self.http_timeout_s <= 0:
            p.append(f"reward.http_timeout_s must be > 0, got {self.http_timeout_s}")
        at_least(p, "reward.http_max_retries", self.http_max_retries, 0)
        at_least(p, "reward.http_max_batch", self.http_max_batch, 1)
        at_least(p, "reward.http_concurrency", self.http_concurrency, 1)
        if not self.http_max_response_mb > 0:
            p.append(f"reward.http_max_response_mb must be > 0, got {self.http_max_response_mb}")
        p += self._code_problems()
        if self.http_client_key and not self.http_client_cert:
            p.append(f"reward.http_client_key is set ({self.http_client_key!r}) but reward.http_client_cert is not: "
                     "set the client certificate it belongs to")
        return p

    def _code_problems(self) -> list[str]:
        p = []
        for key, allowed in (("code_format", ("auto", "humaneval", "mbpp")), ("code_score", ("fraction", "all")),
                             ("code_sandbox", ("strict", "process"))):
            if getattr(self, key) not in allowed:
                p.append(f"reward.{key} must be {'|'.join(allowed)}, got {getattr(self, key)!r}")
        if self.code_timeout_s <= 0:
            p.append(f"reward.code_timeout_s must be > 0, got {self.code_timeout_s}")
        at_least(p, "reward.code_workers", self.code_workers, 1)
        at_least(p, "reward.code_memory_mb", self.code_memory_mb, 64, " (the interpreter itself needs ~30 MB)")
        at_least(p, "reward.code_max_output_kb", self.code_max_output_kb, 1)
        if not self.code_entry_point_key:
            p.append("reward.code_entry_point_key is empty: name the entry point column (humaneval)")
        return p
