"""What a benchmark is: its measurement, its table, its options and the processes it runs in."""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kbackend.backend_choice import active_backend
from kbackend.study.verdicts import mean_interval

Rows = tuple[list[dict[str, Any]], dict[str, Any]]
DEFAULT_NOTE = ("medians over repeated steps; first (compiling) call excluded and reported as "
                "compile_s; shared machines make absolute figures noisy: compare within a run")


def say(message: str) -> None:
    """A worker's progress line on stderr, tagged with its backend."""
    print(f"[{active_backend()}] {message}", file=sys.stderr, flush=True)


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    """Median and [min, max] of the finite values (None where there are none), ``n`` of them
    ``of`` all: a benchmark's figure over seeds or repeats."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return {"median": None, "min": None, "max": None, "n": 0, "of": len(values)}
    return {"median": statistics.median(finite), "min": min(finite), "max": max(finite),
            "n": len(finite), "of": len(values)}


def spread_text(figure: dict[str, Any], fmt: str) -> str:
    """A ``spread`` as a table cell: ``median [min, max]`` (the median alone where they agree)."""
    if figure["median"] is None:
        return "-"
    low, mid, high = (format(figure[k], fmt) for k in ("min", "median", "max"))
    return mid if low == high else f"{mid} [{low}, {high}]"


@dataclass(frozen=True)
class Settings:
    """What a worker is asked to measure: quick mode, timed repeats (None: the benchmark's
    default), the benchmark's own options, the worker's virtual device count, and the run's
    output folder (``--out``: where a worker writes files of its own, such as plots)."""

    quick: bool = False
    repeats: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    devices: int | None = None
    out: str | None = None

    def rounds(self, quick: int, full: int) -> int:
        """``--repeats`` if given, else ``quick`` or ``full`` rounds by mode."""
        return self.repeats or (quick if self.quick else full)


@dataclass(frozen=True)
class Option:
    """A command-line option of one benchmark, e.g. ``--batch-sizes`` (dest ``batch_sizes``)."""

    flag: str
    help: str
    parse: Callable[[str], Any] = str
    default: Any = None

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class WorkerSpec:
    """One child process of a run: its label in the report, backend and virtual devices."""

    label: str
    backend: str
    virtual_devices: int | None = None


def median_of(rows: Sequence[dict[str, Any]], field: str = "wall_s",
              **match: Any) -> float | None:
    """The median ``field`` of the ``rows`` matching every ``match`` (None where none has it)."""
    values = [r[field] for r in rows if r.get(field) is not None
              and all(r.get(k) == v for k, v in match.items())]
    return float(np.median(values)) if values else None


def geometric_interval(logs: Sequence[float],
                       level: float) -> tuple[float, float | None, float | None]:
    """The geometric mean of paired ratios given as ``logs``, with its ``level`` t-interval
    (``verdicts.mean_interval`` on the logs; an unbounded end is None)."""
    estimate, low, high = mean_interval(logs, level)
    return (math.exp(estimate), math.exp(low) if math.isfinite(low) else None,
            math.exp(high) if math.isfinite(high) else None)


def one_per_backend(settings: Settings, backends: Sequence[str]) -> list[WorkerSpec]:
    """The default: one worker per requested backend, side by side."""
    return [WorkerSpec(backend, backend) for backend in backends]


def name_list(text: str) -> list[str]:
    """``'sqrt, linear'`` -> ``['sqrt', 'linear']`` (an option parser)."""
    return [part.strip() for part in text.split(",") if part.strip()]


def int_list(text: str) -> list[int]:
    """``'8,32,128'`` -> ``[8, 32, 128]`` (an option parser)."""
    return [int(part) for part in name_list(text)]


def float_list(text: str) -> list[float]:
    """``'1e-3,3e-3'`` -> ``[0.001, 0.003]`` (an option parser)."""
    return [float(part) for part in name_list(text)]


def positive_int(text: str) -> int:
    """An integer >= 1 (an option parser)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def subset_of(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """An option parser of a comma-separated, non-empty subset of ``allowed``."""

    def parse(text: str) -> list[str]:
        names = name_list(text)
        if not names or any(name not in allowed for name in names):
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated subset of {', '.join(allowed)}, got {text!r}")
        return names

    return parse


@dataclass(frozen=True)
class Benchmark:
    """A benchmark: what one worker measures and how the workers' rows become a report.

    ``measure(settings)`` runs in each worker process and returns ``(rows, summary)``; it must be
    a module-level function (the worker imports it by name). ``keys`` name the columns
    identifying a case, ``values`` the measured columns shown per backend in the default table.
    Optional: ``options`` (extra flags), ``workers`` (which processes; default one per backend),
    ``resources`` (a context the parent holds while the workers run, yielding options for them,
    e.g. a Redis server's URL), ``derive`` (adds columns computed across workers' rows) and
    ``table`` (markdown from the payload, in place of the side-by-side table).
    """

    name: str
    description: str
    measure: Callable[[Settings], Rows]
    keys: Sequence[str] = ()
    values: Sequence[str] = ()
    summary_fields: Sequence[str] = ()
    options: Sequence[Option] = ()
    workers: Callable[[Settings, Sequence[str]], list[WorkerSpec]] = one_per_backend
    resources: Callable[[Settings], AbstractContextManager[dict[str, Any]]] | None = None
    derive: Callable[[list[dict[str, Any]]], None] | None = None
    table: Callable[[dict[str, Any]], str] | None = None
    note: str = DEFAULT_NOTE

