"""``kbackend launch``: start a multi-process training job on this machine and watch it.

``kbackend launch --num-processes N -- <train args>`` runs ``kbackend train <train args>
--num-processes N --process-id I --coordinator 127.0.0.1:PORT`` for I = 0 .. N-1 (on
TensorFlow each with a ``TF_CONFIG`` naming every worker's address, worker 0 the
coordinator's), prefixes each process's output lines with ``[I]``, and waits. Process 0's output
is shown as it comes (the others compute the same figures: their lines would repeat it N times);
the other processes' output is kept and shown only if the job fails (``--all-output`` shows every
process live).

Before any process starts, the launcher checks once what every process would check alike: the
train flags, the output paths, the model source (file or builder source), the data as far as
it needs no framework (a built-in dataset loaded here once, a ``.npz`` or ``.csv`` read in full,
a folder's listing), the batch against the data and the processes and a built-in model's memory
where the splits are known; and N against the CPUs (each
process needs one; ``--oversubscribe`` allows more). So a bad value is one line, exit 2, not N
failed processes.

If one process fails (or is killed) the launcher stops the others, prints the failed processes'
kept output, and names the process that failed first (a process that exits 3 after losing a
peer is named only when no other failed). Its exit status is that process's when it was 2 (bad
input), 4 (diverged) or 130 (interrupted), else 3 (the job failed). Each process dies with the
launcher (``commands.LAUNCHER_PID_ENV``): a launcher killed even by ``kill -9`` leaves none running.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from kbackend import distributed
from kbackend.backend_choice import selected_backend
from kbackend.backends.cluster import free_ports, worker_environments
from kbackend.commands import (
    LAUNCHER_PID_ENV,
    OneLineErrorParser,
    add_import_flag,
    add_reprobe_flag,
    bound_integer_flags,
)
from kbackend.commands import train as train_command
from kbackend.data import user as user_data
from kbackend.engines import get_engine
from kbackend.errors import ConfigError
from kbackend.model_sources import parse_model_source
from kbackend.workload import SPLIT_SEED

# Flags the launcher sets on every process; the train arguments must not set them.
_OWN_FLAGS = ("--num-processes", "--process-id", "--coordinator")
GRACE_S = 5.0
# A process that exits 3 reports a lost peer: the peer that died may be seen a moment later.
PEER_REPORT_S = 1.0
# A failed process's status the launcher passes on; any other failure is the job's, 3.
PASSED_ON = {2: "bad input", 4: "training diverged", 130: "interrupted"}
JOB_FAILED = 3


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
    add_reprobe_flag(parser)
    parser.add_argument("--oversubscribe", action="store_true",
                        help="allow more processes than this machine's CPUs")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, metavar="-- TRAIN_ARGS",
                        help="arguments of kbackend train, after --")
    add_import_flag(parser)
    parser.set_defaults(func=run)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the system has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_num_processes(num_processes: int, oversubscribe: bool) -> None:
    """``ConfigError`` unless ``num_processes`` is >= 1 and, without ``oversubscribe``, at
    most the CPUs (each process computes on its own: more only contend for them)."""
    if num_processes < 1:
        raise ConfigError(f"Invalid --num-processes {num_processes}: expected >= 1.")
    cpus = usable_cpus()
    if num_processes > cpus and not oversubscribe:
        raise ConfigError(
            f"Invalid --num-processes {num_processes}: this machine has {cpus} CPU(s), and each "
            f"process needs one. Use -N {cpus} or fewer, or add --oversubscribe.")


def check_train_args(train_args: list[str], num_processes: int, coordinator: str) -> None:
    """Check the train arguments as each process will, before any process starts: the flags,
    the output paths, the model source, the data as far as it can be read without a framework
    (``kbackend.data.user.check_source``: a built-in dataset loaded once here, a ``.npz`` or
    ``.csv`` read in full); where that gives the splits, the batch against them and the
    processes, and the model's memory where it is known unbuilt (``ModelSource.check_fits``).
    A bad value is one line (exit 2) here, not N failed processes."""
    parser = OneLineErrorParser(prog="kbackend launch -- TRAIN_ARGS", add_help=False)
    parser.add_argument("--backend", default=None)
    parser.add_argument("--verbose", action="store_true")
    train_command.add_train_arguments(parser)
    bound_integer_flags(parser)
    args = parser.parse_args([*train_args, "--num-processes", str(num_processes),
                              "--process-id", "0", "--coordinator", coordinator])
    config = train_command.check_args(args)  # the model source's checks among them
    source = parse_model_source(config.model, unsafe_deserialization=
                                config.unsafe_deserialization, from_weights=config.from_weights)
    dataset = user_data.check_source(
        config.dataset, label=config.label, layout=source.layout,
        data_format=source.data_format(config.model_options),
        validation_fraction=config.validation_fraction, seed=SPLIT_SEED,
        data_dir=config.data_dir)
    if dataset is None:  # the splits are settled when each process prepares them
        return
    # Devices per process are known only once a process starts its backend: one here, so the
    # split over the processes is checked (each process checks its devices again).
    get_engine(distributed.engine_name(config)).plan(config, len(dataset.x_train))  # checks
    source.check_fits(dataset.info, config.model_options)


def _forward(stream: object, prefix: str, kept: list[str] | None) -> None:
    """Copy ``stream``'s lines, prefixed, to stdout, or into ``kept`` when given."""
    for line in iter(stream.readline, ""):  # type: ignore[attr-defined]
        if kept is not None:
            kept.append(f"{prefix}{line}")
            continue
        sys.stdout.write(f"{prefix}{line}")
        sys.stdout.flush()


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


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    meaning = PASSED_ON.get(code) or ("lost a peer or could not join" if code == JOB_FAILED
                                      else "")
    return f"exited with status {code}" + (f" ({meaning})" if meaning else "")


def first_failure(exits: list[tuple[int, int]]) -> tuple[int, int] | None:
    """``(index, status)`` of the process to blame among ``exits`` (in the order they ended):
    the first that failed other than by losing a peer (status 3), else the first failed."""
    failed = [(index, code) for index, code in exits if code != 0]
    return next(((i, c) for i, c in failed if c != JOB_FAILED), failed[0] if failed else None)


def worker_command(train_args: list[str], num_processes: int, index: int,
                   coordinator: str) -> list[str]:
    """The command line of process ``index``."""
    return [sys.executable, "-m", "kbackend", "train", *train_args,
            "--num-processes", str(num_processes), "--process-id", str(index),
            "--coordinator", coordinator]


def _wait_for(process: subprocess.Popen, index: int, ended: queue.Queue) -> None:
    ended.put((index, process.wait()))


def run(args: argparse.Namespace) -> int:
    train_args = list(args.train_args)
    if train_args and train_args[0] == "--":
        train_args = train_args[1:]
    check_num_processes(args.num_processes, args.oversubscribe)
    clashing = [a for a in train_args if a.split("=")[0] in _OWN_FLAGS]
    if clashing:
        raise ConfigError(
            f"kbackend launch sets {', '.join(_OWN_FLAGS)} itself; remove {clashing}.")
    if train_args and train_args[0] == "train":
        train_args = train_args[1:]
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"Invalid --port {args.port}: expected 1-65535 (0: a free one).")
    port = args.port or free_ports(1)[0]  # a free one now, the OS's pick
    coordinator = f"127.0.0.1:{port}"
    check_train_args(train_args, args.num_processes, coordinator)
    # Each process dies with this one (cli._die_with_launcher), even when it is killed -9.
    env = {**os.environ, LAUNCHER_PID_ENV: str(os.getpid())}
    # What the backend's workers need besides the coordinator (TensorFlow's: each its own
    # address, in TF_CONFIG); an entry replaces a variable of this environment.
    cluster = worker_environments(selected_backend(), port, args.num_processes)
    processes: list[subprocess.Popen] = []
    threads = []
    ended: queue.Queue = queue.Queue()
    kept: list[list[str]] = [[] for _ in range(args.num_processes)]

    def on_sigterm(*_: object) -> None:
        _stop(processes)
        sys.exit(143)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        for index in range(args.num_processes):
            command = worker_command(train_args, args.num_processes, index, coordinator)
            own_env = {**env, **cluster[index]}
            process = subprocess.Popen(command, env=own_env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, bufsize=1)
            processes.append(process)
            live = index == 0 or args.all_output
            thread = threading.Thread(target=_forward, daemon=True, args=(
                process.stdout, f"[{index}] ", None if live else kept[index]))
            thread.start()
            threads.append(thread)
            threading.Thread(target=_wait_for, args=(process, index, ended), daemon=True).start()
        sys.stderr.write(f"kbackend launch: {args.num_processes} processes, "
                         f"coordinator {coordinator}\n")
        return _watch(processes, threads, ended, kept)
    except KeyboardInterrupt:
        _stop(processes)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _watch(processes: list[subprocess.Popen], threads: list[threading.Thread],
           ended: queue.Queue, kept: list[list[str]]) -> int:
    """Wait for the processes; on the first failure stop the others and report it."""
    exits: list[tuple[int, int]] = []
    while len(exits) < len(processes):
        exits.append(ended.get())
        if exits[-1][1] == 0:
            continue
        if exits[-1][1] == JOB_FAILED:  # the peer it lost may be reported a moment later
            deadline = time.monotonic() + PEER_REPORT_S
            while len(exits) < len(processes) and time.monotonic() < deadline:
                try:
                    exits.append(ended.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
        index, code = first_failure(exits)  # type: ignore[misc]
        _stop(processes)
        for thread in threads:
            thread.join(timeout=2)
        for i, c in enumerate(p.poll() for p in processes):
            if c not in (None, 0) and kept[i]:  # the failed ones' output, kept until now
                sys.stdout.write("".join(kept[i]))
        sys.stdout.flush()
        sys.stderr.write(f"kbackend launch: error: process {index} {_describe(code)}; "
                         f"stopped the other {len(processes) - 1} process(es).\n")
        return code if code in PASSED_ON else JOB_FAILED  # the blamed process's, or the job's
    for thread in threads:
        thread.join(timeout=2)
    return 0
