"""Subprocess entry points: `python -m cluster.bench direct-vllm SPEC | trl SPEC OUT`."""
import sys

from cluster.bench.command import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
