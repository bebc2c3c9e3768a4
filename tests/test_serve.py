"""``kbackend serve``: the HTTP endpoint, its input validation, micro-batching, a burst of requests.

Every socket is on 127.0.0.1.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kbackend.cache import PredictionCache, Rounding, open_store
from kbackend.errors import ConfigError
from kbackend.serving import server as server_module
from kbackend.serving.model import BatchPredictor
from kbackend.serving.server import (
    MAX_BODY_BYTES,
    MicroBatcher,
    PredictionServer,
    body_limit,
    check_loopback,
    check_port,
)
from tests.conftest import ROOT
from tests.test_cache import ATOL, FEATURES, rows, tiny_model

LOOPBACK = "127.0.0.1"


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1)


@pytest.fixture
def server(model, tmp_path):
    store = open_store(str(tmp_path / "serve.db"))
    cache = PredictionCache(model, store, Rounding(2))
    srv = PredictionServer(LOOPBACK, 0, predict=cache.predict, row_shape=(FEATURES,),
                           info={"model": "tiny"}, cache_stats=lambda: cache.stats().to_dict(),
                           max_wait_ms=5)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=10)
    store.close()


def request(srv: PredictionServer, method: str, path: str, body: bytes | str | None = None):
    host, port = srv.server_address[:2]
    assert host == LOOPBACK
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_serve_answers_a_request_with_the_models_predictions(server, model):
    x = rows(3, seed=5)
    status, payload = request(server, "POST", "/predict", json.dumps({"inputs": x.tolist()}))
    assert status == 200
    rounded = np.round(x.astype(np.float64), 2).astype(np.float32)
    np.testing.assert_allclose(np.array(payload["predictions"]), model.predict(rounded, verbose=0),
                               atol=ATOL)
    status, health = request(server, "GET", "/health")
    assert status == 200 and health["status"] == "ok"
    status, stats = request(server, "GET", "/stats")
    assert stats["requests"] == 1 and stats["cache"]["misses"] == 3


@pytest.mark.parametrize(("body", "status", "message"), [
    ("{not json", 400, "invalid JSON"),
    (b"\xff\xfe", 400, "invalid JSON"),
    ('[[1, 2, 3, 4]]', 400, 'expected a JSON object {"inputs"'),
    ('{"rows": [[1, 2, 3, 4]]}', 400, 'expected a JSON object {"inputs"'),
    ('{"inputs": [[1, 2, 3]]}', 422,
     r"expected shape (N, 4) (4 features per row), received (1, 3)"),
    ('{"inputs": [1, 2, 3, 4]}', 422, "expected shape (N, 4)"),
    ('{"inputs": [[1, 2, 3, 4], [1, 2]]}', 422, "rectangular array"),
    ('{"inputs": [[1, 2, NaN, 4]]}', 422, "NaN in 1 row"),
    ('{"inputs": [[1, 2, Infinity, 4]]}', 422, "inf in 1 row"),
    ('{"inputs": [["a", "b", "c", "d"]]}', 422, "expected numbers"),
    ('{"inputs": [[true, false, true, false]]}', 422, "expected numbers"),
    ('{"inputs": []}', 422, "expected shape"),
])
def test_serve_rejects_bad_requests_with_4xx_and_a_clear_message(server, body, status, message):
    got_status, payload = request(server, "POST", "/predict", body)
    assert got_status == status
    assert message in payload["error"]
    assert request(server, "GET", "/stats")[1]["requests"] == 0  # nothing reached the model


def raw_request(srv: PredictionServer, head: str, body: bytes = b"", *,
                end_body: bool = True) -> tuple[int, dict]:
    """Send ``head`` (request line and headers, CRLF added) and ``body`` on one socket.

    Returns the status and the JSON body.

    ``end_body=False`` keeps the sending side open: the answer must come without the client closing.
    """
    with socket.create_connection(srv.server_address[:2], timeout=30) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n\r\n" + body)
        if end_body:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    response = b"".join(chunks)
    assert response, "the server closed the connection without an answer"
    header_block, _, content = response.partition(b"\r\n\r\n")
    status_line, *headers = header_block.decode("latin-1").split("\r\n")
    assert "content-type: application/json" in (h.lower() for h in headers), header_block
    return int(status_line.split()[1]), json.loads(content)


VALID = json.dumps({"inputs": [[0.1, 0.2, 0.3, 0.4]]})
POST = "POST /predict HTTP/1.1\nHost: localhost\nContent-Type: application/json"


def _nested(depth: int) -> bytes:
    return ('{"inputs": ' + "[" * depth + "]" * depth + "}").encode()


def _sized(body: bytes) -> tuple[str, bytes]:
    return f"{POST}\nContent-Length: {len(body)}", body


# (name, head, body, end_body, status, message). end_body=False: the client does not finish sending
# (the body is longer than it says, or still coming): the server answers without reading it.
BAD_REQUESTS = [
    ("no Content-Length", POST, VALID.encode(), True, 411, "missing Content-Length header"),
    ("chunked", POST + "\nTransfer-Encoding: chunked", b"5\r\nhello\r\n0\r\n\r\n", True, 411,
     "Transfer-Encoding is not supported"),
    ("negative length", POST + "\nContent-Length: -1", b"x" * 200_000, False, 400,
     "invalid Content-Length '-1'"),
    ("text length", POST + "\nContent-Length: ten", VALID.encode(), False, 400,
     "invalid Content-Length 'ten'"),
    ("signed length", POST + "\nContent-Length: +5", VALID.encode(), False, 400,
     "invalid Content-Length '+5'"),
    ("underscored length", POST + "\nContent-Length: 1_0", VALID.encode(), False, 400,
     "invalid Content-Length"),
    ("conflicting lengths", POST + "\nContent-Length: 3\nContent-Length: 4", b"{}", False, 400,
     "conflicting Content-Length"),
    ("length over the limit", POST + f"\nContent-Length: {MAX_BODY_BYTES + 1}", b"[" * 1000, False,
     413, "exceeds the limit of"),
    ("5,000-digit length", POST + "\nContent-Length: " + "9" * 5000, b"", False, 413,
     "exceeds the limit"),
    ("incomplete body", POST + "\nContent-Length: 100", b'{"inputs": ', True, 400,
     "received 11 of 100 bytes"),
    ("text/plain",
     POST.replace("application/json", "text/plain") + f"\nContent-Length: {len(VALID)}",
     VALID.encode(), False, 415, "unsupported Content-Type 'text/plain'"),
    ("form (curl -d default)",
     POST.replace("application/json", "application/x-www-form-urlencoded")
     + f"\nContent-Length: {len(VALID)}", VALID.encode(), False, 415, "expected application/json"),
    ("latin-1 JSON", POST + "; charset=latin-1" + f"\nContent-Length: {len(VALID)}",
     VALID.encode(), False, 415, "(UTF-8)"),
    ("5,000-digit integer", *_sized(('{"inputs": [[' + "7" * 5000 + ", 1, 2, 3]]}").encode()),
     True, 400, "invalid JSON: a number of 5000 characters; expected at most 400"),
    ("5,000-digit float", *_sized(('{"inputs": [[0.' + "7" * 5000 + ", 1, 2, 3]]}").encode()),
     True, 400, "a number of 5002 characters"),
    ("nested 100,000 deep", *_sized(_nested(100_000)), True, 400,
     "invalid JSON: nested too deeply"),
    ("nested 100 deep", *_sized(_nested(100)), True, 422, "expected a rectangular array"),
    ("bad request line", "GARBAGE", b"", True, 400, "Bad request"),
    ("unsupported method", "PUT /predict HTTP/1.1\nHost: localhost", b"", True, 501,
     "Unsupported method"),
    ("unknown path", "POST /nope HTTP/1.1\nContent-Length: 100000", b"{", False, 404,
     "unknown path '/nope'"),
]


@pytest.mark.parametrize(("head", "body", "end_body", "status", "message"),
                         [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_serve_answers_every_bad_request_with_a_json_error_and_keeps_serving(
        server, capfd, head, body, end_body, status, message):
    got_status, payload = raw_request(server, head, body, end_body=end_body)
    assert (got_status, payload["status"]) == (status, status)
    assert message in payload["error"]
    assert "\n" not in payload["error"] and len(payload["error"]) < 400
    assert request(server, "POST", "/predict", VALID)[0] == 200, "the server still answers"
    stats = request(server, "GET", "/stats")[1]
    assert (stats["requests"], stats["rejected"]) == (1, 1)
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("content_type", [
    "application/json", "application/json; charset=utf-8", 'Application/JSON;charset="UTF-8"',
    "application/vnd.kbackend+json", None,
])
def test_serve_accepts_json_content_types_and_no_content_type(server, content_type):
    header = "" if content_type is None else f"\nContent-Type: {content_type}"
    head = f"POST /predict HTTP/1.1\nHost: localhost{header}\nContent-Length: {len(VALID)}"
    status, payload = raw_request(server, head, VALID.encode())
    assert status == 200 and np.array(payload["predictions"]).shape == (1, 3)


def test_an_idle_connection_is_closed_after_the_timeout_without_a_traceback(server, capfd,
                                                                           monkeypatch):
    monkeypatch.setattr(server_module._Handler, "timeout", 0.5)
    with socket.create_connection(server.server_address[:2], timeout=30) as idle:
        assert request(server, "POST", "/predict", VALID)[0] == 200, "others are served meanwhile"
        assert idle.recv(65536) == b"", "closed without an answer: no request was started"
    assert "Traceback" not in capfd.readouterr().err


def test_serve_unknown_path_and_too_many_rows(server):
    assert request(server, "GET", "/nope")[0] == 404
    assert request(server, "POST", "/other", "{}")[0] == 404
    big = json.dumps({"inputs": np.zeros((5000, FEATURES)).tolist()})
    status, payload = request(server, "POST", "/predict", big)
    assert status == 413 and "exceed the limit of 4096" in payload["error"]


@pytest.mark.slow
def test_serve_survives_a_burst_of_concurrent_requests(server, model):
    requests_count, threads = 96, 16
    inputs = [rows(1 + i % 5, seed=100 + i) for i in range(requests_count)]

    def send(x):
        return request(server, "POST", "/predict", json.dumps({"inputs": x.tolist()}))

    started = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        answers = list(pool.map(send, inputs, timeout=120))
    assert time.monotonic() - started < 120
    for x, (status, payload) in zip(inputs, answers, strict=True):
        assert status == 200
        rounded = np.round(x.astype(np.float64), 2).astype(np.float32)
        np.testing.assert_allclose(np.array(payload["predictions"]),
                                   model.predict(rounded, verbose=0), atol=ATOL)
    stats = request(server, "GET", "/stats")[1]
    assert stats["requests"] == requests_count and stats["rows"] == sum(len(x) for x in inputs)
    assert stats["cache"]["rows"] == stats["rows"]


def test_micro_batcher_predicts_waiting_requests_together():
    release, first_call = threading.Event(), threading.Event()
    calls: list[int] = []

    def slow_predict(x):
        calls.append(len(x))
        first_call.set()
        release.wait(30)
        return x * 2

    batcher = MicroBatcher(slow_predict, max_wait_s=0.2)
    try:
        with ThreadPoolExecutor(8) as pool:
            first = pool.submit(batcher.submit, np.ones((1, 2), np.float32))
            assert first_call.wait(30)  # the worker is busy with the first request ...
            rest = [pool.submit(batcher.submit, np.full((2, 2), i, np.float32)) for i in range(7)]
            while batcher._queue.qsize() < 7:  # ... while seven more queue up
                time.sleep(0.005)
            release.set()
            np.testing.assert_array_equal(first.result(30), np.full((1, 2), 2))
            for i, future in enumerate(rest):
                np.testing.assert_array_equal(future.result(30), np.full((2, 2), 2 * i))
        assert calls == [1, 14], "the seven waiting requests are predicted in one call"
        assert batcher.stats()["batches"] == 2
    finally:
        release.set()
        batcher.close()


def test_micro_batcher_passes_errors_to_every_waiting_request():
    batcher = MicroBatcher(lambda x: 1 / 0, max_wait_s=0.001)
    try:
        with pytest.raises(ZeroDivisionError):
            batcher.submit(np.ones((1, 2), np.float32), timeout_s=30)
    finally:
        batcher.close()


def test_only_loopback_addresses_are_served():
    assert check_loopback("127.0.0.1") == "127.0.0.1"
    assert check_loopback("localhost").startswith("127.")
    for host in ("0.0.0.0", "192.0.2.1"):
        with pytest.raises(ConfigError, match="loopback addresses only"):
            check_loopback(host)


@pytest.mark.slow
def test_serve_command_end_to_end(model, tmp_path, backend):
    model_file = tmp_path / "tiny.keras"
    model.save(model_file)
    cache_file = tmp_path / "cli.db"
    # A fresh process: the server runs until SIGTERM, and its shutdown path is what flushes
    # counters.
    proc = subprocess.Popen(
        [sys.executable, "-m", "kbackend", "serve", "--model", str(model_file), "--port", "0",
         "--cache", str(cache_file), "--decimals", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "KERAS_BACKEND": backend},
    )
    try:
        line = proc.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)/predict", line)
        assert match, (f"no URL in {line!r}; "
                       f"stderr: {proc.stderr.read() if proc.poll() is not None else ''}")
        port = int(match.group(1))
        fake = type("S", (), {"server_address": (LOOPBACK, port)})
        x = rows(2, seed=9)
        status, payload = request(fake, "POST", "/predict", json.dumps({"inputs": x.tolist()}))
        assert status == 200 and np.array(payload["predictions"]).shape == (2, 3)
        assert request(fake, "POST", "/predict", "{bad")[0] == 400
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    summary = out[out.index("stopped after"):]
    assert re.search(r"stopped after \d+ s: 1 requests answered, 1 rejected; 2 rows in 1 batches",
                     summary), summary
    assert re.search(r"cache: 0 hits, 2 misses \(0% of 2 rows\), 2 stored; latency p50", summary)
    assert "{" not in summary  # readable lines, not a dict
    with open_store(str(cache_file), create=False) as store:
        (info,) = store.namespaces()
        assert (info.entries, info.misses) == (2, 2), (
            "the server's counters were flushed on shutdown")


def test_batch_predictor_is_used_without_cache(model):
    srv = PredictionServer(LOOPBACK, 0, predict=BatchPredictor(model), row_shape=(FEATURES,),
                           info={})
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        status, payload = request(srv, "POST", "/predict", json.dumps({"inputs": rows(2).tolist()}))
        assert status == 200
        np.testing.assert_allclose(np.array(payload["predictions"]),
                                   model.predict(rows(2), verbose=0), atol=ATOL)
        assert "cache" not in request(srv, "GET", "/stats")[1]
    finally:
        srv.shutdown()
        srv.server_close()


def test_serve_port_out_of_range_is_one_line_exit_2(cli):
    for port in ("99999", "65536"):
        result = cli("serve", "--model", "missing.keras", "--port", port)
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
        assert (f"Invalid --port. Expected an integer from 0 (any free port) to 65535. "
                f"Received: {port}.") in result.stderr
    result = cli("serve", "--model", "missing.keras", "--port", "-1")
    # before the model is looked at
    assert result.returncode == 2 and "Received: -1" in result.stderr


def test_serve_port_in_use_is_one_line_exit_2(cli):
    with socket.socket() as taken:
        taken.bind((LOOPBACK, 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = cli("serve", "--model", "missing.keras", "--port", port)
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
        assert (f"Cannot listen on 127.0.0.1:{port}" in result.stderr
                and f"Received: --port {port}." in result.stderr)
        with pytest.raises(ConfigError, match=f"Cannot listen on 127.0.0.1:{port}"):
            PredictionServer(LOOPBACK, port, predict=lambda x: x, row_shape=(FEATURES,), info={})
        with pytest.raises(ConfigError, match=r"in use|another process"):
            check_port(LOOPBACK, port)
    assert check_port(LOOPBACK, 0) == 0


# -- bounds: memory before parsing, concurrent bodies, a whole-request deadline ----------------
@pytest.fixture
def bounded():
    """A server with small bounds (a deadline of 1 s, 2 bodies at once, 8 rows a request)."""

    def predict(x):
        return np.zeros((len(x), 3), np.float32)

    srv = PredictionServer(LOOPBACK, 0, predict=predict, row_shape=(FEATURES,), info={},
                           max_request_rows=8, max_concurrent_bodies=2, request_deadline_s=1.0,
                           body_slot_wait_s=0.2)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=10)


def _answer(sock: socket.socket) -> tuple[int, dict[str, str], dict]:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    head, _, content = b"".join(chunks).partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, json.loads(content)


def test_the_body_limit_follows_the_row_limit_and_the_models_input_size():
    assert body_limit((4,), 8) == 4096 + 8 * (4 * 64 + 64)
    assert body_limit((28, 28), 4096) == MAX_BODY_BYTES  # large rows: the absolute cap
    assert body_limit((None, 3), 8) == MAX_BODY_BYTES  # a free dimension: nothing to derive
    assert body_limit((4,), 8, max_body_bytes=1000) == 1000


def test_a_body_beyond_what_the_row_limit_can_hold_is_refused_unread(bounded):
    limit = bounded.max_body_bytes
    head = f"{POST}\nContent-Length: {limit + 1}"
    status, payload = raw_request(bounded, head, b"[" * 100, end_body=False)
    assert status == 413 and f"exceeds the limit of {limit} (8 rows" in payload["error"]


def test_many_tiny_rows_are_counted_before_parsing(monkeypatch):
    # A 1-feature model with a large absolute cap: 2 MiB of "[0]," rows is counted, not parsed.
    monkeypatch.setattr(server_module, "PRESCAN_BYTES", 1024)
    parsed = []
    monkeypatch.setattr(server_module, "parse_json_body", lambda body: parsed.append(1))
    srv = PredictionServer(LOOPBACK, 0, predict=lambda x: x, row_shape=(1, 1), info={},
                           max_request_rows=4096)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        body = b'{"inputs": [' + b"[[0]]," * 20_000 + b"[[0]]]}"
        status, payload = raw_request(srv, f"{POST}\nContent-Length: {len(body)}", body)
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=10)
    assert status == 413 and "body holds 40003 lists: more than 4096 rows" in payload["error"]
    assert parsed == []  # refused before parsing


def test_a_request_trickling_in_is_cut_off_at_the_deadline_with_408(bounded):
    # One byte of headers, then one every 0.3 s (a deadline of 1 s; the idle timeout is 30 s).
    with socket.create_connection(bounded.server_address[:2], timeout=30) as slow:
        started = time.monotonic()
        for byte in b"POST /predict HTTP/1.1\r\nHost: x\r\n":
            try:
                slow.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.3)
            if time.monotonic() - started > 3:
                break
        status, _, payload = _answer(slow)
    assert status == 408 and "within 1s of its first byte" in payload["error"]
    assert time.monotonic() - started < 5


def test_a_body_shorter_than_its_length_gets_408_at_the_deadline(bounded):
    with socket.create_connection(bounded.server_address[:2], timeout=30) as sock:
        started = time.monotonic()
        sock.sendall(f"{POST}\nContent-Length: 100\n\n{{".replace("\n", "\r\n").encode())
        status, _, payload = _answer(sock)  # the client keeps its side open
    assert status == 408 and "received 1 of 100 bytes" in payload["error"]
    assert 0.9 < time.monotonic() - started < 5
    assert request(bounded, "POST", "/predict", VALID)[0] == 200  # still serving


def test_bodies_beyond_the_concurrent_limit_get_503_with_retry_after(bounded):
    # Two requests hold both body slots (their bodies still coming); a third waits 0.2 s for a
    # slot, then is told to retry. Once they end, requests are served again.
    holders = []
    for _ in range(2):
        sock = socket.create_connection(bounded.server_address[:2], timeout=30)
        sock.sendall(f"{POST}\nContent-Length: 50\n\n{{".replace("\n", "\r\n").encode())
        holders.append(sock)
    time.sleep(0.3)  # both are reading their bodies
    try:
        with socket.create_connection(bounded.server_address[:2], timeout=30) as third:
            third.sendall((f"{POST}\nContent-Length: {len(VALID)}\n\n".replace("\n", "\r\n")
                           + VALID).encode())
            third.shutdown(socket.SHUT_WR)
            status, headers, payload = _answer(third)
        assert status == 503 and headers["retry-after"] == "1"
        assert "busy: 2 request bodies are being read" in payload["error"]
    finally:
        for sock in holders:
            sock.close()
    time.sleep(0.3)  # the holders' handlers see their connections closed and free the slots
    assert request(bounded, "POST", "/predict", VALID)[0] == 200


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_serve_listens_on_ipv6_loopback():
    """--host ::1 serves IPv6 loopback (issue 36 item 12), and the URL says so in brackets."""
    srv = PredictionServer("::1", 0, predict=lambda x: x, row_shape=(FEATURES,), info={})
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        assert srv.url.startswith("http://[::1]:")
        conn = http.client.HTTPConnection("::1", srv.server_address[1], timeout=30)
        conn.request("POST", "/predict", body=json.dumps({"inputs": rows(2).tolist()}),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        np.testing.assert_allclose(json.loads(response.read())["predictions"], rows(2), atol=ATOL)
        conn.close()
    finally:
        srv.shutdown()
        srv.server_close()
