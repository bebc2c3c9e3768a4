"""Where a study's time goes, and the time model's arithmetic.

- ``TimeSpent``: this process's study time by phase; ``clock`` is the one clock of a phase
  (wall seconds less the set-up built meanwhile, which is counted as set-up).
- ``apply_time_model``: each cell's time to target from its steps and its measured seconds per
  step (``step_times.StepTimeModel`` measures them).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from kbackend.history import History
from kbackend.study.study_record import Cell, StepTimes
from kbackend.study.summaries import startup_seconds


def apply_time_model(cells: list[Cell], step_times: StepTimes | None) -> list[Cell]:
    """Each cell's time to target = its median steps to target x its median measured seconds
    per step; the interval is [low steps x fastest step time, high steps x slowest step time].
    The runs' own clocks stay in ``time_to_target_runs``. Without a measurement the runs'
    clocks remain the time to target (``time_model: "run clocks"``)."""
    measured = {c.key: c.seconds_per_step for c in step_times.cells} if step_times else {}
    return [_modelled(cell, measured.get((cell.optimizer, int(cell.batch_size))))
            for cell in cells]


def _modelled(cell: Cell, per_step: dict[str, float] | None) -> Cell:
    """``apply_time_model`` of one cell with its measured seconds per step (None: none)."""
    intervals = {**cell.intervals, "time_to_target_runs": cell.intervals.get("time_to_target")}
    timed = replace(cell, intervals=intervals, time_to_target_runs=cell.time_to_target)
    if per_step is None or not per_step.get("n"):
        return replace(timed, time_model="run clocks")
    steps = intervals["steps_to_target"]
    assert steps is not None  # a summarized cell's
    intervals["time_to_target"] = {
        "median": steps["median"] * per_step["median"],
        "low": steps["low"] * per_step["low"], "high": steps["high"] * per_step["high"],
        "n": steps["n"], "coverage": steps["coverage"]}
    return replace(timed, time_model="steps x step time", seconds_per_step=per_step,
                   samples_per_s=int(cell.batch_size) / per_step["median"],
                   time_to_target=(steps["median"] * per_step["median"]) if cell.reached
                   else None)


@dataclass
class TimeSpent:
    """Where this process's study time went, by phase (seconds). Runs reused from the store
    cost nothing here; a population counts once, not once per member (its members share one
    clock)."""

    runs: int = 0          # runs trained in this process
    # wall time around those runs: set-up, compilation, training, evaluation
    runs_wall: float = 0.0
    training: float = 0.0  # their training time (evaluation excluded), start-up included
    startup: float = 0.0   # of it, compilation and first-call overhead
    evaluation: float = 0.0
    step_times: float = 0.0  # the time model
    noise: float = 0.0
    added_seeds: float = 0.0  # sequential seeds and frontier runs (their runs counted above too)
    added_seed_runs: int = 0
    frontier_runs: int = 0
    # Building the model, the seeds' initial values and each cell's trainer (outside the
    # training clock and every other phase): a cell's start-up with its compilation.
    setup: float = 0.0

    def add(self, histories: list[History], wall: float) -> None:
        """Count runs trained together (one run, or a population's members) in ``wall`` s; the
        trainer's construction, where they built it, is set-up (``timing["setup_time"]``)."""
        built = max(h.timing.get("setup_time") or 0.0 for h in histories)
        self.runs += len(histories)
        self.setup += built
        self.runs_wall += wall - built
        self.training += max(h.timing.get("train_time") or 0.0 for h in histories)
        self.startup += max(startup_seconds(h)[0] for h in histories)
        self.evaluation += max(h.timing.get("eval_time") or 0.0 for h in histories)

    def clock(self) -> Callable[[], float]:
        """A phase's clock started now: called, its wall seconds so far less the set-up built
        meanwhile (which counts as set-up)."""
        start, setup_before = time.perf_counter(), self.setup
        return lambda: time.perf_counter() - start - (self.setup - setup_before)

    @property
    def steady_training(self) -> float:
        """Training with the start-ups taken out: the wall time spent in train steps."""
        return max(self.training - self.startup, 0.0)
