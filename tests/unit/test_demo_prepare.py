"""`raygrpo demo --recipe NAME` up to the run: each recipe composed by the CLI's own path (build_parser's args into
cluster/demo/demo.py prepare_demo), no engine. Every recipe but the SmolLM2 ones (their model is converted from PyPI:
test_demo_recipes.py): the config it trains with (its overrides, data files, the user's overrides last), which warm
start it trains from and how that warm start trains and checks itself, and the reward_model recipe's reward model,
built from that warm start. The warm start's and the reward model's own training are stood in for here (they are
test_warmstart.py's and test_policy_reward.py's; the chat and tools warm starts run for real, and the addition and
reward_model recipes train, in tests/e2e/test_recipes_end_to_end.py). Step 4, the printed results, below too."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from cluster.cli import build_parser
from cluster.config import load_config
from cluster.demo import demo
from cluster.demo.checks import forced_call_accuracy, gsm8k_accuracy
from cluster.demo.demo import DEMO_MARK, DemoRun, prepare_demo, print_results
from cluster.demo.recipes import RECIPES
from cluster.models.tasks import conversation_sequence
from cluster.models.warmstart import answer_sequence, greedy_accuracy

# what the e2e tier's runs pass: the user's overrides, which come after the recipe's
SMALL = ["--seed", "1", "--steps", "1", "--warm-start-steps", "10", "--reward-model-steps", "10",
         "trainer.prompts_per_step=4", "data.num_eval=8"]
BUILT = [name for name, r in RECIPES.items() if r.base != "smollm2"]


def stand_in(mp: pytest.MonkeyPatch) -> dict:
    """The warm start and the reward model stood in for: each call recorded, its directory a copy of the model it
    starts from (a model directory the config accepts)."""
    calls: dict = {"warm": [], "rm": []}

    def warm_start(base, out, examples, spec, *, sequence, check, task):
        calls["warm"].append({"base": Path(base), "out": Path(out), "n": len(examples), "spec": spec,
                              "sequence": sequence, "check": check, "task": task})
        if not Path(out).exists():
            shutil.copytree(base, out)
        return Path(out)

    def reward_model(policy, out, examples, spec):
        calls["rm"].append({"policy": Path(policy), "out": Path(out), "n": len(examples), "spec": spec})
        if not Path(out).exists():
            shutil.copytree(policy, out)
        return Path(out)

    mp.setattr(demo, "warm_start", warm_start)
    mp.setattr(demo, "warm_start_result", lambda out: {"steps": 10, "accuracy": 0.0})
    mp.setattr(demo, "build_policy_reward_model", reward_model)
    mp.setattr(demo, "policy_reward_result", lambda out: {"report": {}})
    mp.setattr(demo, "describe", lambda report: "is stood in for")
    return calls


def prepare(name: str, cache: Path, run_dir: Path, *extra: str):
    args = build_parser().parse_args(["demo", "--recipe", name, "--run-dir", str(run_dir), "--cache-dir", str(cache),
                                      *SMALL, *extra])
    return prepare_demo(args)


@dataclasses.dataclass
class Prepared:
    run: DemoRun
    calls: dict  # the stand-ins' calls its preparation made
    run_dir: Path  # the --run-dir it was given
    cache: Path  # the --cache-dir, the same for every recipe


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict[str, Prepared]:
    """Every recipe prepared once, in one cache shared as a user's is: the base models are built once, by the real
    builders (offline); the data files written by each recipe's own code."""
    cache, runs, out = tmp_path_factory.mktemp("demo-cache"), tmp_path_factory.mktemp("runs"), {}
    with pytest.MonkeyPatch.context() as mp:
        calls = stand_in(mp)
        for name in BUILT:
            calls["warm"], calls["rm"] = [], []
            out[name] = Prepared(prepare(name, cache, runs / name), dict(calls), runs / name, cache)
    return out


@pytest.mark.parametrize("name", BUILT)
def test_every_recipe_composes_a_valid_config_on_its_warm_start(name, prepared):
    p = prepared[name]
    recipe, cfg, built, run_dir, cache = p.run.recipe, p.run.cfg, p.calls, p.run_dir, p.cache
    assert recipe is RECIPES[name] and cfg.problems() == []  # load_config validated it, model.path included
    # the CLI's options and the user's overrides, after the recipe's own
    assert (cfg.trainer.seed, cfg.trainer.steps, cfg.trainer.prompts_per_step, cfg.data.num_eval) == (1, 1, 4, 8)
    assert cfg.trainer.run_dir == str(run_dir) and not run_dir.exists()  # run_demo makes it
    # GRPO starts from the warm start, trained from the recipe's base model with the CLI's seed and step cap
    [warm] = built["warm"]
    assert cfg.model.path == str(warm["out"]) and warm["out"].parent == cache
    assert warm["base"].name == ("base-qwen2-h128-l4" if recipe.base == "addition" else "chat-recipes-qwen2-h128-l4")
    assert (warm["spec"].seed, warm["spec"].steps, warm["spec"].threads) == (1, 10, 1)
    assert warm["spec"].target_accuracy == recipe.warm_start.target_accuracy and warm["n"] > 0
    assert warm["out"].name == recipe.warm_start_name(warm["spec"])
    if recipe.base == "addition":  # one warm start for the addition recipes: the demo's own
        assert warm["out"].name == "warm-to0.25-seed1-threads1" and warm["task"] == ""
        assert (warm["sequence"], warm["check"]) == (answer_sequence, greedy_accuracy)
        assert cfg.data.train == "task:addition"
    if name == "reward_model":  # its reward model, from the warm start, is the run's only reward
        [rm] = built["rm"]
        assert rm["policy"] == warm["out"] and rm["out"] == cache / "rm-warm-to0.25-seed1-threads1"
        assert (rm["spec"].seed, rm["spec"].steps) == (1, 10) and rm["n"] == warm["n"]
        assert cfg.reward.functions == [f"model:{rm['out']}"] and cfg.reward.names == ["addition_rm"]
    else:
        assert built["rm"] == [] and not any(f.startswith("model:") for f in cfg.reward.functions)


def test_each_recipe_trains_what_it_names(prepared):
    """Each recipe's own settings, as the run gets them (what docs and `raygrpo demo --help` promise)."""
    cfgs, cache = {name: p.run.cfg for name, p in prepared.items()}, prepared["chat"].cache
    a = cfgs["addition"]
    assert (a.trainer.mode, a.learner.lora_rank, a.reward.functions, a.rollout.env) == ("sync", 0, ["exact_match"], "")
    lora = cfgs["lora"]
    assert (lora.learner.lora_rank, lora.learner.lora_alpha, lora.learner.lr) == (16, 32, 1e-3)
    assert lora.learner.lora_sync == "adapter" and lora.reference.placement == "learner"
    asy = cfgs["async"]
    assert asy.trainer.mode == "async" and asy.reference.placement == "auto"
    assert (asy.rollout.threads, asy.learner.threads, asy.reference.threads) == (0, 0, 0)  # the default thread budget
    pipe = cfgs["pipeline"]
    assert (pipe.trainer.mode, pipe.trainer.eval_every, pipe.trainer.pipeline_groups_in_flight) == ("pipeline", 0, 64)
    for name in ("lora", "async", "pipeline", "reward_model"):  # the addition task, on the demo's warm start
        assert (cfgs[name].data.train, cfgs[name].model.path) == ("task:addition", a.model.path), name
    tools = cfgs["tools"]
    assert tools.rollout.env == "calculator" and tools.reward.functions == ["gsm8k"]
    assert cfgs["chat"].rollout.env == "" and cfgs["chat"].reward.functions == ["gsm8k"]
    # the chat and tools recipes train on their own data, written into the cache, each with its own warm start
    warm = {w["out"].name: w for p in prepared.values() for w in p.calls["warm"]}
    for name, check, sequence, target in (("chat", gsm8k_accuracy, answer_sequence, 0.25),
                                          ("tools", forced_call_accuracy, conversation_sequence, 0.5)):
        cfg = cfgs[name]
        assert (cfg.data.train, cfg.data.eval) == (str(cache / f"data-{name}" / "train.jsonl"),
                                                   str(cache / f"data-{name}" / "eval.jsonl"))
        w = warm[f"warm-{name}-to{target:.2f}-seed1-threads1"]
        assert cfg.model.path == str(w["out"]) and (w["check"], w["sequence"], w["task"]) == (check, sequence, name)
        assert w["n"] == 5000  # the train split, rendered as the run renders it
    first = json.loads((cache / "data-chat" / "train.jsonl").read_text().splitlines()[0])
    assert first["prompt"][0]["role"] == "system" and "####" in first["answer"]
    assert len({a.model.path, cfgs["chat"].model.path, tools.model.path}) == 3


def test_a_run_dir_holding_a_users_run_is_refused_before_any_warm_start(monkeypatch, tmp_path, capsys):
    built, user_run = stand_in(monkeypatch), tmp_path / "mine"
    user_run.mkdir()
    (user_run / "config.yaml").write_text(json.dumps({"model": {"path": str(tmp_path / "my-model")}}))
    assert prepare("addition", tmp_path / "cache", user_run) is None
    assert built["warm"] == [] and sorted(p.name for p in user_run.iterdir()) == ["config.yaml"]
    assert "refusing to start afresh" in capsys.readouterr().err
    assert not (user_run / DEMO_MARK).exists()


def results(name: str, tmp_path: Path, capsys) -> str:
    """What step 4 prints for `name` after a 1-step run with 8 held-out prompts, its one update verified."""
    before = {"accuracy": 0.25, "pass@2": 0.5, "num_prompts": 8, "tool_calls_per_trajectory": 0.0, "tool_call_rate": 0.0}
    after = {"accuracy": 0.5, "pass@2": 0.625, "num_prompts": 8, "tool_calls_per_trajectory": 1.5, "tool_call_rate": 0.75}
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "sync_verified": True}) + "\n")
    cfg = load_config(RECIPES[name].config, ["model.path=/nonexistent", "trainer.eval_pass_k=2"], validate_paths=False)
    print_results(RECIPES[name], cfg, {"before": before, "after": after, "run_dir": str(tmp_path), "hf_model": "h",
                                       "checkpoint": "c"}, [tmp_path / "reward.png"])
    return capsys.readouterr().out


@pytest.mark.parametrize("name", ["addition", "tools"])
def test_the_results_show_the_table_the_verdict_and_the_verified_syncs(name, tmp_path, capsys):
    out = results(name, tmp_path, capsys)
    assert "[4/4] held-out evaluation (8 unseen prompts)" in out and "verdict: held-out greedy accuracy 0.250 -> 0.500" in out
    assert "accuracy (greedy)" in out and "pass@2" in out
    assert "weight sync verified at 1 of 1 steps" in out and f"reward plot:  {tmp_path / 'reward.png'}" in out
    # only the tools recipe shows its greedy trajectories' tool calls, before and after
    assert ("tool_calls_per_trajectory (greedy)" in out) == ("tool_call_rate (greedy)" in out) == (name == "tools")
    if name == "tools":
        assert any(line.split()[-2:] == ["0.000", "0.750"] for line in out.splitlines() if "tool_call_rate" in line)


def test_the_users_overrides_win_over_the_recipes(prepared, monkeypatch, tmp_path):
    stand_in(monkeypatch)
    cfg = prepare("lora", prepared["lora"].cache, tmp_path / "run", "learner.lr=5e-4", "reference.placement=actor").cfg
    assert (cfg.learner.lr, cfg.reference.placement, cfg.learner.lora_rank) == (5e-4, "actor", 16)
