"""What importing a module costs (pyproject.toml's lazy imports, docs/DESIGN.md "Layout and the import
rule"): the driver's modules import no vLLM, DeepSpeed or transformers (a config error stays quick),
a learner rank no vLLM (it runs on a GPU image without vLLM until it syncs weights), and the CLI
nothing heavy until a command runs; the unit tier no vLLM at all."""
import ast
import subprocess
import sys
from pathlib import Path

UNIT = Path(__file__).resolve().parent
HEAVY = {"vllm", "deepspeed", "peft", "transformers", "datasets", "matplotlib", "ray", "trl"}


def imported(*modules: str) -> set[str]:
    """Top-level packages loaded by importing `modules` in a fresh interpreter."""
    code = "import sys; " + "; ".join(f"import {m}" for m in modules) + \
        "; print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    return set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())


def test_the_cli_imports_nothing_heavy_until_a_command_runs():
    assert not imported("cluster.cli") & (HEAVY | {"torch"})


def loaded_by_the_cli(*argvs: list[str]) -> set[str]:
    """Top-level packages loaded in a fresh interpreter by `raygrpo ARGV` for each argv in turn (its exit ignored)."""
    code = ("import sys; from cluster.cli import main\n"
            f"for argv in {list(argvs)!r}:\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('MODULES', ' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.rsplit("MODULES", 1)[1].split())


def test_the_config_check_and_the_clis_refusals_import_no_torch(tmp_path):
    """torch takes 2-7 s to import on a loaded machine: `raygrpo --help`, a config with a mistake and the
    config module itself answer without it (cluster/config.py reaches actors/, learner/ and cluster/run/
    modules whose torch-using parts live apart: actors/runtime/process_groups.py, actors/transport/cpu_packing.py,
    learner/checkpoint_manifest.py, the objective's option names in learner/config.py)."""
    assert "torch" not in imported("cluster.config")
    bad = tmp_path / "run.yaml"
    bad.write_text("trainer:\n  stepz: 3\n")
    loaded = loaded_by_the_cli(["--help"], ["train", "--help"], ["train", str(bad)], ["train", str(tmp_path / "none.yaml")],
                               ["data", str(bad)])
    assert "cluster" in loaded and not loaded & (HEAVY | {"torch"})


def test_the_driver_the_config_check_and_the_bench_import_none_of_the_heavy_packages():
    assert not imported("cluster.config", "cluster.driver.trainer", "cluster.data.preview", "cluster.demo.demo",
                        "cluster.bench") & HEAVY


def test_a_learner_rank_imports_no_vllm():
    assert "vllm" not in imported("learner.worker")


def imports_vllm(path: Path) -> bool:
    """Whether the module at `path` has an `import vllm...` or `from vllm... import` anywhere (a test's body included)."""
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        if any(n.split(".")[0] == "vllm" for n in names):
            return True
    return False


def test_no_unit_test_module_imports_vllm(collection_of_this_session):
    """The unit tier runs without vLLM (seconds-fast; an image without it can run it): no unit test names vllm,
    and collecting tests/unit (every module and what it imports of the project, as pytest does) loads none.
    A test that needs vLLM belongs in tests/e2e.

    Where this process collected the whole tier and no other (`make test`: each xdist worker collects it all),
    what that collection loaded is read (tests/unit/conftest.py); otherwise (a file or a test picked, or
    the e2e tier beside) the tier is collected in a fresh interpreter (30-40 s on a busy 2-core machine)."""
    modules = set(UNIT.glob("test_*.py"))
    named = sorted(p.name for p in modules if imports_vllm(p))
    assert not named, f"{named} import vllm: move those tests to tests/e2e"
    if collection_of_this_session["paths"] == modules and not collection_of_this_session["others"]:
        assert not collection_of_this_session["vllm"], \
            "collecting tests/unit loaded vllm (a project module a unit test imports pulls it in)"
        return
    code = ("import sys, pytest; rc = pytest.main(['--collect-only', '-qq', '-p', 'no:cacheprovider', sys.argv[1]]); "
            "print(); print(int(rc), 'vllm' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, str(UNIT)], capture_output=True, text=True, cwd=UNIT.parents[1])
    assert done.stdout.split()[-2:] == ["0", "False"], \
        f"collecting tests/unit loaded vllm (a project module a unit test imports pulls it in):\n{done.stdout[-2000:]}"


def test_no_two_test_modules_share_a_basename():
    """pytest imports test modules by basename (rootdir imports, no __init__.py): a second
    tests/*/test_x.py stops the whole suite at collection ("import file mismatch"), as
    tests/e2e/test_reward_fails_alone.py beside tests/unit/test_reward_fails_alone.py once did."""
    tests = Path(__file__).resolve().parent.parent
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted(tests.rglob("test_*.py")):
        if path.name in seen:
            clashes.append(f"{seen[path.name].relative_to(tests)} and {path.relative_to(tests)}")
        seen.setdefault(path.name, path)
    assert not clashes, "test modules sharing a basename (rename one): " + "; ".join(clashes)
