"""Order statistics for figures measured over seeds: a median with an interval of known coverage."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["median_coverage", "median_interval"]


def median_coverage(n: int, depth: int = 1) -> float:
    """The probability that [x_(depth), x_(n + 1 - depth)], the ``depth``-th smallest and
    largest of ``n`` independent draws, covers the median of their distribution: the interval
    misses only when ``n + 1 - depth`` or more draws fall on one side, each with probability
    1/2. For ``depth`` 1, [min, max]: ``1 - 2 * 0.5 ** n``, 0 for one draw, 0.75 for three,
    0.9375 for five."""
    if n < 1 or not 1 <= depth <= (n + 1) // 2:
        return 0.0
    below = sum(math.comb(n, k) for k in range(depth)) / 2.0 ** n
    return 1.0 - 2.0 * below


def median_interval(values: list[float], level: float | None = None) -> dict[str, Any]:
    """The median of ``values`` with an order-statistic interval and its coverage
    (``median_coverage``): [min, max], or with ``level`` the narrowest symmetric interval whose
    coverage is at least ``level`` (so more values narrow it, where [min, max] only widens; it
    is [min, max] while no narrower one reaches ``level``). Infinite values (a run that never
    reached the target) sort last, so a median or upper end can be infinite."""
    ordered = sorted(float(v) for v in values)
    n = len(ordered)
    if n == 0:
        return {"median": math.nan, "low": math.nan, "high": math.nan, "n": 0, "coverage": 0.0}
    middle = n // 2
    median = ordered[middle] if n % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    depth = 1
    while level is not None and depth < (n + 1) // 2 and median_coverage(n, depth + 1) >= level:
        depth += 1
    return {"median": median, "low": ordered[depth - 1], "high": ordered[n - depth], "n": n,
            "coverage": median_coverage(n, depth)}


def log_log_interpolate(points: dict[int, float], x: float) -> float | None:
    """``y`` at ``x`` from ``{x: y}`` points (all positive), interpolated linearly in log x and
    log y; None outside the points' range (never extrapolated) or without points."""
    xs = sorted(points)
    if not xs or not xs[0] <= x <= xs[-1]:
        return None
    logs = [math.log(points[k]) for k in xs]
    return float(math.exp(np.interp(math.log(x), [math.log(k) for k in xs], logs)))
