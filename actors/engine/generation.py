"""EngineGeneration: the rollout actor's sampling calls (generate, multi-turn, prompt log-probs).

A part of actors/rollout.py's RolloutWorker, mixed into its class rather than held by it: the driver
calls these methods on the actor's Ray handle, and Ray finds an actor's remote methods on its class.
It owns the tokenizer, the stop tokens and the multi-turn environments; it reads the engine
(`llm`), the config, the torch thread count (actors/runtime/actor_base.py), the weight version and
the adapter (engine/weight_updates.py), and runs every engine call through the pipeline part's
`_loop_idle` (engine/pipeline_loop.py).
"""
from __future__ import annotations

import copy
from typing import Any

from actors.completions import PromptRollout, completion_from_vllm, stop_token_ids
from actors.config import RolloutConfig
from actors.multiturn.env_pool import EnvPool
from actors.multiturn.trajectories import ChatTokens, run_trajectories
from actors.runtime.threads import use_threads


class EngineGeneration:
    """generate, generate_multiturn, prompt_logprobs and the requests they send."""

    # Of the actor: the config, the engine and its path; of the other parts: the threads, the version, the adapter.
    cfg: RolloutConfig
    llm: Any
    model_path: str
    threads: int
    _version: int
    _adapter: Any

    def _start_generation(self, chat_template_kwargs: dict | None) -> None:
        """The tokenizer and stop tokens; with `cfg.env`, the multi-turn chat renderer (a template that is
        not prefix-preserving is refused here) and the environment processes. Then the warm-up."""
        self.tokenizer = self.llm.get_tokenizer()
        self.stop_token_ids = stop_token_ids(self.model_path, self.tokenizer.eos_token_id)
        self._chat = self._envs = None
        if self.cfg.env:
            self._chat = ChatTokens(self.tokenizer, chat_template_kwargs)
            self._envs = EnvPool(self.cfg.env, self.cfg.env_num_procs, self.cfg.env_timeout_s)
            self._env_keys = 0
        self._warm_up()

    def _warm_up(self) -> None:
        """The first seeded sampling call pays a one-off ~3 s (sampler set-up); pay it at start so
        the first training step's timing is not an outlier. One token of context: no prefix
        cache block fills, nothing leaks into later requests."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        token = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        self.llm.generate([TokensPrompt(prompt_token_ids=[token])],
                          SamplingParams(n=2, max_tokens=2, seed=0, logprobs=0), use_tqdm=False)

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
        use_threads(self.threads)
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
        use_threads(self.threads)
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

    def prompt_logprobs(self, token_ids: list[list[int]]) -> list[list[float]]:
        """vLLM's log-prob of each token given the ones before it (positions 1..L-1), computed
        by the engine's own forward: the check that synced weights really arrived."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._check_not_updating()
        use_threads(self.threads)
        for i, ids in enumerate(token_ids):
            if not 2 <= len(ids) < self.cfg.max_model_len:
                raise ValueError(f"sequence {i} has {len(ids)} tokens; need 2..{self.cfg.max_model_len - 1}")
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        with self._loop_idle("prompt_logprobs"):
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in token_ids],
                                        params, use_tqdm=False, lora_request=self._adapter.request)
        return [[float(step[tok].logprob) for tok, step in zip(ids[1:], out.prompt_logprobs[1:])]
                for ids, out in zip(token_ids, outputs)]
