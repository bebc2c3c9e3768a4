"""A finished study as typed, frozen values: what ``kbackend.study`` returns.

Built once from the study's result dict (``pipeline.run_study``'s ``study``) at the API
boundary, so a Keras user writes ``result.best.batch_size`` and ``result.rows[0].reached``.
``Recommendation`` also holds fields other parts of the study may fill later (``confirmation``,
``edge``, ``tie``): they are None until then. This is the one set of result types; the
command line prints from the same ``recommendation``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kbackend.data import DATASETS


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
    """The recommended cell re-run on held-out seeds: the seeds, how many reached, and its steps
    and time to target over them (filled by the confirmation step where the study runs one)."""

    seeds: tuple[int, ...]
    reached: int
    steps_to_target: Interval | None = None
    time_to_target: Interval | None = None


@dataclass(frozen=True)
class Recommendation:
    """The cell to train at: the fastest median time to target, or the cheapest of the cells it
    ties with; the ``kbackend train`` command and the Python call that train at it.
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
    confirmation: Confirmation | None = None  # held-out seeds' steps and time (later work)
    edge: bool | None = None  # the best rate on an end of its grid (later work)
    tie: str | None = None  # a sentence on the tie, where one decided the pick (later work)

    def __getitem__(self, name: str) -> Any:
        return getattr(self, name)

    def to_dict(self) -> dict[str, Any]:
        """The recommendation as JSON values (ties as lists)."""
        return {**asdict(self), "tied_with": [list(t) for t in self.tied_with]}


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
    cell: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def of(cls, cell: dict[str, Any]) -> CellRow:
        return cls(cell["optimizer"], cell["batch_size"], cell["learning_rate"],
                   bool(cell.get("reached")), int(cell.get("seeds", 1)),
                   int(cell.get("seeds_reached", int(bool(cell.get("reached"))))),
                   cell.get("steps_to_target"), cell.get("time_to_target"),
                   cell.get("samples_to_target"), cell.get("best_metric"),
                   cell.get("test_metric"), cell.get("test_metric_name"),
                   cell.get("samples_per_s"), cell)

    def __getitem__(self, name: str) -> Any:
        return self.cell[name]

    def to_dict(self) -> dict[str, Any]:
        """The row's typed fields (the full record stays in ``cell``)."""
        return {k: v for k, v in asdict(self).items() if k != "cell"}


@dataclass(frozen=True)
class StudyResult:
    """A finished study: ``best`` (the ``Recommendation``, None if no cell reached), ``rows``
    (one ``CellRow`` per cell), ``report_path``, ``runs_path`` (``runs.csv``, one row per run)
    and the raw ``study`` / ``analysis`` records."""

    best: Recommendation | None
    rows: tuple[CellRow, ...]
    report_path: Path
    runs_path: Path | None = None
    study: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    analysis: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, study: dict[str, Any], analysis: dict[str, Any], report_path: Path,
           runs_path: Path | None = None) -> StudyResult:
        """The typed result of ``run_study``'s ``study`` and ``analysis``."""
        cells = [*study["cells"], *(study.get("auto_cells") or [])]
        return cls(recommendation(study), tuple(CellRow.of(c) for c in cells), report_path,
                   runs_path, study, analysis)

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


def recommendation(study: dict[str, Any]) -> Recommendation | None:
    """The cell to train at: the fastest median time to target; where the intervals cannot
    separate it from others (``tied_with``), the cheapest among them: the fewest samples
    processed to the target (steps x batch, the compute a run costs on any hardware). None if
    no cell reached."""
    cells = [c for c in study["cells"] if c.get("reached") and c.get("time_to_target")]
    if not cells:
        return None
    fastest = min(cells, key=lambda c: c["time_to_target"])
    low, high = _span(fastest)
    tied = [c for c in cells if c is not fastest and _span(c)[0] <= high and low <= _span(c)[1]]
    best = min([fastest, *tied], key=lambda c: (_samples(c), c["time_to_target"]))
    tied = [c for c in [fastest, *tied] if c is not best]
    command, call = _train_calls(study["config"], best)
    return Recommendation(
        optimizer=best["optimizer"], batch_size=best["batch_size"],
        learning_rate=best["learning_rate"], time_to_target=best["time_to_target"],
        steps_to_target=best["steps_to_target"],
        intervals={k: best["intervals"].get(k) for k in ("time_to_target", "steps_to_target")},
        tied_with=tuple((c["optimizer"], c["batch_size"]) for c in tied),
        resolved=not tied and best.get("seeds", 1) > 1, seeds=best.get("seeds", 1),
        command=command, python=call)


def _train_calls(config: dict[str, Any], best: dict[str, Any]) -> tuple[str, str]:
    """The ``kbackend train`` command and the ``kbackend.train`` call at ``best``."""
    target = config["target"]
    data = (f"--dataset {config['dataset']}" if config["dataset"] in DATASETS
            else f"--data {config['dataset']}")
    command = (f"kbackend train --model {config['model']} {data}"
               + (f" --label {config['label']}" if config.get("label") else "")
               + f" --optimizer {best['optimizer']} --lr {best['learning_rate']:g} "
               f"--batch-size {best['batch_size']} --target-metric {target['metric']} "
               f"--target {target['value']:g} --epochs 100 --save best.keras")
    call = (f"kbackend.train({config['model']!r}, data={config['dataset']!r}, "
            f"optimizer={best['optimizer']!r}, learning_rate={best['learning_rate']:g}, "
            f"batch_size={best['batch_size']}, target={target['value']:g}, "
            f"target_metric={target['metric']!r}, epochs=100, save='best.keras')")
    return command, call


def recommendation_lines(best: Recommendation | None) -> list[str]:
    """The study's answer on the console: the cell to train at and the command that does."""
    if best is None:
        return ["No cell reached the target: nothing to recommend (raise the budget with "
                "--max-steps, or lower --target)."]
    ties = ", ".join(f"{o} at batch {b}" for o, b in best.tied_with)
    if best.seeds < 2:
        why = " (one seed: no interval, so not resolved; the fastest median)"
    elif ties:
        why = (f" (tied with {ties} within the intervals: of those, the fewest samples to the "
               "target)")
    else:
        why = " (resolved: the intervals separate it from every other cell)"
    return [f"Recommended: {best.optimizer} at batch {best.batch_size}, lr "
            f"{best.learning_rate:g}{why}.", f"  {best.command}", f"  {best.python}"]


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _samples(cell: dict[str, Any]) -> float:
    samples = cell.get("samples_to_target")
    return samples if samples is not None else cell["steps_to_target"] * cell["batch_size"]


def _span(cell: dict[str, Any]) -> tuple[float, float]:
    interval = (cell.get("intervals") or {}).get("time_to_target") or {}
    return (interval.get("low", cell["time_to_target"]),
            interval.get("high", cell["time_to_target"]))
