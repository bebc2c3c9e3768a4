"""How one backend's worker processes on this machine find each other, without its framework.

``kbackend launch`` starts the workers and trains nothing itself, so it must not import JAX or
TensorFlow (seconds of start-up) to learn what each worker needs: the per-backend answer lives
here, behind the backend boundary, as data keyed by the backend's name (like
``backends._PACKAGES``), and no code outside ``kbackend.backends`` branches on that name.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from contextlib import ExitStack


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports on 127.0.0.1 that are free now (held open together while the OS
    picks them, so no two are the same)."""
    with ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]


def tf_configs(coordinator_port: int, num_processes: int) -> list[str]:
    """Each TensorFlow worker's ``TF_CONFIG``: worker 0 at the coordinator, the others at free
    ports (each worker listens at its own address)."""
    ports = [coordinator_port, *free_ports(num_processes - 1)]
    workers = [f"127.0.0.1:{port}" for port in ports]
    return [json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}})
            for i in range(num_processes)]


_WORKER_ENVIRONMENTS: dict[str, Callable[[int, int], list[dict[str, str]]]] = {
    # jax.distributed finds every peer through the coordinator's address (a command-line flag).
    "jax": lambda port, processes: [{} for _ in range(processes)],
    "tensorflow": lambda port, processes: [{"TF_CONFIG": config}
                                           for config in tf_configs(port, processes)]}


def worker_environments(backend: str, coordinator_port: int,
                        num_processes: int) -> list[dict[str, str]]:
    """The variables each of ``num_processes`` local workers of ``backend`` needs in its
    environment, beyond the coordinator's address every worker is given (index: process id).

    An entry replaces a variable of the same name the launcher's environment holds.
    """
    return _WORKER_ENVIRONMENTS[backend](coordinator_port, num_processes)
