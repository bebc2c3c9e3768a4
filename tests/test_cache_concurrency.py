"""The SQLite store under several processes at once, and after a writer is killed mid-batch.

Run as a script, this file is the worker the tests start (it imports only the store, not Keras,
so each process starts in well under a second).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NAMESPACE = "model-under-test"
WORKERS = 4
KEYS_PER_WORKER = 400
BATCH = 50


def value_of(key: bytes) -> bytes:
    """The deterministic value every writer stores for ``key`` (so any lost or torn row shows)."""
    return hashlib.sha256(key).digest() * 4


def key_of(index: int) -> bytes:
    return index.to_bytes(8, "little")


def mixed_worker(path: str, worker: int, start_at: float) -> dict:
    """Read then write overlapping key ranges, and bump counters, all against one file."""
    from kbackend.cache.sqlite_store import SQLiteStore

    while time.time() < start_at:  # start together, so the processes really overlap
        time.sleep(0.001)
    store = SQLiteStore(path, busy_timeout_s=30)
    # Worker w writes keys [w*200, w*200 + 400): each range overlaps the next worker's by half.
    first = worker * KEYS_PER_WORKER // 2
    inserted = hits = 0
    for start in range(first, first + KEYS_PER_WORKER, BATCH):
        keys = [key_of(i) for i in range(start, start + BATCH)]
        found = store.get_many(NAMESPACE, keys)
        for key, value in zip(keys, found, strict=True):
            if value is not None and value != value_of(key):
                raise AssertionError(f"worker {worker}: wrong value for key {key.hex()}")
        hits += sum(value is not None for value in found)
        missing = [(k, value_of(k)) for k, v in zip(keys, found, strict=True) if v is None]
        inserted += store.put_many(NAMESPACE, missing)
        store.add_counters(NAMESPACE, hits=1, misses=2)
    store.close()
    return {"inserted": inserted, "hits": hits}


def endless_writer(path: str, batch: int) -> None:
    """Write batches of ``batch`` new rows, one transaction each, until killed."""
    from kbackend.cache.sqlite_store import SQLiteStore

    store = SQLiteStore(path)
    next_key = store.count()
    print("ready", flush=True)
    while True:
        keys = [key_of(i) for i in range(next_key, next_key + batch)]
        store.put_many(NAMESPACE, [(k, value_of(k)) for k in keys])
        next_key += batch


def _start(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def test_four_processes_share_one_sqlite_cache(tmp_path):
    from kbackend.cache.sqlite_store import SQLiteStore

    path = str(tmp_path / "shared.db")  # not created yet: the workers also race to initialize it
    start_at = time.time() + 1.5
    workers = [_start("mixed", path, str(w), repr(start_at)) for w in range(WORKERS)]
    results = []
    for proc in workers:
        out, err = proc.communicate(timeout=180)
        assert "database is locked" not in err
        assert proc.returncode == 0, f"worker failed: {err.strip().splitlines()[-1:]}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    expected_keys = (WORKERS + 1) * KEYS_PER_WORKER // 2  # the union of the overlapping ranges
    assert sum(r["inserted"] for r in results) == expected_keys, "each key is inserted exactly once"
    with SQLiteStore(path, create=False) as store:
        assert store.integrity_check() == "ok"
        assert store.count() == expected_keys, "no lost rows"
        keys = [key_of(i) for i in range(expected_keys)]
        assert store.get_many(NAMESPACE, keys) == [value_of(k) for k in keys]
        (info,) = store.namespaces()
        batches = WORKERS * KEYS_PER_WORKER // BATCH
        assert (info.hits, info.misses) == (batches, 2 * batches), "no lost counter updates"


def test_threads_share_one_store_object(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from kbackend.cache.sqlite_store import SQLiteStore

    with SQLiteStore(str(tmp_path / "threads.db")) as store:
        def work(worker: int) -> int:
            keys = [key_of(worker * 100 + i) for i in range(200)]
            store.get_many(NAMESPACE, keys)
            return store.put_many(NAMESPACE, [(k, value_of(k)) for k in keys])

        with ThreadPoolExecutor(8) as pool:
            inserted = sum(pool.map(work, range(8)))
        assert inserted == store.count() == 900
        assert store.integrity_check() == "ok"


@pytest.mark.parametrize("delay_s", [0.3, 0.9])
def test_writer_killed_mid_batch_leaves_a_consistent_usable_cache(tmp_path, delay_s):
    from kbackend.cache.sqlite_store import SQLiteStore

    path = str(tmp_path / "crash.db")
    batch = 500
    for _ in range(2):  # kill twice: the second writer starts on the first one's leftovers
        writer = _start("writer", path, str(batch))
        assert writer.stdout.readline().strip() == "ready", writer.stderr.read()
        time.sleep(delay_s)
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
        assert writer.returncode == -signal.SIGKILL
    with SQLiteStore(path, create=False) as store:
        assert store.integrity_check() == "ok"
        count = store.count()
        assert count > 0 and count % batch == 0, f"{count} rows: a partial batch was committed"
        keys = [key_of(i) for i in range(count)]
        assert store.get_many(NAMESPACE, keys) == [value_of(k) for k in keys]
        extra = [key_of(count + i) for i in range(10)]
        assert store.put_many(NAMESPACE, [(k, value_of(k)) for k in extra]) == 10  # still usable
        assert store.count() == count + 10


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "mixed":
        print(json.dumps(mixed_worker(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))),
              flush=True)
    elif role == "writer":
        endless_writer(sys.argv[2], int(sys.argv[3]))
