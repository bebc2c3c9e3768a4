"""The hand-written TensorFlow training loops the benchmarks use as their floor (no Keras): a ReLU
MLP (bench_engines) and the Conv1D + BatchNorm classifier of examples/models.py
(bench_user_model)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kbackend.backends.reference_parts import (
    BN_EPSILON,
    BN_MOMENTUM,
    ReferenceLoop,
    conv1d_arrays,
    epoch_spans,
)


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


def reference_conv1d_loop(params: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray,
                          learning_rate: float, *, steps_per_call: int = 0,
                          unroll: bool = False) -> ReferenceLoop:
    """The Conv1D + BatchNorm classifier of ``examples/models.py`` (``conv1d_classifier``)
    trained by hand with plain SGD (``assign_sub``): per block a ``tf.nn.conv1d`` (kernel 5,
    SAME, no bias), batch norm in training mode by hand (``tf.nn.moments`` over batch and
    time, ``inv = rsqrt(var + 1e-3) * gamma``, ``h * inv + (beta - mean * inv)``, gamma and
    beta trained, the moving mean and variance updated as Keras does with momentum 0.99), ReLU
    and ``tf.nn.max_pool1d`` (2, VALID); then the mean over time, a dense layer to logits and
    ``tf.nn.sparse_softmax_cross_entropy_with_logits``. The normalization is Keras's form
    (``tf.nn.batch_normalization``'s), the faster one: written as ``(h - mean) * rsqrt(var +
    1e-3) * gamma + beta`` a step took ~12% longer on a CPU here (bench_user_model).

    ``params``: the Keras model's ``get_weights()`` order, (kernel ``(5, in, out)``, gamma,
    beta, moving mean, moving variance) per block, then the dense kernel and bias. ``x``:
    ``(steps, batch, time, channels)`` pre-stacked batches, ``y``: ``(steps, batch)``, both put
    on the device once. An epoch is one ``tf.function(jit_compile=True)`` loop over every step
    (``steps_per_call`` 0), or calls of ``steps_per_call`` steps (the last shorter), each such
    a loop or, with ``unroll``, its steps written out one after another (no loop: what the
    native engine does for conv models on a CPU, ``capabilities.unrolls_its_loop``).
    """
    import tensorflow as tf  # deferred: importing TensorFlow is heavy

    arrays, blocks = conv1d_arrays(params)
    variables = [tf.Variable(a) for a in arrays]
    train_step = _conv1d_train_step(variables, blocks, learning_rate)
    spans = epoch_spans(len(x), steps_per_call)
    calls = {length: _conv1d_call(train_step, length, unroll)
             for length in {b - a for a, b in spans}}
    chunks = [(tf.identity(tf.constant(x[a:b])), tf.identity(tf.constant(y[a:b], tf.int32)))
              for a, b in spans]

    def run_epoch() -> np.ndarray:
        losses = [calls[len(xs)](xs, ys) for xs, ys in chunks]
        return np.concatenate([part.numpy() for part in losses])  # to the host: finished

    return ReferenceLoop(run_epoch, lambda: [v.numpy() for v in variables])


def _conv1d_train_step(variables: list[Any], blocks: int,
                       learning_rate: float) -> Callable[[Any, Any], Any]:
    """One SGD step of the classifier on ``variables`` (the Keras ``get_weights()`` order):
    ``train_step(xb, yb)`` returns the batch's loss, the trainable variables stepped and the
    moving statistics updated with the batch's."""
    import tensorflow as tf  # deferred: importing TensorFlow is heavy

    trainable = [v for i, v in enumerate(variables[:-2]) if i % 5 < 3] + variables[-2:]

    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            h, updates = xb, []
            for b in range(blocks):
                kernel, gamma, beta, moving_mean, moving_var = variables[5 * b:5 * b + 5]
                h = tf.nn.conv1d(h, kernel, stride=1, padding="SAME")
                mean, var = tf.nn.moments(h, axes=[0, 1])
                inv = tf.math.rsqrt(var + BN_EPSILON) * gamma
                h = h * inv + (beta - mean * inv)
                h = tf.nn.max_pool1d(tf.nn.relu(h), 2, 2, "VALID")
                updates += [(moving_mean, mean), (moving_var, var)]
            logits = tf.matmul(tf.reduce_mean(h, axis=1), variables[-2]) + variables[-1]
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yb, logits=logits))
        for variable, grad in zip(trainable, tape.gradient(loss, trainable), strict=True):
            variable.assign_sub(learning_rate * grad)
        for moving, batch_value in updates:
            moving.assign(moving * BN_MOMENTUM + batch_value * (1.0 - BN_MOMENTUM))
        return loss

    return train_step


def _conv1d_call(train_step: Callable[[Any, Any], Any], length: int,
                 unroll: bool) -> Callable[..., Any]:
    """One compiled call of the epoch: ``call(xs, ys)`` runs ``length`` steps and returns their
    losses, in an XLA loop or, with ``unroll``, written out."""
    import tensorflow as tf  # deferred: importing TensorFlow is heavy

    @tf.function(jit_compile=True)
    def call(xs, ys):
        if unroll:  # written out: no loop in the program
            return tf.stack([train_step(xs[i], ys[i]) for i in range(length)])
        losses = tf.TensorArray(tf.float32, size=length)
        for i in tf.range(length):
            losses = losses.write(i, train_step(xs[i], ys[i]))
        return losses.stack()

    return call
