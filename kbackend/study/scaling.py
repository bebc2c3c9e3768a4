"""What a study's steps to target say about batch-size scaling: scaling regions, the critical
batch size fit, the throughput curve from the runs' clocks, where one optimizer overtakes
another, and the measured gradient noise scale over training.

Regions (Shallue et al. 2018): between two neighbouring batch sizes B1 < B2 with steps to
target S1, S2, the scaling exponent k = log(S1 / S2) / log(B2 / B1) is 1 when doubling the batch
halves the steps (perfect scaling) and 0 when it saves none (saturation). k >= 0.7 is marked
perfect scaling, k <= 0.2 saturation, anything between diminishing returns.

Knee (McCandlish et al. 2018): steps to target follow S(B) = S_min (1 + B_crit / B); a
least-squares fit of S = a + b / B (relative errors) gives S_min = a and B_crit = b / a, the
batch size where the run takes twice the minimum number of steps. It is compared with the
measured gradient noise scale B_simple, which predicts it.
"""


from __future__ import annotations

import itertools
import math
import statistics
from typing import TYPE_CHECKING, Any

from kbackend.study.study_record import Cell

if TYPE_CHECKING:  # the store opens SQLite: not at the train command's set-up (test_startup)
    from kbackend.study.store import StoredRun

PERFECT_SCALING_EXPONENT = 0.7
SATURATION_EXPONENT = 0.2
# A fitted knee more than this factor outside the studied batch sizes is reported as outside.
KNEE_EXTRAPOLATION = 2.0


def by_optimizer(cells: list[Cell]) -> dict[str, list[Cell]]:
    grouped: dict[str, list[Cell]] = {}
    for cell in cells:
        grouped.setdefault(cell.optimizer, []).append(cell)
    for group in grouped.values():
        group.sort(key=lambda c: c.batch_size)
    return grouped


def scaling_regions(points: list[tuple[int, float]]) -> list[dict[str, Any]]:
    """Label each segment between neighbouring (batch size, steps to target) points."""
    segments = []
    for (b1, s1), (b2, s2) in itertools.pairwise(points):
        exponent = math.log(s1 / s2) / math.log(b2 / b1)
        if exponent >= PERFECT_SCALING_EXPONENT:
            region = "perfect scaling"
        elif exponent <= SATURATION_EXPONENT:
            region = "saturation"
        else:
            region = "diminishing returns"
        segments.append({"from": b1, "to": b2, "exponent": exponent, "region": region})
    return segments


def fit_critical_batch(points: list[tuple[int, float]]) -> dict[str, Any]:
    """Fit S(B) = S_min (1 + B_crit / B) to (batch size, steps) points (relative least squares).

    ``b_crit`` is None when the fit has no finite positive knee: ``beyond_grid`` says whether
    steps still fall in proportion at the largest batch (knee above the grid) or never did
    (knee below it).
    """
    if len(points) < 2:
        return {"s_min": None, "b_crit": None,
                "note": "fewer than two batch sizes reached the target"}
    # Weighted normal equations for S = a + b u, u = 1 / B, weights 1 / S^2.
    rows = [(1.0 / s, (1.0 / b) / s, 1.0) for b, s in points]  # (1/S, u/S, S/S)
    saa = sum(r[0] ** 2 for r in rows)
    sab = sum(r[0] * r[1] for r in rows)
    sbb = sum(r[1] ** 2 for r in rows)
    sa_y = sum(r[0] * r[2] for r in rows)
    sb_y = sum(r[1] * r[2] for r in rows)
    det = saa * sbb - sab * sab
    if abs(det) < 1e-300:
        return {"s_min": None, "b_crit": None, "note": "degenerate fit"}
    a = (sa_y * sbb - sab * sb_y) / det
    b = (saa * sb_y - sab * sa_y) / det
    smallest, largest = min(p[0] for p in points), max(p[0] for p in points)
    # A knee far outside the grid is an extrapolation, not a measurement.
    if a <= 1e-9 * max(p[1] for p in points) or b / a > KNEE_EXTRAPOLATION * largest:
        return {"s_min": None, "b_crit": None, "beyond_grid": "above",
                "note": f"no saturation within the grid: B_crit > {largest}"}
    if b <= 0 or b / a < smallest / KNEE_EXTRAPOLATION:
        return {"s_min": a, "b_crit": None, "beyond_grid": "below",
                "note": f"saturated over the whole grid: B_crit < {smallest}"}
    return {"s_min": a, "b_crit": b / a, "note": ""}


def throughput_curve(runs: list[StoredRun]) -> list[dict[str, Any]]:
    """Median steady-state samples/s per batch size over every run (all optimizers and rates)."""
    by_batch: dict[int, list[float]] = {}
    for run in runs:
        value = run.result.get("samples_per_s")
        if value is not None and math.isfinite(value) and value > 0:
            by_batch.setdefault(run.config["batch_size"], []).append(value)
    return [{"batch_size": b, "samples_per_s": statistics.median(v), "runs": len(v)}
            for b, v in sorted(by_batch.items())]


def cell_time(cell: Cell | None) -> float:
    return math.inf if cell is None else cell.seconds


def crossover(cells: list[Cell], challenger: str,
              incumbent: str) -> dict[str, Any] | None:
    """The smallest batch size from which ``challenger`` reaches the target in less training time
    than ``incumbent`` at that and every larger studied batch size (None if both are absent)."""
    grouped = by_optimizer(cells)
    if challenger not in grouped or incumbent not in grouped:
        return None
    a = {c.batch_size: c for c in grouped[challenger]}
    b = {c.batch_size: c for c in grouped[incumbent]}
    sizes = sorted(s for s in set(a) & set(b)
                   if math.isfinite(cell_time(a[s])) or math.isfinite(cell_time(b[s])))
    wins = [cell_time(a[s]) < cell_time(b[s]) for s in sizes]
    result: dict[str, Any] = {"challenger": challenger, "incumbent": incumbent,
                              "batch_size": None, "wins": dict(zip(sizes, wins, strict=True))}
    if not sizes:
        result["note"] = "neither reached the target at any common batch size"
    elif all(wins):
        result["note"] = f"{challenger} is faster at every batch size studied"
    elif not wins[-1]:
        result["note"] = f"{challenger} does not overtake {incumbent} within the grid"
    else:
        first = len(wins)
        while first > 0 and wins[first - 1]:
            first -= 1
        result["batch_size"] = sizes[first]
        result["note"] = f"{challenger} is faster from batch size {sizes[first]} up"
    return result


def training_noise_scale(noise: dict[str, Any] | None) -> float | None:
    """B_simple over training: the ratio of the tr(Sigma) and |G|^2 estimates averaged over the
    measurement points after initialization. One point's |G|^2 near the target is small and
    noisy, so its ratio alone can be off by an order of magnitude. None when it is not a
    finding: no measurement, or an average estimate that is not positive (``noise_scale_note``
    says which)."""
    if not noise or not noise.get("points"):
        return None
    points = [p for p in noise["points"] if p["step"] > 0] or noise["points"]
    grad_sq = sum(p["grad_sq"] for p in points)
    trace = sum(p["trace_sigma"] for p in points)
    if not (grad_sq > 0 and trace > 0 and math.isfinite(grad_sq) and math.isfinite(trace)):
        return None
    return trace / grad_sq


def noise_scale_note(noise: dict[str, Any] | None) -> str:
    """Why ``training_noise_scale`` gave no value ('' when it gave one)."""
    if not noise or not noise.get("points"):
        return "not estimated: no measurement (--noise-points 0)"
    if training_noise_scale(noise) is not None:
        return ""
    points = [p for p in noise["points"] if p["step"] > 0] or noise["points"]
    grad_sq = sum(p["grad_sq"] for p in points)
    trace = sum(p["trace_sigma"] for p in points)
    pair = f"batch pair {noise.get('small_batch')}/{noise.get('big_batch')}"
    if not grad_sq > 0:
        return (f"not estimated: the |G|^2 estimate is not positive ({grad_sq:.3g}) with the "
                f"{pair}: the gradient is too small against its noise to measure with "
                f"{noise.get('draws')} draws")
    return (f"not estimated: the tr(Sigma) estimate is not positive ({trace:.3g}) with the "
            f"{pair}")
