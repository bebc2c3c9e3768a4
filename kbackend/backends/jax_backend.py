"""JAX implementations of kbackend's backend-specific operations."""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np


def framework_versions() -> dict[str, str]:
    """Versions of the framework packages behind this backend."""
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__}


def devices() -> list[dict[str, Any]]:
    """The devices computations can run on: kind, platform and id of each."""
    return [
        {"id": d.id, "platform": d.platform, "kind": d.device_kind, "process": d.process_index}
        for d in jax.devices()
    ]


def block_until_ready(value: Any) -> Any:
    """Wait for every array in ``value`` to be computed (for honest timing)."""
    return jax.block_until_ready(value)


def to_numpy(value: Any) -> np.ndarray:
    """A NumPy copy of a backend array."""
    return np.asarray(value)


def supports_channels_first_conv() -> bool:
    """XLA on every JAX platform implements NCHW convolutions."""
    return True


def native_trainer(model: Any, spec: Any, dataset: Any) -> Any:
    """The fused native train loop for this backend (driven by ``kbackend.engines.native``)."""
    from kbackend.backends.jax_native import NativeTrainer

    return NativeTrainer(model, spec, dataset)


# --- parallel (issue 6) ---
# Device counts, virtual devices, data-parallel scopes and multi-process start-up for JAX.
# kbackend.parallel calls these through ``impl()``; tf_backend has the same functions.

import os as _os  # noqa: E402
from collections.abc import Iterator as _Iterator  # noqa: E402
from contextlib import contextmanager as _contextmanager  # noqa: E402

VIRTUAL_DEVICES_ENV = "KBACKEND_VIRTUAL_DEVICES"


def _backends_initialized() -> bool:
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())


def setup_virtual_devices(count: int) -> None:
    """Split the host CPU into ``count`` virtual devices (must run before JAX starts its runtime).

    The JAX equivalent of ``XLA_FLAGS=--xla_force_host_platform_device_count=N``. A no-op when the
    runtime already has ``count`` CPU devices; an error when it started with a different number.
    """
    from kbackend.errors import ConfigError

    if _backends_initialized():
        have = len(jax.devices("cpu"))
        if have != count:
            raise ConfigError(
                f"Cannot create {count} virtual CPU devices: JAX already started with {have}. "
                f"Set {VIRTUAL_DEVICES_ENV}={count} (or JAX_NUM_CPU_DEVICES={count}) before starting Python."
            )
        return
    jax.config.update("jax_num_cpu_devices", int(count))


def device_count() -> int:
    """How many devices (all processes together) computations can run on."""
    return jax.device_count()


def local_device_count() -> int:
    """How many devices this process drives."""
    return jax.local_device_count()


def platform() -> str:
    """The platform of the default devices (cpu, gpu, tpu)."""
    return jax.devices()[0].platform


@_contextmanager
def data_parallel_scope(count: int) -> _Iterator[Any]:
    """A scope in which Keras models built, compiled and fit run data parallel on ``count`` devices.

    ``keras.distribution.DataParallel``: variables replicated, every batch split along its first
    axis across the devices, gradients reduced by XLA's SPMD partitioner.
    """
    import keras

    distribution = keras.distribution.DataParallel(devices=jax.devices()[:count])
    # In a multi-process job each process already feeds its own block (keras_fit_inputs).
    distribution.auto_shard_dataset = False
    with distribution.scope():
        yield distribution


def initialize_processes(coordinator: str, num_processes: int, process_id: int,
                         timeout_s: int, heartbeat_s: int) -> None:
    """Join a ``num_processes``-process job (``jax.distributed``; gloo collectives on CPU).

    Process 0 hosts the coordination service at ``coordinator``. A process that cannot reach it
    within ``timeout_s`` raises; a process that stops sending heartbeats for ``heartbeat_s`` makes
    the coordination service stop the others.
    """
    from kbackend.errors import ConfigError
    from kbackend.parallel import check_coordinator

    if jax.distributed.is_initialized():
        return
    check_coordinator(coordinator, process_id, num_processes, timeout_s)
    if _backends_initialized():
        raise ConfigError("Multi-process training must start before JAX runs anything in this process.")
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
            initialization_timeout=int(timeout_s), heartbeat_timeout_seconds=int(heartbeat_s),
            shutdown_timeout_seconds=int(timeout_s),
        )
        jax.devices()  # connect now, so an unreachable coordinator fails here, after the timeout
    except Exception as error:  # jax raises XlaRuntimeError / RuntimeError with long C++ text
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(
            f"Process {process_id} of {num_processes} could not join the job at coordinator "
            f"{coordinator} within {timeout_s}s: {first_line[:300]}. Is process 0 running and the "
            "address reachable?"
        ) from None


def process_index() -> int:
    """This process's index in a multi-process job (0 when alone)."""
    return jax.process_index()


def process_count() -> int:
    """How many processes the job has (1 when alone)."""
    return jax.process_count()


def native_data_parallel_train(model: Any, dataset: Any, spec: Any, config: Any,
                               reporter: Any = None) -> Any:
    """The pmap-style native data-parallel engine (``jax.shard_map``, ``lax.pmean``)."""
    from kbackend.parallel.jax_engine import train

    return train(model, dataset, spec, config, reporter)


if _os.environ.get(VIRTUAL_DEVICES_ENV) and not _backends_initialized():
    # Honour the request as early as possible, so ``kbackend info`` and every run see the devices.
    jax.config.update("jax_num_cpu_devices", int(_os.environ[VIRTUAL_DEVICES_ENV]))


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
    return layer.__class__.from_config(layer.get_config())



def training_gradients(model: Any, x: Any, y: Any) -> tuple[Any, list[Any]]:
    """One training-mode loss and its gradients for a compiled Keras model (backend arrays).

    Differentiates Keras' own stateless loss (``compute_loss_and_updates``, what ``fit``
    differentiates on JAX; regularization losses count), jitted once per model, and writes the
    updated non-trainable state (BatchNormalization's moving statistics) back as a train step
    does. Gradients come in the order of ``model.trainable_variables``.
    """
    grad_fn = getattr(model, "_kbackend_grad_fn", None)
    if grad_fn is None:
        loss_fn = functools.partial(model.compute_loss_and_updates, training=True)
        grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
        model._kbackend_grad_fn = grad_fn  # lives and dies with the model
    (loss, aux), grads = grad_fn(
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.metrics_variables],
        x, y, None,
        optimizer_variables=[v.value for v in model.optimizer.variables],
    )
    for variable, value in zip(model.non_trainable_variables, aux[2], strict=True):
        variable.assign(value)
    return loss, list(grads)


def loss_and_gradients(model: Any, x: Any, y: Any) -> tuple[float, list[np.ndarray]]:
    """``training_gradients`` as a float and NumPy arrays (state updates applied, see there)."""
    loss, grads = training_gradients(model, x, y)
    return float(loss), [np.asarray(g) for g in grads]


def bias_add_misroutes(model: Any, x: Any) -> list[str]:
    """Always empty: JAX's ``add`` broadcasts and never guesses a bias axis (see tf_backend)."""
    return []


# --- study (issue 4) ---
_GRADIENT_FUNCTIONS: Any = None


def batch_gradients(model: Any, x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """Gradient of the mean sparse categorical cross-entropy of ``model`` on the batch ``(x, y)``
    with respect to its trainable variables, one NumPy array per variable.

    The forward pass runs with ``training=False`` (no dropout noise, batch-norm moving
    statistics), so the gradient is a function of the weights and the batch alone. One jitted
    function per model, compiled once per batch shape.
    """
    import weakref

    import keras

    global _GRADIENT_FUNCTIONS
    if _GRADIENT_FUNCTIONS is None:
        _GRADIENT_FUNCTIONS = weakref.WeakKeyDictionary()
    gradient = _GRADIENT_FUNCTIONS.get(model)
    if gradient is None:
        def mean_loss(trainable, non_trainable, inputs, labels):
            probabilities, _ = model.stateless_call(trainable, non_trainable, inputs, training=False)
            return jax.numpy.mean(keras.losses.sparse_categorical_crossentropy(labels, probabilities))

        gradient = jax.jit(jax.grad(mean_loss))
        _GRADIENT_FUNCTIONS[model] = gradient
    grads = gradient([v.value for v in model.trainable_variables],
                     [v.value for v in model.non_trainable_variables],
                     jax.numpy.asarray(x), jax.numpy.asarray(y))
    return [np.asarray(g) for g in grads]


# --- hardware (issue 7) ---
# Device memory, device transfer, mixed-precision support and matmul peak, used by
# kbackend.hardware (monitor, benchmarks, advise). tf_backend.py has the same functions.


def device_memory_in_use() -> int | None:
    """Bytes in use on the first device, or None where the platform does not report it (CPU)."""
    stats = jax.devices()[0].memory_stats()
    if not stats or "bytes_in_use" not in stats:
        return None
    return int(stats["bytes_in_use"])


def to_device(batch: Any) -> Any:
    """Start copying ``batch`` (a pytree of arrays) to the default device; returns at once."""
    return jax.device_put(batch)


def device_scope(platform: str) -> Any:
    """A context manager placing new arrays and computations on the first ``platform`` device."""
    return jax.default_device(jax.devices(platform)[0])


def precision_support() -> dict[str, dict[str, bool]]:
    """For each Keras dtype policy: whether it runs here and whether the hardware accelerates it."""
    from kbackend.hardware.device import cpu_accelerates, gpu_accelerates

    platform = jax.devices()[0].platform
    result = {}
    for policy, dtype in (("mixed_bfloat16", jax.numpy.bfloat16), ("mixed_float16", jax.numpy.float16)):
        try:
            x = jax.numpy.ones((8, 8), dtype)
            jax.block_until_ready(x @ x)
            runs = True
        except Exception:  # an unsupported dtype fails in many ways across platforms
            runs = False
        if platform == "gpu":
            accelerated = gpu_accelerates(policy, getattr(jax.devices()[0], "compute_capability", None))
        else:
            accelerated = (platform == "tpu" and policy == "mixed_bfloat16") or (
                platform == "cpu" and cpu_accelerates(policy))
        result[policy] = {"runs": runs, "accelerated": bool(runs and accelerated)}
    result["float32"] = {"runs": True, "accelerated": True}
    return result


def matmul_flops(n: int = 1024, dtype: str = "float32", repeats: int = 10,
                 jit: bool = True) -> dict[str, float]:
    """Measured FLOP/s of an ``n x n`` matmul (jitted or op by op): median over ``repeats`` calls."""
    import time

    import jax.numpy as jnp

    key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(key_a, (n, n), dtype=dtype)
    b = jax.random.normal(key_b, (n, n), dtype=dtype)
    matmul = jax.jit(jnp.matmul) if jit else jnp.matmul
    start = time.perf_counter()
    jax.block_until_ready(matmul(a, b))
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(matmul(a, b))
        times.append(time.perf_counter() - start)
    median = float(np.median(times))
    return {"n": n, "dtype": dtype, "jit": jit, "median_s": median, "flops": 2.0 * n**3 / median,
            "best_flops": 2.0 * n**3 / min(times), "compile_s": compile_s}
