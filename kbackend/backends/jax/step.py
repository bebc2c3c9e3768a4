"""The one JAX train step: Keras's stateless API, ``jax.value_and_grad`` and an optax transform.

Both JAX engines build on this module: the single-device native engine (``native.py``, batches
gathered on the device) and the data-parallel engine (``data_parallel.py``, batches sharded over
a mesh). A step is a pure function ``(state, (x, y)) -> (state, StepMetrics)``; with an axis name
it runs per shard under ``shard_map`` / ``pmap`` and averages gradients, metrics and BatchNorm
statistics over that axis.

The data-parallel semantics (those of ``jax.pmap`` with a named axis, written with
``jax.shard_map``):

- the global batch ``(K, B, ...)`` of K fused steps is split along B into equal per-device shards
  (``PartitionSpec(None, "batch")``); the state is replicated (``PartitionSpec()``);
- every device computes the loss and gradients of its shard; ``lax.pmean`` over ``"batch"`` turns
  the per-shard mean gradients into the gradient of the global-batch mean loss (shards are equal);
- BatchNormalization computes its batch statistics across all shards (``synced_batch_norm``), so
  normalization, moving statistics and gradients are those of the single-device global batch;
- every device applies the same optax update to the same parameters, so they stay identical;
- ``lax.scan`` runs K steps inside one compiled call (written out instead where a loop would be
  slow: conv models on a CPU, ``scan_steps``).

With ``mesh=None`` the same code runs without any collective: the single-device reference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kbackend.backends import capabilities
from kbackend.backends.jax.optimizers import KerasOptState, to_optax
from kbackend.task import CLASSIFICATION, Task

AXIS = "batch"


class TrainState(NamedTuple):
    """Everything a train step changes: the model's values and the optimizer's state."""

    trainable: list[Any]
    non_trainable: list[Any]  # BatchNorm statistics, dropout seed-generator state, ...
    opt_state: Any


class StepMetrics(NamedTuple):
    """Metrics of one step's (global) batch; shape ``(K,)`` after K fused steps. ``metric`` is
    the task's (``Task.metric``: accuracy for classifiers, an error for regression)."""

    loss: Any
    metric: Any


def initial_state(model: Any, tx: Any, spec: Any = None) -> TrainState:
    """The state of a built Keras model and a fresh optax state for ``tx`` (``to_optax(spec)``
    when ``spec``, an ``OptimizerSpec``, is given: its init is then shared, ``fresh_opt_state``).

    The values are copies: steps donate the state's buffers, the Keras variables keep theirs.
    The copies go through the host (``jnp.array`` would compile a copy program per shape) and
    the optimizer state is made by one compiled program (eager ``zeros_like`` compiles one per
    shape): a native run then compiles only what it runs.
    """
    trainable = [jax.device_put(np.asarray(v.value)) for v in model.trainable_variables]
    non_trainable = [jax.device_put(np.asarray(v.value)) for v in model.non_trainable_variables]
    if spec is not None:
        opt_state = fresh_opt_state(spec, trainable)
    else:
        opt_state = jax.jit(tx.init)(trainable)
    return TrainState(trainable, non_trainable, opt_state)


@functools.cache
def _compiled_init(spec: Any, members: bool) -> Any:
    init = to_optax(spec).init
    return jax.jit(jax.vmap(init) if members else init)


def fresh_opt_state(spec: Any, params: Any, learning_rate: Any = None, *,
                    members: bool = False) -> Any:
    """A fresh state of ``spec``'s optimizer (``optimizers.to_optax``) for ``params``, at
    base rate ``learning_rate`` (default ``spec``'s; with ``members``, the params are stacked
    along a leading member axis and the rate is one per member).

    The init depends on the optimizer alone (zero slots, a zero count; the base rate is state,
    ``KerasOptState.learning_rate``), not on the rate or the step budget, so one compiled init
    serves every cell of a study that uses that optimizer, not one compilation per trainer.
    """
    shared = replace(spec, learning_rate=1.0, decay_steps=None)
    rate = spec.learning_rate if learning_rate is None else learning_rate
    return _compiled_init(shared, members)(params)._replace(
        learning_rate=jnp.asarray(rate, jnp.float32))


def mean_loss(task: Task, labels: Any, outputs: Any) -> Any:
    """``task``'s loss over a batch, reduced as ``compile`` reduces it (sum over batch size)."""
    per_sample = task.per_sample_loss(labels, outputs)
    return jnp.sum(per_sample) / per_sample.shape[0]


def total_loss(data_loss: Any, extra_losses: list[Any]) -> Any:
    """Data loss plus regularization losses, summed as ``keras.Model.compute_loss`` does."""
    if not extra_losses:
        return data_loss
    return jnp.sum(jnp.stack([data_loss, *(jnp.sum(loss) for loss in extra_losses)]))


def make_loss_fn(model: Any, task: Task = CLASSIFICATION) -> Callable[..., Any]:
    """``loss(trainable, non_trainable, x, y) -> (loss, (non_trainable, metric))``.

    The loss Keras ``fit`` minimizes for the model compiled with ``task.loss``
    (``train_on_batch`` reports the same number): the mean of the task's loss plus the layers'
    regularization losses; ``metric`` is the batch mean of ``task.metric``.
    """

    def loss_fn(trainable: list, non_trainable: list, x: Any, y: Any) -> tuple[Any, Any]:
        outputs, non_trainable, extra_losses = model.stateless_call(
            trainable, non_trainable, x, training=True, return_losses=True)
        loss = total_loss(mean_loss(task, y, outputs), extra_losses)
        metric = jnp.mean(task.per_sample_metric(y, outputs))
        return loss, (non_trainable, metric)

    return loss_fn


def _synced_moments(layer: Any, axis_name: str) -> Callable[..., Any]:
    """BatchNormalization moments over the whole batch, all shards together (sync BN).

    Two collectives, both exact for equal shards: the global mean is the mean of shard means;
    the global variance is the mean over shards of the shard's mean squared deviation from the
    *global* mean. This is the same two-pass formula ``jnp.var`` uses on one device.
    """

    def moments(inputs: Any, mask: Any) -> tuple[Any, Any]:
        if mask is not None:
            raise NotImplementedError("Synchronized BatchNormalization with a mask is not "
                                      "supported.")
        axes = tuple(layer._reduction_axes)
        x = inputs.astype(jnp.float32) if inputs.dtype in (jnp.float16, jnp.bfloat16) else inputs
        mean = lax.pmean(jnp.mean(x, axes, keepdims=True), axis_name)
        variance = lax.pmean(jnp.mean(jnp.square(x - mean), axes, keepdims=True), axis_name)
        return (jnp.squeeze(mean, axes).astype(inputs.dtype),
                jnp.squeeze(variance, axes).astype(inputs.dtype))

    return moments


@contextmanager
def synced_batch_norm(model: Any, axis_name: str | None) -> Iterator[None]:
    """While tracing inside ``shard_map``, make every BatchNormalization layer use global moments.

    A layer-level hook: ``BatchNormalization._moments`` is replaced on the instances for the
    duration of the trace and restored afterwards. Does nothing without an axis.
    """
    if axis_name is None:
        yield
        return
    import keras  # deferred: Keras is imported once the backend is chosen

    layers = [layer for layer in model._flatten_layers()
              if isinstance(layer, keras.layers.BatchNormalization)]
    for layer in layers:
        object.__setattr__(layer, "_moments", _synced_moments(layer, axis_name))
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("_moments", None)


def make_step(model: Any, tx: Any, axis_name: str | None = None,
              task: Task = CLASSIFICATION,
              observe: Callable[[Any, Any], Any] | None = None,
              value_and_grad: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """One train step ``(state, (x, y)) -> (state, StepMetrics)`` with optax transform ``tx``.

    Without ``axis_name`` this is the single-device step. With it, the step runs on one
    device's shard (under ``shard_map`` / ``pmap``): BatchNorm statistics are those of the whole
    batch, and gradients and metrics are averaged over the axis, which for equal shards gives
    the gradient and loss of the global-batch mean.

    ``observe(shard_grads, mean_grads)``, if given, sees this device's gradients and their mean
    over the axis (the update's) and its value is returned beside the metrics: ``(state,
    (StepMetrics, observed))``; the update is the same (``--batch-size auto`` data parallel).

    ``value_and_grad(trainable, non_trainable, x, y) -> ((loss, (non_trainable, metric)),
    grads, observed)``, if given, replaces the gradient of ``make_loss_fn``; what it observed is
    returned beside the metrics as ``observe``'s (``--batch-size auto``'s micro-batched
    gradients and their noise norms, ``backends.jax.adaptive``).
    """
    if value_and_grad is None:
        plain = jax.value_and_grad(make_loss_fn(model, task), has_aux=True)

        def value_and_grad(*args: Any) -> Any:
            return (*plain(*args), None)

        observes = observe is not None
    else:
        observes = True

    def mean_over_devices(value: Any) -> Any:
        return value if axis_name is None else lax.pmean(value, axis_name)

    def step(state: TrainState, batch: tuple[Any, Any]) -> tuple[TrainState, Any]:
        x, y = batch
        with synced_batch_norm(model, axis_name):
            (loss, (non_trainable, metric)), grads, observed = value_and_grad(
                state.trainable, state.non_trainable, x, y)
        shard_grads, grads = grads, mean_over_devices(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.trainable)
        trainable = optax.apply_updates(state.trainable, updates)
        metrics = StepMetrics(mean_over_devices(loss), mean_over_devices(metric))
        new_state = TrainState(trainable, non_trainable, opt_state)
        if observe is not None:
            observed = observe(shard_grads, grads)
        return (new_state, (metrics, observed)) if observes else (new_state, metrics)

    return step


def unrolls_its_loop(model: Any) -> bool:
    """``capabilities.unrolls_its_loop`` on JAX's default platform (conv models on a CPU)."""
    return capabilities.unrolls_its_loop(model, jax.default_backend())


def scan_steps(body: Any, state: Any, xs: Any, unroll: bool) -> tuple[Any, Any]:
    """``lax.scan(body, state, xs)``, or with ``unroll`` the same steps written out one after
    another (no while loop at all: ``lax.scan``'s ``unroll`` still leaves a one-trip loop)."""
    if not unroll:
        return lax.scan(body, state, xs)
    outputs = []
    for index in range(jax.tree.leaves(xs)[0].shape[0]):
        state, output = body(state, jax.tree.map(lambda leaf, i=index: leaf[i], xs))
        outputs.append(output)
    return state, jax.tree.map(lambda *values: jnp.stack(values), *outputs)


def make_step_body(model: Any, tx: Any, axis_name: str | None,
                   unroll: bool = False, task: Task = CLASSIFICATION,
                   observe: Callable[[Any, Any], Any] | None = None) -> Callable[..., Any]:
    """K fused steps ``(state, (xs, ys)) -> (state, StepMetrics)`` on one device's shard.

    With ``axis_name`` the gradients, metrics and BatchNorm statistics are averaged over that
    axis (run it under ``shard_map`` / ``pmap``); without it this is the single-device step.
    ``unroll`` writes the K steps out instead of looping (``scan_steps``); ``observe``: as
    ``make_step``'s (its values stacked over the K steps).
    """
    one_step = make_step(model, tx, axis_name, task, observe)

    def fused_steps(state: TrainState, batches: tuple[Any, Any]) -> tuple[TrainState, StepMetrics]:
        return scan_steps(one_step, state, batches, unroll)

    return fused_steps


def make_mesh(devices: list[Any]) -> Mesh:
    """A one-axis mesh named ``"batch"`` over ``devices``."""
    return Mesh(np.asarray(devices), (AXIS,))


def make_train_step(model: Any, tx: Any, mesh: Mesh | None = None,
                    impl: str = "shard_map", unroll: bool = False,
                    task: Task = CLASSIFICATION,
                    observe: Callable[[Any, Any], Any] | None = None,
                    observed_spec: Any = None) -> jax.stages.Wrapped:
    """The jitted train step ``(state, (xs, ys)) -> (state, StepMetrics)``; the state is donated.

    ``mesh=None``: single device, no collectives. ``impl="shard_map"``: ``xs`` of shape
    ``(K, B, ...)`` sharded along B over the mesh (see ``shard_batch``), state replicated
    (``replicate``). ``impl="pmap"``: the same body under ``jax.pmap``; state and batches carry a
    leading device axis (``replicate_for_pmap``, ``split_for_pmap``). ``unroll``: the K steps
    written out, not looped (``unrolls_its_loop``). ``observe``: as ``make_step``'s;
    ``observed_spec`` the ``PartitionSpec`` (tree) of its values stacked over the K steps under
    ``shard_map`` (default replicated, ``P()``); under pmap every device's values come back.
    """
    if mesh is None:
        return jax.jit(make_step_body(model, tx, None, unroll, task, observe), donate_argnums=0)
    body = make_step_body(model, tx, AXIS, unroll, task, observe)
    if impl == "pmap":
        return jax.pmap(body, axis_name=AXIS, devices=list(mesh.devices.flat), donate_argnums=0)
    # check_vma=False: pmap semantics, where gradients of replicated parameters are per-device
    # values that the body averages explicitly with lax.pmean.
    outputs = P() if observe is None else (P(), P() if observed_spec is None else observed_spec)
    sharded = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(None, AXIS)),
                            out_specs=(P(), outputs), check_vma=False)
    return jax.jit(sharded, donate_argnums=0)


def replicate(value: Any, mesh: Mesh) -> Any:
    """Place ``value`` (a pytree of host or device arrays, equal in every process) on every
    device."""
    sharding = NamedSharding(mesh, P())

    def put(leaf: Any) -> Any:
        host = np.asarray(leaf)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, value)


def shard_batch(local: Any, mesh: Mesh) -> Any:
    """Assemble global ``(K, B, ...)`` arrays from this process's rows
    ``(K, B / processes, ...)``."""
    sharding = NamedSharding(mesh, P(None, AXIS))
    processes = jax.process_count()

    def put(leaf: Any) -> Any:
        host = np.asarray(leaf)
        global_shape = (host.shape[0], host.shape[1] * processes, *host.shape[2:])
        return jax.make_array_from_process_local_data(sharding, host, global_shape)

    return jax.tree.map(put, local)


def replicate_for_pmap(value: Any, count: int) -> Any:
    """``value`` stacked once per device, as ``jax.pmap`` takes replicated arguments."""
    return jax.tree.map(lambda leaf: np.stack([np.asarray(leaf)] * count), value)


def split_for_pmap(batch: Any, count: int) -> Any:
    """``(K, B, ...)`` -> ``(devices, K, B / devices, ...)``: device d gets rows d*b .. (d+1)*b."""
    def split(leaf: Any) -> Any:
        host = np.asarray(leaf)
        k, b = host.shape[0], host.shape[1]
        return np.swapaxes(host.reshape(k, count, b // count, *host.shape[2:]), 0, 1)

    return jax.tree.map(split, batch)


def to_host(value: Any) -> Any:
    """NumPy copies of replicated arrays (this process's copy; works in multi-process jobs)."""
    def fetch(leaf: Any) -> Any:
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            return np.asarray(leaf.addressable_data(0))
        return np.asarray(leaf)

    return jax.tree.map(fetch, value)


# Where Keras 3.15's optimizers keep their slots, per trainable variable, in the order of
# ``KerasOptState``'s: SGD(momentum) ``momentums``; Adam and AdamW ``_momentums`` and
# ``_velocities``.
_KERAS_SLOTS = {"momentum": ("momentums", "_momentums"), "velocity": ("_velocities",)}


def write_state(model: Any, state: TrainState) -> None:
    """A run's ``state`` (host or device) into the Keras ``model``: its variables, and the
    optimizer state into the model's optimizer (``spec.to_keras()``, which
    ``engines.keras_fit.compile_model`` gave it), as Keras's own ``fit`` leaves it:
    ``iterations`` the updates applied, each slot (velocity, Adam's moments) per variable. A
    model saved after a native run then resumes training where the run stopped."""
    pairs = [*zip(model.trainable_variables, state.trainable, strict=True),
             *zip(model.non_trainable_variables, state.non_trainable, strict=True)]
    for variable, value in pairs:
        variable.assign(value)
    opt_state = state.opt_state
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not isinstance(opt_state, KerasOptState):
        return
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # a loss-scale wrapper's own
    if not inner.built:
        inner.build(model.trainable_variables)
    for target in {id(optimizer): optimizer, id(inner): inner}.values():
        target.iterations.assign(np.asarray(opt_state.count))
    for field, names in _KERAS_SLOTS.items():
        values = getattr(opt_state, field)
        slots: list[Any] = next((getattr(inner, name) for name in names
                                 if getattr(inner, name, None)), [])
        if len(values) == 0 or not slots:  # sgd's (): no slot
            continue
        for slot, value in zip(slots, values, strict=True):
            slot.assign(np.asarray(value))
