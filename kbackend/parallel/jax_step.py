"""The pmap-style data-parallel train step for JAX, as a pure function ``(state, batch) -> (state, metrics)``.

Semantics (those of ``jax.pmap`` with a named axis, written with ``jax.shard_map``):

- the global batch ``(K, B, ...)`` of K fused steps is split along B into equal per-device shards
  (``PartitionSpec(None, "batch")``); the state is replicated (``PartitionSpec()``);
- every device computes the loss and gradients of its shard; ``lax.pmean`` over ``"batch"`` turns
  the per-shard mean gradients into the gradient of the global-batch mean loss (shards are equal);
- BatchNormalization computes its batch statistics across all shards (``synced_batch_norm``), so
  normalization, moving statistics and gradients are those of the single-device global batch;
- every device applies the same optax update to the same parameters, so they stay identical;
- ``lax.scan`` runs K steps inside one compiled call.

With ``mesh=None`` the same code runs without any collective: the single-device reference.
The step itself (state, loss, sync BN) is the one shared with the single-device native engine,
``kbackend.backends.jax_step``; this module adds the mesh, the sharding and ``shard_map``/``pmap``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kbackend.backends.jax_step import (  # noqa: F401 (re-exported: the parallel step's API)
    StepMetrics,
    TrainState,
    initial_state,
    make_step,
    synced_batch_norm,
)

AXIS = "batch"


def make_step_body(model: Any, tx: Any, axis_name: str | None) -> Callable[..., Any]:
    """K fused steps ``(state, (xs, ys)) -> (state, StepMetrics)`` on one device's shard.

    With ``axis_name`` the gradients, metrics and BatchNorm statistics are averaged over that
    axis (run it under ``shard_map`` / ``pmap``); without it this is the single-device step.
    """
    one_step = make_step(model, tx, axis_name)

    def fused_steps(state: TrainState, batches: tuple[Any, Any]) -> tuple[TrainState, StepMetrics]:
        return lax.scan(one_step, state, batches)

    return fused_steps


def make_mesh(devices: list[Any]) -> Mesh:
    """A one-axis mesh named ``"batch"`` over ``devices``."""
    return Mesh(np.asarray(devices), (AXIS,))


def make_train_step(model: Any, tx: Any, mesh: Mesh | None = None,
                    impl: str = "shard_map") -> Callable[..., Any]:
    """The jitted train step ``(state, (xs, ys)) -> (state, StepMetrics)``; the state is donated.

    ``mesh=None``: single device, no collectives. ``impl="shard_map"``: ``xs`` of shape
    ``(K, B, ...)`` sharded along B over the mesh (see ``shard_batch``), state replicated
    (``replicate``). ``impl="pmap"``: the same body under ``jax.pmap``; state and batches carry a
    leading device axis (``replicate_for_pmap``, ``split_for_pmap``).
    """
    if mesh is None:
        return jax.jit(make_step_body(model, tx, None), donate_argnums=0)
    body = make_step_body(model, tx, AXIS)
    if impl == "pmap":
        return jax.pmap(body, axis_name=AXIS, devices=list(mesh.devices.flat), donate_argnums=0)
    # check_vma=False: pmap semantics, where gradients of replicated parameters are per-device
    # values that the body averages explicitly with lax.pmean.
    sharded = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(None, AXIS)),
                            out_specs=(P(), P()), check_vma=False)
    return jax.jit(sharded, donate_argnums=0)


def replicate(value: Any, mesh: Mesh) -> Any:
    """Place ``value`` (a pytree of host or device arrays, equal in every process) on every device."""
    sharding = NamedSharding(mesh, P())

    def put(leaf: Any) -> Any:
        host = np.asarray(leaf)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, value)


def shard_batch(local: Any, mesh: Mesh) -> Any:
    """Assemble global ``(K, B, ...)`` arrays from this process's rows ``(K, B / processes, ...)``."""
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
