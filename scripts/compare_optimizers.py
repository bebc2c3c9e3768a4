#!/usr/bin/env python
"""Batch-size x optimizer study on one or more backends, side by side (a thin wrapper).

Runs ``kbackend study`` once per backend, each in its own child process (Keras picks its backend
at import), into one results folder, then ``kbackend study compare`` over it. Every other flag
goes to ``kbackend study`` unchanged. The children's output arrives on stderr.

    python scripts/compare_optimizers.py                          # default study, JAX
    python scripts/compare_optimizers.py --backends jax,tensorflow
    python scripts/compare_optimizers.py --backends jax,tensorflow --dataset mnist \\
        --batch-sizes 32,128,512 --max-steps 3000
    python scripts/compare_optimizers.py --quick --out /tmp/study   # a small grid, for smoke tests
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from kbackend.errors import KBackendError
from kbackend.runtime.child import run_in_child

QUICK = ["--optimizers", "sgd,adam", "--batch-sizes", "32,128", "--lr-grid-size", "1",
         "--max-steps", "200", "--noise-points", "2", "--noise-draws", "8", "--seeds", "2",
         "--step-time-repeats", "2"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default=os.environ.get("KERAS_BACKEND", "jax"),
                        help="comma-separated backends, each run in its own process")
    parser.add_argument("--out", default="runs/compare_optimizers", help="results folder")
    parser.add_argument("--quick", action="store_true",
                        help="a small grid (2 optimizers x 2 batch sizes)")
    args, study_args = parser.parse_known_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    grid = QUICK if args.quick else []
    runs = [(b, ["study", "--out", args.out, *grid, *study_args]) for b in backends]
    runs.append((backends[0], ["study", "compare", "--out", args.out]))
    try:
        for backend, command in runs:
            print(f"== {backend}: kbackend {' '.join(command)}", file=sys.stderr, flush=True)
            status = run_in_child("kbackend.cli:main", backend, {"argv": command}, echo=True)
            if status:
                return status
    except KBackendError as error:
        print(f"compare_optimizers: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
