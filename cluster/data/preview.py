"""`raygrpo data CONFIG`: the run's data exactly as training will use it, before any GPU hour is spent.

Loads the data the way `Trainer` does (`load_run_data`: same files, same chat template, same
length filter), then prints the first prompts of step 1 as the engine will receive them
(rendered text and token count), the columns the reward functions will get, and each split's
stats. Starts no actor.
"""
from __future__ import annotations

from actors.completions import stop_token_ids
from actors.rewards.functions import ANSWER_CHECKERS, gsm8k_gold, math_verify_gold, parse_number
from cluster.data.dataset import PromptStream, load_run_data, load_tokenizer, prompt_token_limit, reward_column_problem
from cluster.data.model_check import eos_warning

EXTRA_FIELDS = "_num_tokens, _finish_reason, _max_new_tokens, _overlong_buffer, _answer_key"
# A reward column is shown whole up to this many characters (a GSM8K solution is ~200-600): the
# "#### N" an answer checker reads is at its end.
COLUMN_CHARS = 2000


def _short(value, width: int = 100) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def gold_readings(checkers: list[str], answer) -> list[str]:
    """What each answer checker reads as the gold answer, e.g. 'gsm8k gold: 72' (or why it cannot)."""
    out = []
    for name in checkers:
        try:
            if name == "gsm8k":
                got = str(gsm8k_gold(answer))
            elif name == "math_verify":
                got = str(math_verify_gold(answer)[0])
            else:  # exact_match: a number, else the stripped text compared with the whole completion
                number = parse_number(answer)
                got = str(number) if number is not None else "not a number: compared as text with the whole completion"
        except Exception as e:  # noqa: BLE001 - shown, as training would meet it: a reward error per sample
            got = f"unreadable ({type(e).__name__}: {e})"
        out.append(f"{name} gold: {got}")
    return out


def _token(tokenizer, token_id) -> str:
    return "none" if token_id is None else f"{tokenizer.convert_ids_to_tokens(token_id)!r} ({token_id})"


def preview(cfg, n: int, out=print) -> None:
    """Print what `raygrpo data` shows for `cfg` (a RunConfig, cluster/config.py), `n` prompts of step 1."""
    tok = load_tokenizer(cfg.model.path)
    data = load_run_data(cfg, tok)
    r = cfg.rollout
    out(f"model: {cfg.model.path}")
    out(f"  tokenizer {type(tok).__name__}, {len(tok)} tokens; eos {_token(tok, tok.eos_token_id)}, "
        f"pad {_token(tok, tok.pad_token_id)}; chat template: {'yes' if tok.chat_template else 'none'}")
    out(f"  generation stops at token ids {stop_token_ids(cfg.model.path, tok.eos_token_id)} "
        f"(EOS + generation_config.json eos_token_id)")
    no_eos = eos_warning(cfg.model.path, r)
    if no_eos:
        out(f"  {no_eos}")
    limit = prompt_token_limit(cfg)
    source = "data.max_prompt_tokens" if cfg.data.max_prompt_tokens else \
        f"rollout.max_model_len {r.max_model_len} - rollout.max_new_tokens {r.max_new_tokens}"
    out(f"prompt limit: {limit} tokens ({source}); data.long_prompts={cfg.data.long_prompts}")
    out("")
    for report in data.reports:
        out(report.stats())
    for note in data.notes():
        out(note)

    checkers = [f for f in cfg.reward.functions if f in ANSWER_CHECKERS]
    examples = PromptStream(data.train, cfg.trainer.seed).take(min(n, len(data.train)))
    for i, e in enumerate(examples, 1):
        out("")
        out(f"--- train prompt {i} of step 1 ({e.where or 'built-in task'}): {len(e.prompt_ids)} tokens, as the engine receives it ---")
        out(e.prompt_text)
        out("--- reward functions get ---")
        kind = "chat messages" if isinstance(e.prompt, list) else "string"
        out(f"  prompt ({kind}): {_short(e.prompt)}")
        for key, value in e.fields.items():
            out(f"  {key}: {_short(value, COLUMN_CHARS)}")
            if key == cfg.reward.answer_key:
                for reading in gold_readings(checkers, value):
                    out(f"    {reading}")
        out(f"  (and from the scorer: {EXTRA_FIELDS}{', _messages, _turns' if r.env else ''})")

    out("")
    if r.env:
        out(f"rollout.env: {r.env} (an instance per trajectory, built with the row's columns), rollout.max_turns "
            f"{r.max_turns}, {r.max_new_tokens} new tokens per turn, {r.max_model_len} tokens per trajectory in all; "
            "its rewards are added to the reward functions'")
    functions = ", ".join(cfg.reward.functions) or "none (the environment's rewards only)"
    out(f"reward.functions: {functions}")
    if isinstance(data.train[0].prompt, list):
        out('  a TRL-style function gets prompts as message lists and completions as [{"role": "assistant", "content": text}]')
    missing = reward_column_problem(cfg, data)
    if missing:
        out(f"  ERROR (`raygrpo train` refuses this data): {missing}")
