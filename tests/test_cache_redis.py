"""The Redis store against a real redis-server the test starts on a free loopback port."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kbackend.cache import CacheError, PredictionCache, Rounding, open_store

LOOPBACK = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    pytest.importorskip("redis", reason="the redis client (redis-py) is not installed")
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    port = _free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [server, "--bind", LOOPBACK, "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", str(workdir), "--protected-mode", "yes"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    import redis

    client = redis.Redis(host=LOOPBACK, port=port)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                output = proc.communicate()[0].strip().splitlines()[-1:]
                pytest.skip(f"redis-server could not be started on {LOOPBACK}:{port}: {output}")
            time.sleep(0.05)
    client.close()
    yield f"redis://{LOOPBACK}:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def store(redis_url):
    opened = open_store(redis_url)
    opened.clear()
    yield opened
    opened.close()


def test_redis_store_get_put_first_value_wins(store):
    assert store.get_many("ns", [b"a", b"b"]) == [None, None]
    assert store.put_many("ns", [(b"a", b"1"), (b"b", b"2")]) == 2
    assert store.put_many("ns", [(b"a", b"changed"), (b"c", b"3")]) == 1
    assert store.get_many("ns", [b"c", b"a", b"zz", b"b"]) == [b"3", b"1", None, b"2"]
    assert store.get_many("other", [b"a"]) == [None]
    store.add_counters("ns", hits=3, misses=4)
    store.register_model("ns", {"name": "m"})
    (info,) = store.namespaces()
    assert (info.namespace, info.entries, info.hits, info.misses, info.model) == (
        "ns", 3, 3, 4, {"name": "m"})
    assert store.clear("ns") == 3
    assert store.namespaces() == []


def test_prediction_cache_over_redis_matches_sqlite(store, tmp_path):
    from tests.test_cache import rows, tiny_model

    model = tiny_model()
    x = rows(100)
    with open_store(str(tmp_path / "c.db")) as sqlite_store:
        via_sqlite = PredictionCache(model, sqlite_store, Rounding(1)).predict(x)
    cache = PredictionCache(model, store, Rounding(1))
    first = cache.lookup(x)
    np.testing.assert_allclose(first.predictions, via_sqlite, atol=1e-6, rtol=0)
    second = cache.lookup(x)
    assert second.hit.all()
    np.testing.assert_array_equal(second.predictions, first.predictions)


def test_redis_store_under_concurrent_threads(store):
    def work(worker: int) -> int:
        keys = [(worker * 50 + i).to_bytes(4, "little") for i in range(100)]
        store.get_many("ns", keys)
        return store.put_many("ns", [(k, k * 2) for k in keys])

    with ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(work, range(8))) == 450  # overlapping ranges: each key once
    keys = [i.to_bytes(4, "little") for i in range(450)]
    assert store.get_many("ns", keys) == [k * 2 for k in keys]


def test_unreachable_redis_is_a_clear_error():
    with pytest.raises(CacheError, match="Cannot reach the Redis cache"):
        open_store(f"redis://{LOOPBACK}:{_free_port()}/0")
