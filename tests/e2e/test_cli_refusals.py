"""Issue 36 (reliability round 3), through the CLI as a user hits each case: a cluster address that
accepts and never answers, a gateway that answers 404, torn lines in a run dir's JSONL files, demo
arguments out of range, a working dir that cannot be uploaded.

Each runs `raygrpo` as a user does (the installed console script, from a directory of the user's).
"""
from __future__ import annotations

import http.server
import json
import re
import socket
import threading

import pytest
from console import run

from actors.runtime.waits import WAITING_LINE_EVERY_S

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def silent_listener():
    """A TCP listener on 127.0.0.1 that accepts connections and never answers (nor closes them)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held, stop = [], threading.Event()

    def accept():
        srv.settimeout(0.5)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    t.join(2)
    for c in held:
        c.close()
    srv.close()


@pytest.fixture
def gateway_404():
    """An HTTP server on 127.0.0.1 answering 404 to everything (a gateway with no route to a dashboard)."""
    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_error(404)

        do_POST = do_PUT = do_GET

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def user_config(tmp_path) -> str:
    (tmp_path / "c.yaml").write_text("model:\n  path: /nonexistent-model\ntrainer:\n  run_dir: /tmp/raygrpo-never\n")
    return "c.yaml"


def test_submit_to_an_address_that_never_answers_ends_with_a_clear_error_and_says_what_it_waits_on(
        silent_listener, tmp_path):
    """Case 2: nothing was printed for 600 s and --agent-wait did not bound it."""
    out = run(["submit", user_config(tmp_path), "--address", silent_listener, "--agent-wait", "27", "--no-wait"],
              tmp_path, timeout=200)
    out.report("submit to a silent listener, --agent-wait 27")
    assert out.returncode == 1, out.text[-3000:]
    # 27 s: --agent-wait's read; or the whole call's bound (probe + connect + read), where the thread's imports of
    # ray.job_submission on a loaded machine used the margin up first: either way a bound, said, not 600 s
    assert re.search(rf"the Ray cluster at {re.escape(silent_listener)} did not answer within \d+s", out.text), \
        out.text[-3000:]
    assert "Raise --agent-wait" in out.text and "Traceback" not in out.text
    assert f"waiting on the Ray cluster at {silent_listener} (asking for its authentication mode and Ray version)" \
        in out.text, out.text[-3000:]
    # the auth probe (at most 10 s) + the version request (27 s of silence) + start-up; never 600 s
    assert out.seconds < 180, out.seconds
    # a line when it starts contacting the cluster, then one every 25 s (Python and Ray's import come first: slow
    # on a loaded machine); the margins are a loaded 2-core machine's (CI's)
    assert out.longest_silence()[0] < WAITING_LINE_EVERY_S + 35, out.longest_silence()
    contacting = next(t for t, line in out.lines if "contacting the Ray cluster" in line)
    waiting = [t for t, line in out.lines if "waiting on the Ray cluster" in line]
    assert waiting and all(b - a < WAITING_LINE_EVERY_S + 15
                           for a, b in zip([contacting, *waiting], [*waiting, out.seconds])), out.lines


def test_submit_to_a_gateway_answering_404_is_not_blamed_on_the_ray_version(gateway_404, tmp_path):
    """Case 6: "Jobs API is not supported ... Ray 1.9 or higher" for an address that is no dashboard."""
    out = run(["submit", user_config(tmp_path), "--address", gateway_404, "--no-wait"], tmp_path, timeout=200)
    assert out.returncode == 1, out.text[-3000:]
    assert "answered 404 Not Found" in out.text and "no Ray dashboard is serving there" in out.text, out.text[-3000:]
    assert "1.9" not in out.text and "Traceback" not in out.text, out.text[-3000:]


def completion_row(step: int, i: int) -> str:
    return json.dumps({"step": step, "prompt_index": i, "sample": 0, "prompt": f"{i}+1=", "completion": str(i + 1),
                       "reward": 1.0, "rewards": {"exact_match": 1.0}, "advantage": 0.0, "finish_reason": "stop",
                       "num_tokens": 2}) + "\n"


def test_show_and_plot_say_how_many_torn_lines_they_skipped_and_where(tmp_path):
    """Case 3: `raygrpo show` dropped torn lines silently and reported "3 of 3 logged completion(s)"."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [completion_row(1, 0), completion_row(1, 1), completion_row(1, 2), completion_row(1, 3)]
    lines[1] = lines[1][:40] + "\n"  # a row cut short mid-step, then the run went on
    (run_dir / "completions.jsonl").write_text("".join(lines) + completion_row(1, 4)[:30])  # and a torn last line
    out = run(["show", "run"], tmp_path, timeout=120)
    assert out.returncode == 0, out.text
    assert "completions.jsonl: skipped 2 torn line(s)" in out.text and "line(s) 2, 5" in out.text, out.text
    assert "step 1, 3 of 3 logged completion(s)" in out.text and "2 torn line(s) skipped, so a step may miss some" in out.text

    row = {"kind": "train", "reward_mean": 0.5, "kl": 0.0, "time/step_s": 1.0}
    (run_dir / "metrics.jsonl").write_text(json.dumps({**row, "step": 1}) + "\n" + json.dumps({**row, "step": 2})[:25]
                                           + "\n" + json.dumps({**row, "step": 3}) + "\n")
    out = run(["plot", "run"], tmp_path, timeout=120)
    assert out.returncode == 0, out.text
    assert out.text.count("torn line(s)") == 1 and "metrics.jsonl: skipped 1 torn line(s)" in out.text, out.text
    assert "line(s) 2" in out.text and (run_dir / "reward.png").is_file()


def test_demo_refuses_zero_steps_and_a_negative_seed_at_once(tmp_path):
    """Untried case: `raygrpo demo --steps 0`, `raygrpo demo --seed -1` (and trainer.seed=-1 in a config)."""
    for args, says in ((["--steps", "0"], "argument --steps: '0' is not a whole number of at least 1"),
                       (["--seed", "-1"], "argument --seed: '-1' is not a seed: a whole number from 0 to 2**32-1"),
                       (["--seed=-1"], "argument --seed: '-1' is not a seed")):
        out = run(["demo", *args, "--run-dir", "runs/d"], tmp_path, timeout=120)
        assert out.returncode == 2 and says in out.text, out.text
        assert out.seconds < 60 and not (tmp_path / "runs").exists() and not (tmp_path / ".cache").exists()
    (tmp_path / "c.yaml").write_text("model:\n  path: /nonexistent\ntrainer:\n  seed: -1\n")
    out = run(["data", "c.yaml"], tmp_path, timeout=120)
    assert out.returncode == 2 and "trainer.seed must be a whole number from 0 to 2**32-1, got -1" in out.text, out.text


def test_demo_refuses_to_delete_a_run_dir_it_did_not_make(tmp_path):
    """`raygrpo demo --run-dir` pointed at a user's run: refused (exit 2) with the run left as it was; the
    demo used to remove its run dir, whatever it held."""
    user_run = tmp_path / "runs" / "mine"
    user_run.mkdir(parents=True)
    (user_run / "config.yaml").write_text("model:\n  path: /models/mine\n")
    (user_run / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    before = sorted(p.name for p in user_run.iterdir())
    out = run(["demo", "--run-dir", "runs/mine", "--cache-dir", "cache"], tmp_path, timeout=300)
    assert out.returncode == 2 and "holds a run the demo did not make" in out.text, out.text
    assert sorted(p.name for p in user_run.iterdir()) == before
    assert (user_run / "metrics.jsonl").read_text() == '{"kind": "train", "step": 1}\n'


def test_submit_refuses_a_working_dir_with_a_symlink_loop_or_over_rays_package_limit(tmp_path, gateway_404):
    """Untried case: `submit --working-dir` with a symlink loop or a huge directory: a clear error before
    anything is packed or sent, in bounded time; what .rayignore excludes is not counted."""
    project = tmp_path / "project"
    (project / "sub").mkdir(parents=True)
    (project / "c.yaml").write_text("model:\n  path: /nonexistent-model\ntrainer:\n  run_dir: /tmp/raygrpo-never\n")
    (project / "sub" / "up").symlink_to("..")
    out = run(["submit", "project/c.yaml", "--working-dir", "project", "--address", gateway_404], tmp_path, timeout=120)
    assert out.returncode == 2, out.text
    assert f"the symlink {project}/sub/up points to {project}, a directory it is inside of (a loop)" in out.text
    assert "add sub/up to a .rayignore" in out.text and "Traceback" not in out.text
    (project / "sub" / "up").unlink()

    with open(project / "weights.bin", "wb") as f:  # sparse: 600 MiB by size, nothing on the disk
        f.truncate(600 * 2**20)
    out = run(["submit", "project/c.yaml", "--working-dir", "project", "--address", gateway_404], tmp_path, timeout=120)
    assert out.returncode == 2, out.text
    assert "holds more than 100 MiB (Ray's upload limit: its dashboard refuses a larger request, HTTP 413) to upload" \
        in out.text and "weights.bin (600 MiB)" in out.text
    assert out.seconds < 60

    (project / ".rayignore").write_text("weights.bin\n")  # excluded: the submit goes on (to the 404 gateway)
    out = run(["submit", "project/c.yaml", "--working-dir", "project", "--address", gateway_404], tmp_path, timeout=120)
    assert out.returncode == 1 and "answered 404 Not Found" in out.text and "package limit" not in out.text, out.text
