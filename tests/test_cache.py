"""The prediction cache in one process: rounding, keys, fingerprints, hits and misses, bad input."""

from __future__ import annotations

import sqlite3
import zipfile

import numpy as np
import pytest

from kbackend.cache import (
    CacheError,
    PredictionCache,
    Rounding,
    model_fingerprint,
    open_store,
    parse_grid,
)
from kbackend.errors import ConfigError, DataError
from kbackend.model_sources import load_model
from kbackend.serving.model import BatchPredictor, ModelError, bucket_size

FEATURES = 4
ATOL = 1e-6  # one model, two batch compositions: float32 XLA results may differ in the last bits


def tiny_model(seed: int = 0):
    from kbackend.backend_choice import keras as import_keras

    keras = import_keras()
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((FEATURES,), name="inputs")
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    outputs = keras.layers.Dense(3, activation="softmax")(hidden)
    return keras.Model(inputs, outputs, name="tiny")


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture
def store(tmp_path):
    with open_store(str(tmp_path / "cache.db")) as opened:
        yield opened


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((n, FEATURES), dtype=np.float32)


class CountingPredictor(BatchPredictor):
    """A BatchPredictor that records the size of every call."""

    def __init__(self, model):
        super().__init__(model)
        self.calls: list[int] = []

    def __call__(self, x):
        self.calls.append(len(x))
        return super().__call__(x)


def test_cached_predictions_equal_direct_predictions_of_rounded_inputs(model, store):
    cache = PredictionCache(model, store, Rounding(1))
    x = rows(200)
    first = cache.lookup(x)
    rounded = np.round(x.astype(np.float64), 1).astype(np.float32)
    np.testing.assert_array_equal(first.rounded, rounded)
    direct = np.asarray(model.predict(rounded, verbose=0))
    np.testing.assert_allclose(first.predictions, direct, atol=ATOL, rtol=0)
    # Rows that round alike share an entry: fewer stored entries than rows, and within one
    # batch the later duplicates are already answered from the first.
    assert cache.stats().stored == len(np.unique(rounded, axis=0))
    second = cache.lookup(x + np.float32(0.01))  # same rounding for most rows
    same_key = np.all(np.round(x + np.float32(0.01), 1) == np.round(x, 1), axis=1)
    assert second.hit[same_key].all()
    np.testing.assert_array_equal(second.predictions[same_key], first.predictions[same_key])
    np.testing.assert_allclose(second.predictions, model.predict(second.rounded, verbose=0),
                               atol=ATOL, rtol=0)


def test_exact_mode_hits_only_identical_rows(model, store):
    cache = PredictionCache(model, store)
    x = rows(50)
    cache.predict(x)
    again = cache.lookup(x)
    assert again.hit.all()
    nudged = cache.lookup(np.nextafter(x, np.float32(2)))  # one ulp away: another key
    assert not nudged.hit.any()
    np.testing.assert_allclose(again.predictions, model.predict(x, verbose=0), atol=ATOL, rtol=0)


def test_misses_are_predicted_in_one_batched_call_once_per_distinct_row(model, store):
    predictor = CountingPredictor(model)
    cache = PredictionCache(model, store, Rounding(0), predictor=predictor)
    # decimals 0: at most 2**4 distinct rows per half
    x = np.concatenate([rows(300), rows(300) + 2])
    result = cache.lookup(x)
    distinct = len(np.unique(result.rounded, axis=0))
    assert predictor.calls == [distinct]
    stats = cache.stats()
    assert (stats.rows, stats.hits, stats.misses, stats.stored) == (600, 0, 600, distinct)
    cache.lookup(x)
    assert predictor.calls == [distinct]  # all hits: the model is not called
    assert cache.stats().hits == 600 and cache.stats().hit_rate == pytest.approx(0.5)


def test_changing_one_weight_invalidates(model, store, tmp_path):
    model.save(tmp_path / "tiny.keras")
    changed = load_model(tmp_path / "tiny.keras", serving=True)
    assert model_fingerprint(changed) == model_fingerprint(model), (
        "a reloaded model keeps its fingerprint")
    x = rows(64)
    old = PredictionCache(model, store, Rounding(2))
    old.predict(x)
    kernel = changed.layers[-1].kernel
    value = np.asarray(kernel.numpy() if hasattr(kernel, "numpy") else kernel.value)
    value = np.array(value, copy=True)
    value[0, 0] += 1e-3
    kernel.assign(value)
    new = PredictionCache(changed, store, Rounding(2))
    assert new.fingerprint != old.fingerprint
    result = new.lookup(x)
    assert not result.hit.any(), "a changed model must not be answered from the old model's entries"
    np.testing.assert_allclose(result.predictions, changed.predict(result.rounded, verbose=0),
                               atol=ATOL, rtol=0)
    assert {info.namespace for info in store.namespaces()} == {old.fingerprint, new.fingerprint}


def test_per_feature_rounding_and_negative_zero():
    rounding = Rounding.parse("1,exact,0,-1")
    x = np.array([[0.26, 0.123456, 2.6, 17.0], [-0.04, -0.0, -0.4, 4.0]], dtype=np.float32)
    got = rounding.apply(x)
    want = np.array([[0.3, 0.123456, 3.0, 20.0], [0.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    np.testing.assert_array_equal(got, want)
    assert not np.signbit(got).any(), "-0.0 must become 0.0 (same answer, so the same key)"
    assert Rounding.parse("exact").decimals is None and Rounding.parse("2").decimals == 2
    with pytest.raises(ConfigError, match="expected an integer"):
        Rounding.parse("two")
    with pytest.raises(ConfigError, match="one value per feature"):
        Rounding.parse("1,2").check((FEATURES,))


def test_bad_inputs_are_refused_with_clear_errors(model, store):
    cache = PredictionCache(model, store, Rounding(2))
    with pytest.raises(DataError,
                       match=r"expected shape \(N, 4\) \(4 features per row\), received \(2, 5\)"):
        cache.predict(np.zeros((2, 5), np.float32))
    bad = rows(3)
    bad[1, 2] = np.nan
    with pytest.raises(DataError, match=r"NaN in 1 row.*first: row 1"):
        cache.predict(bad)
    with pytest.raises(DataError, match="expected numbers"):
        cache.predict(np.array([["a", "b", "c", "d"]]))
    with pytest.raises(DataError, match="at least one row"):
        cache.predict(np.zeros((0, FEATURES), np.float32))
    assert cache.stats().rows == 0 and store.count() == 0


def _unchanged_after_refusal(path, match):
    before = path.read_bytes()
    with pytest.raises(CacheError, match=match):
        open_store(str(path))
    assert path.read_bytes() == before, "a refused cache file must not be modified"
    assert not path.with_name(path.name + "-wal").exists()


def test_non_sqlite_cache_file_is_refused_and_left_unchanged(tmp_path):
    path = tmp_path / "notes.db"
    path.write_bytes(b"these are my notes, not a database\n" * 100)
    _unchanged_after_refusal(path, "is not an SQLite database.*left unchanged")


def test_corrupt_sqlite_cache_file_is_refused_and_left_unchanged(tmp_path):
    path = tmp_path / "corrupt.db"
    with open_store(str(path)) as store:
        store.put_many("m", [(b"k%d" % i, b"v" * 12) for i in range(500)])
    data = bytearray(path.read_bytes())
    data[100:4096] = np.random.default_rng(0).integers(0, 256, 3996, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))
    for suffix in ("-wal", "-shm"):
        path.with_name(path.name + suffix).unlink(missing_ok=True)
    _unchanged_after_refusal(path, "not a usable SQLite database|not a kbackend cache|failed")


def test_another_applications_sqlite_file_is_refused_and_left_unchanged(tmp_path):
    path = tmp_path / "app.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE users (name TEXT)")
        conn.execute("INSERT INTO users VALUES ('ada')")
    conn.close()
    _unchanged_after_refusal(path, "another application.*not a kbackend cache")


def test_missing_cache_is_refused_when_not_creating(tmp_path):
    with pytest.raises(CacheError, match="does not exist"):
        open_store(str(tmp_path / "absent.db"), create=False)


def test_model_file_that_does_not_load(tmp_path):
    broken = tmp_path / "broken.keras"
    broken.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(ModelError, match=r"is not a \.keras archive"):
        load_model(broken, serving=True)
    not_keras = tmp_path / "zip.keras"
    with zipfile.ZipFile(not_keras, "w") as archive:  # a sound zip without a Keras model in it
        archive.writestr("readme.txt", "hello")
    with pytest.raises(ModelError, match="does not load as a Keras model"):
        load_model(not_keras, serving=True)
    with pytest.raises(ModelError, match="not found"):
        load_model(tmp_path / "absent.keras", serving=True)


def test_store_counters_stats_and_clear(model, store):
    cache = PredictionCache(model, store, Rounding(2))
    x = rows(10)
    cache.predict(x)
    cache.predict(x)
    cache.flush_stats()
    cache.flush_stats()  # nothing new: counters unchanged
    (info,) = store.namespaces()
    assert (info.entries, info.hits, info.misses) == (10, 10, 10)
    assert info.model == {"name": "tiny", "input_shape": [4], "output_shape": [3]}
    assert store.clear() == 10
    assert store.namespaces() == [] and store.integrity_check() == "ok"
    assert not cache.lookup(x).hit.any()  # the same cache object keeps working after a clear


def test_grid_spec():
    grid = parse_grid("0=0:1:11; 1=0,0.5,1; *=0", features=4)
    assert grid.size == 33
    all_rows = np.concatenate(list(grid.chunks(chunk=10)))
    assert all_rows.shape == (33, 4) and len(np.unique(all_rows, axis=0)) == 33
    np.testing.assert_array_equal(np.unique(all_rows[:, 0]),
                                  np.linspace(0, 1, 11).astype(np.float32))
    assert (all_rows[:, 2:] == 0).all()
    assert parse_grid("0-3=0,1", features=4).size == 16
    for spec, match in [
        ("0=0,1", "features \\[1, 2, 3\\] have no values"),
        ("7=0,1; *=0", "must lie in 0-3"),
        ("0=a,b; *=0", "expected values"),
        ("0=0:1; *=0", "START:STOP:COUNT"),
        ("0=0,1; 0=2; *=0", "more than one clause"),
        ("*=0:1:100", "more than the limit"),
    ]:
        with pytest.raises(ConfigError, match=match):
            parse_grid(spec, features=4, max_rows=1000)


def test_bucket_sizes_bound_compilations():
    assert [bucket_size(n, 1024) for n in (1, 2, 3, 5, 1000, 1024, 5000)] == [
        1, 2, 4, 8, 1024, 1024, 1024]


def test_batch_predictor_matches_predict_across_chunks(model):
    predictor = BatchPredictor(model, max_batch=64)
    x = rows(150)
    np.testing.assert_allclose(predictor(x), model.predict(x, verbose=0), atol=ATOL, rtol=0)
