"""What importing a module costs (pyproject.toml's lazy imports, docs/DESIGN.md "Layout and the import
rule"): the driver's modules import no vLLM, DeepSpeed or transformers (a config error stays quick),
a learner rank no vLLM (it runs on a GPU image without vLLM until it syncs weights), and the CLI
nothing heavy until a command runs."""
import subprocess
import sys

HEAVY = {"vllm", "deepspeed", "peft", "transformers", "datasets", "matplotlib", "ray", "trl"}


def imported(*modules: str) -> set[str]:
    """Top-level packages loaded by importing `modules` in a fresh interpreter."""
    code = "import sys; " + "; ".join(f"import {m}" for m in modules) + \
        "; print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    return set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())


def test_the_cli_imports_nothing_heavy_until_a_command_runs():
    assert not imported("cluster.cli") & (HEAVY | {"torch"})


def test_the_driver_the_config_check_and_the_bench_import_none_of_the_heavy_packages():
    assert not imported("cluster.config", "cluster.driver.trainer", "cluster.data.preview", "cluster.demo.demo",
                        "cluster.bench") & HEAVY


def test_a_learner_rank_imports_no_vllm():
    assert "vllm" not in imported("learner.worker")
