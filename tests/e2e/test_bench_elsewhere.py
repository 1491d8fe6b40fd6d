"""Issue 30 case 11: `raygrpo bench ... --parts schedule,trl --out OTHER_DIR/bench.json` measured raygrpo but
TRL failed at once: its process (which runs from the project directory) got the relative warm-start
path and transformers took it for a hub repo id. Every path is made absolute before it crosses into
another process; here the bench runs from a directory of the user's, with a relative --cache-dir and
--out in a third directory.

The TRL part installs TRL into the project's .venv-bench on first use (as `raygrpo bench` does for a
user), and includes raygrpo's own sync run. It runs `--model` (issue 38: the real-model comparison) on a
tiny chat model given by a relative path, so the one run also covers that mode's settings, its chat
prompts written into the relative --cache-dir, TRL's phases, the verdict and the learner's memory.
"""
from __future__ import annotations

import json
import shutil

import pytest
from console import run

from cluster.bench.model_bench import DATA_FILE

pytestmark = pytest.mark.timeout(1500)


def test_the_trl_part_runs_with_out_in_another_directory(tmp_path, tiny_chat_model_dir):
    cwd, other = tmp_path / "here", tmp_path / "elsewhere"
    cwd.mkdir()
    shutil.copytree(tiny_chat_model_dir, cwd / "model")
    out = run(["bench", "--model", "model", "--parts", "trl", "--steps", "2", "--trl-threads", "1",
               "--cache-dir", "cache", "--out", other / "bench.json"], cwd, timeout=1400)
    out.report("bench --model, TRL part, from another directory")
    assert out.returncode == 0, out.text[-3000:]
    res = json.loads((other / "bench.json").read_text())
    assert res["trl"]["status"] == "ok", res["trl"]
    s = res["trl"]["settings"]  # absolute, from the user's dir
    assert (s["model"], s["data"]["train"]) == (str(cwd / "model"), str(cwd / "cache" / DATA_FILE))
    assert (s["prompts_per_step"], s["group_size"], s["max_new_tokens"], s["min_new_tokens"]) == (4, 4, 32, 32)
    assert (other / "work" / "trl.log").is_file()
    assert res["schedules"]["sync"]["step_s"] > 0 and res["trl"]["step_s"] > 0
    # TRL's phases were timed: every completion is 32 tokens (min = max), 16 per step
    assert res["trl"]["phases"]["gen_tokens"] == [512.0, 512.0] and min(res["trl"]["phases"]["gen_s"]) > 0
    runs = {r["run"]: r for r in res["phases"]}
    assert set(runs) == {"raygrpo sync", "TRL (1 thread(s))"}
    assert runs["raygrpo sync"]["gen_tokens_per_s"] > 0 and runs["TRL (1 thread(s))"]["train_tokens_per_s"] > 0
    assert res["verdict"]["ratio"] > 0 and res["verdict"]["bound"] in ("gen_s", "reward_s", "ref_s", "train_s", "sync_s")
    assert "raygrpo-best / TRL-best step time" in out.text and "learner memory during the steps" in out.text
    assert res["memory"]["learner_peak_rss_mb"] > 100 and res["memory"]["micro_batch_size"] == 8
