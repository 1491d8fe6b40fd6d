"""A short supervised warm start on a task's format, so GRPO starts from a model that is
sometimes right (a random model never is, and then every group's rewards are equal).

Plain torch, one process: teacher-forced cross-entropy on `prompt + answer + <eos>`, loss on
the answer tokens only. It counts steps, never time, so the result does not depend on machine
load, and the result is cached by its spec. With `target_accuracy` it stops once `checks_in_a_row`
consecutive checks (every `check_every` steps, greedy decoding on `num_check` train prompts it
never trains on) reach the target: a fixed step count lands at different accuracies on different CPUs
(their kernels round differently, and the accuracy climbs steeply), a target lands every
machine at about the same place. `steps` is then the cap.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from actors.rewards.functions import exact_match
from cluster.data.dataset import Example

SPEC_FILE = "raygrpo_warmstart_spec.json"
RESULT_FILE = "raygrpo_warmstart_result.json"  # {"steps": taken, "accuracy": at the last check or null}


@dataclasses.dataclass(frozen=True)
class WarmStartSpec:
    steps: int = 300
    batch_size: int = 64
    lr: float = 1e-3
    seed: int = 0
    target_accuracy: float | None = None  # stop once `checks_in_a_row` checks reach it (None: run `steps`)
    checks_in_a_row: int = 2  # one check can be a spike: the accuracy swings +-10 points between checks
    check_every: int = 20
    num_check: int = 200
    threads: int = 1  # torch threads; other counts (or CPUs) give a different floating-point trajectory


# What a warm start trains on and how it checks itself; a recipe may bring its own (cluster/demo/recipes.py).
Sequence = Callable[[object, Example], tuple[list[int], list[int]]]  # (tokenizer, example) -> (ids, loss mask)
Check = Callable[[object, object, list[Example]], float]  # (model, tokenizer, check examples) -> accuracy


def answer_sequence(tok, e: Example) -> tuple[list[int], list[int]]:
    """prompt + answer + eos, the loss on the answer and eos."""
    # a rendered example (chat template applied at load) brings its ids; a task prompt is encoded here
    p = list(e.prompt_ids) or tok(e.prompt, add_special_tokens=False)["input_ids"]
    a = tok(e.fields["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return p + a, [0] * len(p) + [1] * len(a)


def _encode(tok, examples: list[Example], sequence: Sequence = answer_sequence):
    seqs, masks = [], []
    for e in examples:
        s, m = sequence(tok, e)
        seqs.append(s)
        masks.append(m)
    n = max(map(len, seqs))
    ids = torch.full((len(seqs), n), tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    lab = torch.zeros((len(seqs), n), dtype=torch.bool)
    att = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, : len(s)], lab[i, : len(m)], att[i, : len(s)] = torch.tensor(s), torch.tensor(m, dtype=torch.bool), 1
    return ids, att, lab


def greedy_accuracy(model, tok, examples: list[Example], max_new_tokens: int = 8) -> float:
    """Fraction of prompts whose greedy completion's final number equals the answer (HF generate)."""
    tok.padding_side = "left"
    correct = 0
    with torch.no_grad():
        for i in range(0, len(examples), 64):
            chunk = examples[i : i + 64]
            enc = tok([e.prompt for e in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id)
            for e, row in zip(chunk, out[:, enc["input_ids"].shape[1]:]):
                correct += exact_match(e.prompt, tok.decode(row, skip_special_tokens=True), **e.fields) == 1.0
    return correct / len(examples)


def warm_start(base_dir: str | os.PathLike, out_dir: str | os.PathLike, train: list[Example],
               spec: WarmStartSpec = WarmStartSpec(), progress: bool = True, *, sequence: Sequence = answer_sequence,
               check: Check = greedy_accuracy, task: str = "") -> Path:
    """Fine-tune `base_dir` on `train` (spec.steps, or until spec.target_accuracy); write (or reuse) `out_dir`.
    `warm_start_result(out_dir)` then says how many steps it took and the accuracy it reached.
    `sequence` and `check`: what it trains on and how it checks itself; `task` names them in the cache key."""
    out = Path(out_dir)
    first = train[0].prompt if train else ""
    key = json.dumps({**dataclasses.asdict(spec), "base": str(Path(base_dir).resolve()), "n": len(train), "first": first,
                      **({"task": task} if task else {})}, sort_keys=True)
    if (out / SPEC_FILE).exists() and (out / SPEC_FILE).read_text() == key and (out / RESULT_FILE).exists():
        return out
    if spec.target_accuracy is not None and len(train) <= spec.num_check + spec.batch_size:
        raise ValueError(f"warm start: {len(train)} train examples cannot spare num_check={spec.num_check} for checks")
    # A fixed thread count, not the core count: the result must not depend on the machine's size.
    threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    try:
        return _train_and_save(base_dir, out, train, spec, key, progress, sequence, check)
    finally:
        torch.set_num_threads(threads)


def _train_and_save(base_dir, out: Path, train: list[Example], spec: WarmStartSpec, key: str, progress: bool,
                    sequence: Sequence, check_fn: Check) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(spec.seed)
    rng = random.Random(spec.seed)
    check: list[Example] = []
    if spec.target_accuracy is not None:  # held out from this training, not from GRPO's evaluation split
        train = list(train)
        random.Random(f"warm-check-{spec.seed}").shuffle(train)
        check, train = train[: spec.num_check], train[spec.num_check :]
    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))  # short warm-up
    steps = range(spec.steps)
    tty = sys.stderr.isatty()
    if progress and tty:
        steps = tqdm(steps, desc="warm start (supervised)", unit="step")
    taken, accuracy, reached = spec.steps, None, 0
    for step in steps:
        if check and step > 0 and step % spec.check_every == 0:
            model.eval()
            accuracy = check_fn(model, tok, check)
            model.train()
            if progress:
                print(f"warm start: step {step}, greedy accuracy {accuracy:.3f} on {len(check)} held-out prompts "
                      f"(target {spec.target_accuracy:.2f})", flush=True)
            reached = reached + 1 if accuracy >= spec.target_accuracy else 0
            if reached >= spec.checks_in_a_row:
                taken = step
                break
        if progress and not tty and step % 100 == 0:
            print(f"warm start: step {step}/{spec.steps}", flush=True)
        ids, att, lab = _encode(tok, rng.sample(train, spec.batch_size), sequence)
        logits = model(input_ids=ids, attention_mask=att).logits[:, :-1]
        target, mask = ids[:, 1:], lab[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[mask], target[mask])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    model.eval()
    if check and taken == spec.steps:
        accuracy = check_fn(model, tok, check)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        shutil.rmtree(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / SPEC_FILE).write_text(key)
    (tmp / RESULT_FILE).write_text(json.dumps({"steps": taken, "accuracy": accuracy}))
    os.replace(tmp, out)
    return out


def warm_start_result(out_dir: str | os.PathLike) -> dict:
    """{"steps": steps taken, "accuracy": greedy accuracy on the warm start's check split, or None}."""
    return json.loads((Path(out_dir) / RESULT_FILE).read_text())
