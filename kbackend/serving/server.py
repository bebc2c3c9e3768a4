"""A small HTTP JSON prediction endpoint (standard library), with a micro-batcher.

    POST /predict   {"inputs": [[...], ...]}  ->  {"predictions": [[...], ...]}
    GET  /health    model fingerprint and input shape
    GET  /stats     requests, batches, rows per batch, cache hits and misses

Each request is parsed and validated on its handler thread (bad JSON: 400; valid JSON with the
wrong shape, dtype, NaN or inf: 422; too large: 413), then handed to the ``MicroBatcher``: one
worker thread collects the requests that arrive within ``max_wait_ms`` of the first (up to
``max_batch`` rows) and predicts them in one call, through the cache when there is one.
Only loopback addresses are served.
"""

from __future__ import annotations

import ipaddress
import json
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from kbackend.errors import ConfigError, DataError
from kbackend.serving.model import validate_inputs

MAX_BODY_BYTES = 16 * 1024 * 1024
REQUEST_TIMEOUT_S = 60.0


def check_loopback(host: str) -> str:
    """``host`` if it resolves to a loopback address, else ``ConfigError``."""
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        raise ConfigError(f"Invalid --host {host!r}: it does not resolve to an address.") from None
    if not address.is_loopback:
        raise ConfigError(
            f"Invalid --host {host!r} ({address}): kbackend serve listens on loopback addresses only "
            "(127.0.0.1, localhost); put a reverse proxy in front of it to expose it."
        )
    return str(address)


@dataclass
class _Pending:
    x: np.ndarray
    done: threading.Event = field(default_factory=threading.Event)
    result: np.ndarray | None = None
    error: BaseException | None = None


class MicroBatcher:
    """Collects concurrent requests for up to ``max_wait_s`` and predicts them in one call."""

    def __init__(self, predict: Callable[[np.ndarray], np.ndarray], *, max_batch: int = 1024,
                 max_wait_s: float = 0.002) -> None:
        self.predict = predict
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._lock = threading.Lock()
        self.requests = self.batches = self.rows = self.largest_batch = 0
        self._worker = threading.Thread(target=self._run, name="micro-batcher", daemon=True)
        self._worker.start()

    def submit(self, x: np.ndarray, timeout_s: float = REQUEST_TIMEOUT_S) -> np.ndarray:
        """Predictions for the validated batch ``x``, computed together with concurrent requests."""
        pending = _Pending(x)
        self._queue.put(pending)
        if not pending.done.wait(timeout_s):
            raise TimeoutError(f"prediction did not finish within {timeout_s:.0f}s")
        if pending.error is not None:
            raise pending.error
        assert pending.result is not None
        return pending.result

    def _collect(self, first: _Pending) -> tuple[list[_Pending], bool]:
        items, rows = [first], len(first.x)
        deadline = time.monotonic() + self.max_wait_s
        while rows < self.max_batch:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                item = self._queue.get(timeout=remaining)
            except queue.Empty:
                break
            if item is None:
                return items, True
            items.append(item)
            rows += len(item.x)
        return items, False

    def _run(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is None:
                break
            items, stopping = self._collect(first)
            try:
                predictions = self.predict(np.concatenate([item.x for item in items]))
                offset = 0
                for item in items:
                    item.result = predictions[offset:offset + len(item.x)]
                    offset += len(item.x)
            except BaseException as error:  # every waiting request gets the error, none hangs
                for item in items:
                    item.error = error
            with self._lock:
                self.requests += len(items)
                self.batches += 1
                rows = sum(len(item.x) for item in items)
                self.rows += rows
                self.largest_batch = max(self.largest_batch, rows)
            for item in items:
                item.done.set()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "requests": self.requests, "batches": self.batches, "rows": self.rows,
                "largest_batch_rows": self.largest_batch,
                "requests_per_batch": self.requests / self.batches if self.batches else 0.0,
            }

    def close(self) -> None:
        self._queue.put(None)
        self._worker.join(timeout=10)


class PredictionServer(ThreadingHTTPServer):
    """The HTTP server: a thread per connection, all predictions through one ``MicroBatcher``."""

    daemon_threads = True
    # socketserver's default listen backlog is 5: a burst of connections beyond it while the
    # accept loop is busy gets reset. 128 matches common kernel defaults (somaxconn).
    request_queue_size = 128

    def __init__(self, host: str, port: int, *, predict: Callable[[np.ndarray], np.ndarray],
                 row_shape: tuple[int | None, ...], info: dict[str, Any],
                 cache_stats: Callable[[], dict[str, Any]] | None = None, max_batch: int = 1024,
                 max_wait_ms: float = 2.0, max_request_rows: int = 4096, verbose: bool = False) -> None:
        self.row_shape = row_shape
        self.info = info
        self.cache_stats = cache_stats
        self.max_request_rows = max_request_rows
        self.verbose = verbose
        self.started = time.time()
        self.rejected = 0
        self._rejected_lock = threading.Lock()
        self.batcher = MicroBatcher(predict, max_batch=max_batch, max_wait_s=max_wait_ms / 1000)
        super().__init__((check_loopback(host), port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def stats(self) -> dict[str, Any]:
        stats = {"uptime_s": time.time() - self.started, "rejected": self.rejected, **self.batcher.stats()}
        if self.cache_stats is not None:
            stats["cache"] = self.cache_stats()
        return stats

    def server_close(self) -> None:
        super().server_close()
        self.batcher.close()


class _RequestError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


def _reject_constant(name: str) -> float:
    # JSON has no NaN or Infinity; Python's parser accepts them, so turn them into a NaN/inf the
    # input validation then reports by name (422), rather than a syntax error.
    return float(name.lower().replace("infinity", "inf"))


class _Handler(BaseHTTPRequestHandler):
    server: PredictionServer
    server_version = "kbackend-serve"
    timeout = 30  # seconds a client may stall mid-request before its thread gives up

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.verbose:
            super().log_message(format, *args)

    def _send(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: HTTPStatus, message: str) -> None:
        with self.server._rejected_lock:
            self.server.rejected += 1
        self._send(status, {"error": message, "status": int(status)})

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(HTTPStatus.OK, {"status": "ok", **self.server.info})
        elif self.path == "/stats":
            self._send(HTTPStatus.OK, self.server.stats())
        else:
            self._error(HTTPStatus.NOT_FOUND, f"unknown path {self.path!r}: use POST /predict, GET /health or /stats")

    def do_POST(self) -> None:
        if self.path != "/predict":
            self._error(HTTPStatus.NOT_FOUND, f"unknown path {self.path!r}: use POST /predict")
            return
        try:
            x = self._read_inputs()
        except _RequestError as error:
            self._error(error.status, str(error))
            return
        try:
            predictions = self.server.batcher.submit(x)
        except TimeoutError as error:
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, str(error))
            return
        except Exception as error:  # the model or the cache failed: the client is not at fault
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"prediction failed: {type(error).__name__}: {error}")
            return
        self._send(HTTPStatus.OK, {"predictions": predictions.tolist()})

    def _read_inputs(self) -> np.ndarray:
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            raise _RequestError(HTTPStatus.LENGTH_REQUIRED, "missing Content-Length header")
        try:
            length = int(length_header)
        except ValueError:
            raise _RequestError(HTTPStatus.BAD_REQUEST, f"invalid Content-Length {length_header!r}") from None
        if length > MAX_BODY_BYTES:
            raise _RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                f"body of {length} bytes exceeds the limit of {MAX_BODY_BYTES}")
        body = self.rfile.read(length)
        try:
            payload = json.loads(body, parse_constant=_reject_constant)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise _RequestError(HTTPStatus.BAD_REQUEST, f"invalid JSON: {error}") from None
        if not isinstance(payload, dict) or "inputs" not in payload:
            raise _RequestError(HTTPStatus.BAD_REQUEST,
                                'expected a JSON object {"inputs": [[...], ...]} with one list per row')
        try:
            array = np.asarray(payload["inputs"])
        except ValueError:
            raise _RequestError(HTTPStatus.UNPROCESSABLE_ENTITY,
                                "invalid inputs: expected a rectangular array (every row the same shape)") from None
        if array.ndim >= 1 and len(array) > self.server.max_request_rows:
            raise _RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                f"{len(array)} rows exceed the limit of {self.server.max_request_rows} per request")
        try:
            return validate_inputs(array, self.server.row_shape)
        except DataError as error:
            raise _RequestError(HTTPStatus.UNPROCESSABLE_ENTITY, str(error)) from None
