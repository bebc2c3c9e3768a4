#!/usr/bin/env python
"""Batch-size x optimizer study on one or more backends, side by side (a thin wrapper).

Runs ``kbackend study`` once per backend, each in its own process (Keras picks its backend at
import), into one results folder, then ``kbackend study compare`` over it. Every other flag
goes to ``kbackend study`` unchanged.

    python scripts/compare_optimizers.py                          # default study, JAX
    python scripts/compare_optimizers.py --backends jax,tensorflow
    python scripts/compare_optimizers.py --backends jax,tensorflow --dataset mnist \\
        --batch-sizes 32,128,512 --max-steps 3000
    python scripts/compare_optimizers.py --quick --out /tmp/study   # a small grid, for smoke tests
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUICK = ["--optimizers", "sgd,adam", "--batch-sizes", "32,128", "--lr-grid-size", "1",
         "--max-steps", "200", "--noise-points", "2", "--noise-draws", "8"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default=os.environ.get("KERAS_BACKEND", "jax"),
                        help="comma-separated backends, each run in its own process")
    parser.add_argument("--out", default="runs/compare_optimizers", help="results folder")
    parser.add_argument("--quick", action="store_true", help="a small grid (2 optimizers x 2 batch sizes)")
    args, study_args = parser.parse_known_args(argv)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for backend in (b.strip() for b in args.backends.split(",") if b.strip()):
        command = [sys.executable, "-m", "kbackend", "study", "--out", args.out,
                   *(QUICK if args.quick else []), *study_args]
        print(f"== {backend}: {' '.join(command[2:])}", flush=True)
        status = subprocess.call(command, env={**env, "KERAS_BACKEND": backend})
        if status:
            return status
    return subprocess.call([sys.executable, "-m", "kbackend", "study", "compare", "--out", args.out], env=env)


if __name__ == "__main__":
    raise SystemExit(main())
