"""Compiling the next batch size's call in a background thread while the current size trains
(``--batch-size auto`` with ``KBACKEND_ADAPTIVE_AHEAD=1``), and the other bookkeeping both
backends' adaptive trainers share (``SizedCalls``). Backend-free; each trainer supplies the
function that compiles.

A compilation asked for is started at the trainer's next call, not at once: by then the
programs the current size needs first are compiled (a background compilation holds the lock
they would wait for). The record says how many sizes were compiled ahead, the seconds the loop
still waited for them and the seconds of their compilation that overlapped training.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np


class AheadCompiler:
    """Background compilations by key (batch size, call length) and their record."""

    def __init__(self) -> None:
        self._threads: dict[Hashable, threading.Thread] = {}
        self._results: dict[Hashable, dict[str, Any]] = {}
        self._to_start: list[threading.Thread] = []
        self.record: dict[str, Any] = {"sizes": 0, "waited_s": 0.0, "hidden_s": 0.0}

    def request(self, key: Hashable, compile_call: Callable[[], Any]) -> None:
        """Compile ``key``'s call with ``compile_call`` in the background (started by
        ``start_pending``); a key already asked for is not compiled twice."""
        if key in self._threads:
            return
        result: dict[str, Any] = {}

        def work() -> None:
            started = time.perf_counter()
            try:
                result["compiled"] = compile_call()
            except Exception as error:  # compiled again (and raised) by the trainer
                result["error"] = error
            result["seconds"] = time.perf_counter() - started

        thread = threading.Thread(target=work, name=f"compile-ahead-{key}", daemon=True)
        self._threads[key], self._results[key] = thread, result
        self.record["sizes"] += 1
        self._to_start.append(thread)

    def start_pending(self) -> None:
        """Start the compilations asked for since the last call (the trainer's ``run``)."""
        while self._to_start:
            self._to_start.pop().start()

    def pending(self) -> list[Any]:
        """The keys asked for and not yet taken."""
        return list(self._threads)

    def compiling(self, key: Hashable) -> bool:
        """Whether ``key``'s background compilation is running now."""
        thread = self._threads.get(key)
        return thread is not None and thread.is_alive()

    def take(self, key: Hashable) -> Any | None:
        """``key``'s call compiled ahead (waiting for what is left of it), or None: not asked
        for, or failed (the trainer then compiles it, and raises its error, itself)."""
        thread = self._threads.pop(key, None)
        if thread is None:
            return None
        result = self._results.pop(key)
        start = time.perf_counter()
        if thread in self._to_start:  # asked for, not started: compiled here instead
            self._to_start.remove(thread)
            thread.start()
        thread.join()
        if "error" in result:
            return None
        waited = time.perf_counter() - start
        self.record["waited_s"] += waited
        self.record["hidden_s"] += max(0.0, result["seconds"] - waited)
        return result["compiled"]


class SizedCalls:
    """What every adaptive trainer (one device or data parallel, on either backend) keeps: its
    calls by (batch size, call length) (``_sized``), the programs compiled for each
    (``trace_counts_by_size``, and the trainer's ``trace_counts`` per length), and the noise
    norms of the calls fetched (``take_noise_norms``)."""

    trace_counts: dict[int, int]

    def _start_sized(self) -> None:
        self._sized: dict[tuple[int, int], Any] = {}
        self.trace_counts_by_size: dict[tuple[int, int], int] = {}
        self._norms: list[tuple[int, np.ndarray, np.ndarray]] = []

    def _count_trace(self, key: tuple[int, int]) -> None:
        """One more program for ``key`` = (batch size, call length)."""
        self.trace_counts_by_size[key] = self.trace_counts_by_size.get(key, 0) + 1
        self.trace_counts[key[1]] = self.trace_counts.get(key[1], 0) + 1

    def _keep_norms(self, batch: int, micro: Any, big: Any) -> None:
        self._norms.append((batch, np.asarray(micro, np.float64), np.asarray(big, np.float64)))

    def take_noise_norms(self) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """``(batch, micro (K, M), batch (K,))`` of each call fetched since the last take (data
        parallel: the micro-batches are the devices' shards, ``(K, devices)``)."""
        taken, self._norms = self._norms, []
        return taken


class MeasuredCalls(SizedCalls):
    """A one-device adaptive trainer's calls: the last step of every ``calls_between(K)``-th
    call is measured (one measured step per ``measure_every`` steps), and the next size's calls
    may be compiled ahead (``ahead``); ``_lock``: one trace or compilation at a time (the model's
    layers are shared)."""

    def _start_measured(self, measure_every: int) -> None:
        self._start_sized()
        self.measure_every = measure_every
        self._calls = 0
        self._lock = threading.Lock()
        self.ahead = AheadCompiler()

    @property
    def ahead_record(self) -> dict[str, Any]:
        """Calls compiled ahead (``AheadCompiler.record``)."""
        return self.ahead.record

    def calls_between(self, length: int) -> int:
        """Calls of ``length`` steps from one measured step to the next."""
        return max(1, round(self.measure_every / length))

    def _next_call_measures(self, length: int) -> bool:
        """Whether the call of ``length`` steps about to run measures its last step; starts the
        compilations asked for ahead."""
        measure = self._calls % self.calls_between(length) == 0
        self._calls += 1
        self.ahead.start_pending()
        return measure
