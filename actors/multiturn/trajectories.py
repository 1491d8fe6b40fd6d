"""Multi-turn rollouts: trajectories driven turn by turn through vLLM, token-exact.

A trajectory is the rendered prompt followed by the model's turns and, between them, the
environment's messages (actors/multiturn/envs.py). Token ids go in and come out, so what the learner
trains on is exactly what was sampled:

- the model's sampled ids are appended verbatim (they end with the end-of-turn token); they are
  decoded only to give the environment (and the rewards) text, never re-encoded;
- environment messages are appended as the chat template's own tokens for them: the conversation
  is rendered without and with the new messages and the difference is taken. What the template
  writes after the end-of-turn token (ChatML's newline) is part of that difference, so no turn
  separator is lost (verl's incremental rendering dropped it);
- that only works for a prefix-preserving template (rendering more messages never rewrites the
  tokens of earlier ones): `ChatTokens` checks it once at start and refuses a template that is not.

All live trajectories advance together: one engine call per turn for all of them, then one
batch of environment calls. `rollout.max_model_len` is each trajectory's whole token budget.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

# Why a trajectory ended.
#   stop           the environment said done after a model turn that ended with the end-of-turn token
#   length         the environment said done after a turn cut at rollout.max_new_tokens
#   max_turns      rollout.max_turns model turns and the environment was not done
#   max_model_len  the next turn or the environment's messages did not fit in rollout.max_model_len
#                  (the latter: Trajectory.env_overflow_tokens > 0, counted as env_overflows)
#   env_error      the environment raised, hung, died or broke the contract (counted as env_errors)
TRAJECTORY_FINISH_REASONS = ("stop", "length", "max_turns", "max_model_len", "env_error")


class TemplateError(ValueError):
    pass


@dataclass
class Trajectory:
    prompt_ids: list[int]  # the rendered prompt, with the environment's reset() messages
    token_ids: list[int] = field(default_factory=list)  # after the prompt: model turns and environment messages
    loss_mask: list[int] = field(default_factory=list)  # per token_ids entry: 1 sampled by the model, 0 environment
    logprobs: list[float] = field(default_factory=list)  # behaviour log-prob of each MODEL token, in order
    messages: list[dict] = field(default_factory=list)  # the whole conversation, prompt included
    text: str = ""  # the last assistant turn's text
    finish_reason: str = ""
    turns: int = 0  # assistant turns
    tool_calls: int = 0  # "tool" messages the environment answered with
    env_reward: float = 0.0  # sum of the environment's step rewards
    env_tokens: int = 0
    env_error: str | None = None
    # the environment's last messages did not fit in rollout.max_model_len: their token count (the
    # trajectory ended there, finish_reason "max_model_len"; counted as env_overflows)
    env_overflow_tokens: int = 0
    turn_ended: bool = True  # the last model turn ended with the end-of-turn token (not cut at max_new_tokens)

    def model_logprobs_full(self) -> list[float]:
        """Behaviour log-probs spread over token_ids (NaN at environment positions, never read)."""
        it = iter(self.logprobs)
        return [next(it) if m else float("nan") for m in self.loss_mask]


@dataclass
class MultiTurnRollout:
    """The G trajectories of one prompt (empty when the prompt was skipped)."""

    trajectories: list[Trajectory]
    weight_version: int
    skipped: str | None = None
    env_s: float = 0.0  # this prompt's share of the time spent waiting on environments

    @property
    def completions(self) -> list[Trajectory]:  # what the scorer and the driver read, as for PromptRollout
        return self.trajectories

    def training_rows(self) -> list[tuple]:
        """(prompt_ids, completion_ids, behavior_logp, loss_mask) per trajectory, as PromptRollout's."""
        return [(t.prompt_ids, t.token_ids, t.model_logprobs_full(), t.loss_mask) for t in self.trajectories]


class ChatTokens:
    """The chat template as token ids: the prompt, and the suffix that appends environment messages."""

    def __init__(self, tokenizer, template_kwargs: dict | None = None):
        """template_kwargs: passed to every apply_chat_template (data.chat_template_kwargs, e.g. enable_thinking)."""
        self.tok = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.eos = tokenizer.eos_token_id
        if self.eos is None:
            raise TemplateError("the tokenizer has no eos_token: multi-turn rollouts need the end-of-turn token")
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat_template: multi-turn rollouts render the conversation "
                                "with it (set one in tokenizer_config.json)")
        self.check_prefix_preserving()

    def ids(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                            **self.template_kwargs)
        # verbose=False: transformers' "Token indices sequence length is longer than ..." warning is about the
        # tokenizer's model_max_length; a conversation too long for rollout.max_model_len is raygrpo's to say
        # (env_overflows, said once per run), and the warning reached the console from the worker (CI at stop 67)
        return list(self.tok.encode(text, add_special_tokens=False, verbose=False))

    def check_prefix_preserving(self) -> None:
        """Refuse a template whose rendering of earlier messages changes when messages are added
        (e.g. one that strips reasoning from earlier assistant turns): turn-by-turn token appends
        would then train on a context the template never produces."""
        user = [{"role": "user", "content": "What is 2+3?"}]
        asst = {"role": "assistant", "content": "calc(2+3)"}
        prompt = self.ids(user, True)
        with_asst = self.ids(user + [asst], False)
        problems = []
        if with_asst[:len(prompt)] != prompt:
            problems.append("the generation prompt is not a prefix of the rendered assistant turn")
        elif self.eos not in with_asst[len(prompt):]:
            problems.append(f"the assistant turn does not end with the eos token {self.tok.eos_token!r}")
        for role in ("tool", "user"):
            try:
                nxt = self.ids(user + [asst, {"role": role, "content": "5"}], True)
            except Exception as e:  # noqa: BLE001 - a template may refuse a role: say which
                problems.append(f"rendering a {role!r} message fails ({type(e).__name__}: {e})")
                continue
            if nxt[:len(with_asst)] != with_asst:
                problems.append(f"adding a {role!r} message changes the tokens of the turns before it")
        if problems:
            raise TemplateError("the chat template is not prefix-preserving, so multi-turn trajectories cannot be "
                                "token-exact: " + "; ".join(problems) + ". Use a template that renders earlier "
                                "turns identically whatever follows (e.g. ChatML).")

    def env_suffix(self, conversation: list[dict], new: list[dict], turn_ended: bool) -> list[int]:
        """Tokens that follow the model's last sampled token to add `new` and open the next
        assistant turn: the template's closing of the assistant turn (after the end-of-turn token
        when the model sampled it; from it, when the turn was cut at max_new_tokens), then the
        new messages and the next generation prompt."""
        base = self.ids(conversation, False)
        full = self.ids(conversation + new, True)
        if full[:len(base)] != base:
            raise TemplateError("the chat template rendered this conversation's earlier turns differently once "
                                "the environment's messages were added (not prefix-preserving here)")
        last_eos = len(base) - 1 - base[::-1].index(self.eos)
        return base[last_eos + (1 if turn_ended else 0):] + full[len(base):]


def _seed(seed: int | None, index: int, turn: int) -> int | None:
    return None if seed is None else (seed * 1_000_003 + index * 7_919 + turn * 104_729) % (2**31)


def run_trajectories(sample, chat: ChatTokens, envs, cfg, conversations: list[list[dict]], fields: list[dict],
                     group_size: int, seeds: list[int] | None, version: int, next_key) -> list[MultiTurnRollout]:
    """G trajectories per conversation, all advancing together turn by turn.

    `sample(requests)` is the engine: requests are (context token ids, max_tokens, seed), one per live
    trajectory, sampled in one call and stopped at `chat.eos` only; it returns per request
    (sampled token ids, their log-probs, finish reason). `envs` is an actors.multiturn.env_pool.EnvPool,
    `next_key()` a fresh key for one environment instance.
    """
    G, budget = group_size, cfg.max_model_len
    env_s = 0.0

    def env_calls(calls):
        nonlocal env_s
        t0 = time.perf_counter()
        out = envs.run(calls)
        env_s += time.perf_counter() - t0
        return out

    # One environment per trajectory: Env(**fields), reset() -> messages before the first turn.
    rollouts, live = [], []  # live: (trajectory, env key, index of its request within the prompt's group)
    keys = [[next_key() for _ in range(G)] for _ in conversations]
    opened = env_calls([(keys[p][g], "open", dict(fields[p])) for p in range(len(conversations)) for g in range(G)])
    for p, conversation in enumerate(conversations):
        trajs = []
        for g in range(G):
            ok, value = opened[p * G + g]
            messages = [dict(m) for m in conversation] + (value if ok else [])
            traj = Trajectory(prompt_ids=chat.ids(messages, True), messages=messages)
            if not ok:
                traj.env_error, traj.finish_reason = f"reset: {value}", "env_error"
            elif len(traj.prompt_ids) >= budget - 1:
                traj.finish_reason = "max_model_len"
            else:
                live.append((traj, keys[p][g], p, g))
            trajs.append(traj)
        skipped = None
        if all(t.finish_reason == "max_model_len" for t in trajs):
            skipped = f"prompt {p} is {len(trajs[0].prompt_ids)} tokens, no room in max_model_len {budget}"
            if cfg.long_prompt == "error":
                envs.run([(k, "close", None) for row in keys for k in row])
                raise ValueError(skipped)
            live = [x for x in live if x[2] != p]
        rollouts.append(MultiTurnRollout(trajs, version, skipped=skipped))

    for turn in range(cfg.max_turns):
        if not live:
            break
        # 1. one engine call: the next model turn of every live trajectory
        requests = [(traj.prompt_ids + traj.token_ids,
                     min(cfg.max_new_tokens, budget - len(traj.prompt_ids) - len(traj.token_ids)),
                     None if seeds is None else _seed(seeds[p], g, turn)) for traj, _, p, g in live]
        stepping = []
        for (traj, key, p, g), (ids, logprobs, _), (_, max_tokens, _) in zip(live, sample(requests), requests):
            ids = list(ids)
            traj.token_ids += ids
            traj.loss_mask += [1] * len(ids)
            traj.logprobs += logprobs
            traj.turns += 1
            ended = bool(ids) and ids[-1] == chat.eos
            traj.text = chat.tok.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
            traj.messages.append({"role": "assistant", "content": traj.text})
            traj.turn_ended = ended
            if not ended and max_tokens < cfg.max_new_tokens:  # cut by the trajectory's token budget
                traj.finish_reason = "max_model_len"
                continue
            # A turn cut at max_new_tokens still goes to the environment (it decides what a truncated
            # turn means); the end-of-turn token the model did not sample is then template (env) tokens.
            stepping.append((traj, key, p, g))
        # 2. one batch of environment calls: every trajectory whose turn ended
        results = env_calls([(key, "step", traj.text) for traj, key, _, _ in stepping])
        live = []
        for (traj, key, p, g), (ok, value) in zip(stepping, results):
            if not ok:
                traj.env_error, traj.finish_reason = f"step: {value}", "env_error"
                continue
            traj.env_reward += value["reward"]
            traj.tool_calls += sum(m["role"] == "tool" for m in value["messages"])
            conversation_so_far = list(traj.messages)
            traj.messages += value["messages"]
            if value["done"]:
                traj.finish_reason = "stop" if traj.turn_ended else "length"
                continue
            if turn + 1 == cfg.max_turns:
                traj.finish_reason = "max_turns"
                continue
            try:
                suffix = chat.env_suffix(conversation_so_far, value["messages"], traj.turn_ended)
            except TemplateError as e:
                traj.env_error, traj.finish_reason = str(e), "env_error"
                continue
            if len(traj.prompt_ids) + len(traj.token_ids) + len(suffix) >= budget:
                traj.finish_reason = "max_model_len"  # no room for the messages and a token of reply
                traj.env_overflow_tokens = len(suffix)
                continue
            traj.token_ids += suffix
            traj.loss_mask += [0] * len(suffix)
            traj.env_tokens += len(suffix)
            live.append((traj, key, p, g))
    for traj, _, _, _ in live:  # defensive: the loop above gives every trajectory a reason
        traj.finish_reason = traj.finish_reason or "max_turns"
    env_calls([(k, "close", None) for row in keys for k in row])
    for r in rollouts:
        r.env_s = env_s / max(len(rollouts), 1)
    return rollouts
