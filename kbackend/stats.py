"""Order statistics for figures measured over seeds: a median with an interval of known coverage."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["median_coverage", "median_interval"]


def median_coverage(n: int) -> float:
    """The probability that [x_(1), x_(n)], the smallest and largest of ``n`` independent draws,
    covers the median of their distribution: ``1 - 2 * 0.5 ** n`` (each draw falls below the
    median with probability 1/2, and the interval misses it only when all ``n`` fall on one
    side). 0 for one draw, 0.75 for three, 0.9375 for five."""
    if n < 1:
        return 0.0
    return 1.0 - 2.0 * 0.5 ** n


def median_interval(values: list[float]) -> dict[str, Any]:
    """The median of ``values`` with the order-statistic interval [min, max] and its coverage
    (``median_coverage``). Infinite values (a run that never reached the target) sort last, so
    a median or upper end can be infinite."""
    ordered = sorted(float(v) for v in values)
    n = len(ordered)
    if n == 0:
        return {"median": math.nan, "low": math.nan, "high": math.nan, "n": 0, "coverage": 0.0}
    middle = n // 2
    median = ordered[middle] if n % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    return {"median": median, "low": ordered[0], "high": ordered[-1], "n": n,
            "coverage": median_coverage(n)}


def log_log_interpolate(points: dict[int, float], x: float) -> float | None:
    """``y`` at ``x`` from ``{x: y}`` points (all positive), interpolated linearly in log x and
    log y; None outside the points' range (never extrapolated) or without points."""
    xs = sorted(points)
    if not xs or not xs[0] <= x <= xs[-1]:
        return None
    logs = [math.log(points[k]) for k in xs]
    return float(math.exp(np.interp(math.log(x), [math.log(k) for k in xs], logs)))
