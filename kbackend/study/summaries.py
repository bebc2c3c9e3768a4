"""A study's figures: one run's (``summarize_run``), a learning rate's rank over its seeds
(``rate_score``, ``best_rate``) and a cell's medians with their intervals (``summarize_cell``),
all re-derived from stored trajectories (``history_from_trajectory``) so stored runs follow this
code.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from kbackend.data.batching import steps_per_epoch
from kbackend.history import History, RunRecord
from kbackend.io import JsonObject
from kbackend.stats import median_interval
from kbackend.training import Target

if TYPE_CHECKING:  # the store opens SQLite: not at the train command's set-up (test_startup)
    from kbackend.study.store import StoredRun
    from kbackend.study.study_record import Cell


@dataclass(frozen=True)
class RunPlan:
    """One training run of the grid."""

    optimizer: str
    batch_size: int
    learning_rate: float
    max_steps: int
    eval_every: int
    fused_steps: int
    seed: int = 0
    # An auto cell's run (the adaptive batch size): ``batch_size`` is its MIN, this its MAX
    # (0: a fixed batch size), ``lr_scaling`` how its rate (the rate at MIN) follows the batch.
    auto_max: int = 0
    lr_scaling: str = ""

    @property
    def batch_label(self) -> str:
        """``"32"``, or ``"auto:32:512"`` for an auto cell's run (its store key's batch size)."""
        return f"auto:{self.batch_size}:{self.auto_max}" if self.auto_max else str(self.batch_size)

    def label(self) -> str:
        return (f"{self.optimizer} B={self.batch_label} lr={self.learning_rate:g} "
                f"seed={self.seed}")


def plan_from_key_config(config: JsonObject) -> RunPlan:
    """The plan a stored run's key configuration describes (``StudyRunner.run_key_config``)."""
    batch, auto_max = config["batch_size"], 0
    if isinstance(batch, str):  # "auto:MIN:MAX"
        _, low, high = batch.split(":")
        batch, auto_max = int(low), int(high)
    return RunPlan(config["optimizer"]["name"], batch, config["learning_rate"],
                   config["max_steps"], config["eval_every"], config["fused_steps"],
                   config["seed"], auto_max, config.get("lr_scaling", ""))


def adaptive_ranges(record: RunRecord) -> list[dict[str, float]]:
    """An adaptive run's step ranges (each from its ``step`` on), [] for a fixed batch size."""
    return list((record.adaptive_batch or {}).get("ranges") or [])


def ranges_time(ranges: list[dict[str, float]], step: int,
                per_step: Callable[[int], float | None]) -> float | None:
    """An adaptive run's cost to the end of ``step``: each range's steps up to ``step`` (a range
    from step s covers steps s+1 to the next range's) times ``per_step`` of its batch size;
    None where one is not known."""
    total = 0.0
    for index, entry in enumerate(ranges):
        start = int(entry["step"])
        end = int(ranges[index + 1]["step"]) if index + 1 < len(ranges) else step
        steps = max(0, min(end, step) - start)
        if not steps:
            continue
        per = per_step(int(entry["batch_size"]))
        if per is None:
            return None
        total += steps * per
    return total


def adaptive_samples(ranges: list[dict[str, float]], step: int) -> int:
    """Samples an adaptive run trained on by the end of ``step`` (``ranges_time`` at one
    sample per sample)."""
    return int(ranges_time(ranges, step, float) or 0)


def cell_seconds_per_step(cell: Cell) -> float | None:
    """A cell's seconds per step here: the time model's median, else its runs' clocks (time to
    target / steps to target)."""
    per_step = (cell.seconds_per_step or {}).get("median")
    if per_step is None and cell.time_to_target and cell.steps_to_target:
        per_step = cell.time_to_target / cell.steps_to_target
    return per_step


def samples_seen(step: int, num_train: int, batch_size: int, drops_remainder: bool = False) -> int:
    """Training samples processed by the end of ``step``."""
    if drops_remainder:
        return int(step) * batch_size
    per_epoch = steps_per_epoch(num_train, batch_size, drops_last=False)
    full_epochs, rest = divmod(int(step), per_epoch)
    return full_epochs * num_train + rest * batch_size


def drops_partial_batch(history: History) -> bool:
    """Whether the run's engine drops each epoch's partial batch (the native engine records
    how many samples it drops; Keras fit drops none)."""
    return history.record.dropped_per_epoch is not None


def samples_trained(history: History, step: int, num_train: int, batch_size: int) -> int:
    """Training samples a run processed by the end of ``step``: over its ranges where its batch
    size adapted (``adaptive_samples``), else at ``batch_size`` (``samples_seen``)."""
    ranges = adaptive_ranges(history.record)
    if ranges:
        return adaptive_samples(ranges, step)
    return samples_seen(step, num_train, batch_size, drops_partial_batch(history))


def steady_throughput(history: History, num_train: int, batch_size: int,
                      startup: float = 0.0) -> float:
    """Samples/s over the run's training time with its start-up (compilation) taken out."""
    seconds = (history.timing.get("train_time") or 0.0) - startup
    if not history.step or seconds <= 0:
        return math.nan
    return samples_trained(history, history.steps_run, num_train, batch_size) / seconds


def startup_seconds(history: History) -> tuple[float, bool]:
    """Per-run start-up time inside the training time (compilation and first-call overhead),
    and whether it is estimated rather than reported by the engine.

    Engines that time their compilation report it (``timing["compile_time"]``), but a first
    call can cost more than its compilation (Keras fit compiles inside its first step; a first
    XLA call on TF also pays for allocation and autotuning). With two or more evaluations the
    start-up is estimated as the training time at the first evaluation minus its steps at the
    median per-step time of the later evaluation intervals; the larger of that and the reported
    compile time is used. Without them: the reported compile time, or for engines that report
    none, the first step's time minus the median step time.
    """
    reported = history.timing.get("compile_time")
    evals = [e for e in history.evals if "step" in e and "train_time" in e]
    rates = [(b["train_time"] - a["train_time"]) / (b["step"] - a["step"])
             for a, b in itertools.pairwise(evals) if b["step"] > a["step"]]
    if rates:
        estimate = max(0.0, evals[0]["train_time"] - evals[0]["step"] * float(np.median(rates)))
        if reported is None or estimate > reported:
            return estimate, True
        return float(reported), False
    if reported is not None:
        return float(reported), False
    times = np.asarray(history.time, dtype=float)
    if times.size < 3:
        return 0.0, True
    return max(0.0, float(times[0] - np.median(np.diff(times)))), True


def trajectory_record(trajectory: JsonObject | None) -> RunRecord:
    """The ``RunRecord`` of a stored trajectory: its ``record`` (``RunRecord.to_dict``), or the
    ``extra`` dict a trajectory stored before the record existed holds instead (none: empty)."""
    trajectory = trajectory or {}
    stored = trajectory.get("record")
    return RunRecord.from_dict(stored if stored is not None else trajectory.get("extra") or {})


def history_from_trajectory(trajectory: JsonObject, result: JsonObject) -> History:
    """Rebuild a run's ``History`` from its stored trajectory (to re-derive its figures)."""
    history = History(step=list(trajectory["step"]), loss=list(trajectory["loss"]),
                      time=list(trajectory["time"]), evals=list(trajectory["evals"]),
                      timing=dict(trajectory.get("timing", {})),
                      record=trajectory_record(trajectory))
    history.test = {k: result[k] for k in ("test_accuracy", "test_loss")
                    if result.get(k) is not None}
    # the task's own test metric (test_mae, ...): kept, so a resumed study's table shows it
    if result.get("test_metric_name") and result.get("test_metric") is not None:
        history.test[result["test_metric_name"]] = result["test_metric"]
    if history.record.target_reached is None and result.get("reached"):
        # Stored before the engine's record was kept: the reaching evaluation is the last one.
        last = history.evals[-1]
        history.record.target_reached = {"step": last["step"], "epoch": last.get("epoch"),
                                         "train_time": last["train_time"]}
    return history


def time_to_target(history: History) -> tuple[float, float]:
    """(time to target, wall to target) of a run that reached its target: training time up to
    the evaluation that reached it, without evaluation; the first without the run's start-up
    (compilation, first calls: ``startup_seconds``), the second with it (docs/study.md)."""
    reached = history.record.target_reached
    assert reached is not None
    wall = float(reached["train_time"])
    return max(wall - startup_seconds(history)[0], 0.0), wall


@dataclass(frozen=True)
class RunFigures:
    """The figures of one finished run (``summarize_run``); ``to_json`` is its stored result."""

    reached: bool
    steps_run: int
    train_time: float | None
    eval_time: float | None
    wall_time: float | None
    compile_time: float | None
    startup_time: float
    startup_time_estimated: bool
    samples_per_s: float
    best_val_accuracy: float | None
    best_val_loss: float | None
    best_metric: float | None
    final_train_loss: float | None
    diverged: bool
    test_accuracy: float | None
    test_metric: float | None  # the task's own (test_accuracy, test_mae, ...)
    test_metric_name: str | None
    test_loss: float | None
    evaluations: int
    drops_partial_batch: bool
    steps_to_target: int | None = None
    samples_to_target: int | None = None
    epochs_to_target: float | None = None
    time_to_target_raw: float | None = None
    time_to_target: float | None = None

    def to_json(self) -> JsonObject:
        return dict(vars(self))


def summarize_run(history: History, plan: RunPlan, target: Target,
                  num_train: int) -> RunFigures:
    """The figures of one finished run.

    Time to target is training time only: the engines exclude evaluation from ``train_time``,
    and the per-run start-up (compilation, first-call overhead: ``startup_seconds``) is
    subtracted too, so runs of a few seconds are not ranked by their compile times;
    ``time_to_target_raw`` keeps it in.
    """
    reached = history.record.target_reached
    losses = np.asarray(history.loss, dtype=float)
    startup, estimated = startup_seconds(history)
    figures = RunFigures(
        reached=reached is not None,
        steps_run=history.steps_run,
        train_time=history.timing.get("train_time"),
        eval_time=history.timing.get("eval_time"),
        wall_time=history.timing.get("wall_time"),
        compile_time=history.timing.get("compile_time"),
        startup_time=startup,
        startup_time_estimated=estimated,
        samples_per_s=steady_throughput(history, num_train, plan.batch_size, startup),
        best_val_accuracy=history.best("val_accuracy"),
        best_val_loss=history.best("val_loss"),
        best_metric=history.best(target.metric),
        final_train_loss=float(losses[-1]) if losses.size else None,
        diverged=history.record.diverged is not None
        or bool(losses.size and not np.all(np.isfinite(losses))),
        test_accuracy=history.test.get("test_accuracy"),
        # the task's own test metric: the run's model is judged on it, whatever the task
        test_metric=next((v for k, v in history.test.items() if k != "test_loss"), None),
        test_metric_name=next((k for k in history.test if k != "test_loss"), None),
        test_loss=history.test.get("test_loss"),
        evaluations=len(history.evals),
        drops_partial_batch=drops_partial_batch(history))
    if reached is None:
        return figures
    step = int(reached["step"])
    samples = samples_trained(history, step, num_train, plan.batch_size)
    time, wall = time_to_target(history)
    return replace(figures, steps_to_target=step, samples_to_target=samples,
                   epochs_to_target=samples / num_train, time_to_target_raw=wall,
                   time_to_target=time)


def run_steps(record: StoredRun) -> float:
    """A run's steps to target; a run that did not reach it counts as infinitely many."""
    steps = record.result["steps_to_target"]
    return math.inf if steps is None or not record.result["reached"] else float(steps)


def run_time(record: StoredRun) -> float:
    """A run's time to target; a run that did not reach it takes infinitely long."""
    return record.result["time_to_target"] if run_steps(record) < math.inf else math.inf


def median_or_inf(values: list[float]) -> float:
    """The median of ``values`` (infinite: never reached), infinite when there are none."""
    return float(statistics.median(values)) if values else math.inf


def rate_score(records: list[StoredRun],
               larger_is_better: bool) -> tuple[float, float, float, float]:
    """How one learning rate of a cell ranks (smaller is better): the median steps to target over
    its seeds (not reached: infinite); on a tie, the mean steps over the seeds (finer than the
    median, and like it free of the machine's load); then (for rates whose median seed did not
    reach) the median best validation metric; only then the median time to target, a clock."""
    per_seed = [run_steps(r) for r in records]
    steps = median_or_inf(per_seed)
    mean_steps = sum(per_seed) / len(per_seed) if per_seed else math.inf
    times = median_or_inf([run_time(r) for r in records])
    metrics = [r.result["best_metric"] for r in records]
    metric = median_or_inf([m for m in metrics if m is not None and math.isfinite(m)])
    if math.isfinite(metric) and larger_is_better:
        metric = -metric
    return steps, mean_steps, metric, times


def best_rate(by_rate: dict[float, list[StoredRun]], larger_is_better: bool) -> float | None:
    """The learning rate a cell reports: the best ``rate_score`` (None for an empty cell)."""
    if not by_rate:
        return None
    return min(by_rate, key=lambda rate: (rate_score(by_rate[rate], larger_is_better), rate))


def summarize_cell(cell: Cell, records: list[StoredRun]) -> Cell:
    """``cell`` with its figures from the runs of its best learning rate (one per seed): each a
    median over the seeds, with the order-statistic interval of ``median_interval``. The cell
    reaches the target when its median seed does."""
    results = [r.result for r in records]
    steps = median_interval([run_steps(r) for r in records])
    reached = math.isfinite(steps["median"])

    def median_of(name: str, only_reached: bool = False) -> dict[str, float]:
        values = [r[name] for r in results if r.get(name) is not None and
                  (not only_reached or r["reached"])]
        return median_interval([float(v) for v in values if math.isfinite(float(v))])

    def finite(value: float | None) -> float | None:
        return value if value is not None and math.isfinite(value) else None

    times = median_interval([run_time(r) for r in records])
    test = median_of("test_accuracy", only_reached=reached)
    # the task's own test metric (test_accuracy for classifiers, test_mae, ...)
    test_metric = median_of("test_metric", only_reached=reached)
    # The run drawn in the trajectory plot: the seed at the median (the lower one of two).
    ordered = sorted(records, key=lambda r: (run_steps(r), -(r.result["best_metric"] or 0.0)))
    middle = ordered[(len(ordered) - 1) // 2]
    return replace(
        cell,
        learning_rate=middle.config["learning_rate"],
        seeds=len(records),
        seed_values=tuple(r.config["seed"] for r in records),
        reached=reached,
        seeds_reached=sum(1 for r in records if run_steps(r) < math.inf),
        steps_to_target=finite(steps["median"]) if reached else None,
        samples_to_target=finite(median_of("samples_to_target")["median"]) if reached else None,
        epochs_to_target=finite(median_of("epochs_to_target")["median"]) if reached else None,
        time_to_target=finite(times["median"]) if reached else None,
        time_to_target_raw=finite(median_of("time_to_target_raw")["median"]) if reached
        else None,
        steps_run=finite(median_of("steps_run")["median"]),
        best_metric=finite(median_of("best_metric")["median"]),
        test_accuracy=finite(test["median"]),
        test_metric=finite(test_metric["median"]),
        samples_per_s=finite(median_of("samples_per_s")["median"]),
        startup_time=finite(median_of("startup_time")["median"]),
        startup_time_estimated=any(r.get("startup_time_estimated") for r in results),
        train_time=sum(r.get("train_time") or 0.0 for r in results),
        wall_time=sum(r.get("wall_time") or 0.0 for r in results),
        seed_steps={str(r.config["seed"]): run_steps(r) for r in records},
        # per seed, for the paired verdicts (kbackend.study.verdicts)
        seed_test={str(r.config["seed"]): float(r.result["test_metric"])
                   for r in records if r.result.get("test_metric") is not None},
        test_metric_name=next((r.result.get("test_metric_name") for r in records
                               if r.result.get("test_metric_name")), None),
        eval_every=records[0].config.get("eval_every") if records else None,
        fused_steps=records[0].config.get("fused_steps") if records else None,
        run_key=middle.key,
        run_keys=tuple(r.key for r in records),
        intervals={"steps_to_target": steps, "time_to_target": times,
                   "test_accuracy": test, "test_metric": test_metric,
                   "best_metric": median_of("best_metric")})

