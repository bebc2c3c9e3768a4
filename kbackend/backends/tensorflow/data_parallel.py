"""TensorFlow data parallelism: Keras ``fit`` under ``tf.distribute.MirroredStrategy``.

There is no native TF data-parallel trainer yet (``DataParallelTrainer`` says so); Keras's own
TF distribution is an unfinished prototype, so ``fit`` runs under a ``MirroredStrategy``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import tensorflow as tf

from kbackend.backends.tensorflow.ops import compute_devices
from kbackend.errors import ConfigError


class DataParallelTrainer:
    """The native data-parallel trainer is JAX-only; TF data parallelism runs through Keras fit."""

    def __init__(self, model: Any, spec: Any, dataset: Any, *, devices: int, batch_size: int,
                 dp_impl: str) -> None:
        raise ConfigError(
            "The data_parallel engine (jax.shard_map) needs KERAS_BACKEND=jax. On TensorFlow use "
            "--engine keras --data-parallel (tf.distribute.MirroredStrategy)."
        )


@contextmanager
def data_parallel_scope(count: int) -> Iterator[Any]:
    """A scope in which Keras models built, compiled and fit run data parallel on ``count`` devices.

    ``tf.distribute.MirroredStrategy`` (Keras's own TF distribution is an unfinished prototype).
    """
    strategy = tf.distribute.MirroredStrategy(
        devices=[d.name for d in compute_devices()[:count]],
        cross_device_ops=tf.distribute.ReductionToOneDevice())
    with strategy.scope():
        yield strategy


def keras_fit_inputs(x: Any, y: Any, batch_size: int) -> tuple[Any, Any, int]:
    """What this process passes to ``fit``: all of it, with the global batch size
    (``MirroredStrategy`` splits every batch over the local devices itself)."""
    return x, y, batch_size


def data_parallel_jit_compile(requested: bool) -> bool:
    """False: XLA-compiled Keras steps cannot read the per-replica variables of a
    ``MirroredStrategy`` on other devices (TF's XLA known issue "tf.Variable on a different
    device"), so mirrored training runs as a plain ``tf.function`` graph."""
    return False


def data_parallel_clone_layer(layer: Any) -> Any:
    """A fresh copy of ``layer`` for a data-parallel replica of its model.

    Each ``MirroredStrategy`` replica runs its own forward pass, so BatchNormalization is copied
    with ``synchronized=True``: its batch statistics are all-reduced across replicas, as in the
    single-device run over the global batch.
    """
    import keras  # deferred: Keras is imported once the backend is chosen

    config = layer.get_config()
    if isinstance(layer, keras.layers.BatchNormalization):
        config["synchronized"] = True
    return layer.__class__.from_config(config)
