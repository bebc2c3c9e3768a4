"""TensorFlow: micro-batch gradients for the online noise scale (``--batch-size auto``).

One forward pass over the whole batch of B samples under a persistent ``GradientTape``, then one
backward pass per micro-batch (``tape.gradient`` with ``output_gradients`` that weigh micro-batch
m's samples by 1 / b, b = B / M, and the regularization losses by 1). The update is the mean of
the M micro-batch gradients, exactly the gradient of the batch's mean loss: the forward pass,
BatchNormalization's batch statistics (its moving statistics updated once), Dropout's masks and
the update are those of the plain step (``native.make_train_step``), for every model. The cost
is M - 1 extra backward passes (M = 2 by default, ``kbackend.adaptive``).

Besides the update, a step returns each micro-batch gradient's squared norm and the squared norm
of their mean, the two inputs of ``kbackend.adaptive.NoiseScale``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import tensorflow as tf

from kbackend.adaptive import DEFAULT_MEASURE_EVERY, micro_batches_for
from kbackend.backends import kept_while_alive
from kbackend.backends.compile_ahead import MeasuredCalls, SizedCalls
from kbackend.backends.tensorflow.data_parallel import DataParallelTrainer
from kbackend.backends.tensorflow.native import NativeTrainer
from kbackend.backends.tensorflow.ops import counted_loop, jit_function, note_program
from kbackend.errors import ConfigError, is_out_of_memory
from kbackend.task import CLASSIFICATION, Task


def _dense(gradient: Any, variable: Any) -> tf.Tensor:
    """A dense gradient (zeros where the loss does not reach the variable; an Embedding's
    ``IndexedSlices`` made dense)."""
    if gradient is None:
        return tf.zeros_like(variable)
    return tf.convert_to_tensor(gradient)


def _squared_norm(tensors: list[tf.Tensor]) -> tf.Tensor:
    return tf.add_n([tf.reduce_sum(tf.square(tf.cast(t, tf.float32))) for t in tensors])


def micro_batched_value_and_grad(model: Any, micro_batches: int,
                                 task: Task = CLASSIFICATION) -> Any:
    """``f(x, y) -> (loss, grads, micro_sq_norms, batch_sq_norm)`` for use inside a traced
    step: the batch's loss and gradient (the mean of ``micro_batches`` micro-batch gradients of
    its rows m*b .. (m+1)*b, in ``model.trainable_variables`` order) and the noise norms
    (``micro_sq_norms`` of shape ``(M,)``)."""

    def value_and_grad(x: Any, y: Any) -> tuple[Any, list[Any], Any, Any]:
        variables = model.trainable_variables
        with tf.GradientTape(persistent=True) as tape:
            outputs = model(x, training=True)
            per_sample = task.per_sample_loss(y, outputs)
            penalties = [tf.reduce_sum(loss) for loss in model.losses]
        batch = tf.shape(per_sample)[0]
        size = batch // micro_batches
        rows = tf.range(batch) // size
        targets = [per_sample, *penalties]
        micro_grads = []
        for index in range(micro_batches):  # one backward pass per micro-batch
            weights = tf.cast(rows == index, per_sample.dtype) / tf.cast(size, per_sample.dtype)
            grads = tape.gradient(targets, variables, output_gradients=[
                weights, *(tf.ones_like(p) for p in penalties)])
            micro_grads.append([_dense(g, v) for g, v in zip(grads, variables, strict=True)])
        del tape
        mean_grads = [tf.add_n(list(parts)) / micro_batches for parts in zip(*micro_grads,
                                                                            strict=True)]
        data_loss = tf.reduce_sum(per_sample) / tf.cast(batch, per_sample.dtype)
        loss = tf.add_n([tf.cast(data_loss, tf.float32),
                         *(tf.cast(p, tf.float32) for p in penalties)])
        return (loss, mean_grads, tf.stack([_squared_norm(g) for g in micro_grads]),
                _squared_norm(mean_grads))

    return value_and_grad


def make_adaptive_train_step(model: Any, optimizer: Any, micro_batches: int,
                             task: Task = CLASSIFICATION) -> Any:
    """``native.make_train_step`` with micro-batched gradients: ``train_step(x, y) -> (loss,
    micro_sq_norms, batch_sq_norm)``, updating ``model``'s variables in place."""
    value_and_grad = micro_batched_value_and_grad(model, micro_batches, task)

    def train_step(x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        loss, grads, micro_norms, batch_norm = value_and_grad(x, y)
        optimizer.apply(grads, model.trainable_variables)
        return loss, micro_norms, batch_norm

    return train_step


# (model, micro-batches, task) -> XLA-compiled micro-batched gradient; dies with its model.
_FUNCTIONS: dict[tuple[int, int, Task], Any] = {}


def micro_batched_gradients(model: Any, x: Any, y: Any, micro_batches: int = 0, *,
                            task: Task = CLASSIFICATION) -> tuple[float, list[np.ndarray],
                                                                  np.ndarray, float]:
    """``(loss, grads, micro_sq_norms, batch_sq_norm)`` of ``model``'s training-mode loss on
    ``(x, y)`` split into ``micro_batches`` micro-batches (0: ``micro_batches_for(len(x))``),
    in one XLA program. ``grads`` is the mean of the micro-batch gradients in
    ``model.trainable_variables`` order, as NumPy arrays. The model's weights are not changed
    (BatchNormalization's moving statistics are, as in a train step)."""
    count = micro_batches or micro_batches_for(len(y))
    function = kept_while_alive(
        _FUNCTIONS, (id(model), count, task), (model,),
        lambda: jit_function(micro_batched_value_and_grad(model, count, task)))
    loss, grads, micro_norms, batch_norm = function(tf.convert_to_tensor(x),
                                                    tf.convert_to_tensor(y))
    return (float(loss), [np.asarray(g) for g in grads], np.asarray(micro_norms, np.float64),
            float(batch_norm))


class AdaptiveTrainer(MeasuredCalls, NativeTrainer):
    """The native trainer with micro-batched steps at whichever batch size an epoch's rows have.

    The model's and the optimizer's variables are the state and every batch size's program
    updates them in place, so a change of size carries everything over; each (batch size, call
    length) is compiled once (``trace_counts_by_size``). ``fetch`` returns a call's losses, as
    the loop expects, and keeps its noise norms on the host for ``take_noise_norms``. The
    learning rate is a Keras variable the programs read (``set_learning_rate``); schedules are
    refused before a run (a schedule is traced into the program).

    Each call length is traced once for every batch size (the rows' shape relaxed to
    ``(None, None)``; ``traces``): a new size costs XLA's compilation of the traced graph at its
    shapes (or its load from the persistent cache), not a new trace, which cost about as much
    (0.7 s each for the seed MLP on a 2-core CPU, docs/adaptive.md). A model that cannot be
    traced without a static batch size (a layer that reads ``x.shape[0]``) is traced per size
    instead, the rows' batch fixed (``relaxed`` False). ``trace_counts_by_size`` counts the XLA
    programs of each (size, length): one per rows shape. A call shorter than one already
    compiled at its size (an epoch's last, or the rest of an epoch after a growth) runs that
    call's program with fewer steps (its trip count is a run-time value), so it compiles
    nothing; a one-step call too, which a run of one-step calls writes out instead
    (``writes_out``).

    The estimate is taken inside the fused call: its first K - 1 steps are the plain step, its
    last step the micro-batch step on every ``calls_between(K)``-th call (a run-time flag:
    ``tf.cond``, one program per size), the plain one otherwise (NaN norms, skipped by the
    estimator): one measured step per ``measure_every`` steps. ``measure_every=1`` measures
    every step (the reference estimator the benchmark compares with).
    """

    def __init__(self, model: Any, spec: Any, dataset: Any, jit_compile: bool = True,
                 task: Task = CLASSIFICATION, measure_every: int = DEFAULT_MEASURE_EVERY) -> None:
        super().__init__(model, spec, dataset, jit_compile, task)
        self.task = task
        self._start_measured(measure_every)  # _sized values: (compiled call, its length)
        # (micro-batches, length[, batch where not relaxed]) -> the traced function
        self._functions: dict[tuple[int, ...], Any] = {}
        self._shapes: set[tuple[int, tuple[int, ...]]] = set()  # (function id, rows shape)
        self.relaxed = True
        self._steps: dict[int, Any] = {}
        self.traces = 0
        self._count_lock = threading.Lock()

    def _adaptive_step(self, count: int) -> Any:
        if count not in self._steps:
            self._steps[count] = make_adaptive_train_step(self.model, self.optimizer, count,
                                                          self.task)
        return self._steps[count]

    def reset(self, values: Any, learning_rate: float) -> None:
        """A new run on the compiled programs, measured from its first call as a fresh
        trainer's run is."""
        super().reset(values, learning_rate)
        self._calls = 0

    def _run_function(self, batch: int, length: int) -> Any:
        """The ``length``-step call for ``batch`` rows, traced once for every batch size of
        its micro-batch count."""
        count = micro_batches_for(batch)
        key = (count, length) if self.relaxed else (count, length, batch)
        if key not in self._functions:
            self._functions[key] = self._adaptive_run_fn(count, length,
                                                         None if self.relaxed else batch)
        return self._functions[key]

    def _adaptive_run_fn(self, count: int, length: int, batch: int | None = None) -> Any:
        """The ``length``-step call with ``count`` micro-batches, traced for rows of any
        number of steps and ``batch`` samples (None: any)."""
        step = self._adaptive_step(count)
        nan = tf.constant(float("nan"), tf.float32)

        def batch_at(x_all, y_all, epoch_rows, index):
            row = tf.gather(epoch_rows, index)
            return tf.gather(x_all, row), tf.gather(y_all, row)

        def measured(x, y):
            loss, micro, big = step(x, y)
            return tf.cast(loss, tf.float32), micro, big

        def plain(x, y):  # NaN norms are skipped by the estimator
            return tf.cast(self.train_step(x, y), tf.float32), tf.fill([count], nan), nan

        def last_step(x_all, y_all, epoch_rows, index, measure):
            x, y = batch_at(x_all, y_all, epoch_rows, index)
            return tf.cond(measure, lambda: measured(x, y), lambda: plain(x, y))

        def run(x_all, y_all, epoch_rows, start, n_steps, measure):
            self.traces += 1
            every = self.measure_every <= 1
            if self.writes_out(length):  # the steps written out; ``n_steps`` is ``length``
                outputs = [(measured if every else plain)(
                    *batch_at(x_all, y_all, epoch_rows, start + i)) for i in range(length - 1)]
                outputs.append(last_step(x_all, y_all, epoch_rows, start + length - 1,
                                         tf.constant(True) if every else measure))
                losses, micros, bigs = (tf.stack(values) for values in zip(*outputs,
                                                                            strict=True))
                return (losses, micros, bigs) if every else (losses, micros[-1:], bigs[-1:])
            losses = tf.zeros([length], tf.float32)
            micros, bigs = tf.fill([length, count], nan), tf.fill([length], nan)
            last = tf.maximum(n_steps - 1, 0)  # a 0-step call (compiling) trains nothing

            def body(i, losses, micros, bigs):
                x, y = batch_at(x_all, y_all, epoch_rows, start + i)
                loss, micro, big = measured(x, y) if every else plain(x, y)
                return (tf.tensor_scatter_nd_update(losses, [[i]], [loss]),
                        tf.tensor_scatter_nd_update(micros, [[i]], [micro]),
                        tf.tensor_scatter_nd_update(bigs, [[i]], [big]))

            losses, micros, bigs = counted_loop(last, body, (losses, micros, bigs))
            loss, micro, big = tf.cond(
                n_steps > 0,
                lambda: last_step(x_all, y_all, epoch_rows, start + last, measure | every),
                lambda: (tf.constant(0.0), tf.fill([count], nan), nan))
            losses = tf.tensor_scatter_nd_update(losses, [[last]], [loss])
            if every:
                micros = tf.tensor_scatter_nd_update(micros, [[last]], [micro])
                bigs = tf.tensor_scatter_nd_update(bigs, [[last]], [big])
                return losses, micros, bigs
            return losses, micro[None], big[None]

        def spec(tensor: Any) -> tf.TensorSpec:
            return tf.TensorSpec(tensor.shape, tf.as_dtype(tensor.dtype))

        scalar = tf.TensorSpec([], tf.int32)
        signature = [tf.nest.map_structure(spec, self.x_train),
                     tf.nest.map_structure(spec, self.y_train),
                     tf.TensorSpec([None, batch], tf.int32), scalar, scalar,
                     tf.TensorSpec([], tf.bool)]
        return jit_function(run, self.jit_compile, input_signature=signature)

    def _program(self, key: tuple[int, int], epoch_rows: Any, n_steps: int) -> Any:
        """``key``'s call XLA-compiled at the rows' shape by a call of ``n_steps`` steps (0 for
        a loop: it reads the variables and writes none, so it may run beside training; a
        written-out call's steps, whose values the caller puts back). Counted as one program
        (``trace_counts_by_size``)."""
        args = (self.x_train, self.y_train, epoch_rows, tf.constant(0), tf.constant(n_steps),
                tf.constant(False))
        with self._lock:
            fn = self._run_function(*key)
            traced = fn.experimental_get_tracing_count() > 0
            try:
                fn(*args)
            except Exception as error:
                # Only a first trace that failed (no graph: a model that reads a static batch
                # size) falls back; errors of compiling or running are raised as they are.
                if (traced or not self.relaxed or fn.experimental_get_tracing_count() > 0
                        or is_out_of_memory(error)):
                    raise
                self.relaxed = False  # traced per size from now on, the rows' batch fixed
                del self._functions[micro_batches_for(key[0]), key[1]]
                fn = self._run_function(*key)
                fn(*args)
            self._count_program(fn, key, tuple(epoch_rows.shape), traced)
        return fn

    def _count_program(self, fn: Any, key: tuple[int, int], shape: tuple[int, ...],
                       traced: bool) -> None:
        """Count ``fn``'s XLA program at rows of ``shape`` for ``key`` (``traced``: compiled
        from a graph traced before, so not counted by its trace)."""
        with self._count_lock:  # the ahead thread counts too
            self._shapes.add((id(fn), shape))
            if traced:
                note_program(fn)
            self._count_trace(key)

    def put_epoch(self, rows: np.ndarray) -> tf.Tensor:
        """The epoch's index matrix on the device as int32, the dtype the traced calls take."""
        return super().put_epoch(np.asarray(rows, np.int32))

    def _longer_call(self, batch: int, length: int) -> tuple[Any, int] | None:
        """A compiled loop call at ``batch`` longer than ``length`` steps, which can run
        ``length`` (None: none, or written-out calls, whose step count is fixed)."""
        longer = [entry for (size, _), entry in self._sized.items()
                  if size == batch and entry[1] > length and not self.writes_out(entry[1])]
        return min(longer, key=lambda entry: entry[1]) if longer else None

    def compile(self, length: int, epoch_rows: Any) -> float:
        """Compile the ``length``-step call at the rows' batch size if needed; its seconds
        (for a call compiled ahead, only what was left of its compilation; a written-out call
        trains ``length`` steps and puts the variables back; a shorter call than one compiled
        at that size runs that one's program and compiles nothing)."""
        key = (int(epoch_rows.shape[-1]), length)
        if key in self._sized:
            return 0.0
        start = time.perf_counter()
        for size, n in self.ahead.pending():  # this size's calls compiled ahead, taken first
            compiled = self.ahead.take((size, n)) if size == key[0] else None
            if compiled is not None:
                self._sized[size, n] = (compiled, n)
        if key in self._sized:
            return time.perf_counter() - start
        longer = self._longer_call(*key)
        if longer is not None:
            self._sized[key] = longer
        elif self.writes_out(length):
            saved = self.state_copy()
            self._sized[key] = (self._program(key, epoch_rows, length), length)
            self._put_state(saved)
        else:
            self._sized[key] = (self._program(key, epoch_rows, 0), length)
        return time.perf_counter() - start

    def compile_ahead(self, batch: int, length: int, steps: int) -> None:
        """Trace and compile the ``length``-step call at ``batch`` for an epoch of ``steps``
        rows in a background thread (a 0-step call on rows of that shape): ``compile`` then
        takes it. Not for a call whose steps are written out: only a call that trains steps
        compiles it, which cannot run beside training."""
        key = (batch, length)
        if key in self._sized or self.writes_out(length):
            return
        rows = np.zeros((steps, batch), np.int32)
        self.ahead.request(key, lambda: self._program(key, rows, 0))

    def run(self, epoch_rows: Any, start: int, length: int) -> Any:
        batch = int(epoch_rows.shape[-1])
        measure = self._next_call_measures(length)
        call, program_length = self._sized[batch, length]
        outputs = call(self.x_train, self.y_train, epoch_rows, tf.constant(start),
                       tf.constant(length), tf.constant(measure))
        shape = tuple(epoch_rows.shape)
        if (id(call), shape) not in self._shapes:  # rows of a new shape: XLA compiled anew
            self._count_program(call, (batch, program_length), shape, True)
        return batch, length, outputs

    def fetch(self, handle: Any) -> np.ndarray:
        """A call's losses on the host (its first ``length``: a longer call's program may have
        run it); its noise norms kept for ``take_noise_norms``."""
        batch, length, (losses, micro, big) = handle
        micro, big = micro.numpy(), big.numpy()  # sliced on the host, not by eager TF ops
        if self.measure_every <= 1:  # one row per step
            micro, big = micro[:length], big[:length]
        self._keep_norms(batch, micro, big)
        return losses.numpy()[:length]

    def set_learning_rate(self, learning_rate: float) -> None:
        """The rate of the next steps: a Keras variable the compiled programs read."""
        self.optimizer.learning_rate = learning_rate

    def restore_state(self, copy: list[np.ndarray]) -> None:
        """Put back a ``state_copy`` (the knee probe trains; the run starts where it was, its
        first call measured)."""
        self._put_state(copy)
        self._calls = 0


class DataParallelAdaptiveTrainer(SizedCalls, DataParallelTrainer):
    """``--batch-size auto`` on the data-parallel engine (``MirroredStrategy``, one process).

    The replicas' shards are the micro-batches (McCandlish et al. 2018, appendix A), as on JAX
    (``backends.jax.adaptive.DataParallelAdaptiveTrainer``): a replica's gradient of its shard
    and the all-reduced mean are the estimator's two batch sizes, so every step is measured with
    no extra gradient. The plain step (``DataParallelTrainer``) leaves the all-reduce to the
    Keras optimizer, out of the step's reach; here the step all-reduces the replicas' gradients
    itself and this trainer's optimizer is told that they arrive reduced (its
    ``_all_reduce_sum_gradients``, the one place Keras's TF optimizer sums replicas, returns
    them as they are). So the update is the plain step's, with the same one all-reduce, plus
    an all-gather of one scalar per replica; ``test_adaptive_data_parallel`` checks the update
    against the plain step's, so a Keras that reduced elsewhere would fail there.

    A replica's loss is its share of the global batch's mean (``tf.nn.compute_average_loss``),
    so its gradient is 1 / replicas of its shard's mean gradient (the penalty's share
    included): the squared norm kept is ``replicas**2`` times the replica's. Each (global batch
    size, call length) is compiled once (``trace_counts_by_size``); ``fetch`` keeps a call's
    norms (``(K, replicas)`` and ``(K,)``) for ``take_noise_norms``.
    """

    def __init__(self, model: Any, spec: Any, dataset: Any, *, devices: int, batch_size: int,
                 dp_impl: str = "", task: Task = CLASSIFICATION) -> None:
        super().__init__(model, spec, dataset, devices=devices, batch_size=batch_size,
                         dp_impl=dp_impl, task=task)
        self._start_sized()
        if not hasattr(self.optimizer, "_all_reduce_sum_gradients"):
            raise ConfigError("--batch-size auto with data parallelism needs Keras's TF "
                              "optimizer to sum replica gradients in _all_reduce_sum_gradients, "
                              "which this Keras lacks: use KERAS_BACKEND=jax.")
        self.optimizer._all_reduce_sum_gradients = lambda grads_and_vars: grads_and_vars

    def _adaptive_run_fn(self, batch: int, length: int) -> Any:
        loss_and_grads = self._replica_loss_fn(batch)
        model, optimizer, strategy = self.replica_model, self.optimizer, self.strategy
        share = float(self.replicas) ** 2  # a shard's mean gradient is replicas x the replica's

        def replica_step(xs: tf.Tensor, ys: tf.Tensor, i: tf.Tensor) -> tuple[Any, Any, Any]:
            loss, grads = loss_and_grads(xs[i], ys[i])
            grads = [_dense(g, v) for g, v in zip(grads, model.trainable_variables, strict=True)]
            context = tf.distribute.get_replica_context()
            summed = context.all_reduce(tf.distribute.ReduceOp.SUM, grads)
            optimizer.apply(summed, model.trainable_variables)  # reduces nothing again
            return loss, (share * _squared_norm(grads))[None], _squared_norm(summed)

        def run(xs: Any, ys: Any, n_steps: tf.Tensor) -> tuple[tf.Tensor, ...]:
            self._count_trace((batch, length))
            losses = tf.TensorArray(tf.float32, size=n_steps)
            micros = tf.TensorArray(tf.float32, size=n_steps)
            bigs = tf.TensorArray(tf.float32, size=n_steps)
            for i in tf.range(n_steps):
                loss, micro, big = strategy.run(replica_step, args=(xs, ys, i))
                losses = losses.write(i, tf.cast(strategy.reduce("SUM", loss, axis=None),
                                                 tf.float32))
                micros = micros.write(i, strategy.gather(micro, axis=0))
                bigs = bigs.write(i, strategy.experimental_local_results(big)[0])
            return losses.stack(), micros.stack(), bigs.stack()

        return tf.function(run)

    def compile(self, length: int, epoch_rows: np.ndarray) -> float:
        """Trace the ``length``-step call at the rows' global batch size if needed (a 0-step
        call); the seconds it took."""
        key = (int(epoch_rows.shape[-1]), length)
        if key in self._sized:
            return 0.0
        started = time.perf_counter()
        fn = self._adaptive_run_fn(*key)
        fn(*self._batches(epoch_rows, 0, length), tf.constant(0))[0].numpy()
        self._sized[key] = fn
        return time.perf_counter() - started

    def run(self, epoch_rows: np.ndarray, start: int, length: int) -> Any:
        batch = int(epoch_rows.shape[-1])
        return batch, self._sized[batch, length](*self._batches(epoch_rows, start, length),
                                                 tf.constant(length))

    def fetch(self, handle: Any) -> np.ndarray:
        """A call's global-batch losses on the host; its noise norms kept."""
        batch, (losses, micro, big) = handle
        self._keep_norms(batch, micro, big)
        return losses.numpy()

    def set_learning_rate(self, learning_rate: float) -> None:
        """The rate of the next steps: a mirrored variable the traced calls read."""
        self.optimizer.learning_rate = learning_rate

    def _state_variables(self) -> list[Any]:
        return [*self._variables(self.replica_model), *self.optimizer.variables]

    def state_copy(self) -> list[np.ndarray]:
        """A host copy of everything a step changes (every replica holds the same values)."""
        return [np.array(v.numpy()) for v in self._state_variables()]

    def restore_state(self, copy: list[np.ndarray]) -> None:
        for variable, value in zip(self._state_variables(), copy, strict=True):
            variable.assign(value)

    def evaluate_test(self) -> tuple[float, float]:
        """Test loss and metric of the trained values (written into the Keras model)."""
        self.finish()
        return self._evaluator("test")
