"""Three-way verdicts on paired seeds: A better, B better, equivalent within a margin, or not
resolved, each from one interval whose coverage is stated and checked by simulation
(tests/test_study_verdicts.py).

Why this interval. The seeds of two cells pair: seed s starts every cell from the same initial
weights and shuffles with the same permutation, so a comparison looks at the per-seed ratio
A_s / B_s (times, steps) or difference A_s - B_s (accuracies). With 3 to 20 seeds an
order-statistic interval on their median can reach at most 1 - 2 x 0.5^n coverage (75% at 3
seeds), too little to spend over several looks; the t-interval on the mean of the per-seed log
ratios (or differences) is exact when those are normal (a log-normal seed-to-seed spread, as
steps to target show), reaches any level at any n >= 2, and its coverage under skewed spreads
is checked by simulation.

Times add the step time: time = steps x seconds per step, measured apart in R interleaved
rounds. Rounds pair like seeds (two cells timed moments apart share the machine's load), so the
log time ratio is the mean log steps ratio plus the per-round log step-time ratio's 20%-trimmed
mean, and its standard error adds both (Welch-Satterthwaite degrees of freedom). Why trimmed: on
a shared machine one round in five or ten catches a burst of load on one cell and moves its
log ratio by 1-2.7 (measured, default study at load 6-14, against a spread of 0.06-0.15 in the
other rounds); the mean and its standard deviation followed that round and widened 13 of the 16
per-batch optimizer intervals to 4-17x. The trimmed mean drops the g = floor(0.2 R) highest and
lowest rounds, and its standard error is Tukey and McLaughlin's (the winsorized variance, R-2g-1
degrees of freedom: Yuen's interval), whose coverage holds under such outliers
(tests/test_study_verdicts.py). What it estimates is the ratio on the machine between bursts.

Steps to target are known only to one evaluation interval e (the run crosses the target
somewhere in the e steps before the evaluation that sees it), so the per-seed spread of a
log steps ratio is floored at that rounding's own spread, sqrt((e_A/S_A)^2 + (e_B/S_B)^2) /
sqrt(12): seeds that all stop at the same evaluation do not make a zero-width interval.

Sequential seeds (``seed_schedule``): a comparison is looked at after each round of added seeds,
L looks at most. The error alpha is spent over the looks (``LookLevels``): look k's interval has
level 1 - alpha_k, with alpha_k in fixed shares (``FIRST_LOOK_SHARE`` at the first look, the rest
equal) scaled so that the chance that *any* look's interval misses the truth is at most alpha,
whatever rule stops the rounds (exactly so for looks at the scheduled seed counts; a round cut
short by the budget reads fewer seeds at its look's level, simulated at 6.6-8.6%): a verdict is
wrong only when the interval it was read from misses. The
looks read nested seeds, so their misses overlap; summing the alpha_k (Bonferroni) ignores that
and spends less than alpha (7.8% of 10% at 3, 5, 8, 10 seeds). The scale is found by simulation
(``joint_miss``): under normal per-seed log ratios each look's t-statistic at the truth is pivotal
(its law depends on neither the true ratio nor the spread), so one fixed draw of standard normal
seeds calibrates every comparison (Pocock's idea, with t-intervals and unequal shares). Why the
first look gets half: under the seed budget most comparisons never get a second look, so their
verdict is read at the first; equal shares answered 2 of the default study's 16 per-batch
optimizer comparisons where one 90% look answered 10. Why calibrate: the default study's open
comparisons sit at ratios of 1.0-1.1x with seeds spreading 15-25%, which 10 seeds cannot resolve
within 1.2x; overlapping looks cost little, so the default takes up to 20 seeds in 6 looks at
about the levels Bonferroni gave 4 (93.4% at the first look against 95%, 98.7% at the later ones
against 98.3%; simulated in tests/test_study_verdicts.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the results' types import the store (SQLite): not at the train command's
    from kbackend.io import JsonObject
    from kbackend.study.study_record import Cell, StepTimes  # set-up (test_startup)

# The chance that a comparison's final verdict is wrong, over all its looks, is at most 1 - this.
VERDICT_CONFIDENCE = 0.9
# The share of that error the first look spends (the rest is split equally over the later looks).
FIRST_LOOK_SHARE = 0.5
# Times, steps and non-accuracy metrics: a ratio within 1.2x is "equivalent". Why 1.2x: a 20%
# difference in training time is within what the same run moves by on a shared machine (docs:
# timing noise), and it does not change which setting a user should pick.
DEFAULT_MARGIN = 0.20
DEFAULT_ACCURACY_MARGIN = 0.01  # accuracies: a difference within one percentage point
DEFAULT_MAX_SEEDS = 20
OUTCOMES = ("a", "b", "equivalent", "not_resolved")


def seed_schedule(seeds: int, max_seeds: int) -> list[int]:
    """The seed counts at which verdicts are read: ``seeds``, then each round adds half as many
    again (at least one) up to ``max_seeds`` (3, 5, 8, 12, 18, 20 by default). Fewer looks than
    one per seed keep each look's level from narrowing with every added seed."""
    counts = [seeds]
    while counts[-1] < max_seeds:
        counts.append(min(max_seeds, counts[-1] + max(1, math.ceil(counts[-1] / 2))))
    return counts


@dataclass(frozen=True)
class LookLevels:
    """Each look's interval level (``schedule[k]`` seeds: ``levels[k]``): alpha spent in fixed
    shares (``FIRST_LOOK_SHARE`` at the first look, the rest equally over the others), scaled so
    that all looks together miss with probability 1 - ``confidence`` (``joint_miss``)."""

    schedule: tuple[int, ...]
    levels: tuple[float, ...]

    @classmethod
    def of(cls, seeds: int, max_seeds: int,
           confidence: float = VERDICT_CONFIDENCE) -> LookLevels:
        schedule = tuple(seed_schedule(seeds, max_seeds))
        alpha = 1.0 - confidence
        if len(schedule) == 1:
            return cls(schedule, (confidence,))
        rest = (1.0 - FIRST_LOOK_SHARE) / (len(schedule) - 1)
        shares = (FIRST_LOOK_SHARE, *([rest] * (len(schedule) - 1)))
        scale = _spending_scale(schedule, shares, alpha)
        return cls(schedule, tuple(1.0 - alpha * scale * share for share in shares))

    def at(self, seeds: int) -> float:
        """The level of a verdict read on ``seeds`` paired seeds: the first look with at least
        that many (a round cut short by the budget belongs to the look it was heading for)."""
        index = next((k for k, count in enumerate(self.schedule) if count >= seeds),
                     len(self.schedule) - 1)
        return self.levels[index]

    @property
    def final(self) -> float:
        """The last look's level (what ``could_resolve`` asks of ``max_seeds`` seeds)."""
        return self.levels[-1]


# The standard normal studies ``joint_miss`` calibrates the looks on: 200,000 estimate a joint
# miss near 10% to +-0.067 points (one standard error); the levels aim two of those below alpha
CALIBRATION_STUDIES = 200_000
_DRAWS_PER_CHUNK = 2_000_000  # seeds drawn at a time (16 MB, whatever --max-seeds is)


def _normal_t_statistics(schedule: tuple[int, ...]) -> np.ndarray:
    """|t| at the truth of each look of ``schedule``, for ``CALIBRATION_STUDIES`` studies of
    standard normal seeds (one fixed draw: every study calibrates alike). A look on one seed
    has no interval, so it never misses (0)."""
    rng, chunks, done = np.random.default_rng(0), [], 0
    rows = max(1, _DRAWS_PER_CHUNK // schedule[-1])
    while done < CALIBRATION_STUDIES:
        draws = rng.standard_normal((min(rows, CALIBRATION_STUDIES - done), schedule[-1]))
        looks = []
        for n in schedule:
            seeds = draws[:, :n]
            if n < 2:
                looks.append(np.zeros(len(draws)))
                continue
            looks.append(np.abs(seeds.mean(axis=1)) / (seeds.std(axis=1, ddof=1) / math.sqrt(n)))
        chunks.append(np.stack(looks, axis=1))
        done += len(draws)
    return np.concatenate(chunks)


def _share_missed(statistics: np.ndarray, schedule: Sequence[int],
                  levels: Sequence[float]) -> float:
    """The share of the simulated studies (``statistics``) in which some look's t-interval at
    its level misses the truth."""
    critical = np.array([t_quantile(0.5 + level / 2, n - 1)
                         for level, n in zip(levels, schedule, strict=True)])
    return float(np.mean(np.any(statistics > critical, axis=1)))


def joint_miss(schedule: Sequence[int], levels: Sequence[float]) -> float:
    """The chance that any look's t-interval (``schedule[k]`` seeds at ``levels[k]``) misses the
    truth, for normal per-seed values (simulated on a fixed draw)."""
    return _share_missed(_normal_t_statistics(tuple(schedule)), schedule, levels)


@cache
def _spending_scale(schedule: tuple[int, ...], shares: tuple[float, ...], alpha: float) -> float:
    """The largest factor s >= 1 (to 0.1%) whose levels 1 - alpha x s x share miss jointly
    with probability at most ``alpha`` less two of the simulation's standard errors (so the
    bound holds beyond its noise): 1 is Bonferroni, which always holds. The draw is made once
    per call and freed after (only the scale is kept)."""
    aim = alpha - 2.0 * math.sqrt(alpha * (1.0 - alpha) / CALIBRATION_STUDIES)
    statistics = _normal_t_statistics(schedule)

    def misses(scale: float) -> float:
        return _share_missed(statistics, schedule,
                             [1.0 - alpha * scale * share for share in shares])

    low, high = 1.0, 1.0 / (alpha * max(shares))  # at ``high`` some look's level is 0
    while high - low > 1e-3:
        middle = (low + high) / 2
        low, high = (middle, high) if misses(middle) <= aim else (low, middle)
    return low


@dataclass(frozen=True)
class VerdictSettings:
    """The seeds, margins and per-look interval levels a study's verdicts are read with
    (``cell_verdicts.verdict_settings``: from a study's config)."""

    seeds: int
    max_seeds: int
    levels: LookLevels
    margin: float
    accuracy_margin: float

    @property
    def looks(self) -> int:
        """How many times a comparison may be looked at (``seed_schedule``'s rounds)."""
        return len(self.levels.schedule)

    @property
    def level(self) -> float:
        """The last look's interval level."""
        return self.levels.final


Level = float | LookLevels


def t_quantile(probability: float, df: float) -> float:
    """Student's t quantile (SciPy, a dependency of scikit-learn, imported when first needed)."""
    # deferred: only the analysis needs it; SciPy ships no type stubs
    from scipy.stats import t  # type: ignore[import-untyped]

    return float(t.ppf(probability, df))


ROUND_TRIM = 0.2  # the share of rounds dropped at each end of the step-time ratios


def trimmed_mean(values: Sequence[float], trim: float = ROUND_TRIM) -> tuple[float, float, int]:
    """(mean, variance of that mean, degrees of freedom) of ``values``' ``trim``-trimmed mean:
    g = floor(trim x n) values dropped at each end, the variance from the winsorized sample
    (Tukey-McLaughlin: (n-1) s_w^2 / (h (h-1)), h = n - 2g values kept), h - 1 degrees of
    freedom. No trimming below five values (g = 0: the plain mean)."""
    x = np.sort(np.asarray(values, dtype=float))
    n = x.size
    if n == 0:
        return math.nan, 0.0, 0
    g = math.floor(trim * n)
    kept = n - 2 * g
    mean = float(x[g:n - g].mean())
    if kept < 2:
        return mean, 0.0, 0
    winsorized = np.clip(x, x[g], x[n - g - 1])
    variance = (n - 1) * float(winsorized.var(ddof=1)) / (kept * (kept - 1))
    return mean, variance, kept - 1


def trimmed_interval(values: Sequence[float], level: float) -> tuple[float, float, float]:
    """(estimate, low, high): Yuen's t-interval at ``level`` of ``values``' trimmed mean
    (``trimmed_mean``): step-time rounds, whose bursts of load it leaves out."""
    estimate, variance, df = trimmed_mean(values)
    if df < 1:
        return estimate, -math.inf, math.inf
    half = t_quantile(0.5 + level / 2, df) * math.sqrt(variance)
    return estimate, estimate - half, estimate + half


def mean_interval(values: Sequence[float], level: float, floor_sd: float = 0.0,
                  rounds: Sequence[float] | None = None) -> tuple[float, float, float]:
    """(estimate, low, high): the t-interval at ``level`` of the mean of ``values`` (plus the
    trimmed mean of ``rounds`` when given, an independent second sample whose standard error
    adds: ``trimmed_mean``). The sample's spread is taken as at least ``floor_sd``. Fewer than
    two values: an unbounded interval around the estimate."""
    x = np.asarray(values, dtype=float)
    n = x.size
    if n == 0:
        return math.nan, -math.inf, math.inf
    estimate = float(x.mean())
    if n < 2:
        return estimate, -math.inf, math.inf
    var_x = max(float(x.var(ddof=1)), floor_sd ** 2) / n
    variance, df = var_x, float(n - 1)
    if rounds is not None and len(rounds) > 0:
        round_mean, var_r, round_df = trimmed_mean(rounds)
        estimate += round_mean
        variance = var_x + var_r
        if var_r > 0:  # Welch-Satterthwaite
            df = variance ** 2 / (var_x ** 2 / (n - 1) + var_r ** 2 / round_df)
    if variance == 0:
        return estimate, estimate, estimate
    half = t_quantile(0.5 + level / 2, df) * math.sqrt(variance)
    return estimate, estimate - half, estimate + half


def decide(low: float, high: float, margin: float, a_is_better_below: bool) -> str:
    """The outcome of an interval [low, high] of a difference (0: equal; a log ratio is one):
    ``"equivalent"`` when it lies inside [-margin, margin] (a difference smaller than what
    matters, even where it excludes 0), ``"a"``/``"b"`` when it lies wholly on one side of 0
    (``a_is_better_below``: a negative difference favours A), else ``"not_resolved"``."""
    if math.isnan(low) or math.isnan(high):
        return "not_resolved"
    if -margin <= low and high <= margin:
        return "equivalent"
    if high < 0:
        return "a" if a_is_better_below else "b"
    if low > 0:
        return "b" if a_is_better_below else "a"
    return "not_resolved"


class Resolvable:
    """A finding with a three-way ``outcome`` (one of ``OUTCOMES``)."""

    outcome: str

    @property
    def resolved(self) -> bool:
        """Whether it is answered: A better, B better or equivalent."""
        return self.outcome != "not_resolved"


@dataclass(frozen=True)
class Verdict(Resolvable):
    """One three-way verdict on paired seeds: the interval [``low``, ``high``] around
    ``estimate`` of the ratio A/B (``kind`` "ratio": times, steps) or the difference A - B
    ("difference": accuracies) over ``seeds`` paired seeds at ``level``, and its ``outcome``
    (one of ``OUTCOMES``) against ``margin``. ``censored``: a seed that never reached. ``sd``:
    the per-seed spread and ``round_variance`` the step-time rounds' share of the variance
    (None where no interval was computed), what ``could_resolve`` extrapolates. ``cells``: the
    (optimizer, batch size) pairs compared; ``source`` and ``metric``: a test-metric verdict's.
    ``look``: the seeds of the earlier look that answered it (``at_first_look``), else None."""

    kind: str
    seeds: int
    level: float
    margin: float
    censored: bool
    estimate: float
    low: float
    high: float
    outcome: str
    sd: float | None = None
    round_variance: float | None = None
    cells: tuple[tuple[str, int | str], ...] = ()
    source: str | None = None
    metric: str | None = None
    look: int | None = None

    def between(self, *cells: tuple[str, int | str]) -> Verdict:
        """This verdict naming the cells it compares."""
        return replace(self, cells=tuple(cells))

    def to_json(self) -> JsonObject:
        """The verdict as the report's JSON record (fields without a value left out)."""
        optional = {"sd": self.sd, "round_variance": self.round_variance,
                    "cells": [list(cell) for cell in self.cells] or None,
                    "source": self.source, "metric": self.metric, "look": self.look}
        return {"kind": self.kind, "seeds": self.seeds, "level": self.level,
                "margin": self.margin, "censored": self.censored, "estimate": self.estimate,
                "low": self.low, "high": self.high, "outcome": self.outcome,
                "resolved": self.resolved,
                **{name: value for name, value in optional.items() if value is not None}}

    @classmethod
    def from_json(cls, record: JsonObject) -> Verdict:
        """The verdict a ``to_json`` record holds (a report section reading a stored record)."""
        return cls(record["kind"], record["seeds"], record["level"], record["margin"],
                   record["censored"], record["estimate"], record["low"], record["high"],
                   record["outcome"], record.get("sd"), record.get("round_variance"),
                   tuple((str(o), b) for o, b in record.get("cells") or ()),
                   record.get("source"), record.get("metric"), record.get("look"))


def _paired(a: dict[str, float], b: dict[str, float]) -> list[str]:
    return sorted(set(a) & set(b), key=lambda s: (len(s), s))


Seeds = dict[str, float]


def at_first_look(verdict_of: Callable[[Seeds, Seeds, float], Verdict], a: Seeds,
                  b: Seeds, level: Level) -> Verdict:
    """``verdict_of(a, b, level)`` on every seed the two share; where that is not resolved and
    ``level`` spreads the error over looks, the first earlier look that resolved it (look k:
    the first ``schedule[k]`` shared seeds, the seeds it had then, at ``levels[k]``), its
    ``look`` its seed count. As sure as the last look: each look's interval has its own share
    of the error, so all of them cover together with the stated confidence. Without it, seeds
    added for another comparison (a cell is in several) could re-open an answered one at a
    later look's stricter level."""
    seeds = _paired(a, b)
    if not isinstance(level, LookLevels):
        return verdict_of(a, b, float(level))
    final = verdict_of(a, b, level.at(len(seeds)))
    if final.resolved:
        return final
    # A later seed that never reached the target stays evidence: an earlier look may not say
    # that side is better, or equivalent (the censoring rule of the last look).
    forbidden = ({"a", "equivalent"} if any(math.isinf(a[s]) for s in seeds) else set()) | \
        ({"b", "equivalent"} if any(math.isinf(b[s]) for s in seeds) else set())
    for count, at_level in zip(level.schedule, level.levels, strict=True):
        if count >= len(seeds):
            break
        shared = seeds[:count]
        earlier = verdict_of({s: a[s] for s in shared}, {s: b[s] for s in shared}, at_level)
        if earlier.resolved and earlier.outcome not in forbidden:
            return replace(earlier, look=count, censored=earlier.censored or final.censored)
    return final


def ratio_verdict(a: Seeds, b: Seeds, *, level: Level, margin: float,
                  floor_sd: float = 0.0, round_log_ratios: Sequence[float] | None = None,
                  scale: float = 1.0, bounds: tuple[float | None, float | None] = (None, None),
                  ) -> Verdict:
    """Smaller is better (times, steps): the interval of the ratio A/B over the seeds both have
    (dicts seed -> value; infinite: never reached), at the first look that resolves it
    (``at_first_look``). ``round_log_ratios``: the per-round log ratios of a second factor
    (step times; rounds are not looks: every look reads all of them); ``scale``: a known factor
    of the ratio. A seed that never reached counts at a lower bound of its value: ``bounds``
    (A's, B's: the steps it ran), else its side's largest finite value, so the ratio is biased
    towards equal and only the verdict against that side stands."""
    return at_first_look(lambda x, y, at: _ratio_verdict(
        x, y, at, margin, floor_sd, round_log_ratios, scale, bounds), a, b, level)


def _ratio_verdict(a: Seeds, b: Seeds, at: float, margin: float, floor_sd: float,
                   round_log_ratios: Sequence[float] | None, scale: float,
                   bounds: tuple[float | None, float | None]) -> Verdict:
    seeds = _paired(a, b)
    pairs = [(a[s], b[s]) for s in seeds]
    censored_a = any(math.isinf(x) for x, _ in pairs)
    censored_b = any(math.isinf(y) for _, y in pairs)
    unresolved = Verdict("ratio", len(seeds), at, margin, censored_a or censored_b, math.nan,
                         math.nan, math.nan, "not_resolved")
    if (censored_a and censored_b) or not pairs:
        return unresolved
    cap_a = bounds[0] or max((x for x, _ in pairs if math.isfinite(x)), default=math.nan)
    cap_b = bounds[1] or max((y for _, y in pairs if math.isfinite(y)), default=math.nan)
    logs = [math.log((x if math.isfinite(x) else cap_a) / (y if math.isfinite(y) else cap_b))
            for x, y in pairs]
    if any(math.isnan(v) for v in logs):
        return unresolved
    estimate, low, high = mean_interval(logs, at, floor_sd, round_log_ratios)
    round_var = trimmed_mean(round_log_ratios)[1] if round_log_ratios else 0.0
    shift = math.log(scale)
    outcome = decide(low + shift, high + shift, math.log1p(margin), a_is_better_below=True)
    if (censored_a and outcome != "b") or (censored_b and outcome != "a"):
        outcome = "not_resolved"
    return replace(unresolved, estimate=math.exp(estimate + shift), low=math.exp(low + shift),
                   high=math.exp(high + shift), outcome=outcome, sd=_sd(logs, floor_sd),
                   round_variance=round_var)


def difference_verdict(a: Seeds, b: Seeds, *, level: Level, margin: float,
                       larger_is_better: bool) -> Verdict:
    """The interval of the difference A - B over the seeds both have (accuracies: ``margin`` in
    the metric's own units, 0.01 = one point), at the first look that resolves it."""
    finite_a = {s: v for s, v in a.items() if math.isfinite(v)}
    finite_b = {s: v for s, v in b.items() if math.isfinite(v)}
    return at_first_look(lambda x, y, at: _difference_verdict(x, y, at, margin, larger_is_better),
                         finite_a, finite_b, level)


def _difference_verdict(a: Seeds, b: Seeds, at: float, margin: float,
                        larger_is_better: bool) -> Verdict:
    seeds = _paired(a, b)
    diffs = [a[s] - b[s] for s in seeds]
    estimate, low, high = mean_interval(diffs, at)
    outcome = decide(low, high, margin, a_is_better_below=not larger_is_better) \
        if diffs else "not_resolved"
    return Verdict("difference", len(seeds), at, margin, False, estimate, low, high, outcome,
                   sd=_sd(diffs, 0.0))


def _sd(values: Sequence[float], floor_sd: float) -> float:
    return max(float(np.std(values, ddof=1)), floor_sd) if len(values) > 1 else math.inf


def could_resolve(verdict: Verdict, max_seeds: int, level: float) -> bool:
    """Whether more seeds could still settle an unresolved ``verdict`` by ``max_seeds``: with
    the estimate and spread it has now, the interval at ``max_seeds`` (its level ``level``)
    would exclude equality or fit inside the margin. Only the cost depends on this rule, not
    the verdicts' error (every look is counted in its level)."""
    if verdict.resolved or verdict.seeds >= max_seeds or verdict.censored:
        return False
    sd = math.inf if verdict.sd is None else verdict.sd
    if not math.isfinite(sd) or math.isnan(verdict.estimate):
        return verdict.seeds < 2  # one seed: no spread yet, a second one gives it
    # the step times' share of the variance does not shrink with seeds
    variance = sd ** 2 / max_seeds + (verdict.round_variance or 0.0)
    half = t_quantile(0.5 + level / 2, max_seeds - 1) * math.sqrt(variance)
    if verdict.kind == "ratio":
        centre, edge = abs(math.log(verdict.estimate)), math.log1p(verdict.margin)
    else:
        centre, edge = abs(verdict.estimate), verdict.margin
    return centre > half or centre + half < edge


def step_time_log_ratios(step_times: StepTimes | None, a: tuple[str, int],
                         b: tuple[str, int]) -> list[float] | None:
    """Per-round log ratios of two cells' measured seconds per step (rounds pair: they were
    timed moments apart); None when either cell was not timed."""
    timed = step_times.seconds() if step_times else {}
    if a not in timed or b not in timed:
        return None
    return [math.log(x / y) for x, y in zip(timed[a], timed[b], strict=False) if x > 0 and y > 0]


def budget_steps(cell: Cell) -> float | None:
    """The steps a cell's seeds that never reached the target ran (a lower bound of their
    steps to target), where the cell did not reach: its median steps run."""
    return None if cell.reached or not cell.steps_run else float(cell.steps_run)


def rounding_sd(cells: Sequence[Cell]) -> float:
    """The spread a log steps ratio gets from each cell's evaluation interval alone (a crossing
    anywhere in the e steps before the evaluation that sees it: sd e / S / sqrt(12))."""
    return math.sqrt(sum((c.eval_every / c.steps_to_target) ** 2 / 12.0 for c in cells
                         if c.steps_to_target and c.eval_every))


def format_value(value: Any, spec: str = ".3g", missing: str = "-") -> str:
    """``value`` formatted by ``spec``; ``missing`` for None or a float that is not finite."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return missing
    return format(value, spec)


def span_text(verdict: Verdict) -> str:
    """The verdict's estimate and interval, e.g. ``0.62x [0.48, 0.80]`` or ``+0.8 pt [...]``."""
    if math.isnan(verdict.estimate):
        return "no paired seeds"

    def end(value: float) -> str:
        return "inf" if math.isinf(value) else format(value, ".3g")

    if verdict.kind == "ratio":
        return f"{end(verdict.estimate)}x [{end(verdict.low)}, {end(verdict.high)}]"
    scale = 100.0  # accuracy points
    return (f"{verdict.estimate * scale:+.2f} pt [{verdict.low * scale:+.2f}, "
            f"{verdict.high * scale:+.2f}]")


def open_bound(verdict: Verdict) -> str | None:
    """The tightest statement an unresolved verdict's interval supports: "within 1.3x either
    way" (a ratio: the larger of high and 1/low) or "within 2.1 pt either way" (a difference);
    None where the interval is unbounded or the verdict is answered. It is not an answer: the
    interval still holds equality and reaches past the margin."""
    low, high = verdict.low, verdict.high
    if verdict.outcome != "not_resolved" or not (math.isfinite(low) and math.isfinite(high)):
        return None
    if verdict.kind == "ratio":
        return f"within {max(high, 1.0 / low):.2g}x either way" if low > 0 else None
    return f"within {100 * max(abs(low), abs(high)):.2g} pt either way"


def outcome_text(verdict: Verdict, a_name: str, b_name: str, better: str,
                 seconds: float | None = None) -> str:
    """One phrase: who is ``better`` (e.g. "faster"), "equivalent within 10%" or "not resolved
    after N seeds (and S seconds)", with the interval."""
    ratio = verdict.kind == "ratio"
    margin = f"{verdict.margin:.0%}" if ratio else f"{100 * verdict.margin:g} pt"
    n = verdict.seeds
    figures = f"{'A/B' if ratio else 'A-B'} {span_text(verdict)}"
    if verdict.outcome == "a":
        head = f"{a_name} {better}"
    elif verdict.outcome == "b":
        head = f"{b_name} {better}"
    elif verdict.outcome == "equivalent":
        head = f"{a_name} and {b_name} equivalent within {margin}"
    else:
        spent = f" and {seconds:.0f} s of added seeds" if seconds else ""
        bound = open_bound(verdict)
        head = (f"not resolved after {n} seed{'s' if n != 1 else ''}{spent}"
                + (f": {a_name} and {b_name} {bound}" if bound else ""))
    return f"{head} ({figures}, {n} seeds, {verdict.level:.1%} interval)"
