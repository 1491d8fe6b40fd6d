"""How the `chat` and `tools` recipes' warm starts check themselves (cluster/models/warmstart.py
`check`): plain transformers generation in the warm start's own process, no engines.

chat   greedy single-turn accuracy under the `gsm8k` verdict (the recipe's reward);
tools  greedy accuracy with the first turn forced to open a calculator call ("calc("), the
       calculator in the loop: whether the model can use the tool once it calls it. The warm start
       stops there, before calling becomes its habit (its unforced greedy tool-call rate stays at or
       below one half, the condition of issue 28), and GRPO has to learn to call.
"""
from __future__ import annotations

import torch

from actors.multiturn.envs import CalculatorEnv
from actors.multiturn.trajectories import ChatTokens
from actors.rewards.functions import gsm8k
from cluster.data.dataset import Example

CHUNK = 64  # prompts per generate call


def _generate(model, tok, contexts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of token-id contexts (left-padded), each cut after its EOS."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    n = max(map(len, contexts))
    ids = torch.full((len(contexts), n), pad)
    att = torch.zeros((len(contexts), n), dtype=torch.long)
    for i, c in enumerate(contexts):
        ids[i, n - len(c):], att[i, n - len(c):] = torch.tensor(c), 1
    out = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=pad, eos_token_id=tok.eos_token_id)
    rows = []
    for row in out[:, n:].tolist():
        rows.append(row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
    return rows


def gsm8k_accuracy(model, tok, examples: list[Example], max_new_tokens: int = 24) -> float:
    """The chat recipe's check: greedy single-turn, judged by the gsm8k reward."""
    with torch.no_grad():
        gens = []
        for s in range(0, len(examples), CHUNK):
            gens += _generate(model, tok, [list(e.prompt_ids) for e in examples[s:s + CHUNK]], max_new_tokens)
    ok = [gsm8k(e.prompt, tok.decode(g, skip_special_tokens=True), answer=e.fields["answer"]) == 1.0
          for e, g in zip(examples, gens)]
    return sum(ok) / len(ok)


def calculator_trajectories(model, tok, examples: list[Example], force: str = "", max_turns: int = 3,
                            max_new_tokens: int = 16) -> list[tuple[str, int]]:
    """Per example, (the last assistant turn's text, tool calls) of a greedy conversation with the
    calculator environment; `force` is put at the start of the first turn."""
    chat = ChatTokens(tok)
    out = [("", 0)] * len(examples)
    state = {i: (list(e.prompt_ids), list(e.prompt), 0, CalculatorEnv()) for i, e in enumerate(examples)}
    forced = list(tok.encode(force, add_special_tokens=False)) if force else []
    with torch.no_grad():
        for turn in range(max_turns):
            keys, pre = list(state), forced if turn == 0 else []
            for s in range(0, len(keys), CHUNK):
                chunk = keys[s:s + CHUNK]
                for i, ids in zip(chunk, _generate(model, tok, [state[i][0] + pre for i in chunk], max_new_tokens)):
                    ids = pre + ids
                    ctx, msgs, calls, env = state[i]
                    ended = bool(ids) and ids[-1] == chat.eos
                    text = tok.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
                    msgs = msgs + [{"role": "assistant", "content": text}]
                    res = env.step(text)
                    calls += sum(m["role"] == "tool" for m in res["messages"])
                    if res["done"] or turn + 1 == max_turns:
                        out[i] = (text, calls)
                        del state[i]
                    else:
                        suffix = chat.env_suffix(msgs, res["messages"], ended)
                        state[i] = (ctx + ids + suffix, msgs + res["messages"], calls, env)
    return out


def forced_call_accuracy(model, tok, examples: list[Example]) -> float:
    """The tools recipe's check: greedy accuracy when the first turn opens a calculator call."""
    outs = calculator_trajectories(model, tok, examples, force="calc(")
    ok = [gsm8k(e.prompt, text, answer=e.fields["answer"]) == 1.0 for e, (text, _) in zip(examples, outs)]
    called = sum(c > 0 for _, c in outs)
    print(f"    forced-call check: accuracy {sum(ok) / len(ok):.3f}, calls made {called}/{len(ok)}", flush=True)
    return sum(ok) / len(ok)
