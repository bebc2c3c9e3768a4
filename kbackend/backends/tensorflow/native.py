"""The native TF train loop: ``GradientTape`` and the Keras optimizer in one XLA-compiled loop.

``K`` train steps run in one ``tf.function(jit_compile=True)`` call: a loop over ``K`` rows of
sample indices, each row gathered from the training split that lives on the device for the
whole run. The optimizer is the model's compiled Keras optimizer (``OptimizerSpec.to_keras()``),
so the math is the one documented in ``kbackend.optim``.

The loop's trip count is a tensor, not a Python int: calling a fresh loop with 0 steps compiles
it (and times the compilation) without training, and the real calls reuse that program.

Conv models on a CPU write the ``K`` steps out instead (a Python ``for`` in the traced function,
``capabilities.unrolls_its_loop``): XLA:CPU runs a convolution inside the loop ~40x slower. Such
a call has no 0-step form (a ``tf.cond`` around the steps is as slow as the loop), so its first
call trains ``K`` steps and the variables are put back afterwards: its compile time includes
those steps. A one-step call (K = 1) is written out for every model: it needs no loop, and TF's
loop made even the seed MLP's step ~40% slower here (docs/engines.md).

``jit_compile=False`` (``--no-jit``) runs the same loop as a ``tf.function`` graph without XLA:
no XLA compilation (on a CPU 1-3 s per program, more than a short run trains), steps slower
for larger models (docs/engines.md), and written out only at K = 1 (the unrolled form exists
for XLA:CPU's loops).

Reached only through ``kbackend.backends.ops()`` (the dispatch point).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import tensorflow as tf

from kbackend.backends import capabilities, device_copy_once, kept_while_alive
from kbackend.backends.tensorflow.ops import counted_loop, jit_function, platform
from kbackend.data.batching import pad_to_chunks
from kbackend.errors import ConfigError
from kbackend.history import RunRecord
from kbackend.task import CLASSIFICATION, Task

EVAL_CHUNK = 1024  # most validation samples per forward pass (the split is cut into even chunks)


def _on_device(array: np.ndarray) -> tf.Tensor:
    """A copy of ``array`` on the default device (the accelerator when there is one)."""
    return tf.identity(tf.convert_to_tensor(array))


def native_loop_uses_xla(jit_compile: bool) -> bool:
    """Whether the native loop is XLA-compiled: as ``jit_compile`` says (``--no-jit``: a graph)."""
    return jit_compile


def make_train_step(model: Any, optimizer: Any, task: Task = CLASSIFICATION) -> Any:
    """``train_step(x, y) -> loss``: one update of ``model``'s variables, in place, on the mean
    of ``task``'s loss plus the regularization losses."""

    def train_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            outputs = model(x, training=True)
            per_sample = task.per_sample_loss(y, outputs)
            loss = tf.reduce_sum(per_sample) / tf.cast(tf.size(per_sample), per_sample.dtype)
            if model.losses:  # regularization, summed as keras.Model.compute_loss does
                loss = tf.reduce_sum(tf.stack([loss, *(tf.reduce_sum(x) for x in model.losses)]))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    return train_step


class Evaluator:
    """Loss and metric (``task``'s) of a Keras model's current variables on a dataset's
    validation or test split (placed on the device once, padded into chunks), in one XLA
    program (a graph without XLA where ``jit_compile`` is False)."""

    def __init__(self, model: Any, dataset: Any, jit_compile: bool = True,
                 task: Task = CLASSIFICATION) -> None:
        self.model, self.dataset, self.task = model, dataset, task
        self._splits: dict[str, tuple[tf.Tensor, ...]] = {}
        self._evaluate = jit_function(self._evaluate_fn, jit_compile)

    def _evaluate_fn(self, x_chunks, y_chunks, mask_chunks):
        loss_sum = tf.constant(0.0)
        correct = tf.constant(0.0)
        for i in tf.range(tf.shape(x_chunks)[0]):
            outputs = self.model(x_chunks[i], training=False)
            per_sample = self.task.per_sample_loss(y_chunks[i], outputs)
            hits = self.task.per_sample_metric(y_chunks[i], outputs)
            loss_sum += tf.reduce_sum(per_sample * mask_chunks[i])
            correct += tf.reduce_sum(hits * mask_chunks[i])
        penalty = tf.add_n([tf.reduce_sum(x) for x in self.model.losses] or [tf.constant(0.0)])
        count = tf.reduce_sum(mask_chunks)
        return loss_sum / count + penalty, correct / count

    def __call__(self, split: str) -> tuple[float, float]:
        if split not in self._splits:
            x, y = getattr(self.dataset, f"x_{split}"), getattr(self.dataset, f"y_{split}")
            self._splits[split] = tuple(_on_device(a) for a in pad_to_chunks(x, y, EVAL_CHUNK))
        loss, accuracy = self._evaluate(*self._splits[split])
        return float(loss), float(accuracy)


_EVALUATORS: dict[tuple[int, int, bool, Task], Evaluator] = {}


def shared_evaluator(model: Any, dataset: Any, jit_compile: bool = True,
                     task: Task = CLASSIFICATION) -> Evaluator:
    """The ``Evaluator`` of ``model`` on ``dataset`` for ``task``, one while both live."""
    return kept_while_alive(_EVALUATORS, (id(model), id(dataset), jit_compile, task),
                            (model, dataset), lambda: Evaluator(model, dataset, jit_compile, task))


class NativeTrainer:
    """Runs fused train calls on one model; see ``kbackend.engines.native`` for the driver."""

    def __init__(self, model: Any, spec: Any, dataset: Any, jit_compile: bool = True,
                 task: Task = CLASSIFICATION) -> None:
        self.model = model
        self.jit_compile = jit_compile
        # The model's optimizer only where kbackend compiled it for this very spec
        # (``engines.keras_fit.compile_model``); a user's own compiled optimizer is not the
        # run's (a study's SGD cell must not train with the Adam the model was saved with).
        compiled_for = getattr(model, "_kbackend_spec", None)
        self.optimizer = (model.optimizer if compiled_for is not None and compiled_for == spec
                          and getattr(model, "optimizer", None) is not None else spec.to_keras())
        self.optimizer.build(model.trainable_variables)
        self.train_step = make_train_step(model, self.optimizer, task)
        # One device copy per dataset, shared by every trainer of it.
        self.x_train = device_copy_once(dataset.x_train, _on_device)
        self.y_train = device_copy_once(dataset.y_train, _on_device)
        self.dataset = dataset
        self._compiled: dict[int, Any] = {}
        self.trace_counts: dict[int, int] = {}
        # Shared by every trainer of this model and dataset (a study's cells): compiled once.
        self._evaluator = shared_evaluator(model, dataset, jit_compile, task)
        self.unroll = capabilities.unrolls_its_loop(model, platform(), xla=jit_compile)
        self.run_record = RunRecord(unrolled_loop=self.unroll, xla=jit_compile)

    # -- training -------------------------------------------------------------------------
    def writes_out(self, length: int) -> bool:
        """Whether a ``length``-step call has its steps written out instead of a loop: where the
        model's are (``unroll``), and always for one step, which needs no loop; TF's XLA loop
        made the seed MLP's step ~40% slower on a CPU (docs/engines.md)."""
        return self.unroll or length == 1

    def _run_fn(self, length: int) -> Any:
        def run(x_all, y_all, epoch_rows, start, n_steps):
            self.trace_counts[length] = self.trace_counts.get(length, 0) + 1
            if self.writes_out(length):  # the steps written out; ``n_steps`` is ``length``
                return tf.stack([
                    tf.cast(self._step_at(x_all, y_all, epoch_rows, start + i), tf.float32)
                    for i in range(length)])
            def body(i: tf.Tensor, losses: tf.Tensor) -> tuple[tf.Tensor]:
                loss = self._step_at(x_all, y_all, epoch_rows, start + i)
                return (tf.tensor_scatter_nd_update(losses, [[i]], [tf.cast(loss, tf.float32)]),)

            return counted_loop(n_steps, body, (tf.zeros([length], tf.float32),))[0]

        return jit_function(run, self.jit_compile)

    def _step_at(self, x_all: tf.Tensor, y_all: tf.Tensor, epoch_rows: tf.Tensor,
                 index: tf.Tensor) -> tf.Tensor:
        """One train step on the batch of row ``index`` of the epoch (gathered on the device)."""
        row = tf.gather(epoch_rows, index)  # dynamic index: no per-value compile
        return self.train_step(tf.gather(x_all, row), tf.gather(y_all, row))

    def put_epoch(self, rows: np.ndarray) -> tf.Tensor:
        """Move an epoch's ``(steps, batch)`` index matrix to the device, ahead of its steps."""
        return _on_device(rows)

    def compile(self, length: int, epoch_rows: Any) -> float:
        """Compile the ``length``-step call if needed (a 0-step call); the seconds it took."""
        if length in self._compiled:
            return 0.0
        start = time.perf_counter()
        fn = self._run_fn(length)
        if self.writes_out(length):  # no 0-step call: train ``length`` steps, put values back
            saved = self.state_copy()
            fn(self.x_train, self.y_train, epoch_rows, tf.constant(0), tf.constant(length)).numpy()
            self._put_state(saved)
        else:
            fn(self.x_train, self.y_train, epoch_rows, tf.constant(0), tf.constant(0)).numpy()
        self._compiled[length] = fn
        return time.perf_counter() - start

    def run(self, epoch_rows: Any, start: int, length: int) -> tf.Tensor:
        """Run ``length`` steps from row ``start``; their losses."""
        return self._compiled[length](self.x_train, self.y_train, epoch_rows,
                                      tf.constant(start), tf.constant(length))

    def fetch(self, losses: tf.Tensor) -> np.ndarray:
        return losses.numpy()

    # -- evaluation -----------------------------------------------------------------------
    def evaluate(self) -> tuple[float, float]:
        """Validation loss (the task's + regularization, as Keras reports it) and metric."""
        return self._evaluator("val")

    def evaluate_test(self) -> tuple[float, float]:
        """Test loss and metric, computed like ``evaluate`` (same compiled program)."""
        return self._evaluator("test")

    # -- model values ---------------------------------------------------------------------
    def _variables(self) -> list[Any]:
        return [*self.model.trainable_variables, *self.model.non_trainable_variables]

    def _all_variables(self) -> list[Any]:
        """The model's and the optimizer's variables: everything a train step changes."""
        return [*self.model.variables, *self.optimizer.variables]

    def state_copy(self) -> list[np.ndarray]:
        """A host copy of everything a step changes (model and optimizer variables)."""
        return [np.array(v.numpy()) for v in self._all_variables()]

    def _put_state(self, copy: list[np.ndarray]) -> None:
        for variable, value in zip(self._all_variables(), copy, strict=True):
            variable.assign(value)

    def reset(self, values: Any, learning_rate: float) -> None:
        """Start a new run on the compiled programs: the model's ``(trainable,
        non_trainable)`` values, the optimizer's slots and iteration count zeroed, its rate
        set. Keras keeps the rate in a variable that the compiled loop reads, so nothing is
        traced again. A schedule's rate is part of the trace: another rate is a ``ConfigError``."""
        schedule = self.optimizer._learning_rate
        if callable(schedule) and schedule.spec.learning_rate != learning_rate:
            raise ConfigError(
                f"Cannot reset to learning rate {learning_rate:g}: this trainer's schedule was "
                f"traced with {schedule.spec.learning_rate:g}; build a trainer for the new rate.")
        trainable, non_trainable = values
        self.restore([*trainable, *non_trainable])
        for variable in self.optimizer.variables:
            variable.assign(np.zeros(variable.shape, variable.dtype))
        if not callable(schedule):
            self.optimizer.learning_rate = learning_rate

    def snapshot(self) -> list[np.ndarray]:
        return [np.array(v.numpy()) for v in self._variables()]

    def restore(self, snapshot: list[np.ndarray]) -> None:
        for variable, value in zip(self._variables(), snapshot, strict=True):
            variable.assign(value)

    def finish(self) -> None:
        """Nothing to write back: the loop updated the Keras variables in place."""
