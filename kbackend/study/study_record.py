"""A study's results as frozen values: ``StudyRecord``, what ``StudyRunner.run`` returns and
the pipeline completes (the held-out seeds' ``HeldOutRuns``, warnings, the device profile's
prediction, the machine's load ``MachineLoad``, where the time went ``TimeAccount``), read by the
analysis, the recommendation, the report, the plots and the exports; its ``Cell`` s (one type,
batch fixed or auto, with their ``Frontier``), the time model's ``StepTimes`` and the
``NoiseScale``. They become JSON only at the boundary: the store (``StepTimes.to_json``,
``NoiseScale.to_json``, ``HeldOutRuns.to_json``), ``report.summary_payload`` (summary.json,
byte for byte what the dicts they replaced wrote) and ``StudyRecord.to_json``
(``result.study.to_json()["cells"]``); ``from_json`` reads a stored summary back (re-analysis,
``study compare``'s tools). The runs inside stay ``StoredRun.to_dict`` records, the store's own
JSON.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kbackend.errors import InternalError
from kbackend.io import JsonObject
from kbackend.study.store import StoredRun


@dataclass(frozen=True)
class MachineLoad:
    """The machine's one-minute load before and after the study, and its CPU count."""

    before: float
    after: float
    cpus: int | None

    def to_json(self) -> dict[str, float | int | None]:
        return {"before": self.before, "after": self.after, "cpus": self.cpus}


@dataclass(frozen=True)
class TimeAccount:
    """Where a study's time went, from the process's start (``pipeline.time_accounting``):
    seconds per part, with the ratio the overhead goal is stated in."""

    runs_trained: int
    whole_process_s: float
    this_call_s: float
    before_call_s: float
    steady_training_s: float
    startup_s: float
    setup_s: float
    evaluation_s: float
    around_runs_s: float
    time_model_s: float
    noise_scale_s: float
    added_seeds_s: float  # inside the runs' figures above: the sequential seeds' rounds
    added_seed_runs: int
    frontier_runs: int
    report_s: float | None
    other_s: float
    whole_over_steady: float | None
    goal_s: float
    goal_met: bool

    def to_json(self) -> dict[str, float | int | bool | None]:
        """The accounting as summary.json holds it (``time_spent``), in this field order."""
        return dict(vars(self))

    @classmethod
    def from_json(cls, record: JsonObject) -> TimeAccount:
        """An accounting read back; one written before a part was counted has it at 0."""
        return cls(**{name: record.get(name, 0) for name in cls.__dataclass_fields__})


@dataclass(frozen=True)
class Cell:
    """One cell of the study: an optimizer at a batch size (``batch_size`` "auto" for an auto
    cell, its bounds in ``auto``), its learning-rate search (the grid, the rates tried, the
    extensions, the path it trained on) and, at its best rate, its figures: medians over seeds
    with their ``intervals``, the per-seed values the paired verdicts read, its runs' keys.
    Later parts fill in the frontier, the time model (``time_model``, ``seconds_per_step``,
    the runs' own clocks in ``time_to_target_runs``) and an auto cell's modelled times.

    ``to_json`` writes the record summary.json has always held (its keys in this order, the
    parts not filled in left out); ``from_json`` reads one back, old or partial."""

    optimizer: str
    batch_size: int | str
    lr_grid: tuple[float, ...] = ()
    lr_tried: tuple[float, ...] = ()
    lr_extended: dict[str, int] = field(default_factory=dict)
    lr_at_grid_edge: bool = False
    lr_edge: str | None = None
    lr_at_bound: bool = False
    population: dict[str, Any] = field(default_factory=dict)  # Populations.path's record
    learning_rate: float = math.nan
    seeds: int = 1
    seed_values: tuple[int, ...] = ()
    reached: bool = False
    seeds_reached: int = 0
    steps_to_target: float | None = None
    samples_to_target: float | None = None
    epochs_to_target: float | None = None
    time_to_target: float | None = None
    time_to_target_raw: float | None = None
    steps_run: float | None = None
    best_metric: float | None = None
    test_accuracy: float | None = None
    test_metric: float | None = None
    samples_per_s: float | None = None
    startup_time: float | None = None
    startup_time_estimated: bool = False
    train_time: float = 0.0
    wall_time: float = 0.0
    seed_steps: dict[str, float] = field(default_factory=dict)
    seed_test: dict[str, float] = field(default_factory=dict)
    test_metric_name: str | None = None
    eval_every: int | None = None
    fused_steps: int | None = None
    run_key: str = ""
    run_keys: tuple[str, ...] = ()
    intervals: dict[str, dict[str, float] | None] = field(default_factory=dict)
    # an auto cell's: its bounds and rate scaling, then (``finish_auto_cells``) per seed its
    # samples and modelled seconds to target and step ranges, and the largest batch it grew to
    auto: dict[str, int | str] | None = None
    frontier: Frontier | None = None  # summarize_frontier's; None: none measured
    seed_samples: dict[str, float] | None = None
    seed_times: dict[str, float] | None = None
    ranges: dict[str, list[dict[str, float]]] | None = None
    time_to_target_runs: float | None = None
    time_model: str | None = None  # None: no time model applied yet
    seconds_per_step: dict[str, float] | None = None
    largest_batch: int | None = None

    @property
    def key(self) -> tuple[str, int | str]:
        return self.optimizer, self.batch_size

    @property
    def size(self) -> int:
        """A fixed cell's batch size (an auto cell grows through many: it has none)."""
        assert isinstance(self.batch_size, int), "an auto cell has no one batch size"
        return self.batch_size

    @property
    def steps(self) -> float:
        """The median steps to target, infinite where the cell did not reach the target."""
        return self.steps_to_target if self.reached and self.steps_to_target is not None \
            else math.inf

    @property
    def seconds(self) -> float:
        """The median time to target, infinite where the cell did not reach the target."""
        return self.time_to_target if self.reached and self.time_to_target is not None \
            else math.inf

    def to_json(self) -> JsonObject:
        """The cell's record, keys in summary.json's order; the parts not filled in left out."""
        values = dict(vars(self))
        for name in ("lr_grid", "lr_tried", "seed_values", "run_keys"):
            values[name] = list(values[name])
        values["frontier"] = None if self.frontier is None else self.frontier.to_json()
        absent = set()
        if self.auto is None:
            absent |= {"auto", "seed_samples", "seed_times", "ranges", "largest_batch"}
        if self.frontier is None:
            absent.add("frontier")
        if self.time_model is None:
            absent |= {"time_to_target_runs", "time_model"}
        if self.seconds_per_step is None:
            absent.add("seconds_per_step")
        return {k: v for k, v in values.items() if k not in absent}

    @classmethod
    def from_json(cls, record: JsonObject) -> Cell:
        """A cell read back (a stored summary, a test's partial record): what it lacks takes
        its default, what this version does not keep is dropped."""
        known = {k: v for k, v in record.items() if k in cls.__dataclass_fields__}
        for name in ("lr_grid", "lr_tried", "seed_values", "run_keys"):
            if name in known:
                known[name] = tuple(known[name])
        known["frontier"] = Frontier.from_json(known.get("frontier"))
        if "seeds_reached" not in known:
            known["seeds_reached"] = int(bool(known.get("reached")))
        return cls(**known)


@dataclass(frozen=True)
class CellStepTime:
    """One cell's steady seconds per step, timed apart from its runs (``StepTimeModel``):
    ``seconds`` per step in each interleaved round (rounds pair across cells), their
    ``seconds_per_step`` (``stats.median_interval``) and coefficient of variation ``cv``."""

    optimizer: str
    batch_size: int
    learning_rate: float
    steps_per_call: int
    fused_steps: int
    warm_up_s: float
    seconds: tuple[float, ...]
    seconds_per_step: dict[str, float]
    cv: float | None

    @property
    def key(self) -> tuple[str, int]:
        return self.optimizer, self.batch_size

    def to_json(self) -> JsonObject:
        return {**vars(self), "seconds": list(self.seconds)}


@dataclass(frozen=True)
class StepTimes:
    """The time model's measurement: every timed cell (``cells``) with how it was timed (the
    engine whose compiled step was timed, the study's own engine, the interleaved rounds, the
    least seconds per timed call and the calls per round kept at their fastest)."""

    engine: str
    study_engine: str | None
    repeats: int
    min_seconds: float | None
    round_calls: int | None
    cells: tuple[CellStepTime, ...]
    # Read back from the store, whose JSON sorts its keys: summary.json has always written a
    # reused measurement in that order (a fresh one in the order above), and still does.
    sorted_keys: bool = field(default=False, repr=False, compare=False)

    def seconds(self) -> dict[tuple[str, int], tuple[float, ...]]:
        """Each timed cell's seconds per step by round, by (optimizer, batch size)."""
        return {cell.key: cell.seconds for cell in self.cells}

    def to_json(self) -> JsonObject:
        """As the store and summary.json hold it (``step_times``)."""
        record = {"engine": self.engine, "study_engine": self.study_engine,
                  "repeats": self.repeats, "min_seconds": self.min_seconds,
                  "round_calls": self.round_calls, "cells": [c.to_json() for c in self.cells]}
        return _sorted_keys(record) if self.sorted_keys else record

    @classmethod
    def from_json(cls, record: JsonObject | None) -> StepTimes | None:
        """The measurement ``to_json`` wrote (None: none was made)."""
        if record is None:
            return None
        cells = tuple(CellStepTime(
            c["optimizer"], c["batch_size"], c.get("learning_rate", math.nan),
            c.get("steps_per_call", 0),
            c.get("fused_steps", 1), c.get("warm_up_s", 0.0), tuple(c["seconds"]),
            c.get("seconds_per_step") or {}, c.get("cv")) for c in record.get("cells") or ())
        return cls(record.get("engine", "native"), record.get("study_engine"),
                   record.get("repeats", 0), record.get("min_seconds"),
                   record.get("round_calls"), cells, list(record) == sorted(record))


def _sorted_keys(value: Any) -> Any:
    """``value`` with every dict's keys in sorted order (as ``json.dumps(sort_keys=True)``)."""
    if isinstance(value, dict):
        return {k: _sorted_keys(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted_keys(v) for v in value]
    return value


@dataclass(frozen=True)
class NoisePoint:
    """The noise-scale estimate at one point of training (``adaptive.NoiseEstimate``'s figures
    at ``step``)."""

    step: int
    grad_sq: float
    trace_sigma: float
    grad_sq_se: float
    trace_sigma_se: float
    small_batch: int
    big_batch: int
    draws: int
    b_simple: float

    def to_json(self) -> JsonObject:
        return dict(vars(self))


@dataclass(frozen=True)
class NoiseScale:
    """The gradient noise scale measured along one cell's training (``noise_runs``): the cell,
    the batch pair and draws, each point's estimate, the last estimate after initialization
    and, where a wider batch pair was tried after the first, that first pair's
    ``{small_batch, big_batch, b_simple_final}``."""

    optimizer: str
    batch_size: int
    learning_rate: float
    small_batch: int
    big_batch: int
    draws: int
    points: tuple[NoisePoint, ...]
    b_simple_final: float
    first_try: dict[str, float] | None = None
    sorted_keys: bool = field(default=False, repr=False, compare=False)  # as ``StepTimes``'s

    def to_json(self) -> JsonObject:
        """As the store and summary.json hold it (``noise``)."""
        record = {name: getattr(self, name) for name in self.__dataclass_fields__
                  if name not in ("sorted_keys", "first_try")}
        record["points"] = [p.to_json() for p in self.points]
        if self.first_try is not None:
            record["first_try"] = self.first_try
        return _sorted_keys(record) if self.sorted_keys else record

    @classmethod
    def from_json(cls, record: JsonObject | None) -> NoiseScale | None:
        if not record:
            return None
        points = tuple(NoisePoint(**p) for p in record["points"])
        return cls(record["optimizer"], record["batch_size"], record["learning_rate"],
                   record["small_batch"], record["big_batch"], record["draws"], points,
                   record["b_simple_final"], record.get("first_try"),
                   list(record) == sorted(record))


@dataclass(frozen=True)
class Frontier:
    """A cell's frontier over its seeds (``frontier.summarize_frontier``): the equal budget in
    epochs, the seeds, the metric, the best validation value, the test metric at that
    checkpoint and the epoch of it (medians with ``median_interval``'s intervals), and per seed
    the values the paired verdicts read; ``steps``: the most steps a frontier run trained (its
    budget at this batch size; None in studies stored before it was kept)."""

    epochs: int | None = None
    steps: int | None = None
    seeds: int = 0
    metric: str | None = None
    test_metric_name: str | None = None
    best_metric: dict[str, float] = field(default_factory=dict)
    test_metric: dict[str, float] = field(default_factory=dict)
    best_epoch: dict[str, float] = field(default_factory=dict)
    seed_best: dict[str, float] = field(default_factory=dict)
    seed_test: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> JsonObject:
        record = dict(vars(self))
        if record["steps"] is None:  # a stored frontier without it reads back as it was
            del record["steps"]
        return record

    @classmethod
    def from_json(cls, record: JsonObject | None) -> Frontier | None:
        """A cell's frontier read back ({} or None: none was measured; what this version does
        not keep is dropped)."""
        if not record:
            return None
        return cls(**{k: v for k, v in record.items() if k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class HeldOutRuns:
    """The recommended cell's printed ``kbackend train`` command run on held-out seeds
    (``recommend.confirm_cell``; stored, so a resumed study reuses it): the cell and its rate,
    the seeds, how many reached the target and failed, whether most reached, the steps, time
    and wall to target over them (``median_interval``'s, a seed that did not reach counting as
    never), the study's own figures for the cell and the command's arguments."""

    optimizer: str
    batch_size: int | str
    learning_rate: float
    seeds: int
    held_out_seeds: tuple[int, ...]
    reached: int
    failed: int
    confirmed: bool
    steps_to_target: dict[str, float]
    time_to_target: dict[str, float]
    wall_to_target: dict[str, float]
    study_steps_to_target: float | None
    study_time_to_target: float | None
    arguments: tuple[str, ...]

    @property
    def key(self) -> tuple[str, int | str]:
        return self.optimizer, self.batch_size

    def to_json(self) -> JsonObject:
        return {**vars(self), "held_out_seeds": list(self.held_out_seeds),
                "arguments": list(self.arguments)}

    @classmethod
    def from_json(cls, record: JsonObject) -> HeldOutRuns:
        """The stored record; a missing field is an ``InternalError`` naming it (every version
        that stored a confirmation wrote them all)."""
        missing = [name for name in cls.__dataclass_fields__ if name not in record]
        if missing:
            raise InternalError(f"A stored confirmation lacks {', '.join(missing)}.")
        values = {name: record[name] for name in cls.__dataclass_fields__}
        return cls(**{**values, "held_out_seeds": tuple(values["held_out_seeds"]),
                      "arguments": tuple(values["arguments"])})


@dataclass(frozen=True)
class SeedRound:
    """One round of added seeds: the seeds each cell has after it, the cells it extended (those
    of a verdict that could still resolve) and [optimizer, batch size, seed] of each run added."""

    seeds: int
    cells: tuple[tuple[str, int | str], ...]
    runs: tuple[tuple[str, int | str, int], ...]

    def to_json(self) -> JsonObject:
        return {"seeds": self.seeds, "cells": [list(c) for c in self.cells],
                "runs": [list(r) for r in self.runs]}


@dataclass(frozen=True)
class AddedSeeds:
    """What ``sequential.extend_seeds`` added: the seed schedule, each round, the seconds spent
    (this process's clock, and the runs' recorded seconds against the budget, the frontier's
    apart), the budget (None: no limit), why the rounds stopped and the frontier's epochs."""

    schedule: tuple[int, ...]
    max_seeds: int
    rounds: tuple[SeedRound, ...]
    seconds: float
    recorded_seconds: float
    frontier_seconds: float
    budget: float | None
    stopped: str
    frontier_epochs: int

    def to_json(self) -> JsonObject:
        return {**vars(self), "schedule": list(self.schedule),
                "rounds": [r.to_json() for r in self.rounds]}

    @classmethod
    def from_json(cls, record: JsonObject | None) -> AddedSeeds | None:
        if record is None:
            return None
        rounds = tuple(SeedRound(r["seeds"], tuple(tuple(c) for c in r["cells"]),
                                 tuple(tuple(x) for x in r["runs"]))
                       for r in record.get("rounds") or ())
        return cls(tuple(record.get("schedule") or ()), record.get("max_seeds", 0), rounds,
                   record.get("seconds", 0.0), record.get("recorded_seconds", 0.0),
                   record.get("frontier_seconds", 0.0), record.get("budget"),
                   record.get("stopped", ""), record.get("frontier_epochs", 0))


@dataclass(frozen=True)
class StudyRecord:
    """A study's results: its identity and set-up (``config`` is ``StudyConfig.to_dict``), its
    cells (the fixed grid's, then ``auto_cells``) and their runs, the time model's step times,
    the noise scale, the added seeds' rounds; then what the pipeline adds after the runs."""

    study_id: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    env: dict[str, Any] = field(default_factory=dict)  # envinfo.environment_identity
    dataset: dict[str, Any] = field(default_factory=dict)  # DatasetInfo.to_dict
    batch_sizes: tuple[int, ...] = ()
    cells: list[Cell] = field(default_factory=list)
    runs: list[StoredRun] = field(default_factory=list)
    digests: dict[str, str] = field(default_factory=dict)
    step_times: StepTimes | None = None
    noise: NoiseScale | None = None
    added_seeds: AddedSeeds | None = None
    auto_cells: list[Cell] = field(default_factory=list)
    auto_runs: list[StoredRun] = field(default_factory=list)
    # added by the pipeline after the runs
    confirmation: tuple[HeldOutRuns, ...] | None = None
    warnings: tuple[str, ...] = ()
    device_profile: dict[str, Any] | None = None
    machine_load: MachineLoad | None = None
    time_spent: TimeAccount | None = None

    @property
    def target(self) -> dict[str, Any]:
        """The study's target: ``{"metric", "value"}``."""
        return dict(self.config["target"])

    @property
    def all_cells(self) -> list[Cell]:
        """The fixed grid's cells, then the auto cells."""
        return [*self.cells, *self.auto_cells]

    @property
    def all_runs(self) -> list[StoredRun]:
        """Every stored run: the fixed cells' (all rates and seeds), then the auto cells'."""
        return [*self.runs, *self.auto_runs]

    def to_json(self) -> JsonObject:
        """The record as the JSON dict it used to be (``study`` its id; empty parts left out
        as the dict left them out)."""
        record: JsonObject = {
            "study": self.study_id, "digests": self.digests,
            "step_times": None if self.step_times is None else self.step_times.to_json(),
            "config": self.config, "env": self.env, "dataset": self.dataset,
            "batch_sizes": list(self.batch_sizes), "cells": [c.to_json() for c in self.cells],
            "runs": [r.to_dict() for r in self.runs],
            "noise": None if self.noise is None else self.noise.to_json(),
            "added_seeds": None if self.added_seeds is None else self.added_seeds.to_json()}
        if self.auto_cells or self.auto_runs:
            record.update(auto_cells=[c.to_json() for c in self.auto_cells],
                          auto_runs=[r.to_dict() for r in self.auto_runs])
        if self.confirmation is not None:
            record["confirmation"] = [c.to_json() for c in self.confirmation]
        record["warnings"] = list(self.warnings)
        if self.device_profile is not None:
            record["device_profile"] = self.device_profile
        if self.machine_load is not None:
            record["machine_load"] = self.machine_load.to_json()
        if self.time_spent is not None:
            record["time_spent"] = self.time_spent.to_json()
        return record

    @classmethod
    def from_json(cls, record: JsonObject) -> StudyRecord:
        """A record read back from its JSON (a summary.json, or a part of one)."""
        load, spent = record.get("machine_load"), record.get("time_spent")
        confirmation = record.get("confirmation")
        return cls(
            study_id=record.get("study", ""), config=record.get("config") or {},
            env=record.get("env") or {}, dataset=record.get("dataset") or {},
            batch_sizes=tuple(record.get("batch_sizes") or ()),
            cells=[Cell.from_json(c) for c in record.get("cells") or ()],
            runs=[_stored_run(r) for r in record.get("runs") or ()],
            digests=record.get("digests") or {},
            step_times=StepTimes.from_json(record.get("step_times")),
            noise=NoiseScale.from_json(record.get("noise")),
            added_seeds=AddedSeeds.from_json(record.get("added_seeds")),
            auto_cells=[Cell.from_json(c) for c in record.get("auto_cells") or ()],
            auto_runs=[_stored_run(r) for r in record.get("auto_runs") or ()],
            confirmation=None if confirmation is None else tuple(
                HeldOutRuns.from_json(c) for c in confirmation),
            warnings=tuple(record.get("warnings") or ()),
            device_profile=record.get("device_profile"),
            machine_load=None if load is None else MachineLoad(**load),
            time_spent=None if spent is None else TimeAccount.from_json(spent))


def _stored_run(record: JsonObject) -> StoredRun:
    """A run read back: ``StoredRun.to_dict``'s record, or summary.json's (its optimizer beside
    the config, which holds only what the report reads; a test's may hold less)."""
    config = dict(record.get("config") or {})
    if "optimizer" in record and "optimizer" not in config:
        config["optimizer"] = {"name": record["optimizer"]}
    return StoredRun(record.get("key", ""), record.get("kind", "run"), record.get("study", ""),
                     record.get("backend", ""), config, dict(record.get("result") or {}),
                     record.get("trajectory"), record.get("finished_at", 0.0))
