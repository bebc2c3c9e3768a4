"""``kbackend launch``: start a multi-process training job on this machine and watch it.

``kbackend launch --num-processes N -- <train args>`` runs ``kbackend train <train args>
--num-processes N --process-id I --coordinator 127.0.0.1:PORT`` for I = 0 .. N-1 (on
TensorFlow each with a ``TF_CONFIG`` naming every worker's address, worker 0 the coordinator's), prefixes each
process's output lines with ``[I]``, and waits. Process 0's output is shown as it comes (the
others compute the same figures: their lines would repeat it N times); the other processes'
output is kept and shown only if the job fails (``--all-output`` shows every process live). If
one process fails (or is killed) the launcher stops the others, prints the failed processes'
kept output, and exits non-zero naming the process that failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import ExitStack

from kbackend.backend_choice import selected_backend
from kbackend.cli import OneLineErrorParser
from kbackend.commands import train as train_command
from kbackend.errors import ConfigError

# Flags the launcher sets on every process; the train arguments must not set them.
_OWN_FLAGS = ("--num-processes", "--process-id", "--coordinator")
GRACE_S = 5.0


def register(subparsers: argparse._SubParsersAction, parents: list) -> None:
    parser = subparsers.add_parser(
        "launch", parents=parents,
        help="run a multi-process training job on this machine (kbackend launch -N 2 -- ...)")
    parser.add_argument("-N", "--num-processes", type=int, default=2, metavar="N",
                        help="how many training processes to start (default 2)")
    parser.add_argument("--port", type=int, default=0,
                        help="coordinator port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--all-output", action="store_true",
                        help="show every process's output as it comes (default: process 0's; "
                             "the others' only if the job fails)")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, metavar="-- TRAIN_ARGS",
                        help="arguments of kbackend train, after --")
    parser.set_defaults(func=run)


def check_train_args(train_args: list[str], num_processes: int, coordinator: str) -> None:
    """Parse and check the train arguments as each process will, before any process starts:
    a bad flag is one line (exit 2) here, not N failed processes."""
    parser = OneLineErrorParser(prog="kbackend launch -- TRAIN_ARGS", add_help=False)
    parser.add_argument("--backend", default=None)
    parser.add_argument("--verbose", action="store_true")
    train_command.add_train_arguments(parser)
    args = parser.parse_args([*train_args, "--num-processes", str(num_processes),
                              "--process-id", "0", "--coordinator", coordinator])
    train_command.check_args(args)


def free_port() -> int:
    """A port on 127.0.0.1 that is free now (the OS picks it)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports on 127.0.0.1 that are free now (held open together while the OS
    picks them, so no two are the same)."""
    with ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]


def tf_configs(coordinator_port: int, num_processes: int) -> list[str]:
    """Each process's ``TF_CONFIG``: worker 0 at the coordinator, the others at free ports."""
    ports = [coordinator_port, *free_ports(num_processes - 1)]
    workers = [f"127.0.0.1:{port}" for port in ports]
    return [json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}})
            for i in range(num_processes)]


def _forward(stream: object, prefix: str, sink: object, kept: list[str] | None = None) -> None:
    """Copy ``stream``'s lines, prefixed, to ``sink``, or into ``kept`` when given."""
    for line in iter(stream.readline, ""):  # type: ignore[attr-defined]
        if kept is not None:
            kept.append(f"{prefix}{line}")
            continue
        sink.write(f"{prefix}{line}")  # type: ignore[attr-defined]
        sink.flush()  # type: ignore[attr-defined]


def _stop(processes: list[subprocess.Popen]) -> None:
    """SIGTERM every live process, then SIGKILL whatever is left after a grace period."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + GRACE_S
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run(args: argparse.Namespace) -> int:
    train_args = list(args.train_args)
    if train_args and train_args[0] == "--":
        train_args = train_args[1:]
    if args.num_processes < 1:
        raise ConfigError(f"Invalid --num-processes {args.num_processes}: expected >= 1.")
    clashing = [a for a in train_args if a.split("=")[0] in _OWN_FLAGS]
    if clashing:
        raise ConfigError(f"kbackend launch sets {', '.join(_OWN_FLAGS)} itself; remove {clashing}.")
    if train_args and train_args[0] == "train":
        train_args = train_args[1:]
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"Invalid --port {args.port}: expected 1-65535 (0: a free one).")
    port = args.port or free_port()
    coordinator = f"127.0.0.1:{port}"
    check_train_args(train_args, args.num_processes, coordinator)
    env = dict(os.environ)
    # TensorFlow workers each listen at their own address (TF_CONFIG; it replaces one set here).
    cluster = (tf_configs(port, args.num_processes) if selected_backend() == "tensorflow"
               else None)
    processes: list[subprocess.Popen] = []
    threads = []
    kept: list[list[str]] = [[] for _ in range(args.num_processes)]
    for index in range(args.num_processes):
        command = [sys.executable, "-m", "kbackend", "train", *train_args,
                   "--num-processes", str(args.num_processes), "--process-id", str(index),
                   "--coordinator", coordinator]
        own_env = env if cluster is None else {**env, "TF_CONFIG": cluster[index]}
        process = subprocess.Popen(command, env=own_env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, bufsize=1)
        processes.append(process)
        live = index == 0 or getattr(args, "all_output", False)
        thread = threading.Thread(target=_forward, daemon=True,
                                  args=(process.stdout, f"[{index}] ", sys.stdout,
                                        None if live else kept[index]))
        thread.start()
        threads.append(thread)
    sys.stderr.write(f"kbackend launch: {args.num_processes} processes, coordinator {coordinator}\n")
    previous = signal.signal(signal.SIGTERM, lambda *_: (_stop(processes), sys.exit(143)))
    try:
        while True:
            codes = [p.poll() for p in processes]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                index, code = failed[0]
                _stop(processes)
                for thread in threads:
                    thread.join(timeout=2)
                for i, c in enumerate(p.poll() for p in processes):
                    if c not in (None, 0) and kept[i]:  # the failed ones' output, kept until now
                        sys.stdout.write("".join(kept[i]))
                sys.stdout.flush()
                how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
                sys.stderr.write(f"kbackend launch: error: process {index} {how}; "
                                 f"stopped the other {len(processes) - 1} process(es).\n")
                return 1
            if all(c == 0 for c in codes):
                for thread in threads:
                    thread.join(timeout=2)
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        _stop(processes)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
