"""JAX: micro-batch gradients for the online noise scale (``--batch-size auto``).

One forward pass over the whole batch of B samples, then one backward pass per micro-batch
(``jax.vjp`` with a cotangent that weighs micro-batch m's samples by 1 / b, b = B / M, and the
regularization losses by 1). The update is the mean of the M micro-batch gradients, which is
exactly the gradient of the batch's mean loss: the forward pass, BatchNormalization's batch
statistics, Dropout's masks and the update are those of the plain step (``step.make_step``), for
every model. (Where samples interact through batch statistics, a micro-batch's gradient is that
of its share of the batch loss, not of the micro-batch trained alone.)

The cost is M - 1 extra backward passes; M = 2 by default (``kbackend.adaptive``). An earlier
version vmapped the gradient over reshaped micro-batches: on a 2-core CPU its step was 8x the
plain step's at batch 8 and 1.6x at 512 (XLA:CPU's batched matmul), and it changed the maths of
BatchNorm and Dropout models.

Besides the update, a step returns ``NoiseNorms``: each micro-batch gradient's squared norm and
the squared norm of their mean, the two inputs of ``kbackend.adaptive.NoiseScale``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from kbackend.adaptive import DEFAULT_MEASURE_EVERY, micro_batches_for
from kbackend.backends import kept_while_alive
from kbackend.backends.compile_ahead import MeasuredCalls, SizedCalls
from kbackend.backends.jax.data_parallel import DataParallelTrainer
from kbackend.backends.jax.native import NativeTrainer, make_evaluator
from kbackend.backends.jax.step import (
    AXIS,
    make_step,
    make_train_step,
    replicate,
    scan_steps,
)
from kbackend.task import CLASSIFICATION, Task


class NoiseNorms(NamedTuple):
    """Squared gradient norms of one step: ``micro`` per micro-batch (shape ``(M,)``) and
    ``batch`` of their mean (the update); ``(K, M)`` and ``(K,)`` after K fused steps."""

    micro: Any
    batch: Any


def squared_norm(tree: Any) -> Any:
    """Sum of squares over every leaf (float32)."""
    return sum(jnp.sum(jnp.square(leaf.astype(jnp.float32))) for leaf in jax.tree.leaves(tree))


def make_forward(model: Any, task: Task = CLASSIFICATION) -> Callable[..., Any]:
    """``forward(trainable, non_trainable, x, y) -> ((per_sample_loss, penalty),
    (non_trainable, metric))``: ``step.make_loss_fn``'s pass with the per-sample losses kept
    apart (its loss is ``mean(per_sample_loss) + penalty``)."""

    def forward(trainable: Any, non_trainable: Any, x: Any, y: Any) -> tuple[Any, Any]:
        outputs, non_trainable, extra_losses = model.stateless_call(
            trainable, non_trainable, x, training=True, return_losses=True)
        per_sample = task.per_sample_loss(y, outputs)
        penalty = sum((jnp.sum(loss) for loss in extra_losses), jnp.float32(0.0))
        metric = jnp.mean(task.per_sample_metric(y, outputs))
        return (per_sample, penalty), (non_trainable, metric)

    return forward


def micro_batched_value_and_grad(model: Any, micro_batches: int,
                                 task: Task = CLASSIFICATION) -> Any:
    """``f(trainable, non_trainable, x, y) -> ((loss, (non_trainable, metric)), grads,
    NoiseNorms)``: the batch's loss and gradient (the mean of ``micro_batches`` micro-batch
    gradients of its rows m*b .. (m+1)*b) and the noise norms."""
    forward = make_forward(model, task)

    def value_and_grad(trainable: Any, non_trainable: Any, x: Any, y: Any) -> Any:
        (per_sample, penalty), pullback, (non_trainable, metric) = jax.vjp(
            lambda params: forward(params, non_trainable, x, y), trainable, has_aux=True)
        batch = per_sample.shape[0]
        size = batch // micro_batches
        micro_grads = []
        for index in range(micro_batches):  # one backward pass per micro-batch
            weights = jnp.zeros((batch,), per_sample.dtype).at[
                index * size:(index + 1) * size].set(1.0 / size)
            micro_grads.append(pullback((weights, jnp.ones_like(penalty)))[0])
        grads = jax.tree.map(lambda *parts: sum(parts) / micro_batches, *micro_grads)
        norms = NoiseNorms(jnp.stack([squared_norm(g) for g in micro_grads]),
                           squared_norm(grads))
        loss = jnp.sum(per_sample) / batch + penalty
        return (loss, (non_trainable, metric)), grads, norms

    return value_and_grad


# (model, micro-batches, task) -> jitted micro-batched gradient; dies with its model.
_FUNCTIONS: dict[tuple[int, int, Task], Any] = {}


def micro_batched_gradients(model: Any, x: Any, y: Any, micro_batches: int = 0, *,
                            task: Task = CLASSIFICATION) -> tuple[float, list[np.ndarray],
                                                                  np.ndarray, float]:
    """``(loss, grads, micro_sq_norms, batch_sq_norm)`` of ``model``'s training-mode loss on
    ``(x, y)`` split into ``micro_batches`` micro-batches (0: ``micro_batches_for(len(x))``),
    at the model's current values, which are not changed. ``grads`` is the mean of the
    micro-batch gradients in ``model.trainable_variables`` order, as NumPy arrays."""
    count = micro_batches or micro_batches_for(len(y))
    function = kept_while_alive(_FUNCTIONS, (id(model), count, task), (model,),
                                lambda: jax.jit(micro_batched_value_and_grad(model, count, task)))
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    (loss, _), grads, norms = function(trainable, non_trainable, jnp.asarray(x), jnp.asarray(y))
    return (float(loss), [np.asarray(g) for g in grads], np.asarray(norms.micro, np.float64),
            float(norms.batch))


class AdaptiveTrainer(MeasuredCalls, NativeTrainer):
    """The native trainer with micro-batched steps at whichever batch size an epoch's rows have.

    One ``TrainState`` (weights, BatchNorm statistics, optimizer slots and count) runs through
    every batch size, so a change of size carries everything over; each (batch size, call
    length) is compiled once (``trace_counts_by_size``). ``fetch`` returns a call's losses, as
    the loop expects, and keeps its ``NoiseNorms`` on the host for ``take_noise_norms``.
    ``set_learning_rate`` changes the base rate, which is optimizer state
    (``optimizers.KerasOptState.learning_rate``): no program is traced again.

    The estimate is taken inside the fused call: its first K - 1 steps are the plain step
    (``step.make_step``, the native trainer's), its last step the same step with the
    micro-batched gradient injected (``micro_batched_value_and_grad``) on every
    ``calls_between(K)``-th call (a run-time flag: ``lax.cond``, one program per size), the
    plain one otherwise (NaN norms, skipped by the estimator): one measured step per
    ``measure_every`` steps. ``measure_every=1`` measures every step (the reference
    estimator the benchmark compares with).
    """

    def __init__(self, model: Any, spec: Any, dataset: Any, jit_compile: bool = True,
                 task: Task = CLASSIFICATION, measure_every: int = DEFAULT_MEASURE_EVERY) -> None:
        super().__init__(model, spec, dataset, jit_compile, task)
        self._start_measured(measure_every)

    def reset(self, values: Any, learning_rate: float) -> None:
        """A new run on the compiled programs, measured from its first call as a fresh
        trainer's run is."""
        super().reset(values, learning_rate)
        self._calls = 0

    def _adaptive_run_fn(self, batch: int, length: int) -> Any:
        count = micro_batches_for(batch)
        measured = make_step(self.model, self.tx, task=self.task,
                             value_and_grad=micro_batched_value_and_grad(self.model, count,
                                                                          self.task))
        unmeasured = NoiseNorms(jnp.full((count,), jnp.nan, jnp.float32), jnp.float32(jnp.nan))

        def with_norms(state, batch_xy):
            state, (metrics, norms) = measured(state, batch_xy)
            return state, (metrics.loss, norms)

        def without_norms(state, batch_xy):  # the plain step; NaN norms are skipped
            state, metrics = self.train_step(state, batch_xy)
            return state, (metrics.loss, unmeasured)

        def run(state, x_all, y_all, epoch_rows, start, measure):
            self._count_trace((batch, length))
            rows = jax.lax.dynamic_slice_in_dim(epoch_rows, start, length)
            if self.measure_every <= 1:  # every step measured
                return scan_steps(lambda s, row: with_norms(s, (x_all[row], y_all[row])),
                                  state, rows, self.unroll)

            def plain(state, row):
                state, metrics = self.train_step(state, (x_all[row], y_all[row]))
                return state, metrics.loss

            losses = jnp.zeros((0,), jnp.float32)
            if length > 1:
                state, losses = scan_steps(plain, state, rows[:-1], self.unroll)
            last = (x_all[rows[-1]], y_all[rows[-1]])
            state, (loss, norms) = jax.lax.cond(measure, with_norms, without_norms, state, last)
            return state, (jnp.concatenate([losses, loss[None]]),
                           NoiseNorms(norms.micro[None], norms.batch[None]))

        return run

    def _compile_call(self, key: tuple[int, int], state: Any, epoch_rows: Any) -> Any:
        """The ``jit(...).lower(...).compile()``d call of ``key`` (one at a time: the lock)."""
        with self._lock:
            jitted = jax.jit(self._adaptive_run_fn(*key), donate_argnums=0)
            return jitted.lower(state, self.x_train, self.y_train, epoch_rows, np.int32(0),
                                np.bool_(True)).compile()

    def compile(self, length: int, epoch_rows: Any) -> float:
        """Compile the ``length``-step call at the rows' batch size if needed; the seconds the
        caller waited (for a call compiled ahead, only what was left of its compilation)."""
        key = (int(epoch_rows.shape[-1]), length)
        if key in self._sized:
            return 0.0
        start = time.perf_counter()
        compiled = self.ahead.take(key)
        self._sized[key] = (compiled if compiled is not None
                            else self._compile_call(key, self.state, epoch_rows))
        return time.perf_counter() - start

    def compile_ahead(self, batch: int, length: int, steps: int) -> None:
        """Compile the ``length``-step call at ``batch`` for an epoch of ``steps`` rows in a
        background thread, on abstract arguments (shapes and dtypes): ``compile`` then takes
        the compiled object instead of compiling."""
        key = (batch, length)
        if key in self._sized:
            return
        state = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype),
                             self.state)
        rows = jax.ShapeDtypeStruct((steps, batch), jnp.int32)
        self.ahead.request(key, lambda: self._compile_call(key, state, rows))

    def run(self, epoch_rows: Any, start: int, length: int) -> Any:
        batch = int(epoch_rows.shape[-1])
        measure = self._next_call_measures(length)
        self.state, (losses, norms) = self._sized[batch, length](
            self.state, self.x_train, self.y_train, epoch_rows, np.int32(start),
            np.bool_(measure))
        return batch, losses, norms

    def fetch(self, handle: Any) -> np.ndarray:
        """A call's losses on the host; its noise norms kept for ``take_noise_norms``."""
        batch, losses, norms = handle
        losses, micro, big = jax.device_get(jax.block_until_ready((losses, *norms)))
        self._keep_norms(batch, micro, big)
        return np.asarray(losses)

    def set_learning_rate(self, learning_rate: float) -> None:
        """The base rate of the next steps (optimizer state: nothing is compiled again)."""
        opt_state = self.state.opt_state._replace(
            learning_rate=jnp.asarray(learning_rate, jnp.float32))
        self.state = self.state._replace(opt_state=opt_state)

    def state_copy(self) -> Any:
        """A host copy of everything a step changes (weights, statistics, optimizer state)."""
        return jax.device_get(self.state)

    def restore_state(self, copy: Any) -> None:
        """Put back a ``state_copy`` (the knee probe trains; the run starts where it was, its
        first call measured)."""
        self.state = jax.tree.map(lambda leaf: jax.device_put(np.asarray(leaf)), copy)
        self._calls = 0


def device_noise_norms(shard_grads: Any, mean_grads: Any) -> NoiseNorms:
    """``make_step``'s ``observe`` for a data-parallel step: this device's squared gradient norm
    (its shard's, shape ``(1,)``) and that of the mean, the update's (the same on every device).
    The shards are the micro-batches (McCandlish et al. 2018, appendix A). No collective: the
    per-device values leave the program sharded (``DEVICE_NORMS_SPEC``: ``(K, devices)``)."""
    return NoiseNorms(squared_norm(shard_grads)[None], squared_norm(mean_grads))


# device_noise_norms's values over K steps under shard_map: (K, devices) sharded, (K,) replicated
DEVICE_NORMS_SPEC = NoiseNorms(PartitionSpec(None, AXIS), PartitionSpec())


class DataParallelAdaptiveTrainer(SizedCalls, DataParallelTrainer):
    """``--batch-size auto`` on the data-parallel engine (one process, ``devices`` devices).

    The plain data-parallel step (``step.make_step`` under ``shard_map`` / ``pmap``) with
    ``device_noise_norms`` observing it: each device's gradient of its shard and the all-reduced
    mean are the two batch sizes of the estimator (b = per-device batch, B = global batch), so
    every step is measured at the cost of one squared norm per device and an all-gather of
    ``devices`` scalars, with no extra gradient. The update is the plain step's. Each (global
    batch size, call length) is compiled once (``trace_counts_by_size``); ``fetch`` keeps a
    call's ``NoiseNorms`` (``(K, devices)`` and ``(K,)``) for ``take_noise_norms``, as
    ``AdaptiveTrainer`` does, so ``engines.adaptive`` drives both alike.
    """

    def __init__(self, model: Any, spec: Any, dataset: Any, *, devices: int, batch_size: int,
                 dp_impl: str = "shard_map", task: Task = CLASSIFICATION) -> None:
        super().__init__(model, spec, dataset, devices=devices, batch_size=batch_size,
                         dp_impl=dp_impl, task=task)
        self.dataset, self.task = dataset, task
        self._start_sized()

    def _make_step(self, model: Any, tx: Any, dp_impl: str, task: Task) -> Any:
        return make_train_step(model, tx, self.mesh, dp_impl, self.unroll, task,
                               observe=device_noise_norms, observed_spec=DEVICE_NORMS_SPEC)

    def compile(self, length: int, epoch_rows: np.ndarray) -> float:
        """Compile the ``length``-step call at the rows' global batch size if needed."""
        key = (int(epoch_rows.shape[-1]) * jax.process_count(), length)
        if key in self._sized:
            return 0.0
        started = time.perf_counter()
        self._count_trace(key)
        self._sized[key] = self.step.lower(self.state,
                                           self._batches(epoch_rows, 0, length)).compile()
        return time.perf_counter() - started

    def run(self, epoch_rows: np.ndarray, start: int, length: int) -> Any:
        batch = int(epoch_rows.shape[-1]) * jax.process_count()
        self.state, (metrics, norms) = self._sized[batch, length](
            self.state, self._batches(epoch_rows, start, length))
        return batch, metrics.loss, norms

    def fetch(self, handle: Any) -> np.ndarray:
        """A call's global-batch losses on the host; its noise norms kept."""
        batch, losses, norms = handle
        losses, micro, big = jax.device_get(jax.block_until_ready((losses, *norms)))
        if self.pmap:  # (devices, K, ...): device d's values; micro (devices, K, 1)
            losses, big, micro = losses[0], big[0], np.moveaxis(micro[..., 0], 0, 1)
        self._keep_norms(batch, micro, big)
        return np.asarray(losses)

    def set_learning_rate(self, learning_rate: float) -> None:
        """The base rate of the next steps (optimizer state: nothing is compiled again)."""
        rate = np.float32(learning_rate)
        value = (np.full((self.count,), rate) if self.pmap else replicate(rate, self.mesh))
        self.state = self.state._replace(
            opt_state=self.state.opt_state._replace(learning_rate=value))

    def state_copy(self) -> Any:
        """A host copy of everything a step changes (one device's: they are the same)."""
        return self._host_state()

    def restore_state(self, copy: Any) -> None:
        self.state = self._place_state(copy)

    def evaluate_test(self) -> tuple[float, float]:
        """Test loss and metric on this process's copy of the parameters."""
        current = self._host_state()
        evaluate_test = make_evaluator(self.model, self.dataset, "test", task=self.task)
        return evaluate_test(current.trainable, current.non_trainable)
