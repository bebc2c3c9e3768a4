"""A finished study as typed, frozen values: what ``kbackend.study`` returns.

Built once from the study's record (``pipeline.run_study``'s ``StudyRecord``) at the API
boundary, so a Keras user writes ``result.best.batch_size`` and ``result.rows[0].reached``.
The ``Recommendation`` (with its ``Confirmation`` and ``Interval``, ``recommend``'s, re-exported
here) also holds fields other parts of the study may fill later (``confirmation``, ``edge``,
``tie``): they are None until then. This is the one set of result types; the command line
prints from the same ``recommendation``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kbackend.io import JsonObject
from kbackend.study.analysis import Analysis
from kbackend.study.recommend import (
    Confirmation,
    Interval,
    Recommendation,
    recommendation,
    recommendation_lines,
)
from kbackend.study.study_record import Cell, StudyRecord

__all__ = ["CellRow", "Confirmation", "Interval", "Recommendation", "StudyResult",
           "recommendation", "recommendation_lines"]


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
        """``row["seeds"]``: any figure of the cell's full record by name, for a Python user's
        code (``row.cell`` holds it typed)."""
        return getattr(self.cell, name)

    def to_dict(self) -> JsonObject:
        """The row's typed fields (the full record stays in ``cell``)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "cell"}


@dataclass(frozen=True)
class StudyResult:
    """A finished study: ``best`` (the ``Recommendation``, None if no cell reached), ``rows``
    (one ``CellRow`` per cell), ``report_path``, ``runs_path`` (``runs.csv``, one row per
    run), the ``study`` record (``StudyRecord``; ``study.to_json()["cells"]`` its JSON) and its
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

    def to_dict(self) -> JsonObject:
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

