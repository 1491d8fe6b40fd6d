"""Where the project lives, and paths made absolute: what the CLI, the demo, the bench, the config and
the run dir all need (and nothing else of the project, so any module can import it without an import circle)."""
import os
from pathlib import Path

from actors.runtime.user_code import is_file_spec

PROJECT_ROOT = Path(__file__).resolve().parent.parent
# SmolLM2-135M-Instruct as the tests' fixture builds it (tests/conftest.py), and `raygrpo bench --model` alone
SMOLLM2_FIXTURE = PROJECT_ROOT / ".cache" / "tests" / "smollm2-135m-instruct"


def absolute_paths(data: dict) -> dict:
    """The config's file paths made absolute (against the current directory), as they are before they cross
    into another process: an actor, a bench subprocess, a later resume from elsewhere. Works on the raw
    mapping (a saved config.yaml too); what is not a path (task:..., auto, a built-in name) stays."""
    def path(v):
        return os.path.abspath(v) if isinstance(v, str) and v else v

    def spec(v):  # path/to/file.py:name
        return f"{path(v.rpartition(':')[0])}:{v.rpartition(':')[2]}" if is_file_spec(v) else v

    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    sections = {name: out.get(name) if isinstance(out.get(name), dict) else {} for name in
                ("model", "data", "trainer", "checkpoint", "rollout", "reward")}
    m, d, t, c, r, w = sections.values()
    for key, section in (("path", m), ("run_dir", t)):
        if key in section:
            section[key] = path(section[key])
    for key in ("train", "eval"):
        v = d.get(key)
        if isinstance(v, str) and v and not v.startswith("task:"):
            d[key] = ",".join(path(x.strip()) for x in v.split(","))
    if isinstance(c.get("resume"), str) and c["resume"] not in ("auto", "none"):
        c["resume"] = path(c["resume"])
    if isinstance(r.get("env"), str):
        r["env"] = spec(r["env"])
    if isinstance(w.get("functions"), list):
        w["functions"] = [spec(f) if isinstance(f, str) else f for f in w["functions"]]
    return out
