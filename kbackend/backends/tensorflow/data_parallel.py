"""TensorFlow data parallelism on ``tf.distribute``: the native trainer and Keras ``fit``.

``DataParallelTrainer`` is the trainer of the one epoch loop (``kbackend.engines.loop``) for a
data-parallel run, written as TF's custom-loop guide does it (Keras's ``fit`` is bypassed: under
``MultiWorkerMirroredStrategy`` it fails in Keras 3.15). The model is cloned inside the
strategy's scope, so its variables are mirrored on every replica; K train steps run in one
``tf.function``, a ``tf.range`` loop of ``strategy.run`` calls. Each replica computes its shard's
loss scaled by the *global* batch size (``tf.nn.compute_average_loss``) and its share of the
regularization penalty (``tf.nn.scale_regularization_loss``); the Keras optimizer sums the
replicas' gradients across devices and processes (an all-reduce by the strategy) and applies the
update on every replica. So every step is the single-device step on the global batch.

- One process: ``MirroredStrategy`` over the local devices (GPUs, else logical CPU devices).
- Several processes: the job's ``MultiWorkerMirroredStrategy`` (``ops.initialize_processes``),
  one replica per process on CPU, collective ops over gRPC.
- BatchNormalization layers become ``synchronized=True``: their batch moments are all-reduced,
  as over the global batch on one device.
- XLA: a replica's forward and backward pass runs as an XLA program (``jit_function``) when the
  model has no BatchNormalization; a synchronized BatchNorm all-reduces inside the pass, and TF
  cannot run a cross-replica collective inside a nested compiled function ("merge_call called
  while defining a new graph"), so such models run as a plain TF graph. The all-reduce and the
  optimizer update always run outside XLA: XLA cannot read the mirrored variables of other
  devices (TF's known issue "tf.Variable on a different device").

Batches are the native engine's: each epoch a permutation fixed by ``(seed, epoch)`` cut into full
global batches; replica r of the job takes columns ``[r * b, (r + 1) * b)`` of every global batch
(``b`` = per-replica batch), gathered on its own host, so the job trains on the same global batch
as one device does.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import tensorflow as tf

from kbackend.backends.tensorflow import ops
from kbackend.backends.tensorflow.native import shared_evaluator
from kbackend.backends.tensorflow.ops import compute_devices, jit_function
from kbackend.errors import ConfigError
from kbackend.history import RunRecord
from kbackend.task import CLASSIFICATION, Task


def local_strategy(count: int) -> Any:
    """``MirroredStrategy`` over this process's first ``count`` compute devices."""
    return tf.distribute.MirroredStrategy(
        devices=[d.name for d in compute_devices()[:count]],
        cross_device_ops=tf.distribute.ReductionToOneDevice())


class DataParallelTrainer:
    """A ``Trainer`` (``kbackend.engines.loop``) for a data-parallel run over ``devices``
    replicas."""

    def __init__(self, model: Any, spec: Any, dataset: Any, *, devices: int, batch_size: int,
                 dp_impl: str, task: Task = CLASSIFICATION) -> None:
        import keras  # deferred: Keras is imported once the backend is chosen

        if dp_impl == "pmap":
            raise ConfigError("--dp-impl pmap is JAX's; on TensorFlow the data_parallel engine "
                              "runs on tf.distribute. Leave --dp-impl out.")
        self.strategy = ops.job_strategy() or local_strategy(devices)
        replicas = self.strategy.num_replicas_in_sync
        if replicas != devices:
            raise ConfigError(f"The TensorFlow strategy has {replicas} replicas; the run asked "
                              f"for {devices} devices.")
        self.model, self.replicas, self.batch_size, self.task = model, replicas, batch_size, task
        with self.strategy.scope():
            self.replica_model = keras.models.clone_model(
                model, clone_function=data_parallel_clone_layer)
            self.replica_model.set_weights(model.get_weights())
            self.optimizer = spec.to_keras()
            self.optimizer.build(self.replica_model.trainable_variables)
        self.xla = not any(isinstance(layer, keras.layers.BatchNormalization)
                           for layer in model._flatten_layers(include_self=False))
        # The K steps stay a TF loop around the replica's XLA pass: no XLA while loop to avoid
        # (measured: the Fashion-MNIST CNN on 2 devices trains as fast at K = 4 as at K = 1).
        self.unroll = False
        self.x_train, self.y_train = dataset.x_train, dataset.y_train
        self._evaluator = shared_evaluator(model, dataset, task=task)
        self._compiled: dict[int, Any] = {}
        self.trace_counts: dict[int, int] = {}
        self.run_record = RunRecord(engine="data_parallel", dp_impl=type(self.strategy).__name__,
                                    replica_xla=self.xla, losses_are_global_batch_means=True)

    # -- the compiled call ----------------------------------------------------------------
    def _replica_loss_fn(self, global_batch: int) -> Any:
        """A replica's ``(loss, grads)`` on its shard, its loss a share of the mean over
        ``global_batch`` samples (the replicas' gradients sum to the global batch's)."""
        model, task = self.replica_model, self.task

        def loss_and_grads(x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, list[tf.Tensor]]:
            with tf.GradientTape() as tape:
                outputs = model(x, training=True)
                per_sample = task.per_sample_loss(y, outputs)
                loss = tf.nn.compute_average_loss(per_sample, global_batch_size=global_batch)
                if model.losses:  # this replica's share of the penalty: the sum is one penalty
                    loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
            return loss, tape.gradient(loss, model.trainable_variables)

        return jit_function(loss_and_grads) if self.xla else loss_and_grads

    def _run_fn(self, length: int) -> Any:
        loss_and_grads = self._replica_loss_fn(self.batch_size)
        model, optimizer, strategy = self.replica_model, self.optimizer, self.strategy

        def replica_step(xs: tf.Tensor, ys: tf.Tensor, i: tf.Tensor) -> tf.Tensor:
            loss, grads = loss_and_grads(xs[i], ys[i])
            optimizer.apply(grads, model.trainable_variables)  # sums the replicas' gradients
            return loss

        def run(xs: Any, ys: Any, n_steps: tf.Tensor) -> tf.Tensor:
            self.trace_counts[length] = self.trace_counts.get(length, 0) + 1
            losses = tf.TensorArray(tf.float32, size=n_steps)
            for i in tf.range(n_steps):
                loss = strategy.run(replica_step, args=(xs, ys, i))
                losses = losses.write(i, tf.cast(strategy.reduce("SUM", loss, axis=None),
                                                 tf.float32))
            return losses.stack()

        return tf.function(run)

    def _batches(self, epoch_rows: np.ndarray, start: int, length: int) -> tuple[Any, Any]:
        """Each local replica's columns of ``length`` global batches, as per-replica values."""
        rows = epoch_rows[start:start + length]
        per = int(rows.shape[-1]) // self.replicas  # the rows hold global batches

        def shard(values: np.ndarray) -> Any:
            def of_replica(context: Any) -> tf.Tensor:
                replica = context.replica_id_in_sync_group
                return tf.constant(values[rows[:, replica * per:(replica + 1) * per]])
            return self.strategy.experimental_distribute_values_from_function(of_replica)

        return shard(self.x_train), shard(self.y_train)

    # -- training -------------------------------------------------------------------------
    def put_epoch(self, rows: np.ndarray) -> np.ndarray:
        """The epoch's ``(steps, global batch)`` index matrix, kept on the host."""
        return rows

    def compile(self, length: int, epoch_rows: np.ndarray) -> float:
        """Trace the ``length``-step call if needed (a 0-step call); the seconds it took."""
        if length in self._compiled:
            return 0.0
        started = time.perf_counter()
        fn = self._run_fn(length)
        fn(*self._batches(epoch_rows, 0, length), tf.constant(0)).numpy()
        self._compiled[length] = fn
        return time.perf_counter() - started

    def run(self, epoch_rows: np.ndarray, start: int, length: int) -> tf.Tensor:
        """Run ``length`` steps from row ``start``; their global-batch losses."""
        return self._compiled[length](*self._batches(epoch_rows, start, length),
                                      tf.constant(length))

    def fetch(self, losses: tf.Tensor) -> np.ndarray:
        return losses.numpy()

    # -- evaluation and model values ------------------------------------------------------
    def _variables(self, model: Any) -> list[Any]:
        return [*model.trainable_variables, *model.non_trainable_variables]

    def snapshot(self) -> list[np.ndarray]:
        """A host copy of the replicated model's values (every replica holds the same)."""
        return [np.array(v.numpy()) for v in self._variables(self.replica_model)]

    def restore(self, snapshot: list[np.ndarray]) -> None:
        for variable, value in zip(self._variables(self.replica_model), snapshot, strict=True):
            variable.assign(value)

    def finish(self) -> None:
        """Write the trained values into the Keras model (save/evaluate/predict use them)."""
        for variable, value in zip(self._variables(self.model), self.snapshot(), strict=True):
            variable.assign(value)
        # The optimizer state too (iterations, slots), so a saved model resumes: the model's
        # optimizer is the same spec's Keras optimizer, built on the same variables in order.
        optimizer = self.model.optimizer
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            for target, value in zip(optimizer.variables, self.optimizer.variables, strict=True):
                target.assign(value.numpy())

    def evaluate(self) -> tuple[float, float]:
        """Validation loss (the task's + regularization) and metric, on this process."""
        self.finish()
        return self._evaluator("val")


@contextmanager
def data_parallel_scope(count: int) -> Iterator[Any]:
    """A scope in which Keras models built, compiled and fit run data parallel on ``count`` devices.

    ``tf.distribute.MirroredStrategy`` (Keras's own TF distribution is an unfinished prototype).
    Keras 3.15's ``fit`` fails under ``MultiWorkerMirroredStrategy``, so a multi-process job is
    refused here and pointed to the native data-parallel engine.
    """
    if ops.process_count() > 1:
        raise ConfigError(
            "Keras fit cannot train across processes on TensorFlow (Keras 3.15 fails under "
            "MultiWorkerMirroredStrategy): use --engine native (the data_parallel engine).")
    strategy = local_strategy(count)
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
