"""The demo's recipes (`raygrpo demo --recipe NAME`): one training mode each, shown to learn on a CPU.

A recipe is data, not code: which config and overrides it trains with, which base model it starts
from, what data it writes, and how its warm start trains and checks itself. `run_demo`
(cluster/demo/demo.py) runs every recipe the same way: base model -> data -> warm start (cached)
-> GRPO through the full system -> the before/after table and verdict.

  addition  2-digit addition on a character-level model, full fine-tuning, the sync schedule
  lora      the same task with a LoRA adapter; only the adapter travels to vLLM
            (learner.lora_sync=adapter); the reference is the base model with adapters off
  async     the same task with trainer.mode=async, the default thread budget, reference.placement=auto
  pipeline  the same task with trainer.mode=pipeline: the engine never stops, weight updates land
            mid-request; no evaluation during training (pipeline mode refuses trainer.eval_every), and
            one thread per actor as cpu_demo.yaml sets (the seeds in docs/STATUS.md were measured so)
  chat      a byte-level BPE chat model (ChatML, EOS <|im_end|>) on conversational word problems,
            rendered with the chat template and scored by the gsm8k reward
  tools     multi-turn with the built-in calculator on 3-digit products: the warm start can use the
            tool but does not call it; GRPO has to learn to call it and use its answer
  reward_model  the addition task scored by a learned reward model alone (`model:PATH`, a
            RewardModelActor): initialised from the warm start, trained on its own samples
            (cluster/demo/policyreward.py), built and cached after the warm start; exact_match only judges
  smollm2   a real pretrained model, SmolLM2-135M-Instruct (Llama, tied embeddings, ChatML), converted
            from PyPI by cluster/models/smollm2.py; no warm start: GRPO trains the instruct model as
            it is, on word problems asked after one worked example, a format it half follows (smollm2_data)
  code      SmolLM2-135M-Instruct again, writing small Python functions scored by code_tests (the strict
            sandbox); the held-out split's functions are never trained on (cluster/models/codetasks.py)

The addition recipes share their base model and cached warm start.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from cluster.demo.checks import forced_call_accuracy, gsm8k_accuracy
from cluster.demo.policyreward import PolicyRewardSpec
from cluster.models.codetasks import HELD_OUT_CONSTANTS, TRAIN_CONSTANTS, code_rows
from cluster.models.tasks import chat_rows, conversation_sequence, tool_rows
from cluster.models.tinychat import TinyChatSpec
from cluster.models.tinymodel import TinyModelSpec
from cluster.models.warmstart import Check, Sequence, WarmStartSpec, answer_sequence, greedy_accuracy
from cluster.models.wordproblems import write_jsonl
from cluster.paths import PROJECT_ROOT

MODEL = TinyModelSpec(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512, seed=0)
# Chosen so GRPO has room to improve: big enough to learn 2-digit addition, warm start stopped
# well below the ceiling (see docs/STATUS.md). The warm start stops at a target accuracy, not
# at a step count: 900 steps gave 0.31 on one CPU and 0.205 on another, and GRPO's gain halved.
ADDITION_WARM_START = WarmStartSpec(steps=2000, batch_size=64, lr=1e-3, target_accuracy=0.25, check_every=20,
                                    num_check=200)
# The chat model's tokenizer also learns the recipes' conversations (numbers, calc(...) calls).
CHAT_MODEL = TinyChatSpec(model=MODEL, corpus="recipes")
TRAIN_ROWS, EVAL_ROWS = 5000, 400
ONE_DIGIT = {"lo": 1, "hi": 9, "b_lo": 1, "b_hi": 9}
TOOL_FRACTION = 0.3  # of the warm start's rows that show a call: enough to learn its format, not its habit


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    config: Path  # the run's config; `overrides` apply on top, the user's dotted overrides after them
    overrides: tuple[str, ...] = ()
    base: str = "addition"  # the base model: "addition" (character-level), "chat" (BPE, ChatML) or "smollm2"
    # (pretrained, built from PyPI)
    rows: Callable[[], tuple[list[dict], list[dict]]] | None = None  # (train, held-out) rows; None: the config's task
    warm_start: WarmStartSpec | None = ADDITION_WARM_START  # None: GRPO starts from the base model itself
    sequence: Sequence = answer_sequence  # what the warm start trains on
    check: Check = greedy_accuracy  # how it checks itself (stops at warm_start.target_accuracy)
    check_name: str = "greedy accuracy"
    tool_stats: bool = False  # print the greedy evaluation's tool calls per trajectory
    reward_model: PolicyRewardSpec | None = None  # built from the warm start; the run's reward.functions

    def warm_start_name(self, spec: WarmStartSpec) -> str:
        """The cached warm start's directory: the addition recipes share one (the demo's own)."""
        prefix = "" if self.base == "addition" else f"{self.name}-"
        return f"warm-{prefix}to{spec.target_accuracy:.2f}-seed{spec.seed}-threads{spec.threads}"

    def write_data(self, cache: Path) -> list[str]:
        """The recipe's train and held-out JSONL files under `cache` (deterministic), as overrides;
        [] for the addition task, which the config generates itself."""
        if self.rows is None:
            return []
        train, held = self.rows()
        d = cache / f"data-{self.name}"
        return [f"data.train={write_jsonl(d / 'train.jsonl', train)}", f"data.eval={write_jsonl(d / 'eval.jsonl', held)}"]


def chat_data() -> tuple[list[dict], list[dict]]:
    return chat_rows(TRAIN_ROWS, seed=1, **ONE_DIGIT), chat_rows(EVAL_ROWS, seed=2, **ONE_DIGIT)


def tools_data() -> tuple[list[dict], list[dict]]:
    """The held-out prompts carry no demonstration: they are only asked."""
    return tool_rows(TRAIN_ROWS, seed=1, tool_fraction=TOOL_FRACTION), tool_rows(EVAL_ROWS, seed=2, tool_fraction=0.0)


def smollm2_data() -> tuple[list[dict], list[dict]]:
    """The chat recipe's one-digit word problems asked of SmolLM2-135M-Instruct after one worked example
    turn ("3 + 4 = 7\n#### 7", tasks.WORKED_EXAMPLE): a format it half follows. Without the example it rarely
    ends its turn ("#### 2\nThe answer is 2.\n#### 4..." to the token cap; gsm8k reads the last "####"), so
    sampled answers were right 13.5% of the time; with it, it stops by itself, and its answers are right and
    end in "#### N" greedy on 35% of held-out prompts, sampled on 24% (it often drops the "####" line
    or slips on the arithmetic). The screen's table is in docs/STATUS.md."""
    return (chat_rows(TRAIN_ROWS, seed=1, worked_example=True, **ONE_DIGIT),
            chat_rows(EVAL_ROWS, seed=2, worked_example=True, **ONE_DIGIT))


def code_data() -> tuple[list[dict], list[dict]]:
    """Functions to write (codetasks.py): the training split's constants, and held-out functions never trained on."""
    return code_rows(TRAIN_ROWS, seed=1, constants=TRAIN_CONSTANTS), code_rows(EVAL_ROWS, seed=2, constants=HELD_OUT_CONSTANTS)


EXAMPLES = PROJECT_ROOT / "examples"
RECIPES = {r.name: r for r in (
    Recipe("addition", EXAMPLES / "cpu_demo.yaml"),
    Recipe("lora", EXAMPLES / "cpu_demo.yaml", ("learner.lora_rank=16", "learner.lora_alpha=32", "learner.lr=1e-3",
                                                "learner.lora_sync=adapter", "reference.placement=learner")),
    Recipe("async", EXAMPLES / "cpu_demo.yaml", ("trainer.mode=async", "reference.placement=auto", "rollout.threads=0",
                                                 "learner.threads=0", "reference.threads=0")),
    # 64 groups in flight (twice the default bound, which was the default then): how its seeds were measured
    Recipe("pipeline", EXAMPLES / "cpu_demo.yaml", ("trainer.mode=pipeline", "trainer.eval_every=0",
                                                    "trainer.pipeline_groups_in_flight=64")),
    Recipe("chat", EXAMPLES / "recipe_chat.yaml", base="chat", rows=chat_data, check=gsm8k_accuracy,
           warm_start=WarmStartSpec(steps=1000, batch_size=64, lr=1e-3, target_accuracy=0.25, check_every=10,
                                    num_check=200)),
    Recipe("tools", EXAMPLES / "recipe_tools.yaml", base="chat", rows=tools_data, sequence=conversation_sequence,
           check=forced_call_accuracy, check_name="greedy accuracy with a forced first call", tool_stats=True,
           warm_start=WarmStartSpec(steps=2000, batch_size=64, lr=1e-3, target_accuracy=0.5, check_every=50,
                                    num_check=200)),
    Recipe("reward_model", EXAMPLES / "reward_model.yaml", reward_model=PolicyRewardSpec()),
    Recipe("smollm2", EXAMPLES / "recipe_smollm2.yaml", base="smollm2", rows=smollm2_data, warm_start=None),
    Recipe("code", EXAMPLES / "recipe_code.yaml", base="smollm2", rows=code_data, warm_start=None),
)}
