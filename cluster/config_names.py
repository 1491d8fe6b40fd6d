"""What an unknown config key probably meant: a raygrpo key spelled close to it, or a TRL / verl name.

Policy for other frameworks' names: refused, with the raygrpo key to write instead (never a
silent alias). Several of them do not mean quite what the raygrpo key means (TRL's `epsilon`
sets both clip bounds, its `per_device_train_batch_size` counts completions, its `loss_type`
picks an aggregation and an advantage), so one name per setting keeps every saved config.yaml
readable and a run dir's continuity check exact. README "Coming from TRL or verl" lists them.
"""
from __future__ import annotations

import difflib

# name users type -> (whose name it is, the raygrpo key(s), what differs; "" when the meaning is the same)
FOREIGN_NAMES: dict[str, tuple[str, str, str]] = {
    # TRL GRPOConfig
    "num_generations": ("TRL", "trainer.group_size", ""),
    "epsilon": ("TRL", "algo.clip_low and algo.clip_high",
                "TRL's epsilon is both bounds unless epsilon_high is set; set both keys"),
    "epsilon_high": ("TRL", "algo.clip_high", ""),
    "loss_type": ("TRL", "algo.aggregation (with algo.advantage_estimator)",
                  "grpo: aggregation=seq-mean-token-mean; bnpo/dapo: token-mean; dr_grpo: "
                  "aggregation=seq-mean-token-sum-norm and advantage_estimator=dr_grpo"),
    "report_to": ("TRL", "metrics.tensorboard and metrics.wandb", "two booleans, e.g. metrics.wandb=true"),
    "max_completion_length": ("TRL", "rollout.max_new_tokens", ""),
    "per_device_train_batch_size": ("TRL", "trainer.prompts_per_step and learner.micro_batch_size",
                                    "TRL counts completions per device; a raygrpo step takes trainer.prompts_per_step "
                                    "prompts x trainer.group_size completions, trained in micro-batches of "
                                    "learner.micro_batch_size sequences per rank"),
    "learning_rate": ("TRL", "learner.lr", ""),
    "max_prompt_length": ("TRL", "data.max_prompt_tokens", "raygrpo filters longer prompts (data.long_prompts), "
                                                            "it never truncates them"),
    "num_iterations": ("TRL", "learner.mu", ""),
    "importance_sampling_level": ("TRL", "algo.ratio_level", "the same values: token | sequence"),
    "max_steps": ("TRL", "trainer.steps", ""),
    "output_dir": ("TRL", "trainer.run_dir", ""),
    "run_name": ("TRL", "metrics.wandb_run_name", ""),
    "log_completions": ("TRL", "metrics.log_completions", ""),
    "num_completions_to_print": ("TRL", "metrics.completions_per_step", ""),
    # verl (actor_rollout_ref.*, data.*, algorithm.*, trainer.*)
    "n": ("verl", "trainer.group_size", "verl's actor_rollout_ref.rollout.n"),
    "clip_ratio": ("verl", "algo.clip_low and algo.clip_high", ""),
    "clip_ratio_low": ("verl", "algo.clip_low", ""),
    "clip_ratio_high": ("verl", "algo.clip_high", ""),
    "kl_loss_coef": ("verl", "algo.beta", ""),
    "kl_loss_type": ("verl", "algo.kl_estimator", "verl's low_var_kl is k3"),
    "loss_agg_mode": ("verl", "algo.aggregation", "the same values"),
    "adv_estimator": ("verl", "algo.advantage_estimator", ""),
    "train_batch_size": ("verl", "trainer.prompts_per_step", "prompts per step, as in verl"),
    "max_response_length": ("verl", "rollout.max_new_tokens", ""),
    "ppo_micro_batch_size_per_gpu": ("verl", "learner.micro_batch_size", ""),
    "total_training_steps": ("verl", "trainer.steps", ""),
    "project_name": ("verl", "metrics.wandb_project", ""),
    "experiment_name": ("verl", "metrics.wandb_run_name", ""),
    "logger": ("verl", "metrics.tensorboard and metrics.wandb", "two booleans"),
}


def foreign_name_hint(key: str, written: str = "") -> str:
    """'TRL's name; in raygrpo: trainer.group_size' for a TRL/verl name, else ''.
    written: the whole dotted key as the user wrote it (verl's actor_rollout_ref.rollout.n), named instead."""
    if key not in FOREIGN_NAMES:
        return ""
    who, ours, note = FOREIGN_NAMES[key]
    written = written or key
    note = "" if "." in written and written in note else note  # "verl's actor_rollout_ref.rollout.n": nothing new
    return f"{written} is {who}'s name; raygrpo calls it {ours}" + (f" ({note})" if note else "")


def did_you_mean(key: str, section: str, section_keys: list[str], all_keys: list[str]) -> list[str]:
    """Likely intended dotted keys for `key` found in `section` ("" = top level): close spellings
    in the same section, then the same or a close name in another section (trainer.lr -> learner.lr)."""
    prefix = f"{section}." if section else ""
    out = [prefix + k for k in difflib.get_close_matches(key, section_keys, n=3, cutoff=0.75)]
    leaves = {k.rpartition(".")[2]: k for k in all_keys}
    for leaf in difflib.get_close_matches(key, list(leaves), n=3, cutoff=0.8):
        for full in all_keys:
            if full.rpartition(".")[2] == leaf and full not in out and full.rpartition(".")[0] != section:
                out.append(full)
    if not out and section == "" and "." not in key:  # a section name typed wrong: `trainers:`
        out = difflib.get_close_matches(key, section_keys, n=2, cutoff=0.6)
    return out[:3]


def unknown_key_problem(key: str, section: str, section_keys: list[str], all_keys: list[str]) -> str:
    """The one line an unknown key gets in a ConfigError."""
    where = f"{section}.{key}" if section else key
    hint = foreign_name_hint(key)
    if hint:
        return f"unknown key {where}: {hint}"
    guesses = did_you_mean(key, section, section_keys, all_keys)
    if guesses:
        return f"unknown key {where}: did you mean {' or '.join(guesses)}?"
    return f"unknown key {where} (known{' in ' + section if section else ' sections'}: {', '.join(sorted(section_keys))})"


def _leaves(prefix: str, mapping: dict):
    for k, v in mapping.items():
        path = f"{prefix}.{k}"
        if isinstance(v, dict) and v:
            yield from _leaves(path, v)
        else:
            yield path


def unknown_key_problems(key: str, value, section: str, section_keys: list[str], all_keys: list[str]) -> list[str]:
    """The lines an unknown key gets. A mapping under it (verl's nested keys: the override
    `actor_rollout_ref.rollout.n=8`, or `algorithm: {adv_estimator: grpo}` in YAML) gets one line per
    leaf when a leaf is a TRL/verl name, or, unless the key is a raygrpo section misspelt (`trainers:`),
    when a leaf is a raygrpo key's name (`actor_rollout_ref.actor.optim.lr` -> learner.lr); else the
    key gets one line."""
    where = f"{section}.{key}" if section else key
    if isinstance(value, dict) and value:
        lines, foreign, guessed = [], False, False
        for path in _leaves(where, value):
            leaf = path.rpartition(".")[2]
            hint = foreign_name_hint(leaf, path)
            guesses = [] if hint else did_you_mean(leaf, "", [], all_keys)
            foreign, guessed = foreign or bool(hint), guessed or bool(guesses)
            lines.append(f"unknown key {path}: {hint}" if hint else
                         f"unknown key {path}: did you mean {' or '.join(guesses)}?" if guesses else
                         f"unknown key {path} (no raygrpo key of that name)")
        if foreign or (guessed and not did_you_mean(key, section, section_keys, all_keys)):
            return lines
    return [unknown_key_problem(key, section, section_keys, all_keys)]
