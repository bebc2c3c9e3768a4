"""The one JAX train step: Keras's stateless API, ``jax.value_and_grad`` and an optax transform.

Both JAX engines build on this module: the single-device native engine
(``backends/jax_native.py``, batches gathered on the device) and the data-parallel engine
(``parallel/jax_step.py``, batches sharded over a mesh). A step is a pure function
``(state, (x, y)) -> (state, StepMetrics)``; with an axis name it runs per shard under
``shard_map`` / ``pmap`` and averages gradients, metrics and BatchNorm statistics over that axis.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class TrainState(NamedTuple):
    """Everything a train step changes: the model's values and the optimizer's state."""

    trainable: list[Any]
    non_trainable: list[Any]  # BatchNorm statistics, dropout seed-generator state, ...
    opt_state: Any


class StepMetrics(NamedTuple):
    """Metrics of one step's (global) batch; shape ``(K,)`` after K fused steps."""

    loss: Any
    accuracy: Any


def initial_state(model: Any, tx: Any) -> TrainState:
    """The state of a built Keras model and a fresh optax state for ``tx``.

    The values are copies: steps donate the state's buffers, the Keras variables keep theirs.
    """
    trainable = [jnp.array(v.value) for v in model.trainable_variables]
    non_trainable = [jnp.array(v.value) for v in model.non_trainable_variables]
    return TrainState(trainable, non_trainable, tx.init(trainable))


def mean_cross_entropy(labels: Any, probs: Any) -> Any:
    """Keras's ``sparse_categorical_crossentropy`` loss, reduced as ``compile`` reduces it."""
    import keras

    per_sample = keras.losses.sparse_categorical_crossentropy(labels, probs)
    return jnp.sum(per_sample) / per_sample.shape[0]


def total_loss(data_loss: Any, extra_losses: list[Any]) -> Any:
    """Data loss plus regularization losses, summed as ``keras.Model.compute_loss`` does."""
    if not extra_losses:
        return data_loss
    return jnp.sum(jnp.stack([data_loss, *(jnp.sum(loss) for loss in extra_losses)]))


def make_loss_fn(model: Any) -> Callable[..., Any]:
    """``loss(trainable, non_trainable, x, y) -> (loss, (non_trainable, accuracy))``.

    The loss Keras ``fit`` minimizes for kbackend's models (``train_on_batch`` reports the
    same number): mean sparse categorical cross-entropy of the softmax outputs plus the layers'
    regularization losses.
    """

    def loss_fn(trainable: list, non_trainable: list, x: Any, y: Any) -> tuple[Any, Any]:
        probs, non_trainable, extra_losses = model.stateless_call(
            trainable, non_trainable, x, training=True, return_losses=True)
        loss = total_loss(mean_cross_entropy(y, probs), extra_losses)
        accuracy = jnp.mean((jnp.argmax(probs, axis=-1) == y).astype(jnp.float32))
        return loss, (non_trainable, accuracy)

    return loss_fn


def _synced_moments(layer: Any, axis_name: str) -> Callable[..., Any]:
    """BatchNormalization moments over the whole batch, all shards together (sync BN).

    Two collectives, both exact for equal shards: the global mean is the mean of shard means;
    the global variance is the mean over shards of the shard's mean squared deviation from the
    *global* mean. This is the same two-pass formula ``jnp.var`` uses on one device.
    """

    def moments(inputs: Any, mask: Any) -> tuple[Any, Any]:
        if mask is not None:
            raise NotImplementedError("Synchronized BatchNormalization with a mask is not supported.")
        axes = tuple(layer._reduction_axes)
        x = inputs.astype(jnp.float32) if inputs.dtype in (jnp.float16, jnp.bfloat16) else inputs
        mean = lax.pmean(jnp.mean(x, axes, keepdims=True), axis_name)
        variance = lax.pmean(jnp.mean(jnp.square(x - mean), axes, keepdims=True), axis_name)
        return (jnp.squeeze(mean, axes).astype(inputs.dtype),
                jnp.squeeze(variance, axes).astype(inputs.dtype))

    return moments


@contextmanager
def synced_batch_norm(model: Any, axis_name: str | None) -> Iterator[None]:
    """While tracing inside ``shard_map``, make every BatchNormalization layer use global moments.

    A layer-level hook: ``BatchNormalization._moments`` is replaced on the instances for the
    duration of the trace and restored afterwards. Does nothing without an axis.
    """
    if axis_name is None:
        yield
        return
    import keras

    layers = [layer for layer in model._flatten_layers()
              if isinstance(layer, keras.layers.BatchNormalization)]
    for layer in layers:
        object.__setattr__(layer, "_moments", _synced_moments(layer, axis_name))
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("_moments", None)


def make_step(model: Any, tx: Any, axis_name: str | None = None) -> Callable[..., Any]:
    """One train step ``(state, (x, y)) -> (state, StepMetrics)`` with optax transform ``tx``.

    Without ``axis_name`` this is the single-device step. With it, the step runs on one
    device's shard (under ``shard_map`` / ``pmap``): BatchNorm statistics are those of the whole
    batch, and gradients and metrics are averaged over the axis, which for equal shards gives
    the gradient and loss of the global-batch mean.
    """
    import optax

    grad_fn = jax.value_and_grad(make_loss_fn(model), has_aux=True)

    def mean_over_devices(value: Any) -> Any:
        return value if axis_name is None else lax.pmean(value, axis_name)

    def step(state: TrainState, batch: tuple[Any, Any]) -> tuple[TrainState, StepMetrics]:
        x, y = batch
        with synced_batch_norm(model, axis_name):
            (loss, (non_trainable, accuracy)), grads = grad_fn(
                state.trainable, state.non_trainable, x, y)
        grads = mean_over_devices(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.trainable)
        trainable = optax.apply_updates(state.trainable, updates)
        metrics = StepMetrics(mean_over_devices(loss), mean_over_devices(accuracy))
        return TrainState(trainable, non_trainable, opt_state), metrics

    return step
