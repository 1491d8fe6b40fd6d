"""A tiny model whose completions have long-tailed lengths, from its own sampling (EOS).

The random tiny model (tinymodel.py) puts about 1/vocab of its probability on <eos> at every
token, so its completions run to max_new_tokens. This one is the same model with the <eos> row of
its (untied) output layer replaced by `eos_logit` x mu / |mu|^2, where mu is the mean of the
model's final hidden states over sampled text: the <eos> logit is then about `eos_logit` at every
position (it varies with the hidden state's projection on mu, 0.5-1.4 x between the 5th and 95th
percentile on the default size), every other logit about 0 +- 0.23. Stopping is a per-token draw,
so lengths are near geometric, a mixture of rates: most completions short, a few up to the cap.
Measured on the default size (hidden 128, 4 layers, temperature 1, no top-k/top-p, 128 new tokens
at most) with eos_logit 1.4: mean 33, p50 24, p90 78, 2% capped (HF sampling, 256 completions);
1.8: mean 22, p50 15, p90 50, 0.4% capped. The bench prints the distribution each run actually got.

Nothing fakes the engine: vLLM samples <eos> like any token; the learner trains the row like any other.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from cluster.models.tinymodel import EOS, TinyModelSpec, build_tiny_model, is_cached, save_model_dir

# Text the mean hidden state is taken over: the bench's task prompts, then what the model samples after them.
PROBE_PROMPTS = tuple(f"{a}+{b}=" for a, b in zip(range(10, 90, 5), range(33, 99, 4)))
PROBE_TOKENS = 64


def build_longtail_model(out_dir: str | os.PathLike, base_dir: str | os.PathLike, spec: TinyModelSpec,
                         eos_logit: float) -> Path:
    """Write (or reuse) the long-tailed variant of the tiny model of `spec` (built into `base_dir` if
    missing); returns `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    spec_json = json.dumps({"base": dataclasses.asdict(spec), "eos_logit": eos_logit, "probe_prompts": PROBE_PROMPTS,
                            "probe_tokens": PROBE_TOKENS}, sort_keys=True)
    if is_cached(out, spec_json):
        return out
    base = build_tiny_model(base_dir, spec)
    tok = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    eos = tok.convert_tokens_to_ids(EOS)
    with torch.no_grad():
        mu = mean_hidden_state(model, tok)
        head = model.get_input_embeddings().weight.detach().clone()  # tied: the output layer is the embedding
        head[eos] = eos_logit * mu / mu.dot(mu)
        model.config.tie_word_embeddings = False
        model.lm_head = torch.nn.Linear(head.shape[1], head.shape[0], bias=False)
        model.lm_head.weight = torch.nn.Parameter(head)
    save_model_dir(out, model, tok, spec_json)
    return out


def mean_hidden_state(model, tok) -> torch.Tensor:
    """Mean final (normed) hidden state over the probe prompts and PROBE_TOKENS sampled tokens after each
    (seeded; <eos> not allowed to stop them)."""
    ids = tok(list(PROBE_PROMPTS), return_tensors="pt", padding=True).input_ids
    gen = torch.Generator().manual_seed(0)
    seq = ids
    for _ in range(PROBE_TOKENS):  # plain sampling loop: no dependence on generate()'s defaults
        logits = model(seq).logits[:, -1, :]
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
        seq = torch.cat([seq, nxt], dim=1)
    h = model.model(seq).last_hidden_state
    return h.reshape(-1, h.shape[-1]).mean(0)
