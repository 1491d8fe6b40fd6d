"""A tiny reward model for the addition task, built and trained offline.

A Qwen2ForSequenceClassification (one label) with the character-level tokenizer of
cluster/models/tinymodel.py, trained with the Bradley-Terry loss -log sigmoid(r(correct) - r(wrong)) on
pairs that share a prompt: `a+b=` followed by the sum, against a wrong completion of the kinds a
policy writes (near misses, other numbers, dropped or extra digits, trailing junk). It counts
steps, never time, and is cached by its spec, so the same spec gives the same weights.

What it is for: a `model:PATH` reward in tests and in the reward-model recipe, where GRPO must
learn addition from this model's scores alone. `pairwise_accuracy` says how often it ranks the
sum above a wrong completion on prompts it never trained on (recorded in raygrpo_reward_model.json).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch

from cluster.data.dataset import Example, arithmetic_examples
from cluster.models.tinymodel import build_tokenizer

SPEC_FILE = "raygrpo_reward_model.json"


@dataclasses.dataclass(frozen=True)
class RewardModelSpec:
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    digits: int = 2
    steps: int = 400
    batch_size: int = 64  # prompts per step, one (correct, wrong) pair each
    lr: float = 1e-3
    seed: int = 0
    threads: int = 1  # torch threads; another count gives another floating-point trajectory
    num_check: int = 300  # prompts held out of training, for the pairwise accuracy
    negatives: str = "near-misses-2"  # which mix `wrong_completion` draws (part of the cache key)


def wrong_completion(answer: int, rng: random.Random) -> str:
    """A completion that is not the sum, of the kinds a policy writes. Most are near misses (one digit
    wrong, a carry lost or added): telling those from the sum takes doing the addition."""
    text = str(answer)
    kind = rng.random()
    if kind < 0.35:  # one digit replaced by another
        i = rng.randrange(len(text))
        digits = [d for d in "0123456789" if d != text[i] and not (i == 0 and d == "0" and len(text) > 1)]
        return text[:i] + rng.choice(digits) + text[i + 1:]
    if kind < 0.5:  # a carry lost or added, or off by one
        return str(max(0, answer + rng.choice([-10, 10, -1, 1])))
    if kind < 0.65:  # another number
        return str(rng.choice([n for n in range(0, 200) if n != answer]))
    if kind < 0.75 and len(text) > 1:  # a digit dropped
        i = rng.randrange(len(text))
        return text[:i] + text[i + 1:]
    if kind < 0.85:  # a digit too many
        i = rng.randrange(len(text) + 1)
        return text[:i] + str(rng.randrange(10)) + text[i:]
    return rng.choice([text + "+", text + "=", text + " 1", text + text, "", "="])


def build_reward_model(out_dir: str | os.PathLike, spec: RewardModelSpec = RewardModelSpec(), progress: bool = True) -> Path:
    """Write (or reuse) the trained reward model of `spec` in `out_dir`; returns the directory."""
    out = Path(out_dir)
    key = json.dumps(dataclasses.asdict(spec), sort_keys=True)
    if (out / SPEC_FILE).is_file() and json.loads((out / SPEC_FILE).read_text()).get("spec") == json.loads(key):
        return out
    if out.exists():
        raise FileExistsError(f"{out} exists but holds another reward model; remove it or choose another directory")
    threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    try:
        return _train_and_save(out, spec, json.loads(key), progress)
    finally:
        torch.set_num_threads(threads)


def _split(spec: RewardModelSpec) -> tuple[list[Example], list[Example]]:
    examples = arithmetic_examples("addition", spec.digits)
    random.Random(f"reward-model-{spec.seed}").shuffle(examples)
    return examples[spec.num_check:], examples[:spec.num_check]


def _batch(tok, texts: list[str]):
    ids = [tok(t)["input_ids"] for t in texts]
    width = max(map(len, ids))
    input_ids = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
    return input_ids, mask


def _scores(model, tok, texts: list[str]):
    input_ids, mask = _batch(tok, texts)
    return model(input_ids=input_ids, attention_mask=mask).logits[:, 0]


def train_bradley_terry(model, scores, pairs, steps: int, lr: float, progress: str = "") -> None:
    """Bradley-Terry: minimise -log sigmoid(r(right) - r(wrong)) over `steps` batches of `pairs()`
    (right texts, wrong texts), AdamW with a 20-step warm-up and a linear decay to 5%; `scores(texts)`
    gives the model's rewards. `progress`: a name to print the loss under every 100 steps ("": silent)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / steps))
    model.train()
    for step in range(steps):
        right, wrong = pairs()
        r = scores(right + wrong)
        loss = -torch.nn.functional.logsigmoid(r[:len(right)] - r[len(right):]).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if progress and step % 100 == 0:
            print(f"{progress}: step {step}/{steps}, loss {loss.item():.3f}", flush=True)
    model.eval()


def _train_and_save(out: Path, spec: RewardModelSpec, spec_dict: dict, progress: bool) -> Path:
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(spec.seed)
    rng = random.Random(spec.seed)
    tok = build_tokenizer()
    config = Qwen2Config(vocab_size=(len(tok) + 63) // 64 * 64, hidden_size=spec.hidden_size,
                         intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                         num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                         max_position_embeddings=64, num_labels=1, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, torch_dtype="float32")
    model = Qwen2ForSequenceClassification(config).to(torch.float32)
    train, check = _split(spec)

    def pairs() -> tuple[list[str], list[str]]:
        batch = rng.sample(train, spec.batch_size)
        good = [e.prompt + e.fields["answer"] for e in batch]
        return good, [e.prompt + wrong_completion(int(e.fields["answer"]), rng) for e in batch]

    train_bradley_terry(model, lambda texts: _scores(model, tok, texts), pairs, spec.steps, spec.lr,
                        "reward model" if progress else "")
    accuracy = pairwise_accuracy(model, tok, check, random.Random(f"check-{spec.seed}"))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / SPEC_FILE).write_text(json.dumps({"spec": spec_dict, "pairwise_accuracy": accuracy,
                                                 "check_prompts": len(check)}))
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if progress:
        print(f"reward model: ranks the sum above a wrong completion on {100 * accuracy:.1f}% of "
              f"{len(check)} held-out prompts; saved to {out}", flush=True)
    return out


def pairwise_accuracy(model, tok, examples: list[Example], rng: random.Random, per_prompt: int = 4) -> float:
    """How often the sum scores above a wrong completion (`per_prompt` wrong ones per prompt)."""
    wins = total = 0
    with torch.no_grad():
        for e in examples:
            answer = e.fields["answer"]
            wrong = [wrong_completion(int(answer), rng) for _ in range(per_prompt)]
            r = _scores(model, tok, [e.prompt + answer] + [e.prompt + w for w in wrong])
            wins += int((r[0] > r[1:]).sum())
            total += per_prompt
    return wins / total


def reward_model_result(out_dir: str | os.PathLike) -> dict:
    """{"spec": ..., "pairwise_accuracy": ..., "check_prompts": ...} of a built reward model."""
    return json.loads((Path(out_dir) / SPEC_FILE).read_text())


def main(argv: list[str] | None = None) -> int:
    """`python -m cluster.models.tinyreward [OUT_DIR]`: build the addition reward model that
    examples/reward_model.yaml points at (cached: a second call returns at once)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("out", nargs="?", default=".cache/reward_model/addition-rm", help="where the model goes")
    parser.add_argument("--steps", type=int, default=RewardModelSpec.steps)
    parser.add_argument("--seed", type=int, default=RewardModelSpec.seed)
    args = parser.parse_args(argv)
    out = build_reward_model(args.out, dataclasses.replace(RewardModelSpec(), steps=args.steps, seed=args.seed))
    result = reward_model_result(out)
    print(f"{out}: pairwise accuracy {result['pairwise_accuracy']:.3f} on {result['check_prompts']} held-out prompts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
