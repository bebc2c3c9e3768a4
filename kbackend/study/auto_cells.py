"""The study's auto cells (``--batch-sizes ...,auto``, issue 37): one per optimizer, the adaptive
batch size growing from the study's smallest fixed batch size (MIN) to its largest (MAX), its
base rate (the rate at MIN) searched like any cell's and its seeds the study's own. Each run is
an ordinary stored run whose key holds ``auto:MIN:MAX`` and the rate scaling, so a resumed study
reuses it; the cells stay out of the fixed grid's analyses (scaling regions, step times, added
seeds, noise) and are compared with each optimizer's best fixed batch size
(``auto_verdicts``).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from kbackend.stats import log_log_interpolate, median_interval
from kbackend.study.auto_verdicts import AUTO_TIME_MODEL
from kbackend.study.runner_protocol import CellRunner
from kbackend.study.search import RateSearch
from kbackend.study.store import StoredRun
from kbackend.study.study_record import Cell
from kbackend.study.summaries import (
    adaptive_ranges,
    adaptive_samples,
    cell_seconds_per_step,
    ranges_time,
    run_steps,
    trajectory_record,
)

AUTO_LABEL = "auto"


def auto_cell_runs(runner: CellRunner) -> int:
    """Runs the auto cells hold before any extension (for the progress bar)."""
    config = runner.config
    bounds = config.auto_bounds
    if bounds is None or bounds.minimum is None:
        return 0
    return config.seeds * sum(len(config.learning_rate_grid(o, bounds.minimum))
                              for o in config.optimizers)


def run_auto_cell(runner: CellRunner, optimizer: str) -> tuple[Cell, list[StoredRun]]:
    """One optimizer's auto cell: its rate search (``RateSearch`` with the adaptive batch size,
    one run at a time), and its runs."""
    bounds = runner.config.auto_bounds
    assert bounds is not None and bounds.minimum is not None and bounds.maximum is not None
    cell, runs = RateSearch(runner, bounds.maximum, runner.config.lr_scaling).run_cell(
        optimizer, bounds.minimum)
    return replace(cell, batch_size=AUTO_LABEL,
                   auto={"min": bounds.minimum, "max": bounds.maximum,
                         "lr_scaling": runner.config.lr_scaling}), runs


def step_time_at(cells: list[Cell], optimizer: str, batch_size: int) -> float | None:
    """Seconds per step of ``optimizer`` at ``batch_size``: its fixed cells' step times
    (``seconds_per_step`` of the time model, else their run clocks' time / steps) interpolated
    linearly in log batch size x log seconds; None outside the fixed sizes or without times."""
    points = {}
    for cell in cells:
        per_step = cell_seconds_per_step(cell) if cell.optimizer == optimizer else None
        if per_step and per_step > 0:
            points[int(cell.batch_size)] = per_step
    return log_log_interpolate(points, batch_size)


def modelled_time(ranges: list[dict[str, float]], step: int, cells: list[Cell],
                  optimizer: str) -> float | None:
    """Training seconds to ``step`` of an adaptive run: each range's steps up to ``step`` times
    the fixed cells' seconds per step at its size (``step_time_at``); None where one is not
    known. The estimator's measured steps and the recompilations at each size are not in it."""
    return ranges_time(ranges, step, lambda size: step_time_at(cells, optimizer, size))


def finish_auto_cells(runner: CellRunner, auto_cells: list[Cell],
                      cells: list[Cell]) -> list[Cell]:
    """Per seed of each auto cell's best rate: samples to target, modelled time to target
    (``modelled_time``, the run's own clock where it cannot be modelled), and the ranges; the
    cell's time to target becomes the median modelled time (the runs' clocks kept apart)."""
    return [_finished(runner, cell, cells) for cell in auto_cells]


def _finished(runner: CellRunner, cell: Cell, cells: list[Cell]) -> Cell:
    """``finish_auto_cells`` of one auto cell."""
    samples: dict[str, float] = {}
    times: dict[str, float] = {}
    ranges_by_seed: dict[str, list[dict[str, float]]] = {}
    modelled = True
    for key in cell.run_keys:
        record = runner.stored_record(key)
        assert record is not None  # the cell's runs are stored
        seed = str(record.config["seed"])
        ranges = adaptive_ranges(trajectory_record(record.trajectory))
        ranges_by_seed[seed] = ranges
        steps = run_steps(record)
        if not math.isfinite(steps):
            samples[seed] = times[seed] = math.inf
            continue
        samples[seed] = float(adaptive_samples(ranges, int(steps)))
        seconds = modelled_time(ranges, int(steps), cells, cell.optimizer)
        if seconds is None:
            modelled = False
            seconds = record.result.get("time_to_target") or math.inf
        times[seed] = seconds
    intervals = {**cell.intervals, "time_to_target_runs": cell.intervals.get("time_to_target")}
    intervals["time_to_target"] = median_interval(list(times.values()))
    intervals["samples_to_target"] = median_interval(list(samples.values()))
    finite = sorted(t for t in times.values() if math.isfinite(t))
    grown = [max(int(r["batch_size"]) for r in ranges) for ranges in ranges_by_seed.values()
             if ranges]
    return replace(cell, seed_samples=samples, seed_times=times, ranges=ranges_by_seed,
                   time_to_target_runs=cell.time_to_target, intervals=intervals,
                   time_model=AUTO_TIME_MODEL if modelled else "run clocks",
                   time_to_target=float(np.median(list(times.values())))
                   if cell.reached and finite else cell.time_to_target,
                   largest_batch=max(grown) if grown else None)
