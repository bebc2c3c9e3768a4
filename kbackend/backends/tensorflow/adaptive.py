"""TensorFlow: micro-batched gradients for the online noise scale (``--batch-size auto``).

Inside the traced step the batch of B samples is cut into M micro-batches of B / M samples,
written out one after another (M is small and static: 2-4), each with its own
``GradientTape``. The update is the mean of the micro-batch gradients, which for equal
micro-batches is the gradient of the batch mean loss: the training maths is unchanged for models
whose samples do not interact. Where a model has them, BatchNormalization normalizes each
micro-batch with its own statistics ("ghost" batch norm; its moving statistics are updated once
per micro-batch) and Dropout draws a fresh mask per micro-batch.

Besides the update, a step returns each micro-batch gradient's squared norm and the squared norm
of their mean, the two inputs of ``kbackend.adaptive.NoiseScale``.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import tensorflow as tf

from kbackend.adaptive import micro_batches_for
from kbackend.backends.tensorflow.ops import jit_function
from kbackend.task import CLASSIFICATION, Task


def _dense(gradient: Any, variable: Any) -> tf.Tensor:
    """A dense float32-compatible gradient (zeros where the loss does not reach the variable;
    an Embedding's ``IndexedSlices`` made dense)."""
    if gradient is None:
        return tf.zeros_like(variable)
    return tf.convert_to_tensor(gradient)


def _squared_norm(tensors: list[tf.Tensor]) -> tf.Tensor:
    return tf.add_n([tf.reduce_sum(tf.square(tf.cast(t, tf.float32))) for t in tensors])


def _micro_batch_loss(model: Any, task: Task, x: Any, y: Any) -> tf.Tensor:
    """The loss ``native.make_train_step`` minimizes, on one micro-batch."""
    outputs = model(x, training=True)
    per_sample = task.per_sample_loss(y, outputs)
    loss = tf.reduce_sum(per_sample) / tf.cast(tf.size(per_sample), per_sample.dtype)
    if model.losses:  # regularization, summed as keras.Model.compute_loss does
        loss = tf.reduce_sum(tf.stack([loss, *(tf.reduce_sum(x) for x in model.losses)]))
    return loss


def micro_batched_value_and_grad(model: Any, micro_batches: int,
                                 task: Task = CLASSIFICATION) -> Any:
    """``f(x, y) -> (loss, grads, micro_sq_norms, batch_sq_norm)`` for use inside a traced
    step: loss and grads are the means over ``micro_batches`` equal micro-batches (in
    ``model.trainable_variables`` order), ``micro_sq_norms`` has shape ``(M,)``."""

    def value_and_grad(x: Any, y: Any) -> tuple[Any, list[Any], Any, Any]:
        size = tf.shape(y)[0] // micro_batches
        variables = model.trainable_variables
        losses, micro_norms = [], []
        grad_sums: list[Any] | None = None
        for index in range(micro_batches):
            start = index * size
            rows = tf.range(start, start + size)
            x_micro = tf.nest.map_structure(lambda leaf, r=rows: tf.gather(leaf, r), x)
            with tf.GradientTape() as tape:
                loss = _micro_batch_loss(model, task, x_micro, tf.gather(y, rows))
            grads = [_dense(g, v) for g, v in zip(tape.gradient(loss, variables), variables,
                                                  strict=True)]
            losses.append(tf.cast(loss, tf.float32))
            micro_norms.append(_squared_norm(grads))
            grad_sums = grads if grad_sums is None else [a + g for a, g in zip(grad_sums, grads,
                                                                               strict=True)]
        assert grad_sums is not None
        mean_grads = [g / micro_batches for g in grad_sums]
        return (tf.add_n(losses) / micro_batches, mean_grads, tf.stack(micro_norms),
                _squared_norm(mean_grads))

    return value_and_grad


def make_adaptive_train_step(model: Any, optimizer: Any, micro_batches: int,
                             task: Task = CLASSIFICATION) -> Any:
    """``native.make_train_step`` with micro-batched gradients: ``train_step(x, y) -> (loss,
    micro_sq_norms, batch_sq_norm)``, updating ``model``'s variables in place."""
    value_and_grad = micro_batched_value_and_grad(model, micro_batches, task)

    def train_step(x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        loss, grads, micro_norms, batch_norm = value_and_grad(x, y)
        optimizer.apply(grads, model.trainable_variables)
        return loss, micro_norms, batch_norm

    return train_step


# model -> {(micro-batches, task) -> XLA-compiled micro-batched gradient}; dies with its model.
_FUNCTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def micro_batched_gradients(model: Any, x: Any, y: Any, micro_batches: int = 0, *,
                            task: Task = CLASSIFICATION) -> tuple[float, list[np.ndarray],
                                                                  np.ndarray, float]:
    """``(loss, grads, micro_sq_norms, batch_sq_norm)`` of ``model``'s training-mode loss on
    ``(x, y)`` split into ``micro_batches`` micro-batches (0: ``micro_batches_for(len(x))``),
    in one XLA program. ``grads`` is the mean of the micro-batch gradients in
    ``model.trainable_variables`` order, as NumPy arrays. The model's weights are not changed
    (BatchNormalization's moving statistics are, as in a train step)."""
    count = micro_batches or micro_batches_for(len(y))
    functions = _FUNCTIONS.setdefault(model, {})
    if (count, task) not in functions:
        functions[count, task] = jit_function(micro_batched_value_and_grad(model, count, task))
    loss, grads, micro_norms, batch_norm = functions[count, task](
        tf.convert_to_tensor(x), tf.convert_to_tensor(y))
    return (float(loss), [np.asarray(g) for g in grads], np.asarray(micro_norms, np.float64),
            float(batch_norm))
