"""Where the project lives: the one constant the CLI, the demo and the bench all need (and nothing else,
so any module can import it without an import circle)."""
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
