"""A small HTTP JSON prediction endpoint (standard library), with a micro-batcher.

    POST /predict   {"inputs": [[...], ...]}  ->  {"predictions": [[...], ...]}
    GET  /health    model fingerprint and input shape
    GET  /stats     requests, batches, rows per batch, cache hits and misses

Each request is parsed and validated on its handler thread (the statuses are in ``docs/serving.md``:
a missing length 411, a non-JSON Content-Type 415, bad JSON 400, valid JSON with the wrong shape,
dtype, NaN or inf 422, too large 413; the body limit holds while reading, since the length is
checked before a byte of the body is read), then handed to the ``MicroBatcher``: one
worker thread collects the requests that arrive within ``max_wait_ms`` of the first (up to
``max_batch`` rows) and predicts them in one call, through the cache when there is one.
Only loopback addresses are served.

Bounds on what one client can hold:

- memory before parsing: the body limit is derived from the row limit and the model's input size
  (``body_limit``: ``BYTES_PER_VALUE`` per number, at most ``MAX_BODY_BYTES``), and a body over
  ``PRESCAN_BYTES`` has its lists and numbers counted (``bytes.count``, no parsing) against what
  ``max_request_rows`` rows can hold (413 beyond);
- concurrent bodies: at most ``max_concurrent_bodies`` requests read and parse a body at once; a
  request that finds no slot within ``BODY_SLOT_WAIT_S`` gets 503 with ``Retry-After``;
- time: a request must arrive whole (request line, headers, body) within ``request_deadline_s``
  of its first byte, however slowly it trickles in; else 408 and the connection closes.
"""

from __future__ import annotations

import errno
import io
import ipaddress
import itertools
import json
import math
import operator
import queue
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from kbackend.errors import ConfigError, DataError
from kbackend.io import strict_json_text
from kbackend.serving.model import validate_inputs

MAX_BODY_BYTES = 16 * 1024 * 1024
# The most JSON bytes one number of a row may take: a float64 is at most 24 characters
# ("-1.2345678901234567e-308"), plus a separator and pretty-printing room.
BYTES_PER_VALUE = 64
BYTES_PER_ROW = 64  # a row's brackets, separator and indentation
BODY_OVERHEAD_BYTES = 4096  # {"inputs": ...} and whatever else the object holds
# Bodies larger than this have their lists and numbers counted before parsing.
PRESCAN_BYTES = 1024 * 1024
COUNT_SLACK = 64  # lists and commas a valid body may hold beyond its rows' (other keys)
MAX_CONCURRENT_BODIES = 8
BODY_SLOT_WAIT_S = 1.0  # how long a request waits for a body slot before 503
RETRY_AFTER_S = 1
REQUEST_DEADLINE_S = 10.0  # loopback only: a whole request arrives in far less
REQUEST_TIMEOUT_S = 60.0
# A float64 has at most 309 integer digits; a longer number literal can only be an attack (Python's
# int() refuses more than 4300 digits anyway, with a ValueError from inside the JSON parser).
MAX_NUMBER_CHARS = 400
# After an error sent before the body was read, the unread rest is discarded (up to this much, for
# at most LINGER_S) before closing: closing a socket with unread input sends a TCP reset, which can
# destroy the error response before the client reads it.
DRAIN_BYTES = 1024 * 1024
LINGER_S = 2.0
_JSON_MEDIA_TYPE = re.compile(r"application/(?:[a-z0-9.+-]+\+)?json")
_CONTENT_LENGTH = re.compile(r"[0-9]+")


# The longest a first request may wait for others to join its batch: beyond it a request would
# appear hung (and an infinite wait never answers).
MAX_WAIT_MS_LIMIT = 10_000.0


def check_batching_options(max_batch: int, max_wait_ms: float, max_request_rows: int) -> None:
    """Raise ``ConfigError`` unless the batching limits can serve a request (before the model
    loads)."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1 \
            or max_batch & (max_batch - 1):
        raise ConfigError(f"Invalid --max-batch. Expected a power of two >= 1 (calls are padded to "
                          f"powers of two). Received: {max_batch!r}.")
    if not (isinstance(max_wait_ms, (int, float)) and 0 <= max_wait_ms <= MAX_WAIT_MS_LIMIT):
        raise ConfigError(f"Invalid --max-wait-ms. Expected a number of milliseconds from 0 to "
                          f"{MAX_WAIT_MS_LIMIT:g}. Received: {max_wait_ms!r}.")
    if isinstance(max_request_rows, bool) or not isinstance(max_request_rows, int) \
            or max_request_rows < 1:
        raise ConfigError(f"Invalid --max-request-rows. Expected a positive number of rows. "
                          f"Received: {max_request_rows!r}.")


def _row_counts(row_shape: tuple[int | None, ...]) -> tuple[int, int] | None:
    """(JSON lists one row is written with: itself and every inner list; numbers in it), or
    None where a dimension is not fixed."""
    fixed = [int(d) for d in row_shape if d is not None]
    if len(fixed) < len(row_shape):
        return None
    return 1 + sum(itertools.accumulate(fixed[:-1], operator.mul)), math.prod(fixed)


def body_limit(row_shape: tuple[int | None, ...], max_request_rows: int,
               max_body_bytes: int = MAX_BODY_BYTES) -> int:
    """The most bytes a request body may have: what ``max_request_rows`` rows of the model's
    input take as JSON (``BYTES_PER_VALUE`` a number), at most ``max_body_bytes``."""
    counts = _row_counts(row_shape)
    if counts is None:
        return max_body_bytes
    row_bytes = counts[1] * BYTES_PER_VALUE + BYTES_PER_ROW
    return min(max_body_bytes, BODY_OVERHEAD_BYTES + max_request_rows * row_bytes)


def check_port(host: str, port: int) -> int:
    """``port`` if it is a TCP port (0: any free one) that ``host`` can listen on, else
    ``ConfigError``.

    Binding once here refuses a port in use before the model loads; the server binds again.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError("Invalid --port. Expected an integer from 0 (any free port) to 65535. "
                          f"Received: {port!r}.")
    if port:
        address = check_loopback(host)
        probe = socket.socket(address_family(address), socket.SOCK_STREAM)
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server does
            probe.bind((address, port))
        except OSError as error:
            raise _bind_error(host, port, error) from None
        finally:
            probe.close()
    return port


def address_family(address: str) -> socket.AddressFamily:
    """The socket family of an IP address string (IPv6 for ``::1``)."""
    return socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET


def _bind_error(host: str, port: int, error: OSError) -> ConfigError:
    reason = error.strerror or str(error)
    hint = " (another process listens on it: pick another --port, or 0 for any free one)" \
        if error.errno == errno.EADDRINUSE else ""
    return ConfigError(f"Cannot listen on {host}:{port}: {reason}{hint}. "
                       f"Expected a free port. Received: --port {port}.")


def check_loopback(host: str) -> str:
    """``host``'s loopback address (IPv4, or IPv6 such as ``::1``), else ``ConfigError``."""
    try:
        found = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        # IPv4 first where a name has both (localhost): the address clients try first
        found.sort(key=lambda entry: entry[0] != socket.AF_INET)
        address = ipaddress.ip_address(found[0][4][0])
    except (OSError, ValueError, IndexError, UnicodeError):
        raise ConfigError(f"Invalid --host {host!r}: it does not resolve to an address.") from None
    if not address.is_loopback:
        raise ConfigError(
            f"Invalid --host {host!r} ({address}): kbackend serve listens on loopback addresses "
            "only (127.0.0.1, localhost); put a reverse proxy in front of it to expose it."
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
                 max_wait_ms: float = 2.0, max_request_rows: int = 4096, verbose: bool = False,
                 max_body_bytes: int = MAX_BODY_BYTES,
                 max_concurrent_bodies: int = MAX_CONCURRENT_BODIES,
                 request_deadline_s: float = REQUEST_DEADLINE_S,
                 body_slot_wait_s: float = BODY_SLOT_WAIT_S, strings: bool = False) -> None:
        self.row_shape = row_shape
        self.strings = strings  # a model with a string front: rows of raw strings
        self.info = info
        self.cache_stats = cache_stats
        check_batching_options(max_batch, max_wait_ms, max_request_rows)
        self.max_request_rows = max_request_rows
        # strings have no fixed size per value: the body limit alone bounds them
        self.max_body_bytes = max_body_bytes if strings else body_limit(
            row_shape, max_request_rows, max_body_bytes)
        self.max_concurrent_bodies = max_concurrent_bodies
        self.body_slots = threading.BoundedSemaphore(max_concurrent_bodies)
        self.request_deadline_s = request_deadline_s
        self.body_slot_wait_s = body_slot_wait_s
        self.verbose = verbose
        self.started = time.time()
        self.rejected = 0
        self._rejected_lock = threading.Lock()
        address = check_loopback(host)
        self.address_family = address_family(address)  # read by socketserver's __init__
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError(
                f"Invalid port. Expected an integer from 0 to 65535. Received: {port!r}.")
        self.batcher = MicroBatcher(predict, max_batch=max_batch, max_wait_s=max_wait_ms / 1000)
        try:
            # on failure it closes itself and the batcher
            super().__init__((address, port), _Handler)
        except OSError as error:
            raise _bind_error(host, port, error) from None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        # A TCP server's host is a str: the stubs' bytes is an AF_UNIX socket's address
        if ":" in str(host):
            return f"http://[{host}]:{port}"  # type: ignore[str-bytes-safe]
        return f"http://{host}:{port}"  # type: ignore[str-bytes-safe]

    def stats(self) -> dict[str, Any]:
        stats = {"uptime_s": time.time() - self.started, "rejected": self.rejected,
                 **self.batcher.stats()}
        if self.cache_stats is not None:
            stats["cache"] = self.cache_stats()
        return stats

    def server_close(self) -> None:
        super().server_close()
        self.batcher.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hangs up or stalls is not the server's failure: no traceback in the log.
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):
            if self.verbose:
                sys.stderr.write(
                    f"connection from {client_address[0]} closed: {type(error).__name__}\n")
            return
        sys.stderr.write(f"request from {client_address[0]} failed: {type(error).__name__}: "
                         f"{_one_line(str(error))}\n")


class _RequestError(Exception):
    def __init__(self, status: HTTPStatus, message: str, *, body_unread: bool = False,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body_unread = body_unread
        self.headers = headers or {}


class _DeadlinePassed(Exception):
    """The request did not arrive whole within the server's deadline (not a ``TimeoutError``:
    the base class would close the connection without an answer)."""


class _DeadlineReader(io.RawIOBase):
    """A handler's connection input, read under its deadline: each read waits at most until
    ``handler.deadline`` (set by a request's first byte); between requests, the idle timeout."""

    def __init__(self, handler: _Handler) -> None:
        self.handler = handler

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        handler, connection = self.handler, self.handler.connection
        deadline = handler.deadline
        if deadline is None:
            connection.settimeout(handler.timeout)
        else:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _DeadlinePassed
            connection.settimeout(remaining)
        try:
            received = connection.recv_into(buffer)
        except TimeoutError:
            if deadline is None:
                raise  # idle between requests: closed quietly, as before
            raise _DeadlinePassed from None
        if received and handler.deadline is None:
            handler.deadline = time.monotonic() + handler.server.request_deadline_s
        return received


class _NumberTooLong(ValueError):
    pass


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _reject_constant(name: str) -> float:
    # JSON has no NaN or Infinity; Python's parser accepts them, so turn them into a NaN/inf the
    # input validation then reports by name (422), rather than a syntax error.
    return float(name.lower().replace("infinity", "inf"))


def _parse_float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise _NumberTooLong(
            f"a number of {len(text)} characters; expected at most {MAX_NUMBER_CHARS}")
    return float(text)


def _parse_int(text: str) -> int | float:
    # Beyond int64, numpy would make an object array; as a float it is a number (or inf: 422).
    return int(text) if len(text) <= 18 else _parse_float(text)


def parse_json_body(body: bytes) -> Any:
    """The JSON value in ``body``; ``ValueError`` with one line for anything that is not valid JSON.

    Covers what ``json.loads`` raises besides syntax errors: over-long numbers (``int()`` has a
    digit limit) and deep nesting (``RecursionError``).
    """
    try:
        return json.loads(body, parse_constant=_reject_constant, parse_int=_parse_int,
                          parse_float=_parse_float)
    except RecursionError:
        raise DataError("nested too deeply") from None
    except UnicodeDecodeError as error:
        raise DataError(f"not UTF-8 ({error.reason} at byte {error.start})") from None
    except ValueError as error:  # JSONDecodeError, _NumberTooLong, int()'s digit limit
        raise DataError(_one_line(str(error))) from None


class _Handler(BaseHTTPRequestHandler):
    server: PredictionServer
    server_version = "kbackend-serve"
    timeout = 30  # seconds a client may stall mid-request before its thread gives up
    # The base class answers an unparseable request line as HTTP/0.9: a body without status line
    # or headers. Every answer here has a status and a JSON Content-Type.
    default_request_version = "HTTP/1.0"

    deadline: float | None = None  # when the request being read must be whole

    def setup(self) -> None:
        super().setup()
        self.rfile = io.BufferedReader(_DeadlineReader(self))  # every read under the deadline

    def handle_one_request(self) -> None:
        self.deadline = None  # the next request's clock starts with its first byte
        # An answer before they are read needs them; http.server's parse_request sets command
        # to None too, which its stubs (command: str) do not allow
        self.requestline, self.command = "", None  # type: ignore[assignment]
        self.request_version = self.default_request_version
        try:
            super().handle_one_request()
        except _DeadlinePassed:  # mid request line or headers
            self._error(HTTPStatus.REQUEST_TIMEOUT, self._deadline_message())

    def _deadline_message(self, detail: str = "") -> str:
        return (f"request not received whole within {self.server.request_deadline_s:g}s of its "
                f"first byte (the server's deadline){detail}")

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.verbose:
            super().log_message(format, *args)

    def _send(self, status: HTTPStatus, payload: dict[str, Any],
              headers: dict[str, str] | None = None) -> None:
        # Strict JSON: a NaN prediction is null, recorded under "non_finite" (kbackend.io).
        body = strict_json_text(payload, indent=None).encode()
        try:
            self.connection.settimeout(self.timeout)  # writing: not the request's deadline
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            if status >= 400:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
        except (ConnectionError, TimeoutError):  # the client left: nobody to answer
            self.close_connection = True

    def _error(self, status: HTTPStatus, message: str,
               headers: dict[str, str] | None = None) -> None:
        with self.server._rejected_lock:
            self.server.rejected += 1
        self._send(status, {"error": _one_line(message), "status": int(status)}, headers)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The base class's errors (bad request line, header too long, unsupported method) as
        JSON."""
        status = HTTPStatus(code)
        self._error(status, message or status.phrase)

    def _discard_unread_body(self) -> None:
        # Lingering close: stop writing, then read and drop what the client is still sending
        # (bounded in bytes and time), so the close does not reset the connection under the error
        # response.
        try:
            self.connection.shutdown(socket.SHUT_WR)
            self.deadline = time.monotonic() + LINGER_S  # reads wait at most this long now
            deadline, discarded = self.deadline, 0
            while discarded < DRAIN_BYTES and time.monotonic() < deadline:
                chunk = self.rfile.read1(65536)
                if not chunk:
                    break
                discarded += len(chunk)
        except (OSError, _DeadlinePassed):
            pass

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(HTTPStatus.OK, {"status": "ok", **self.server.info})
        elif self.path == "/stats":
            self._send(HTTPStatus.OK, self.server.stats())
        else:
            self._error(HTTPStatus.NOT_FOUND,
                        f"unknown path {self.path!r}: use POST /predict, GET /health or /stats")

    def do_POST(self) -> None:
        try:
            self._post()
        except (ConnectionError, TimeoutError):
            # stalled or gone mid-body: closed, as the timeout says
            self.close_connection = True
        except Exception as error:  # a bug here must still answer the request, in one line
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR,
                        f"internal error: {type(error).__name__}: {error}")

    def _post(self) -> None:
        try:
            if self.path != "/predict":
                raise _RequestError(HTTPStatus.NOT_FOUND,
                                    f"unknown path {self.path!r}: use POST /predict",
                                    body_unread=True)
            x = self._read_inputs()
        except _RequestError as error:
            self._error(error.status, str(error), error.headers)
            if error.body_unread:
                self._discard_unread_body()
            return
        try:
            predictions = self.server.batcher.submit(x)
        except TimeoutError as error:
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, str(error))
            return
        except Exception as error:  # the model or the cache failed: the client is not at fault
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR,
                        f"prediction failed: {type(error).__name__}: {error}")
            return
        self._send(HTTPStatus.OK, {"predictions": predictions.tolist()})

    def _check_content_type(self) -> None:
        content_type = self.headers.get("Content-Type")
        if content_type is None:  # a client that does not say is taken to send JSON
            return
        media_type, *parameters = (part.strip().lower() for part in content_type.split(";"))
        charset = next((p.partition("=")[2].strip('"') for p in parameters
                        if p.startswith("charset=")), "utf-8")
        if not _JSON_MEDIA_TYPE.fullmatch(media_type) or charset not in ("utf-8", "utf8"):
            raise _RequestError(HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                                f"unsupported Content-Type {content_type!r}: expected "
                                "application/json (UTF-8)", body_unread=True)

    def _body_length(self) -> int:
        if self.headers.get("Transfer-Encoding") is not None:
            raise _RequestError(HTTPStatus.LENGTH_REQUIRED,
                                "Transfer-Encoding is not supported: expected a body with a "
                                "Content-Length header", body_unread=True)
        values = self.headers.get_all("Content-Length") or []
        if not values:
            raise _RequestError(HTTPStatus.LENGTH_REQUIRED,
                                "missing Content-Length header: expected the body's length in "
                                "bytes", body_unread=True)
        if len(set(values)) > 1:
            raise _RequestError(HTTPStatus.BAD_REQUEST,
                                f"conflicting Content-Length headers {values!r}",
                                body_unread=True)
        text = values[0].strip()
        if not _CONTENT_LENGTH.fullmatch(text):
            raise _RequestError(HTTPStatus.BAD_REQUEST,
                                f"invalid Content-Length {values[0][:40]!r}: expected a "
                                "non-negative integer (bytes)", body_unread=True)
        # Compare digit counts first: int() of a 5,000-digit header would itself fail.
        limit = self.server.max_body_bytes
        if len(text.lstrip("0")) > len(str(limit)) or int(text) > limit:
            raise _RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                f"body of {text[:40]} bytes exceeds the limit of {limit} "
                                f"({self.server.max_request_rows} rows of this model's input)",
                                body_unread=True)
        return int(text)

    def _read_body(self, length: int) -> bytes:
        """The body, at most ``length`` bytes (the limit holds while reading), by the deadline."""
        chunks, received = [], 0
        try:
            while received < length:
                chunk = self.rfile.read1(min(length - received, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                received += len(chunk)
        except _DeadlinePassed:
            raise _RequestError(HTTPStatus.REQUEST_TIMEOUT, self._deadline_message(
                f": received {received} of {length} bytes"), body_unread=True) from None
        if received < length:
            raise _RequestError(HTTPStatus.BAD_REQUEST,
                                f"incomplete body: received {received} of {length} bytes")
        return b"".join(chunks)

    def _check_counts(self, body: bytes) -> None:
        """A large body's lists and numbers counted (no parsing) against what the row limit
        holds: a body of many tiny rows is refused before it becomes millions of objects."""
        rows, shape = self.server.max_request_rows, self.server.row_shape
        counts = _row_counts(shape)
        if len(body) <= PRESCAN_BYTES or self.server.strings or counts is None:  # strings: commas
            return
        counted = {"lists": (body.count(b"["), 1 + rows * counts[0]),
                   "numbers": (body.count(b",") + 1, rows * counts[1])}
        for what, (found, most) in counted.items():
            if found > most + COUNT_SLACK:
                raise _RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                    f"body holds {found} {what}: more than {rows} rows of shape "
                                    f"{tuple(shape)} can (the limit is {rows} rows per request)")

    def _read_inputs(self) -> np.ndarray:
        self._check_content_type()
        length = self._body_length()
        slots = self.server.body_slots
        if not slots.acquire(timeout=self.server.body_slot_wait_s):
            raise _RequestError(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"busy: {self.server.max_concurrent_bodies} request bodies are being read; "
                f"retry after {RETRY_AFTER_S}s", body_unread=True,
                headers={"Retry-After": str(RETRY_AFTER_S)})
        try:
            return self._parse_inputs(self._read_body(length))
        finally:
            slots.release()

    def _parse_inputs(self, body: bytes) -> np.ndarray:
        self._check_counts(body)
        try:
            payload = parse_json_body(body)
        except ValueError as error:
            raise _RequestError(HTTPStatus.BAD_REQUEST, f"invalid JSON: {error}") from None
        if not isinstance(payload, dict) or "inputs" not in payload:
            raise _RequestError(HTTPStatus.BAD_REQUEST,
                                'expected a JSON object {"inputs": [[...], ...]} with one list '
                                'per row')
        try:
            array = np.asarray(payload["inputs"])
        except (ValueError, RecursionError):
            raise _RequestError(HTTPStatus.UNPROCESSABLE_ENTITY,
                                "invalid inputs: expected a rectangular array (every row the "
                                "same shape)") from None
        if array.ndim >= 1 and len(array) > self.server.max_request_rows:
            raise _RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                f"{len(array)} rows exceed the limit of "
                                f"{self.server.max_request_rows} per request")
        try:
            return validate_inputs(array, self.server.row_shape, strings=self.server.strings)
        except DataError as error:
            raise _RequestError(HTTPStatus.UNPROCESSABLE_ENTITY, str(error)) from None
