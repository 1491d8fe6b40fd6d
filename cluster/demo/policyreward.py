"""A reward model for the addition task, initialised from the warm-started policy and trained on
the policy's own samples: the standard RLHF recipe, offline and deterministic.

Why not the reward model of cluster/models/tinyreward.py: trained from random weights on synthetic
wrong completions only, it ranked them well (0.96 pairwise) but GRPO found what it had never seen
and drifted down or gamed it (round sums scored high; docs/STATUS.md, "Rewards"). Here:

1. the reward model is the policy's own network (`Qwen2ForSequenceClassification` loaded from the
   warm start's weights, a fresh one-label score head, the same tokenizer): it starts from
   features that already do some addition;
2. its negatives are the policy's own wrong answers: `samples_per_prompt` completions per train
   prompt sampled from the warm start at temperature 1 (HF generate, plain torch), labelled by
   `exact_match`; a share of synthetic near misses (`wrong_completion`) stays in the mix, and a
   share of other prompts' sums: without those it learned that some answers are good whatever
   the prompt (GRPO then answered 37 or 47 to everything); positives are the sum and the
   policy's own correct samples;
3. Bradley-Terry: -log sigmoid(r(right) - r(wrong)) on pairs that share a prompt.

Like the warm start it counts steps, never time, runs on `threads` torch threads and is cached by
its spec and the policy's weights (their sha256: a warm start rebuilt in place, e.g. with other
--warm-start-steps, is another policy), so the same spec gives the same weights. Which prompts it samples
and trains on is the caller's business: the demo passes GRPO's train split, never the held-out one.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch

from actors.rewards.functions import exact_match
from cluster.data.dataset import Example
from cluster.models.tinyreward import train_bradley_terry, wrong_completion

SPEC_FILE = "raygrpo_reward_model.json"  # the same file name as tinyreward's: {"spec", "report"}
SAMPLES_FILE = "policy_samples.jsonl"  # what it trained on: {"prompt", "completion", "correct"}


@dataclasses.dataclass(frozen=True)
class PolicyRewardSpec:
    samples_per_prompt: int = 4  # policy samples per train prompt (temperature 1)
    max_new_tokens: int = 8  # as the rollout's (examples/cpu_demo.yaml)
    # Its top-scoring number is the sum on 31% of held-out prompts after 2000 steps (GRPO then learned
    # nothing), 75% after 6000 (GRPO learned): docs/STATUS.md, "Rewards"
    steps: int = 6000
    batch_size: int = 64  # pairs per step
    lr: float = 1e-3
    # The negatives' mix; the rest (half by default) are the policy's own wrong samples.
    synthetic_fraction: float = 0.25  # a near miss of any kind (tinyreward's `wrong_completion`)
    swapped_fraction: float = 0.25  # another prompt's sum (every answer is a negative as often as it is a
    #                                 positive, so no answer is good on its own)
    policy_positive_fraction: float = 0.5  # of the positives: a correct policy sample (when there is one)
    seed: int = 0
    threads: int = 1  # torch threads; another count gives another floating-point trajectory
    num_check: int = 300  # train prompts held out of this training, for the report


def sample_policy(policy_dir: str | os.PathLike, examples: list[Example], spec: PolicyRewardSpec,
                  batch_prompts: int = 64) -> list[dict]:
    """`spec.samples_per_prompt` completions of each prompt from the policy at temperature 1 (no top-k or
    top-p), each labelled with exact_match: [{"prompt", "completion", "correct"}]. Deterministic for a
    given spec, thread count and CPU (one seed, fixed batches)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    torch.manual_seed(spec.seed)
    out = []
    with torch.no_grad():
        for i in range(0, len(examples), batch_prompts):
            chunk = examples[i:i + batch_prompts]
            enc = tok([e.prompt for e in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
            gen = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=spec.max_new_tokens, num_return_sequences=spec.samples_per_prompt,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            for j, text in enumerate(texts):
                e = chunk[j // spec.samples_per_prompt]
                out.append({"prompt": e.prompt, "completion": text, "correct": exact_match(e.prompt, text, **e.fields) == 1.0})
    return out


def build_policy_reward_model(policy_dir: str | os.PathLike, out_dir: str | os.PathLike, examples: list[Example],
                              spec: PolicyRewardSpec = PolicyRewardSpec(), progress: bool = True) -> Path:
    """Write (or reuse) the reward model of `spec`, initialised from `policy_dir` and trained on its samples
    of `examples`' prompts, in `out_dir`; returns the directory."""
    out = Path(out_dir)
    policy = Path(policy_dir).resolve()
    key = {**dataclasses.asdict(spec), "policy": str(policy), "policy_sha256": _weights_sha256(policy),
           "n": len(examples), "first": examples[0].prompt if examples else ""}
    if (out / SPEC_FILE).is_file() and json.loads((out / SPEC_FILE).read_text()).get("spec") == key:
        return out
    if out.exists():  # a stale one (another spec or policy): the cache dir is ours, rebuild it
        shutil.rmtree(out)
    if len(examples) <= spec.num_check + spec.batch_size:
        raise ValueError(f"policy reward model: {len(examples)} examples cannot spare num_check={spec.num_check}")
    threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    try:
        return _build(policy, out, examples, spec, key, progress)
    finally:
        torch.set_num_threads(threads)


def _weights_sha256(policy: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(policy.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


def _split(examples: list[Example], spec: PolicyRewardSpec) -> tuple[list[Example], list[Example]]:
    shuffled = list(examples)
    random.Random(f"policy-reward-{spec.seed}").shuffle(shuffled)
    return shuffled[spec.num_check:], shuffled[:spec.num_check]


def _by_prompt(samples: list[dict]) -> dict[str, dict[bool, list[str]]]:
    grouped: dict[str, dict[bool, list[str]]] = {}
    for s in samples:
        grouped.setdefault(s["prompt"], {True: [], False: []})[s["correct"]].append(s["completion"])
    return grouped


def _pair(e: Example, own: dict[bool, list[str]], spec: PolicyRewardSpec, rng: random.Random,
          others: list[Example]) -> tuple[str, str]:
    """(a right completion, a wrong one) for one prompt; `others` lends its sums as wrong answers."""
    answer = e.fields["answer"]
    right = (rng.choice(own[True]) if own[True] and rng.random() < spec.policy_positive_fraction else answer)
    kind = rng.random()
    if kind < spec.swapped_fraction:
        wrong = rng.choice(others).fields["answer"]
    elif kind < spec.swapped_fraction + spec.synthetic_fraction or not own[False]:
        wrong = wrong_completion(int(answer), rng)
    else:
        wrong = rng.choice(own[False])
    while exact_match(e.prompt, wrong, **e.fields) == 1.0:  # "46+" is still right, so is a swapped equal sum
        wrong = wrong_completion(int(answer), rng)
    return right, wrong


def _scores(model, tok, texts: list[str]):
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return model(**enc).logits[:, 0]


def _build(policy: Path, out: Path, examples: list[Example], spec: PolicyRewardSpec, key: dict, progress: bool) -> Path:
    from transformers import AutoTokenizer, Qwen2ForSequenceClassification

    train, check = _split(examples, spec)
    samples = sample_policy(policy, train + check, spec)
    own = _by_prompt(samples)
    if progress:
        right = sum(s["correct"] for s in samples) / len(samples)
        print(f"policy reward model: {len(samples)} samples of the policy, {100 * right:.1f}% right", flush=True)
    tok = AutoTokenizer.from_pretrained(policy)
    tok.padding_side = "right"  # transformers reads the score at the last token that is not padding
    torch.manual_seed(spec.seed)  # the fresh score head
    model = Qwen2ForSequenceClassification.from_pretrained(policy, num_labels=1, dtype=torch.float32,
                                                           pad_token_id=tok.pad_token_id)
    rng = random.Random(spec.seed)

    def pairs() -> tuple[list[str], list[str]]:
        batch = rng.sample(train, spec.batch_size)
        chosen = [_pair(e, own[e.prompt], spec, rng, train) for e in batch]
        return [e.prompt + p[0] for e, p in zip(batch, chosen)], [e.prompt + p[1] for e, p in zip(batch, chosen)]

    train_bradley_terry(model, lambda texts: _scores(model, tok, texts), pairs, spec.steps, spec.lr,
                        "policy reward model" if progress else "")
    report = check_report(model, tok, check, own, random.Random(f"check-{spec.seed}"))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        with open(tmp / SAMPLES_FILE, "w") as f:
            f.writelines(json.dumps(s) + "\n" for s in samples)
        (tmp / SPEC_FILE).write_text(json.dumps({"spec": key, "report": report}))
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if progress:
        print(f"policy reward model: {describe(report)}; saved to {out}", flush=True)
    return out


def check_report(model, tok, check: list[Example], own: dict[str, dict[bool, list[str]]], rng: random.Random,
                 num_argmax: int = 100) -> dict:
    """On prompts it never trained on: how often the sum scores above each of the policy's wrong samples
    and above a near miss; best-of-n (the policy's samples of a prompt, the top-scoring one picked: how
    often it is right, against how often a sample is right); and argmax: on `num_argmax` prompts, how
    often the sum is the top-scoring of every number from 0 to twice the largest sum, which is where a
    policy that climbs this reward without limit ends up."""
    vs_policy, vs_near, best, top = [0, 0], [0, 0], [0, 0], [0, 0]
    numbers = [str(n) for n in range(2 * max(int(e.fields["answer"]) for e in check) + 1)]
    with torch.no_grad():
        for i, e in enumerate(check):
            answer, right, wrong = e.fields["answer"], own[e.prompt][True], own[e.prompt][False]
            near = [wrong_completion(int(answer), rng) for _ in range(4)]
            near = [w for w in near if exact_match(e.prompt, w, **e.fields) != 1.0]
            r = _scores(model, tok, [e.prompt + c for c in [answer, *wrong, *near, *right]]).tolist()
            r_wrong, r_near = r[1:1 + len(wrong)], r[1 + len(wrong):1 + len(wrong) + len(near)]
            r_right = r[1 + len(wrong) + len(near):]
            vs_policy = [vs_policy[0] + sum(r[0] > x for x in r_wrong), vs_policy[1] + len(r_wrong)]
            vs_near = [vs_near[0] + sum(r[0] > x for x in r_near), vs_near[1] + len(r_near)]
            if right and wrong:  # best-of-n only means something with both kinds
                best = [best[0] + (max(r_right) > max(r_wrong)), best[1] + 1]
            if i < num_argmax:
                r_all = _scores(model, tok, [e.prompt + n for n in numbers])
                top = [top[0] + (numbers[int(r_all.argmax())] == answer), top[1] + 1]
    n_right = sum(len(own[e.prompt][True]) for e in check)
    n_all = sum(len(own[e.prompt][True]) + len(own[e.prompt][False]) for e in check)
    return {"check_prompts": len(check), "vs_policy_wrong": vs_policy[0] / max(1, vs_policy[1]),
            "vs_near_misses": vs_near[0] / max(1, vs_near[1]), "best_of_n_right": best[0] / max(1, best[1]),
            "best_of_n_prompts": best[1], "samples_right": n_right / max(1, n_all),
            "argmax_right": top[0] / max(1, top[1]), "argmax_prompts": top[1]}


def describe(report: dict) -> str:
    return (f"ranks the sum above the policy's wrong samples {100 * report['vs_policy_wrong']:.1f}% and above near "
            f"misses {100 * report['vs_near_misses']:.1f}% of the time on {report['check_prompts']} held-out prompts; "
            f"picks a right sample {100 * report['best_of_n_right']:.1f}% of the time on the "
            f"{report['best_of_n_prompts']} of them with both kinds; its top-scoring number is the sum on "
            f"{100 * report['argmax_right']:.1f}% of {report['argmax_prompts']}")


def policy_reward_result(out_dir: str | os.PathLike) -> dict:
    """{"spec": ..., "report": ...} of a built policy reward model."""
    return json.loads((Path(out_dir) / SPEC_FILE).read_text())
