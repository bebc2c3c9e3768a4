"""Data parallelism and multi-process training.

Three ways to spread one training run over several devices, all with the same semantics: the
global batch is split into equal per-device shards, every device holds the same parameters,
gradients are averaged, and every device applies the same update.

- ``--engine data_parallel``: the native engine with a sharded trainer
  (``kbackend.engines.data_parallel``): pmap-style ``jax.shard_map`` on JAX (``--dp-impl pmap``
  runs the same step under ``jax.pmap``), a ``tf.distribute`` custom loop on TensorFlow.
- ``--engine keras --data-parallel``: Keras ``fit`` under ``keras.distribution.DataParallel``
  (JAX) or ``tf.distribute.MirroredStrategy`` (TF) (``kbackend.engines.keras_data_parallel``).
- ``--num-processes N --process-id I --coordinator HOST:PORT``: the same engines across processes
  (``jax.distributed`` with gloo on CPU; ``MultiWorkerMirroredStrategy`` on TF, native engine
  only), each process feeding its own shard of every batch; ``kbackend launch`` starts such a
  job on one machine.

This module holds the backend-free job plumbing: option checks, device resolution, engine
choice, the meeting of a job's processes (``check_coordinator``) and their heartbeats
(``JobWatch``), "only process 0 writes" and ending a process whose peer died or hung.
Backend-specific pieces live in ``kbackend.backends``.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
import traceback
from contextlib import suppress
from typing import Any

from kbackend.backends import impl
from kbackend.engine_facts import engine_facts
from kbackend.errors import ConfigError, JobError, KBackendError, check_declared

# The rendezvous of a job's processes before the framework joins them (``check_coordinator``).
_HELLO, _GO, _REFUSED = b"kbackend-join 1", b"kbackend-go", b"kbackend-refused"
_BEAT, _BYE = b".", b"!"  # JobWatch's heartbeat and goodbye


def is_parallel(config: Any) -> bool:
    """Whether ``config`` asks for a data-parallel or multi-process run."""
    return bool(config.data_parallel or engine_facts(config.engine).parallel
                or config.num_processes > 1 or config.devices > 1)


def engine_name(config: Any) -> str:
    """The engine that runs ``config``: the data-parallel version of ``config.engine`` if asked."""
    return engine_facts(config.engine).parallel_twin if is_parallel(config) else config.engine


def prepare(config: Any) -> None:
    """Set up what a parallel run needs before anything runs on a device.

    Creates virtual CPU devices and joins a multi-process job. Runs at the start of
    ``kbackend.training.train``, before its data and batch checks (``kbackend.config.check_run``).
    """
    # The fields' rules again (the config may have changed since it was built), the job's too.
    check_declared(config)
    config.check_processes()
    backend = impl()
    if config.virtual_devices:
        backend.setup_virtual_devices(config.virtual_devices)
    if config.num_processes > 1:
        connections: dict[int, socket.socket] = {}

        def rendezvous() -> None:
            connections.update(check_coordinator(config.coordinator, config.process_id,
                                                 config.num_processes, config.coordinator_timeout))

        # JobWatch detects a lost process; the framework's own heartbeat (JAX's ends in a C++
        # abort) is a backstop, set longer.
        backstop = 2 * config.heartbeat_timeout + 10
        backend.initialize_processes(config.coordinator, config.num_processes, config.process_id,
                                     config.coordinator_timeout, backstop, rendezvous)
        JobWatch(connections, config.process_id, config.num_processes,
                 config.heartbeat_timeout).start()


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


def abort_job(error: BaseException, process: int, processes: int,
              code: int = JobError.exit_status) -> None:
    """End this process of a multi-process job at once, with a one-line reason.

    Called when a collective fails, which in practice means a peer died. The frameworks' orderly
    shutdown would wait on the dead peer's barrier and then abort with a C++ stack trace, so the
    process prints why and exits with ``code`` without running exit handlers.
    """
    first_line = _telling_line(str(error)) or type(error).__name__
    sys.stdout.flush()
    if os.environ.get("KBACKEND_DEBUG"):
        traceback.print_exception(error)
    sys.stderr.write(
        f"kbackend: error: process {process} of {processes} stopped: {type(error).__name__}: "
        f"{first_line[:240]}. If another process of the job died, see its output "
        "(KBACKEND_DEBUG=1 prints the traceback).\n")
    sys.stderr.flush()
    os._exit(code)


def _telling_line(text: str) -> str:
    """The first line of a framework error that says something: TF's start with headers such
    as "Graph execution error:" and node traces; the cause ("Socket closed", "unhealthy
    tasks") comes later."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        header = line.endswith(":") and len(line) < 60
        if not (header or line.startswith(("Detected at node", "File ", "[["))):
            return line
    return lines[0] if lines else ""


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


def check_coordinator(coordinator: str, process_id: int, processes: int,
                      timeout_s: float) -> dict[int, socket.socket]:
    """Gather the job's processes at the coordinator's address before the framework joins them.

    The frameworks' own joins cannot be bounded from Python: JAX's client ends the process with
    a C++ abort when the coordinator is missing or foreign, and TensorFlow's waits for absent
    workers forever while holding the interpreter. So the processes meet first, in Python:
    process 0 listens on the coordinator's port and waits up to ``timeout_s`` for a hello from
    every other process (job size and index checked), then tells each to go and frees the port
    for the framework; the others retry a connection for up to ``timeout_s`` and wait for the
    go. A missing peer, a foreign listener or a mismatched job is a one-line ``JobError``.
    Returns the open connections, by peer index (process 0: every other process; the others:
    process 0), which ``JobWatch`` then uses for heartbeats.
    """
    host, _, port_text = coordinator.rpartition(":")
    host, port = host.strip("[]"), int(port_text)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    deadline = time.monotonic() + timeout_s
    if process_id == 0:
        return _host_rendezvous(family, (host, port), coordinator, processes, timeout_s, deadline)
    return {0: _join_rendezvous((host, port), coordinator, process_id, processes, timeout_s,
                                deadline)}


def _host_rendezvous(family: int, address: tuple[str, int], coordinator: str, processes: int,
                     timeout_s: float, deadline: float) -> dict[int, socket.socket]:
    with socket.socket(family) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(address)
        except OSError as error:
            raise ConfigError(
                f"Process 0 cannot host the coordinator at {coordinator}: {error.strerror}. "
                "Pick a free port (kbackend launch finds one).") from None
        listener.listen(processes)
        peers: dict[int, socket.socket] = {}
        try:
            while len(peers) < processes - 1:
                listener.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    connection, _ = listener.accept()
                except TimeoutError:
                    raise JobError(
                        f"Process 0 of {processes}: {processes - 1 - len(peers)} process(es) did "
                        f"not join at {coordinator} within {timeout_s:g}s "
                        f"(--coordinator-timeout); joined: {sorted(peers) or 'none'}. Start every "
                        "process of the job (kbackend launch does).") from None
                index = _read_hello(connection, processes, peers)
                if index is not None:
                    peers[index] = connection
            for connection in peers.values():
                connection.sendall(_GO + b"\n")
        except BaseException:
            for connection in peers.values():
                connection.close()
            raise
    # The listener is closed: the framework binds the port next (the connections stay open).
    return peers


def _read_hello(connection: socket.socket, processes: int, peers: dict[int, Any]) -> int | None:
    """The index a joining process says it has; None (connection closed) for anything else
    that is not a kbackend process; a ``JobError`` for a process of another job."""
    connection.settimeout(5.0)
    try:
        words = connection.recv(256).split()
    except OSError:
        words = []
    if len(words) != 4 or b" ".join(words[:2]) != _HELLO or not all(w.isdigit() for w in words[2:]):
        connection.close()  # a port scanner or another program: not one of ours
        return None
    size, index = int(words[2]), int(words[3])
    if size != processes or not 0 < index < processes or index in peers:
        joined = "already joined" if index in peers else "is out of range"
        reason = (f"a {size}-process job" if size != processes
                  else f"process {index}, which {joined}")
        connection.sendall(_REFUSED + f" {processes}\n".encode())
        connection.close()
        raise JobError(f"Process 0 of {processes} was joined by a process of {reason}. Give "
                       "every process the same --num-processes and its own --process-id.")
    return index


def _read_line(connection: socket.socket, limit: int = 64) -> bytes:
    """Bytes up to a newline (at most ``limit``), without reading past it."""
    line = b""
    while len(line) < limit and not line.endswith(b"\n"):
        byte = connection.recv(1)
        if not byte:
            break
        line += byte
    return line.strip()


def _join_rendezvous(address: tuple[str, int], coordinator: str, process_id: int,
                     processes: int, timeout_s: float, deadline: float) -> socket.socket:
    while True:
        try:
            connection = socket.create_connection(address, timeout=min(2.0, timeout_s))
            break
        except OSError as error:
            if time.monotonic() >= deadline:
                raise JobError(
                    f"Process {process_id} of {processes} could not reach the coordinator at "
                    f"{coordinator} within {timeout_s:g}s ({error.strerror or error}). Start "
                    "process 0 first, check the address, or raise --coordinator-timeout."
                ) from None
            time.sleep(0.25)
    try:
        connection.sendall(_HELLO + f" {processes} {process_id}\n".encode())
        connection.settimeout(max(0.01, deadline - time.monotonic()))
        answer = _read_line(connection)
    except TimeoutError:
        answer = None
    except OSError:
        answer = b""
    if answer == _GO:
        return connection
    connection.close()
    if answer is not None and answer.startswith(_REFUSED):
        raise JobError(f"Process {process_id}: process 0 at {coordinator} runs a job of "
                       f"{answer.split()[-1].decode()} processes; this one was started for "
                       f"{processes}. Give every process the same --num-processes.")
    seen = "no answer" if answer is None else f"received {answer[:40]!r}"
    raise JobError(
        f"Process {process_id} of {processes}: the program at {coordinator} is not this job's "
        f"process 0 ({seen} within {timeout_s:g}s). Check the address and port, or raise "
        "--coordinator-timeout.")


class JobWatch:
    """Heartbeats between a job's processes over their rendezvous connections.

    Every ``interval`` seconds each side sends a byte; a peer heard from for no ``timeout``
    seconds is hung (a stopped process keeps its sockets open), one whose connection closes
    without a goodbye died; either ends this process with one line and exit 3 (``abort_job``).
    Process 0 watches every process and the others watch process 0, so a lost process ends
    the whole job within ``timeout`` (plus one interval). At a normal exit each process says
    goodbye first (``close``, registered with ``atexit``), so a process that finishes early is
    not taken for a dead one. The frameworks' own heartbeats (JAX's end in a C++ abort) are
    set longer than this one by ``initialize_processes``'s caller.
    """

    def __init__(self, connections: dict[int, socket.socket], process_id: int, processes: int,
                 timeout_s: float) -> None:
        self.connections, self.process_id, self.processes = connections, process_id, processes
        self.timeout_s = float(timeout_s)
        self.interval_s = max(0.1, min(1.0, self.timeout_s / 4))
        self.closing = threading.Event()

    def start(self) -> None:
        for peer, connection in self.connections.items():
            threading.Thread(target=self._watch, args=(peer, connection), daemon=True,
                             name=f"kbackend-heartbeat-{peer}").start()
        atexit.register(self.close)

    def _watch(self, peer: int, connection: socket.socket) -> None:
        connection.settimeout(self.interval_s)
        heard = time.monotonic()
        while not self.closing.is_set():
            try:
                connection.sendall(_BEAT)
                data = connection.recv(64)
            except TimeoutError:
                data = None
            except OSError:
                data = b""
            if self.closing.is_set():
                return
            if data and _BYE in data:
                return  # the peer finished
            if data == b"":
                self._lost(f"process {peer} closed its connection without finishing (died)")
            if data:
                heard = time.monotonic()
            elif time.monotonic() - heard > self.timeout_s:
                self._lost(f"process {peer} sent no heartbeat for {self.timeout_s:g}s "
                           "(hung or stopped)")

    def _lost(self, what: str) -> None:
        if not self.closing.is_set():
            abort_job(JobError(what), self.process_id, self.processes)

    def close(self) -> None:
        """Say goodbye to every peer and stop watching (a normal end of this process)."""
        self.closing.set()
        for connection in self.connections.values():
            with suppress(OSError):
                connection.sendall(_BYE)
            connection.close()
