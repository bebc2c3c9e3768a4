"""JAX data parallelism: the native engine's sharded trainer and Keras ``fit`` under
``DataParallel``.

``DataParallelTrainer`` is the trainer of the one epoch loop (``kbackend.engines.loop``) for a
data-parallel run: it runs ``step.py``'s sharded train step instead of the single-device one.
Batches are as in the native engine: each epoch a permutation fixed by ``(seed, epoch)`` cut into
full global batches (the last partial batch is dropped: it could not be split evenly over the
devices). In a multi-process job each process gathers only its own contiguous block of columns
of every global batch; the devices of process p hold block p, so the global batch, and therefore
the training, is the same as in one process. Validation runs on this process's copy of the
(replicated) parameters.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jax
import numpy as np

from kbackend.backend_choice import tensorflow_kept_out
from kbackend.backends.jax.native import make_evaluator
from kbackend.backends.jax.optimizers import to_optax
from kbackend.backends.jax.step import (
    initial_state,
    make_mesh,
    make_train_step,
    replicate,
    replicate_for_pmap,
    shard_batch,
    split_for_pmap,
    to_host,
    unrolls_its_loop,
    write_state,
)
from kbackend.errors import ConfigError
from kbackend.history import RunRecord
from kbackend.task import CLASSIFICATION, Task


class DataParallelTrainer:
    """A ``Trainer`` (``kbackend.engines.loop``) for a data-parallel run over ``devices``
    devices."""

    def __init__(self, model: Any, spec: Any, dataset: Any, *, devices: int, batch_size: int,
                 dp_impl: str, task: Task = CLASSIFICATION) -> None:
        if dp_impl == "pmap" and jax.process_count() > 1:
            raise ConfigError("--dp-impl pmap runs in one process; use --dp-impl shard_map for "
                              "multi-process jobs.")
        self.model, self.pmap, self.count = model, dp_impl == "pmap", devices
        self.mesh = make_mesh(jax.devices()[:devices])
        tx = to_optax(spec)
        self.unroll = unrolls_its_loop(model)
        self.step = self._make_step(model, tx, dp_impl, task)
        self.state = self._place_state(initial_state(model, tx, spec))
        self.batch_size = batch_size  # global; each epoch's rows may have another (put_epoch)
        self.x_train, self.y_train = dataset.x_train, dataset.y_train
        self._evaluate = make_evaluator(model, dataset, task=task)
        self._compiled: dict[int, Any] = {}
        self.trace_counts: dict[int, int] = {}
        self.run_record = RunRecord(engine="data_parallel", dp_impl=dp_impl,
                                    losses_are_global_batch_means=True, unrolled_loop=self.unroll)

    def _make_step(self, model: Any, tx: Any, dp_impl: str, task: Task) -> Any:
        return make_train_step(model, tx, self.mesh, dp_impl, self.unroll, task)

    def _place_state(self, state: Any) -> Any:
        return replicate_for_pmap(state, self.count) if self.pmap else replicate(state, self.mesh)

    def _batches(self, epoch_rows: np.ndarray, start: int, length: int) -> Any:
        rows = epoch_rows[start:start + length]
        xs, ys = self.x_train[rows], self.y_train[rows]
        if self.pmap:
            return split_for_pmap((xs, ys), self.count)
        return shard_batch((xs, ys), self.mesh)

    def _host_state(self) -> Any:
        host = to_host(self.state)
        return jax.tree.map(lambda leaf: leaf[0], host) if self.pmap else host

    # -- training -------------------------------------------------------------------------
    def put_epoch(self, rows: np.ndarray) -> np.ndarray:
        """This process's columns of the epoch's ``(steps, global batch)`` index matrix (host):
        block p of ``processes`` equal blocks."""
        width = rows.shape[1] // jax.process_count()
        start = jax.process_index() * width
        return rows[:, start:start + width]

    def compile(self, length: int, epoch_rows: np.ndarray) -> float:
        """Compile the ``length``-step call if needed; the seconds it took (0.0 if cached)."""
        if length in self._compiled:
            return 0.0
        started = time.perf_counter()
        self.trace_counts[length] = self.trace_counts.get(length, 0) + 1
        batches = self._batches(epoch_rows, 0, length)
        self._compiled[length] = self.step.lower(self.state, batches).compile()
        return time.perf_counter() - started

    def run(self, epoch_rows: np.ndarray, start: int, length: int) -> Any:
        """Dispatch ``length`` steps from row ``start``; their global-batch losses (device)."""
        self.state, metrics = self._compiled[length](self.state,
                                                     self._batches(epoch_rows, start, length))
        return metrics.loss

    def fetch(self, losses: Any) -> np.ndarray:
        """Wait for a call's losses; this process's host copy."""
        values = to_host(jax.block_until_ready(losses))
        return values[0] if self.pmap else values

    # -- evaluation and model values ------------------------------------------------------
    def evaluate(self) -> tuple[float, float]:
        """Validation loss (the task's + regularization) and metric, on this process."""
        current = self._host_state()
        return self._evaluate(current.trainable, current.non_trainable)

    def snapshot(self) -> Any:
        """A host copy of the model's values (for restoring the best ones)."""
        current = self._host_state()
        return current.trainable, current.non_trainable

    def restore(self, snapshot: Any) -> None:
        host = self._host_state()
        trainable, non_trainable = snapshot
        self.state = self._place_state(host._replace(trainable=trainable,
                                                     non_trainable=non_trainable))

    def finish(self) -> None:
        """Write the trained values back into the Keras model (save/evaluate/predict use them)
        and its optimizer state (a saved model resumes)."""
        write_state(self.model, self._host_state())


@contextmanager
def data_parallel_scope(count: int) -> Iterator[Any]:
    """A scope in which Keras models built, compiled and fit run data parallel on ``count`` devices.

    ``keras.distribution.DataParallel``: variables replicated, every batch split along its first
    axis across the devices, gradients reduced by XLA's SPMD partitioner.
    """
    import keras  # deferred: Keras is imported once the backend is chosen

    distribution = keras.distribution.DataParallel(devices=jax.devices()[:count])
    # In a multi-process job each process already feeds its own block (keras_fit_inputs).
    distribution.auto_shard_dataset = False
    with distribution.scope():
        yield distribution


def keras_fit_inputs(x: Any, y: Any, batch_size: int) -> tuple[Any, Any, int]:
    """What this process passes to ``fit`` under ``DataParallel``: its own block of the data.

    Keras on JAX assembles each global batch from the per-process batches, so process p feeds
    the p-th block of samples with a per-process batch of ``batch_size / processes``.
    """
    processes, index = jax.process_count(), jax.process_index()
    if processes == 1:
        return x, y, batch_size
    block = len(x) // processes
    return (x[index * block:(index + 1) * block], y[index * block:(index + 1) * block],
            batch_size // processes)


def data_parallel_jit_compile(requested: bool) -> bool:
    """Keras on JAX always compiles with XLA; ``DataParallel`` keeps what was asked for."""
    return requested


def data_parallel_clone_layer(layer: Any) -> Any:
    """A fresh copy of ``layer`` for a data-parallel replica of its model.

    Under ``DataParallel`` XLA partitions one global computation, so BatchNormalization already
    sees the whole batch: plain copies.
    """
    with tensorflow_kept_out():
        return layer.__class__.from_config(layer.get_config())
