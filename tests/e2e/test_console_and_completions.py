"""What a TRL or verl user looks at first, through the CLI as they run it (issue 25): the console, the
completions the model wrote, short runs that end normally, a reward from the environment alone.

One `raygrpo train` run in a project directory outside the checkout: a 2-step multi-turn run whose
only reward is the environment's (reward.functions: []). Real Ray, vLLM, DeepSpeed; the offline tiny
chat model. What a second run here used to show is asserted on runs that start anyway: the third-party
lines back in the console with --log-level INFO (test_multiturn.py's CLI run), a resumed run saying
"resumed from" and printing the held-out summary, its 'before' from the first run's step-0 evaluation
(test_safety.py's rerun after SIGTERM).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.bench.console_lines import classify
from cluster.models.wordproblems import conversational_rows, write_jsonl
from cluster.run.metrics import read_metrics

BIN = Path(sys.executable).parent

# The user's environment: answers the first turn with a tool message, then ends the episode. Its
# reward is the same for every trajectory, so no group ever has a learning signal.
ENV = '''
class Lookup:
    def __init__(self, answer, **fields):
        self.turns = 0

    def reset(self):
        return None

    def step(self, text):
        self.turns += 1
        if self.turns == 1:
            return {"messages": [{"role": "tool", "content": "lookup: nothing found"}], "done": False, "reward": 0.25}
        return {"messages": [], "done": True}
'''


def project(root: Path, model_dir: Path) -> Path:
    proj = root / "proj"
    proj.mkdir()
    (proj / "lookup_env.py").write_text(ENV)
    write_jsonl(proj / "train.jsonl", conversational_rows(8, seed=5))
    write_jsonl(proj / "eval.jsonl", conversational_rows(2, seed=6))
    # halt_after 2 with an entropy floor no model meets: the guard trips at step 2, the run's last
    (proj / "run.yaml").write_text(f"""
model: {{path: {model_dir}}}
data: {{train: train.jsonl, eval: eval.jsonl, num_eval: 2}}
trainer: {{steps: 2, prompts_per_step: 2, group_size: 2, run_dir: runs/lookup, halt_after: 2, entropy_floor: 100.0,
          eval_pass_k: 1, actor_timeout_s: 300}}
rollout: {{env: "lookup_env.py:Lookup", max_turns: 2, max_new_tokens: 8, max_model_len: 160, cpu_kv_cache_mb: 64,
          gpu_memory_utilization: 0.03}}
reward: {{functions: []}}
learner: {{lr: 1.0e-4, micro_batch_size: 4}}
metrics: {{tensorboard: false, completions_per_step: 2}}
""")
    return proj


def raygrpo(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "raygrpo"), *args], cwd=cwd, capture_output=True, text=True, timeout=900)


@pytest.mark.timeout(1200)
def test_a_short_multi_turn_run_reads_well_and_logs_what_the_model_wrote(tiny_chat_model_dir, tmp_path):
    proj = project(tmp_path, tiny_chat_model_dir)
    run_dir = proj / "runs" / "lookup"
    first = raygrpo("train", "run.yaml", cwd=proj)
    console = first.stdout + first.stderr
    assert first.returncode == 0, console[-5000:]

    # the console is raygrpo's: no third-party line at the default level, vLLM's per-step INFO in logs/
    lines = classify(console.splitlines(keepends=True))
    assert [line for origin, line in lines if origin == "third-party"] == [], console
    assert "step 2/2" in console and "learner:" in console  # raygrpo's own lines, an actor's included
    worker_logs = "".join(p.read_text() for p in (run_dir / "logs").glob("worker-*.log"))
    assert "Successfully reset prefix cache" in worker_logs and "Successfully reset prefix cache" not in console

    # halts that respect a short run: the zero-variance guard only warns (never a signal), the entropy
    # guard trips at the last step and the run ends as usual
    assert "no learning signal yet" in console and "`raygrpo show " in console and "runs/lookup`" in console
    assert "This was the run's last step, so the run ends normally" in console
    assert (run_dir / "hf_model" / "config.json").is_file()
    assert all((run_dir / f).stat().st_size > 1000 for f in ("reward.png", "kl.png", "step_time.png"))

    # the environment's reward alone; lengths per trajectory and per turn
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and all(r["reward_mean"] == 0.25 for r in rows)
    assert all(r["completions/turn_mean_length"] <= r["completions/mean_length"] <= 16 for r in rows)
    assert all(0 <= r["completions/turn_clipped_ratio"] <= 1 for r in rows)

    # the completions, and `raygrpo show` prints a transcript with its roles
    logged = [json.loads(x) for x in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 1, 2, 2]
    assert all(r["rewards"] == {} and r["reward"] == 0.25 and r["advantage"] == 0.0 for r in logged)
    shown = raygrpo("show", "runs/lookup", "--step", "2", "-n", "1", cwd=proj)
    assert shown.returncode == 0, shown.stderr
    assert "step 2, 1 of 2 logged completion(s)" in shown.stdout and "reward 0.250 (environment 0.250)" in shown.stdout
    assert "  [user] " in shown.stdout and "  [assistant] " in shown.stdout and "  [tool] lookup: nothing found" in shown.stdout
