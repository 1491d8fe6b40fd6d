"""5. TRL's GRPOTrainer on the same task, in its own environment (.venv-bench)."""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from actors.rewards.functions import exact_match
from cluster.bench.report import (
    BENCH_VENV,
    SUBPROCESS_MODULE,
    TRL_REQUIREMENT,
    jsonable,
    mean,
    progress,
    saying_every,
)
from cluster.bench.rollout import renice_to
from cluster.bench.schedule import heldout_examples
from cluster.data.dataset import PromptStream, load_splits
from cluster.launch.ray_cluster import WORKER_ENV
from cluster.models.warmstart import greedy_accuracy
from cluster.paths import PROJECT_ROOT


def bench_venv_python(root: Path = PROJECT_ROOT) -> Path:
    return root / BENCH_VENV / "bin" / "python"


def _venv_site_packages(python: Path) -> str:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _trl_version(python: Path) -> str | None:
    if not python.exists():
        return None
    out = subprocess.run([str(python), "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True,
                         cwd="/", timeout=300)
    return out.stdout.strip() if out.returncode == 0 else None


def ensure_bench_venv(root: Path = PROJECT_ROOT, log=progress) -> tuple[Path | None, str]:
    """(python of .venv-bench with TRL, message) or (None, why not).

    .venv-bench is a venv whose site-packages holds a .pth that adds THIS environment's
    site-packages (so torch, transformers, accelerate... are shared, not copied), plus what TRL
    needs that is missing here. Every package already installed here is pinned by a constraints
    file, so the install cannot move transformers or torch; this is checked afterwards.
    """
    py = bench_venv_python(root)
    version = _trl_version(py)
    if version and version.startswith("1.16"):
        return py, f"reused {root / BENCH_VENV} (trl {version})"
    venv = root / BENCH_VENV
    log(f"TRL: creating {venv} (reuses this environment's packages through a .pth; installs {TRL_REQUIREMENT})")
    try:
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, text=True)
        here = sysconfig.get_paths()["purelib"]
        site = Path(_venv_site_packages(py))
        # `import site; site.addsitedir(...)` (not a bare path) so the .pth files over there run too
        # (e.g. this package's editable install).
        (site / "_raygrpo_base_env.pth").write_text(f"import site; site.addsitedir({here!r})\n")
        pins = sorted({f"{d.metadata['Name']}=={d.version}" for d in md.distributions(path=[here])
                       if d.metadata["Name"] and d.metadata["Name"].lower() not in ("raygrpo", "pip", "setuptools")})
        constraints = venv / "constraints-base-env.txt"
        constraints.write_text("\n".join(pins) + "\n")
        with saying_every(25, f"TRL: installing {TRL_REQUIREMENT}"):
            proc = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                                   "-c", str(constraints), TRL_REQUIREMENT], capture_output=True, text=True,
                                  timeout=1200)
        if proc.returncode != 0:
            return None, f"pip install {TRL_REQUIREMENT} into {venv} failed: {(proc.stderr or proc.stdout).strip()[-600:]}"
    except (subprocess.SubprocessError, OSError) as e:
        return None, f"could not create {venv}: {e}"
    version = _trl_version(py)
    if not version:
        return None, f"{venv} was created but `import trl` fails there"
    check = subprocess.run([str(py), "-c", "import torch, transformers; print(torch.__version__, transformers.__version__, "
                            "transformers.__file__)"], capture_output=True, text=True, cwd="/")
    return py, f"created {venv} (trl {version}; torch/transformers there: {check.stdout.strip()})"


def bench_venv_report(py: Path) -> dict:
    """What .venv-bench holds itself (everything else comes from the base environment)."""
    site = _venv_site_packages(py)
    out = subprocess.run([str(py), "-m", "pip", "list", "--format=json", "--path", site, "--disable-pip-version-check"],
                         capture_output=True, text=True)
    own = json.loads(out.stdout) if out.returncode == 0 and out.stdout.strip() else []
    ver = subprocess.run([str(py), "-c", "import json, torch, transformers, trl; print(json.dumps({'torch': "
                          "torch.__version__, 'transformers': transformers.__version__, 'transformers_path': "
                          "transformers.__file__, 'trl': trl.__version__}))"], capture_output=True, text=True, cwd="/")
    return {"own_packages": {p["name"]: p["version"] for p in own},
            "versions": json.loads(ver.stdout) if ver.returncode == 0 else {"error": ver.stderr[-400:]}}


def parse_threads(spec: str) -> list[int]:
    """--trl-threads: "1" or "1,2"; 0 means every CPU of the machine."""
    out = []
    for part in str(spec).split(","):
        if part.strip():
            n = int(part)
            n = n if n > 0 else (os.cpu_count() or 1)
            if n not in out:
                out.append(n)
    return out or [1]


def trl_settings(cfg, model: str, threads: int) -> dict:
    """Everything the TRL run needs, derived from OUR run's config so both do the same work."""
    t, r, lrn, algo = cfg.trainer, cfg.rollout, cfg.learner, cfg.algo
    n_seq = t.prompts_per_step * t.group_size
    mb = min(lrn.micro_batch_size, n_seq)
    while n_seq % mb or mb % t.group_size:  # TRL: micro-batches of whole groups that tile the batch
        mb -= 1
    return {"model": model, "steps": t.steps, "prompts_per_step": t.prompts_per_step, "group_size": t.group_size,
            "micro_batch_size": mb, "grad_accum": n_seq // mb, "max_new_tokens": r.max_new_tokens,
            "min_new_tokens": r.min_new_tokens, "lr": lrn.lr,
            "beta": algo.beta, "clip_low": algo.clip_low, "clip_high": algo.clip_high, "mu": lrn.mu,
            "temperature": r.temperature, "top_p": r.top_p, "top_k": max(0, r.top_k), "grad_clip": lrn.grad_clip,
            "weight_decay": lrn.weight_decay, "adam_beta1": lrn.adam_beta1, "adam_beta2": lrn.adam_beta2,
            "adam_eps": lrn.adam_eps, "seed": t.seed, "threads": threads,
            # learner.dtype=bfloat16: TRL trains in its bf16 mode too (autocast over float32 weights)
            "bf16": lrn.dtype == "bfloat16",
            "data": {"train": cfg.data.train, "eval": cfg.data.eval, "num_eval": cfg.data.num_eval,
                     "task_digits": cfg.data.task_digits}}


class PhaseTimer:
    """GRPOTrainer's phases per optimizer step, timed by wrapping its methods on the instance:
    generation (`_generate`), rewards (`_calculate_rewards`), the reference's log-probs
    (`_get_per_token_logps_and_entropies` called with `ref_model`) and the whole of
    `_generate_and_score_completions`; training is the step's time outside that. Tokens: completion
    tokens generated, prompt + completion tokens trained (real ones, padding left out), as raygrpo counts.
    A TrainerCallback (its hooks are duck-typed here, so this module needs no TRL import)."""

    KEYS = ("gen_s", "reward_s", "ref_s", "score_s", "gen_tokens", "train_tokens")

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.cur = dict.fromkeys(self.KEYS, 0.0)
        self.steps: dict[str, list[float]] = {k: [] for k in (*self.KEYS, "train_s", "step_s")}

    def attach(self, trainer) -> None:
        def timed(name, key, when=None, count=False):
            fn = getattr(trainer, name)

            def wrapper(*a, **kw):
                if when is not None and not when(*a, **kw):
                    return fn(*a, **kw)
                t = self.clock()
                out = fn(*a, **kw)
                self.cur[key] += self.clock() - t
                if count:
                    completion = float(out["completion_mask"].sum())
                    self.cur["gen_tokens"] += completion
                    self.cur["train_tokens"] += completion + float(out["prompt_mask"].sum())
                return out
            setattr(trainer, name, wrapper)

        timed("_generate", "gen_s")
        timed("_calculate_rewards", "reward_s")
        timed("_get_per_token_logps_and_entropies", "ref_s",
              when=lambda model, *a, **kw: model is getattr(trainer, "ref_model", None))
        timed("_generate_and_score_completions", "score_s", count=True)

    def end_step(self, step_s: float) -> None:
        """The optimizer step that took `step_s` ended: its phases become one entry of each list."""
        for k, v in self.cur.items():
            self.steps[k].append(v)
        self.steps["step_s"].append(step_s)
        self.steps["train_s"].append(step_s - self.cur["score_s"])
        self.cur = dict.fromkeys(self.KEYS, 0.0)


def trl_main(spec_path: str, out_path: str) -> int:
    """Subprocess (.venv-bench's python): TRL's GRPOTrainer on the prompts our trainer takes."""
    s = json.loads(Path(spec_path).read_text())

    torch.set_num_threads(s["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    d = s["data"]
    train, _ = load_splits(d["train"], d["eval"], d["num_eval"], d["task_digits"], s["seed"])
    examples = PromptStream(train, s["seed"]).take(s["steps"] * s["prompts_per_step"])  # our trainer's prompts
    ds = Dataset.from_list([{"prompt": e.prompt, "answer": e.fields["answer"]} for e in examples])

    def exact_match_reward(prompts, completions, answer, **_):
        # conversational prompts get completions as messages: the assistant's text is what raygrpo scores
        return [exact_match(p, c if isinstance(c, str) else c[-1]["content"], answer=a)
                for p, c, a in zip(prompts, completions, answer)]

    class Timer(TrainerCallback):
        def __init__(self):
            self.marks = []

        def on_train_begin(self, args, state, control, **kw):
            self.marks = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kw):
            self.marks.append(time.perf_counter())
            phases.end_step(self.marks[-1] - self.marks[-2])

    tok = AutoTokenizer.from_pretrained(s["model"])
    model = AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32)
    out_dir = tempfile.mkdtemp(prefix="trl-bench-")
    args = GRPOConfig(
        output_dir=out_dir, use_cpu=True, report_to=[], bf16=s["bf16"], fp16=False, seed=s["seed"],
        per_device_train_batch_size=s["micro_batch_size"], gradient_accumulation_steps=s["grad_accum"],
        num_generations=s["group_size"], max_completion_length=s["max_new_tokens"], max_steps=s["steps"],
        learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=s["weight_decay"],
        adam_beta1=s["adam_beta1"], adam_beta2=s["adam_beta2"], adam_epsilon=s["adam_eps"], max_grad_norm=s["grad_clip"],
        optim="adamw_torch", beta=s["beta"], epsilon=s["clip_low"], epsilon_high=s["clip_high"],
        num_iterations=s["mu"], loss_type="dapo", scale_rewards="group", temperature=s["temperature"],
        top_p=s["top_p"], top_k=s["top_k"],
        # rollout.min_new_tokens: GRPOConfig.generation_kwargs go into HF generate's GenerationConfig
        generation_kwargs={"min_new_tokens": s["min_new_tokens"]} if s.get("min_new_tokens") else None,
        logging_steps=1, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, shuffle_dataset=False,  # in order: step k gets our step k's prompts
    )
    phases = PhaseTimer()
    timer = Timer()
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match_reward, args=args, train_dataset=ds,
                          processing_class=tok, callbacks=[timer])
    phases.attach(trainer)
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0

    heldout = heldout_examples(d, s["seed"])  # none with data.num_eval=0 (--setting long)
    torch.set_num_threads(1)  # the same evaluation as raygrpo's model gets (cluster.bench.heldout_accuracy)
    trainer.model.eval()
    accuracy_after = greedy_accuracy(trainer.model, tok, heldout, max_new_tokens=s["max_new_tokens"]) if heldout else None
    steps = [b - a for a, b in zip(timer.marks, timer.marks[1:])]
    logs = [h for h in trainer.state.log_history if "reward" in h]
    rewards = [float(h["reward"]) for h in logs]
    import trl

    result = {"status": "ok", "trl": trl.__version__, "steps": len(steps), "step_seconds": steps,
              "step_s": mean(steps[1:] if len(steps) > 1 else steps), "train_wall_s": total,
              "step_s_median": statistics.median(steps[1:] if len(steps) > 1 else steps),
              "step_s_min": min(steps[1:] if len(steps) > 1 else steps),
              "rewards": rewards, "reward_first": rewards[0] if rewards else None,
              "reward_last": rewards[-1] if rewards else None, "reward_mean": mean(rewards),
              "completion_length": [h.get("completions/mean_length") for h in logs],
              "heldout_accuracy_after": accuracy_after, "heldout_prompts": len(heldout),
              "torch_threads": s["threads"], "phases": phases.steps,
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "settings": s}
    Path(out_path).write_text(json.dumps(jsonable(result), indent=1))
    return 0


def bench_trl(settings: dict, workdir: Path, skip: bool, timeout_s: float, niceness: int | None = None) -> dict:
    if skip:
        return {"status": "skipped", "message": "--skip-trl"}
    py, msg = ensure_bench_venv()
    progress(f"TRL: {msg}")
    if py is None:
        return {"status": "skipped", "message": msg}
    spec, out, log = workdir / "trl_spec.json", workdir / "trl_result.json", workdir / "trl.log"
    spec.write_text(json.dumps(settings))
    out.unlink(missing_ok=True)
    progress(f"TRL: GRPOTrainer, {settings['steps']} steps x {settings['prompts_per_step']} prompts x "
             f"G={settings['group_size']}, {settings['threads']} thread(s) (log {log})")

    env = {**os.environ, **WORKER_ENV, "OMP_NUM_THREADS": str(settings["threads"]), "CUDA_VISIBLE_DEVICES": ""}
    with open(log, "w") as f, saying_every(25, f"TRL: running (log {log})"):
        try:
            proc = subprocess.run([str(py), "-m", SUBPROCESS_MODULE, "trl", str(spec), str(out)], cwd=PROJECT_ROOT,
                                  env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  preexec_fn=renice_to(niceness))
        except subprocess.TimeoutExpired:
            return {"status": "failed", "message": f"timed out after {timeout_s:.0f}s (log {log})"}
    if proc.returncode != 0 or not out.exists():
        tail = log.read_text()[-800:]
        return {"status": "failed", "message": f"exit {proc.returncode} (log {log}): {tail}"}
    res = json.loads(out.read_text())
    res["venv"] = {"message": msg, **bench_venv_report(py)}
    return res
