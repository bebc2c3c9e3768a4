"""The hand-written TensorFlow training loop the engine benchmark uses as its floor (no Keras)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def reference_train_loop(params: Sequence[tuple[np.ndarray, np.ndarray]], x: np.ndarray,
                         y: np.ndarray, learning_rate: float) -> Callable[[], None]:
    """One call trains one epoch of a ReLU MLP (``params``: (weights, bias) per layer) with
    plain SGD (``assign_sub``), in one XLA-compiled ``tf.function`` loop over the pre-stacked
    batches ``x``: (steps, batch, features) and ``y``: (steps, batch) already on the device;
    returns when the epoch has finished."""
    import tensorflow as tf  # deferred: importing TensorFlow is heavy

    variables = [tf.Variable(a) for pair in params for a in pair]
    layers = len(params)
    xs, ys = tf.identity(tf.constant(x)), tf.identity(tf.constant(y, tf.int32))

    @tf.function(jit_compile=True)
    def epoch(xs, ys):
        losses = tf.TensorArray(tf.float32, size=tf.shape(xs)[0])
        for i in tf.range(tf.shape(xs)[0]):
            with tf.GradientTape() as tape:
                h = xs[i]
                for layer in range(layers):
                    h = tf.matmul(h, variables[2 * layer]) + variables[2 * layer + 1]
                    if layer < layers - 1:
                        h = tf.nn.relu(h)
                loss = tf.reduce_mean(
                    tf.nn.sparse_softmax_cross_entropy_with_logits(labels=ys[i], logits=h))
            for variable, grad in zip(variables, tape.gradient(loss, variables), strict=True):
                variable.assign_sub(learning_rate * grad)
            losses = losses.write(i, loss)
        return losses.stack()

    def run() -> None:
        epoch(xs, ys).numpy()  # to the host: the epoch has finished

    return run
