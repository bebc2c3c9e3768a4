"""TensorFlow: versions, devices, logical CPU devices, processes, memory and transfers."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import numpy as np
import tensorflow as tf

from kbackend.backends.capabilities import VIRTUAL_DEVICES_ENV
from kbackend.errors import ConfigError


def framework_versions() -> dict[str, str]:
    """Versions of the framework packages behind this backend."""
    return {"tensorflow": tf.__version__}


def start() -> None:
    """Apply ``KBACKEND_VIRTUAL_DEVICES`` before the runtime starts, so every run sees the devices.

    A failure here is reported by ``kbackend.distributed.prepare`` when a run asks for them.
    """
    if os.environ.get(VIRTUAL_DEVICES_ENV):
        with suppress(ConfigError, RuntimeError, ValueError):
            setup_virtual_devices(int(os.environ[VIRTUAL_DEVICES_ENV]))


def set_random_seed(seed: int) -> None:
    """Seed Python, NumPy, TensorFlow and Keras's global seed (``keras.utils.set_random_seed``)."""
    import keras  # deferred: Keras is imported once the backend is chosen

    keras.utils.set_random_seed(seed)


def devices() -> list[dict[str, Any]]:
    """The logical devices computations can run on: kind, platform and id of each."""
    found = []
    for index, device in enumerate(tf.config.list_logical_devices()):
        details = {}
        physical = list(tf.config.list_physical_devices(device.device_type))
        if physical:
            details = tf.config.experimental.get_device_details(physical[0]) or {}
        found.append(
            {
                "id": index,
                "platform": device.device_type.lower(),
                "kind": details.get("device_name", device.device_type),
                "name": device.name,
            }
        )
    return found


def block_until_ready(value: Any) -> Any:
    """TF eager ops are synchronous once their values are read; materialize them."""
    return tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, value)


def to_numpy(value: Any) -> np.ndarray:
    """A NumPy copy of a backend array."""
    return np.asarray(value)


def setup_virtual_devices(count: int) -> None:
    """Split the host CPU into ``count`` logical devices (must run before TF starts its runtime)."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is not None and len(current) == count:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(int(count))])
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        if have == count:
            return
        raise ConfigError(
            f"Cannot create {count} virtual CPU devices: TensorFlow already started with {have}. "
            f"Set {VIRTUAL_DEVICES_ENV}={count} before starting Python."
        ) from None


def compute_devices() -> list[Any]:
    """The logical devices training runs on: the GPUs, else the (logical) CPUs."""
    gpus = tf.config.list_logical_devices("GPU")
    return gpus or tf.config.list_logical_devices("CPU")


def device_count() -> int:
    """How many devices (all processes together) computations can run on."""
    return len(compute_devices())


def local_device_count() -> int:
    """How many devices this process drives."""
    return len(compute_devices())


def platform() -> str:
    """The platform of the devices computations run on (cpu or gpu)."""
    return compute_devices()[0].device_type.lower()


def initialize_processes(coordinator: str, num_processes: int, process_id: int,
                         timeout_s: int, heartbeat_s: int,
                         check_coordinator: Callable[[], None] = lambda: None) -> None:
    """Multi-process training is not available on TensorFlow with Keras 3.15 (raises).

    ``MultiWorkerMirroredStrategy`` starts and connects the workers, but Keras 3.15's TF
    trainer cannot run ``fit`` under it: its symbolic build MEAN-reduces a PerReplica input
    ("Attempt to convert a value (PerReplica...) to a Tensor") and, past that, its
    ``reduce_per_replica`` concatenates scalar metrics across workers ("Invalid reduction
    dimension 0 for input with 0 dimensions"). Single-process ``MirroredStrategy`` works.
    """
    raise ConfigError(
        "Multi-process training needs KERAS_BACKEND=jax: Keras 3.15's TensorFlow trainer fails "
        "under MultiWorkerMirroredStrategy. On TensorFlow use one process with --data-parallel "
        "(MirroredStrategy over the local devices)."
    )


def process_index() -> int:
    """This process's index: always 0 (TF runs single-process jobs, see initialize_processes)."""
    return 0


def process_count() -> int:
    """How many processes the job has: always 1 on TensorFlow."""
    return 1


def _first_gpu() -> str | None:
    gpus = tf.config.list_logical_devices("GPU")
    return gpus[0].name if gpus else None


def device_memory_in_use() -> int | None:
    """Bytes in use on the first GPU, or None where TF does not report it (CPU)."""
    gpu = _first_gpu()
    if gpu is None:
        return None
    return int(tf.config.experimental.get_memory_info(gpu.split("device:")[-1])["current"])


def to_device(batch: Any) -> Any:
    """Copy ``batch`` (a nest of arrays) to the default device as tensors."""
    with tf.device(_first_gpu() or "/CPU:0"):
        return tf.nest.map_structure(tf.identity, tf.nest.map_structure(tf.convert_to_tensor, batch))


def device_scope(platform: str) -> Any:
    """A context manager placing new tensors and ops on the first ``platform`` device."""
    return tf.device(f"/{platform.upper()}:0")


_JIT_FUNCTIONS: weakref.WeakSet = weakref.WeakSet()


def jit_function(fn: Any) -> Any:
    """``tf.function(fn, jit_compile=True)``, registered so ``compilation_counter`` sees its
    traces (each trace of an XLA-compiled function is one XLA program)."""
    function = tf.function(fn, jit_compile=True)
    _JIT_FUNCTIONS.add(function)
    return function


def _traces() -> int:
    return sum(f.experimental_get_tracing_count() for f in list(_JIT_FUNCTIONS))


@contextmanager
def compilation_counter() -> Iterator[dict[str, Any]]:
    """Counts the XLA programs compiled inside the block: on TensorFlow, new traces of
    kbackend's jit-compiled functions (``jit_function``; TF exposes no process-wide compile
    hook, so programs Keras compiles on its own are not seen)."""
    counts: dict[str, Any] = {"programs": 0, "counted": "traces of kbackend's XLA functions"}
    before = _traces()
    try:
        yield counts
    finally:
        counts["programs"] = _traces() - before
