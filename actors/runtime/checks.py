"""Config range checks: the one shape of check every config section's problems() uses."""
from __future__ import annotations


def at_least(p: list[str], key: str, value, lo, note: str = "") -> None:
    """Append "<key> must be >= <lo><note>, got <value>" to the problems `p` when value < lo."""
    if value < lo:
        p.append(f"{key} must be >= {lo}{note}, got {value}")
