"""The gradient noise scale of a study, measured along one cell's training
(``NoiseMeasurement``): training in segments to each checkpoint, the estimator of ``noise``
at each, one retry with a wider batch pair where the first pair cannot tell the two squared
norms apart. Stored, so a resumed study reuses it.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from kbackend.backends import impl
from kbackend.engine_facts import engine_facts
from kbackend.engines.native import model_values, set_model_values
from kbackend.study.config import REFERENCE_BATCH
from kbackend.study.noise import measure_noise_scale
from kbackend.study.runner_protocol import MeasureRunner
from kbackend.study.scaling import training_noise_scale
from kbackend.study.study_record import Cell, NoisePoint, NoiseScale
from kbackend.study.summaries import RunPlan
from kbackend.training import train


class NoiseMeasurement:
    """B_simple along the training of one cell of ``runner``'s study."""

    def __init__(self, runner: MeasureRunner) -> None:
        self.runner = runner

    def reference(self, cells: list[Cell]) -> Cell | None:
        """The cell whose training run the noise scale is measured along: plain SGD if studied
        (its update has no state, so training in segments is exact), at the grid's batch size
        nearest 32, with its tuned learning rate, up to its steps to target."""
        config = self.runner.config
        if config.noise_points == 0 or not cells:
            return None
        optimizer = "sgd" if "sgd" in config.optimizers else config.optimizers[0]
        batch = min(self.runner.batch_sizes,
                    key=lambda b: (abs(math.log(b / REFERENCE_BATCH)), b))
        return next(c for c in cells if c.optimizer == optimizer and c.batch_size == batch)

    def run(self, cells: list[Cell]) -> NoiseScale | None:
        """Measure B_simple at ``noise_points`` points along the reference cell's training."""
        runner = self.runner
        cell = self.reference(cells)
        if cell is None:
            return None
        small, big = runner.noise_batches
        horizon = round(cell.steps_to_target or cell.steps_run or 0)
        plan = runner.plan(cell.optimizer, int(cell.batch_size), cell.learning_rate)
        points = runner.config.noise_points
        checkpoints = sorted({round(horizon * i / max(1, points - 1)) for i in range(points)})
        key_config = {**runner.run_key_config(plan), "kind": "noise",
                      "checkpoints": checkpoints, "small_batch": small, "big_batch": big,
                      "draws": runner.config.noise_draws}
        return NoiseScale.from_json(runner.stored_or_measured(
            "noise", "noise", key_config, plan,
            lambda: self._with_retry(plan, checkpoints, small, big).to_json()))

    def _with_retry(self, plan: RunPlan, checkpoints: list[int], small: int,
                    big: int) -> NoiseScale:
        result = self.result(plan, checkpoints, small, big)
        wider = (max(1, small // 4), min(self.runner.num_train, big * 4))
        if training_noise_scale(result) is None and wider != (small, big):
            # A pair further apart separates the two squared norms more: one retry.
            retry = self.result(plan, checkpoints, *wider)
            result = replace(retry, first_try={"small_batch": result.small_batch,
                                               "big_batch": result.big_batch,
                                               "b_simple_final": result.b_simple_final})
        return result

    def result(self, plan: RunPlan, checkpoints: list[int], small: int,
               big: int) -> NoiseScale:
        """One noise-scale measurement along ``plan`` with the batch pair (small, big)."""
        points = self.measure(plan, checkpoints, small, big)
        estimates = [p for p in points if p.step > 0]
        final = estimates[-1] if estimates else points[-1]
        return NoiseScale(plan.optimizer, plan.batch_size, plan.learning_rate, small, big,
                          self.runner.config.noise_draws, tuple(points), final.b_simple)

    def measure(self, plan: RunPlan, checkpoints: list[int], small: int,
                big: int) -> list[NoisePoint]:
        """Train in segments to each checkpoint and estimate the noise scale there."""
        runner = self.runner
        dataset, seed = runner.dataset, runner.config.seed
        assert dataset is not None
        native = engine_facts(runner.config.engine).compiled_cells
        # The native engine trains the segments on the cells' compiled programs (Runs writes
        # each segment's result into its model); other engines train a model of their own.
        if native:
            model = runner.native_runs().model
            set_model_values(model, runner.initial_values(seed))
        else:
            model = runner.build_model()
        rng = np.random.default_rng(seed)

        def gradients(xb: Any, yb: Any) -> Any:
            return impl().gradients(model, xb, yb, training=False, task=runner.task)[1]

        points: list[NoisePoint] = []
        done = 0
        for index, checkpoint in enumerate(checkpoints):
            if checkpoint > done:
                # A fresh seed per segment so segments do not replay the same shuffle.
                config = runner.train_config(plan, max_steps=checkpoint - done, target=False,
                                             seed=seed + index)
                if native:
                    history = runner.native_runs().train(config, model_values(model))
                else:
                    history = train(config, dataset=dataset, model=model).history
                done += history.steps_run
            estimate = measure_noise_scale(gradients, dataset.x_train, dataset.y_train, small,
                                           big, runner.config.noise_draws, rng)
            points.append(NoisePoint(done, **estimate.to_dict()))
        return points
