"""The benchmark runner behind ``scripts/bench_*.py``: one subprocess per backend, side by side.

    python scripts/bench_throughput.py [--quick] [--out DIR] [--backends jax,tensorflow]

The parent process starts ``<script> --worker`` once per backend (``KERAS_BACKEND`` set, so each
backend runs in its own process), collects each worker's rows and environment, and writes
``DIR/<name>.json`` (figures + environments) and ``DIR/<name>.md`` (a side-by-side table).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kbackend.backend import BACKENDS
from kbackend.reports import markdown_table, side_by_side, write_report

DEFAULT_OUT = "bench_results"


@dataclass(frozen=True)
class Benchmark:
    """A benchmark: what one worker measures and how its rows become a table.

    ``measure(quick)`` runs in the worker process and returns ``(rows, summary)``. ``keys`` name
    the columns identifying a case; ``values`` the measured columns shown per backend.
    """

    name: str
    description: str
    measure: Callable[[bool], tuple[list[dict[str, Any]], dict[str, Any]]]
    keys: Sequence[str]
    values: Sequence[str]
    summary_fields: Sequence[str] = field(default_factory=tuple)


def _parser(bench: Benchmark) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=bench.description)
    parser.add_argument("--quick", action="store_true", help="a small, fast version (CI, nox -s bench)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT}/)")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help="comma-separated backends, each run in its own process")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return parser


def _worker(bench: Benchmark, quick: bool, result: str) -> int:
    from kbackend.backend import use_backend
    from kbackend.envinfo import environment
    from kbackend.hardware.probe import warm_up
    from kbackend.io import atomic_write_json

    backend = use_backend()
    start = time.perf_counter()
    warm_up_s = warm_up()  # one-time process costs stay out of the first case's compile time
    rows, summary = bench.measure(quick)
    for row in rows:
        row["backend"] = backend
    atomic_write_json(result, {"backend": backend, "rows": rows, "summary": summary,
                               "environment": environment(), "wall_s": time.perf_counter() - start,
                               "warm_up_s": warm_up_s})
    return 0


def _run_backend(script: str, backend: str, quick: bool, folder: str) -> dict[str, Any]:
    result = os.path.join(folder, f"{backend}.json")
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2"}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    command = [sys.executable, script, "--worker", "--result", result] + (["--quick"] if quick else [])
    completed = subprocess.run(command, env=env, capture_output=True, text=True)
    if completed.returncode != 0 or not os.path.exists(result):
        tail = (completed.stderr or completed.stdout).strip().splitlines()[-5:]
        return {"backend": backend, "rows": [], "summary": {}, "error": " | ".join(tail)}
    with open(result, encoding="utf-8") as handle:
        return json.load(handle)


def main(bench: Benchmark, script: str, argv: Sequence[str] | None = None) -> int:
    """Run ``bench`` (worker mode, or the parent that runs one worker per backend)."""
    args = _parser(bench).parse_args(argv)
    if args.worker:
        return _worker(bench, args.quick, args.result)
    backends = [b for b in args.backends.split(",") if b]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        print(f"{bench.name}: error: unknown backends {unknown}; expected some of {list(BACKENDS)}",
              file=sys.stderr)
        return 2
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for backend in backends:
            print(f"{bench.name}: running {backend} ({'quick' if args.quick else 'full'}) ...",
                  file=sys.stderr, flush=True)
            results[backend] = _run_backend(script, backend, args.quick, folder)
            wall = results[backend].get("wall_s")
            print(f"{bench.name}: {backend} " + (f"done in {wall:.1f}s" if wall is not None
                                                 else f"FAILED: {results[backend]['error']}"),
                  file=sys.stderr, flush=True)
    rows = [row for result in results.values() for row in result["rows"]]
    table_rows, columns = side_by_side(rows, bench.keys, bench.values, backends)
    table = markdown_table(table_rows, columns)
    summaries = [{"backend": b, **results[b].get("summary", {})} for b in backends]
    if bench.summary_fields:
        table += "\n" + markdown_table(summaries, ["backend", *bench.summary_fields])
    payload = {
        "benchmark": bench.name, "description": bench.description, "quick": args.quick,
        "keys": list(bench.keys), "values": list(bench.values), "rows": rows,
        "summaries": summaries,
        "backends": {b: {k: v for k, v in r.items() if k != "rows"} for b, r in results.items()},
        "note": "medians over repeated steps; first (compiling) call excluded and reported as "
                "compile_s; shared machines make absolute figures noisy: compare within a run",
    }
    json_path, md_path = write_report(args.out, bench.name, payload, f"{bench.description}\n\n{table}")
    print(table)
    print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    return 1 if any("error" in r for r in results.values()) else 0
