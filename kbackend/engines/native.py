"""The native engine: K train steps per compiled device call, on JAX (optax) or TF (Keras).

This module is the backend-independent driver; the compiled loops live behind the dispatch
point (``impl().native_trainer``: ``backends/jax_native.py``, ``backends/tf_native.py``).

How a run goes:

* The training split is copied to the device once. Each epoch, a permutation fixed by
  ``(seed, epoch)`` is cut into full batches (the last ``n % batch_size`` samples of the shuffled
  order are dropped: a fused loop needs one batch shape) and its index matrix is sent to the
  device at the start of the epoch, ahead of the steps that use it.
* An epoch runs as calls of ``fused_steps`` (K) steps, the last one shorter when K does not
  divide the epoch; a call never spans two epochs. Each distinct call length is compiled once
  (at most two per run, three if ``max_steps`` cuts a call short); ``history.timing
  ["compile_time"]`` is the part of ``train_time`` spent compiling.
* Calls are dispatched asynchronously; the host waits only at evaluation points and epoch ends.
  Per-step times are the measured times at those waits, spread evenly over the steps between
  them (a fused call has no finer clock).
* ``fused_steps=0`` (``--fused-steps auto``) picks K by measurement: ``probe_fused_steps`` times
  one short epoch per candidate on a throwaway clone of the model and keeps the fastest (its
  figures go to ``history.extra["fused_steps_probe"]``; the probe runs before the clock starts).
* Validation runs once per epoch (``eval_every`` 0) or after the first call that reaches each
  multiple of ``eval_every`` steps (so with K > 1 it is rounded up to a call boundary), and at the
  end. Targets, early stopping (patience in evaluations, best values restored) and the reporter
  act at those points. Training time excludes evaluation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import numpy as np

from kbackend.backends import impl
from kbackend.data import batching
from kbackend.engines.keras_fit import compile_model
from kbackend.hardware.monitor import StepMonitor
from kbackend.history import History


class _EarlyStopping:
    """Patience counted in evaluations; remembers the best values to restore at the end."""

    def __init__(self, monitor: str, patience: int) -> None:
        self.monitor, self.patience = monitor, patience
        self.best: float | None = None
        self.best_snapshot: Any = None
        self.waited = 0

    def improved(self, value: float) -> bool:
        if self.best is None:
            return True
        return value > self.best if "acc" in self.monitor else value < self.best

    def should_stop(self, record: dict[str, float], trainer: Any) -> bool:
        value = record[self.monitor]
        if self.improved(value):
            self.best, self.best_snapshot, self.waited = value, trainer.snapshot(), 0
            return False
        self.waited += 1
        return self.waited >= self.patience


def train(model: Any, dataset: Any, spec: Any, config: Any, reporter: Any = None, *,
          shuffle: bool = True, trainer_factory: Callable[..., Any] | None = None) -> History:
    """Train ``model`` in place with fused native steps; the history in kbackend's format.

    ``shuffle=False`` keeps the data order (for comparisons with other engines).
    ``trainer_factory(model, spec, dataset)`` makes the trainer that runs the compiled calls
    (default: the backend's single-device ``native_trainer``; the data-parallel engine passes
    its sharded one). A trainer's optional ``history_extra`` dict goes into ``history.extra``.
    """
    n_train, batch_size = len(dataset.x_train), config.batch_size
    steps_per_epoch = batching.steps_per_epoch(n_train, batch_size)
    fused_steps, probe = config.fused_steps, None
    if fused_steps == 0:  # auto: measure a few K on a throwaway copy of the model
        probe_start = time.perf_counter()
        fused_steps, probe = probe_fused_steps(model, dataset, spec, batch_size, config.seed)
        probe = {"us_per_step": {str(k): v for k, v in probe.items()},
                 "seconds": time.perf_counter() - probe_start}
    batching.check_fused_steps(fused_steps, steps_per_epoch, n_train, batch_size)
    total_steps = steps_per_epoch * config.epochs
    if config.max_steps:
        total_steps = min(total_steps, config.max_steps)
    if config.optimizer.decay_steps is None:
        # Schedules span the epochs this engine really runs (it drops partial batches); like
        # the Keras engine's, the horizon ignores max_steps and targets (they only stop early).
        spec = replace(spec, decay_steps=None).with_total_steps(steps_per_epoch * config.epochs)
    # Compiled for evaluate/predict/save afterwards; the TF loop trains with this optimizer.
    compile_model(model, spec, config)
    trainer = (trainer_factory or impl().native_trainer)(model, spec, dataset)
    eval_every = config.eval_every or steps_per_epoch
    history = History()
    history.extra.update(engine="native", fused_steps=fused_steps,
                         steps_per_epoch=steps_per_epoch, eval_every=eval_every,
                         dropped_per_epoch=n_train - steps_per_epoch * batch_size,
                         decay_steps=spec.decay_steps)
    history.extra.update(getattr(trainer, "history_extra", {}))
    if probe is not None:
        history.extra["fused_steps_probe"] = probe
    stopper = (_EarlyStopping(config.monitor, config.early_stopping)
               if config.early_stopping else None)

    # Compilation runs ahead of time (and is excluded by reset_clock), so no call is skipped.
    monitor = (StepMonitor(skip_first=0).start() if getattr(config, "hardware_monitor", False)
               else None)
    step = 0  # steps dispatched so far
    pending: list[tuple[int, int, Any]] = []  # (first step, length, device losses) not yet read
    pending_losses: list[float] = []  # losses since the last evaluation (for train_loss)
    clock = {"start": time.perf_counter(), "eval": 0.0, "compile": 0.0, "synced": 0.0}

    def train_time() -> float:
        return time.perf_counter() - clock["start"] - clock["eval"]

    def sync() -> None:
        """Wait for the dispatched calls; record their losses with interpolated times."""
        if not pending:
            return
        losses = np.concatenate([trainer.fetch(handle) for _, _, handle in pending])
        first = pending[0][0]
        now = train_time()
        times = np.linspace(clock["synced"], now, len(losses) + 1)[1:]
        history.record_steps(list(range(first + 1, first + len(losses) + 1)), losses, times)
        pending_losses.extend(float(v) for v in losses)
        clock["synced"] = now
        pending.clear()

    def evaluate(epoch: int) -> bool:
        """Validate now; True if training should stop (target reached or patience spent)."""
        sync()
        record: dict[str, Any] = {"step": step, "epoch": epoch, "train_time": train_time()}
        eval_start = time.perf_counter()
        record["val_loss"], record["val_accuracy"] = trainer.evaluate()
        if pending_losses:
            record["train_loss"] = float(np.mean(pending_losses))
        pending_losses.clear()
        history.record_eval(**record)
        clock["eval"] += time.perf_counter() - eval_start
        if monitor is not None:
            monitor.reset_clock()  # evaluation is not a train step
        if reporter is not None:
            reporter.epoch_end(epoch, config.epochs, record)
        if config.target is not None and config.target.reached(record):
            history.extra["target_reached"] = {"step": step, "epoch": epoch,
                                               "train_time": record["train_time"]}
            return True
        return stopper is not None and stopper.should_stop(record, trainer)

    stop = False
    epoch = 0
    for epoch in range(1, config.epochs + 1):
        with monitor.input_wait() if monitor is not None else nullcontext():
            rows = trainer.put_epoch(batching.epoch_batches(n_train, batch_size, config.seed,
                                                            epoch - 1, shuffle))
        start = 0
        for length in batching.call_lengths(steps_per_epoch, fused_steps):
            length = min(length, total_steps - step)
            if length <= 0:
                break
            compile_seconds = trainer.compile(length, rows)
            clock["compile"] += compile_seconds
            if monitor is not None and compile_seconds:
                monitor.reset_clock()  # compilation is not a train step
            pending.append((step, length, trainer.run(rows, start, length)))
            if monitor is not None:  # waits for the call: monitoring gives up dispatch overlap
                monitor.step_end(samples=length * batch_size, steps=length,
                                 result=pending[-1][2])
            step_before, step, start = step, step + length, start + length
            crossed_eval = step // eval_every > step_before // eval_every
            last_step = step >= total_steps
            if (crossed_eval or last_step) and evaluate(epoch):
                stop = True
                break
        if stop or step >= total_steps:
            break
        sync()  # epoch end: bound the number of undelivered calls

    sync()
    if history.evals and history.evals[-1]["step"] != step:
        evaluate(epoch)
    history.timing["train_time"] = train_time()
    if monitor is not None:
        history.extra["monitor"] = monitor.stop()
    history.timing["eval_time"] = clock["eval"]
    history.timing["compile_time"] = clock["compile"]
    history.stopped_early = bool(stopper and stop and "target_reached" not in history.extra)
    if history.stopped_early and stopper.best_snapshot is not None:
        trainer.restore(stopper.best_snapshot)
    trainer.finish()
    history.extra["epochs_run"] = epoch
    history.extra["trace_counts"] = {str(k): v for k, v in trainer.trace_counts.items()}
    return history


class EpochRunner:
    """Whole epochs of the native loop without history bookkeeping (for benchmarks).

    ``runner()`` trains one epoch exactly as ``train`` does (same batches, call lengths and
    compiled programs) and returns its per-step losses; ``compile_time`` accumulates the
    seconds spent compiling.
    """

    def __init__(self, model: Any, dataset: Any, spec: Any, batch_size: int, fused_steps: int,
                 seed: int = 0) -> None:
        self.n_train, self.batch_size, self.seed = len(dataset.x_train), batch_size, seed
        steps = batching.steps_per_epoch(self.n_train, batch_size)
        batching.check_fused_steps(fused_steps, steps, self.n_train, batch_size)
        self.lengths = batching.call_lengths(steps, fused_steps)
        self.trainer = impl().native_trainer(model, spec, dataset)
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


PROBE_CANDIDATES = (1, 8, 32)


def probe_fused_steps(model: Any, dataset: Any, spec: Any, batch_size: int, seed: int = 0,
                      candidates: tuple[int, ...] = PROBE_CANDIDATES) -> tuple[int, dict]:
    """The fastest K among ``candidates`` (capped at one epoch), measured, and us/step of each.

    Each candidate trains a clone of ``model`` (same weights; ``model`` is not touched) on a
    probe epoch of ``max(candidates)`` batches: once to compile and warm up, once timed. Where
    per-call overhead dominates (small batches) large K wins; where the step's arithmetic
    dominates, K barely matters and the probe keeps whichever program XLA made fastest.
    """
    from dataclasses import replace as replace_fields

    from kbackend.backend import keras as import_keras

    keras = import_keras()
    steps = batching.steps_per_epoch(len(dataset.x_train), batch_size)
    ks = sorted({min(k, steps) for k in candidates})
    probe_steps = max(ks)
    subset = replace_fields(dataset, x_train=dataset.x_train[: probe_steps * batch_size],
                            y_train=dataset.y_train[: probe_steps * batch_size])
    timings: dict[int, float] = {}
    for k in ks:
        clone = keras.models.clone_model(model)
        clone.set_weights(model.get_weights())
        runner = EpochRunner(clone, subset, spec, batch_size, k, seed)
        runner()  # compiles
        start = time.perf_counter()
        runner()
        timings[k] = (time.perf_counter() - start) / probe_steps * 1e6
    return min(timings, key=timings.get), timings
