"""Against Keras Tuner (issue 43): kbackend/bench/tuner.py (--help for options)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from kbackend.bench.runner import main

if __name__ == "__main__":
    raise SystemExit(main("bench_tuner"))
