"""Reading dataset files into rows: JSONL / JSON / parquet files and `save_to_disk` directories.

What users of TRL, verl and OpenRLHF bring. Parquet files and `Dataset.save_to_disk`
directories are read with HF `datasets`. JSON and JSONL files are read here, line by line,
because `datasets`' JSON loader reports a bad line (or bytes that are not UTF-8) without the
line number, and converts every row to one Arrow schema (a string `answer` in one row and a
number in the next is an error there); read here, every problem names file and line and each
row keeps its own Python types.

A row is `(where, dict)`: `where` names the file and line (or row) for error messages.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

SUFFIXES = (".jsonl", ".json", ".parquet")
MAX_PROBLEMS_SHOWN = 10


class DataError(ValueError):
    pass


def raise_problems(problems: list[str], what: str) -> None:
    if problems:
        shown = problems[:MAX_PROBLEMS_SHOWN]
        if len(problems) > MAX_PROBLEMS_SHOWN:
            shown.append(f"... and {len(problems) - MAX_PROBLEMS_SHOWN} more")
        raise DataError(f"{what} (fix or remove them):\n  " + "\n  ".join(shown))


def split_paths(spec: str) -> list[str]:
    """`a.jsonl, b.parquet` -> ['a.jsonl', 'b.parquet'] (a comma-separated list is concatenated)."""
    return [p.strip() for p in spec.split(",") if p.strip()]


def path_problem(path: str, key: str) -> str | None:
    """Why `path` cannot be a dataset (for config validation), or None."""
    p = Path(path)
    if p.is_dir():
        return None
    if not p.is_file():
        return f"{key} {path!r} does not exist"
    if p.suffix not in SUFFIXES:
        return f"{key} {path!r}: unsupported file type {p.suffix!r} (use {', '.join(SUFFIXES)} or a save_to_disk directory)"
    return None


def read_rows(spec: str, split: str, problems: list[str]) -> list[tuple[str, dict]]:
    """Every row of every file in the comma-separated `spec`, in order. `split` picks the split of a
    `DatasetDict` directory ("train" for data.train, "test" or "validation" for data.eval). Lines that
    are not JSON objects (or not UTF-8) are appended to `problems`, so that the caller reports them
    together with the rows it finds wrong."""
    rows = []
    for path in split_paths(spec):
        p = Path(path)
        if p.is_dir():
            rows += _read_saved(p, split)
        elif p.suffix == ".parquet":
            rows += _read_parquet(p)
        elif p.suffix in (".jsonl", ".json"):
            rows += _read_json(p, problems)
        else:
            raise DataError(path_problem(path, "dataset") or f"cannot read {path}")
    return rows


def _decoded_lines(path: Path, problems: list[str]) -> list[tuple[int, str]]:
    """(line number, text) of every line; bytes that are not UTF-8 are a problem naming the line."""
    out = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                out.append((lineno, raw.decode("utf-8")))
            except UnicodeDecodeError as e:
                problems.append(f"{path}:{lineno}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                "save the file as UTF-8")
    return out


def _read_json(path: Path, problems: list[str]) -> list[tuple[str, dict]]:
    """JSON Lines (one object per line), or for a .json file also one JSON array of objects."""
    lines = _decoded_lines(path, problems)
    text = "".join(line for _, line in lines)
    rows = []
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            problems.append(f"{path}:{e.lineno}: not valid JSON ({e.msg})")
            return []
        for i, item in enumerate(items):
            if isinstance(item, dict):
                rows.append((f"{path} item {i}", item))
            else:
                problems.append(f"{path} item {i}: expected an object, got {json.dumps(item)[:80]}")
        return rows
    for lineno, line in lines:
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            problems.append(f"{path}:{lineno}: not valid JSON ({e.msg})")
            continue
        if not isinstance(obj, dict):
            problems.append(f"{path}:{lineno}: expected a JSON object, got {line.strip()[:80]!r}")
            continue
        rows.append((f"{path}:{lineno}", obj))
    return rows


def _dataset_rows(ds, where: str) -> list[tuple[str, dict]]:
    return [(f"{where} row {i}", _drop_arrow_nulls(row)) for i, row in enumerate(ds.to_list())]


def _drop_arrow_nulls(row: dict) -> dict:
    """Arrow gives every message struct every key seen in any message (absent ones as None); a chat
    template that tests `message.name is defined` must not see a `name: None` nobody wrote."""
    for key, value in row.items():
        if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
            row[key] = [{k: v for k, v in m.items() if v is not None or k in ("role", "content")} for m in value]
    return row


def _read_parquet(path: Path) -> list[tuple[str, dict]]:
    import datasets

    datasets.disable_progress_bars()
    # A throw-away cache: the rows are kept in memory, nothing accumulates in ~/.cache.
    with tempfile.TemporaryDirectory(prefix="raygrpo-parquet-") as cache:
        try:
            ds = datasets.Dataset.from_parquet(str(path), cache_dir=cache, keep_in_memory=True)
        except Exception as e:  # noqa: BLE001 - pyarrow raises many kinds; the user needs file + reason
            raise DataError(f"{path}: cannot read it as parquet ({type(e).__name__}: {e})") from None
        return _dataset_rows(ds, str(path))


def _read_saved(path: Path, split: str) -> list[tuple[str, dict]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path), keep_in_memory=True)
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{path}: not a directory written by Dataset.save_to_disk ({type(e).__name__}: {e})") from None
    if isinstance(ds, datasets.DatasetDict):
        names = [split] if split == "train" else ["test", "validation"]
        chosen = next((n for n in names if n in ds), None)
        if chosen is None and len(ds) == 1:
            chosen = next(iter(ds))
        if chosen is None:
            raise DataError(f"{path} holds splits {', '.join(ds)}; expected {' or '.join(names)} "
                            "(save the split you want with Dataset.save_to_disk)")
        return _dataset_rows(ds[chosen], f"{path}[{chosen}]")
    return _dataset_rows(ds, str(path))
