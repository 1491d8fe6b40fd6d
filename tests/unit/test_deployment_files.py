"""docker/'s deployment files checked as far as a machine without Kubernetes allows (issue 37): the KubeRay
RayJob against the image it names and the config its entrypoint runs (the resources that config asks of
Ray fit the pods); the SLURM script and compose file start nodes in token mode with the agent timeout
raised, as the embedded cluster does. tests/e2e/test_slurm.py runs the SLURM script for real."""
from __future__ import annotations

import importlib
import re
import shlex
import sys
import types
from pathlib import Path

import yaml

from cluster.config import RunConfig, load_config
from cluster.launch import ray_cluster

ROOT = Path(__file__).resolve().parents[2]
RAYJOB = yaml.safe_load((ROOT / "docker" / "rayjob.yaml").read_text())
IMAGES = {"raygrpo:gpu": "docker/Dockerfile.gpu", "raygrpo:cpu": "docker/Dockerfile.cpu"}


def ray_demand(cfg: RunConfig) -> tuple[float, float, list[float]]:
    """(CPUs, GPUs, each actor's GPUs) the run's placement group asks of Ray (cluster/launch/placement.py)."""
    r, lrn, ref, rw = cfg.rollout, cfg.learner, cfg.reference, cfg.reward
    actors = [(r.num_cpus, r.num_gpus)] * r.num_workers + [(lrn.num_cpus, lrn.num_gpus)] * lrn.num_ranks
    if cfg.algo.beta > 0 and not cfg.reference_on_learner():
        actors.append((ref.num_cpus, ref.num_gpus))
    if getattr(rw, "model", None):
        actors.append((rw.model_num_cpus, rw.model_num_gpus))
    return sum(c for c, _ in actors), sum(g for _, g in actors), [g for _, g in actors]


def entrypoint() -> tuple[str, list[str]]:
    argv = shlex.split(RAYJOB["spec"]["entrypoint"])
    assert argv[:2] == ["raygrpo", "train"], argv
    return argv[2], argv[3:]


def containers():
    spec = RAYJOB["spec"]["rayClusterSpec"]
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    workers = [(g["replicas"], g["template"]["spec"]["containers"][0]) for g in spec["workerGroupSpecs"]]
    return head, workers


def test_the_rayjob_runs_a_config_the_image_holds_and_that_passes_the_config_check():
    config, overrides = entrypoint()
    head, workers = containers()
    for c in [head, *(w for _, w in workers)]:
        assert c["image"] in IMAGES, f"{c['name']}: {c['image']} is not an image docker/ builds"
        dockerfile = (ROOT / IMAGES[c["image"]]).read_text()
        # the image has the examples where the entrypoint looks for them (as the CPU image, which is built and run)
        assert "COPY examples/ /opt/raygrpo/examples/" in dockerfile
    assert config.startswith("/opt/raygrpo/examples/")
    in_repo = ROOT / config.removeprefix("/opt/raygrpo/")
    assert in_repo.is_file()
    assert "ray.address=auto" in overrides  # the job's driver runs in the head pod: the cluster it belongs to
    cfg = load_config(in_repo, overrides, validate_paths=False)  # model.path is on the cluster's volume
    assert cfg.trainer.run_dir.startswith("/shared/") and cfg.model.path.startswith("/shared/")
    for c in [head, *(w for _, w in workers)]:  # every pod sees the model and the run dir
        assert {"name": "shared", "mountPath": "/shared"} in c["volumeMounts"]


def test_the_rayjobs_worker_pods_hold_what_its_config_asks_of_ray():
    config, overrides = entrypoint()
    cfg = load_config(ROOT / config.removeprefix("/opt/raygrpo/"), overrides, validate_paths=False)
    cpus, gpus, per_actor = ray_demand(cfg)
    _, workers = containers()
    pod_gpus = [int(w["resources"]["limits"].get("nvidia.com/gpu", 0)) for n, w in workers for _ in range(n)]
    pod_cpus = [float(w["resources"]["limits"]["cpu"]) for n, w in workers for _ in range(n)]
    assert gpus <= sum(pod_gpus), f"the config asks for {gpus} GPUs, the worker pods have {sum(pod_gpus)}"
    assert cpus <= sum(pod_cpus), f"the config asks for {cpus} CPUs, the worker pods have {sum(pod_cpus)}"
    assert max(per_actor) <= min(pod_gpus)
    # KubeRay gives each pod's Ray its container limit as --num-cpus/--num-gpus: a SPREAD placement puts
    # at most a pod's share of the actors on it
    assert cfg.ray.strategy == "SPREAD" and cpus / len(pod_cpus) <= min(pod_cpus)


def sbatch_lines() -> list[str]:
    return (ROOT / "docker" / "slurm.sbatch").read_text().splitlines()


def test_the_slurm_script_starts_every_node_in_token_mode_and_waits_for_them_bounded():
    text = "\n".join(sbatch_lines())
    assert "export RAY_AUTH_MODE=token" in text and "export RAY_AUTH_TOKEN" in text
    assert not re.search(r"^sleep\s+\d+\s*$", text, flags=re.M), "a fixed sleep instead of waiting for the nodes"
    assert "wait_for_nodes 1" in text and 'wait_for_nodes "${#nodes[@]}"' in text
    assert "RAYGRPO_NODE_WAIT_S" in text and "exit 1" in text
    # the exports come before the first `ray start`
    first_start = next(i for i, line in enumerate(sbatch_lines()) if "ray start" in line and not line.startswith("#"))
    assert all(i < first_start for i, line in enumerate(sbatch_lines()) if line.startswith("export RAY_"))


def test_the_slurm_scripts_allocation_holds_the_example_it_names():
    lines = sbatch_lines()
    opts = dict(re.findall(r"^#SBATCH --([a-z-]+)=(\S+)", "\n".join(lines), flags=re.M))
    usage = next(line for line in lines if line.startswith("#   sbatch docker/slurm.sbatch"))
    config, *overrides = usage.split("sbatch docker/slurm.sbatch ")[1].split()
    cfg = load_config(ROOT / config, overrides, validate_paths=False)
    cpus, gpus, _ = ray_demand(cfg)
    nodes = int(opts["nodes"])
    assert gpus <= nodes * int(opts["gpus-per-node"]) and cpus <= nodes * int(opts["cpus-per-task"])


def test_every_ray_node_raygrpo_starts_gets_the_node_start_environment(monkeypatch):
    assert ray_cluster.NODE_START_ENV == {"RAY_agent_register_timeout_ms": "300000",
                                          "RAY_prestart_worker_first_driver": "0"}
    for key, value in ray_cluster.NODE_START_ENV.items():
        assert f"export {key}=${{{key}:-{value}}}" in "\n".join(sbatch_lines()), key
        for name in ("compose.yaml", "compose.host.yaml"):
            compose = yaml.safe_load((ROOT / "docker" / name).read_text())
            assert compose["x-node"]["environment"][key] == value, (name, key)

    seen = {}
    # the real ray._private first: start_ray's loopback_only imports it, which a stand-in `ray` cannot give
    # (this passed only when an earlier test of the same process had imported Ray)
    importlib.import_module("ray._private.ray_constants")
    fake = types.SimpleNamespace(is_initialized=lambda: False,
                                 init=lambda **kw: seen.update(env=dict(__import__("os").environ)))
    monkeypatch.setitem(sys.modules, "ray", fake)
    for key in ray_cluster.NODE_START_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # set, start_ray joins that cluster instead
    ray_cluster.start_ray("", num_cpus=8)  # the embedded cluster: its raylet reads the driver's environment
    assert {k: seen["env"][k] for k in ray_cluster.NODE_START_ENV} == ray_cluster.NODE_START_ENV
    key = "RAY_agent_register_timeout_ms"
    monkeypatch.setenv(key, "900000")  # the user's own setting wins
    ray_cluster.start_ray("", num_cpus=8)
    assert seen["env"][key] == "900000"
