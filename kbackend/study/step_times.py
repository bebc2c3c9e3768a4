"""The time model's measurement: each cell's steady seconds per step, timed apart from its runs
in interleaved rounds (``StepTimeModel``); ``timing.apply_time_model`` turns them into times to
target.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from kbackend.engine_facts import engine_facts
from kbackend.engines.native import epoch_runner
from kbackend.hardware.measure import time_interleaved
from kbackend.optim import OptimizerSpec
from kbackend.stats import median_interval
from kbackend.study.runner_protocol import MeasureRunner
from kbackend.study.study_record import Cell, CellStepTime, StepTimes

# A timed call of the time model runs whole fused calls until it lasts STEP_TIME_SECONDS or
# holds STEP_TIME_STEPS steps, whichever comes first. 30 ms is far above the clock's and a
# dispatch's jitter (microseconds); what varies is the machine's load, which only ever slows a
# call. So a round times ROUND_CALLS calls of each cell back to back and keeps the fastest (as
# timeit does): TensorFlow's Adam/SGD step-time log ratio at batch 64 spread 0.28 over ten
# single calls and 0.17 over ten fastest-of-3 at load 4-5 (JAX: 0.10 either way). The
# interleaved rounds spread what load remains over the cells, and the trimmed round mean
# (``verdicts.trimmed_mean``) keeps one burst from deciding. At batch 1,024 of the default study
# a call is 2-4 fused calls of 2 steps, so the step cap binds only for mid-sized batches.
STEP_TIME_STEPS = 64
STEP_TIME_SECONDS = 0.03
ROUND_CALLS = 3
# Within a round the cells are timed batch size by batch size (every optimizer at 8, then at 16,
# ...), so the two cells a per-batch comparison reads are timed moments apart and share the load
# of those moments: their per-round log step-time ratios spread 0.07-0.11 (sd), against 0.09-0.16
# timed a whole grid apart, optimizer by optimizer (default studies on both backends,
# 2026-12-07; docs/study.md, "Time to target").
ROUND_ORDER = "batch-major"

# (optimizer, batch size, learning rate, most steps per timed call, fused steps) of one cell
TimingPlan = tuple[str, int, float, int, int]


def timed_steps(seconds_per_call: float, fused: int, most: int) -> int:
    """Steps per timed call: whole calls of ``fused`` steps until the call lasts
    ``STEP_TIME_SECONDS`` (by ``seconds_per_call``, one call's time) or holds ``most``."""
    calls = math.ceil(STEP_TIME_SECONDS / max(seconds_per_call, 1e-9))
    return fused * max(1, min(calls, most // fused))


class StepTimeModel:
    """Times the cells of ``runner``'s study (their optimizer, batch size and best rate)."""

    def __init__(self, runner: MeasureRunner) -> None:
        self.runner = runner

    def plan(self, cell: Cell) -> tuple[int, int]:
        """(most steps per timed call, fused steps) for timing one cell: the native engine's
        compiled step with the training's K when the study's engine fuses steps, else one step
        per call; at most ``STEP_TIME_STEPS`` steps rounded up to whole calls of K (fewer where
        whole calls reach ``STEP_TIME_SECONDS`` sooner: ``timed_steps``)."""
        run = self.runner.plan(cell.optimizer, int(cell.batch_size), cell.learning_rate)
        fused = max(1, run.fused_steps)
        return fused * -(-STEP_TIME_STEPS // fused), fused

    def timer(self, cell: Cell, steps: int) -> Callable[[], Any]:
        """A callable that trains ``steps`` steps (whole calls of the cell's K) of the cell's
        compiled native step (its optimizer, batch size and best rate): with the native engine,
        the very program the cell's runs trained with (nothing is compiled); else on a copy of
        its model."""
        runner = self.runner
        assert runner.dataset is not None
        fused = self.plan(cell)[1]
        if engine_facts(runner.config.engine).compiled_cells:
            plan = runner.plan(cell.optimizer, int(cell.batch_size), cell.learning_rate)
            return runner.native_runs().step_timer(runner.train_config(plan),
                                                   runner.initial_values(runner.config.seed),
                                                   steps)
        batch = int(cell.batch_size)
        rows = np.arange(steps * batch) % runner.num_train  # whole batches, wrapping the data
        subset = replace(runner.dataset, x_train=runner.dataset.x_train[rows],
                         y_train=runner.dataset.y_train[rows])
        return epoch_runner(runner.build_model(), subset,
                            OptimizerSpec(cell.optimizer, cell.learning_rate),
                            batch, fused, runner.config.seed)

    def measure(self, cells: list[Cell]) -> StepTimes | None:
        """Each cell's steady seconds per step, in ``step_time_repeats`` interleaved rounds: in
        each round every cell times ``ROUND_CALLS`` calls of ``timed_steps`` steps and keeps
        the fastest, batch size by batch size (``ROUND_ORDER``), in an order rotated by the
        round, so a load that comes and goes spreads over every cell alike. The first calls
        of each cell (compilation, warm-up, the estimate that sizes its timed call) are not
        timed. Stored, so a resumed study reuses it."""
        runner = self.runner
        repeats = runner.config.step_time_repeats
        if repeats == 0 or not cells:
            return None
        plans: list[TimingPlan] = [
            (c.optimizer, int(c.batch_size), c.learning_rate, *self.plan(c)) for c in cells]
        key_config = {"kind": "steptime", **runner.content_identity(),
                      "seed": runner.config.seed,
                      "cells": plans, "repeats": repeats, "engine": runner.config.engine,
                      "min_seconds": STEP_TIME_SECONDS, "round_calls": ROUND_CALLS,
                      "round_order": ROUND_ORDER, **runner.env}
        return StepTimes.from_json(runner.stored_or_measured(
            "steptime", "timing", key_config, None,
            lambda: self._time(cells, plans, repeats).to_json()))

    def _time(self, cells: list[Cell], plans: list[TimingPlan],
              repeats: int) -> StepTimes:
        native = engine_facts(self.runner.config.engine).compiled_cells
        timers: list[Callable[[], Any]] = []
        steps: list[int] = []
        built: list[float] = []
        for cell, plan in zip(cells, plans, strict=True):
            start = time.perf_counter()
            if native:  # the cell's programs exist: size the call (a warm-up, then one call)
                one_call = time_interleaved({0: self.timer(cell, plan[4])}, 1,
                                            wait=lambda result: result)[0]
                steps.append(timed_steps(one_call.median_s, plan[4], plan[3]))
            else:  # a fresh model per timer, compiled by its first call: one timer, full size
                steps.append(plan[3])
            timers.append(self.timer(cell, steps[-1]))
            built.append(time.perf_counter() - start)
        # Each timer's first call is an untimed warm-up: it compiles (keras engines) or places
        # its state and rows (native: 5-10x a steady call, measured at batch 16-64).
        order = sorted(range(len(cells)), key=lambda i: (int(cells[i].batch_size), i))
        # the timers wait for their own results
        timings = time_interleaved({i: timers[i] for i in order}, repeats,
                                   wait=lambda result: result, best_of=ROUND_CALLS)
        rows = []
        for index, (plan, n) in enumerate(zip(plans, steps, strict=True)):
            timing, seconds = timings[index], [t / n for t in timings[index].times]
            rows.append(CellStepTime(plan[0], plan[1], plan[2], n, plan[4],
                                     built[index] + timing.first_call_s, tuple(seconds),
                                     median_interval(seconds), timing.cv))
        return StepTimes("native", self.runner.config.engine, repeats, STEP_TIME_SECONDS,
                         ROUND_CALLS, tuple(rows))
