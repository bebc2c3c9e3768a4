"""A timing harness: first (compiling) call apart, medians over repeats, results waited for."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kbackend.backends import impl


@dataclass(frozen=True)
class Timing:
    """Seconds per call: median and spread of the repeats, plus the first (compiling) call."""

    median_s: float
    p10_s: float
    p90_s: float
    repeats: int
    first_call_s: float

    @property
    def compile_s(self) -> float:
        """The first call's extra time over a steady call: tracing and compilation."""
        return max(0.0, self.first_call_s - self.median_s)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "compile_s": self.compile_s}


def summarize(first_call_s: float, repeat_times: Sequence[float]) -> Timing:
    """A ``Timing`` from the first call's time and the steady calls' times."""
    times = np.asarray(repeat_times, dtype=float)
    if times.size == 0:
        times = np.asarray([first_call_s])
    return Timing(float(np.median(times)), float(np.percentile(times, 10)),
                  float(np.percentile(times, 90)), int(times.size), float(first_call_s))


def time_calls(fn: Callable[[], Any], repeats: int = 10,
               wait: Callable[[Any], Any] | None = None) -> Timing:
    """Time ``fn()``: one first call (compiles), then ``repeats`` calls; ``wait`` blocks on results.

    ``wait`` defaults to the active backend's ``block_until_ready`` so asynchronous dispatch never
    stops a timer early.
    """
    if wait is None:
        wait = impl().block_until_ready
    start = time.perf_counter()
    wait(fn())
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        wait(fn())
        times.append(time.perf_counter() - start)
    return summarize(first, times)
