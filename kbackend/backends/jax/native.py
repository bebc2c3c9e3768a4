"""The native JAX train loop: Keras's stateless API, ``jax.value_and_grad``, optax, ``lax.scan``.

The train step is the shared one in ``step.py`` (``(state, batch) -> (state,
metrics)``, also used by the data-parallel engine); this module only feeds it. ``K`` steps run
in one compiled call: ``lax.scan`` over ``K`` rows of sample indices, each row gathered from the
training split that lives on the device for the whole run.
The state buffers are donated, so XLA updates the parameters in place. Each call's length is
compiled once, ahead of time (``jit(...).lower(...).compile()``), which also times compilation.

Reached through ``kbackend.backends.ops()`` (the dispatch point); ``data_parallel.py`` reuses
``make_evaluator``.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kbackend.backends import device_copy_once, kept_while_alive
from kbackend.backends.jax.optimizers import to_optax
from kbackend.backends.jax.step import (
    TrainState,
    fresh_opt_state,
    initial_state,
    make_step,
    scan_steps,
    unrolls_its_loop,
    write_state,
)
from kbackend.data.batching import pad_to_chunks
from kbackend.history import RunRecord
from kbackend.task import CLASSIFICATION, Task

EVAL_CHUNK = 1024  # most validation samples per forward pass (the split is cut into even chunks)


_EVALUATORS: dict[tuple, Any] = {}


def make_evaluator(model: Any, dataset: Any, split: str = "val", members: bool = False,
                   task: Task = CLASSIFICATION) -> Any:
    """``build_evaluator``'s evaluator, built (and so compiled) once per model, dataset, split
    and kind while model and dataset live: a study's cells share one model, so their trainers
    share its evaluators instead of compiling one each."""
    return kept_while_alive(_EVALUATORS, (id(model), id(dataset), split, members, task),
                            (model, dataset),
                            lambda: build_evaluator(model, dataset, split, members, task))


def build_evaluator(model: Any, dataset: Any, split: str = "val", members: bool = False,
                    task: Task = CLASSIFICATION) -> Any:
    """``evaluate(trainable, non_trainable) -> (loss, metric)`` on ``dataset``'s ``split``
    (``"val"`` or ``"test"``), which goes to the (default) device once, padded into chunks.

    The loss is the mean of ``task``'s loss plus the regularization losses, as Keras reports
    it; the metric the mean of ``task.metric``. With
    ``members`` the values carry a leading population axis (``population.py``) and the result
    is two host arrays, one entry per member.
    """
    x, y = getattr(dataset, f"x_{split}"), getattr(dataset, f"y_{split}")
    val = tuple(jax.device_put(a) for a in pad_to_chunks(x, y, EVAL_CHUNK))

    @jax.jit
    def evaluate_chunks(trainable, non_trainable, x_chunks, y_chunks, mask_chunks):
        def chunk_sums(carry, chunk):
            x, y, mask = chunk
            outputs, _, extra = model.stateless_call(
                trainable, non_trainable, x, training=False, return_losses=True)
            per_sample = task.per_sample_loss(y, outputs)
            correct = task.per_sample_metric(y, outputs)
            penalty = sum((jnp.sum(loss) for loss in extra), jnp.float32(0.0))
            return (carry[0] + jnp.sum(per_sample * mask), carry[1] + jnp.sum(correct * mask),
                    penalty), None

        zero = jnp.float32(0.0)
        (loss_sum, correct, penalty), _ = jax.lax.scan(
            chunk_sums, (zero, zero, zero), (x_chunks, y_chunks, mask_chunks))
        count = jnp.sum(mask_chunks)
        return loss_sum / count + penalty, correct / count

    if members:
        evaluate_members = jax.jit(jax.vmap(evaluate_chunks, in_axes=(0, 0, None, None, None)))

        def evaluate_population(trainable: Any,
                                non_trainable: Any) -> tuple[np.ndarray, np.ndarray]:
            loss, accuracy = evaluate_members(trainable, non_trainable, *val)
            return np.asarray(loss, dtype=float), np.asarray(accuracy, dtype=float)

        return evaluate_population

    def evaluate(trainable: Any, non_trainable: Any) -> tuple[float, float]:
        loss, accuracy = evaluate_chunks(trainable, non_trainable, *val)
        return float(loss), float(accuracy)

    return evaluate


def native_loop_uses_xla(jit_compile: bool) -> bool:
    """Always: JAX runs a loop of steps as one compiled program (``jax.jit``), with or without
    ``jit_compile``; there is no graph without XLA."""
    return True


class CompiledCalls:
    """The calls of a JAX trainer whose ``_run_fn(length)`` is ``(state, x_all, y_all,
    epoch_rows, start) -> (state, losses)``: each length compiled once, ahead of time, the state
    donated. Shared by ``NativeTrainer`` and ``population.PopulationTrainer``."""

    state: Any

    def __init__(self, model: Any, spec: Any, dataset: Any, task: Task) -> None:
        self.model, self.dataset, self.task = model, dataset, task
        self.spec, self.tx = spec, to_optax(spec)
        self.train_step = make_step(model, self.tx, task=task)
        # The training split goes to the device once (shared by every trainer of this
        # dataset); steps gather their batches there.
        self.x_train = device_copy_once(dataset.x_train, jax.device_put)
        self.y_train = device_copy_once(dataset.y_train, jax.device_put)
        self._compiled: dict[int, Any] = {}
        self.trace_counts: dict[int, int] = {}
        self.unroll = unrolls_its_loop(model)

    def _run_fn(self, length: int) -> Any:
        """One run's call: ``length`` steps from row ``start`` of ``epoch_rows``."""
        def run(state, x_all, y_all, epoch_rows, start):
            self.trace_counts[length] = self.trace_counts.get(length, 0) + 1
            rows = jax.lax.dynamic_slice_in_dim(epoch_rows, start, length)

            def body(state, row):
                state, metrics = self.train_step(state, (x_all[row], y_all[row]))
                return state, metrics.loss

            return scan_steps(body, state, rows, self.unroll)

        return run

    def put_epoch(self, rows: np.ndarray) -> Any:
        """Move an epoch's index matrix to the device, ahead of its steps."""
        return jax.device_put(rows)

    def compile(self, length: int, epoch_rows: Any) -> float:
        """Compile the ``length``-step call if needed; the seconds it took (0.0 if cached)."""
        if length in self._compiled:
            return 0.0
        start = time.perf_counter()
        jitted = jax.jit(self._run_fn(length), donate_argnums=0)
        self._compiled[length] = jitted.lower(
            self.state, self.x_train, self.y_train, epoch_rows, np.int32(0)).compile()
        return time.perf_counter() - start

    def run(self, epoch_rows: Any, start: int, length: int) -> Any:
        """Dispatch ``length`` steps from row ``start`` (asynchronously); their losses (device)."""
        self.state, losses = self._compiled[length](
            self.state, self.x_train, self.y_train, epoch_rows, np.int32(start))
        return losses

    def fetch(self, losses: Any) -> np.ndarray:
        """Wait for a call's losses and copy them to the host."""
        return np.asarray(jax.block_until_ready(losses))


class NativeTrainer(CompiledCalls):
    """Runs fused train calls on one model; see ``kbackend.engines.native`` for the driver."""

    def __init__(self, model: Any, spec: Any, dataset: Any, jit_compile: bool = True,
                 task: Task = CLASSIFICATION) -> None:
        super().__init__(model, spec, dataset, task)  # ``jit_compile`` changes nothing here
        self.state = initial_state(model, self.tx, spec)
        self._evaluate = make_evaluator(model, dataset, task=task)
        self.run_record = RunRecord(unrolled_loop=self.unroll, xla=True)

    # -- evaluation -----------------------------------------------------------------------
    def evaluate(self) -> tuple[float, float]:
        """Validation loss (the task's + regularization, as Keras reports it) and metric."""
        return self._evaluate(self.state.trainable, self.state.non_trainable)

    def evaluate_test(self) -> tuple[float, float]:
        """Test loss and metric, computed like ``evaluate`` (on the device)."""
        evaluate_test = make_evaluator(self.model, self.dataset, "test", task=self.task)
        return evaluate_test(self.state.trainable, self.state.non_trainable)

    # -- model values ---------------------------------------------------------------------
    def reset(self, values: Any, learning_rate: float) -> None:
        """Start a new run on the compiled programs: the model's ``(trainable,
        non_trainable)`` values and a fresh optimizer state at base rate ``learning_rate``
        (a runtime value of the compiled step, so nothing is traced again)."""
        trainable, non_trainable = ([jax.device_put(np.asarray(v)) for v in part]
                                    for part in values)
        # The base rate is optimizer state (``optimizers.KerasOptState.learning_rate``).
        self.state = TrainState(trainable, non_trainable,
                                fresh_opt_state(self.spec, trainable, learning_rate))

    def snapshot(self) -> Any:
        """A host copy of the model's values (for restoring the best ones)."""
        return jax.device_get((self.state.trainable, self.state.non_trainable))

    def restore(self, snapshot: Any) -> None:
        trainable, non_trainable = (jax.tree.map(jnp.asarray, part) for part in snapshot)
        self.state = self.state._replace(trainable=trainable, non_trainable=non_trainable)

    def finish(self) -> None:
        """Write the trained values back into the Keras model (save/evaluate/predict use them)
        and its optimizer state (a saved model resumes)."""
        write_state(self.model, self.state)
