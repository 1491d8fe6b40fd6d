"""tests/cpu_by_process.py, the suite's CPU by kind of process: what it calls each process, and its watch
of a real command (a child that burns CPU is found and counted)."""
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cpu_by_process as cpu  # noqa: E402


def test_processes_are_named_by_what_they_are():
    assert cpu.kind("ray::RolloutWor", "ray::RolloutWorker.generate") == "ray::RolloutWor"
    assert cpu.kind("ray::RolloutWor", "/v/bin/python /v/ray/_private/workers/default_worker.py") == "ray::RolloutWor"
    assert cpu.kind("ray::IDLE", "ray::IDLE") == "ray::IDLE"
    assert cpu.kind("python", "/v/bin/python -m cluster.cli train c.yaml") == "python cluster.cli"
    assert cpu.kind("python", "/v/bin/python -u /v/ray/_private/log_monitor.py --x") == "python log_monitor.py"
    assert cpu.kind("cc1plus", "/usr/lib/gcc/cc1plus -quiet shm.cpp") == "cc1plus"
    table = cpu.by_kind({"1": [2.0, "raylet", ""], "2": [3.0, "raylet", ""], "3": [1.0, "gcs_server", ""]})
    assert table == {"raylet": [5.0, 2], "gcs_server": [1.0, 1]}


def test_a_watched_command_has_its_childs_cpu_counted(tmp_path):
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 3.0: pass\n"
    run = cpu.watch([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}])"])
    assert run["rc"] == 0 and run["wall"] >= 3.0 and run["busy"] >= 2.0
    # the child, read while it ran (its last second may be missed)
    assert max(c for c, _, cmd in run["procs"].values() if "process_time" in cmd) >= 1.0
    assert "python" in cpu.report(run)
    out = subprocess.run([sys.executable, str(Path(cpu.__file__)), str(tmp_path / "missing.json"), "x"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "Where a command's CPU goes" in out.stderr
