"""The code kind of `reward.functions` entry: `code_tests`. A completion's program (its last fenced Python
block, else the whole completion) runs against its row's tests in an OS-level sandbox
(actors/runtime/sandbox/, the level `reward.code_sandbox` names), one forked child per test.

Dataset shapes (`reward.code_format`; `auto` tells them apart per row by the columns it has):

    humaneval   a `test` column (reward.code_tests_key) of code that defines `check(candidate)`, and an
                `entry_point` column (reward.code_entry_point_key) naming the function. Every `assert` of
                check's body is a test of its own (check with the other asserts taken out), so a partly
                right program scores in between. A program that does not define the entry point gets the
                prompt in front of it (a completion that continues the prompt's signature).
    mbpp        a `test_list` column (reward.code_tests_key) of assert lines, each a test, with the
                optional `test_setup_code` column run before each.

The score (`reward.code_score`): `fraction` of the tests passed, or `all` (1.0 only if every test
passed). Per test an outcome, passed | failed | error | timeout | memory | output_limit, with its test
and detail: in completions.jsonl (`tests`), `raygrpo show` and `raygrpo score`. A program that fails,
hangs or is killed scores 0 for those tests; a row without its tests column is an error (counted, never a 0) naming it.

The level is probed when the scorer starts: where it cannot be had the run refuses to start, naming
why and `reward.code_sandbox=process` as the weaker level that runs anyway. Never a silent downgrade.
"""
from __future__ import annotations

import ast
import functools
import re
from concurrent.futures import ThreadPoolExecutor

from actors.config import RewardConfig
from actors.rewards.base import Batch, KindRunner, RewardKind, Tally
from actors.runtime.sandbox import LEVELS, Limits, probe, run_program

NAME = "code_tests"
SETUP_KEY = "test_setup_code"  # MBPP's column of code run before each test
DEFAULT_TESTS_KEY = {"humaneval": "test", "mbpp": "test_list"}
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def program_of(completion: str) -> str:
    """The last fenced Python block of a completion, else the whole completion."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def _check(module: ast.Module) -> ast.FunctionDef | None:
    return next((n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)


@functools.lru_cache(maxsize=256)  # the G completions of a prompt share its tests: split them once
def _check_asserts(test: str, entry_point: str) -> tuple[tuple[str, str], ...]:
    """HumanEval: one (name, source) per assert of check()'s body, each a check() with the other asserts
    taken out; the whole check() as one test when it has fewer than two asserts or does not parse."""
    try:
        check = _check(ast.parse(test))
    except SyntaxError:
        check = None
    count = sum(isinstance(s, ast.Assert) for s in check.body) if check else 0
    if count < 2:
        return ((f"check({entry_point})", f"{test}\ncheck({entry_point})"),)
    out = []
    for k in range(count):
        module = ast.parse(test)
        check = _check(module)
        kept = [s for s in check.body if isinstance(s, ast.Assert)][k]
        check.body = [s for s in check.body if not isinstance(s, ast.Assert) or s is kept]
        out.append((ast.unparse(kept), f"{ast.unparse(module)}\ncheck({entry_point})"))
    return tuple(out)


def row_format(fields: dict, cfg: RewardConfig) -> str:
    """humaneval | mbpp for one row (reward.code_format, or read from its columns)."""
    if cfg.code_format != "auto":
        return cfg.code_format
    if cfg.code_tests_key:
        return "mbpp" if isinstance(fields.get(cfg.code_tests_key), list) else "humaneval"
    return "mbpp" if "test_list" in fields else "humaneval"


def tests_of(prompt, completion: str, fields: dict, cfg: RewardConfig) -> tuple[str, list[tuple[str, str]]]:
    """(the program, [(test name, test source)]) for one sample; a ValueError names a missing column."""
    shape = row_format(fields, cfg)
    key = cfg.code_tests_key or DEFAULT_TESTS_KEY[shape]
    tests = fields.get(key)
    if not tests:
        have = ", ".join(k for k in fields if not k.startswith("_")) or "no columns"
        raise ValueError(f"code_tests ({shape}) needs the tests column {key!r} (reward.code_tests_key) in the row; "
                       f"it has: {have}")
    program = program_of(completion)
    if shape == "mbpp":
        setup = fields.get(SETUP_KEY) or ""
        return program, [(str(t), f"{setup}\n{t}") for t in (tests if isinstance(tests, list) else [tests])]
    entry = fields.get(cfg.code_entry_point_key)
    if not entry:
        raise ValueError(f"code_tests (humaneval) needs the entry point column {cfg.code_entry_point_key!r} "
                       "(reward.code_entry_point_key) in the row")
    if not re.search(rf"def\s+{re.escape(entry)}\s*\(", program) and isinstance(prompt, str) and entry in prompt:
        program = prompt + program  # the completion continues the prompt's signature
    return program, list(_check_asserts(str(tests), entry))


def score_of(outcomes: list[dict], how: str) -> float:
    """reward.code_score: fraction = passed / tests; all = 1.0 only if every test passed."""
    passed = sum(o["outcome"] == "passed" for o in outcomes)
    return passed / len(outcomes) if how == "fraction" else float(passed == len(outcomes))


def refusal(level: str, reason: str) -> str:
    weaker = LEVELS[level].weaker
    text = f"reward.code_sandbox={level} cannot be had on this machine: {reason}."
    if weaker:
        text += (f" Run where it can (the raygrpo image; user namespaces allowed: sysctl user.max_user_namespaces > 0, "
                 f"kernel.unprivileged_userns_clone=1), or accept the weaker isolation with "
                 f"reward.code_sandbox={weaker} (no namespaces: programs see this host's files and network with "
                 f"your rights)")
    return text


class CodeKind(RewardKind):
    name = "code"
    form = f"{NAME!r} (code run against the row's tests)"
    judges = True  # 1.0: every test passed (held-out evaluation's pass rate)

    def recognises(self, spec: str) -> bool:
        return spec == NAME

    def timeout_setting(self, spec: str, cfg: RewardConfig) -> str | None:
        return f"reward.code_timeout_s={cfg.code_timeout_s:g}"

    def start(self, specs: list[str], cfg: RewardConfig) -> CodeTests:
        return CodeTests(specs, cfg)


class CodeTests(KindRunner):
    """Programs run `reward.code_workers` at a time, on threads (each waits on its sandbox's process)."""

    def __init__(self, specs: list[str], cfg: RewardConfig):
        self.cfg, self.names = cfg, {}
        self.level = LEVELS[cfg.code_sandbox]
        if specs:
            reason = probe(cfg.code_sandbox)
            if reason is not None:
                raise ValueError(refusal(cfg.code_sandbox, reason))
        self.limits = Limits(cfg.code_timeout_s, cfg.code_memory_mb, cfg.code_max_output_kb * 1024)
        self.threads = ThreadPoolExecutor(cfg.code_workers, thread_name_prefix="raygrpo-code")

    def run(self, prompt, completion: str, fields: dict) -> tuple[float, list[dict]]:
        """(score, per test {"test", "outcome", "detail"}) of one sample."""
        program, tests = tests_of(prompt, completion, fields, self.cfg)
        outcomes = run_program(self.level, program, [src for _, src in tests], self.limits)
        rows = [{"test": name, **o} for (name, _), o in zip(tests, outcomes)]
        return score_of(rows, self.cfg.code_score), rows

    def send(self, specs: list[str], batch: Batch, tally: Tally, progress):
        futures = {}
        for spec in specs:
            progress.add(spec, len(batch))
            for i in range(len(batch)):
                fut = self.threads.submit(self.run, batch.prompts[i], batch.texts[i], batch.fields[i])
                fut.add_done_callback(lambda f, spec=spec: progress.finish(spec))
                futures[spec, i] = fut

        def wait() -> None:
            for (spec, i), fut in futures.items():
                tally.stats[spec].calls += 1
                try:
                    value, tests = fut.result()
                except Exception as e:  # noqa: BLE001 - a row it cannot score is an error, counted
                    tally.record(spec, i, False, f"{type(e).__name__}: {e}")
                    continue
                tally.record(spec, i, True, value)
                tally.tests[i] = tests
                tally.stats[spec].timeouts += any(t["outcome"] == "timeout" for t in tests)

        return wait

    def close(self) -> None:
        self.threads.shutdown(wait=True, cancel_futures=True)
