"""The JAX data-parallel native engine: the native driver with a sharded trainer.

The loop (epochs, fused calls, evaluation points, targets, early stopping, history, compile
timing) is ``kbackend.engines.native.train``'s; this module supplies its trainer,
``DataParallelTrainer``, which runs ``jax_step``'s sharded train step instead of the
single-device one. Batches are as in the native engine: each epoch a permutation fixed by
``(seed, epoch)`` cut into full global batches of ``config.batch_size`` (the last partial batch
is dropped: it could not be split evenly over the devices). In a multi-process job each process
gathers only its own contiguous block of columns of every global batch; the devices of process
p hold block p, so the global batch, and therefore the training, is the same as in one process.
Validation runs on this process's copy of the (replicated) parameters.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from kbackend.history import History
from kbackend.parallel import check_batch_split, device_count
from kbackend.parallel.jax_step import (
    initial_state,
    make_mesh,
    make_train_step,
    replicate,
    replicate_for_pmap,
    shard_batch,
    split_for_pmap,
    to_host,
)


class DataParallelTrainer:
    """The native driver's trainer for a data-parallel run (see ``kbackend.engines.native``)."""

    def __init__(self, model: Any, spec: Any, dataset: Any, config: Any) -> None:
        from kbackend.backends.jax_native import make_evaluator
        from kbackend.errors import ConfigError

        count = device_count(config)
        batch = config.batch_size
        per_device = check_batch_split(batch, count, config.num_processes)
        processes, process = jax.process_count(), jax.process_index()
        if config.dp_impl == "pmap" and processes > 1:
            raise ConfigError("--dp-impl pmap runs in one process; use --dp-impl shard_map for "
                              "multi-process jobs.")
        self.model, self.pmap, self.count = model, config.dp_impl == "pmap", count
        self.mesh = make_mesh(jax.devices()[:count])
        tx = spec.to_optax()
        self.step = make_train_step(model, tx, self.mesh, config.dp_impl)
        start = initial_state(model, tx)
        self.state = self._place_state(start)
        self.columns = slice(process * (batch // processes), (process + 1) * (batch // processes))
        self.x_train, self.y_train = dataset.x_train, dataset.y_train
        self._evaluate = make_evaluator(model, dataset)
        self._compiled: dict[int, Any] = {}
        self.trace_counts: dict[int, int] = {}
        self.history_extra = {"engine": "data_parallel", "devices": count,
                              "per_device_batch": per_device, "processes": processes,
                              "dp_impl": config.dp_impl, "losses_are_global_batch_means": True}

    def _place_state(self, state: Any) -> Any:
        return replicate_for_pmap(state, self.count) if self.pmap else replicate(state, self.mesh)

    def _batches(self, epoch_rows: np.ndarray, start: int, length: int) -> Any:
        rows = epoch_rows[start:start + length]
        xs, ys = self.x_train[rows], self.y_train[rows]
        return split_for_pmap((xs, ys), self.count) if self.pmap else shard_batch((xs, ys), self.mesh)

    def _host_state(self) -> Any:
        host = to_host(self.state)
        return jax.tree.map(lambda leaf: leaf[0], host) if self.pmap else host

    # -- training -------------------------------------------------------------------------
    def put_epoch(self, rows: np.ndarray) -> np.ndarray:
        """This process's columns of the epoch's ``(steps, global batch)`` index matrix (host)."""
        return rows[:, self.columns]

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
        """Validation loss (cross-entropy + regularization) and accuracy, on this process."""
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
        """Write the trained values back into the Keras model (save/evaluate/predict use them)."""
        current = self._host_state()
        pairs = [*zip(self.model.trainable_variables, current.trainable, strict=True),
                 *zip(self.model.non_trainable_variables, current.non_trainable, strict=True)]
        for variable, value in pairs:
            variable.assign(value)


def train(model: Any, dataset: Any, spec: Any, config: Any, reporter: Any = None) -> History:
    """Train ``model`` data parallel over ``config.devices`` devices; return the history."""
    from kbackend.engines import native
    from kbackend.errors import ConfigError

    if config.fused_steps == 0:
        # The probe measures one device, and each process would pick its own K: the processes'
        # compiled programs (and their collectives) must match.
        raise ConfigError("--fused-steps auto is single-device only: pass a number of fused "
                          "steps with --engine data_parallel.")
    return native.train(model, dataset, spec, config, reporter,
                        trainer_factory=lambda m, s, d: DataParallelTrainer(m, s, d, config))
