"""Batch sources for benchmarks and the Keras engine: NumPy batches with an optional host-side
transform, as a plain iterator or as a Keras ``PyDataset`` for ``model.fit``.

Both read each epoch in ``kbackend.data.batching.epoch_order`` (the native engine's order, fixed
by seed and epoch), so the batches a model sees do not depend on whether a monitor watches them.
Unlike the native engine they keep the last, shorter batch of an epoch
(``batching.epoch_batches_with_remainder``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import numpy as np

from kbackend.backend_choice import keras as import_keras
from kbackend.data.batching import epoch_batches_with_remainder, steps_per_epoch


def iterate_batches(x: np.ndarray, y: np.ndarray, batch_size: int, *, epochs: int = 1,
                    transform: Callable[[np.ndarray], np.ndarray] | None = None,
                    shuffle: bool = True, seed: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(x, y)`` batches for ``epochs`` passes; ``transform`` runs on each x batch on the host."""
    for epoch in range(epochs):
        for index in epoch_batches_with_remainder(len(x), batch_size, seed, epoch, shuffle):
            batch = x[index]
            yield (transform(batch) if transform is not None else batch), y[index]


def monitored_batches(x: np.ndarray, y: np.ndarray, batch_size: int, *, monitor: Any = None,
                      transform: Callable[[np.ndarray], np.ndarray] | None = None,
                      seed: int = 0, shuffle: bool = True,
                      label_transform: Callable[[np.ndarray], Any] | None = None) -> Any:
    """A Keras ``PyDataset`` of each epoch's batches (``label_transform``: a multi-output task's
    packed labels -> a dict by output); with a ``monitor``, building a batch counts as input wait.

    Batch ``i`` of epoch ``e`` is a pure function of ``(seed, e, i)``. The epoch is set by the
    callback ``epoch_callback()`` returns (add it to ``fit``'s callbacks; without it every
    ``fit`` epoch reads epoch 0's order), and ``fit`` must get ``shuffle=False``, or Keras
    shuffles the batches once more. Keras's ``on_epoch_end`` hook is not used to count epochs:
    its calls before training differ between backends, and TensorFlow creates the next epoch's
    iterator before it.

    On JAX, ``fit`` reads a ``PyDataset`` on the training thread (the wait is exact); on TF
    through ``tf.data`` on a producer thread: the time is an upper bound (the summary says so).
    """
    # Any: mypy cannot see the classes of a module imported at run time (the bases below)
    keras: Any = import_keras()

    class Batches(keras.utils.PyDataset):
        def __init__(self) -> None:
            super().__init__(workers=1, use_multiprocessing=False)
            self.epoch = 0
            self._rows = (0, epoch_batches_with_remainder(len(x), batch_size, seed, 0, shuffle))

        def __len__(self) -> int:
            return steps_per_epoch(len(x), batch_size, drops_last=False)

        def rows(self, index: int) -> np.ndarray:
            """The sample indices of batch ``index`` of the current epoch."""
            epoch, rows = self._rows  # one tuple: tf.data reads from another thread
            if epoch != self.epoch:
                epoch = self.epoch
                rows = epoch_batches_with_remainder(len(x), batch_size, seed, epoch, shuffle)
                self._rows = (epoch, rows)
            return rows[index]

        def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
            rows = self.rows(index)
            with monitor.input_wait() if monitor is not None else nullcontext():
                labels = y[rows] if label_transform is None else label_transform(y[rows])
                return (transform(x[rows]) if transform is not None else x[rows]), labels

        def epoch_callback(self) -> Any:
            """A Keras callback that points this source at each epoch as ``fit`` begins it."""
            source = self

            class FollowEpochs(keras.callbacks.Callback):
                def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
                    source.epoch = epoch

            return FollowEpochs()

    return Batches()
