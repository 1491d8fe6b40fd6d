"""A readable console: raygrpo's own lines, third-party ones at WARNING or above, the rest in RUN_DIR/logs/.

The level (`--log-level`, else `RAYGRPO_LOG_LEVEL`, else WARNING) is the console threshold for
third-party loggers (vLLM, Ray, DeepSpeed, transformers). raygrpo's own lines are never hidden.
At WARNING or ERROR ("quiet"):

- every Ray worker process of the run (the actors) sends its own stdout/stderr, the C++ output of
  torch and vLLM, progress bars and Python warnings to `RUN_DIR/logs/worker-<pid>.log`
  (`placement.json` names the actor of each pid); what raygrpo's code prints in an actor still
  reaches the console, as do third-party log records at the threshold or above. This is Ray's
  `worker_process_setup_hook` (`setup_worker`), handed the log dir and level in the runtime env.
- vLLM logs everything (its per-step INFO lines such as "Successfully reset prefix cache"
  included) into that file, through a logging config it reads from `VLLM_LOGGING_CONFIG_PATH`
  (vLLM re-applies its config when an engine starts, so a handler added beside it would be lost);
- the driver's third-party INFO lines (Ray's "Started a local Ray instance") go to
  `RUN_DIR/logs/driver.log`, transformers' progress bars are off;
- a short list of warnings that raygrpo's own set-up causes on purpose (EXPECTED_WARNINGS, each
  with the reason) is kept out of the console; they are still in the log files.

At INFO or DEBUG nothing is redirected or filtered: the console is what it was before this module.
"""
from __future__ import annotations

import io
import json
import logging
import os
import sys
from pathlib import Path

from actors.runtime.atomic_file import replace_text
from actors.runtime.start_up import hold_until_started

LEVEL_ENV = "RAYGRPO_LOG_LEVEL"  # the user's switch (and how the level reaches child processes)
LOG_DIR_ENV = "RAYGRPO_LOG_DIR"  # set by raygrpo in the Ray workers' environment, not by users
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_LEVEL = "WARNING"
WORKER_HOOK = "cluster.run.logs.setup_worker"

# (text in the message, why raygrpo expects it): third-party warnings that raygrpo's own settings
# trigger on every run; kept out of the console at WARNING and ERROR, never out of the log files.
EXPECTED_WARNINGS = (
    ("The global random seed is set to", "vLLM in-process on CPU; raygrpo seeds each request"),
    ("does not officially support disabling chunked prefill", "off on CPU on purpose (docs/DESIGN.md)"),
    ("Enforce eager set", "CPU engines run eager"),
    ("Inductor compilation was disabled", "CPU engines run eager"),
    ("Triton is not installed", "no Triton for CPU torch"),
    ("Triton is installed, but doesn't include CPU backend", "no Triton for CPU torch"),
    ("Reset SSM cache type", "vLLM CPU platform default"),
    ("Model Runner V2 requires Triton", "no Triton for CPU torch"),
    ("is not found in LD_PRELOAD", "vLLM-CPU's tcmalloc/iomp speed hint (see docs/DESIGN.md)"),
    ("doesn't allow to use `torch.set_num_threads`", "raygrpo's thread budget sets threads around it"),
    ("Token authentication is enabled for this Ray cluster", "Ray 2.60's default; raygrpo finds the token"),
    ("Setting accelerator to CPU", "DeepSpeed on a CPU machine"),
    ("built successfully", "DeepSpeed loading its cached CPU op (a print, not a log record)"),
    ("deprecated support for supporting different tokenizers for different LoRAs",
     "vLLM 0.32 on every LoRA request; raygrpo's adapters use the base model's tokenizer, as vLLM does by default"),
    ("Passing raw prompts to InputProcessor is deprecated",
     "vLLM 0.32, once per pipeline-mode engine: its EngineLoop hands LLMEngine.add_request a TokensPrompt, which vLLM "
     "still renders itself (issue 59)"),
)


def console_level(flag: str | None = None) -> str:
    """The console level: the --log-level flag, else RAYGRPO_LOG_LEVEL, else WARNING."""
    level = (flag or os.environ.get(LEVEL_ENV) or DEFAULT_LEVEL).upper()
    if level not in LEVELS:
        source = "--log-level" if flag else LEVEL_ENV
        raise ValueError(f"{source}={level!r}: use one of {', '.join(LEVELS)}")
    return level


def is_quiet(level: str) -> bool:
    return level in ("WARNING", "ERROR")


def expected(text: str) -> bool:
    return any(snippet in text for snippet, _ in EXPECTED_WARNINGS)


class ExpectedWarnings(logging.Filter):
    """Drops the EXPECTED_WARNINGS records (on a console handler; files keep them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not expected(record.getMessage())


# --------------------------------------------------------------------------- the driver


def setup_driver(level: str) -> None:
    """Before anything heavy is imported: the level for child processes, progress bars off when quiet."""
    os.environ[LEVEL_ENV] = level
    if is_quiet(level):
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' and the hub's tqdm bars
        logging.getLogger("DeepSpeed").addFilter(ExpectedWarnings())  # records logged on it directly


DRIVER_LOGGERS = ("ray", "DeepSpeed", "")  # the driver's third-party loggers with console handlers ("" = root)


def quiet_driver_console() -> None:
    """Quiet: the driver's third-party console handlers at the threshold, the expected warnings out.
    Ray installs its "ray" logger's handler when it is imported, so this imports it first."""
    level = console_level()
    if not is_quiet(level):
        return
    import ray  # noqa: F401

    for name in DRIVER_LOGGERS:
        for h in logging.getLogger(name).handlers:
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):  # a console
                h.setLevel(max(h.level, getattr(logging, level)))
                if not any(isinstance(f, ExpectedWarnings) for f in h.filters):
                    h.addFilter(ExpectedWarnings())


def start_run_log(run_dir: str | Path) -> None:
    """Quiet: the console as quiet_driver_console, and the driver's third-party lines down to INFO
    (Ray's "Started a local Ray instance") into RUN_DIR/logs/driver.log. Call before ray.init."""
    if not is_quiet(console_level()):
        return
    quiet_driver_console()
    log_dir = Path(run_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(log_dir / "driver.log")
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [%(name)s] %(message)s"))
    to_file.raygrpo_run_log = True
    for name in DRIVER_LOGGERS:  # one run log per process: a later run in it (tests) replaces the earlier one's
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if getattr(h, "raygrpo_run_log", False)]:
            logger.removeHandler(old)
            old.close()
        logger.addHandler(to_file)


def worker_env(run_dir: str | Path) -> dict:
    """What start_ray adds to the runtime env of every Ray worker: the hook and the level, and the log dir
    when quiet (at INFO and DEBUG the hook only holds back garbage collections while the actor starts)."""
    level = console_level()
    log_dir = {LOG_DIR_ENV: str((Path(run_dir) / "logs").resolve())} if is_quiet(level) else {}
    return {"worker_process_setup_hook": WORKER_HOOK, "env_vars": {LEVEL_ENV: level, **log_dir}}


def point_at_actor_logs(run_dir: str | Path) -> None:
    """After an actor failed in a quiet run: say where its own output (vLLM's or DeepSpeed's traceback) is."""
    files = sorted((Path(run_dir) / "logs").glob("worker-*.log"))
    if files and is_quiet(console_level()):
        names = " (placement.json names the actor of each pid)" if (Path(run_dir) / "placement.json").is_file() else ""
        print(f"the actors' own output (vLLM, DeepSpeed, Ray; their tracebacks) is in {files[0].parent}/: "
              f"{', '.join(f.name for f in files)}{names}; --log-level INFO shows it on the console",
              file=sys.stderr, flush=True)


def tidy(run_dir: str | Path) -> None:
    """Remove the empty log files of Ray workers that never ran an actor (Ray starts spare ones)."""
    for f in (Path(run_dir) / "logs").glob("worker-*.log"):
        try:
            if f.stat().st_size == 0:
                f.unlink()
        except OSError:
            pass


# --------------------------------------------------------------------------- inside a Ray worker

_console: io.TextIOBase | None = None  # the stream Ray shows on the driver's console (setup_worker saves it)


class ConsoleLines(io.TextIOBase):
    """A line-buffered text stream on a file descriptor that drops expected third-party prints."""

    def __init__(self, fd: int):
        self._out = os.fdopen(fd, "w", buffering=1, encoding="utf-8", errors="replace")
        self._partial = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._partial += text
        *lines, self._partial = self._partial.split("\n")
        for line in lines:
            if not expected(line):
                self._out.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self._out.flush()

    def fileno(self) -> int:
        return self._out.fileno()


def console_handler(level: str = DEFAULT_LEVEL) -> logging.Handler:
    """A handler onto the console (named by vLLM's logging config, hence a factory); outside a
    worker set up by `setup_worker` (a vLLM engine subprocess), onto stderr."""
    handler = logging.StreamHandler(_console or sys.stderr)
    handler.setLevel(level)
    handler.addFilter(ExpectedWarnings())
    handler.setFormatter(logging.Formatter("%(levelname)s [%(name)s] %(message)s"))
    return handler


def vllm_logging_config(level: str) -> dict:
    """vLLM's logging, read from VLLM_LOGGING_CONFIG_PATH: every record into the worker's log file
    (its stderr), those at `level` or above also onto the console."""
    return {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"file": {"format": "%(asctime)s %(levelname)s [%(name)s:%(lineno)d] %(message)s"}},
        "handlers": {"file": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "file"},
                     "console": {"()": "cluster.run.logs.console_handler", "level": level}},
        "loggers": {"vllm": {"handlers": ["file", "console"], "level": "DEBUG" if level == "DEBUG" else "INFO",
                             "propagate": False}},
    }


def setup_worker() -> None:
    """Ray's worker_process_setup_hook (see the module docstring). Runs before the actor's class is
    built, so before vLLM, torch or DeepSpeed are imported: it holds back full garbage collections until
    the actor has started (at every level), and when quiet sends the output to the log dir. Without a
    writable log dir (a node that does not see the run dir) only the levels and filters apply."""
    global _console
    hold_until_started()  # before the actor's module imports torch (actors/runtime/start_up.py)
    level = console_level()
    if not is_quiet(level):
        return
    log_dir, log_fd = os.environ.get(LOG_DIR_ENV, ""), None
    if log_dir:
        try:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            log_fd = os.open(Path(log_dir) / f"worker-{os.getpid()}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError:
            log_fd = None
    sys.stdout.flush()
    sys.stderr.flush()
    if log_fd is not None:
        # fds 1 and 2 (what Ray streams to the driver) now go to the file; the console keeps a copy of 1
        console_out = os.dup(1)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        # raygrpo's print() in actors still reaches the console, and so do third-party records at the
        # threshold: both through the stdout copy, where Ray also writes the actor's name for its line prefix
        sys.stdout = _console = ConsoleLines(console_out)
        config = Path(log_dir) / "vllm_logging.json"
        replace_text(config, json.dumps(vllm_logging_config(level)))
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(config)
    else:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", level)
    root = logging.getLogger()
    root.addHandler(console_handler(level))  # third-party records that propagate: at the threshold
    logging.getLogger("DeepSpeed").addFilter(ExpectedWarnings())
