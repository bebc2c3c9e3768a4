"""Background prefetch: a host thread produces the next batches (and starts their transfer to the
device) while the current step computes.

    with Prefetcher(batches, depth=2, to_device=True) as batches:
        for x, y in batches:
            ...

``to_device=True`` copies each batch with ``kbackend.backends.impl().to_device`` on the producer
thread, so the copy overlaps compute too. A ``StepMonitor`` passed as ``monitor`` counts the time
the consumer blocks on the queue as input wait (the true wait, measured on the training thread).
Exceptions raised by the source re-raise in the consumer.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from typing import Any

from kbackend.backends import impl
from kbackend.errors import ConfigError

_DONE = object()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class Prefetcher:
    """Iterate ``source`` ``depth`` items ahead on a daemon thread."""

    def __init__(self, source: Iterable[Any], depth: int = 2, *, to_device: bool = False,
                 transfer: Callable[[Any], Any] | None = None, monitor: Any = None) -> None:
        if not isinstance(depth, int) or depth < 1:
            raise ConfigError(f"Invalid prefetch depth {depth!r}: expected an integer >= 1.")
        if to_device and transfer is None:
            transfer = impl().to_device
        self.depth = depth
        self._transfer = transfer
        self._monitor = monitor
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._source = iter(source)
        self._thread = threading.Thread(target=self._produce, name="kbackend-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        try:
            for item in self._source:
                if self._transfer is not None:
                    item = self._transfer(item)
                if not self._put(item):
                    return
        except BaseException as error:  # handed to the consumer, which re-raises it
            self._put(_Failure(error))
            return
        self._put(_DONE)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        with self._monitor.input_wait() if self._monitor is not None else nullcontext():
            item = self._queue.get()
        if item is _DONE:
            self._stop.set()
            raise StopIteration
        if isinstance(item, _Failure):
            self._stop.set()
            raise item.error
        return item

    def close(self) -> None:
        """Stop the producer thread (items not yet consumed are dropped)."""
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

