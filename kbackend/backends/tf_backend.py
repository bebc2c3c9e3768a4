"""TensorFlow implementations of kbackend's backend-specific operations."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf


def framework_versions() -> dict[str, str]:
    """Versions of the framework packages behind this backend."""
    return {"tensorflow": tf.__version__}


def devices() -> list[dict[str, Any]]:
    """The logical devices computations can run on: kind, platform and id of each."""
    found = []
    for index, device in enumerate(tf.config.list_logical_devices()):
        details = {}
        physical = [p for p in tf.config.list_physical_devices(device.device_type)]
        if physical:
            details = tf.config.experimental.get_device_details(physical[0]) or {}
        found.append(
            {
                "id": index,
                "platform": device.device_type.lower(),
                "kind": details.get("device_name", device.device_type),
                "name": device.name,
            }
        )
    return found


def block_until_ready(value: Any) -> Any:
    """TF eager ops are synchronous once their values are read; materialize them."""
    return tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, value)


def to_numpy(value: Any) -> np.ndarray:
    """A NumPy copy of a backend array."""
    return np.asarray(value)


def supports_channels_first_conv() -> bool:
    """TF's CPU kernels implement Conv2D and pooling only for NHWC (keras issues 20414, 19591)."""
    return bool(tf.config.list_physical_devices("GPU"))


# --- study (issue 4) ---
_GRADIENT_FUNCTIONS: Any = None


def batch_gradients(model: Any, x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """Gradient of the mean sparse categorical cross-entropy of ``model`` on the batch ``(x, y)``
    with respect to its trainable variables, one NumPy array per variable.

    The forward pass runs with ``training=False`` (no dropout noise, batch-norm moving
    statistics), so the gradient is a function of the weights and the batch alone. One XLA
    ``tf.function`` per model, traced once per batch shape.
    """
    import weakref

    import keras

    global _GRADIENT_FUNCTIONS
    if _GRADIENT_FUNCTIONS is None:
        _GRADIENT_FUNCTIONS = weakref.WeakKeyDictionary()
    gradient = _GRADIENT_FUNCTIONS.get(model)
    if gradient is None:
        @tf.function(jit_compile=True)
        def gradient(inputs, labels):
            with tf.GradientTape() as tape:
                probabilities = model(inputs, training=False)
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, probabilities))
            return tape.gradient(loss, model.trainable_variables)

        _GRADIENT_FUNCTIONS[model] = gradient
    grads = gradient(tf.convert_to_tensor(x), tf.convert_to_tensor(y))
    return [g.numpy() for g in grads]
