"""The one epoch loop of the native engines: fused calls, evaluation points, targets, stopping.

Every engine that drives its own compiled calls (``native``, ``data_parallel``) hands a
``Trainer`` (the protocol in ``kbackend.backends``) to ``run``; the Keras ``fit`` engines use
Keras's loop. How a run goes:

* Each epoch, a permutation fixed by ``(seed, epoch)`` is cut into full batches (the last
  ``n % batch_size`` samples of the shuffled order are dropped: a fused loop needs one batch
  shape) and its index matrix goes to the trainer at the start of the epoch (``put_epoch``).
* An epoch runs as calls of ``fused_steps`` (K) steps, the last one shorter when K does not
  divide the epoch; a call never spans two epochs. Each distinct call length is compiled once
  (at most two per run, three if ``max_steps`` cuts a call short); ``history.timing
  ["compile_time"]`` is the part of ``train_time`` spent compiling.
* Calls are dispatched asynchronously; the host reads a call's losses once the next call is
  dispatched (so the device always has work queued), and waits for all of them only at
  evaluation points and epoch ends. Per-step times are the measured times at those waits,
  spread evenly over the steps between them (a fused call has no finer clock).
* Validation runs once per epoch (``eval_every`` 0) or after the first call that reaches each
  multiple of ``eval_every`` steps (so with K > 1 it is rounded up to a call boundary), and at the
  end. Targets, early stopping (patience in evaluations, best values restored) and the reporter
  act at those points. Training time excludes evaluation.
* Divergence: the first non-finite loss read stops the run, at most one call (K steps) after
  the call it happened in; ``history.extra["diverged"]`` records its step and value and there is
  no further evaluation. Raising is the caller's decision (``kbackend.training.train``).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kbackend.backends import Trainer
from kbackend.backends.capabilities import MAX_UNROLLED_STEPS
from kbackend.data import batching
from kbackend.errors import ConfigError
from kbackend.hardware.monitor import StepMonitor
from kbackend.history import History
from kbackend.task import better

__all__ = ["EarlyStopping", "EpochRunner", "Plan", "Trainer", "run", "run_population",
           "steps_per_call"]


def steps_per_call(trainer: Trainer, fused_steps: int) -> int:
    """K as asked, or at most ``capabilities.MAX_UNROLLED_STEPS`` where ``trainer`` writes its K
    steps out: its program holds K copies of the step, so compile time and program size grow
    with K while the step time does not fall (the steps are the same either way)."""
    return min(fused_steps, MAX_UNROLLED_STEPS) if trainer.unroll else fused_steps


@dataclass(frozen=True)
class Plan:
    """How many steps a run takes and where it evaluates."""

    n_train: int
    batch_size: int
    epochs: int
    fused_steps: int
    steps_per_epoch: int
    total_steps: int
    eval_every: int

    @classmethod
    def of(cls, config: Any, n_train: int, fused_steps: int) -> Plan:
        """The plan of ``config`` on ``n_train`` samples with K = ``fused_steps`` (checked)."""
        steps = batching.steps_per_epoch_dropping_last(n_train, config.batch_size)
        batching.check_fused_steps(fused_steps, steps, n_train, config.batch_size)
        total = steps * config.epochs
        if config.max_steps:
            total = min(total, config.max_steps)
        return cls(n_train, config.batch_size, config.epochs, fused_steps, steps, total,
                   config.eval_every or steps)

    def for_trainer(self, trainer: Trainer) -> Plan:
        """This plan with K as ``trainer`` runs it (``steps_per_call``)."""
        fused = steps_per_call(trainer, self.fused_steps)
        return self if fused == self.fused_steps else replace(self, fused_steps=fused)

    @property
    def dropped_per_epoch(self) -> int:
        return self.n_train - self.steps_per_epoch * self.batch_size


class EarlyStopping:
    """Patience counted in evaluations; remembers the best values to restore at the end."""

    def __init__(self, monitor: str, patience: int) -> None:
        # the same direction test as targets and reports (``kbackend.task.better``)
        self.monitor, self.patience = monitor, patience
        self.best: float | None = None
        self.best_snapshot: Any = None
        self.waited = 0

    def improved(self, value: float) -> bool:
        if self.best is None:
            return True
        return better(self.monitor, value, self.best)

    def should_stop(self, record: dict[str, float], trainer: Trainer) -> bool:
        value = record[self.monitor]
        if self.improved(value):
            self.best, self.best_snapshot, self.waited = value, trainer.snapshot(), 0
            return False
        self.waited += 1
        return self.waited >= self.patience


class _Run:
    """The state of one run of the loop: the clock, undelivered calls, the history."""

    def __init__(self, trainer: Trainer, plan: Plan, config: Any, reporter: Any,
                 history: History) -> None:
        self.trainer, self.plan, self.config, self.reporter = trainer, plan, config, reporter
        self.history = history
        self.stopper = (EarlyStopping(config.monitor, config.early_stopping)
                        if config.early_stopping else None)
        # Compilation runs ahead of time (and is excluded by reset_clock), so no call is skipped.
        self.monitor = (StepMonitor(skip_first=0).start()
                        if getattr(config, "hardware_monitor", False) else None)
        self.step = 0  # steps dispatched so far
        self.pending: list[tuple[int, Any]] = []  # (first step, device losses) not yet recorded
        self.fetched: list[np.ndarray] = []  # host losses of the first len(fetched) pending calls
        self.diverged: dict[str, Any] | None = None  # the first non-finite loss: step and value
        self.losses_since_eval: list[float] = []  # for the evaluation record's train_loss
        self.start = time.perf_counter()
        self.eval_seconds = self.compile_seconds = self.synced_at = 0.0

    def train_time(self) -> float:
        return time.perf_counter() - self.start - self.eval_seconds

    def sync(self) -> None:
        """Wait for the dispatched calls; record their losses with interpolated times."""
        if not self.pending:
            return
        self.fetch_ready(len(self.pending))
        losses = np.concatenate(self.fetched)
        first = self.pending[0][0]
        now = self.train_time()
        times = np.linspace(self.synced_at, now, len(losses) + 1)[1:]
        steps = list(range(first + 1, first + len(losses) + 1))
        self.history.record_steps(steps, losses.tolist(), times.tolist())
        self.losses_since_eval.extend(float(v) for v in losses)
        self.synced_at = now
        self.pending.clear()
        self.fetched.clear()

    def fetch_ready(self, count: int) -> None:
        """Read the losses of the first ``count`` pending calls to the host; note divergence."""
        for first, handle in self.pending[len(self.fetched):count]:
            losses = np.asarray(self.trainer.fetch(handle))
            self.fetched.append(losses)
            finite = np.isfinite(losses)
            if self.diverged is None and not finite.all():
                index = int(np.argmin(finite))
                self.diverged = {"step": first + index + 1, "loss": str(float(losses[index])),
                                 "seen_in": "train_loss"}

    def evaluate(self, epoch: int) -> bool:
        """Validate now; True if training should stop (target reached, patience spent, diverged)."""
        self.sync()
        if self.diverged is not None:
            return True
        record: dict[str, Any] = {"step": self.step, "epoch": epoch,
                                  "train_time": self.train_time()}
        eval_start = time.perf_counter()
        record["val_loss"], record[f"val_{self.config.task.metric}"] = self.trainer.evaluate()
        if self.losses_since_eval:
            record["train_loss"] = float(np.mean(self.losses_since_eval))
        self.losses_since_eval.clear()
        self.history.record_eval(**record)
        self.eval_seconds += time.perf_counter() - eval_start
        if self.monitor is not None:
            self.monitor.reset_clock()  # evaluation is not a train step
        if self.reporter is not None:
            self.reporter.epoch_end(epoch, self.plan.epochs, record)
        target = self.config.target
        if target is not None and target.reached(record):
            self.history.extra["target_reached"] = {"step": self.step, "epoch": epoch,
                                                    "train_time": record["train_time"]}
            return True
        return self.stopper is not None and self.stopper.should_stop(record, self.trainer)

    def dispatch(self, rows: Any, start: int, length: int) -> None:
        """Compile (if new) and dispatch one call of ``length`` steps from row ``start``."""
        compile_seconds = self.trainer.compile(length, rows)
        self.compile_seconds += compile_seconds
        if self.monitor is not None and compile_seconds:
            self.monitor.reset_clock()  # compilation is not a train step
        self.pending.append((self.step, self.trainer.run(rows, start, length)))
        if self.monitor is not None:  # waits for the call: monitoring gives up dispatch overlap
            self.monitor.step_end(samples=length * self.plan.batch_size, steps=length,
                                  result=self.pending[-1][1])
        self.step += length
        # The previous call has (nearly) finished while this one is queued: reading its losses
        # costs the device no idle time and finds a divergence one call later at most.
        self.fetch_ready(len(self.pending) - 1)
        live = getattr(self.reporter, "steps_done", None)
        if live is not None and self.fetched:
            done = self.pending[len(self.fetched) - 1][0] + len(self.fetched[-1])
            live(done, self.plan.total_steps, float(self.fetched[-1][-1]), self.train_time(),
                 self.plan.batch_size)

    def epoch(self, epoch: int, shuffle: bool) -> bool:
        """Train one epoch; True if an evaluation asked to stop (target or patience)."""
        plan = self.plan
        with self.monitor.input_wait() if self.monitor is not None else nullcontext():
            rows = self.trainer.put_epoch(batching.epoch_batches(
                plan.n_train, plan.batch_size, self.config.seed, epoch - 1, shuffle))
        start = 0
        for length in batching.call_lengths(plan.steps_per_epoch, plan.fused_steps):
            length = min(length, plan.total_steps - self.step)
            if length <= 0:
                break
            step_before = self.step
            self.dispatch(rows, start, length)
            start += length
            if self.diverged is not None:
                return True
            crossed_eval = self.step // plan.eval_every > step_before // plan.eval_every
            if (crossed_eval or self.step >= plan.total_steps) and self.evaluate(epoch):
                return True
        return False


def run(trainer: Trainer, plan: Plan, config: Any, reporter: Any = None, *,
        history: History | None = None) -> History:
    """Train with ``trainer`` as ``plan`` says; the history in kbackend's format.

    ``config`` supplies the seed, target, early stopping (``monitor``, ``early_stopping``) and
    ``hardware_monitor``, and ``shuffle`` (False: every epoch in the dataset's order).
    """
    history = history if history is not None else History()
    capped = plan.for_trainer(trainer)
    if capped is not plan:
        history.extra["fused_steps_asked"] = plan.fused_steps
        plan = capped
    history.extra.update(fused_steps=plan.fused_steps, steps_per_epoch=plan.steps_per_epoch,
                         eval_every=plan.eval_every, dropped_per_epoch=plan.dropped_per_epoch)
    history.extra.update(trainer.history_extra)
    state = _Run(trainer, plan, config, reporter, history)
    epoch, stop = 0, False
    for epoch in range(1, plan.epochs + 1):
        stop = state.epoch(epoch, config.shuffle)
        if stop or state.step >= plan.total_steps:
            break
        state.sync()  # epoch end: bound the number of undelivered calls
        if state.diverged is not None:
            break
    state.sync()
    if state.diverged is not None:
        history.extra["diverged"] = state.diverged
    elif history.evals and history.evals[-1]["step"] != state.step:
        state.evaluate(epoch)
    history.timing["train_time"] = state.train_time()
    if state.monitor is not None:
        history.extra["monitor"] = state.monitor.stop()
    history.timing["eval_time"] = state.eval_seconds
    history.timing["compile_time"] = state.compile_seconds
    stopper = state.stopper
    # Stopped before the budget by a target or by patience (as Keras fit's epochs say); only
    # patience restores the best values.
    history.stopped_early = bool(stop and state.diverged is None)
    if (history.stopped_early and stopper is not None and "target_reached" not in history.extra
            and stopper.best_snapshot is not None):
        trainer.restore(stopper.best_snapshot)
    trainer.finish()
    history.extra["epochs_run"] = epoch
    history.extra["trace_counts"] = {str(k): v for k, v in trainer.trace_counts.items()}
    return history


class EpochRunner:
    """Whole epochs of the loop without history bookkeeping (for benchmarks and the K probe).

    ``runner()`` trains one epoch exactly as ``run`` does (same batches, call lengths and
    compiled programs) and returns its per-step losses; ``compile_time`` accumulates the
    seconds spent compiling.
    """

    def __init__(self, trainer: Trainer, n_train: int, batch_size: int, fused_steps: int,
                 seed: int = 0) -> None:
        self.trainer, self.n_train, self.batch_size, self.seed = trainer, n_train, batch_size, seed
        steps = batching.steps_per_epoch_dropping_last(n_train, batch_size)
        batching.check_fused_steps(fused_steps, steps, n_train, batch_size)
        self.lengths = batching.call_lengths(steps, steps_per_call(trainer, fused_steps))
        self.epoch = 0
        self.compile_time = 0.0

    def __call__(self) -> np.ndarray:
        rows = self.trainer.put_epoch(
            batching.epoch_batches(self.n_train, self.batch_size, self.seed, self.epoch))
        self.epoch += 1
        handles, start = [], 0
        for length in self.lengths:
            self.compile_time += self.trainer.compile(length, rows)
            handles.append(self.trainer.run(rows, start, length))
            start += length
        return np.concatenate([self.trainer.fetch(handle) for handle in handles])


def run_population(trainer: Any, plan: Plan, configs: list[Any],
                   censor: Any = None) -> list[History]:
    """Train a population (``impl().population_trainer``, reset already) as ``plan`` says; one
    history per member, each the history its run alone would have (``run``'s batches, call
    lengths, evaluation points and target) up to float rounding.

    All members share the plan; member m shuffles with ``configs[m].seed`` and stops at its own
    target. The population runs until every member has stopped or the budget is spent; a
    stopped member's later steps are computed (vmap has no holes) but not recorded. Members are
    checked for divergence at evaluation points and epoch ends (not one call later, as ``run``
    does): a diverged member stops there, the others go on. A member's values are frozen where it
    stops (``trainer.freeze``) and the test split is evaluated once for all at the end. Timing
    is the population's: one clock, one compilation, shared by all.
    ``censor(step, histories, active)``, called after each evaluation, returns members to stop
    there without a target (the study's pruning: runs that can no longer win); each is then the
    run alone with ``max_steps`` = that step, and ``extra["censored_at"]`` says so.
    Early stopping and the hardware monitor are single-run features and are refused.
    """
    if any(c.early_stopping or getattr(c, "hardware_monitor", False) for c in configs):
        raise ConfigError("A population runs neither early stopping nor the hardware monitor; "
                          "train those runs one at a time.")
    plan = plan.for_trainer(trainer)
    histories = [History() for _ in configs]
    for history in histories:
        history.extra.update(fused_steps=plan.fused_steps, steps_per_epoch=plan.steps_per_epoch,
                             eval_every=plan.eval_every, dropped_per_epoch=plan.dropped_per_epoch)
    active = set(range(len(configs)))
    losses_since_eval: list[list[float]] = [[] for _ in configs]
    pending: list[tuple[int, Any]] = []
    clock = {"start": time.perf_counter(), "eval": 0.0, "compile": 0.0, "synced_at": 0.0}

    def train_time() -> float:
        return time.perf_counter() - clock["start"] - clock["eval"]

    def finish(members: list[int], epoch: int) -> None:
        if not members:
            return
        trainer.freeze(members)  # the test split is evaluated once, for all, at the end
        for m in members:
            history = histories[m]
            history.timing.update(train_time=train_time(), eval_time=clock["eval"],
                                  compile_time=clock["compile"])
            history.extra.update(epochs_run=epoch, trace_counts={
                str(k): v for k, v in trainer.trace_counts.items()})
            active.discard(m)

    def sync(epoch: int) -> None:
        if not pending:
            return
        losses = np.concatenate([trainer.fetch(handle) for _, handle in pending], axis=1)
        first = pending[0][0]
        pending.clear()
        now = train_time()
        steps = list(range(first + 1, first + losses.shape[1] + 1))
        times = np.linspace(clock["synced_at"], now, losses.shape[1] + 1)[1:]
        clock["synced_at"] = now
        diverged = []
        for m in sorted(active):
            histories[m].record_steps(steps, losses[m].tolist(), times.tolist())
            losses_since_eval[m].extend(float(v) for v in losses[m])
            finite = np.isfinite(losses[m])
            if not finite.all():
                index = int(np.argmin(finite))
                histories[m].extra["diverged"] = {
                    "step": first + index + 1, "loss": str(float(losses[m][index])),
                    "seen_in": "train_loss"}
                diverged.append(m)
        finish(diverged, epoch)

    def evaluate(step: int, epoch: int, members: set[int] | None = None) -> None:
        sync(epoch)
        members = active if members is None else members & active
        if not members:
            return
        at = train_time()
        eval_start = time.perf_counter()
        val_loss, val_metric = trainer.evaluate()
        metric = f"val_{configs[0].task.metric}"
        clock["eval"] += time.perf_counter() - eval_start
        reached = []
        for m in sorted(members):
            record: dict[str, Any] = {"step": step, "epoch": epoch, "train_time": at,
                                      "val_loss": float(val_loss[m]),
                                      metric: float(val_metric[m])}
            if losses_since_eval[m]:
                record["train_loss"] = float(np.mean(losses_since_eval[m]))
            losses_since_eval[m].clear()
            histories[m].record_eval(**record)
            target = configs[m].target
            if target is not None and target.reached(record):
                histories[m].extra["target_reached"] = {"step": step, "epoch": epoch,
                                                        "train_time": at}
                reached.append(m)
        finish(reached, epoch)
        if censor is not None and active:
            stopped = sorted(set(censor(step, histories, set(active))) & active)
            for m in stopped:
                histories[m].extra["censored_at"] = step
            finish(stopped, epoch)

    step, epoch = 0, 0
    for epoch in range(1, plan.epochs + 1):
        rows = trainer.put_epoch(np.stack([
            batching.epoch_batches(plan.n_train, plan.batch_size, c.seed, epoch - 1, c.shuffle)
            for c in configs]))
        start = 0
        for length in batching.call_lengths(plan.steps_per_epoch, plan.fused_steps):
            length = min(length, plan.total_steps - step)
            if length <= 0 or not active:
                break
            clock["compile"] += trainer.compile(length, rows)
            pending.append((step, trainer.run(rows, start, length)))
            step_before, step, start = step, step + length, start + length
            crossed_eval = step // plan.eval_every > step_before // plan.eval_every
            if crossed_eval or step >= plan.total_steps:
                evaluate(step, epoch)
        if not active or step >= plan.total_steps:
            break
        sync(epoch)
    sync(epoch)
    evaluate(step, epoch, {m for m in active
                           if histories[m].evals and histories[m].evals[-1]["step"] != step})
    finish(sorted(active), epoch)
    eval_start = time.perf_counter()
    test_loss, test_metric = trainer.evaluate_test()
    test_seconds = time.perf_counter() - eval_start
    metric = f"test_{configs[0].task.metric}"
    for m, history in enumerate(histories):
        history.test = {"test_loss": float(test_loss[m]), metric: float(test_metric[m])}
        history.timing["eval_time"] += test_seconds
    return histories
