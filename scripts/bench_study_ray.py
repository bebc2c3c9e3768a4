"""Study on Ray benchmark: kbackend/bench/study_ray.py, docs/cluster.md (--help for options)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from kbackend.bench.runner import run
from kbackend.bench.study_ray import BENCHMARKS

if __name__ == "__main__":
    raise SystemExit(run(BENCHMARKS[0]))
