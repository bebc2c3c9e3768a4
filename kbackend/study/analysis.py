"""What a study's cells say, as one record (``analyze``): per optimizer its steps to target,
scaling regions and critical batch size (``scaling``), the throughput curve and its knee
(``kbackend.hardware.knee``'s one definition), the best cell, where Adam overtakes SGD, the
gradient noise scale, and every verdict (``cell_verdicts``, ``auto_verdicts``).

Everything here is plain Python over the cell records the runner returns (no training), so the
conclusions can be recomputed from a stored study and tested on made-up numbers.
"""


from __future__ import annotations

from dataclasses import dataclass

from kbackend.io import JsonObject
from kbackend.stats import median_coverage
from kbackend.study.auto_verdicts import AutoVerdict, auto_verdicts
from kbackend.study.cell_verdicts import (
    CriticalBatch,
    FastestVerdict,
    GeneralizationVerdict,
    KneeVerdict,
    NoiseAgreement,
    OptimizerComparison,
    RegionVerdict,
    StepTimeSpread,
    critical_batch_over_seeds,
    fastest_verdict,
    generalization_verdict,
    measured_throughput,
    noise_agreement,
    optimizer_comparison,
    region_verdicts,
    step_time_spread,
    throughput_knee_verdict,
    verdict_settings,
)
from kbackend.study.scaling import (
    COMPARED,
    CriticalBatchFit,
    Crossover,
    ScalingRegion,
    ThroughputPoint,
    by_optimizer,
    crossover,
    fit_critical_batch,
    noise_scale_note,
    scaling_regions,
    throughput_curve,
    throughput_knee,
    training_noise_scale,
)
from kbackend.study.study_record import AddedSeeds, Cell, StudyRecord
from kbackend.study.verdicts import VERDICT_CONFIDENCE, VerdictSettings


@dataclass(frozen=True)
class BestCell:
    """The cell with the fastest median time to target (``Analysis.best``)."""

    optimizer: str
    batch_size: int | str
    learning_rate: float
    time_to_target: float | None
    steps_to_target: float | None

    def to_json(self) -> JsonObject:
        return dict(vars(self))


@dataclass(frozen=True)
class OptimizerFigures:
    """One optimizer's cells (``optimizer_figures``): steps to target per batch size
    (batch size, steps, reached), scaling regions, the fitted critical batch size, its fastest
    cell that reached (batch size, time to target) and the batch sizes that never reached."""

    steps_to_target: tuple[tuple[int | str, float | None, bool], ...]
    regions: tuple[ScalingRegion, ...]
    knee: CriticalBatchFit
    fastest: tuple[int | str, float | None] | None
    not_reached: tuple[int | str, ...]

    def to_json(self) -> JsonObject:
        return {"steps_to_target": [{"batch_size": b, "steps": s, "reached": r}
                                    for b, s, r in self.steps_to_target],
                "regions": [r.to_json() for r in self.regions], "knee": self.knee.to_json(),
                "fastest": None if self.fastest is None else
                {"batch_size": self.fastest[0], "time_to_target": self.fastest[1]},
                "not_reached": list(self.not_reached)}


def optimizer_figures(group: list[Cell]) -> OptimizerFigures:
    """One optimizer's cells: steps to target per batch size, scaling regions, the fitted
    critical batch size, its fastest cell and the batch sizes that never reached."""
    points = [(c.size, c.steps) for c in group if c.reached]
    fastest = min(group, key=lambda c: c.seconds)
    return OptimizerFigures(
        tuple((c.batch_size, c.steps_to_target, c.reached) for c in group),
        tuple(scaling_regions(points)), fit_critical_batch(points),
        (fastest.batch_size, fastest.time_to_target) if fastest.reached else None,
        tuple(c.batch_size for c in group if not c.reached))


@dataclass(frozen=True)
class OptimizerVerdicts:
    """One optimizer's verdicts: its scaling steps, the critical batch size fitted per seed
    (``b_crit``), its agreement with B_simple and the generalization verdict."""

    regions: tuple[RegionVerdict, ...]
    b_crit: CriticalBatch
    noise_agreement: NoiseAgreement
    generalization: GeneralizationVerdict

    def to_json(self) -> JsonObject:
        return {"regions": [r.to_json() for r in self.regions], "b_crit": self.b_crit.to_json(),
                "noise_agreement": self.noise_agreement.to_json(),
                "generalization": self.generalization.to_json()}


@dataclass(frozen=True)
class StudyVerdicts:
    """Every verdict of a study, with the settings (seeds, levels, looks, margins) they used
    and the seed rounds that were added for them (``added_seeds``: ``sequential``'s record).
    ``adaptive``: the auto cells' verdicts, None in a study without auto cells."""

    settings: VerdictSettings
    added_seeds: AddedSeeds | None
    fastest: FastestVerdict
    optimizers: tuple[OptimizerComparison, ...]
    per_optimizer: dict[str, OptimizerVerdicts]
    throughput_knee: KneeVerdict
    step_time_spread: StepTimeSpread | None
    adaptive: tuple[AutoVerdict, ...] | None = None

    def to_json(self) -> JsonObject:
        settings = self.settings
        adaptive = {} if self.adaptive is None else {
            "adaptive": [x.to_json() for x in self.adaptive]}
        return {
            "seeds": settings.seeds, "coverage": median_coverage(settings.seeds),
            "confidence": VERDICT_CONFIDENCE, "level": settings.level,
            "look_levels": dict(zip(settings.levels.schedule, settings.levels.levels,
                                    strict=True)),
            "looks": settings.looks, "margin": settings.margin,
            "accuracy_margin": settings.accuracy_margin,
            "added_seeds": None if self.added_seeds is None else self.added_seeds.to_json(),
            "fastest": self.fastest.to_json(),
            "optimizers": [x.to_json() for x in self.optimizers],
            "per_optimizer": {name: per.to_json() for name, per in self.per_optimizer.items()},
            "throughput_knee": self.throughput_knee.to_json(),
            "step_time_spread": None if self.step_time_spread is None
            else self.step_time_spread.to_json(), **adaptive}


def study_verdicts(study: StudyRecord, b_simple: float | None) -> StudyVerdicts:
    """Every verdict of a study, with the settings (seeds, levels, looks, margins) they used."""
    cells, step_times = study.cells, study.step_times
    settings = verdict_settings(study)
    comparisons = (optimizer_comparison(cells, challenger, incumbent, settings, step_times)
                   for challenger, incumbent in COMPARED)
    per_optimizer = {}
    for optimizer, group in by_optimizer(cells).items():
        b_crit = critical_batch_over_seeds(group)
        per_optimizer[optimizer] = OptimizerVerdicts(
            tuple(region_verdicts(group, settings)), b_crit,
            noise_agreement(b_crit, b_simple, b_crit.n or settings.seeds),
            generalization_verdict(group, settings))
    return StudyVerdicts(
        settings, study.added_seeds, fastest_verdict(cells, settings, step_times),
        tuple(x for x in comparisons if x is not None), per_optimizer,
        throughput_knee_verdict(step_times, settings), step_time_spread(step_times),
        # the adaptive batch size against each best fixed one
        tuple(auto_verdicts(study, settings)) if study.auto_cells else None)


@dataclass(frozen=True)
class Analysis:
    """What a study's cells say (``analyze``): every verdict, per optimizer its figures
    (``optimizer_figures``), the throughput curve and its knee, the best cell, the crossovers
    of the medians and the gradient noise scale. ``to_json`` is the report's record of it."""

    verdicts: StudyVerdicts
    per_optimizer: dict[str, OptimizerFigures]
    throughput: tuple[ThroughputPoint, ...]
    throughput_knee: int | None
    throughput_plateau_reached: bool | None
    best: BestCell | None
    crossovers: tuple[Crossover, ...]
    b_simple: float | None
    b_simple_note: str

    def to_json(self) -> JsonObject:
        """The analysis as summary.json holds it (``report.summary_payload``)."""
        return {"verdicts": self.verdicts.to_json(),
                "per_optimizer": {k: v.to_json() for k, v in self.per_optimizer.items()},
                "throughput": [p.to_json() for p in self.throughput],
                "throughput_knee": self.throughput_knee,
                "throughput_plateau_reached": self.throughput_plateau_reached,
                "best": None if self.best is None else self.best.to_json(),
                "crossovers": [x.to_json() for x in self.crossovers], "b_simple": self.b_simple,
                "b_simple_note": self.b_simple_note}


def analyze(study: StudyRecord) -> Analysis:
    """Conclusions of a study result (the runner's output, or ``StudyRecord.from_json`` of a
    stored summary)."""
    cells = study.cells
    measured = measured_throughput(study.step_times)
    # The time model's interleaved timings when there are any; else the runs' own clocks.
    curve = measured or throughput_curve(study.runs)
    knee = throughput_knee(curve) if curve else None
    reached = [c for c in cells if c.reached]
    best = min(reached, key=lambda c: c.seconds) if reached else None
    crossovers = tuple(x for x in (crossover(cells, *pair) for pair in COMPARED)
                       if x is not None)
    noise = study.noise
    b_simple = training_noise_scale(noise)
    return Analysis(
        verdicts=study_verdicts(study, b_simple),
        per_optimizer={optimizer: optimizer_figures(group)
                       for optimizer, group in by_optimizer(cells).items()},
        throughput=tuple(curve),
        throughput_knee=None if knee is None else knee.batch_size,
        throughput_plateau_reached=None if knee is None else knee.plateau_reached,
        best=None if best is None else BestCell(best.optimizer, best.batch_size,
                                                best.learning_rate, best.time_to_target,
                                                best.steps_to_target),
        crossovers=crossovers, b_simple=b_simple, b_simple_note=noise_scale_note(noise))
