"""Batch sources for benchmarks and the monitored Keras engine: NumPy batches with an optional
host-side transform, as a plain iterator or as a Keras ``PyDataset`` for ``model.fit``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kbackend.backend import keras as import_keras


def iterate_batches(x: np.ndarray, y: np.ndarray, batch_size: int, *, epochs: int = 1,
                    transform: Callable[[np.ndarray], np.ndarray] | None = None,
                    shuffle: bool = True, seed: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(x, y)`` batches for ``epochs`` passes; ``transform`` runs on each x batch on the host."""
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        order = rng.permutation(len(x)) if shuffle else np.arange(len(x))
        for start in range(0, len(x), batch_size):
            index = order[start:start + batch_size]
            batch = x[index]
            yield (transform(batch) if transform is not None else batch), y[index]


def monitored_batches(x: np.ndarray, y: np.ndarray, batch_size: int, *, monitor: Any = None,
                      transform: Callable[[np.ndarray], np.ndarray] | None = None,
                      seed: int = 0) -> Any:
    """A Keras ``PyDataset`` of shuffled batches; time spent building each counts as input wait.

    On JAX, ``fit`` reads a ``PyDataset`` on the training thread (the wait is exact); on
    TensorFlow ``fit`` reads it through ``tf.data`` on a producer thread, so the recorded time is
    an upper bound of the wait (the monitor summary says which).
    """
    keras = import_keras()

    class Batches(keras.utils.PyDataset):
        def __init__(self) -> None:
            super().__init__(workers=1, use_multiprocessing=False)
            self.rng = np.random.default_rng(seed)
            self.order = self.rng.permutation(len(x))

        def __len__(self) -> int:
            return -(-len(x) // batch_size)

        def _batch(self, index: int) -> tuple[np.ndarray, np.ndarray]:
            rows = self.order[index * batch_size:(index + 1) * batch_size]
            batch = x[rows]
            return (transform(batch) if transform is not None else batch), y[rows]

        def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
            if monitor is None:
                return self._batch(index)
            with monitor.input_wait():
                return self._batch(index)

        def on_epoch_end(self) -> None:
            self.order = self.rng.permutation(len(x))

    return Batches()
