"""Names handed to another process as strings (vLLM's lazy engine factory, entry points in setup.py,
`python -m` targets) break only at run time over there: check here that each one resolves."""
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

from cluster import job_entry
from cluster.bench import command, report
from cluster.launch import submit
from cluster.paths import PROJECT_ROOT


def resolve(module: str, attr: str | None = None):
    assert importlib.util.find_spec(module) is not None, f"no module {module}"
    obj = importlib.import_module(module)
    return getattr(obj, attr) if attr else obj


def test_project_root_is_the_checkout():
    assert (PROJECT_ROOT / "setup.py").is_file() and PROJECT_ROOT == Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("group", ["console_scripts", "vllm.general_plugins"])
def test_setup_py_entry_points_resolve(group):
    setup = (PROJECT_ROOT / "setup.py").read_text()
    block = re.search(rf'"{re.escape(group)}": \[([^\]]*)\]', setup)
    assert block, f"setup.py declares no {group}"
    targets = re.findall(r'"[\w-]+=([\w.]+):(\w+)"', block.group(1))
    assert targets
    for module, attr in targets:
        assert callable(resolve(module, attr))


def test_submit_entry_script_and_the_module_it_runs_resolve():
    script = submit.JOB_ENTRY.read_text()  # submit's entrypoint: `sh <JOB_ENTRY relative to the project> train ...`
    assert submit.JOB_ENTRY.resolve().is_relative_to(PROJECT_ROOT)
    modules = re.findall(r"-m ([\w.]+)", script)
    assert modules == ["cluster.job_entry"], modules
    assert resolve(modules[0]) is job_entry and callable(job_entry.main)


def test_bench_subprocess_module_has_a_main_that_dispatches():
    assert report.SUBPROCESS_MODULE == "cluster.bench"
    assert importlib.util.find_spec(f"{report.SUBPROCESS_MODULE}.__main__") is not None
    assert command.main(["no-such-part"]) == 2  # unknown subcommands get the usage line, not a traceback
