"""JAX: the one gradient helper (training-mode Keras loss or inference-mode cross-entropy)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from kbackend.backends import kept_while_alive

# (model, training flag, task) -> jitted value-and-grad; entries live and die with their model.
_GRADIENT_FUNCTIONS: dict[tuple[int, bool, Any], Any] = {}


def _gradient_function(model: Any, training: bool, task: Any = None) -> Any:
    def build() -> Any:
        if training:
            loss_fn = functools.partial(model.compute_loss_and_updates, training=True)
            return jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
        import keras  # deferred: Keras is imported once the backend is chosen

        def mean_loss(trainable, non_trainable, inputs, labels):
            outputs, _ = model.stateless_call(trainable, non_trainable, inputs, training=False)
            if task is not None:  # the task's loss (a multi-output task's weighted sum)
                return jax.numpy.mean(task.per_sample_loss(labels, outputs))
            return jax.numpy.mean(keras.losses.sparse_categorical_crossentropy(labels, outputs))

        return jax.jit(jax.value_and_grad(mean_loss))

    key = (id(model), training, None if training else task)
    return kept_while_alive(_GRADIENT_FUNCTIONS, key, (model,), build)


def gradients(model: Any, x: Any, y: Any, *, training: bool = True,
              as_numpy: bool = True, task: Any = None) -> tuple[Any, list[Any]]:
    """The loss of ``model`` on ``(x, y)`` and its gradients, in ``model.trainable_variables``
    order.

    ``training=True``: Keras's own compiled loss in training mode (``compute_loss_and_updates``,
    what ``fit`` differentiates on JAX; regularization losses count); the updated non-trainable
    state (BatchNormalization's moving statistics) is written back, as a train step does. The
    model must be compiled. ``training=False``: the mean sparse categorical cross-entropy of an
    inference-mode forward pass (no dropout noise, moving statistics), a function of the weights
    and the batch alone; with ``task`` (a ``kbackend.task.Task``), the mean of its loss instead.
    ``as_numpy=False`` returns backend arrays. One jitted function per (model, mode, task),
    compiled once per batch shape.
    """
    function = _gradient_function(model, training, task)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    if training:
        (loss, aux), grads = function(
            trainable, non_trainable, [v.value for v in model.metrics_variables], x, y, None,
            optimizer_variables=[v.value for v in model.optimizer.variables])
        for variable, value in zip(model.non_trainable_variables, aux[2], strict=True):
            variable.assign(value)
    else:
        loss, grads = function(trainable, non_trainable, jax.numpy.asarray(x), jax.numpy.asarray(y))
    if as_numpy:
        return float(loss), [np.asarray(g) for g in grads]
    return loss, list(grads)


def bias_add_misroutes(model: Any, x: Any) -> list[str]:
    """Always empty: JAX's ``add`` broadcasts and never guesses a bias axis (see the TF backend)."""
    return []
