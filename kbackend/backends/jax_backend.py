"""JAX implementations of kbackend's backend-specific operations."""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np


def framework_versions() -> dict[str, str]:
    """Versions of the framework packages behind this backend."""
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__}


def devices() -> list[dict[str, Any]]:
    """The devices computations can run on: kind, platform and id of each."""
    return [
        {"id": d.id, "platform": d.platform, "kind": d.device_kind, "process": d.process_index}
        for d in jax.devices()
    ]


def block_until_ready(value: Any) -> Any:
    """Wait for every array in ``value`` to be computed (for honest timing)."""
    return jax.block_until_ready(value)


def to_numpy(value: Any) -> np.ndarray:
    """A NumPy copy of a backend array."""
    return np.asarray(value)


def supports_channels_first_conv() -> bool:
    """XLA on every JAX platform implements NCHW convolutions."""
    return True



def training_gradients(model: Any, x: Any, y: Any) -> tuple[Any, list[Any]]:
    """One training-mode loss and its gradients for a compiled Keras model (backend arrays).

    Differentiates Keras' own stateless loss (``compute_loss_and_updates``, what ``fit``
    differentiates on JAX; regularization losses count), jitted once per model, and writes the
    updated non-trainable state (BatchNormalization's moving statistics) back as a train step
    does. Gradients come in the order of ``model.trainable_variables``.
    """
    grad_fn = getattr(model, "_kbackend_grad_fn", None)
    if grad_fn is None:
        loss_fn = functools.partial(model.compute_loss_and_updates, training=True)
        grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
        model._kbackend_grad_fn = grad_fn  # lives and dies with the model
    (loss, aux), grads = grad_fn(
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.metrics_variables],
        x, y, None,
        optimizer_variables=[v.value for v in model.optimizer.variables],
    )
    for variable, value in zip(model.non_trainable_variables, aux[2], strict=True):
        variable.assign(value)
    return loss, list(grads)


def loss_and_gradients(model: Any, x: Any, y: Any) -> tuple[float, list[np.ndarray]]:
    """``training_gradients`` as a float and NumPy arrays (state updates applied, see there)."""
    loss, grads = training_gradients(model, x, y)
    return float(loss), [np.asarray(g) for g in grads]


def bias_add_misroutes(model: Any, x: Any) -> list[str]:
    """Always empty: JAX's ``add`` broadcasts and never guesses a bias axis (see tf_backend)."""
    return []
