"""``kbackend serve``: the HTTP endpoint, its input validation, micro-batching and a burst of requests.

Every socket is on 127.0.0.1.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kbackend.cache import PredictionCache, Rounding, open_store
from kbackend.errors import ConfigError
from kbackend.serving.model import BatchPredictor
from kbackend.serving.server import MicroBatcher, PredictionServer, check_loopback
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
    srv = PredictionServer(LOOPBACK, 0, predict=cache.predict, row_shape=(FEATURES,), info={"model": "tiny"},
                           cache_stats=lambda: cache.stats().to_dict(), max_wait_ms=5)
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
    np.testing.assert_allclose(np.array(payload["predictions"]), model.predict(rounded, verbose=0), atol=ATOL)
    status, health = request(server, "GET", "/health")
    assert status == 200 and health["status"] == "ok"
    status, stats = request(server, "GET", "/stats")
    assert stats["requests"] == 1 and stats["cache"]["misses"] == 3


@pytest.mark.parametrize(("body", "status", "message"), [
    ("{not json", 400, "invalid JSON"),
    (b"\xff\xfe", 400, "invalid JSON"),
    ('[[1, 2, 3, 4]]', 400, 'expected a JSON object {"inputs"'),
    ('{"rows": [[1, 2, 3, 4]]}', 400, 'expected a JSON object {"inputs"'),
    ('{"inputs": [[1, 2, 3]]}', 422, r"expected shape (N, 4) (4 features per row), received (1, 3)"),
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


def test_serve_unknown_path_and_too_many_rows(server):
    assert request(server, "GET", "/nope")[0] == 404
    assert request(server, "POST", "/other", "{}")[0] == 404
    big = json.dumps({"inputs": np.zeros((5000, FEATURES)).tolist()})
    status, payload = request(server, "POST", "/predict", big)
    assert status == 413 and "exceed the limit of 4096" in payload["error"]


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
        np.testing.assert_allclose(np.array(payload["predictions"]), model.predict(rounded, verbose=0), atol=ATOL)
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


def test_serve_command_end_to_end(model, tmp_path, backend):
    model_file = tmp_path / "tiny.keras"
    model.save(model_file)
    cache_file = tmp_path / "cli.db"
    # A fresh process: the server runs until SIGTERM, and its shutdown path is what flushes counters.
    proc = subprocess.Popen(
        [sys.executable, "-m", "kbackend", "serve", "--model", str(model_file), "--port", "0",
         "--cache", str(cache_file), "--decimals", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "KERAS_BACKEND": backend},
    )
    try:
        line = proc.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)/predict", line)
        assert match, f"no URL in {line!r}; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
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
    assert "stopped" in out
    with open_store(str(cache_file), create=False) as store:
        (info,) = store.namespaces()
        assert (info.entries, info.misses) == (2, 2), "the server's counters were flushed on shutdown"


def test_batch_predictor_is_used_without_cache(model):
    srv = PredictionServer(LOOPBACK, 0, predict=BatchPredictor(model), row_shape=(FEATURES,), info={})
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        status, payload = request(srv, "POST", "/predict", json.dumps({"inputs": rows(2).tolist()}))
        assert status == 200
        np.testing.assert_allclose(np.array(payload["predictions"]), model.predict(rows(2), verbose=0), atol=ATOL)
        assert "cache" not in request(srv, "GET", "/stats")[1]
    finally:
        srv.shutdown()
        srv.server_close()
