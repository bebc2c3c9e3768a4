"""Data parallelism and multi-process training.

Three ways to spread one training run over several devices, all with the same semantics: the
global batch is split into equal per-device shards, every device holds the same parameters,
gradients are averaged, and every device applies the same update.

- ``--engine data_parallel`` (JAX): a pmap-style native engine written with ``jax.shard_map``
  (``kbackend.engines.data_parallel``, trainer in ``kbackend.backends.jax.data_parallel``);
  ``--dp-impl pmap`` runs the same step under ``jax.pmap``.
- ``--engine keras --data-parallel``: Keras ``fit`` under ``keras.distribution.DataParallel``
  (JAX) or ``tf.distribute.MirroredStrategy`` (TF) (``kbackend.engines.keras_data_parallel``).
- ``--num-processes N --process-id I --coordinator HOST:PORT``: the same engines across processes
  (``jax.distributed`` with gloo on CPU; ``MultiWorkerMirroredStrategy`` on TF), each process
  feeding its own shard of every batch; ``kbackend launch`` starts such a job on one machine.

This module holds the backend-free job plumbing: option checks, device resolution, engine
choice, the coordinator check, "only process 0 writes" and ending a process whose peer died.
Backend-specific pieces live in ``kbackend.backends``.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from typing import Any

from kbackend.backends import impl
from kbackend.config import validate_parallel_options
from kbackend.errors import ConfigError, KBackendError

NATIVE_ENGINE = "data_parallel"
KERAS_ENGINE = "keras_data_parallel"
# Engines whose data-parallel version is one of the above.
_DATA_PARALLEL_ENGINES = {"keras": KERAS_ENGINE, "native": NATIVE_ENGINE,
                          NATIVE_ENGINE: NATIVE_ENGINE, KERAS_ENGINE: KERAS_ENGINE}


def is_parallel(config: Any) -> bool:
    """Whether ``config`` asks for a data-parallel or multi-process run."""
    return bool(config.data_parallel or config.engine in (NATIVE_ENGINE, KERAS_ENGINE)
                or config.num_processes > 1 or config.devices > 1)


def engine_name(config: Any) -> str:
    """The engine that runs ``config``: the data-parallel version of ``config.engine`` if asked."""
    if not is_parallel(config):
        return config.engine
    if config.engine not in _DATA_PARALLEL_ENGINES:
        raise ConfigError(
            f"Engine {config.engine!r} has no data-parallel version. Expected one of "
            f"{sorted(_DATA_PARALLEL_ENGINES)} with --data-parallel / --devices / --num-processes."
        )
    return _DATA_PARALLEL_ENGINES[config.engine]


def prepare(config: Any) -> None:
    """Set up what a parallel run needs before anything runs on a device.

    Creates virtual CPU devices and joins a multi-process job. Runs at the start of
    ``kbackend.training.train``, before its data and batch checks (``kbackend.config.check_run``).
    """
    validate_parallel_options(config)
    backend = impl()
    if config.virtual_devices:
        backend.setup_virtual_devices(config.virtual_devices)
    if config.num_processes > 1:
        def coordinator_reachable() -> None:
            check_coordinator(config.coordinator, config.process_id, config.num_processes,
                              config.coordinator_timeout)

        backend.initialize_processes(config.coordinator, config.num_processes, config.process_id,
                                     config.coordinator_timeout, config.heartbeat_timeout,
                                     coordinator_reachable)


def device_count(config: Any) -> int:
    """The number of devices a run of ``config`` uses (``devices``, or all of them when 0)."""
    backend = impl()
    available = backend.device_count()
    if config.devices == 0:
        return available
    if config.devices > available:
        raise ConfigError(
            f"Requested {config.devices} devices, but only {available} "
            f"{backend.platform()} device(s) exist. Use --devices {available} or fewer"
            + (f", or create virtual CPU devices with --virtual-devices {config.devices}."
               if backend.platform() == "cpu" else ".")
        )
    if config.num_processes > 1 and config.devices != available:
        raise ConfigError(
            f"A {config.num_processes}-process job uses all its {available} devices; "
            f"received devices={config.devices}. Leave --devices out."
        )
    return config.devices


def process_index() -> int:
    """This process's index in a multi-process job (0 when alone)."""
    return impl().process_index()


def is_chief() -> bool:
    """Whether this process writes results and the saved model (process 0 only)."""
    return process_index() == 0


def abort_job(error: BaseException, process: int, processes: int, code: int = 3) -> None:
    """End this process of a multi-process job at once, with a one-line reason.

    Called when a collective fails, which in practice means a peer died. The frameworks' orderly
    shutdown would wait on the dead peer's barrier and then abort with a C++ stack trace, so the
    process prints why and exits with ``code`` without running exit handlers.
    """
    text = str(error).strip()
    first_line = text.splitlines()[0] if text else type(error).__name__
    sys.stdout.flush()
    if os.environ.get("KBACKEND_DEBUG"):
        traceback.print_exception(error)
    sys.stderr.write(
        f"kbackend: error: process {process} of {processes} stopped: {type(error).__name__}: "
        f"{first_line[:240]}. If another process of the job died, see its output "
        "(KBACKEND_DEBUG=1 prints the traceback).\n")
    sys.stderr.flush()
    os._exit(code)


def run_guarded(function: Any, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``; in a multi-process job, a failure other than bad input
    (a lost peer) ends this process with a clear message instead of a hang or an abort."""
    backend = impl()
    try:
        return function(*args, **kwargs)
    except KBackendError:
        raise
    except Exception as error:
        if backend.process_count() > 1:
            abort_job(error, backend.process_index(), backend.process_count())
        raise


def check_coordinator(coordinator: str, process_id: int, processes: int, timeout_s: float) -> None:
    """Fail with a clear ``ConfigError`` before joining a job whose coordinator cannot work.

    Process 0 must be able to listen on the coordinator's port; every other process retries a TCP
    connection to it for up to ``timeout_s`` seconds. (The frameworks' own clients terminate
    the process with a C++ stack trace when the coordinator is unreachable.)
    """
    host, _, port_text = coordinator.rpartition(":")
    host, port = host.strip("[]"), int(port_text)
    if process_id == 0:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as error:
                raise ConfigError(
                    f"Process 0 cannot host the coordinator at {coordinator}: {error.strerror}. "
                    "Pick a free port (kbackend launch finds one)."
                ) from None
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout_s)):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"Process {process_id} of {processes} could not reach the coordinator at "
                    f"{coordinator} within {timeout_s:g}s ({error.strerror or error}). Start process 0 "
                    "first, check the address, or raise --coordinator-timeout."
                ) from None
            time.sleep(0.25)
