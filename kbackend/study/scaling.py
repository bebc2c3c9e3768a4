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
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from kbackend.hardware.knee import Knee, find_knee
from kbackend.io import JsonObject
from kbackend.study.study_record import Cell, CellStepTime, NoiseScale

if TYPE_CHECKING:  # the store opens SQLite: not at the train command's set-up (test_startup)
    from kbackend.study.store import StoredRun

PERFECT_SCALING_EXPONENT = 0.7
SATURATION_EXPONENT = 0.2
# A fitted knee more than this factor outside the studied batch sizes is reported as outside.
KNEE_EXTRAPOLATION = 2.0
COMPARED = (("adam", "sgd"), ("adam", "momentum"))  # the report's optimizer comparisons


Grouped = TypeVar("Grouped", Cell, CellStepTime)


def by_optimizer(cells: Iterable[Grouped]) -> dict[str, list[Grouped]]:
    """``cells`` by optimizer, each group in batch-size order."""
    grouped: dict[str, list[Grouped]] = {}
    for cell in cells:
        grouped.setdefault(cell.optimizer, []).append(cell)
    for group in grouped.values():
        group.sort(key=lambda c: c.batch_size)
    return grouped


@dataclass(frozen=True)
class ScalingRegion:
    """The segment between two neighbouring batch sizes: its scaling exponent and region."""

    low: int
    high: int
    exponent: float
    region: str

    def to_json(self) -> JsonObject:
        return {"from": self.low, "to": self.high, "exponent": self.exponent,
                "region": self.region}


def region_of(exponent: float) -> str:
    """The scaling region a steps-vs-batch exponent falls in."""
    if exponent >= PERFECT_SCALING_EXPONENT:
        return "perfect scaling"
    if exponent <= SATURATION_EXPONENT:
        return "saturation"
    return "diminishing returns"


def scaling_regions(points: list[tuple[int, float]]) -> list[ScalingRegion]:
    """Label each segment between neighbouring (batch size, steps to target) points."""
    segments = []
    for (b1, s1), (b2, s2) in itertools.pairwise(points):
        exponent = math.log(s1 / s2) / math.log(b2 / b1)
        segments.append(ScalingRegion(b1, b2, exponent, region_of(exponent)))
    return segments


@dataclass(frozen=True)
class CriticalBatchFit:
    """The fit of S(B) = S_min (1 + B_crit / B): ``b_crit`` None where it has no finite positive
    knee (``beyond_grid``: "above" or "below" the grid where that is why; ``note`` says so)."""

    s_min: float | None
    b_crit: float | None
    note: str
    beyond_grid: str | None = None

    def to_json(self) -> JsonObject:
        where = {} if self.beyond_grid is None else {"beyond_grid": self.beyond_grid}
        return {"s_min": self.s_min, "b_crit": self.b_crit, **where, "note": self.note}


def fit_critical_batch(points: list[tuple[int, float]]) -> CriticalBatchFit:
    """Fit S(B) = S_min (1 + B_crit / B) to (batch size, steps) points (relative least squares).

    ``b_crit`` is None when the fit has no finite positive knee: ``beyond_grid`` says whether
    steps still fall in proportion at the largest batch (knee above the grid) or never did
    (knee below it).
    """
    if len(points) < 2:
        return CriticalBatchFit(None, None, "fewer than two batch sizes reached the target")
    # Weighted normal equations for S = a + b u, u = 1 / B, weights 1 / S^2.
    rows = [(1.0 / s, (1.0 / b) / s, 1.0) for b, s in points]  # (1/S, u/S, S/S)
    saa = sum(r[0] ** 2 for r in rows)
    sab = sum(r[0] * r[1] for r in rows)
    sbb = sum(r[1] ** 2 for r in rows)
    sa_y = sum(r[0] * r[2] for r in rows)
    sb_y = sum(r[1] * r[2] for r in rows)
    det = saa * sbb - sab * sab
    if abs(det) < 1e-300:
        return CriticalBatchFit(None, None, "degenerate fit")
    a = (sa_y * sbb - sab * sb_y) / det
    b = (saa * sb_y - sab * sa_y) / det
    smallest, largest = min(p[0] for p in points), max(p[0] for p in points)
    # A knee far outside the grid is an extrapolation, not a measurement.
    if a <= 1e-9 * max(p[1] for p in points) or b / a > KNEE_EXTRAPOLATION * largest:
        return CriticalBatchFit(None, None, f"no saturation within the grid: B_crit > {largest}",
                                "above")
    if b <= 0 or b / a < smallest / KNEE_EXTRAPOLATION:
        return CriticalBatchFit(a, None, f"saturated over the whole grid: B_crit < {smallest}",
                                "below")
    return CriticalBatchFit(a, b / a, "")


@dataclass(frozen=True)
class ThroughputPoint:
    """Samples/s at one batch size: the median over ``runs`` runs' own clocks
    (``throughput_curve``), or over the time model's timings with their interval
    (``cell_verdicts.measured_throughput``: ``low``, ``high``, ``n``, ``coverage``)."""

    batch_size: int
    samples_per_s: float
    runs: int | None = None
    low: float | None = None
    high: float | None = None
    n: int | None = None
    coverage: float | None = None

    def to_json(self) -> JsonObject:
        return {k: v for k, v in vars(self).items() if v is not None}


def throughput_knee(curve: list[ThroughputPoint]) -> Knee:
    """The knee of a throughput curve (``kbackend.hardware.knee``'s one definition)."""
    return find_knee([p.batch_size for p in curve], [p.samples_per_s for p in curve])


def throughput_curve(runs: list[StoredRun]) -> list[ThroughputPoint]:
    """Median steady-state samples/s per batch size over every run (all optimizers and rates)."""
    by_batch: dict[int, list[float]] = {}
    for run in runs:
        value = run.result.get("samples_per_s")
        if value is not None and math.isfinite(value) and value > 0:
            by_batch.setdefault(run.config["batch_size"], []).append(value)
    return [ThroughputPoint(b, statistics.median(v), len(v)) for b, v in sorted(by_batch.items())]


@dataclass(frozen=True)
class Crossover:
    """Where ``challenger`` overtakes ``incumbent`` (``crossover``): the batch size from which it
    is faster (None: not within the grid), whether it wins at each common batch size, and why."""

    challenger: str
    incumbent: str
    batch_size: int | None
    wins: dict[int, bool]
    note: str

    def to_json(self) -> JsonObject:
        return dict(vars(self))


def crossover(cells: list[Cell], challenger: str, incumbent: str) -> Crossover | None:
    """The smallest batch size from which ``challenger`` reaches the target in less training time
    than ``incumbent`` at that and every larger studied batch size (None if both are absent)."""
    a = {c.size: c for c in cells if c.optimizer == challenger}
    b = {c.size: c for c in cells if c.optimizer == incumbent}
    if not a or not b:
        return None
    sizes = sorted(s for s in set(a) & set(b)
                   if math.isfinite(a[s].seconds) or math.isfinite(b[s].seconds))
    wins = [a[s].seconds < b[s].seconds for s in sizes]
    first = None
    if not sizes:
        note = "neither reached the target at any common batch size"
    elif all(wins):
        note = f"{challenger} is faster at every batch size studied"
    elif not wins[-1]:
        note = f"{challenger} does not overtake {incumbent} within the grid"
    else:
        first = len(wins)
        while first > 0 and wins[first - 1]:
            first -= 1
        note = f"{challenger} is faster from batch size {sizes[first]} up"
    return Crossover(challenger, incumbent, None if first is None else sizes[first],
                     dict(zip(sizes, wins, strict=True)), note)


def _noise_sums(noise: NoiseScale) -> tuple[float, float]:
    """The |G|^2 and tr(Sigma) estimates summed over the points after initialization (all
    points where there are none)."""
    points = [p for p in noise.points if p.step > 0] or noise.points
    return sum(p.grad_sq for p in points), sum(p.trace_sigma for p in points)


def training_noise_scale(noise: NoiseScale | None) -> float | None:
    """B_simple over training: the ratio of the tr(Sigma) and |G|^2 estimates averaged over the
    measurement points after initialization. One point's |G|^2 near the target is small and
    noisy, so its ratio alone can be off by an order of magnitude. None when it is not a
    finding: no measurement, or an average estimate that is not positive (``noise_scale_note``
    says which)."""
    if noise is None or not noise.points:
        return None
    grad_sq, trace = _noise_sums(noise)
    if not (grad_sq > 0 and trace > 0 and math.isfinite(grad_sq) and math.isfinite(trace)):
        return None
    return trace / grad_sq


def noise_scale_note(noise: NoiseScale | None) -> str:
    """Why ``training_noise_scale`` gave no value ('' when it gave one)."""
    if noise is None or not noise.points:
        return "not estimated: no measurement (--noise-points 0)"
    if training_noise_scale(noise) is not None:
        return ""
    grad_sq, trace = _noise_sums(noise)
    pair = f"batch pair {noise.small_batch}/{noise.big_batch}"
    if not grad_sq > 0:
        return (f"not estimated: the |G|^2 estimate is not positive ({grad_sq:.3g}) with the "
                f"{pair}: the gradient is too small against its noise to measure with "
                f"{noise.draws} draws")
    return (f"not estimated: the tr(Sigma) estimate is not positive ({trace:.3g}) with the "
            f"{pair}")
