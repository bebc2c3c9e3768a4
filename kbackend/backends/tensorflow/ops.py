"""TensorFlow: versions, devices, logical CPU devices, processes, memory and transfers."""

from __future__ import annotations

import json
import os
import socket
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
from tensorflow.python.eager import context

from kbackend.backends.capabilities import VIRTUAL_DEVICES_ENV
from kbackend.backends.compile_cache import compile_cache_folder, private_cache_folder
from kbackend.errors import ConfigError


def framework_versions() -> dict[str, str]:
    """Versions of the framework packages behind this backend."""
    return {"tensorflow": tf.__version__}


TF_CACHE_FLAG = "--tf_xla_persistent_cache_directory"
TF_CACHE_PRIVATE_ENV = "KBACKEND_TF_CACHE_PRIVATE"  # this process's folder, as its children see it


def start() -> None:
    """Apply ``KBACKEND_VIRTUAL_DEVICES`` before the runtime starts, so every run sees the devices,
    and turn on XLA's persistent cache in this process's own folder
    (``kbackend.backends.compile_cache``; TF reads ``TF_XLA_FLAGS`` at its first compilation).

    A failure here is reported by ``kbackend.distributed.prepare`` when a run asks for them.
    """
    if os.environ.get(VIRTUAL_DEVICES_ENV):
        with suppress(ConfigError, RuntimeError, ValueError):
            setup_virtual_devices(int(os.environ[VIRTUAL_DEVICES_ENV]))
    shared = compile_cache_folder("tensorflow")
    if shared is None:
        return
    flags = os.environ.get("TF_XLA_FLAGS", "").split()
    # A kbackend parent's private folder (inherited with the environment) is not this process's.
    inherited = f"{TF_CACHE_FLAG}={os.environ.get(TF_CACHE_PRIVATE_ENV, '')}"
    if any(f.startswith(f"{TF_CACHE_FLAG}=") and f != inherited for f in flags):
        return  # the user's own setting stays
    with suppress(OSError):
        private = private_cache_folder(shared)
        kept = [f for f in flags if f != inherited]
        os.environ["TF_XLA_FLAGS"] = " ".join([*kept, f"{TF_CACHE_FLAG}={private}"])
        os.environ[TF_CACHE_PRIVATE_ENV] = str(private)


def set_random_seed(seed: int) -> None:
    """Seed Python, NumPy, TensorFlow and Keras's global seed (``keras.utils.set_random_seed``)."""
    import keras  # deferred: Keras is imported once the backend is chosen

    keras.utils.set_random_seed(seed)


def devices() -> list[dict[str, Any]]:
    """The logical devices computations can run on: kind, platform and id of each."""
    found = []
    for index, device in enumerate(tf.config.list_logical_devices()):
        details: dict[str, Any] = {}
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
    """How many devices (all processes together) computations can run on: in a multi-process
    job the strategy's replicas, one per process on CPU (or each process's GPUs)."""
    strategy = job_strategy()
    return strategy.num_replicas_in_sync if strategy is not None else len(compute_devices())


def local_device_count() -> int:
    """How many devices this process drives."""
    return device_count() // process_count()


def platform() -> str:
    """The platform of the devices computations run on (cpu or gpu)."""
    return compute_devices()[0].device_type.lower()


# The MultiWorkerMirroredStrategy of this process's multi-process job, once it has joined one.
_JOB: dict[str, Any] = {}
TF_CONFIG_ENV = "TF_CONFIG"


def job_strategy() -> Any | None:
    """The job's ``MultiWorkerMirroredStrategy`` (None outside a multi-process job)."""
    return _JOB.get("strategy")


def cluster_config(coordinator: str, num_processes: int, process_id: int) -> dict[str, Any]:
    """This process's ``TF_CONFIG``: the environment's (checked against the job's flags), else
    ``num_processes`` workers on the coordinator's host at consecutive ports from its port
    (worker 0 is the coordinator; ``kbackend launch`` writes a ``TF_CONFIG`` of free ports)."""
    host, _, port = coordinator.rpartition(":")
    text = os.environ.get(TF_CONFIG_ENV)
    if not text:
        workers = [f"{host}:{int(port) + i}" for i in range(num_processes)]
        return {"cluster": {"worker": workers}, "task": {"type": "worker", "index": process_id}}
    try:
        config = json.loads(text)
        workers, task = list(config["cluster"]["worker"]), config["task"]
        kind, index = task["type"], int(task["index"])
    except (ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"Invalid {TF_CONFIG_ENV}: expected JSON with cluster.worker (a list of "
                          f"HOST:PORT) and task.type/task.index. Received: {text[:200]!r} "
                          f"({type(error).__name__}).") from None
    problems = []
    if set(config["cluster"]) != {"worker"} or kind != "worker":
        problems.append("only 'worker' tasks (no chief, ps or evaluator)")
    if len(workers) != num_processes:
        problems.append(f"{num_processes} workers (--num-processes); it lists {len(workers)}")
    if index != process_id:
        problems.append(f"task.index {process_id} (--process-id); it has {index}")
    if workers and workers[0] != coordinator:
        problems.append(f"worker 0 at the coordinator {coordinator}; it has {workers[0]}")
    if problems:
        raise ConfigError(f"{TF_CONFIG_ENV} does not match this job: expected "
                          + "; ".join(problems) + ".")
    return config


def _check_own_port(address: str, process_id: int) -> None:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, int(port)))
        except OSError as error:
            raise ConfigError(
                f"Process {process_id} cannot listen at its worker address {address}: "
                f"{error.strerror}. Pick free ports (kbackend launch finds them).") from None


def initialize_processes(coordinator: str, num_processes: int, process_id: int,
                         timeout_s: int, heartbeat_s: int,
                         check_coordinator: Callable[[], None] = lambda: None) -> None:
    """Join a ``num_processes``-process job as a ``MultiWorkerMirroredStrategy`` worker.

    The cluster comes from ``cluster_config`` (written to ``TF_CONFIG``). TF's coordination
    service (led by worker 0) is configured before the strategy starts it: workers must register
    within ``timeout_s``, and a worker that sends no heartbeat for ``heartbeat_s`` (dead or
    hung) aborts the others' collectives with an error, which ``kbackend.distributed
    .run_guarded`` turns into exit 3. Keras's ``fit`` cannot run under this strategy (Keras 3.15),
    so only the native data-parallel engine trains in such a job.
    """
    if "strategy" in _JOB:
        return
    config = cluster_config(coordinator, num_processes, process_id)
    check_coordinator()
    if process_id != 0:
        _check_own_port(config["cluster"]["worker"][process_id], process_id)
    if context.context()._context_handle is not None:
        raise ConfigError("Multi-process training must start before TensorFlow runs anything "
                          "in this process.")
    os.environ[TF_CONFIG_ENV] = json.dumps(config)
    context.context().configure_coordination_service(
        service_type="standalone", service_leader="/job:worker/replica:0/task:0",
        cluster_register_timeout_in_ms=int(timeout_s * 1000),
        heartbeat_timeout_in_ms=int(heartbeat_s * 1000),
        shutdown_barrier_timeout_in_ms=int(timeout_s * 1000),
        coordinated_jobs=[coordination_config_pb2.CoordinatedJob(name="worker",
                                                                  num_tasks=num_processes)])
    try:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    except Exception as error:  # TF raises with long C++ text
        text = str(error).strip()
        first_line = text.splitlines()[0] if text else type(error).__name__
        raise ConfigError(
            f"Process {process_id} of {num_processes} could not join the TensorFlow job at "
            f"{coordinator} within {timeout_s}s: {first_line[:300]}. Is every process running "
            "and the addresses reachable?") from None
    _JOB.update(strategy=strategy, index=process_id, count=num_processes)


def process_index() -> int:
    """This process's index in a multi-process job (0 when alone)."""
    return int(_JOB.get("index", 0))


def process_count() -> int:
    """How many processes the job has (1 when alone)."""
    return int(_JOB.get("count", 1))


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
        tensors = tf.nest.map_structure(tf.convert_to_tensor, batch)
        return tf.nest.map_structure(tf.identity, tensors)


def device_scope(platform: str) -> Any:
    """A context manager placing new tensors and ops on the first ``platform`` device."""
    return tf.device(f"/{platform.upper()}:0")


_JIT_FUNCTIONS: weakref.WeakSet = weakref.WeakSet()
# A function traced once for every batch size (a relaxed signature) compiles one XLA program per
# input shape, not per trace: the programs past its first, counted by ``note_program``.
_EXTRA_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def jit_function(fn: Any, jit_compile: bool = True, input_signature: Any = None) -> Any:
    """``tf.function(fn, jit_compile=True)``, registered so ``compilation_counter`` sees its
    traces (each trace of an XLA-compiled function is one XLA program; a function with a
    relaxed ``input_signature`` notes its further input shapes with ``note_program``).
    ``jit_compile=False``: a plain ``tf.function`` graph (no XLA program, so nothing to count)."""
    function = tf.function(fn, jit_compile=jit_compile, input_signature=input_signature)
    if jit_compile:
        _JIT_FUNCTIONS.add(function)
    return function


def note_program(function: Any) -> None:
    """Count one more XLA program of ``function``: its call at a new input shape, which XLA
    compiles without a new trace."""
    if function in _JIT_FUNCTIONS:
        _EXTRA_PROGRAMS[function] = _EXTRA_PROGRAMS.get(function, 0) + 1


def counted_loop(n_steps: tf.Tensor, body: Callable[..., tuple], carry: tuple) -> tuple:
    """``carry = body(i, *carry)`` for ``i`` in ``[0, n_steps)``, as one loop whose trip count
    stays a run-time value under XLA, so one compiled program serves every ``n_steps``.

    Autograph's ``for i in tf.range(n_steps)`` sets the loop's ``maximum_iterations`` to
    ``n_steps``, which XLA needs as a compile-time constant: each new value compiled a new
    program without a retrace (measured: 1.9-2.9 s per value for a 12-feature MLP on CPU), so
    a 0-step call compiled a program no real call used and the first real call compiled again
    inside the training clock. ``tf.while_loop`` without ``maximum_iterations`` keeps it dynamic.
    """

    def step(i: tf.Tensor, *values: Any) -> tuple:
        return (i + 1, *body(i, *values))

    return tuple(tf.while_loop(lambda i, *_: i < n_steps, step,
                               (tf.constant(0, n_steps.dtype), *carry))[1:])


def _traces() -> dict[Any, int]:
    """Each live registered function's trace count (held: none is collected while counted)."""
    return {f: f.experimental_get_tracing_count() + _EXTRA_PROGRAMS.get(f, 0)
            for f in list(_JIT_FUNCTIONS)}


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
        # Per function: a function collected meanwhile (an earlier run's) must not count as
        # minus its traces, as a difference of sums did.
        counts["programs"] = sum(n - before.get(f, 0) for f, n in _traces().items())
