"""cluster/run/logs.py: the console level, and what a Ray worker's set-up hook does with each kind of output.
The hook runs in a plain subprocess here (as Ray runs it in a fresh worker); no Ray, no vLLM."""
import importlib.util
import json
import logging
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cluster.cli import main
from cluster.run import logs

WORKER = textwrap.dedent("""
    import json, logging, logging.config, os, sys
    from cluster.run.logs import setup_worker
    setup_worker()
    print("raygrpo line from an actor", flush=True)
    os.write(2, b"[W1124 utils.cpp:68] a C++ warning\\n")
    print("Loading weights: 100%|####| 50/50", file=sys.stderr, flush=True)
    logging.getLogger("some.library").warning("a warning worth seeing")
    logging.getLogger("some.library").info("an info line")
    logging.getLogger("DeepSpeed").warning("Setting accelerator to CPU.")
    path = os.environ.get("VLLM_LOGGING_CONFIG_PATH")
    if path:  # what vLLM does with it when it configures its logging
        logging.config.dictConfig(json.load(open(path)))
    vllm = logging.getLogger("vllm.v1.core.block_pool")
    vllm.info("Successfully reset prefix cache")
    vllm.warning("Enforce eager set, disabling torch.compile")
    vllm.warning("the KV cache is small")
    logging.getLogger("vllm.v1.engine.input_processor").warning(
        "vLLM has deprecated support for supporting different tokenizers for different LoRAs. By default, vLLM "
        "uses base model's tokenizer.")
    logging.getLogger("vllm.v1.engine.input_processor").warning(
        "Passing raw prompts to InputProcessor is deprecated and will be removed in the future. You should instead "
        "pass the outputs of Renderer.render_cmpl() or Renderer.render_chat().")
    sys.stdout.flush()
""")


def run_worker(tmp_path, level):
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("RAYGRPO_")}
    env |= {logs.LEVEL_ENV: level, logs.LOG_DIR_ENV: str(tmp_path / "logs")}
    out = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    files = list((tmp_path / "logs").glob("worker-*.log"))
    return out.stdout + out.stderr, files[0].read_text() if files else ""


def test_a_quiet_worker_shows_raygrpo_and_real_warnings_and_files_the_rest(tmp_path):
    console, logfile = run_worker(tmp_path, "WARNING")
    assert "raygrpo line from an actor" in console
    assert "a warning worth seeing" in console and "the KV cache is small" in console
    for hidden in ("a C++ warning", "Loading weights", "an info line", "Setting accelerator", "Successfully reset",
                   "Enforce eager", "different tokenizers for different LoRAs", "Passing raw prompts"):
        assert hidden not in console, hidden
    for kept in ("a C++ warning", "Loading weights", "Successfully reset prefix cache", "Enforce eager set",
                 "different tokenizers for different LoRAs", "Passing raw prompts to InputProcessor"):
        assert kept in logfile, kept
    assert json.loads((tmp_path / "logs" / "vllm_logging.json").read_text())["loggers"]["vllm"]["level"] == "INFO"


def test_info_level_leaves_a_worker_as_it_was(tmp_path):
    console, logfile = run_worker(tmp_path, "INFO")
    assert logfile == "" and not (tmp_path / "logs").exists()
    assert "a C++ warning" in console and "Loading weights" in console and "Setting accelerator" in console


def test_the_level_comes_from_the_flag_then_the_environment(monkeypatch):
    monkeypatch.delenv(logs.LEVEL_ENV, raising=False)
    assert logs.console_level() == "WARNING" and logs.console_level("info") == "INFO"
    monkeypatch.setenv(logs.LEVEL_ENV, "error")
    assert logs.console_level() == "ERROR" and logs.console_level("DEBUG") == "DEBUG"
    monkeypatch.setenv(logs.LEVEL_ENV, "loud")
    with pytest.raises(ValueError, match="RAYGRPO_LOG_LEVEL='LOUD': use one of DEBUG, INFO, WARNING, ERROR"):
        logs.console_level()


def test_workers_get_the_log_dir_only_when_quiet(monkeypatch, tmp_path):
    monkeypatch.setenv(logs.LEVEL_ENV, "WARNING")
    env = logs.worker_env(tmp_path / "run")
    assert env["worker_process_setup_hook"] == "cluster.run.logs.setup_worker"
    assert env["env_vars"] == {logs.LEVEL_ENV: "WARNING", logs.LOG_DIR_ENV: str((tmp_path / "run" / "logs").resolve())}
    monkeypatch.setenv(logs.LEVEL_ENV, "INFO")  # the hook still holds back garbage collections (test_start_up_gc.py)
    assert logs.worker_env(tmp_path / "run") == {"worker_process_setup_hook": "cluster.run.logs.setup_worker",
                                                 "env_vars": {logs.LEVEL_ENV: "INFO"}}


def test_the_drivers_ray_info_lines_go_to_the_run_log(monkeypatch, tmp_path, capsys):
    import ray  # noqa: F401 - installs Ray's console handler

    monkeypatch.setenv(logs.LEVEL_ENV, "WARNING")
    ray_logger = logging.getLogger("ray")
    before = list(ray_logger.handlers), ray_logger.level
    # Ray's handler keeps the stderr it was made with (another test's capture, maybe): point it at this one's.
    # Only Ray's own: where ray was imported before pytest's logging plugin set up (an e2e module imports
    # it at collection), pytest's capture handlers sit on the "ray" logger too.
    streams = [(h, h.stream) for h in before[0]
               if isinstance(h, logging.StreamHandler) and not type(h).__module__.startswith("_pytest")]
    for h, _ in streams:
        h.stream = sys.stderr  # not setStream: it flushes the old stream, which may be closed
    try:
        logs.start_run_log(tmp_path)
        ray_logger.setLevel(logging.INFO)  # what ray.init does
        ray_logger.info("Started a local Ray instance.")
        ray_logger.warning("Token authentication is enabled for this Ray cluster.")
        ray_logger.warning("cannot place the actors")
        for h in ray_logger.handlers:
            h.flush()
    finally:
        for h in ray_logger.handlers[len(before[0]):]:
            h.close()
        ray_logger.handlers[:] = before[0]
        ray_logger.setLevel(before[1])
        for h, stream in streams:
            h.stream = stream
    err = capsys.readouterr().err
    text = (tmp_path / "logs" / "driver.log").read_text()
    assert "Started a local Ray instance" in text and "Token authentication" in text and "cannot place" in text
    assert "cannot place the actors" in err and "Started a local" not in err and "Token authentication" not in err


def test_an_unknown_log_level_in_the_environment_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setenv(logs.LEVEL_ENV, "verbose")
    assert main(["plot", "/nonexistent"]) == 2
    assert "RAYGRPO_LOG_LEVEL='VERBOSE': use one of" in capsys.readouterr().err


def test_a_failed_actor_points_at_the_log_files(monkeypatch, tmp_path, capsys):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "worker-42.log").write_text("Traceback ... ValueError: max_model_len\n")
    monkeypatch.setenv(logs.LEVEL_ENV, "WARNING")
    logs.point_at_actor_logs(tmp_path)
    err = capsys.readouterr().err
    assert f"is in {tmp_path / 'logs'}/: worker-42.log" in err and "--log-level INFO" in err
    monkeypatch.setenv(logs.LEVEL_ENV, "INFO")  # everything was on the console already
    logs.point_at_actor_logs(tmp_path)
    assert capsys.readouterr().err == ""


def test_the_lora_tokenizer_warning_filtered_is_the_one_the_installed_vllm_logs():
    """The snippet is vLLM's own text (v1/engine/input_processor.py, logged on every LoRA request): a vLLM
    that rewords it would put the warning back on the console, and this says so."""
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed here")
    source = (Path(spec.origin).parent / "v1" / "engine" / "input_processor.py").read_text()
    text = "".join(re.findall(r'"([^"]*)"', source))  # its string literals, joined as Python joins adjacent ones
    snippet = next(s for s, _ in logs.EXPECTED_WARNINGS if "LoRAs" in s)
    assert snippet in text
    assert logs.expected("vLLM has deprecated support for supporting different tokenizers for different LoRAs.")


def test_the_raw_prompts_warning_filtered_is_the_one_the_installed_vllm_logs():
    """Issue 59, item 9: vLLM's "Passing raw prompts to InputProcessor is deprecated" reached the console in every
    pipeline run (the EngineLoop hands add_request a TokensPrompt). The snippet is vLLM's own text."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed here")
    source = (Path(spec.origin).parent / "v1" / "engine" / "input_processor.py").read_text()
    text = "".join(re.findall(r'"([^"]*)"', source))
    snippet = next(s for s, _ in logs.EXPECTED_WARNINGS if "raw prompts" in s)
    assert snippet in text and logs.expected(f"{snippet} and will be removed in the future.")
