"""The one epoch loop of the native engines: fused calls, evaluation points, targets, stopping.

Every engine that drives its own compiled calls (``native``, ``data_parallel``) hands a
``Trainer`` (the protocol in ``kbackend.backends``) and its ``TrainPlan`` to ``run``; a study's
cell hands a population trainer (``impl().population_trainer``: M runs in lockstep) to
``run_population``. Both are the same loop (``_Loop``): a single run is a population of one.
The Keras ``fit`` engines use Keras's loop. How a run goes:

* Each epoch, a permutation fixed by ``(seed, epoch)`` is cut into full batches (the last
  ``n % batch_size`` samples of the shuffled order are dropped: a fused loop needs one batch
  shape) and its index matrix goes to the trainer at the start of the epoch (``put_epoch``; a
  population stacks one matrix per member, each with its own seed).
* An epoch runs as calls of ``fused_steps`` (K) steps, the last one shorter when K does not
  divide the epoch; a call never spans two epochs. Each distinct call length is compiled once
  (at most two per run, three if ``max_steps`` cuts a call short); ``history.timing
  ["compile_time"]`` is the part of ``train_time`` spent compiling.
* Calls are dispatched asynchronously; the host reads a call's losses once the next call is
  dispatched (so the device always has work queued), and records them only at evaluation
  points and epoch ends. Per-step times are the measured times at those waits, spread evenly
  over the steps between them (a fused call has no finer clock).
* Validation runs once per epoch (``eval_every`` 0) or after the first call that reaches each
  multiple of ``eval_every`` steps (so with K > 1 it is rounded up to a call boundary), and at the
  end. Targets, early stopping (patience in evaluations, best values restored; one run only)
  and the reporter act at those points. Training time excludes evaluation.
* Divergence: a member whose loss becomes non-finite stops. When no healthy member is left (a
  single run always) the loop stops at once, at most one call (K steps) after the call it
  happened in; otherwise the member stops at the next evaluation point or epoch end and the
  others go on. ``history.record.diverged`` holds its step and value and there is no further
  evaluation. Raising is the caller's decision (``kbackend.training.train``).

A batch size that grows during a run (``--batch-size auto``, issue 37) plugs in here without a
second loop: at each evaluation point (where every call has ended and the losses are recorded)
``run`` asks its ``policy`` (``engines.adaptive.AdaptiveBatch``) for the plan of the next steps;
a new plan (another batch size, its call lengths; the same trainer, whose state runs through
every size) takes over from the next call, with the rest of the epoch's order cut into batches
of the new size, and evaluation points counted from that step. ``_Loop`` reads every number
from ``self.plan`` for that reason.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from typing import Any

import numpy as np

from kbackend.backends import Trainer
from kbackend.backends.capabilities import MAX_UNROLLED_STEPS
from kbackend.config import TrainConfig
from kbackend.data import batching
from kbackend.engines.plan import TrainPlan
from kbackend.errors import ConfigError
from kbackend.hardware.monitor import StepMonitor
from kbackend.history import History, RunRecord
from kbackend.optim import OptimizerSpec
from kbackend.task import better

__all__ = ["EarlyStopping", "EpochRunner", "TrainPlan", "Trainer", "run", "run_population",
           "steps_per_call"]


def steps_per_call(trainer: Trainer, fused_steps: int) -> int:
    """K as asked, or at most ``capabilities.MAX_UNROLLED_STEPS`` where ``trainer`` writes its K
    steps out: its program holds K copies of the step, so compile time and program size grow
    with K while the step time does not fall (the steps are the same either way)."""
    return min(fused_steps, MAX_UNROLLED_STEPS) if trainer.unroll else fused_steps


def plan_for_trainer(plan: TrainPlan, trainer: Trainer) -> TrainPlan:
    """``plan`` with K as ``trainer`` runs it (``steps_per_call``)."""
    return plan.with_fused_steps(steps_per_call(trainer, plan.fused_steps))


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


class _Loop:
    """The one epoch loop over M members (M = 1: a single run): the clock, undelivered calls,
    each member's history until it stops (target, patience, divergence, censoring, budget).

    ``stacked``: the trainer is a population trainer (epoch matrices ``(M, steps, B)``, losses
    ``(M, K)``, per-member evaluations, ``freeze``); otherwise a single run's trainer, whose
    values are seen here with a member axis of one.
    """

    def __init__(self, trainer: Any, plan: TrainPlan, configs: list[TrainConfig],
                 histories: list[History], *, stacked: bool, reporter: Any = None,
                 censor: Any = None, policy: Any = None) -> None:
        self.trainer, self.configs, self.histories = trainer, configs, histories
        self.policy = policy  # a single run's batch-size policy (``run``), or None
        self.stacked, self.reporter, self.censor = stacked, reporter, censor
        self.plan = plan_for_trainer(plan, trainer)
        for history in histories:
            record = history.record
            if self.plan.fused_steps != plan.fused_steps:
                record.fused_steps_asked = plan.fused_steps
            record.fused_steps, record.steps_per_epoch = (self.plan.fused_steps,
                                                          self.plan.steps_per_epoch)
            record.eval_every, record.dropped_per_epoch = (self.plan.eval_every,
                                                           self.plan.dropped_per_epoch)
        single = configs[0] if len(configs) == 1 else None
        self.stopper = (EarlyStopping(single.monitor, single.early_stopping)
                        if single is not None and single.early_stopping else None)
        self.stopped_by_patience = False
        # Compilation runs ahead of time (and is excluded by reset_clock), so no call is skipped.
        self.monitor = (StepMonitor(skip_first=0).start()
                        if single is not None and single.hardware_monitor else None)
        self.active = set(range(len(configs)))
        self.noticed: dict[int, dict[str, Any]] = {}  # members' first non-finite loss
        self.losses_since_eval: list[list[float]] = [[] for _ in configs]
        self.step = 0  # steps dispatched so far
        self.epoch = 0
        self.epoch_samples = 0  # samples of this epoch's order dispatched so far
        self.plan_start = 0  # the step the current plan took over (evaluation points count)
        self.pending: list[tuple[int, Any]] = []  # (first step, device losses) not yet recorded
        self.fetched: list[np.ndarray] = []  # host losses (M, L) of the first pending calls
        self.start = time.perf_counter()
        self.eval_seconds = self.compile_seconds = self.synced_at = 0.0

    def train_time(self) -> float:
        return time.perf_counter() - self.start - self.eval_seconds

    @property
    def halted(self) -> bool:
        """No healthy member is left: stop at once rather than at the next evaluation."""
        return bool(self.active) and self.active <= set(self.noticed)

    # -- the steps -----------------------------------------------------------------------------
    def _put_epoch(self) -> Any:
        plan = self.plan
        matrices = [batching.epoch_batches(plan.n_train, plan.batch_size, c.seed, self.epoch - 1,
                                           c.shuffle) for c in self.configs]
        with self.monitor.input_wait() if self.monitor is not None else nullcontext():
            return self.trainer.put_epoch(np.stack(matrices) if self.stacked else matrices[0])

    def fetch_ready(self, count: int) -> None:
        """Read the losses of the first ``count`` pending calls to the host; note divergence."""
        for first, handle in self.pending[len(self.fetched):count]:
            losses = np.asarray(self.trainer.fetch(handle))
            losses = losses if self.stacked else losses[None, :]
            self.fetched.append(losses)
            for m in sorted(self.active - set(self.noticed)):
                finite = np.isfinite(losses[m])
                if not finite.all():
                    index = int(np.argmin(finite))
                    self.noticed[m] = {"step": first + index + 1,
                                       "loss": str(float(losses[m][index])),
                                       "seen_in": "train_loss"}

    def sync(self) -> None:
        """Wait for the dispatched calls; record their losses with interpolated times; stop the
        members that diverged."""
        if not self.pending:
            return
        self.fetch_ready(len(self.pending))
        losses = np.concatenate(self.fetched, axis=1)
        first = self.pending[0][0]
        now = self.train_time()
        times = np.linspace(self.synced_at, now, losses.shape[1] + 1)[1:].tolist()
        steps = list(range(first + 1, first + losses.shape[1] + 1))
        for m in sorted(self.active):
            self.histories[m].record_steps(steps, losses[m].tolist(), times)
            self.losses_since_eval[m].extend(float(v) for v in losses[m])
        self.synced_at = now
        self.pending.clear()
        self.fetched.clear()
        diverged = sorted(self.active & set(self.noticed))
        for m in diverged:
            self.histories[m].record.diverged = self.noticed[m]
        self.finish(diverged)

    def dispatch(self, rows: Any, start: int, length: int) -> None:
        """Compile (if new) and dispatch one call of ``length`` steps from row ``start``."""
        compile_seconds = self.trainer.compile(length, rows)
        self.compile_seconds += compile_seconds
        if self.monitor is not None and compile_seconds:
            self.monitor.reset_clock()  # compilation is not a train step
        self.pending.append((self.step, self.trainer.run(rows, start, length)))
        self.epoch_samples += length * self.plan.batch_size
        if self.monitor is not None:  # waits for the call: monitoring gives up dispatch overlap
            self.monitor.step_end(samples=length * self.plan.batch_size, steps=length,
                                  result=self.pending[-1][1])
        self.step += length
        # The previous call has (nearly) finished while this one is queued: reading its losses
        # costs the device no idle time and finds a divergence one call later at most.
        self.fetch_ready(len(self.pending) - 1)
        live = getattr(self.reporter, "steps_done", None)
        if live is not None and self.fetched:
            done = self.pending[len(self.fetched) - 1][0] + self.fetched[-1].shape[1]
            live(done, self.plan.total_steps, float(self.fetched[-1][0][-1]), self.train_time(),
                 self.plan.batch_size)

    # -- evaluation points ---------------------------------------------------------------------
    def evaluate(self, members: set[int] | None = None) -> None:
        """Validate the active ``members`` (all by default) now; stop those that reached their
        target, ran out of patience or are censored."""
        self.sync()
        members = self.active if members is None else members & self.active
        if not members:
            return
        at = self.train_time()
        eval_start = time.perf_counter()
        val_loss, val_metric = map(np.atleast_1d, self.trainer.evaluate())
        metric = f"val_{self.configs[0].task.metric}"
        records: dict[int, dict[str, Any]] = {}
        for m in sorted(members):
            record: dict[str, Any] = {"step": self.step, "epoch": self.epoch, "train_time": at,
                                      "val_loss": float(val_loss[m]),
                                      metric: float(val_metric[m])}
            if self.losses_since_eval[m]:
                record["train_loss"] = float(np.mean(self.losses_since_eval[m]))
            self.losses_since_eval[m].clear()
            self.histories[m].record_eval(**record)
            records[m] = record
        self.eval_seconds += time.perf_counter() - eval_start
        if self.monitor is not None:
            self.monitor.reset_clock()  # evaluation is not a train step
        stopped = []
        for m, record in records.items():
            if self.reporter is not None:
                self.reporter.epoch_end(self.epoch, self.plan.epochs, record)
            target = self.configs[m].target
            if target is not None and target.reached_in(self.histories[m].evals):
                self.histories[m].record.target_reached = {"step": self.step, "epoch": self.epoch,
                                                           "train_time": at}
                stopped.append(m)
            elif self.stopper is not None and self.stopper.should_stop(record, self.trainer):
                self.stopped_by_patience = True
                stopped.append(m)
        for m in stopped:  # by a target or patience, before the budget (as Keras fit's epochs)
            self.histories[m].stopped_early = True
        self.finish(stopped)
        if self.censor is not None and self.active:
            censored = sorted(set(self.censor(self.step, self.histories, set(self.active)))
                              & self.active)
            for m in censored:
                self.histories[m].record.censored_at = self.step
            self.finish(censored)

    def finish(self, members: list[int]) -> None:
        """Stop ``members``: their timing and counts as of now; a population freezes their
        values (the test split is evaluated once, for all, at the end)."""
        if not members:
            return
        if self.stacked:
            self.trainer.freeze(members)
        trace_counts = {str(k): v for k, v in self.trainer.trace_counts.items()}
        for m in members:
            history = self.histories[m]
            history.timing.update(train_time=self.train_time(), eval_time=self.eval_seconds,
                                  compile_time=self.compile_seconds)
            history.record.epochs_run, history.record.trace_counts = self.epoch, trace_counts
            self.active.discard(m)

    # -- the loop ------------------------------------------------------------------------------
    def regrow(self) -> tuple[Any, list[int]] | None:
        """At an evaluation point: the policy's new plan, if any, from the next call on; the
        rest of the epoch's rows (on the device; None if none are left) and their call
        lengths."""
        if self.policy is None or not self.active or self.halted:
            return None
        grown = self.policy.next_plan(self.plan, self.step, self.epoch, self.epoch_samples)
        if grown is None:
            return None
        plan, rest, steps = grown
        self.plan, self.plan_start = plan_for_trainer(plan, self.trainer), self.step
        if not steps:
            return None, []
        return (self.trainer.put_epoch(rest),
                batching.call_lengths(steps, min(self.plan.fused_steps, steps)))

    def run(self) -> None:
        """Train until every member has stopped or the plan's budget is spent."""
        for epoch in range(1, self.plan.epochs + 1):
            self.epoch, self.epoch_samples = epoch, 0
            rows = self._put_epoch()
            start, lengths = 0, self.plan.call_lengths()
            while lengths:
                length = min(lengths.pop(0), self.plan.total_steps - self.step)
                if length <= 0 or not self.active:
                    break
                step_before = self.step
                self.dispatch(rows, start, length)
                start += length
                if self.halted:
                    break
                if self.plan.crosses_evaluation(step_before, self.step, self.plan_start):
                    self.evaluate()
                    grown = self.regrow()
                    if grown is not None:
                        (rows, lengths), start = grown, 0
            if not self.active or self.halted or self.step >= self.plan.total_steps:
                break
            self.sync()  # epoch end: bound the number of undelivered calls
            if not self.active:
                break
        self.sync()
        self.evaluate({m for m in self.active if self.histories[m].evals
                       and self.histories[m].evals[-1]["step"] != self.step})
        self.finish(sorted(self.active))


def native_history(spec: OptimizerSpec, **record: Any) -> History:
    """An empty history of a native-engine run of ``spec``; ``record``: more of its fields."""
    return History(record=RunRecord(engine="native", decay_steps=spec.decay_steps, **record))


def note_test_divergence(history: History) -> None:
    """A non-finite test loss after finite training losses, recorded as ``record.diverged``."""
    test_loss = history.test["test_loss"]
    if history.record.diverged is None and not math.isfinite(test_loss):
        history.record.diverged = {"step": history.steps_run, "loss": str(test_loss),
                                   "seen_in": "test_loss"}


def run(trainer: Trainer, plan: TrainPlan, config: TrainConfig, reporter: Any = None, *,
        history: History | None = None, policy: Any = None) -> History:
    """Train with ``trainer`` as ``plan`` says; the history in kbackend's format.

    ``config`` supplies the seed, target, early stopping (``monitor``, ``early_stopping``) and
    ``hardware_monitor``, and ``shuffle`` (False: every epoch in the dataset's order).
    ``policy.next_plan(plan, step, epoch, samples_used) -> (plan, rows, steps) | None``, asked
    at each evaluation point, changes the plan from the next call on (``--batch-size auto``):
    the epoch goes on with the first ``steps`` of ``rows``.
    """
    history = history if history is not None else History()
    history.record.update(trainer.run_record)
    state = _Loop(trainer, plan, [config], [history], stacked=False, reporter=reporter,
                  policy=policy)
    state.run()
    if state.monitor is not None:
        history.record.monitor = state.monitor.stop()
    # Only patience restores the best values (a target keeps the values that reached it).
    if state.stopped_by_patience and state.stopper is not None \
            and state.stopper.best_snapshot is not None:
        trainer.restore(state.stopper.best_snapshot)
    trainer.finish()
    return history


def run_population(trainer: Any, plan: TrainPlan, configs: list[TrainConfig],
                   censor: Any = None) -> list[History]:
    """Train a population (``impl().population_trainer``, reset already) as ``plan`` says; one
    history per member, each the history its run alone would have (``run``'s batches, call
    lengths, evaluation points and target) up to float rounding.

    All members share the plan; member m shuffles with ``configs[m].seed`` and stops at its own
    target. The population runs until every member has stopped or the budget is spent; a
    stopped member's later steps are computed (vmap has no holes) but not recorded. A diverged
    member stops at the next evaluation point or epoch end (one call later, as ``run`` does,
    only when no healthy member is left); the others go on. A member's values are frozen where
    it stops (``trainer.freeze``) and the test split is evaluated once for all at the end.
    Timing is the population's: one clock, one compilation, shared by all.
    ``censor(step, histories, active)``, called after each evaluation, returns members to stop
    there without a target (the study's pruning: runs that can no longer win); each is then the
    run alone with ``max_steps`` = that step, and ``record.censored_at`` says so.
    Early stopping and the hardware monitor are single-run features and are refused.
    """
    if any(c.early_stopping or c.hardware_monitor for c in configs):
        raise ConfigError("A population runs neither early stopping nor the hardware monitor; "
                          "train those runs one at a time.")
    histories = [History() for _ in configs]
    _Loop(trainer, plan, configs, histories, stacked=True, censor=censor).run()
    eval_start = time.perf_counter()
    test_loss, test_metric = trainer.evaluate_test()
    test_seconds = time.perf_counter() - eval_start
    metric = f"test_{configs[0].task.metric}"
    for m, history in enumerate(histories):
        history.test = {"test_loss": float(test_loss[m]), metric: float(test_metric[m])}
        history.timing["eval_time"] += test_seconds
    return histories


class EpochRunner:
    """Whole epochs of the loop without history bookkeeping (for benchmarks and the K probe).

    ``runner()`` trains one epoch exactly as ``run`` does (same batches, call lengths and
    compiled programs) and returns its per-step losses; ``compile_time`` accumulates the
    seconds spent compiling.
    """

    def __init__(self, trainer: Trainer, n_train: int, batch_size: int, fused_steps: int,
                 seed: int = 0) -> None:
        self.trainer, self.n_train, self.batch_size, self.seed = trainer, n_train, batch_size, seed
        steps = batching.steps_per_epoch(n_train, batch_size)
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


