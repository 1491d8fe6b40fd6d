import subprocess
import sys

import pytest

from cluster.cli import build_parser, main
from cluster.models.tinymodel import TinyModelSpec, build_tiny_model

COMMANDS = ["train", "data", "submit", "show", "export", "plot", "demo", "bench"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_useful_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"raygrpo {command}" in out and len(out) > 200


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and all(c in out.stdout for c in COMMANDS)


def test_broken_config_is_one_clear_error_and_exit_2(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("trainer:\n  group_size: 1\n  stepz: 3\nmodel:\n  path: /nonexistent\n")
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "unknown key trainer.stepz" in err and "Traceback" not in err


def test_missing_model_dir_exit_2(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model:\n  path: {tmp_path}/no-model\n")
    assert main(["train", str(cfg)]) == 2
    assert "is not a model directory" in capsys.readouterr().err


def test_submit_checks_the_users_files_before_contacting_the_cluster(tmp_path, capsys):
    """A config outside the checkout: its directory is the working dir, and a reward file the config
    names but that directory lacks is refused before anything is uploaded (no cluster at that address)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("reward: {functions: [my_rewards.py:score]}\n")
    assert main(["submit", str(cfg), "--address", "http://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'my_rewards.py'} does not exist" in err and "relative to it" in err


def test_unknown_reward_function_is_a_config_error(tmp_path, capsys):
    model = build_tiny_model(tmp_path / "m", TinyModelSpec(num_layers=1))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{path: {model}}}\nreward: {{functions: [no_such_reward]}}\n"
                   f"trainer: {{run_dir: {tmp_path / 'run'}}}\n")
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "unknown reward function 'no_such_reward'" in err and "exact_match" in err
