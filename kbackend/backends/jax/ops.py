"""JAX: versions, devices, virtual CPU devices, multi-process start-up, memory and transfers."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import jax
import jaxlib
import numpy as np
from jax._src import xla_bridge

from kbackend.backends.capabilities import VIRTUAL_DEVICES_ENV
from kbackend.backends.compile_cache import COMPILE_CACHE_MAX_BYTES, compile_cache_folder
from kbackend.errors import ConfigError


def framework_versions() -> dict[str, str]:
    """Versions of the framework packages behind this backend."""
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__}


def start() -> None:
    """Apply ``KBACKEND_VIRTUAL_DEVICES`` before the runtime starts, so every run sees the devices,
    and turn on the persistent compilation cache (``kbackend.backends.compile_cache``)."""
    if os.environ.get(VIRTUAL_DEVICES_ENV) and not _backends_initialized():
        jax.config.update("jax_num_cpu_devices", int(os.environ[VIRTUAL_DEVICES_ENV]))
    folder = compile_cache_folder("jax")
    # jax's Config defines its options' attributes at run time (its stubs declare none)
    cache_dir = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]
    if folder is not None and cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(folder))
        # Small programs too: kbackend's are mostly sub-second compiles, paid in every process.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        # A size bound makes JAX lock the folder around reads and writes (concurrent processes).
        jax.config.update("jax_compilation_cache_max_size", COMPILE_CACHE_MAX_BYTES)


def set_random_seed(seed: int) -> None:
    """Seed Python, NumPy and Keras's global seed, as ``keras.utils.set_random_seed`` does.

    Keras's own function also seeds TensorFlow whenever it is installed, which imports it
    (seconds of start-up and its C++ logs) in a JAX process that never uses it.
    """
    from keras.src.backend.common import global_state  # deferred: Keras after the backend choice
    from keras.src.random import seed_generator  # deferred: as above
    from keras.src.utils import rng_utils  # deferred: as above

    global_state.set_global_attribute(rng_utils.GLOBAL_RANDOM_SEED, seed)
    global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, None)
    random.seed(seed)
    np.random.seed(seed)


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


def _backends_initialized() -> bool:
    return bool(xla_bridge.backends_are_initialized())


def setup_virtual_devices(count: int) -> None:
    """Split the host CPU into ``count`` virtual devices (must run before JAX starts its runtime).

    The JAX equivalent of ``XLA_FLAGS=--xla_force_host_platform_device_count=N``. A no-op when the
    runtime already has ``count`` CPU devices; an error when it started with a different number.
    """
    if _backends_initialized():
        have = len(jax.devices("cpu"))
        if have != count:
            raise ConfigError(
                f"Cannot create {count} virtual CPU devices: JAX already started with {have}. "
                f"Set {VIRTUAL_DEVICES_ENV}={count} (or JAX_NUM_CPU_DEVICES={count}) before "
                "starting Python."
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


def initialize_processes(coordinator: str, num_processes: int, process_id: int,
                         timeout_s: int, heartbeat_s: int,
                         check_coordinator: Callable[[], None] = lambda: None) -> None:
    """Join a ``num_processes``-process job (``jax.distributed``; gloo collectives on CPU).

    Process 0 hosts the coordination service at ``coordinator``; ``check_coordinator`` raises a
    clear error first where it cannot work (the framework's own client would abort). A process
    that cannot join within ``timeout_s`` raises; a process that stops sending heartbeats for
    ``heartbeat_s`` makes the coordination service stop the others.
    """
    if jax.distributed.is_initialized():
        return
    check_coordinator()
    if _backends_initialized():
        raise ConfigError("Multi-process training must start before JAX runs anything in this "
                          "process.")
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
            initialization_timeout=int(timeout_s), heartbeat_timeout_seconds=int(heartbeat_s),
            shutdown_timeout_seconds=int(timeout_s),
        )
        jax.devices()  # connect now, so an unreachable coordinator fails here, after the timeout
    except Exception as error:  # jax raises XlaRuntimeError / RuntimeError with long C++ text
        text = str(error).strip()
        first_line = text.splitlines()[0] if text else type(error).__name__
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


_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # a program loaded, not compiled


@contextmanager
def compilation_counter() -> Iterator[dict[str, Any]]:
    """Counts the XLA programs built inside the block (JAX's backend-compile event: compiled
    or loaded from the persistent cache), how many of them were loaded (``from_cache``), and
    the seconds they took."""
    counts: dict[str, Any] = {"programs": 0, "from_cache": 0, "seconds": 0.0,
                              "counted": "JAX backend compilations"}

    def listener(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == _BACKEND_COMPILE_EVENT:
            counts["programs"] += 1
            counts["seconds"] += duration_secs

    def cache_hit(event: str, **kwargs: Any) -> None:
        if event == _CACHE_HIT_EVENT:
            counts["from_cache"] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    jax.monitoring.register_event_listener(cache_hit)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        jax.monitoring.unregister_event_listener(cache_hit)
