"""The whole system, driven by the real driver loop: real Ray, vLLM, DeepSpeed, tiny model.

Each run starts its own actors in the session's Ray cluster, so a run costs an engine start
plus a DeepSpeed start; the runs are kept few and short.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from finished_run import OLDEST_KEPT, STEPS

from actors.runtime.threads import node_cores
from cluster.config import load_config
from cluster.driver.trainer import Trainer
from cluster.run.metrics import read_metrics
from learner import checkpoint

ROOT = Path(__file__).resolve().parents[2]


def config(tiny_model_dir, run_dir, *overrides):
    base = [
        f"model.path={tiny_model_dir}", f"trainer.run_dir={run_dir}", "trainer.steps=4", "trainer.prompts_per_step=4",
        "trainer.group_size=4", "data.num_eval=0", "data.task_digits=1", "rollout.max_model_len=48",
        "rollout.max_new_tokens=6", "rollout.gpu_memory_utilization=0.03", "learner.lr=1e-3",
        "learner.micro_batch_size=8", "metrics.tensorboard=false", "trainer.actor_timeout_s=600",
        "reward.functions=[exact_match, format]",
    ]
    return load_config(None, [*base, *overrides])


def train_rows(run_dir):
    return read_metrics(run_dir)


def first_and_redone(run_dir, step: int, steps: list[int]) -> tuple[dict, dict]:
    """A run that redid `step` after a resume: its raw metrics.jsonl, as written, holds each train step once
    (`steps`), the first row of `step` moved to metrics.jsonl.superseded by the resume. Returns that first row and
    the row of the step as redone."""
    raw = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in raw if r["kind"] == "train"] == steps
    superseded = [json.loads(line) for line in (run_dir / "metrics.jsonl.superseded").read_text().splitlines()]
    return next(r for r in superseded if r.get("step") == step), next(r for r in raw if r["step"] == step)


def kill_while_learning(trainer: Trainer, at_step: int, role: str) -> list[int]:
    """SIGKILL the actor `role` (from placement.json's roles) once, when the driver starts training
    with `trainer.step == at_step`. Returns the list the killed pid and then the kill's time.monotonic()
    are appended to."""
    learn, killed = trainer._learn, []

    def learn_then_kill(batch, sw):
        if trainer.step == at_step and not killed:
            pid = next(p["pid"] for p in trainer.placement if p["role"] == role)
            os.kill(pid, signal.SIGKILL)
            killed.extend((pid, time.monotonic()))
        return learn(batch, sw)

    trainer._learn = learn_then_kill
    return killed


def listeners_while_learning(trainer: Trainer, at_step: int, role: str) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket of actor `role`, read once when the driver
    starts training with `trainer.step == at_step`."""
    learn, seen = trainer._learn, []

    def learn_and_look(batch, sw):
        if trainer.step == at_step and not seen:
            pid = next(p["pid"] for p in trainer.placement if p["role"] == role)
            seen.extend((c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="tcp")
                        if c.status == psutil.CONN_LISTEN)
        return learn(batch, sw)

    trainer._learn = learn_and_look
    return seen


def threads_while_learning(trainer: Trainer, at_step: int) -> dict[str, int]:
    """role -> the torch threads each actor reports (info()) when the driver starts training step
    `at_step` + 1: what the thread budget really set in the actor, not what the driver planned."""
    import ray

    learn, seen = trainer._learn, {}

    def learn_and_ask(batch, sw):
        if trainer.step == at_step and not seen:
            a = trainer.actors
            handles = {"rollout-0": a.rollouts[0], "learner-0": a.learners[0], **(
                {"reference": a.reference} if a.reference is not None else {})}
            seen.update({role: ray.get(h.info.remote())["torch_threads"] for role, h in handles.items()})
        return learn(batch, sw)

    trainer._learn = learn_and_ask
    return seen


def test_sync_run_with_reference_then_resume_is_exact(finished_run, ray_cluster, tmp_path):
    """A run that never stopped vs one resumed from its step-2 checkpoint: steps 3..4 are equal. The run that
    never stopped is the session's finished run (tests/e2e/finished_run.py: sync, a KL term with the reference
    on the learner rank, reference.placement auto on CPU); the resumed one runs its config in-process with the
    reference on its own actor, which gives the same KL; every actor computes with the thread budget's count.
    (Formerly its own full run too: an engine start and a learner group more. A copied run dir resumed with
    checkpoint.resume=auto: test_safety.py's SIGTERM rerun.)"""
    _, full, _ = finished_run
    rows = train_rows(full)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["weight_version"] == r["step"] and r["staleness"] == 0 for r in rows)
    assert all(r["kl"] is not None for r in rows) and rows[-1]["kl"] > 0 and rows[-1]["ref_s"] > 0
    placement = json.loads((full / "placement.json").read_text())
    assert "reference" not in {p["role"] for p in placement}  # the learner rank computed it
    # sync schedule: each phase gets the whole node (the test machine's cores, as the actors see them); what
    # the actors really set is asked below, of the resumed run's
    assert all(p["threads"] == node_cores() for p in placement)
    assert all(r["gen_tokens"] > 0 and r["sync_bytes"] > 0 for r in rows)
    assert (full / "hf_model" / "config.json").exists()
    assert (full / "config.yaml").exists()

    # The run stopped at step 2, resumed from its step-2 checkpoint (checkpoint.resume names it) in another
    # run dir, with the reference on its own actor: the finished run's own config.yaml (its micro-batches,
    # seed, data, rewards), the reference scoring in the learner's micro-batches (8): with shared prompts a
    # log-prob depends on its micro-batch's padding in the last bits, and where every advantage is 0 (a random
    # model) the KL term is the whole gradient: Adam turns a 1e-14 difference into an lr-sized step. W&B and
    # TensorBoard off: nothing here reads them.
    by_actor = tmp_path / "actor"
    step2 = full / "checkpoints" / checkpoint.step_dir_name(OLDEST_KEPT)
    trainer = Trainer(load_config(full / "config.yaml", [
        f"trainer.run_dir={by_actor}", f"checkpoint.resume={step2}", "reference.placement=actor",
        "reference.threads=1", "reference.micro_batch_size=8", "metrics.wandb=false", "metrics.tensorboard=false"]))
    assert trainer.cfg.learner.micro_batch_size == 8 and trainer.cfg.algo.beta > 0
    threads = threads_while_learning(trainer, at_step=OLDEST_KEPT)
    summary = trainer.run()
    # sync schedule: rollout and learner get the whole node; an override wins
    assert threads == {"rollout-0": node_cores(), "learner-0": node_cores(), "reference": 1}
    assert "reference" in {p["role"] for p in json.loads((by_actor / "placement.json").read_text())}
    assert summary["checkpoint"].endswith(checkpoint.step_dir_name(STEPS))
    resumed = train_rows(by_actor)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))  # steps 1..2 carried by the checkpoint
    assert resumed[-1]["kl"] > 0  # the last step compares a real KL
    for a, b in zip(rows[OLDEST_KEPT:], resumed[OLDEST_KEPT:], strict=True):
        assert a["reward_mean"] == b["reward_mean"], (a, b)
        assert a["gen_tokens"] == b["gen_tokens"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["kl"] == pytest.approx(b["kl"], abs=1e-6), (a, b)


# The run's trainer.actor_timeout_s: a driver that waited on the rank left in a collective with a dead peer would
# take at least this long from the kill to the run's end. The default (600 s), not less: at 240 s a learner rank
# starting DeepSpeed on the slower machine under the suite's load did not answer in time (CI at stop 67).
ASYNC_ACTOR_TIMEOUT_S = 600


def test_async_run_survives_a_killed_engine_reference_and_learner_rank_and_redoes_the_lost_step_exactly(
        tiny_model_dir, ray_cluster, tmp_path):
    """One async run with a KL term (reference.placement auto: the actor, which scores each batch as it is
    collected) on 2 learner ranks, checkpoint at step 2, and three SIGKILLs, each while the driver trains:
    - the engine, while step 2's generation is in flight (it overlaps step 1's training): Ray restarts it, the
      driver re-syncs it and re-sends its prompts. One engine: that a restarted engine of two gets its own share
      again, not the other's, is test_rollout_pool.py's restart in place. (Not later: a batch generated again
      after the restart has the newest weights, and step 3's must be one version behind, below);
    - the reference actor, while step 4 is collected with its log-probs: Ray restarts it and retries the call
      (reference.max_restarts), and every step still has its KL;
    - learner rank 1 of 2, while it trains step 4: rank 0 is left in a collective with a dead peer, yet the
      driver sees the death at once (not after trainer.actor_timeout_s, which here would fail the test),
      restarts the learner ranks, resumes at step 2, and the run still ends with exactly steps 1..4 logged once
      each. Checkpoint 2 carries step 3's batch (generated with the weights of step 1, its reference log-probs
      with it), so the redone step 3 trains on the same batch with the same weights as the first time: an
      exact resume, with the two ranks' gradients reduced as the first time.
    (Formerly two runs, test_async_run_survives_a_killed_rollout_worker and
    test_a_dead_learner_rank_of_two_resumes_exactly_without_waiting_out_the_timeout: each run costs an engine
    start and the learner ranks'.)"""
    run_dir = tmp_path / "async"
    trainer = Trainer(config(tiny_model_dir, run_dir, "trainer.mode=async", "algo.beta=0.05", "learner.num_ranks=2",
                             "checkpoint.every=2", "trainer.max_learner_restarts=1",
                             f"trainer.actor_timeout_s={ASYNC_ACTOR_TIMEOUT_S}"))
    killed = kill_while_learning(trainer, at_step=0, role="rollout-0")  # training step 1, generating step 2
    # training step 3 while step 4 is collected, its reference log-probs included
    killed_reference = kill_while_learning(trainer, at_step=2, role="reference")
    killed_rank = kill_while_learning(trainer, at_step=3, role="learner-1")  # training step 4
    sockets = listeners_while_learning(trainer, at_step=1, role="learner-0")
    summary = trainer.run()
    assert killed and killed_reference and killed_rank, "a worker was never killed: the test did not test anything"
    # From the rank's kill to the run's end (the ranks restarted, steps 3 and 4 trained) in less than the timeout
    # a driver that waited on rank 0 alone would have waited out first: the death was seen at once.
    assert trainer.learner_restarts == 1 and time.monotonic() - killed_rank[1] < ASYNC_ACTOR_TIMEOUT_S
    assert summary["checkpoint"].endswith("step-00000004")
    # embedded cluster: rank 0's own listeners (rendezvous + weight-transfer stores, gloo) on loopback
    # only; the one wildcard socket is Ray's core-worker server, which every actor process has
    assert sum(ip == "127.0.0.1" for ip, _ in sockets) >= 2, sockets
    assert sum(ip in ("0.0.0.0", "::") for ip, _ in sockets) == 1 and {ip for ip, _ in sockets} <= {
        "127.0.0.1", "0.0.0.0", "::"}, sockets
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert summary["rollout_restarts"] >= 1 and rows[-1]["rollout_restarts"] >= 1
    # async: each batch comes from the previous version (never older than max_staleness=1)
    assert all(0 <= r["staleness"] <= 1 for r in rows) and any(r["staleness"] == 1 for r in rows)
    # no prompt lost: every step trained on full groups, and the weights kept advancing
    assert all(r["trained_groups"] == 4 for r in rows)
    assert [r["weight_version"] for r in rows] == [1, 2, 3, 4]
    assert all(r["sync_verified"] is True for r in rows), rows  # async updates verified on every engine, a restarted one too
    assert all(r["kl"] is not None and r["ref_s"] > 0 for r in rows)
    placement = {p["role"]: p for p in json.loads((run_dir / "placement.json").read_text())}
    # placement.json shows the engine Ray restarted, not the one killed (a reference actor Ray restarts on a live
    # host is not noticed by the driver, its call retried by Ray: placement.json keeps its first pid)
    assert placement["rollout-0"]["pid"] != killed[0]
    threads = {role: p["threads"] for role, p in placement.items()}
    # the reference collects with the engines while the learner trains: they split the cores
    assert threads["reference"] + threads["learner-0"] <= max(2, node_cores())

    # step 3 was logged before the rank's death and redone after the resume from step 2
    first, again = first_and_redone(run_dir, step=3, steps=[1, 2, 3, 4])
    assert first["staleness"] == again["staleness"] == 1
    for key in ("reward_mean", "gen_tokens", "trained_groups"):
        assert first[key] == again[key], key
    # the same weights on the same batch (its reference log-probs carried with it):
    for key in ("grad_norm", "entropy", "logprob_diff_mean", "loss", "kl"):
        assert first[key] == pytest.approx(again[key], rel=1e-6), key
    assert first["grad_norm"] > 0


def run_cli(*args, cwd=ROOT, timeout=600):
    return subprocess.run([sys.executable, "-m", "cluster.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


def test_malformed_dataset_line_is_named_and_exits_nonzero(tiny_model_dir, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"\n')
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{path: {tiny_model_dir}}}\ndata: {{train: {data}}}\ntrainer: {{run_dir: {tmp_path / 'run'}}}\n")
    out = run_cli("train", cfg)
    assert out.returncode == 2
    assert f"{data}:2" in out.stderr and "Traceback" not in out.stderr
