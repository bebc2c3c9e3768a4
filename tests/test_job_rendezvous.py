"""The meeting of a multi-process job's processes before the framework joins them, and the
heartbeats that end the job when one of them dies or hangs (``kbackend.distributed``).

Backend-free and in-process: the processes are threads here, the frameworks are not started.
The multi-process tests (tests/test_parallel_processes.py) run the same code in real jobs.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kbackend import distributed
from kbackend.errors import JobError


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _meet(processes: int, timeout_s: float = 10.0, sizes: dict[int, int] | None = None,
          ids: list[int] | None = None):
    """Run ``check_coordinator`` for every process in threads: {index: connections or error}."""
    coordinator = f"127.0.0.1:{_free_port()}"
    results: dict[int, object] = {}

    def one(slot: int, index: int) -> None:
        try:
            results[slot] = distributed.check_coordinator(
                coordinator, index, (sizes or {}).get(index, processes), timeout_s)
        except JobError as error:
            results[slot] = error

    threads = [threading.Thread(target=one, args=(slot, index))
               for slot, index in enumerate(ids or range(processes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


def test_every_process_meets_process_0():
    results = _meet(3)
    assert sorted(results[0]) == [1, 2]  # process 0 holds a connection to each other process
    assert list(results[1]) == [0] and list(results[2]) == [0]
    for connections in results.values():
        for connection in connections.values():
            connection.close()


def test_process_0_alone_says_so_after_the_timeout():
    started = time.monotonic()
    results = _meet(2, timeout_s=1.0, ids=[0])
    assert 1.0 <= time.monotonic() - started < 10
    assert isinstance(results[0], JobError)
    assert "1 process(es) did not join" in str(results[0]) and "within 1s" in str(results[0])


def test_a_process_of_another_job_size_is_refused_on_both_sides():
    results = _meet(2, sizes={1: 3})
    assert isinstance(results[0], JobError) and "a 3-process job" in str(results[0])
    assert isinstance(results[1], JobError) and "runs a job of 2 processes" in str(results[1])


def test_a_foreign_program_at_the_coordinator_is_named():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]

        def answer_like_a_web_server() -> None:
            connection, _ = listener.accept()
            connection.sendall(b"HTTP/1.0 200 OK\r\n\r\n")
            connection.close()

        threading.Thread(target=answer_like_a_web_server, daemon=True).start()
        with pytest.raises(JobError,
                           match=r"is not this job's process 0 \(received b'HTTP/1.0 200 OK'"):
            distributed.check_coordinator(f"127.0.0.1:{port}", 1, 2, 5.0)


def test_a_stranger_connecting_to_process_0_is_ignored():
    coordinator_port = _free_port()
    results: dict[str, object] = {}

    def host() -> None:
        results["host"] = distributed.check_coordinator(f"127.0.0.1:{coordinator_port}", 0, 2, 10.0)

    thread = threading.Thread(target=host)
    thread.start()
    deadline = time.monotonic() + 5
    while True:  # a port scanner: connects, says something else, leaves
        try:
            with socket.create_connection(("127.0.0.1", coordinator_port), timeout=1) as stranger:
                stranger.sendall(b"GET / HTTP/1.0\r\n\r\n")
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    peer = distributed.check_coordinator(f"127.0.0.1:{coordinator_port}", 1, 2, 10.0)
    thread.join(timeout=10)
    assert list(results["host"]) == [1] and list(peer) == [0]
    for connection in [*results["host"].values(), *peer.values()]:
        connection.close()


def _watched_pair(monkeypatch, timeout_s: float = 0.6):
    """A JobWatch on one end of a socket pair; abort_job records instead of ending the test."""
    ours, theirs = socket.socketpair()
    lost: list[str] = []
    monkeypatch.setattr(distributed, "abort_job", lambda error, *_: lost.append(str(error)))
    monkeypatch.setattr(distributed.atexit, "register", lambda *_: None)
    watch = distributed.JobWatch({1: ours}, 0, 2, timeout_s)
    watch.start()
    return watch, theirs, lost


def _wait_for(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_peer_that_dies_ends_the_job(monkeypatch):
    watch, theirs, lost = _watched_pair(monkeypatch)
    theirs.close()  # no goodbye: the process died
    _wait_for(lambda: lost)
    watch.closing.set()
    assert lost and "process 1 closed its connection without finishing (died)" in lost[0]


def test_a_peer_that_hangs_ends_the_job_after_the_heartbeat_timeout(monkeypatch):
    watch, theirs, lost = _watched_pair(monkeypatch)  # the peer stays connected but silent
    started = time.monotonic()
    _wait_for(lambda: lost)
    waited = time.monotonic() - started
    watch.closing.set()
    theirs.close()
    assert lost and "process 1 sent no heartbeat for 0.6s (hung or stopped)" in lost[0]
    assert 0.6 <= waited < 5


def test_a_peer_that_finishes_is_not_taken_for_a_dead_one(monkeypatch):
    watch, theirs, lost = _watched_pair(monkeypatch)
    beating = threading.Event()

    def heartbeat_then_goodbye() -> None:
        for _ in range(8):  # alive for about 1.6 s, longer than the 0.6 s timeout
            theirs.sendall(distributed._BEAT)
            time.sleep(0.2)
        theirs.sendall(distributed._BYE)
        theirs.close()
        beating.set()

    threading.Thread(target=heartbeat_then_goodbye, daemon=True).start()
    beating.wait(timeout=10)
    time.sleep(1.0)  # well past the timeout after the goodbye
    watch.closing.set()
    assert lost == []
