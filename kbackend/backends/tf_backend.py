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



def training_gradients(model: Any, x: Any, y: Any) -> tuple[Any, list[Any]]:
    """One training-mode loss and its gradients for a compiled Keras model (backend tensors).

    The computation of Keras' TF ``train_step``: a ``GradientTape`` around the training call and
    ``compute_loss``. The training call updates BatchNormalization's moving statistics in place,
    as a train step does. Gradients come in the order of ``model.trainable_variables``, as TF
    returns them (an Embedding's gradient is a sparse ``tf.IndexedSlices``; None where the loss
    does not depend on a variable).
    """
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        loss = model.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
    return loss, tape.gradient(loss, model.trainable_variables)


def loss_and_gradients(model: Any, x: Any, y: Any) -> tuple[float, list[np.ndarray]]:
    """``training_gradients`` as a float and dense NumPy arrays (zeros for None)."""
    loss, grads = training_gradients(model, x, y)
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
    import keras.src.backend.tensorflow.numpy as tf_numpy

    found: list[str] = []
    original = tf_numpy.add

    def recording_add(x1: Any, x2: Any) -> Any:
        s1, s2 = getattr(x1, "shape", ()), getattr(x2, "shape", ())
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
