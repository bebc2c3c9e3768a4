"""A study's runs for the tools Keras users read: ``runs.csv`` (one row per run, for pandas) and
TensorBoard run folders with the HParams plugin's experiment.

Both are written from the study's stored runs (``StudyRecord.all_runs``), so
a resumed study writes the same rows and adds only the run folders it lacks: a run's folder is
named by its settings and its store key, and one that exists is left as it is.
"""

from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kbackend.io import atomic_write_text, temp_folder
from kbackend.study.store import StoredRun
from kbackend.study.study_record import StudyRecord
from kbackend.tensorboard_logs import evaluation_scalars, write_experiment, write_run

RUNS_CSV = "runs.csv"
RUN_COLUMNS = ("optimizer", "batch_size", "learning_rate", "seed", "max_steps", "reached",
               "steps_to_target", "time_to_target", "best_metric", "test_metric",
               "test_metric_name", "steps_run", "samples_per_s", "reused", "key")


def run_row(run: StoredRun, started_at: float | None) -> dict[str, Any]:
    """One ``runs.csv`` row: the run's settings, seed and figures; ``reused``: stored before
    this invocation started (``started_at``, a ``time.time()``), so not trained by it."""
    config, result = run.config, run.result
    optimizer = config["optimizer"]
    finished = run.finished_at
    return {
        "optimizer": optimizer["name"] if isinstance(optimizer, dict) else optimizer,
        "batch_size": config["batch_size"], "learning_rate": config["learning_rate"],
        "seed": config["seed"], "max_steps": config.get("max_steps"),
        "reached": bool(result.get("reached")),
        "steps_to_target": result.get("steps_to_target"),
        "time_to_target": result.get("time_to_target"),
        "best_metric": result.get("best_metric"), "test_metric": result.get("test_metric"),
        "test_metric_name": result.get("test_metric_name"), "steps_run": result.get("steps_run"),
        "samples_per_s": result.get("samples_per_s"),
        "reused": bool(started_at is not None and finished is not None
                       and finished < started_at),
        "key": run.key,
    }


def runs_csv_text(study: StudyRecord, started_at: float | None) -> str:
    """``runs.csv``'s text: a header of ``RUN_COLUMNS``, one row per run (empty cells where a
    figure is missing or not finite)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, RUN_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for run in study.all_runs:
        row = run_row(run, started_at)
        writer.writerow({k: "" if _missing(v) else v for k, v in row.items()})
    return out.getvalue()


def write_runs_csv(study: StudyRecord, folder: str | os.PathLike,
                   started_at: float | None) -> Path:
    """``folder/runs.csv``, atomically."""
    return atomic_write_text(Path(folder) / RUNS_CSV, runs_csv_text(study, started_at))


def run_name(run: StoredRun) -> str:
    """A run's folder: its optimizer, batch size, rate and seed, and its store key's start (so
    a pruned run and its full re-run, or a changed setup, are folders of their own)."""
    row = run_row(run, None)
    batch = str(row["batch_size"]).replace(":", "-")
    return (f"{row['optimizer']}-b{batch}-lr{row['learning_rate']:g}-seed{row['seed']}-"
            f"{run.key[:8]}")


def run_points(run: StoredRun) -> Iterator[tuple[int, dict[str, float]]]:
    """Each evaluation's scalars of a stored run (as ``train --tensorboard`` writes them): the
    batch size and rate of an auto run are those of its step range."""
    config, trajectory = run.config, run.trajectory or {}
    adaptive = (trajectory.get("record") or {}).get("adaptive_batch") or {}
    ranges = adaptive.get("ranges") or []
    auto = isinstance(config["batch_size"], str)
    previous: dict[str, Any] | None = None
    for record in trajectory.get("evals") or []:
        start = previous["step"] if previous else 0
        current = [r for r in ranges if r["step"] <= start][-1:] or [None]
        batch = current[0]["batch_size"] if current[0] else adaptive.get("min", 0)
        rate = current[0]["learning_rate"] if current[0] else config["learning_rate"]
        if not auto:
            batch = config["batch_size"]
        yield int(record["step"]), evaluation_scalars(record, previous, batch, rate, auto)
        previous = record


def write_tensorboard(study: StudyRecord, logdir: str | os.PathLike) -> list[Path]:
    """Every stored run as a TensorBoard run folder under ``logdir`` (those missing), and the
    HParams experiment (optimizer, batch size, learning rate; steps and time to target, the
    best validation value) at its top. Returns the folders written now."""
    logdir = Path(logdir)
    runs = study.all_runs
    metric = study.target["metric"]
    metrics = {"steps_to_target": "steps to target", "time_to_target": "time to target (s)",
               f"best_{metric}": f"best {metric}"}
    # One type per hparam (the plugin's domains are typed): batch sizes are text where an auto
    # cell's "auto:MIN:MAX" is among them.
    as_text = any(isinstance(r.config["batch_size"], str) for r in runs)
    rows = [run_row(run, None) for run in runs]
    hparams = [{"optimizer": row["optimizer"],
                "batch_size": str(row["batch_size"]) if as_text else int(row["batch_size"]),
                "learning_rate": float(row["learning_rate"])} for row in rows]
    written = []
    for run, row, run_hparams in zip(runs, rows, hparams, strict=True):
        folder = logdir / run_name(run)
        if folder.is_dir() and any(folder.glob("events.out.tfevents.*")):
            continue  # written by an earlier invocation: the same stored run
        staging = temp_folder(folder)  # moved into place whole: a killed write leaves none
        write_run(staging, run_points(run), run_hparams,
                  {"steps_to_target": row["steps_to_target"],
                   "time_to_target": row["time_to_target"],
                   f"best_{metric}": row["best_metric"]})
        if folder.is_dir():
            folder.rmdir()  # empty (a folder holding other files is refused, not removed)
        staging.rename(folder)
        written.append(folder)
    _write_experiment(logdir, {name: [h[name] for h in hparams]
                               for name in ("optimizer", "batch_size", "learning_rate")}, metrics)
    return written


def _write_experiment(logdir: Path, hparams: dict[str, list[Any]],
                      metrics: dict[str, str]) -> None:
    """The experiment's event file at ``logdir``'s top, replacing the one an earlier invocation
    wrote (its grid may have grown), written apart and moved in."""
    staging = temp_folder(logdir / ".experiment")
    try:
        write_experiment(staging, hparams, metrics)
        for old in logdir.glob("events.out.tfevents.*"):
            old.unlink()
        for new in staging.glob("events.out.tfevents.*"):
            new.rename(logdir / new.name)
    finally:
        for left in staging.iterdir():
            left.unlink()
        staging.rmdir()


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and not math.isfinite(value))
