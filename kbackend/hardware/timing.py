"""The timing harness: first (compiling) call apart, interleaved repeats, the noise kept with the
figure, results waited for, and an injectable clock.

Every measurement kbackend keeps per machine (the adaptive batch size's throughput knee among
them) times its calls here. A figure comes with its noise: the coefficient of variation of the
repeats (``Timing.cv``). Configurations compared on a shared machine are timed interleaved
(``time_interleaved``: one call of each per round, the order rotated every round), so that a
burst of load hits every configuration alike and each round gives a paired ratio
(``paired_ratios``) instead of two figures taken minutes apart. The clock is an argument (tests
slow it on purpose to stand for a busy machine).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import numpy as np

from kbackend.backends import impl

Clock = Callable[[], float]
K = TypeVar("K", bound=Hashable)
NOISY_CV = 0.10  # repeats that vary more than this (std / mean) make a noisy figure


@dataclass(frozen=True)
class Timing:
    """Seconds per call: median and spread of the repeats, plus the first (compiling) call;
    ``cv``: the repeats' coefficient of variation (std / mean; NaN for fewer than two);
    ``times``: the repeats themselves, in order (one per round when interleaved)."""

    median_s: float
    p10_s: float
    p90_s: float
    repeats: int
    first_call_s: float
    cv: float = math.nan
    times: tuple[float, ...] = ()

    @property
    def compile_s(self) -> float:
        """The first call's extra time over a steady call: tracing and compilation."""
        return max(0.0, self.first_call_s - self.median_s)

    @property
    def noisy(self) -> bool:
        """Whether the repeats vary by more than ``NOISY_CV``."""
        return bool(self.cv > NOISY_CV)

    def to_dict(self) -> dict[str, Any]:
        fields = asdict(self)
        fields.pop("times")
        return {**fields, "compile_s": self.compile_s}


def summarize(first_call_s: float, repeat_times: Sequence[float]) -> Timing:
    """A ``Timing`` from the first call's time and the steady calls' times."""
    times = np.asarray(repeat_times, dtype=float)
    if times.size == 0:
        times = np.asarray([first_call_s])
    mean = float(np.mean(times))
    cv = float(np.std(times, ddof=1) / mean) if times.size > 1 and mean > 0 else math.nan
    return Timing(float(np.median(times)), float(np.percentile(times, 10)),
                  float(np.percentile(times, 90)), int(times.size), float(first_call_s), cv,
                  tuple(float(t) for t in np.asarray(repeat_times, dtype=float)))


def _timed(fn: Callable[[], Any], wait: Callable[[Any], Any], clock: Clock) -> float:
    start = clock()
    wait(fn())
    return clock() - start


def time_calls(fn: Callable[[], Any], repeats: int = 10,
               wait: Callable[[Any], Any] | None = None,
               clock: Clock = time.perf_counter) -> Timing:
    """Time ``fn()``: one first call (compiles), then ``repeats`` calls; ``wait`` blocks on results.

    ``wait`` defaults to the active backend's ``block_until_ready`` so asynchronous dispatch never
    stops a timer early.
    """
    return time_interleaved({0: fn}, repeats, wait, clock)[0]


def time_interleaved(fns: Mapping[K, Callable[[], Any]], rounds: int,
                     wait: Callable[[Any], Any] | None = None,
                     clock: Clock = time.perf_counter, first_calls: bool = True) -> dict[K, Timing]:
    """Time every function of ``fns`` over ``rounds`` rounds, one call of each per round, the
    order rotated by one each round (so none is always first after a pause); each one's first
    call (compiling) is made and timed apart beforehand unless ``first_calls`` is False (then
    ``first_call_s`` is NaN). ``Timing.times[r]`` is round r's call: ``paired_ratios`` compares
    two functions round by round."""
    if wait is None:
        wait = impl().block_until_ready
    keys = list(fns)
    first = {key: _timed(fns[key], wait, clock) if first_calls else math.nan for key in keys}
    times: dict[K, list[float]] = {key: [] for key in keys}
    for round_index in range(rounds):
        shift = round_index % len(keys)
        for key in keys[shift:] + keys[:shift]:
            times[key].append(_timed(fns[key], wait, clock))
    return {key: summarize(first[key], times[key]) for key in keys}


def paired_ratios(numerator: Timing, denominator: Timing) -> list[float]:
    """Round-by-round ``numerator / denominator`` of two interleaved timings' calls (as many
    rounds as both have)."""
    return [a / b for a, b in zip(numerator.times, denominator.times, strict=False) if b > 0]
