"""JAX: micro-batched gradients for the online noise scale (``--batch-size auto``).

The batch of B samples is reshaped into M micro-batches of B / M samples and ``jax.vmap`` takes
the gradient of each (the parameters are shared, so XLA runs the forward pass as one matmul over
the whole batch and only the weight gradients are per micro-batch). The update is the mean of
the micro-batch gradients, which for equal micro-batches is the gradient of the batch mean loss:
the training maths is unchanged for models whose samples do not interact. Two caveats, stated
where a model has them: BatchNormalization normalizes each micro-batch with its own statistics
("ghost" batch norm; the moving statistics are averaged over micro-batches), and Dropout's
seed state is shared by the micro-batches of a step (the same mask pattern repeats across them).

Besides the update, a step returns ``NoiseNorms``: each micro-batch gradient's squared norm and
the squared norm of their mean, the two inputs of ``kbackend.adaptive.NoiseScale``.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kbackend.adaptive import micro_batches_for
from kbackend.backends.jax.native import NativeTrainer
from kbackend.backends.jax.step import StepMetrics, TrainState, make_loss_fn, scan_steps
from kbackend.task import CLASSIFICATION, Task


class NoiseNorms(NamedTuple):
    """Squared gradient norms of one step: ``micro`` per micro-batch (shape ``(M,)``) and
    ``batch`` of their mean (the update); ``(K, M)`` and ``(K,)`` after K fused steps."""

    micro: Any
    batch: Any


def split_micro_batches(value: Any, count: int) -> Any:
    """``(B, ...)`` leaves -> ``(count, B / count, ...)``: micro-batch m is rows m*b .. (m+1)*b."""
    def split(leaf: Any) -> Any:
        return leaf.reshape(count, leaf.shape[0] // count, *leaf.shape[1:])

    return jax.tree.map(split, value)


def squared_norm(tree: Any, leading_axes: int = 0) -> Any:
    """Sum of squares over every leaf's trailing axes (float32), keeping ``leading_axes``."""
    def leaf_sum(leaf: Any) -> Any:
        leaf = leaf.astype(jnp.float32)
        return jnp.sum(jnp.square(leaf), axis=tuple(range(leading_axes, leaf.ndim)))

    return sum(leaf_sum(leaf) for leaf in jax.tree.leaves(tree))


def _merge_state(batched: list[Any], original: list[Any]) -> list[Any]:
    """One non-trainable state from the micro-batches' ``(M, ...)`` states: floats (moving
    statistics) averaged, integers (seed-generator counters) from the first micro-batch."""
    merged = []
    for value, before in zip(batched, original, strict=True):
        if value.ndim == jnp.ndim(before):  # not batched: no micro-batch changed it differently
            merged.append(value)
        elif jnp.issubdtype(value.dtype, jnp.floating):
            merged.append(jnp.mean(value, axis=0).astype(value.dtype))
        else:
            merged.append(value[0])
    return merged


def micro_batched_value_and_grad(loss_fn: Callable[..., Any], micro_batches: int) -> Any:
    """``loss_fn`` (``step.make_loss_fn``'s ``(trainable, non_trainable, x, y) -> (loss,
    (non_trainable, metric))``) differentiated per micro-batch.

    Returns ``f(trainable, non_trainable, x, y) -> ((loss, (non_trainable, metric)), grads,
    NoiseNorms)`` where loss, metric and grads are the means over the ``micro_batches``
    micro-batches (the batch's, for equal micro-batches).
    """
    grad_fn = jax.vmap(jax.value_and_grad(loss_fn, has_aux=True), in_axes=(None, None, 0, 0))

    def value_and_grad(trainable: Any, non_trainable: Any, x: Any, y: Any) -> Any:
        xs, ys = split_micro_batches((x, y), micro_batches)
        (losses, (states, metrics)), micro_grads = grad_fn(trainable, non_trainable, xs, ys)
        grads = jax.tree.map(lambda g: jnp.mean(g, axis=0), micro_grads)
        norms = NoiseNorms(squared_norm(micro_grads, leading_axes=1), squared_norm(grads))
        merged = _merge_state(list(states), list(non_trainable))
        return (jnp.mean(losses), (merged, jnp.mean(metrics))), grads, norms

    return value_and_grad


def make_adaptive_step(model: Any, tx: Any, micro_batches: int,
                       task: Task = CLASSIFICATION) -> Callable[..., Any]:
    """``step.make_step``'s single-device train step with micro-batched gradients:
    ``(state, (x, y)) -> (state, (StepMetrics, NoiseNorms))``."""
    value_and_grad = micro_batched_value_and_grad(make_loss_fn(model, task), micro_batches)

    def step(state: TrainState, batch: tuple[Any, Any]) -> tuple[TrainState, Any]:
        x, y = batch
        (loss, (non_trainable, metric)), grads, norms = value_and_grad(
            state.trainable, state.non_trainable, x, y)
        updates, opt_state = tx.update(grads, state.opt_state, state.trainable)
        trainable = optax.apply_updates(state.trainable, updates)
        return TrainState(trainable, non_trainable, opt_state), (StepMetrics(loss, metric), norms)

    return step


# model -> {(micro-batches, task) -> jitted micro-batched gradient}; dies with its model.
_FUNCTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def micro_batched_gradients(model: Any, x: Any, y: Any, micro_batches: int = 0, *,
                            task: Task = CLASSIFICATION) -> tuple[float, list[np.ndarray],
                                                                  np.ndarray, float]:
    """``(loss, grads, micro_sq_norms, batch_sq_norm)`` of ``model``'s training-mode loss on
    ``(x, y)`` split into ``micro_batches`` micro-batches (0: ``micro_batches_for(len(x))``),
    at the model's current values, which are not changed. ``grads`` is the mean of the
    micro-batch gradients in ``model.trainable_variables`` order, as NumPy arrays."""
    count = micro_batches or micro_batches_for(len(y))
    functions = _FUNCTIONS.setdefault(model, {})
    if (count, task) not in functions:
        functions[count, task] = jax.jit(
            micro_batched_value_and_grad(make_loss_fn(model, task), count))
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    (loss, _), grads, norms = functions[count, task](trainable, non_trainable,
                                                     jnp.asarray(x), jnp.asarray(y))
    return (float(loss), [np.asarray(g) for g in grads], np.asarray(norms.micro, np.float64),
            float(norms.batch))


class AdaptiveTrainer(NativeTrainer):
    """The native trainer with micro-batched steps at whichever batch size an epoch's rows have.

    One ``TrainState`` (weights, BatchNorm statistics, optimizer slots and count) runs through
    every batch size, so a change of size carries everything over; each (batch size, call
    length) is compiled once (``trace_counts_by_size``). ``fetch`` returns a call's losses, as
    the loop expects, and keeps its ``NoiseNorms`` on the host for ``take_noise_norms``.
    ``set_learning_rate`` changes the base rate, which is optimizer state
    (``optimizers.KerasOptState.learning_rate``): no program is traced again.
    """

    def __init__(self, model: Any, spec: Any, dataset: Any, jit_compile: bool = True,
                 task: Task = CLASSIFICATION) -> None:
        super().__init__(model, spec, dataset, jit_compile, task)
        self._sized: dict[tuple[int, int], Any] = {}
        self.trace_counts_by_size: dict[tuple[int, int], int] = {}
        self._norms: list[tuple[int, np.ndarray, np.ndarray]] = []

    def _adaptive_run_fn(self, batch: int, length: int) -> Any:
        count = micro_batches_for(batch)
        step = make_adaptive_step(self.model, self.tx, count, self.task)

        def run(state, x_all, y_all, epoch_rows, start):
            key = (batch, length)
            self.trace_counts_by_size[key] = self.trace_counts_by_size.get(key, 0) + 1
            self.trace_counts[length] = self.trace_counts.get(length, 0) + 1
            rows = jax.lax.dynamic_slice_in_dim(epoch_rows, start, length)

            def body(state, row):
                state, (metrics, norms) = step(state, (x_all[row], y_all[row]))
                return state, (metrics.loss, norms)

            return scan_steps(body, state, rows, self.unroll)

        return run

    def compile(self, length: int, epoch_rows: Any) -> float:
        """Compile the ``length``-step call at the rows' batch size if needed; its seconds."""
        key = (int(epoch_rows.shape[-1]), length)
        if key in self._sized:
            return 0.0
        start = time.perf_counter()
        jitted = jax.jit(self._adaptive_run_fn(*key), donate_argnums=0)
        self._sized[key] = jitted.lower(
            self.state, self.x_train, self.y_train, epoch_rows, np.int32(0)).compile()
        return time.perf_counter() - start

    def run(self, epoch_rows: Any, start: int, length: int) -> Any:
        batch = int(epoch_rows.shape[-1])
        self.state, (losses, norms) = self._sized[batch, length](
            self.state, self.x_train, self.y_train, epoch_rows, np.int32(start))
        return batch, losses, norms

    def fetch(self, handle: Any) -> np.ndarray:
        """A call's losses on the host; its noise norms kept for ``take_noise_norms``."""
        batch, losses, norms = handle
        losses, micro, big = jax.device_get(jax.block_until_ready((losses, *norms)))
        self._norms.append((batch, np.asarray(micro, np.float64), np.asarray(big, np.float64)))
        return np.asarray(losses)

    def take_noise_norms(self) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """``(batch, micro (K, M), batch (K,))`` of each call fetched since the last take."""
        taken, self._norms = self._norms, []
        return taken

    def set_learning_rate(self, learning_rate: float) -> None:
        """The base rate of the next steps (optimizer state: nothing is compiled again)."""
        opt_state = self.state.opt_state._replace(
            learning_rate=jnp.asarray(learning_rate, jnp.float32))
        self.state = self.state._replace(opt_state=opt_state)
