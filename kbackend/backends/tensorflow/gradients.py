"""TensorFlow: the one gradient helper (training-mode Keras loss or inference-mode
cross-entropy)."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from kbackend.backends import kept_while_alive

# (model, task) -> jitted inference-mode gradient; entries live and die with their model.
_INFERENCE_GRADIENTS: dict[tuple[int, Any], Any] = {}


def _inference_gradient(model: Any, task: Any = None) -> Any:
    def build() -> Any:
        import keras  # deferred: Keras is imported once the backend is chosen

        @tf.function(jit_compile=True)
        def value_and_gradient(inputs, labels):
            with tf.GradientTape() as tape:
                outputs = model(inputs, training=False)
                if task is not None:  # the task's loss (a multi-output task's weighted sum)
                    losses = task.per_sample_loss(labels, outputs)
                else:
                    losses = keras.losses.sparse_categorical_crossentropy(labels, outputs)
                loss = tf.reduce_mean(losses)
            return loss, tape.gradient(loss, model.trainable_variables)

        return value_and_gradient

    return kept_while_alive(_INFERENCE_GRADIENTS, (id(model), task), (model,), build)


def gradients(model: Any, x: Any, y: Any, *, training: bool = True,
              as_numpy: bool = True, task: Any = None) -> tuple[Any, list[Any]]:
    """The loss of ``model`` on ``(x, y)`` and its gradients, in ``model.trainable_variables``
    order.

    ``training=True``: the computation of Keras's TF ``train_step`` (a ``GradientTape`` around the
    training call and ``compute_loss``; the model must be compiled); the training call updates
    BatchNormalization's moving statistics in place, as a train step does. ``training=False``:
    the mean sparse categorical cross-entropy of an inference-mode forward pass (with ``task``,
    a ``kbackend.task.Task``: the mean of its loss), one XLA ``tf.function`` per model and task.
    ``as_numpy=False`` returns the tensors as TF produces them (an Embedding's gradient is a
    sparse ``tf.IndexedSlices``; None where the loss does not depend on a variable);
    ``as_numpy=True`` dense arrays (zeros for None).
    """
    if training:
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
        grads = tape.gradient(loss, model.trainable_variables)
    else:
        loss, grads = _inference_gradient(model, task)(tf.convert_to_tensor(x),
                                                       tf.convert_to_tensor(y))
    if not as_numpy:
        return loss, list(grads)
    return float(loss), [
        np.zeros(v.shape, v.dtype) if g is None else np.asarray(tf.convert_to_tensor(g))
        for g, v in zip(grads, model.trainable_variables, strict=True)
    ]


def bias_add_misroutes(model: Any, x: Any) -> list[str]:
    """The additions in an inference call of ``model`` that Keras' TF ``add`` gets wrong.

    Keras 3's TF ``ops.add`` (keras/src/backend/tensorflow/numpy.py) turns ``x1 + x2`` into
    ``tf.nn.bias_add`` when ``x2`` squeezes to a vector, guessing the channel axis from shapes:
    NHWC whenever ``x1.shape[-1]`` equals the vector's length. For a channels_first bias
    (shape ``(1, C, 1, ...)``) on an output whose last spatial size happens to equal C, that adds
    the bias along the wrong axis, silently. Returns one ``"x1 shape + x2 shape"`` per such add.
    """
    # deferred: Keras is imported once the backend is chosen
    import keras.src.backend.tensorflow.numpy as tf_numpy

    found: list[str] = []
    original = tf_numpy.add

    def recording_add(x1: Any, x2: Any) -> Any:
        s1: Any = getattr(x1, "shape", ())
        s2: Any = getattr(x2, "shape", ())
        if len(s2) > 1 and len(s1) == len(s2):
            big = [i for i, d in enumerate(s2) if d is None or d > 1]
            if (len(big) == 1 and big[0] != len(s2) - 1 and s2[big[0]] is not None
                    and s1[-1] == s2[big[0]]):
                found.append(f"{tuple(s1)} + {tuple(s2)}")
        return original(x1, x2)

    tf_numpy.add = recording_add
    try:
        model(x, training=False)
    finally:
        tf_numpy.add = original
    return found
