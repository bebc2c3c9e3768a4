"""Run a study: every (optimizer, batch size) cell, a learning-rate search per cell (every rate
with every seed, the grid extended while its best rate sits on an end), the cells' steady step
times measured apart (the time model), a noise-scale measurement; each finished run committed
to the results store.

Re-running the same study skips every run already stored (the key is the run's full
configuration: model, data, optimizer, batch size, learning rate, seed, budget, target, engine,
backend, package versions and device), so an interrupted study resumes where it stopped.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from kbackend.backends import impl
from kbackend.backends.compile_cache import machine_measurement
from kbackend.config import check_metrics
from kbackend.data import Dataset
from kbackend.data.batching import steps_per_epoch_dropping_last, steps_per_epoch_keeping_last
from kbackend.engines import get_engine
from kbackend.engines.native import Runs, epoch_runner, model_values, set_model_values
from kbackend.envinfo import environment_identity
from kbackend.errors import ConfigError
from kbackend.history import History
from kbackend.models import ModelOptions, build_model, model_layout
from kbackend.optim import OptimizerSpec
from kbackend.stats import median_interval
from kbackend.study.analysis import training_noise_scale
from kbackend.study.config import LOCAL_EXECUTOR, REFERENCE_BATCH, StudyConfig
from kbackend.study.noise import measure_noise_scale
from kbackend.study.ray_executor import require_ray, run_on_ray
from kbackend.study.sequential import extend_seeds
from kbackend.study.store import ResultStore, config_key
from kbackend.task import CLASSIFICATION, Task
from kbackend.training import Target, TrainConfig, is_builtin, load_dataset, train, workload_of
from kbackend.workload import Workload

# Engines that validate once per epoch, whatever eval_every asks (Keras fit).
EPOCH_EVAL_ENGINES = frozenset({"keras"})
# A timed call of the time model runs whole fused calls until it lasts STEP_TIME_SECONDS or
# holds STEP_TIME_STEPS steps, whichever comes first. 20 ms is far above the clock's and a
# dispatch's jitter (microseconds); what varies is the machine's load, which the interleaved
# rounds spread over the cells. At batch 1,024 of the default study, six calls of a fixed 32
# steps came to 30-70% of the steps the cell's runs trained (a fifth of all samples trained).
STEP_TIME_STEPS = 32
STEP_TIME_SECONDS = 0.02
PROBE_STEPS = 8  # steps per timed round of the population probe (at least one call)
POPULATION_PROBE_FILE = "population_probe.json"  # the probes' answers, kept per machine
# The per-step speedup a population must show to be chosen. Members run in lockstep until the
# slowest stops and are pruned later than one by one: in the default study on a 2-core CPU the
# population path's steady training equalled the sequential path's at probe speedups of
# 1.1-1.4x (lockstep efficiency 0.86), and its extra compilations made the study slower
# (docs/study.md). Vmapped small models on a GPU are reported 10-100x faster.
POPULATION_MIN_SPEEDUP = 1.5
CPU_REASON = ("a CPU: vmapped members measured 0.8-1.4x per step on this project's CPUs "
              "(scripts/bench_population.py), below the 1.5x a population needs; not probed "
              "(--population on forces it)")


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

    def label(self) -> str:
        return f"{self.optimizer} B={self.batch_size} lr={self.learning_rate:g} seed={self.seed}"


def default_engine() -> str:
    """The engine a study runs unless told otherwise: the native one (K fused steps per call)."""
    return "native"


def samples_seen(step: int, num_train: int, batch_size: int, drops_remainder: bool = False) -> int:
    """Training samples processed by the end of ``step``."""
    if drops_remainder:
        return int(step) * batch_size
    per_epoch = steps_per_epoch_keeping_last(num_train, batch_size)
    full_epochs, rest = divmod(int(step), per_epoch)
    return full_epochs * num_train + rest * batch_size


def _drops_remainder(history: History) -> bool:
    # The native engine records how many samples each epoch drops; Keras fit drops none.
    return "dropped_per_epoch" in history.extra


def steady_throughput(history: History, num_train: int, batch_size: int,
                      startup: float = 0.0) -> float:
    """Samples/s over the run's training time with its start-up (compilation) taken out."""
    seconds = (history.timing.get("train_time") or 0.0) - startup
    if not history.step or seconds <= 0:
        return math.nan
    return samples_seen(history.steps_run, num_train, batch_size, _drops_remainder(history)) / seconds


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


def history_from_trajectory(trajectory: dict[str, Any], result: dict[str, Any]) -> History:
    """Rebuild a run's ``History`` from its stored trajectory (to re-derive its figures)."""
    history = History(step=list(trajectory["step"]), loss=list(trajectory["loss"]),
                      time=list(trajectory["time"]), evals=list(trajectory["evals"]),
                      timing=dict(trajectory.get("timing", {})),
                      extra=dict(trajectory.get("extra", {})))
    history.test = {k: result[k] for k in ("test_accuracy", "test_loss") if result.get(k) is not None}
    if "target_reached" not in history.extra and result.get("reached"):
        # Stored before the engine's extra was kept: the reaching evaluation is the last one.
        last = history.evals[-1]
        history.extra["target_reached"] = {"step": last["step"], "epoch": last.get("epoch"),
                                           "train_time": last["train_time"]}
    return history


def summarize_run(history: History, plan: RunPlan, target: Target, num_train: int) -> dict[str, Any]:
    """The figures of one finished run.

    Time to target is training time only: the engines exclude evaluation from ``train_time``,
    and the per-run start-up (compilation, first-call overhead: ``startup_seconds``) is
    subtracted too, so runs of a few seconds are not ranked by their compile times;
    ``time_to_target_raw`` keeps it in.
    """
    metric = target.metric
    reached = history.extra.get("target_reached")
    losses = np.asarray(history.loss, dtype=float)
    drops = _drops_remainder(history)
    startup, estimated = startup_seconds(history)
    result: dict[str, Any] = {
        "reached": reached is not None,
        "steps_run": history.steps_run,
        "train_time": history.timing.get("train_time"),
        "eval_time": history.timing.get("eval_time"),
        "wall_time": history.timing.get("wall_time"),
        "compile_time": history.timing.get("compile_time"),
        "startup_time": startup,
        "startup_time_estimated": estimated,
        "samples_per_s": steady_throughput(history, num_train, plan.batch_size, startup),
        "best_val_accuracy": history.best("val_accuracy"),
        "best_val_loss": history.best("val_loss"),
        "best_metric": history.best(metric),
        "final_train_loss": float(losses[-1]) if losses.size else None,
        "diverged": "diverged" in history.extra or bool(losses.size and not np.all(np.isfinite(losses))),
        "test_accuracy": history.test.get("test_accuracy"),
        # the task's own test metric (test_accuracy, test_mae, ...): the run's model is judged
        # on it, whatever the task
        "test_metric": next((v for k, v in history.test.items() if k != "test_loss"), None),
        "test_metric_name": next((k for k in history.test if k != "test_loss"), None),
        "test_loss": history.test.get("test_loss"),
        "evaluations": len(history.evals),
        "drops_partial_batch": drops,
    }
    if reached is not None:
        step = int(reached["step"])
        samples = samples_seen(step, num_train, plan.batch_size, drops)
        raw = float(reached["train_time"])
        result.update(steps_to_target=step, samples_to_target=samples,
                      epochs_to_target=samples / num_train, time_to_target_raw=raw,
                      time_to_target=max(raw - startup, 0.0))
    else:
        result.update(steps_to_target=None, samples_to_target=None, epochs_to_target=None,
                      time_to_target=None, time_to_target_raw=None)
    return result


def _steps(record: dict[str, Any]) -> float:
    """A run's steps to target; a run that did not reach it counts as infinitely many."""
    steps = record["result"]["steps_to_target"]
    return math.inf if steps is None or not record["result"]["reached"] else float(steps)


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else math.inf


def rate_score(records: list[dict[str, Any]],
               larger_is_better: bool) -> tuple[float, float, float, float]:
    """How one learning rate of a cell ranks (smaller is better): the median steps to target over
    its seeds (not reached: infinite); on a tie, the mean steps over the seeds (finer than the
    median, and like it free of the machine's load); then (for rates whose median seed did not
    reach) the median best validation metric; only then the median time to target, a clock."""
    per_seed = [_steps(r) for r in records]
    steps = _median(per_seed)
    mean_steps = sum(per_seed) / len(per_seed) if per_seed else math.inf
    times = _median([r["result"]["time_to_target"] if _steps(r) < math.inf else math.inf
                     for r in records])
    metrics = [r["result"]["best_metric"] for r in records]
    metric = _median([m for m in metrics if m is not None and math.isfinite(m)])
    if math.isfinite(metric) and larger_is_better:
        metric = -metric
    return steps, mean_steps, metric, times


def best_rate(by_rate: dict[float, list[dict[str, Any]]], larger_is_better: bool) -> float | None:
    """The learning rate a cell reports: the best ``rate_score`` (None for an empty cell)."""
    if not by_rate:
        return None
    return min(by_rate, key=lambda rate: (rate_score(by_rate[rate], larger_is_better), rate))


def summarize_cell(records: list[dict[str, Any]]) -> dict[str, Any]:
    """A cell's figures from the runs of its best learning rate (one per seed): each a median
    over the seeds, with the order-statistic interval of ``median_interval``. The cell reaches
    the target when its median seed does."""
    results = [r["result"] for r in records]
    steps = median_interval([_steps(r) for r in records])
    reached = math.isfinite(steps["median"])

    def median_of(name: str, only_reached: bool = False) -> dict[str, Any]:
        values = [r[name] for r in results if r.get(name) is not None and
                  (not only_reached or r["reached"])]
        return median_interval([float(v) for v in values if math.isfinite(float(v))])

    def finite(value: float | None) -> float | None:
        return value if value is not None and math.isfinite(value) else None

    times = median_interval([r["time_to_target"] if _steps(rec) < math.inf else math.inf
                             for r, rec in zip(results, records, strict=True)])
    test = median_of("test_accuracy", only_reached=reached)
    # the task's own test metric (test_accuracy for classifiers, test_mae, ...)
    test_metric = median_of("test_metric", only_reached=reached)
    # The run drawn in the trajectory plot: the seed at the median (the lower one of two).
    ordered = sorted(records, key=lambda r: (_steps(r), -(r["result"]["best_metric"] or 0.0)))
    middle = ordered[(len(ordered) - 1) // 2]
    return {
        "learning_rate": middle["config"]["learning_rate"],
        "seeds": len(records),
        "seed_values": [r["config"]["seed"] for r in records],
        "reached": reached,
        "seeds_reached": sum(1 for r in records if _steps(r) < math.inf),
        "steps_to_target": finite(steps["median"]) if reached else None,
        "samples_to_target": finite(median_of("samples_to_target")["median"]) if reached else None,
        "epochs_to_target": finite(median_of("epochs_to_target")["median"]) if reached else None,
        "time_to_target": finite(times["median"]) if reached else None,
        "time_to_target_raw": finite(median_of("time_to_target_raw")["median"]) if reached else None,
        "steps_run": finite(median_of("steps_run")["median"]),
        "best_metric": finite(median_of("best_metric")["median"]),
        "test_accuracy": finite(test["median"]),
        "test_metric": finite(test_metric["median"]),
        "samples_per_s": finite(median_of("samples_per_s")["median"]),
        "startup_time": finite(median_of("startup_time")["median"]),
        "startup_time_estimated": any(r.get("startup_time_estimated") for r in results),
        "train_time": sum(r.get("train_time") or 0.0 for r in results),
        "wall_time": sum(r.get("wall_time") or 0.0 for r in results),
        "seed_steps": {str(r["config"]["seed"]): _steps(r) for r in records},
        # per seed, for the paired verdicts (kbackend.study.verdicts)
        "seed_test": {str(r["config"]["seed"]): float(r["result"]["test_metric"])
                      for r in records if r["result"].get("test_metric") is not None},
        "test_metric_name": next((r["result"].get("test_metric_name") for r in records
                                  if r["result"].get("test_metric_name")), None),
        "eval_every": records[0]["config"].get("eval_every") if records else None,
        "run_key": middle["key"],
        "run_keys": [r["key"] for r in records],
        "intervals": {"steps_to_target": steps, "time_to_target": times,
                      "test_accuracy": test, "test_metric": test_metric,
                      "best_metric": median_of("best_metric")},
    }


def apply_time_model(cells: list[dict[str, Any]], step_times: dict[str, Any] | None) -> None:
    """Each cell's time to target = its median steps to target x its median measured seconds
    per step; the interval is [low steps x fastest step time, high steps x slowest step time].
    The runs' own clocks stay in ``time_to_target_runs``. Without a measurement the runs'
    clocks remain the time to target (``time_model: "run clocks"``)."""
    measured = {(c["optimizer"], c["batch_size"]): c["seconds_per_step"]
                for c in (step_times or {}).get("cells", [])}
    for cell in cells:
        intervals = cell.setdefault("intervals", {})
        intervals["time_to_target_runs"] = intervals.get("time_to_target")
        cell["time_to_target_runs"] = cell.get("time_to_target")
        per_step = measured.get((cell["optimizer"], cell["batch_size"]))
        if per_step is None or not per_step.get("n"):
            cell["time_model"] = "run clocks"
            continue
        steps = intervals["steps_to_target"]
        cell["time_model"] = "steps x step time"
        cell["seconds_per_step"] = per_step
        cell["samples_per_s"] = cell["batch_size"] / per_step["median"]
        intervals["time_to_target"] = {
            "median": steps["median"] * per_step["median"],
            "low": steps["low"] * per_step["low"], "high": steps["high"] * per_step["high"],
            "n": steps["n"], "coverage": steps["coverage"]}
        cell["time_to_target"] = (steps["median"] * per_step["median"]) if cell["reached"] else None


@dataclass
class TimeSpent:
    """Where this process's study time went, by phase (seconds). Runs reused from the store
    cost nothing here; a population counts once, not once per member (its members share one
    clock)."""

    runs: int = 0          # runs trained in this process
    runs_wall: float = 0.0  # wall time around those runs: set-up, compilation, training, evaluation
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

    @property
    def steady_training(self) -> float:
        """Training with the start-ups taken out: the wall time spent in train steps."""
        return max(self.training - self.startup, 0.0)


class StudyRunner:
    """Plans, validates and runs a study against a results store."""

    def __init__(self, config: StudyConfig, store: ResultStore | None,
                 on_event: Callable[..., None] | None = None) -> None:
        self.config = config
        self.store = store
        self.on_event = on_event or (lambda *args, **kwargs: None)
        self.dataset: Dataset | None = None
        self.env = environment_identity()
        self.study_id = config_key(config.identity())[:12]
        self.executed = 0
        self.time_spent = TimeSpent()
        self._native_runs: Runs | None = None
        self._initial_values: dict[int, Any] = {}
        # A user model or dataset (``kbackend.workload``) and the task every run trains.
        self.workload: Workload | None = None
        self.task: Task = CLASSIFICATION

    # -- validation and planning (everything here runs before any training) ------------------

    def prepare(self) -> None:
        """Load the data and check every option; raise a ``KBackendError`` on bad input."""
        config = self.config
        get_engine(config.engine)
        config.resolved_target  # noqa: B018 - validated on construction, resolved here
        source = TrainConfig(model=config.model, dataset=config.dataset, data_dir=config.data_dir,
                             validation_fraction=config.validation_fraction, seed=config.seed,
                             label=config.label, target=config.resolved_target,
                             unsafe_deserialization=config.unsafe_deserialization)
        if is_builtin(source):
            model_layout(config.model)
            self.dataset = load_dataset(source)
        else:  # the user's model or data: its task (loss, metric) trains every cell
            self.workload = workload_of(source)
            self.dataset, self.task = self.workload.dataset, self.workload.task
            check_metrics(replace(source, task=self.task))
        self.batch_sizes = config.resolved_batch_sizes(self.num_train)
        if config.population == "on" and (config.engine != "native"
                                           or not impl().supports_populations()):
            raise ConfigError("--population on needs the native engine on JAX (vmap); this "
                              f"study runs the {config.engine} engine on {self.env['backend']}: "
                              "use --population auto or off.")
        self.noise_batches = self._noise_batches() if config.noise_points else (0, 0)
        if config.executor != LOCAL_EXECUTOR:
            require_ray()  # Ray is an optional extra: a one-line error naming it, before training

    def platform(self) -> str:
        """The platform the cells train on (``"cpu"``, ``"gpu"``, ...): this process's."""
        return impl().platform()

    @property
    def num_train(self) -> int:
        assert self.dataset is not None
        return len(self.dataset.x_train)

    def _noise_batches(self) -> tuple[int, int]:
        config, sizes = self.config, self.batch_sizes
        small = config.noise_small_batch or min(sizes)
        big = config.noise_big_batch or max(sizes)
        if big <= small:
            big = min(self.num_train, small * 8)
        if big > self.num_train:
            raise ConfigError(
                f"Invalid --noise-batches: the big batch ({big}) is larger than the training split "
                f"({self.num_train} samples). Expected a batch of at most {self.num_train}.")
        if big <= small:
            raise ConfigError(
                f"Cannot measure the noise scale: need a big batch larger than the small one "
                f"({small}) within the training split ({self.num_train} samples)."
            )
        return small, big

    def eval_every(self, batch_size: int) -> int:
        """Steps between evaluations: about ``evals_per_epoch`` per epoch, preferably a divisor of
        the epoch so that every fused call has the same length (one compilation per run)."""
        if self.config.engine in EPOCH_EVAL_ENGINES:
            return steps_per_epoch_keeping_last(self.num_train, batch_size)
        per_epoch = steps_per_epoch_dropping_last(self.num_train, batch_size)
        wanted = max(1, round(per_epoch / self.config.evals_per_epoch))
        divisors = [d for d in range(1, per_epoch + 1) if per_epoch % d == 0]
        nearest = min(divisors, key=lambda d: (abs(math.log(d / wanted)), d))
        return nearest if wanted / 2 <= nearest <= wanted * 2 else wanted

    def full_budget(self, batch_size: int) -> int:
        """The step budget of a run at ``batch_size`` that no pruning has cut."""
        return self.config.step_budget(steps_per_epoch_dropping_last(self.num_train, batch_size))

    def plan(self, optimizer: str, batch_size: int, learning_rate: float,
             budget: int | None = None, seed: int | None = None) -> RunPlan:
        every = self.eval_every(batch_size)
        steps = budget if budget is not None else self.full_budget(batch_size)
        steps = -(-steps // every) * every  # whole evaluation intervals
        if not get_engine(self.config.engine).fuses_steps:
            fused = 1
        else:
            fused = min(self.config.fused_steps or every,
                        steps_per_epoch_dropping_last(self.num_train, batch_size))
        return RunPlan(optimizer, batch_size, learning_rate, steps, every, fused,
                       self.config.seed if seed is None else seed)

    def run_key_config(self, plan: RunPlan) -> dict[str, Any]:
        """Everything that determines a run's outcome: its store key is a hash of this."""
        assert self.dataset is not None
        config = self.config
        info = self.dataset.info
        return {
            "kind": "run",
            "model": config.model,
            "model_options": ModelOptions(seed=plan.seed).key(),
            "data": {"name": info.name, "source": info.source, "num_train": info.num_train,
                     "num_val": info.num_val, "num_test": info.num_test,
                     "validation_fraction": config.validation_fraction},
            "optimizer": OptimizerSpec(plan.optimizer, plan.learning_rate).to_dict(),
            "batch_size": plan.batch_size,
            "learning_rate": plan.learning_rate,
            "seed": plan.seed,
            "max_steps": plan.max_steps,
            "eval_every": plan.eval_every,
            "fused_steps": plan.fused_steps,
            "target": asdict(config.resolved_target),
            "engine": config.engine,
            # Only when off: the keys of runs stored before the option existed stay valid.
            **({} if config.jit_compile else {"jit_compile": False}),
            **self.env,
        }

    def total_runs(self) -> int:
        """Runs the grid holds before any extension (pruned runs included: they still run, on a
        smaller budget; a pruned rate may skip its last seeds)."""
        return self.config.seeds * sum(len(self.config.learning_rate_grid(o, b))
                                       for o in self.config.optimizers for b in self.batch_sizes)

    # -- running -------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Run (or resume) the whole study; return its cells, runs and noise-scale estimate."""
        if self.dataset is None:
            self.prepare()
        if self.config.executor != LOCAL_EXECUTOR:
            # The same study, its cells run as Ray tasks and their results stored here.
            cells, runs, step_times, noise = run_on_ray(self)
            added = extend_seeds(self, cells, runs, step_times, summarize_cell)  # here, in the driver
            apply_time_model(cells, step_times)
            return {"study": self.study_id, "step_times": step_times, "config": self.config.to_dict(),
                    "env": self.env, "dataset": self.dataset.info.to_dict(),
                    "batch_sizes": list(self.batch_sizes), "cells": cells, "runs": runs,
                    "noise": noise, "added_seeds": added}
        cells, runs = [], []
        for optimizer in self.config.optimizers:
            for batch_size in self.batch_sizes:
                cell = self.run_cell(optimizer, batch_size)
                runs.extend(cell.pop("runs"))
                cells.append(cell)
        start, setup_before = time.perf_counter(), self.time_spent.setup
        step_times = self.measure_step_times(cells)
        self.time_spent.step_times += self._seconds_since(start, setup_before)
        added = extend_seeds(self, cells, runs, step_times, summarize_cell)
        apply_time_model(cells, step_times)
        start, setup_before = time.perf_counter(), self.time_spent.setup
        noise = self.run_noise(cells)
        self.time_spent.noise += self._seconds_since(start, setup_before)
        return {"study": self.study_id, "step_times": step_times, "config": self.config.to_dict(), "env": self.env,
                "dataset": self.dataset.info.to_dict(), "batch_sizes": list(self.batch_sizes),
                "cells": cells, "runs": runs, "noise": noise, "added_seeds": added}

    @property
    def larger_is_better(self) -> bool:
        return self.config.resolved_target.direction == "max"

    def extension_factors(self, optimizer: str, grid: tuple[float, ...]) -> tuple[float, float]:
        """The ratio a grid is extended by below and above: the study's ``lr_factor`` for a
        generated grid, the ratio of the two outermost rates at that end for an explicit one."""
        if optimizer not in self.config.learning_rates or len(grid) < 2:
            return self.config.lr_factor, self.config.lr_factor
        ordered = sorted(grid)
        return ordered[1] / ordered[0], ordered[-1] / ordered[-2]

    def run_cell(self, optimizer: str, batch_size: int) -> dict[str, Any]:
        """Every learning rate of one cell, each with every seed, the grid extended while the
        best rate sits on an end of it (``lr_extend`` points each way at most); the cell's
        figures with their intervals, and under ``"runs"`` every run it made."""
        config = self.config
        grid = config.learning_rate_grid(optimizer, batch_size)
        by_rate: dict[float, list[dict[str, Any]]] = {}
        runs: list[dict[str, Any]] = []
        path = self.population_path(optimizer, batch_size, grid)
        if path["path"] == "population":
            runs += self.run_population(optimizer, batch_size, grid, by_rate)
        else:
            for learning_rate in grid:
                runs += self.run_rate(optimizer, batch_size, learning_rate, by_rate)
        low_factor, high_factor = self.extension_factors(optimizer, grid)
        extended = {"below": 0, "above": 0}
        while len(grid) > 1:
            best, tried = best_rate(by_rate, self.larger_is_better), sorted(by_rate)
            if best == tried[0] and extended["below"] < config.lr_extend:
                extended["below"] += 1
                rate = float(f"{tried[0] / low_factor:.4g}")
            elif best == tried[-1] and extended["above"] < config.lr_extend:
                extended["above"] += 1
                rate = float(f"{tried[-1] * high_factor:.4g}")
            else:
                break
            self.on_event("extend", runs=config.seeds)
            runs += self.run_rate(optimizer, batch_size, rate, by_rate)
        best = best_rate(by_rate, self.larger_is_better)
        runs += self.complete_censored(optimizer, batch_size, best, by_rate)
        tried = sorted(by_rate)
        edge = None
        if len(tried) > 1 and best in (tried[0], tried[-1]):
            edge = "below" if best == tried[0] else "above"
        return {
            "optimizer": optimizer, "batch_size": batch_size,
            "lr_grid": list(grid), "lr_tried": tried, "lr_extended": extended,
            "lr_at_grid_edge": edge is not None,
            "lr_edge": edge,
            "lr_at_bound": edge is not None and extended[edge] >= config.lr_extend,
            "population": path,
            **summarize_cell(by_rate[best]),
            "runs": runs,
        }

    def run_rate(self, optimizer: str, batch_size: int, learning_rate: float,
                 by_rate: dict[float, list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """One learning rate of a cell with every seed, into ``by_rate``; returns its runs.

        With pruning, the rate's budget is the best median steps-to-target so far: a run that
        does not reach the target within it counts as never reaching it, which can only make
        this rate's median worse than the best one's, never better. Once too few seeds are left
        for the median seed to reach, the remaining seeds are skipped: the rate cannot win.
        """
        config = self.config
        best = best_rate(by_rate, self.larger_is_better)
        best_median = rate_score(by_rate[best], self.larger_is_better)[0] if best is not None else math.inf
        pruned = config.prune and math.isfinite(best_median)
        budget = min(self.full_budget(batch_size), math.ceil(best_median)) if pruned else None
        needed = config.seeds // 2 + 1  # seeds that must reach for the median seed to reach
        records: list[dict[str, Any]] = []
        for seed in config.seed_values:
            if pruned and sum(1 for r in records if not r["result"]["reached"]) > config.seeds - needed:
                self.on_event("pruned", runs=1)
                continue
            records.append(self.run_one(self.plan(optimizer, batch_size, learning_rate, budget, seed)))
        by_rate[learning_rate] = records
        return list(records)

    def complete_censored(self, optimizer: str, batch_size: int, rate: float | None,
                          by_rate: dict[float, list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """Re-run, on the full budget, the seeds of the winning rate that a pruned budget cut
        short: the median is exact without them, the upper end of the interval is not."""
        if rate is None:
            return []
        full = self.plan(optimizer, batch_size, rate).max_steps
        runs = []
        for index, record in enumerate(by_rate[rate]):
            if not record["result"]["reached"] and record["config"]["max_steps"] < full:
                self.on_event("extend", runs=1)
                record = self.run_one(self.plan(optimizer, batch_size, rate, seed=record["config"]["seed"]))
                by_rate[rate][index] = record
                runs.append(record)
        return runs

    # -- populations: a cell's grid x seeds as one vmapped program -----------------------------

    def population_path(self, optimizer: str, batch_size: int,
                        grid: tuple[float, ...]) -> dict[str, Any]:
        """How a cell's initial grid (every rate x every seed) is trained: ``{"path":
        "population" | "sequential", ...}`` with the reason or the probe's figures.

        ``population="auto"`` on an accelerator measures (``Runs.probe_population``: both
        paths compiled, then timed in interleaved rounds) and keeps the population when it is
        ``POPULATION_MIN_SPEEDUP`` faster; on a CPU it runs one by one without probing
        (``CPU_REASON``); the probe is stored in the study (a
        resumed study takes the same path) and in the kbackend cache folder (another study of
        the same cell on this machine and software reuses it). Grid extensions and pruning stay sequential.
        """
        config, members = self.config, len(grid) * self.config.seeds
        if config.population == "off":
            return {"path": "sequential", "members": members, "reason": "--population off"}
        if config.engine != "native":
            return {"path": "sequential", "members": members,
                    "reason": f"the {config.engine} engine trains one run at a time"}
        if members < 2:
            return {"path": "sequential", "members": members, "reason": "one run per cell"}
        if config.population == "on":
            return {"path": "population", "members": members, "reason": "--population on"}
        if self.platform() == "cpu":
            return {"path": "sequential", "members": members, "reason": CPU_REASON}
        plans = self.population_plans(optimizer, batch_size, grid)
        configs = [self.train_config(p) for p in plans]
        values = [self.initial_values(p.seed) for p in plans]
        fused = configs[0].fused_steps
        steps = fused * -(-PROBE_STEPS // fused)  # whole calls
        info = self.dataset.info  # its shape and size: not where its file is cached
        key_config = {"kind": "population_probe", "model": self.config.model,
                      "data": {"name": info.name, "input_shape": list(info.input_shape),
                               "num_train": info.num_train, "num_val": info.num_val},
                      "optimizer": optimizer, "min_speedup": POPULATION_MIN_SPEEDUP,
                      "batch_size": batch_size, "fused_steps": configs[0].fused_steps,
                      "members": members, "steps": steps, **self.env}
        def measure() -> dict[str, Any]:  # once per machine (and software) for this cell
            probe, cached = machine_measurement(
                POPULATION_PROBE_FILE, config_key(key_config),
                lambda: self.native_runs().probe_population(configs, values, steps,
                                                            min_speedup=POPULATION_MIN_SPEEDUP))
            return {**probe, "cached": cached}

        return self.stored_or_measured("population_probe", "probe", key_config, plans[0], measure)

    def population_plans(self, optimizer: str, batch_size: int,
                         grid: tuple[float, ...]) -> list[RunPlan]:
        """Every rate x every seed of a cell's grid, on the full budget (members run in
        lockstep, so a pruned budget would save nothing)."""
        return [self.plan(optimizer, batch_size, rate, seed=seed)
                for rate in grid for seed in self.config.seed_values]

    def run_population(self, optimizer: str, batch_size: int, grid: tuple[float, ...],
                       by_rate: dict[float, list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """The cell's grid x seeds as one population (the runs not yet stored), into
        ``by_rate``; returns the runs. Each member is stored as the run it equals."""
        plans = self.population_plans(optimizer, batch_size, grid)
        records: dict[int, dict[str, Any]] = {}
        missing = []
        censored = self.censored_runs()
        for index, plan in enumerate(plans):
            stored = self.stored_run(plan)
            if stored is None and self.budgetless_key(plan) in censored:
                budget = censored[self.budgetless_key(plan)]["config"]["max_steps"]
                stored = self.stored_run(self.plan(optimizer, batch_size, plan.learning_rate,
                                                   budget, plan.seed))
            if stored is not None:
                records[index] = stored
            else:
                missing.append(index)
        if len(missing) == 1:
            records[missing[0]] = self.run_one(plans[missing[0]])
        elif missing:
            self.on_event("start_population", plan=plans[missing[0]], runs=len(missing))
            configs = [self.train_config(plans[i]) for i in missing]
            values = [self.initial_values(plans[i].seed) for i in missing]
            censor = self.population_pruner(plans, missing, records) if self.config.prune else None
            start, setup_before = time.perf_counter(), self.time_spent.setup
            histories = self.native_runs().train_population(configs, values, censor)
            self.time_spent.add(histories, self._seconds_since(start, setup_before))
            for index, history in zip(missing, histories, strict=True):
                plan = plans[index]
                if "censored_at" in history.extra:  # the run a pruned budget would have made
                    plan = self.plan(optimizer, batch_size, plan.learning_rate,
                                     history.extra["censored_at"], plan.seed)
                records[index] = self.store_run(plan, history)
        ordered = [records[i] for i in range(len(plans))]
        for rate in grid:
            by_rate[rate] = [r for r, p in zip(ordered, plans, strict=True)
                             if p.learning_rate == rate]
        return ordered

    def population_pruner(self, plans: list[RunPlan], missing: list[int],
                          stored: dict[int, dict[str, Any]]) -> Callable[..., list[int]]:
        """The sequential path's pruning for a population: once some rate's median steps to
        target S is known, a member of another rate is stopped as soon as even reaching at the
        next evaluation could not bring its rate's median to S or below. The best rate's seeds
        run on (its interval needs them). ``plans`` are the cell's runs; the population trains
        ``plans[i] for i in missing`` (member m is ``missing[m]``); ``stored`` holds the others."""
        member_of = {index: m for m, index in enumerate(missing)}

        def censor(step: int, histories: list[History], active: set[int]) -> list[int]:
            steps: dict[float, list[float]] = {}
            hopeful: dict[float, list[float]] = {}
            for index, plan in enumerate(plans):
                if index in stored:
                    value = best_case = _steps(stored[index])
                else:
                    m = member_of[index]
                    reached = histories[m].extra.get("target_reached")
                    value = float(reached["step"]) if reached else math.inf
                    best_case = float(step + plan.eval_every) if m in active else value
                steps.setdefault(plan.learning_rate, []).append(value)
                hopeful.setdefault(plan.learning_rate, []).append(best_case)
            best = min(_median(v) for v in steps.values())
            if not math.isfinite(best):
                return []
            return [m for m in active if _median(hopeful[plans[missing[m]].learning_rate]) > best]

        return censor

    def budgetless_key(self, plan: RunPlan) -> str:
        """A run's key without its step budget: what a censored member is found by."""
        return config_key({k: v for k, v in self.run_key_config(plan).items() if k != "max_steps"})

    def censored_runs(self) -> dict[str, dict[str, Any]]:
        """This study's stored population members that its pruner stopped, by budgetless key
        (a resumed population finds them under the budget they stopped at)."""
        found = {}
        for record in self.store.records(study=self.study_id, kind="run"):
            if "censored_at" in (record["trajectory"] or {}).get("extra", {}):
                config = {k: v for k, v in record["config"].items() if k != "max_steps"}
                found[config_key(config)] = record
        return found

    def stored_run(self, plan: RunPlan) -> dict[str, Any] | None:
        """The stored record of ``plan`` (its figures re-derived by this code), or None."""
        stored = self.store.get(config_key(self.run_key_config(plan)))
        if stored is not None:
            if stored["trajectory"]:  # figures are re-derived, so stored runs follow this code
                history = history_from_trajectory(stored["trajectory"], stored["result"])
                stored["result"] = {**stored["result"], **summarize_run(
                    history, plan, self.config.resolved_target, self.num_train)}
            self.on_event("skipped", plan=plan, record=stored)
        return stored

    def stored_record(self, key: str) -> dict[str, Any] | None:
        """The stored run under ``key`` with its figures re-derived by this code (as
        ``stored_run``), or None."""
        stored = self.store.get(key)
        if stored is not None and stored["trajectory"]:
            config = stored["config"]
            plan = RunPlan(config["optimizer"]["name"], config["batch_size"],
                           config["learning_rate"], config["max_steps"], config["eval_every"],
                           config["fused_steps"], config["seed"])
            history = history_from_trajectory(stored["trajectory"], stored["result"])
            stored["result"] = {**stored["result"], **summarize_run(
                history, plan, self.config.resolved_target, self.num_train)}
        return stored

    def run_one(self, plan: RunPlan) -> dict[str, Any]:
        """Run ``plan`` unless the store already has it; return the stored record."""
        stored = self.stored_run(plan)
        if stored is not None:
            return stored
        self.on_event("start", plan=plan)
        start, setup_before = time.perf_counter(), self.time_spent.setup
        history = self.execute(plan)
        self.time_spent.add([history], self._seconds_since(start, setup_before))
        return self.store_run(plan, history)

    def store_run(self, plan: RunPlan, history: History) -> dict[str, Any]:
        """Commit one finished run's figures and trajectory; return the stored record."""
        key_config = self.run_key_config(plan)
        key = config_key(key_config)
        result = summarize_run(history, plan, self.config.resolved_target, self.num_train)
        trajectory = {"step": history.step, "loss": history.loss, "time": history.time,
                      "evals": history.evals, "timing": history.timing, "extra": history.extra}
        self.store.put(key, "run", self.study_id, self.env["backend"], key_config, result, trajectory)
        self.executed += 1
        record = self.store.get(key)
        self.on_event("finished", plan=plan, record=record)
        return record

    def train_config(self, plan: RunPlan, *, max_steps: int | None = None,
                     target: Target | bool | None = True, seed: int | None = None) -> TrainConfig:
        config = self.config
        max_steps = plan.max_steps if max_steps is None else max_steps
        # Enough epochs for the budget even when the engine drops each epoch's partial batch.
        per_epoch = steps_per_epoch_dropping_last(self.num_train, plan.batch_size)
        return TrainConfig(
            model=config.model, dataset=config.dataset, data_dir=config.data_dir,
            validation_fraction=config.validation_fraction,
            optimizer=OptimizerSpec(plan.optimizer, plan.learning_rate),
            batch_size=plan.batch_size, epochs=max(1, -(-max_steps // per_epoch)),
            engine=config.engine, jit_compile=config.jit_compile, max_steps=max_steps,
            eval_every=0 if config.engine in EPOCH_EVAL_ENGINES else plan.eval_every,
            fused_steps=plan.fused_steps,
            target=config.resolved_target if target is True else (target or None),
            seed=plan.seed if seed is None else seed,
            model_options=ModelOptions(seed=plan.seed),
            # A diverged run is a result of the grid (recorded as diverged), not a failed study.
            on_divergence="record", task=self.task, label=config.label,
            unsafe_deserialization=config.unsafe_deserialization,
        )

    def build_model(self, seed: int | None = None) -> Any:
        """A fresh model; the same seed gives the same initial weights on one backend."""
        assert self.dataset is not None
        seed = self.config.seed if seed is None else seed
        if self.workload is not None:
            return self.workload.build(seed)
        return build_model(self.config.model, self.dataset.info, ModelOptions(seed=seed))

    def initial_values(self, seed: int) -> Any:
        """The model values seed ``seed`` initializes (built once per seed: every cell of the
        study starts its runs of that seed from the same weights)."""
        if seed not in self._initial_values:
            start = time.perf_counter()
            self._initial_values[seed] = model_values(self.build_model(seed))
            self.time_spent.setup += time.perf_counter() - start
        return self._initial_values[seed]

    def native_runs(self) -> Runs:
        """The native engine's runs of this study, on one model (built on first use)."""
        if self._native_runs is None:
            start = time.perf_counter()
            self._native_runs = Runs(self.build_model(), self.dataset)
            self.time_spent.setup += time.perf_counter() - start
        return self._native_runs

    def _seconds_since(self, start: float, setup_before: float) -> float:
        """Wall seconds since ``start`` less the set-up built meanwhile (counted as set-up)."""
        return time.perf_counter() - start - (self.time_spent.setup - setup_before)

    def execute(self, plan: RunPlan) -> History:
        """Train one run from fresh initial weights (its seed's) and return its history.

        With the native engine every run of a cell reuses the cell's compiled programs
        (``engines.native.Runs``: the rate and the initial weights are runtime arguments), so a
        cell pays its start-up once; other engines build and compile per run (``train``).
        """
        if self.config.engine == "native":
            return self.native_runs().train(self.train_config(plan), self.initial_values(plan.seed))
        return train(self.train_config(plan), dataset=self.dataset,
                     model=self.build_model(plan.seed)).history

    # -- time model: steady seconds per step, measured apart ----------------------------------

    def step_time_plan(self, cell: dict[str, Any]) -> tuple[int, int]:
        """(most steps per timed call, fused steps) for timing one cell: the native engine's
        compiled step with the training's K when the study's engine fuses steps, else one step
        per call; at most ``STEP_TIME_STEPS`` steps rounded up to whole calls of K (fewer where
        whole calls reach ``STEP_TIME_SECONDS`` sooner: ``timed_steps``)."""
        fused = self.plan(cell["optimizer"], cell["batch_size"], cell["learning_rate"]).fused_steps
        fused = max(1, fused)
        return fused * -(-STEP_TIME_STEPS // fused), fused

    def step_timer(self, cell: dict[str, Any], steps: int) -> Callable[[], Any]:
        """A callable that trains ``steps`` steps (whole calls of the cell's K) of the cell's
        compiled native step (its optimizer, batch size and best rate): with the native engine,
        the very program the cell's runs trained with (nothing is compiled); else on a copy of
        its model."""
        assert self.dataset is not None
        fused = self.step_time_plan(cell)[1]
        if self.config.engine == "native":
            plan = self.plan(cell["optimizer"], cell["batch_size"], cell["learning_rate"])
            return self.native_runs().step_timer(self.train_config(plan),
                                                 self.initial_values(self.config.seed), steps)
        batch = cell["batch_size"]
        rows = np.arange(steps * batch) % self.num_train  # whole batches, wrapping the data
        subset = replace(self.dataset, x_train=self.dataset.x_train[rows],
                         y_train=self.dataset.y_train[rows])
        return epoch_runner(self.build_model(), subset,
                            OptimizerSpec(cell["optimizer"], cell["learning_rate"]),
                            batch, fused, self.config.seed)

    def measure_step_times(self, cells: list[dict[str, Any]]) -> dict[str, Any] | None:
        """Each cell's steady seconds per step, in ``step_time_repeats`` interleaved rounds: in
        each round every cell times one call of ``timed_steps`` steps, in an order rotated by
        the round, so a load that comes and goes spreads over every cell alike. The first calls
        of each cell (compilation, warm-up, the estimate that sizes its timed call) are not
        timed. Stored, so a resumed study reuses it."""
        repeats = self.config.step_time_repeats
        if repeats == 0 or not cells:
            return None
        plans = [(c["optimizer"], c["batch_size"], c["learning_rate"], *self.step_time_plan(c))
                 for c in cells]
        key_config = {"kind": "steptime", "model": self.config.model, "seed": self.config.seed,
                      "data": self.dataset.info.to_dict() if self.dataset else None,
                      "cells": plans, "repeats": repeats, "engine": self.config.engine,
                      "min_seconds": STEP_TIME_SECONDS, **self.env}
        return self.stored_or_measured("steptime", "timing", key_config, None,
                                       lambda: self._time_steps(cells, plans, repeats))

    @staticmethod
    def timed_steps(seconds_per_call: float, fused: int, most: int) -> int:
        """Steps per timed call: whole calls of ``fused`` steps until the call lasts
        ``STEP_TIME_SECONDS`` (by ``seconds_per_call``, one call's time) or holds ``most``."""
        calls = math.ceil(STEP_TIME_SECONDS / max(seconds_per_call, 1e-9))
        return fused * max(1, min(calls, most // fused))

    def _time_steps(self, cells: list[dict[str, Any]], plans: list[tuple], repeats: int) -> dict[str, Any]:
        timers, seconds, steps = [], [[] for _ in cells], []
        warm_up = []
        for cell, plan in zip(cells, plans, strict=True):
            start = time.perf_counter()
            if self.config.engine == "native":  # the cell's programs exist: size the call
                one_call = self.step_timer(cell, plan[4])
                one_call()  # warms up
                clock = time.perf_counter()
                one_call()
                steps.append(self.timed_steps(time.perf_counter() - clock, plan[4], plan[3]))
            else:  # a fresh model per timer, compiled by its first call: one timer, full size
                steps.append(plan[3])
            timers.append(self.step_timer(cell, steps[-1]))
            if self.config.engine != "native":  # native: whole calls of the program warmed above
                timers[-1]()  # warms up (compiles: the programs are new)
            warm_up.append(time.perf_counter() - start)
        for round_index in range(repeats):
            shift = round_index % len(cells)
            for index in list(range(shift, len(cells))) + list(range(shift)):
                start = time.perf_counter()
                timers[index]()
                seconds[index].append((time.perf_counter() - start) / steps[index])
        result = {
            "engine": "native", "study_engine": self.config.engine, "repeats": repeats,
            "min_seconds": STEP_TIME_SECONDS,
            "cells": [{"optimizer": p[0], "batch_size": p[1], "learning_rate": p[2],
                       "steps_per_call": n, "fused_steps": p[4], "warm_up_s": w,
                       "seconds": s, "seconds_per_step": median_interval(s)}
                      for p, n, w, s in zip(plans, steps, warm_up, seconds, strict=True)],
        }
        return result

    def stored_or_measured(self, kind: str, event: str, key_config: dict[str, Any],
                           plan: RunPlan | None, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The stored result of ``key_config``, or ``measure()`` committed to the store (with
        the ``start_/finished_/skipped_<event>`` progress events)."""
        key = config_key(key_config)
        stored = self.store.get(key)
        if stored is not None:
            self.on_event(f"skipped_{event}", record=stored)
            return stored["result"]
        self.on_event(f"start_{event}", plan=plan)
        result = measure()
        self.store.put(key, kind, self.study_id, self.env["backend"], key_config, result)
        self.on_event(f"finished_{event}", record=self.store.get(key))
        return result

    # -- gradient noise scale ----------------------------------------------------------------

    def noise_reference(self, cells: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The cell whose training run the noise scale is measured along: plain SGD if studied
        (its update has no state, so training in segments is exact), at the grid's batch size
        nearest 32, with its tuned learning rate, up to its steps to target."""
        if self.config.noise_points == 0 or not cells:
            return None
        optimizer = "sgd" if "sgd" in self.config.optimizers else self.config.optimizers[0]
        batch = min(self.batch_sizes, key=lambda b: (abs(math.log(b / REFERENCE_BATCH)), b))
        return next(c for c in cells if c["optimizer"] == optimizer and c["batch_size"] == batch)

    def run_noise(self, cells: list[dict[str, Any]]) -> dict[str, Any] | None:
        """Measure B_simple at ``noise_points`` points along the reference cell's training."""
        cell = self.noise_reference(cells)
        if cell is None:
            return None
        small, big = self.noise_batches
        horizon = round(cell["steps_to_target"] or cell["steps_run"] or 0)
        plan = self.plan(cell["optimizer"], cell["batch_size"], cell["learning_rate"])
        points = self.config.noise_points
        checkpoints = sorted({round(horizon * i / max(1, points - 1)) for i in range(points)})
        key_config = {**self.run_key_config(plan), "kind": "noise", "checkpoints": checkpoints,
                      "small_batch": small, "big_batch": big, "draws": self.config.noise_draws}
        return self.stored_or_measured("noise", "noise", key_config, plan,
                                       lambda: self._noise_with_retry(plan, checkpoints, small, big))

    def _noise_with_retry(self, plan: RunPlan, checkpoints: list[int], small: int,
                          big: int) -> dict[str, Any]:
        result = self.noise_result(plan, checkpoints, small, big)
        wider = (max(1, small // 4), min(self.num_train, big * 4))
        if training_noise_scale(result) is None and wider != (small, big):
            # A pair further apart separates the two squared norms more: one retry.
            retry = self.noise_result(plan, checkpoints, *wider)
            retry["first_try"] = {k: result[k] for k in ("small_batch", "big_batch", "b_simple_final")}
            result = retry
        return result

    def noise_result(self, plan: RunPlan, checkpoints: list[int], small: int,
                     big: int) -> dict[str, Any]:
        """One noise-scale measurement along ``plan`` with the batch pair (small, big)."""
        result = {"optimizer": plan.optimizer, "batch_size": plan.batch_size,
                  "learning_rate": plan.learning_rate, "small_batch": small, "big_batch": big,
                  "draws": self.config.noise_draws,
                  "points": self.measure_noise(plan, checkpoints, small, big)}
        estimates = [p for p in result["points"] if p["step"] > 0]
        final = estimates[-1] if estimates else result["points"][-1]
        result["b_simple_final"] = final["b_simple"]
        return result

    def measure_noise(self, plan: RunPlan, checkpoints: list[int], small: int | None = None,
                      big: int | None = None) -> list[dict[str, Any]]:
        """Train in segments to each checkpoint and estimate the noise scale there."""
        assert self.dataset is not None
        native = self.config.engine == "native"
        # The native engine trains the segments on the cells' compiled programs (Runs writes
        # each segment's result into its model); other engines train a model of their own.
        if native:
            model = self.native_runs().model
            set_model_values(model, self.initial_values(self.config.seed))
        else:
            model = self.build_model()
        rng = np.random.default_rng(self.config.seed)
        x, y = self.dataset.x_train, self.dataset.y_train
        if small is None or big is None:
            small, big = self.noise_batches
        points, done = [], 0
        for index, checkpoint in enumerate(checkpoints):
            if checkpoint > done:
                # A fresh seed per segment so segments do not replay the same shuffle.
                config = self.train_config(plan, max_steps=checkpoint - done, target=False,
                                           seed=self.config.seed + index)
                if native:
                    history = self.native_runs().train(config, model_values(model))
                else:
                    history = train(config, dataset=self.dataset, model=model).history
                done += history.steps_run
            estimate = measure_noise_scale(lambda xb, yb: impl().gradients(model, xb, yb, training=False)[1],
                                           x, y, small, big, self.config.noise_draws, rng)
            points.append({"step": done, **estimate.to_dict()})
        return points
