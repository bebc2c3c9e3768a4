"""The accuracy each batch size reaches: per cell and seed, a run of its best learning rate on an
equal budget (``frontier_epochs`` epochs, the same for every cell) that does not stop at the
target, recording the best validation value of the target metric and the test metric of that
checkpoint. Beside each cell's time to target, these give the time-vs-accuracy frontier.

The test metric is taken at the best checkpoint itself: each evaluation that improves on the
best validation value so far (``kbackend.task.better``) evaluates the test split there, on the
device, so no checkpoint is copied or restored. Those test evaluations are timed and moved from
the run's training time to its evaluation time.

Native engine only (its ``Runs`` give the trainer to evaluate on); other engines report the
frontier as not measured. Each frontier run is stored (kind ``"frontier"``, keyed by the run's
configuration and the budget), so a resumed study reuses it.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kbackend.data.batching import steps_per_epoch
from kbackend.engine_facts import engine_facts
from kbackend.io import JsonObject
from kbackend.stats import median_interval
from kbackend.study.runner_protocol import MeasureRunner
from kbackend.study.study_record import Cell, Frontier
from kbackend.task import better

if TYPE_CHECKING:
    from kbackend.study.config import StudyConfig


class BestCheckpoint:
    """A loop reporter: at each evaluation that improves ``metric``, the test split's loss and
    metric of the model as it is at that evaluation."""

    def __init__(self, trainer: Any, metric: str) -> None:
        self.trainer, self.metric = trainer, metric
        self.best: float | None = None
        self.at: dict[str, float] = {}  # step, epoch, test loss and metric of the best
        self.seconds = 0.0

    def epoch_end(self, epoch: int, epochs: int, record: dict[str, Any]) -> None:
        """Called by the loop after every evaluation (``record`` holds its values)."""
        value = record.get(self.metric)
        if value is None or not math.isfinite(value):
            return
        if self.best is None or better(self.metric, value, self.best):
            start = time.perf_counter()
            test_loss, test_metric = self.trainer.evaluate_test()
            self.seconds += time.perf_counter() - start
            self.best = float(value)
            self.at = {"step": record["step"], "epoch": epoch, "test_loss": float(test_loss),
                       "test_metric": float(test_metric)}


def why_no_frontier(config: StudyConfig) -> str | None:
    """Why ``config``'s study runs no frontier runs, in a few words; None when it does."""
    if not engine_facts(config.engine).compiled_cells:
        return f"the {config.engine} engine runs none"
    if config.frontier_epochs <= 0:
        return "their budget is 0 epochs: --frontier-epochs, frontier_epochs= in Python"
    return None


def frontier_run(runner: MeasureRunner, cell: Cell, seed: int) -> JsonObject:
    """The stored frontier figures of ``cell``'s best rate with ``seed`` (trained if missing):
    the store's row, as a run's stored result is."""
    config = runner.config
    size = int(cell.batch_size)
    per_epoch = steps_per_epoch(runner.num_train, size)
    plan = replace(runner.plan(cell.optimizer, size, cell.learning_rate, seed=seed),
                   max_steps=config.frontier_epochs * per_epoch)
    metric = config.resolved_target.metric
    key_config = {**runner.run_key_config(plan), "kind": "frontier",
                  "frontier_epochs": config.frontier_epochs, "metric": metric}

    def measure() -> JsonObject:
        train_config = runner.train_config(plan, target=False)
        runs = runner.native_runs()
        reporter = BestCheckpoint(runs.trainer(train_config), metric)
        elapsed = runner.time_spent.clock()
        history = runs.train(train_config, runner.initial_values(seed), reporter=reporter)
        # the test evaluations at each new best are evaluation, not training
        history.timing["train_time"] = (history.timing.get("train_time") or 0.0) - reporter.seconds
        history.timing["eval_time"] = (history.timing.get("eval_time") or 0.0) + reporter.seconds
        runner.time_spent.add([history], elapsed())
        runner.time_spent.frontier_runs += 1
        return {"seed": seed, "epochs": config.frontier_epochs, "steps_run": history.steps_run,
                "wall_time": history.timing.get("wall_time"),
                "metric": metric, "best_metric": reporter.best, **reporter.at,
                "test_metric_name": next((k for k in history.test if k != "test_loss"), None),
                "final_test_metric": next((v for k, v in history.test.items()
                                           if k != "test_loss"), None),
                "diverged": history.record.diverged is not None,
                "evals": [{k: e.get(k) for k in ("step", "epoch", metric)}
                          for e in history.evals]}

    return runner.stored_or_measured("frontier", "frontier", key_config, plan, measure)


def summarize_frontier(results: list[JsonObject]) -> Frontier:
    """A cell's frontier figures over its seeds (their stored rows, ``frontier_run``): medians
    with order-statistic intervals, and the per-seed values the paired verdicts read."""
    best = {str(r["seed"]): float(r["best_metric"]) for r in results
            if r.get("best_metric") is not None}
    test = {str(r["seed"]): float(r["test_metric"]) for r in results
            if r.get("test_metric") is not None}
    first = results[0] if results else {}
    return Frontier(
        epochs=first.get("epochs"),
        steps=max((int(r["steps_run"]) for r in results if r.get("steps_run") is not None),
                  default=None),
        seeds=len(results), metric=first.get("metric"),
        test_metric_name=first.get("test_metric_name"),
        best_metric=median_interval(list(best.values())),
        test_metric=median_interval(list(test.values())),
        best_epoch=median_interval([float(r["epoch"]) for r in results if r.get("epoch")]),
        seed_best=best, seed_test=test)


def measure_frontier(runner: MeasureRunner, cell: Cell,
                     seeds: list[int]) -> tuple[Frontier, float]:
    """Frontier runs for ``seeds`` of ``cell`` (stored ones reused): their summary (the cell's
    ``frontier``) and the seconds those runs recorded (stored or not)."""
    results = [frontier_run(runner, cell, seed) for seed in seeds]
    return summarize_frontier(results), sum(r.get("wall_time") or 0.0 for r in results)
