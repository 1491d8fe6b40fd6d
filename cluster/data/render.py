"""Prompts as the engine receives them: chat-template rendering and token counts, done once on the driver.

A prompt is a string or a list of `{"role", "content"}` messages (TRL's conversational format,
verl's parquet `prompt` column; content a string, or a list of text parts that `text_content` joins
at load). Messages are rendered with the model's own chat template,
`apply_chat_template(messages, add_generation_prompt=True, **chat_template_kwargs)`, then
encoded without adding special tokens (the template wrote them) -- exactly what
`apply_chat_template(..., tokenize=True)` returns. A string is encoded as it is (with the
tokenizer's usual special tokens, as vLLM does for a text prompt), or wrapped as one user
message when `data.apply_chat_template` is set.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from cluster.data.files import DataError


@dataclass(frozen=True)
class PromptFormat:
    apply_chat_template: bool = False  # wrap string prompts as one user message and render them
    system_prompt: str = ""  # added as the first message when a conversation has no system message
    chat_template_kwargs: dict = field(default_factory=dict)  # passed to apply_chat_template (enable_thinking, ...)


def prompt_problem(prompt) -> str | None:
    """Why `prompt` is neither a string nor a list of {"role": str, "content": str | text parts} messages, or None."""
    if isinstance(prompt, str):
        return None if prompt else "the prompt is an empty string"
    if not isinstance(prompt, list) or not prompt:
        return f"the prompt must be a string or a non-empty list of {{\"role\", \"content\"}} messages, got {_short(prompt)}"
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"message {i} must be an object with string \"role\" and \"content\", got {_short(m)}"
        content = m.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            return f"message {i}'s \"content\" must be a string or a list of text parts, got {_short(content)}"
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("text"), str) or part.get("type", "text") != "text":
                kind = f"of type {part['type']!r}" if isinstance(part, dict) and "type" in part else _short(part)
                return (f"message {i} has a content part {kind}: raygrpo trains text models, so a content list may "
                        "hold only text parts ({\"type\": \"text\", \"text\": ...})")
    return None


def text_content(prompt):
    """`prompt` with every message's content as one string: a list of text parts (OpenAI's format) joined
    with newlines, as vLLM joins them for a chat template that takes string content. Other keys are kept."""
    if isinstance(prompt, str) or all(isinstance(m["content"], str) for m in prompt):
        return prompt
    return [m if isinstance(m["content"], str) else {**m, "content": "\n".join(p["text"] for p in m["content"])}
            for m in prompt]


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def conversation(prompt, fmt: PromptFormat) -> list[dict] | None:
    """The messages to render for `prompt`, or None for a string used as it is."""
    if isinstance(prompt, str):
        if not fmt.apply_chat_template:
            return None
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = list(prompt)
    if fmt.system_prompt and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": fmt.system_prompt}, *messages]
    return messages


def render(prompts: list, tokenizer, fmt: PromptFormat) -> list[tuple[str, list[int]]]:
    """(rendered text, token ids) per prompt: what the engine receives."""
    chats = [conversation(p, fmt) for p in prompts]
    if any(c is not None for c in chats) and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "the prompts are chat messages (or data.apply_chat_template is set) but the model's tokenizer has no "
            "chat template; use a chat/instruct model, add a template to its tokenizer_config.json / "
            "chat_template.jinja, or give plain string prompts")
    if fmt.system_prompt and any(c is None for c in chats):
        raise DataError("data.system_prompt is set but some prompts are plain strings used as they are; "
                        "set data.apply_chat_template: true to render them as chat messages")
    texts = [p if c is None else tokenizer.apply_chat_template(
        c, add_generation_prompt=True, tokenize=False, **fmt.chat_template_kwargs) for p, c in zip(prompts, chats)]
    out: list[tuple[str, list[int]]] = [("", [])] * len(prompts)
    for templated in (True, False):  # the template wrote the special tokens; a plain string gets the usual ones
        idx = [i for i, c in enumerate(chats) if (c is not None) == templated]
        if idx:
            ids = tokenizer([texts[i] for i in idx], add_special_tokens=not templated)["input_ids"]
            for i, row in zip(idx, ids):
                out[i] = (texts[i], list(row))
    return out


@dataclass
class LengthReport:
    """What a dataset looks like in tokens, and what the length limit removed."""

    name: str
    rows: int
    limit: int
    filtered: int = 0
    longest_filtered: int = 0
    tokens: list[int] = field(default_factory=list, repr=False)  # every row's prompt length

    def percentile(self, q: float) -> int:
        s = sorted(self.tokens)
        return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))] if s else 0

    def stats(self) -> str:
        return (f"{self.name}: {self.rows} rows, {self.filtered} filtered (> {self.limit} prompt tokens), "
                f"prompt tokens p50 {self.percentile(50)} / p95 {self.percentile(95)} / max {max(self.tokens, default=0)}")

    def filtered_note(self) -> str | None:
        if not self.filtered:
            return None
        return (f"data: filtered {self.filtered} of {self.rows} {self.name} prompts longer than {self.limit} tokens "
                f"(longest {self.longest_filtered}); data.max_prompt_tokens / rollout.max_model_len set the limit")


def length_filter(items: list, lengths: list[int], limit: int, policy: str, name: str,
                  wheres: list[str]) -> tuple[list, LengthReport]:
    """Keep the items whose prompt fits `limit` tokens; `policy` "error" raises on the first ones that don't."""
    report = LengthReport(name, len(items), limit, tokens=list(lengths))
    long = [i for i, n in enumerate(lengths) if n > limit]
    if long and policy == "error":
        raise DataError(
            f"{len(long)} {name} prompt(s) are longer than {limit} tokens (data.long_prompts=error), e.g. "
            + "; ".join(f"{wheres[i]}: {lengths[i]} tokens" for i in long[:5])
            + ". Raise rollout.max_model_len / data.max_prompt_tokens, or set data.long_prompts=filter")
    report.filtered = len(long)
    report.longest_filtered = max((lengths[i] for i in long), default=0)
    drop = set(long)
    return [x for i, x in enumerate(items) if i not in drop], report


def multiturn_format(cfg) -> PromptFormat:
    """How a multi-turn conversation opens (`cfg`: the RunConfig): the data's messages (a string
    prompt as one user turn) with data.system_prompt, rendered with data.chat_template_kwargs, as
    single-turn prompts are."""
    return PromptFormat(True, cfg.data.system_prompt, dict(cfg.data.chat_template_kwargs))
