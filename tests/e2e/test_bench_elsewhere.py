"""Issue 30 case 11: `raygrpo bench ... --parts schedule,trl --out OTHER_DIR/bench.json` measured raygrpo but
TRL failed at once: its process (which runs from the project directory) got the relative warm-start
path and transformers took it for a hub repo id. Every path is made absolute before it crosses into
another process; here the bench runs from a directory of the user's, with a relative --cache-dir and
--out in a third directory.

The TRL part installs TRL into the project's .venv-bench on first use (as `raygrpo bench` does for a
user), and includes raygrpo's own sync run: the smallest settings keep it to a few steps of a tiny model.
"""
from __future__ import annotations

import json

import pytest
from console import run

pytestmark = pytest.mark.timeout(1500)


def test_the_trl_part_runs_with_out_in_another_directory(tmp_path):
    cwd, other = tmp_path / "here", tmp_path / "elsewhere"
    cwd.mkdir()
    out = run(["bench", "--parts", "trl", "--hidden-size", "64", "--num-layers", "2", "--warm-start-steps", "0",
               "--steps", "2", "--trl-threads", "1", "--cache-dir", "cache", "--out", other / "bench.json",
               "data.num_eval=8"], cwd, timeout=1400)
    out.report("bench TRL part from another directory")
    assert out.returncode == 0, out.text[-3000:]
    res = json.loads((other / "bench.json").read_text())
    assert res["trl"]["status"] == "ok", res["trl"]
    assert res["trl"]["settings"]["model"] == str(cwd / "cache" / "base-h64-l2")  # absolute, from the user's dir
    assert (other / "work" / "trl.log").is_file() and (cwd / "cache").is_dir()
    assert res["schedules"]["sync"]["step_s"] > 0 and res["trl"]["step_s"] > 0
