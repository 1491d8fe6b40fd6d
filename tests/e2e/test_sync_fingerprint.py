"""The verified weight sync (actors/transport/fingerprint.py), through the real driver loop: real
Ray, vLLM, DeepSpeed. An engine that does not hold what the learner sent halts the run at that
step, naming the engine and a tensor; a healthy run logs `sync_verified` true at every step.
"""
from __future__ import annotations

import sys

import pytest

from cluster.config import load_config
from cluster.driver.trainer import Trainer
from cluster.run.health import TrainingHalted
from cluster.run.metrics import read_metrics


def config(tiny_model_dir, run_dir, *overrides):
    # A reward that differs between a prompt's completions at every step, so every step trains and syncs.
    reward = run_dir.parent / "length_reward.py"
    reward.write_text("def reward(prompt, completion, **kw):\n    return len(completion) / 10\n")
    return load_config(None, [
        f"model.path={tiny_model_dir}", f"trainer.run_dir={run_dir}", "trainer.steps=3", "trainer.prompts_per_step=4",
        "trainer.group_size=4", "data.num_eval=0", "data.task_digits=1", "rollout.max_model_len=48",
        "rollout.max_new_tokens=6", "rollout.gpu_memory_utilization=0.03", "learner.lr=1e-3",
        "learner.micro_batch_size=8", "metrics.tensorboard=false", "trainer.actor_timeout_s=300",
        f"reward.functions=['{reward}:reward']", "checkpoint.every=0", *overrides])


def leave_the_next_update_out(worker) -> None:
    """Runs inside a RolloutWorker (Ray's __ray_call__): its next weight update goes through the whole
    protocol (the sender's broadcast completes, the version is stamped), but the engine ends it
    holding the weights it had before, as if the update had never been loaded. Once."""
    llm = worker.llm
    start, finish = llm.start_weight_update, llm.finish_weight_update
    saved = []

    def start_and_save(*a, **kw):
        saved.extend(llm.apply_model(lambda m: [p.data.clone() for p in m.parameters()])[0])
        return start(*a, **kw)

    def restore_and_finish(*a, **kw):
        llm.apply_model(lambda m: [p.data.copy_(old) for p, old in zip(m.parameters(), saved)])
        llm.start_weight_update, llm.finish_weight_update = start, finish
        return finish(*a, **kw)

    llm.start_weight_update, llm.finish_weight_update = start_and_save, restore_and_finish


def test_an_update_left_out_on_one_engine_halts_the_run_at_that_step(tiny_model_dir, ray_cluster, tmp_path):
    """One engine: the check names the engine it catches; that it names the right one of several is
    tests/unit/test_fingerprint.py's (a changed row range named with its engine, the other one passing)."""
    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors cannot import this test module

    run_dir = tmp_path / "run"
    trainer = Trainer(config(tiny_model_dir, run_dir))
    learn, armed = trainer._learn, []

    def learn_with_a_fault(batch, sw):
        if trainer.step == 1 and not armed:  # training step 2: its update will not reach the engine
            ray.get(trainer.actors.rollouts[0].__ray_call__.remote(leave_the_next_update_out))
            armed.append(True)
        return learn(batch, sw)

    trainer._learn = learn_with_a_fault
    with pytest.raises(TrainingHalted) as e:
        trainer.run()
    assert armed, "the fault was never injected: the test did not test anything"
    msg = str(e.value)
    assert msg.startswith("step 2: weight sync check failed after the update to version 2: rollout worker 0"), msg
    assert "tensor model." in msg and "sampled values differ" in msg, msg
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1] and rows[0]["sync_verified"] is True  # step 1 was fine, and kept
