"""The study's verdicts over its cells: the fastest cell, optimizer against optimizer, scaling
regions, the critical batch size over seeds against B_simple, generalization and the throughput
knee. A finding is stated only where the paired-seed intervals of the compared cells separate
(``kbackend.study.verdicts`` holds the interval arithmetic).
"""


from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, replace

from kbackend.io import JsonObject
from kbackend.stats import median_interval
from kbackend.study.scaling import (
    ThroughputPoint,
    by_optimizer,
    fit_critical_batch,
    region_of,
    throughput_knee,
)
from kbackend.study.study_record import Cell, StepTimes, StudyRecord
from kbackend.study.verdicts import (
    DEFAULT_ACCURACY_MARGIN,
    DEFAULT_MARGIN,
    VERDICT_CONFIDENCE,
    LookLevels,
    Resolvable,
    Verdict,
    VerdictSettings,
    budget_steps,
    decide,
    difference_verdict,
    open_bound,
    outcome_text,
    ratio_verdict,
    rounding_sd,
    span_text,
    step_time_log_ratios,
    trimmed_interval,
)
from kbackend.task import metric_direction


def not_resolved(n: int) -> str:
    """The phrase for a comparison the intervals do not settle."""
    reason = " (one seed gives no interval)" if n < 2 else ""
    return f"not resolved at {n} seed{'s' if n != 1 else ''}{reason}"


def _time_span(cell: Cell) -> str:
    """A cell's median time to target with its interval ("-" without one)."""
    interval = (cell.intervals or {}).get("time_to_target")
    if not interval or not interval.get("n"):
        return "-"
    return _median_span(interval["median"], interval["low"], interval["high"],
                        int(interval["n"]), ".3g")


def _median_span(median: float, low: float, high: float, n: int, spec: str) -> str:
    """``median [low, high]`` (one value: the median alone; infinite: "never")."""
    def text(value: float) -> str:
        return "never" if math.isinf(value) else format(value, spec)

    if n == 1:
        return text(median)
    return f"{text(median)} [{text(low)}, {text(high)}]"


def verdict_settings(study: StudyRecord) -> VerdictSettings:
    """The seeds, margins and per-look interval level a study's verdicts are read with."""
    config = study.config
    seeds = int(config.get("seeds", 1))
    max_seeds = max(seeds, int(config.get("max_seeds") or seeds))
    return VerdictSettings(seeds, max_seeds, LookLevels.of(seeds, max_seeds),
                           float(config.get("margin", DEFAULT_MARGIN)),
                           float(config.get("accuracy_margin", DEFAULT_ACCURACY_MARGIN)))


@dataclass(frozen=True)
class FastestVerdict(Resolvable):
    """The fastest cell (``cell``: optimizer, batch size; None where no cell reached), the
    cells it is not shown faster than (``ties``), over ``seeds`` paired seeds, and the
    report's sentence."""

    outcome: str
    seeds: int
    text: str
    cell: tuple[str, int] | None = None
    ties: tuple[str, ...] = ()

    def to_json(self) -> JsonObject:
        cell = None if self.cell is None else {"optimizer": self.cell[0],
                                               "batch_size": self.cell[1]}
        return {"resolved": self.resolved, "outcome": self.outcome, "seeds": self.seeds,
                "cell": cell, "ties": list(self.ties), "text": self.text}


def fastest_verdict(cells: list[Cell], settings: VerdictSettings,
                    step_times: StepTimes | None = None) -> FastestVerdict:
    """The fastest cell, stated only where the paired-seed verdict on time to target
    (``time_verdict``, the interval the other verdicts use) finds it faster than every other
    cell; otherwise the cells it is equivalent to or cannot be told apart from."""
    reached = [c for c in cells if c.reached]
    if not reached:
        return FastestVerdict("not_resolved", 0, "no cell reached the target")
    leader = min(reached, key=lambda c: c.seconds)
    name = f"{leader.optimizer} at batch {leader.batch_size}"
    versus = [(c, time_verdict(leader, c, settings, step_times)) for c in cells
              if c is not leader]
    ties = [(c, v) for c, v in versus if v.outcome != "a"]
    tie_names = tuple(f"{c.optimizer} at batch {c.batch_size}" for c, _ in ties)
    paired = min((v.seeds for _, v in versus), default=settings.seeds)
    shown = ", ".join(tie_names[:6]) + (
        f" and {len(tie_names) - 6} more" if len(tie_names) > 6 else "")
    time = f"{leader.time_to_target:.3g} s"
    if not ties:
        outcome = "a"
        # the closest competitor: the largest leader/other ratio
        closest = max((v for _, v in versus), key=lambda v: v.estimate, default=None)
        figures = "" if closest is None else (
            f"; vs the next: A/B {span_text(closest)} ({paired} seeds, "
            f"{closest.level:.1%} interval)")
        text = f"fastest: {name}, {time} to target, faster than every other cell{figures}"
    elif all(v.outcome == "equivalent" for _, v in ties):
        outcome = "equivalent"
        text = (f"fastest: {name}, {time} to target, equivalent within "
                f"{settings.margin:.0%} to {shown} ({paired} seeds)")
    else:
        outcome = "not_resolved"
        text = f"fastest: {not_resolved(paired)}: {name} ({time}) not shown faster than {shown}"
    return FastestVerdict(outcome, paired, text, _key(leader), tie_names)


def _key(cell: Cell) -> tuple[str, int]:
    return cell.optimizer, cell.size


def time_verdict(a: Cell, b: Cell, settings: VerdictSettings,
                 step_times: StepTimes | None) -> Verdict:
    """Three-way on time to target: paired seeds' steps ratio times the paired rounds' step-time
    ratio (or, without timings, the cells' median seconds per step as a known factor)."""
    rounds = step_time_log_ratios(step_times, _key(a), _key(b))
    scale = 1.0
    if rounds is None and a.reached and b.reached and a.steps_to_target \
            and b.steps_to_target:
        scale = (a.seconds / a.steps) / (b.seconds / b.steps)
    verdict = ratio_verdict(a.seed_steps or {}, b.seed_steps or {},
                            level=settings.levels, margin=settings.margin,
                            floor_sd=rounding_sd([a, b]), round_log_ratios=rounds, scale=scale,
                            bounds=(budget_steps(a), budget_steps(b)))
    return verdict.between(_key(a), _key(b))


class _OfVerdict:
    """A finding whose outcome, resolution and seeds are those of its paired ``verdict``."""

    verdict: Verdict

    @property
    def outcome(self) -> str:
        return self.verdict.outcome

    @property
    def resolved(self) -> bool:
        return self.verdict.resolved

    @property
    def seeds(self) -> int:
        return self.verdict.seeds


@dataclass(frozen=True)
class BatchVerdict(_OfVerdict):
    """One batch size of an optimizer comparison: the time verdict (A = the challenger), the
    optimizer it finds faster (None: neither) and each optimizer's time to target as text."""

    batch_size: int
    faster: str | None
    verdict: Verdict
    times: dict[str, str]

    def to_json(self) -> JsonObject:
        return {"batch_size": self.batch_size, "faster": self.faster, "outcome": self.outcome,
                "resolved": self.resolved, "seeds": self.seeds,
                "verdict": self.verdict.to_json(), **self.times}


@dataclass(frozen=True)
class OptimizerComparison:
    """``challenger`` against ``incumbent`` per batch size (``per_batch``), the crossover batch
    size from which the challenger is faster (``batch_size``; None: none shown) and the
    report's sentence."""

    challenger: str
    incumbent: str
    per_batch: tuple[BatchVerdict, ...]
    batch_size: int | None
    text: str

    @property
    def resolved(self) -> bool:
        """Every batch size's verdict is answered (and there is at least one)."""
        return bool(self.per_batch) and all(p.resolved for p in self.per_batch)

    def to_json(self) -> JsonObject:
        return {"challenger": self.challenger, "incumbent": self.incumbent,
                "per_batch": [p.to_json() for p in self.per_batch],
                "batch_size": self.batch_size, "resolved": self.resolved, "text": self.text}


def optimizer_comparison(cells: list[Cell], challenger: str, incumbent: str,
                         settings: VerdictSettings,
                         step_times: StepTimes | None = None) -> OptimizerComparison | None:
    """Per batch size, a three-way verdict on time to target (challenger = A, incumbent = B),
    and the crossover batch size where the resolved verdicts show one."""
    a = {c.size: c for c in cells if c.optimizer == challenger}
    b = {c.size: c for c in cells if c.optimizer == incumbent}
    if not a or not b:
        return None
    per_batch = []
    for size in sorted(set(a) & set(b)):
        verdict = time_verdict(a[size], b[size], settings, step_times)
        per_batch.append(BatchVerdict(
            size, {"a": challenger, "b": incumbent}.get(verdict.outcome), verdict,
            {challenger: _time_span(a[size]), incumbent: _time_span(b[size])}))
    outcomes = [p.outcome for p in per_batch]
    # A crossover: from some batch size up the challenger is faster at every size, and below it
    # every verdict is resolved the other way or equivalent.
    split, crossover = len(outcomes), None
    while split > 0 and outcomes[split - 1] == "a":
        split -= 1
    if 0 < split < len(outcomes) and all(o in ("b", "equivalent") for o in outcomes[:split]):
        crossover = per_batch[split].batch_size
    groups: dict[str, list[str]] = {}
    for p in per_batch:
        label = {"a": f"{challenger} faster", "b": f"{incumbent} faster",
                 "equivalent": f"equivalent within {settings.margin:.0%}"}.get(
            p.outcome, f"not resolved after {p.verdict.seeds} seeds")
        bound = open_bound(p.verdict)
        groups.setdefault(label, []).append(f"{p.batch_size}" + (f" ({bound})" if bound else ""))
    text = "; ".join(f"{label} at batch {', '.join(sizes)}"
                     for label, sizes in groups.items()) or "no common batch size"
    if crossover is not None:
        text += f" (crossover: {challenger} from batch {crossover} up)"
    return OptimizerComparison(challenger, incumbent, tuple(per_batch), crossover, text)


@dataclass(frozen=True)
class RegionVerdict(_OfVerdict):
    """One scaling step between neighbouring reached batch sizes: the steps verdict (A = the
    smaller batch), the median exponent and its range over that paired interval, its region
    and whether the whole range is one region (``region_resolved``)."""

    from_batch: int
    to_batch: int
    exponent: float
    exponent_low: float
    exponent_high: float
    region: str
    region_resolved: bool
    verdict: Verdict

    def to_json(self) -> JsonObject:
        return {"from": self.from_batch, "to": self.to_batch, "exponent": self.exponent,
                "exponent_low": self.exponent_low, "exponent_high": self.exponent_high,
                "region": self.region, "region_resolved": self.region_resolved,
                "resolved": self.resolved, "outcome": self.outcome, "seeds": self.seeds,
                "verdict": self.verdict.to_json()}


def region_verdicts(group: list[Cell], settings: VerdictSettings) -> list[RegionVerdict]:
    """Each segment between neighbouring reached batch sizes B1 < B2: a three-way verdict on
    steps to target (A = B1, B = B2: ``b`` = the larger batch needs fewer steps, ``equivalent``
    = the same within the margin) and the range of its scaling exponent over that paired
    interval; the region is resolved (``region_resolved``) when the whole range is one region."""
    segments = []
    reached = [c for c in group if c.reached]
    for c1, c2 in itertools.pairwise(reached):
        span = math.log(c2.size / c1.size)
        exponent = math.log(c1.steps / c2.steps) / span
        verdict = ratio_verdict(c1.seed_steps or {}, c2.seed_steps or {},
                                level=settings.levels, margin=settings.margin,
                                floor_sd=rounding_sd([c1, c2])).between(_key(c1), _key(c2))
        low = high = math.nan
        if verdict.seeds >= 2 and verdict.low > 0 and math.isfinite(verdict.high):
            # steps ratio B1/B2 = A/B: the exponent grows with it
            low, high = math.log(verdict.low) / span, math.log(verdict.high) / span
        region_resolved = math.isfinite(low) and region_of(low) == region_of(high)
        segments.append(RegionVerdict(c1.size, c2.size, exponent, low, high,
                                      region_of(exponent), region_resolved, verdict))
    return segments


@dataclass(frozen=True)
class CriticalBatch:
    """B_crit fitted to each seed's steps-to-target curve: the median over ``n`` seed fits with
    its order-statistic interval [``low``, ``high``] and that interval's ``coverage``
    (``stats.median_interval``); ``seeds_without_knee``: seeds whose curve has no finite knee."""

    median: float
    low: float
    high: float
    n: int
    coverage: float
    seeds_without_knee: int

    def span(self) -> str:
        """``median [low, high]`` of the fits ("-" without any)."""
        return _median_span(self.median, self.low, self.high, self.n, ".0f") if self.n else "-"

    def to_json(self) -> JsonObject:
        return {"median": self.median, "low": self.low, "high": self.high, "n": self.n,
                "coverage": self.coverage, "seeds_without_knee": self.seeds_without_knee}


def critical_batch_over_seeds(group: list[Cell]) -> CriticalBatch:
    """B_crit fitted to each seed's steps-to-target curve (the seeds are independent replicas of
    the whole curve), as a median with its order-statistic interval; seeds whose curve has no
    finite knee are counted apart."""
    seeds = sorted({s for c in group for s in (c.seed_steps or {})}, key=int)
    values, missing = [], 0
    for seed in seeds:
        points = [(c.size, c.seed_steps[seed]) for c in group
                  if math.isfinite(c.seed_steps.get(seed, math.inf))]
        knee = fit_critical_batch(points)
        if knee.b_crit:
            values.append(knee.b_crit)
        else:
            missing += 1
    return CriticalBatch(**median_interval(values), seeds_without_knee=missing)


@dataclass(frozen=True)
class NoiseAgreement:
    """Whether the measured critical batch size lies within 2x of B_simple (``agree``; None
    where the intervals do not settle it or nothing was measured), and the report's
    sentence."""

    resolved: bool
    text: str
    agree: bool | None = None

    def to_json(self) -> JsonObject:
        agree = {} if self.agree is None else {"agree": self.agree}
        return {"resolved": self.resolved, **agree, "text": self.text}


def noise_agreement(b_crit: CriticalBatch, b_simple: float | None,
                    seeds: int) -> NoiseAgreement:
    """Does the gradient-noise estimate predict the measured critical batch size within 2x?"""
    if b_simple is None:
        return NoiseAgreement(False, "B_simple not estimated: nothing to compare")
    if not b_crit.n:
        return NoiseAgreement(False, "no seed's steps curve has a knee inside the grid")
    low, high = b_simple / 2, b_simple * 2
    interval = f"B_crit {b_crit.span()} over {b_crit.n} seed fits"
    if b_crit.n >= 2 and b_crit.seeds_without_knee == 0:
        if low <= b_crit.low and b_crit.high <= high:
            return NoiseAgreement(True, f"{interval} lies within 2x of B_simple {b_simple:.0f}",
                                  agree=True)
        if b_crit.high < low or b_crit.low > high:
            return NoiseAgreement(True, f"{interval} lies outside 2x of B_simple {b_simple:.0f}",
                                  agree=False)
    return NoiseAgreement(False, f"{interval} vs B_simple {b_simple:.0f}: {not_resolved(seeds)}")


def seed_test_values(cell: Cell) -> tuple[dict[str, float], str]:
    """A cell's per-seed test metric and where it comes from: the frontier's (the checkpoint of
    the best validation value within the equal budget) when measured, else the runs' at the
    target."""
    if cell.frontier is not None and cell.frontier.seed_test:
        return cell.frontier.seed_test, "frontier"
    return cell.seed_test or {}, "target"


def test_metric_verdict(a: Cell, b: Cell, settings: VerdictSettings,
                        metric: str) -> Verdict:
    """Three-way on the test metric (A better = A's value better by ``metric_direction``): a
    difference with the accuracy margin for metrics where larger is better (accuracies, within
    [0, 1]), a ratio with the relative margin for errors and losses."""
    values_a, source = seed_test_values(a)
    values_b, _ = seed_test_values(b)
    if metric_direction(metric) == "max":
        verdict = difference_verdict(values_a, values_b, level=settings.levels,
                                     margin=settings.accuracy_margin, larger_is_better=True)
    else:
        verdict = ratio_verdict(values_a, values_b, level=settings.levels,
                                margin=settings.margin)
    return replace(verdict, cells=(_key(a), _key(b)), source=source, metric=metric)


@dataclass(frozen=True)
class GeneralizationVerdict(Resolvable):
    """The test metric at the smallest (A) against the largest batch size (B): its verdict
    (None where fewer than two batch sizes have test figures), whether the larger batch
    generalizes ``lower``, ``higher`` or ``equivalent`` (None: not resolved) and the report's
    sentence."""

    outcome: str
    seeds: int
    text: str
    larger_batch: str | None = None
    verdict: Verdict | None = None

    def to_json(self) -> JsonObject:
        measured = {} if self.verdict is None else {"larger_batch": self.larger_batch,
                                                    "verdict": self.verdict.to_json()}
        return {"resolved": self.resolved, "outcome": self.outcome, "seeds": self.seeds,
                **measured, "text": self.text}


def generalization_verdict(group: list[Cell],
                           settings: VerdictSettings) -> GeneralizationVerdict:
    """The test metric at the smallest against the largest batch size (A = smallest): of the
    checkpoint with the best validation value within the frontier's equal budget where it was
    measured, else of the runs stopped at the target (both batch sizes must have reached it)."""
    measured = [c for c in group if c.frontier is not None and c.frontier.seed_test]
    candidates = measured if len(measured) >= 2 else \
        [c for c in group if c.reached and c.seed_test]
    if len(candidates) < 2:
        return GeneralizationVerdict("not_resolved", 0,
                                     "fewer than two batch sizes with test figures")
    small, big = candidates[0], candidates[-1]
    metric = small.test_metric_name or "test_accuracy"
    verdict = test_metric_verdict(small, big, settings, metric)
    where = ("at the best validation checkpoint within the equal budget"
             if verdict.source == "frontier" else "of the runs stopped at the target")
    text = (f"{metric} {where}, batch {small.batch_size} (A) vs {big.batch_size} (B): "
            + outcome_text(verdict, f"batch {small.batch_size}", f"batch {big.batch_size}",
                           "generalizes better"))
    larger = {"a": "lower", "b": "higher", "equivalent": "equivalent"}.get(verdict.outcome)
    return GeneralizationVerdict(verdict.outcome, verdict.seeds, text, larger, verdict)


def measured_throughput(step_times: StepTimes | None) -> list[ThroughputPoint]:
    """Samples/s per batch size from the time model's interleaved step timings, pooled over the
    optimizers of that batch size: the median with its order-statistic interval."""
    by_batch: dict[int, list[float]] = {}
    for cell in step_times.cells if step_times else ():
        by_batch.setdefault(cell.batch_size, []).extend(
            cell.batch_size / s for s in cell.seconds if s > 0)
    curve = []
    for size, values in sorted(by_batch.items()):
        interval = median_interval(values)
        curve.append(ThroughputPoint(size, interval["median"], low=interval["low"],
                                     high=interval["high"], n=interval["n"],
                                     coverage=interval["coverage"]))
    return curve


@dataclass(frozen=True)
class DoublingGain:
    """The gain in samples/s from batch ``from_batch`` to ``to_batch`` per doubling (``gain``,
    0.1 = 10%) with its interval [``low``, ``high``] over ``timings`` paired timings."""

    from_batch: int
    to_batch: int
    timings: int
    gain: float
    low: float
    high: float

    def to_json(self) -> JsonObject:
        return {"from": self.from_batch, "to": self.to_batch, "timings": self.timings,
                "gain": self.gain, "low": self.low, "high": self.high}


def doubling_gains(step_times: StepTimes | None, level: float) -> list[DoublingGain]:
    """Per neighbouring pair of timed batch sizes, the interval of samples/s at the larger over
    the smaller, per doubling: per-round log ratios (rounds pair) of every optimizer timed at
    both, pooled, Yuen's trimmed interval at ``level`` (``verdicts.trimmed_interval``)."""
    cells = step_times.cells if step_times else ()
    sizes = sorted({c.batch_size for c in cells})
    optimizers = sorted({c.optimizer for c in cells})
    gains = []
    for b1, b2 in itertools.pairwise(sizes):
        per_doubling = 1.0 / math.log2(b2 / b1)
        logs = []
        for optimizer in optimizers:
            # seconds per sample at b1 over b2 = samples/s at b2 over b1
            ratios = step_time_log_ratios(step_times, (optimizer, b1), (optimizer, b2))
            logs += [(r + math.log(b2 / b1)) * per_doubling for r in ratios or []]
        estimate, low, high = trimmed_interval(logs, level)
        gains.append(DoublingGain(b1, b2, len(logs), math.exp(estimate) - 1,
                                  math.exp(low) - 1, math.exp(high) - 1))
    return gains


@dataclass(frozen=True)
class KneeVerdict:
    """The throughput knee (``batch_size``; ``plateau_reached``: the curve flattens inside the
    grid) with every doubling's gain (``gains``; None where not measured), whether those
    intervals settle it (``resolved``), the three-way ``outcome`` at the knee's doubling and
    the report's sentence. Read over timed rounds, not seeds (its record's ``seeds``: null)."""

    resolved: bool
    outcome: str
    batch_size: int | None
    timings: int
    text: str
    plateau_reached: bool | None = None
    gains: tuple[DoublingGain, ...] | None = None

    def to_json(self) -> JsonObject:
        record = {"resolved": self.resolved, "outcome": self.outcome,
                  "batch_size": self.batch_size, "plateau_reached": self.plateau_reached,
                  "seeds": None, "timings": self.timings,
                  "gains": [gain.to_json() for gain in self.gains or ()], "text": self.text}
        if self.gains is None:  # not measured
            del record["plateau_reached"], record["gains"]
        return record


def throughput_knee_verdict(step_times: StepTimes | None,
                            settings: VerdictSettings | None = None) -> KneeVerdict:
    """The throughput knee (``kbackend.hardware.knee``'s definition: the first batch size whose
    next doubling gains less than 10% samples/s) with paired-round intervals of every gain:
    resolved when each gain before the knee is above 10% and the knee's own below, over their
    whole intervals. ``outcome`` is the three-way verdict at the knee's doubling (A = the knee,
    B = twice it, margin: the knee's 10%): ``equivalent`` where the doubling is flat, ``b``
    where every doubling gains (no plateau in the grid)."""
    curve = measured_throughput(step_times)
    timings = min((p.n or 0 for p in curve), default=0)
    if len(curve) < 2:
        return KneeVerdict(False, "not_resolved", None, timings,
                           "not measured: needs step timings at two or more batch sizes")
    knee = throughput_knee(curve)
    level = VERDICT_CONFIDENCE if settings is None else settings.level
    gains = doubling_gains(step_times, level)
    threshold = knee.min_gain
    resolved, outcome = True, "b"
    for index, gain in enumerate(gains):
        if index > knee.index:
            break
        if index == knee.index and knee.plateau_reached:  # at the knee
            edge = math.log1p(threshold)
            low, high = math.log1p(max(gain.low, -0.999999)), math.log1p(gain.high)
            outcome = decide(low, high, edge, a_is_better_below=True)
            resolved = resolved and gain.high < threshold
        elif gain.low < threshold:
            resolved = False
    if not resolved:
        outcome = "not_resolved"
    where = (f"batch {knee.batch_size}" if knee.plateau_reached else
             f"no plateau up to batch {knee.batch_size}")
    figures = "; ".join(f"{g.from_batch}->{g.to_batch}: {g.gain:+.0%} [{g.low:+.0%}, "
                        f"{g.high:+.0%}]" for g in gains)
    text = (f"throughput knee (next doubling gains < {threshold:.0%}): {where} "
            f"({level:.1%} intervals over {timings} paired timings per batch size; gains per "
            f"doubling {figures})" if resolved else
            f"throughput knee: not resolved after {timings} timings per batch size (median "
            f"curve: {where}; gains per doubling {figures})")
    return KneeVerdict(resolved, outcome, knee.batch_size, timings, text, knee.plateau_reached,
                       tuple(gains))


@dataclass(frozen=True)
class StepTimeSpread:
    """How much the measured step times moved: the median and worst cell's slowest / fastest
    round, and the neighbouring batch sizes whose samples/s overlap (they cannot be ranked)."""

    median_ratio: float | None
    worst: str | None
    worst_ratio: float | None
    unranked_neighbours: tuple[str, ...]

    def to_json(self) -> JsonObject:
        return {"median_ratio": self.median_ratio, "worst": self.worst,
                "worst_ratio": self.worst_ratio,
                "unranked_neighbours": list(self.unranked_neighbours)}


def step_time_spread(step_times: StepTimes | None) -> StepTimeSpread | None:
    """How much the measured step times moved: max/min per cell, and the neighbouring batch
    sizes (same optimizer) whose samples/s intervals overlap, which cannot be ranked."""
    cells = step_times.cells if step_times else ()
    if not cells:
        return None
    ratios = {f"{c.optimizer} B={c.batch_size}": max(c.seconds) / min(c.seconds)
              for c in cells if c.seconds and min(c.seconds) > 0}
    overlaps = []
    for optimizer, group in by_optimizer(cells).items():
        for c1, c2 in itertools.pairwise(group):
            t1 = [c1.batch_size / s for s in c1.seconds]
            t2 = [c2.batch_size / s for s in c2.seconds]
            if min(t2) <= max(t1) and min(t1) <= max(t2):
                overlaps.append(f"{optimizer} {c1.batch_size}/{c2.batch_size}")
    values = sorted(ratios.values())
    worst = max(ratios, key=lambda name: ratios[name]) if ratios else None
    return StepTimeSpread(statistics.median(values) if values else None, worst,
                          ratios.get(worst) if worst else None, tuple(overlaps))
