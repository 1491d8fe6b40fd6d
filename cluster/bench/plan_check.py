"""`python -m cluster.bench.plan_check`: `raygrpo plan --cluster local` against measured runs on this machine
(issue 62; docs/plan.md has the table it prints).

For each model: calibrate it (`raygrpo bench --calibrate`'s steps, its run fit included), then for each
config the fit did not see (other schedules, engine counts, G and lengths), predict it with `raygrpo plan
CONFIG ... --cluster local --profile P --json` and train it for a few steps (`raygrpo train`, at Ray's
worker niceness, its engines and ranks, like the calibration's points), and set the prediction's `step_s` and `learner_peak_bytes` against
the run's (median step after the first; the learner's peak), with the load average before and after.

    python -m cluster.bench.plan_check [--models tiny smollm2] [--out runs/plan_check]

About 30-60 minutes on 2 cores, by their load (SmolLM2-135M's calibration and runs are most of it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from cluster.bench.calibrate import FIT_CONFIG, calibrate
from cluster.bench.report import machine_info
from cluster.bench.run_probe import RunFailed, train_and_measure

# model -> (its directory, what its step is on top of FIT_CONFIG (its fit uses exactly this), the configs
# it is checked on: name -> overrides of that step; none of them is the fit's config)
MODELS: dict[str, tuple[str, list[str], dict[str, list[str]]]] = {
    "tiny": (".cache/tests/tiny-chat-qwen2-h128-l2", ["trainer.steps=6"], {
        "async": ["trainer.mode=async"],
        "pipeline": ["trainer.mode=pipeline"],
        "sync-2eng": ["rollout.num_workers=2"],
        "sync-G4-64tok": ["trainer.prompts_per_step=16", "trainer.group_size=4", "rollout.max_new_tokens=64",
                          "rollout.min_new_tokens=64", "rollout.max_model_len=128"],
    }),
    "smollm2": (".cache/tests/smollm2-135m-instruct",
                ["trainer.steps=3", "trainer.prompts_per_step=2", "trainer.group_size=4", "rollout.max_new_tokens=16",
                 "rollout.min_new_tokens=16", "learner.micro_batch_size=8"], {
        "async": ["trainer.mode=async"],
        "pipeline-2eng": ["trainer.mode=pipeline", "rollout.num_workers=2"],
    }),
}


def predict(config_path: Path, overrides: list[str], profile: Path) -> dict:
    """`raygrpo plan CONFIG overrides --cluster local --profile P --json`'s as_given."""
    cmd = [sys.executable, "-m", "cluster.cli", "plan", str(config_path), *overrides, "--cluster", "local",
           "--profile", str(profile), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RunFailed(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)["as_given"]


def check_model(name: str, out: Path) -> list[dict]:
    model, base, configs = MODELS[name]
    model = str(Path(model).resolve())
    t0 = time.time()
    prof = calibrate(model, base, out / name / "fit-run", list(FIT_CONFIG["reward"]["functions"]))
    profile = prof.save(out / name / "profile.json")
    print(f"plan_check: {name} calibrated in {time.time() - t0:.0f} s -> {profile}", flush=True)
    config = {**FIT_CONFIG, "model": {"path": model}}
    rows = []
    for cname, ovr in configs.items():
        run_dir = out / name / cname
        cfg_path = run_dir.parent / f"{cname}.yaml"
        overrides = [*base, *ovr]
        try:
            measured = train_and_measure(config, overrides, run_dir)  # writes cfg_path
            pred = predict(cfg_path, overrides, profile)
        except RunFailed as e:
            print(f"plan_check: {name}/{cname} failed: {e}", flush=True)
            rows.append({"model": name, "config": cname, "overrides": ovr, "error": str(e)[-500:]})
            continue
        row = {"model": name, "config": cname, "overrides": ovr, "predicted_step_s": pred["step_s"],
               "measured_step_s": measured["step_s"], "step_ratio": pred["step_s"] / measured["step_s"],
               "predicted_peak_bytes": pred["learner_peak_bytes"], "measured_peak_bytes": measured["learner_peak_bytes"],
               "peak_ratio": (pred["learner_peak_bytes"] / measured["learner_peak_bytes"]
                              if measured["learner_peak_bytes"] else None),
               "predicted_phases": pred["phases"], "measured": measured}
        rows.append(row)
        (out / name / "rows.json").write_text(json.dumps(rows, indent=1, default=str) + "\n")  # kept as it goes
        print(f"plan_check: {name}/{cname}: step predicted {row['predicted_step_s']:.2f} s, measured "
              f"{row['measured_step_s']:.2f} s ({row['step_ratio']:.2f}); peak {row['peak_ratio'] or 0:.2f}; "
              f"load {measured['load_before']:.1f}-{measured['load_after']:.1f}", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | config | predicted step | measured step (gen, train) | ratio | predicted peak | measured peak | ratio | load |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['config']} | failed: {r['error'][:80]} | | | | | | |")
            continue
        m, mib = r["measured"], 2**20
        peak = f"{m['learner_peak_bytes'] / mib:.0f} MiB" if m["learner_peak_bytes"] else "-"
        lines.append(f"| {r['model']} | {' '.join(r['overrides'])} | {r['predicted_step_s']:.2f} s | "
                     f"{r['measured_step_s']:.2f} s ({m['gen_s']:.2f}, {m['train_s']:.2f}) | {r['step_ratio']:.2f} | "
                     f"{r['predicted_peak_bytes'] / mib:.0f} MiB | {peak} | "
                     f"{r['peak_ratio'] or float('nan'):.2f} | {m['load_before']:.1f}-{m['load_after']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--out", default="runs/plan_check")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = [r for name in args.models for r in check_model(name, out)]
    info = {"machine": machine_info().get("cpu_model"), "cores": len(os.sched_getaffinity(0)), "rows": rows}
    (out / "plan_check.json").write_text(json.dumps(info, indent=1, default=str) + "\n")
    print(f"plan_check on {info['machine']}, {info['cores']} cores:\n{table(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
