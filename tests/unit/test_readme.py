"""README.md kept true (issue 37): the paths it names exist in this repository, every TRL/verl name
of its mapping tables is answered by the config check (`raygrpo train`) with the raygrpo key the
table gives, and every `ray status` it shows works on a token cluster."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from cluster.config import RunConfig, _dotted_keys

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
TOP = ("actors/", "learner/", "cluster/", "tests/", "docker/", "docs/", "examples/", "../", "./")


def named_paths(text: str) -> list[str]:
    """Repository paths the text names: markdown links, and the words of `code` spans and commands that
    start at a top-level folder (`docs/DESIGN.md`; not run-dir files such as `RUN_DIR/logs/...`)."""
    links = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t and not t.startswith("#")]
    blocks = re.findall(r"^```.*?^```", text, flags=re.S | re.M)  # commands
    inline = re.findall(r"`([^`]+)`", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))
    words = [w for span in blocks + inline for w in span.split()]
    spans = [re.split(r"[:,;)]", w)[0] for w in words if w.startswith(TOP)]
    return sorted(set(links + spans))


def test_every_path_the_readme_names_is_in_this_repository():
    paths = named_paths(README.read_text())
    assert "docs/DESIGN.md" in paths and "docker/slurm.sbatch" in paths  # the scan finds what it checks
    root = ROOT.resolve()
    outside = [p for p in paths if not (ROOT / p).resolve().is_relative_to(root)]
    missing = [p for p in paths if not any(ROOT.glob(p))]  # `examples/data/wordproblems_*.jsonl`: a pattern
    assert not outside, f"README.md names paths outside the repository (a clone lacks them): {outside}"
    assert not missing, f"README.md names paths that do not exist: {missing}"


def mapping_rows() -> list[tuple[list[str], list[str]]]:
    """(names a TRL/verl user writes, the raygrpo keys) of each row of README's "you write" tables."""
    rows, in_table = [], False
    for line in README.read_text().splitlines():
        if line.startswith("| you write ("):
            in_table = True
        elif in_table and line.startswith("| ---"):
            continue
        elif in_table and line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows.append((re.findall(r"`([^`]+)`", cells[0]), re.findall(r"`([a-z_]+\.[a-z_]+)`", cells[1])))
        else:
            in_table = False
    return rows


def test_each_trl_and_verl_name_in_the_readme_is_answered_with_the_key_the_table_gives(tmp_path):
    rows = mapping_rows()
    names = [n for row_names, _ in rows for n in row_names]
    assert len(rows) >= 15 and "actor_rollout_ref.rollout.n" in names and "num_generations" in names
    known = set(_dotted_keys(RunConfig))
    # One `raygrpo train` with every name set: the config check lists every problem at once, before Ray starts.
    out = subprocess.run([str(Path(sys.executable).parent / "raygrpo"), "train", "examples/cpu_demo.yaml",
                          *(f"{n}=1" for n in names)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    answers = {m[1]: m[2] for m in re.finditer(r"- unknown key (\S+): (.*)", out.stderr + out.stdout)}
    for row_names, keys in rows:
        assert keys and set(keys) <= known, f"README maps {row_names} to {keys}, not all of them raygrpo keys"
        for name in row_names:
            assert name in answers, f"{name}: the config check does not name it ({out.stderr[-2000:]})"
            said = answers[name].partition("raygrpo calls it ")[2].split(" (")[0]
            ours = re.findall(r"[a-z_]+\.[a-z_]+", said)
            assert ours and set(ours) <= set(keys), f"{name}: the check says {answers[name]!r}; README says {keys}"


def test_every_ray_status_the_docs_show_runs_in_token_mode():
    """`ray status` against a token cluster fails without RAY_AUTH_MODE=token (Ray 2.60), even with the token."""
    compose_env = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())["x-node"]["environment"]
    lines = [line for doc in (README, ROOT / "docker" / "README.md") for line in doc.read_text().splitlines()
             if "ray status" in line]
    assert lines
    for line in lines:
        if "docker compose" in line and "exec" in line:  # inside a container, whose environment has it
            assert compose_env["RAY_AUTH_MODE"] == "token"
        else:
            assert "RAY_AUTH_MODE=token" in line, line
