"""Data memory benchmark: kbackend/bench/data_memory.py, docs/your-model.md (--help for options)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from kbackend.bench.runner import main

if __name__ == "__main__":
    raise SystemExit(main("bench_data_memory"))
