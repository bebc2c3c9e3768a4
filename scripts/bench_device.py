"""device benchmark: see kbackend/hardware/benchmarks.py and docs/hardware.md.

    python scripts/bench_device.py [--quick] [--out DIR] [--backends jax,tensorflow]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from kbackend.hardware.bench import main
from kbackend.hardware.benchmarks import BENCHMARKS

if __name__ == "__main__":
    raise SystemExit(main(BENCHMARKS["bench_device"], __file__))
