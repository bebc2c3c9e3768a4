"""The one benchmark runner: one parser, one worker per process, one JSON + markdown writer.

    python scripts/bench_throughput.py [--quick] [--out DIR] [--backends jax,tensorflow]
                                       [--repeats N]
    python -m kbackend.bench bench_throughput [same options]

The parent runs each worker (by default one per backend) in its own child process through
``kbackend.runtime.child``, collects each worker's rows, summary and environment
(``kbackend.envinfo.environment``), and writes ``DIR/<name>.json`` (figures + environments) and
``DIR/<name>.md`` (a table). A worker that fails is reported in the JSON and makes the exit
status 1; the other workers still run.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from kbackend import logs
from kbackend.backend_choice import BACKENDS, use_backend, validate_backend
from kbackend.backends import impl
from kbackend.bench.registry import BENCHMARKS
from kbackend.bench.spec import Benchmark, Settings, WorkerSpec
from kbackend.envinfo import environment
from kbackend.errors import KBackendError
from kbackend.hardware.probe import warm_up
from kbackend.reports import markdown_table, side_by_side, write_report
from kbackend.runtime.child import ChildFailed, resolve, run_in_child

DEFAULT_OUT = "runs/bench"


def parser(bench: Benchmark) -> argparse.ArgumentParser:
    """The command line of ``bench``: the shared options plus the benchmark's own."""
    parser = argparse.ArgumentParser(prog=bench.name, description=bench.description)
    parser.add_argument("--quick", action="store_true",
                        help="a small, fast version (CI, nox -s bench)")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help=f"output folder (default {DEFAULT_OUT}/)")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help="comma-separated backends, each run in its own process")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed rounds per case (default: the benchmark's, fewer with --quick)")
    for option in bench.options:
        parser.add_argument(option.flag, dest=option.dest, type=option.parse,
                            default=option.default, help=option.help)
    return parser


def run_worker(measure: str, settings: dict[str, Any]) -> dict[str, Any]:
    """Worker side (in the child process): run ``measure`` and describe where it ran."""
    backend = use_backend()
    impl()  # started before Keras runs anything: TF applies the virtual devices only then
    start = time.perf_counter()
    warm_up_s = warm_up()  # one-time process costs stay out of the first case's figures
    rows, summary = resolve(measure)(Settings(**settings))
    for row in rows:
        row.setdefault("backend", backend)
    return {"backend": backend, "rows": rows, "summary": summary, "environment": environment(),
            "wall_s": time.perf_counter() - start, "warm_up_s": warm_up_s}


def _target(bench: Benchmark) -> str:
    module, name = bench.measure.__module__, bench.measure.__qualname__
    if module == "__main__" or "<locals>" in name:
        raise KBackendError(f"Invalid benchmark {bench.name!r}: its measure function must be "
                            f"importable by name. Received: {module}:{name}.")
    return f"{module}:{name}"


def default_table(bench: Benchmark, payload: dict[str, Any]) -> str:
    """The side-by-side table (one column per value and worker) plus the summaries."""
    labels = list(payload["backends"])
    rows, columns = side_by_side(payload["rows"], bench.keys, bench.values, labels)
    table = markdown_table(rows, columns)
    if bench.summary_fields:
        table += "\n" + markdown_table(payload["summaries"], ["backend", *bench.summary_fields])
    return table


def run(bench: Benchmark, argv: Sequence[str] | None = None, *, in_process: bool = False) -> int:
    """Run ``bench`` with command-line ``argv``: 0 when every worker succeeded, 1 if one failed,
    2 for bad options.

    ``in_process`` runs the workers of this process's backend (without virtual devices of their
    own) here instead of in a child: the smoke tests use it to save a framework start-up per
    worker. Figures measured that way share the process with whatever ran before them.
    """
    args = parser(bench).parse_args(argv)
    backends = _checked_backends(bench, args)
    if backends is None:
        return 2
    settings = Settings(quick=args.quick, repeats=args.repeats,
                        options={o.dest: getattr(args, o.dest) for o in bench.options},
                        out=args.out)
    resources = bench.resources(settings) if bench.resources else contextlib.nullcontext({})
    with resources as extra:
        settings = replace(settings, options={**settings.options, **extra})
        results = {spec.label: _run_one(bench, spec, settings, in_process)
                   for spec in bench.workers(settings, backends)}
    _write_payload(bench, settings, results, args.out)
    return 1 if any("error" in r for r in results.values()) else 0


def _checked_backends(bench: Benchmark, args: argparse.Namespace) -> list[str] | None:
    """The backends of ``--backends``, after checking every option before any worker starts
    (a bad ``--out`` fails now, not after the run); None, the error printed, if one is bad."""
    try:
        if args.repeats is not None and args.repeats < 1:
            raise KBackendError(f"Invalid --repeats {args.repeats}: expected an integer >= 1.")
        backends = [validate_backend(b) for b in args.backends.split(",") if b.strip()]
        Path(args.out).mkdir(parents=True, exist_ok=True)
    except (KBackendError, OSError) as error:
        print(f"{bench.name}: error: {error}", file=sys.stderr)
        return None
    return backends


def _run_one(bench: Benchmark, spec: WorkerSpec, settings: Settings,
             in_process: bool) -> dict[str, Any]:
    """One worker's result: in this process where ``in_process`` allows, else in a child; a
    worker that fails gives its error and no rows (the other workers still run)."""
    print(f"{bench.name}: running {spec.label} ({'quick' if settings.quick else 'full'}) ...",
          file=sys.stderr, flush=True)
    kwargs: dict[str, Any] = {
        "measure": _target(bench),
        "settings": asdict(replace(settings, devices=spec.virtual_devices))}
    try:
        # here: the backend already started, and no virtual devices of the worker's own
        if in_process and spec.virtual_devices is None and spec.backend == use_backend():
            result = run_worker(**kwargs)
        else:
            result = run_in_child("kbackend.bench.runner:run_worker", spec.backend, kwargs,
                                  echo=True, virtual_devices=spec.virtual_devices)
        print(f"{bench.name}: {spec.label} done in {result['wall_s']:.1f}s",
              file=sys.stderr, flush=True)
    except ChildFailed as error:
        result = {"backend": spec.backend, "rows": [], "summary": {}, "error": str(error)}
        print(f"{bench.name}: {spec.label} FAILED: {error}", file=sys.stderr, flush=True)
    return result


def _write_payload(bench: Benchmark, settings: Settings, results: dict[str, dict[str, Any]],
                   out: str) -> None:
    """Write the workers' ``results`` under ``out`` as JSON and a markdown table, and print
    the table."""
    rows = [row for result in results.values() for row in result["rows"]]
    if bench.derive is not None:
        bench.derive(rows)
    payload = {
        "benchmark": bench.name, "description": bench.description, "quick": settings.quick,
        "settings": {"repeats": settings.repeats, "options": settings.options},
        "keys": list(bench.keys), "values": list(bench.values), "rows": rows,
        "summaries": [{"backend": label, **result["summary"]} for label, result in results.items()],
        "backends": {label: {k: v for k, v in r.items() if k != "rows"}
                     for label, r in results.items()},
        "note": bench.note,
    }
    table = bench.table(payload) if bench.table else default_table(bench, payload)
    json_path, md_path = write_report(out, bench.name, payload,
                                      f"{bench.description}\n\n{table}")
    print(table)
    print(f"wrote {json_path} and {md_path}", file=sys.stderr)


def main(name: str, argv: Sequence[str] | None = None) -> int:
    """Run the registered benchmark ``name`` (what every ``scripts/bench_*.py`` calls).

    The calling process is the benchmark's own, so the frameworks' C++ log lines are filtered
    out of its output as on the command line (``KBACKEND_VERBOSE=1`` keeps them); its worker
    processes inherit the filter.
    """
    if not logs.verbose_requested():
        logs.install_filter()
    return run(BENCHMARKS[name], argv)


def main_from_command_line(argv: Sequence[str]) -> int:
    """``python -m kbackend.bench NAME ...``."""
    if not argv or argv[0] not in BENCHMARKS:
        received = argv[0] if argv else None
        print(f"Invalid benchmark. Expected one of {sorted(BENCHMARKS)}. Received: {received!r}.",
              file=sys.stderr)
        return 2
    return main(argv[0], argv[1:])
