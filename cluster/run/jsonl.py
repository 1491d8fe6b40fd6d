"""Reading a run dir's JSONL files (metrics.jsonl, completions.jsonl, a checkpoint's copy of the
metrics) with the lines that are not whole rows counted and named, never dropped silently.

A line is torn when a run stopped while writing it (a kill, a power loss, a full disk): it is not a
whole JSON object, or it is the file's last line and has no newline. Every reader (`raygrpo show`,
`raygrpo plot`, a resume) says how many it skipped and which (line numbers, from 1).
"""
from __future__ import annotations

import json
from pathlib import Path

SHOWN_LINE_NUMBERS = 10  # a note names at most this many line numbers, then "..."


def read_jsonl(path: str | Path) -> tuple[list[dict], list[int]]:
    """(the whole rows of `path`, the numbers of the lines skipped as torn); ([], []) when there is no file.
    Blank lines are neither rows nor torn."""
    path = Path(path)
    if not path.is_file():
        return [], []
    rows, torn = [], []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(keepends=True), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict) and line.endswith("\n"):
            rows.append(row)
        else:
            torn.append(n)
    return rows, torn


def line_numbers(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:SHOWN_LINE_NUMBERS]))
    return shown + (f", ... ({len(numbers) - SHOWN_LINE_NUMBERS} more)" if len(numbers) > SHOWN_LINE_NUMBERS else "")


def torn_note(path: str | Path, torn: list[int], what: str = "skipped") -> str:
    """'warning: PATH: skipped 2 torn line(s) (not whole JSON rows: a run stopped while writing them?): line(s) 3, 9'"""
    return (f"warning: {path}: {what} {len(torn)} torn line(s) (not whole JSON rows: a run stopped while writing "
            f"them?): line(s) {line_numbers(torn)}")
