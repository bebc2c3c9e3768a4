"""A finished study as typed, frozen values: what ``kbackend.study`` returns.

Built once from the study's result dict (``pipeline.run_study``'s ``study``) at the API
boundary, so a Keras user writes ``result.best.batch_size`` and ``result.rows[0].reached``.
``Recommendation`` also holds fields other parts of the study may fill later (``confirmation``,
``edge``, ``tie``): they are None until then. This is the one set of result types; the
command line prints from the same ``recommendation``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from kbackend.study import recommend
from kbackend.study.analysis import Analysis
from kbackend.study.study_record import Cell, StudyRecord


@dataclass(frozen=True)
class Interval:
    """A median over seeds with its [low, high] interval (``stats.median_interval``)."""

    median: float | None
    low: float | None = None
    high: float | None = None
    n: int | None = None

    @classmethod
    def of(cls, values: dict[str, Any] | None) -> Interval | None:
        """The interval ``median_interval`` wrote as a dict, or None where there is none."""
        if not values or "median" not in values:
            return None
        return cls(_number(values.get("median")), _number(values.get("low")),
                   _number(values.get("high")), values.get("n"))


@dataclass(frozen=True)
class Confirmation:
    """A cell's printed ``kbackend train`` command run on held-out seeds
    (``recommend.confirm_cell``): the seeds, how many reached the target, whether most did,
    and its steps, time and wall to target over them (a seed that did not reach: None ends)."""

    optimizer: str
    batch_size: int | str
    seeds: tuple[int, ...]
    reached: int
    confirmed: bool
    steps_to_target: Interval | None = None
    time_to_target: Interval | None = None
    wall_to_target: Interval | None = None

    @classmethod
    def of(cls, record: dict[str, Any]) -> Confirmation:
        return cls(record["optimizer"], record["batch_size"],
                   tuple(record.get("held_out_seeds") or ()), int(record["reached"]),
                   bool(record["confirmed"]), Interval.of(record.get("steps_to_target")),
                   Interval.of(record.get("time_to_target")),
                   Interval.of(record.get("wall_to_target")))


@dataclass(frozen=True)
class Recommendation:
    """The cell to train at: the fastest median time to target (``tie`` says which cells the
    intervals cannot separate from it); the ``kbackend train`` command and the Python call that
    train at it; what that command reached on held-out seeds (``confirmation``; the faster cells
    it did not confirm: ``passed_over``); ``edge``: its rate at the bound of the extended grid.
    ``result.best["batch_size"]`` still reads as the dict it used to be."""

    optimizer: str
    batch_size: int | str
    learning_rate: float
    time_to_target: float
    steps_to_target: float
    intervals: dict[str, Any]
    tied_with: tuple[tuple[str, int | str], ...]
    resolved: bool
    seeds: int
    command: str
    python: str
    confirmation: Confirmation | None = None
    edge: bool = False
    tie: str | None = None
    passed_over: tuple[Confirmation, ...] = ()
    warnings: tuple[str, ...] = ()
    record: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, best: dict[str, Any]) -> Recommendation:
        """The typed form of ``recommend.recommendation``'s record."""
        ties = ", ".join(f"{o} at batch {b}" for o, b in best["tied_with"])
        return cls(
            optimizer=best["optimizer"], batch_size=best["batch_size"],
            learning_rate=best["learning_rate"], time_to_target=best["time_to_target"],
            steps_to_target=best["steps_to_target"], intervals=best["intervals"],
            tied_with=tuple((o, b) for o, b in best["tied_with"]), resolved=best["resolved"],
            seeds=best["seeds"], command=best["command"], python=best["python"],
            confirmation=None if best.get("confirmation") is None
            else Confirmation.of(best["confirmation"]),
            edge=bool(best.get("edge")),
            tie=f"tied with {ties}: the intervals over seeds cannot separate them" if ties
            else None,
            passed_over=tuple(Confirmation.of(c) for c in best.get("passed_over") or ()),
            warnings=tuple(best.get("warnings") or ()), record=best)

    def __getitem__(self, name: str) -> Any:
        return getattr(self, name)

    def to_dict(self) -> dict[str, Any]:
        """The recommendation as JSON values (ties as lists)."""
        values = {k: v for k, v in asdict(self).items() if k != "record"}
        return {**values, "tied_with": [list(t) for t in self.tied_with]}


@dataclass(frozen=True)
class CellRow:
    """One cell of the study's table: the fixed batch sizes' cells, then the auto cells
    (``batch_size == "auto"``). ``row["auto"]`` and other keys read the cell's full record."""

    optimizer: str
    batch_size: int | str
    learning_rate: float
    reached: bool
    seeds: int
    seeds_reached: int
    steps_to_target: float | None
    time_to_target: float | None
    samples_to_target: float | None
    best_metric: float | None
    test_metric: float | None
    test_metric_name: str | None
    samples_per_s: float | None
    cell: Cell = field(repr=False, compare=False)

    @classmethod
    def of(cls, cell: Cell) -> CellRow:
        return cls(cell.optimizer, cell.batch_size, cell.learning_rate, bool(cell.reached),
                   cell.seeds, cell.seeds_reached, cell.steps_to_target, cell.time_to_target,
                   cell.samples_to_target, cell.best_metric, cell.test_metric,
                   cell.test_metric_name, cell.samples_per_s, cell)

    def __getitem__(self, name: str) -> Any:
        return getattr(self.cell, name)

    def to_dict(self) -> dict[str, Any]:
        """The row's typed fields (the full record stays in ``cell``)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "cell"}


@dataclass(frozen=True)
class StudyResult:
    """A finished study: ``best`` (the ``Recommendation``, None if no cell reached), ``rows``
    (one ``CellRow`` per cell), ``report_path``, ``runs_path`` (``runs.csv``, one row per
    run), the ``study`` record (``StudyRecord``; ``study["cells"]`` reads its JSON) and its
    typed ``analysis`` (``analysis.Analysis``)."""

    best: Recommendation | None
    rows: tuple[CellRow, ...]
    report_path: Path
    runs_path: Path | None = None
    study: StudyRecord = field(default_factory=StudyRecord, repr=False, compare=False)
    analysis: Analysis | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, study: StudyRecord, analysis: Analysis, report_path: Path,
           runs_path: Path | None = None) -> StudyResult:
        """The typed result of ``run_study``'s ``study`` and ``analysis``."""
        return cls(recommendation(study), tuple(CellRow.of(c) for c in study.all_cells),
                   report_path, runs_path, study, analysis)

    def to_dict(self) -> dict[str, Any]:
        """``best`` and ``rows`` as JSON values, with the report's and runs table's paths."""
        return {"best": None if self.best is None else self.best.to_dict(),
                "rows": [row.to_dict() for row in self.rows],
                "report_path": str(self.report_path),
                "runs_path": None if self.runs_path is None else str(self.runs_path)}

    def to_pandas(self) -> Any:
        """The rows as a ``pandas.DataFrame`` (pandas must be installed)."""
        try:
            import pandas  # deferred: an optional library, imported only when asked for
        except ImportError:
            raise ImportError("StudyResult.to_pandas() needs pandas: pip install pandas "
                              "(or read runs.csv / to_dict()).") from None
        return pandas.DataFrame([row.to_dict() for row in self.rows])


def recommendation(study: StudyRecord) -> Recommendation | None:
    """The typed recommendation of ``study`` (the rule, command and confirmation:
    ``kbackend.study.recommend``); None if no cell reached the target."""
    best = recommend.recommendation(study)
    return None if best is None else Recommendation.of(best)


def recommendation_lines(best: Recommendation | None) -> list[str]:
    """The study's answer on the console: the cell to train at, what ``train`` reached with
    the printed command on held-out seeds, the warnings, the command and the Python call."""
    return recommend.recommendation_lines(None if best is None else best.record)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None



