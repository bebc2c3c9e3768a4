"""The command line: kbackend predict (with and without a cache), cache warm/stats/clear, export."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import one_line_error
from tests.test_cache import FEATURES, rows, tiny_model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    model = tiny_model(seed=2)
    model.save(folder / "tiny.keras")
    x = rows(40, seed=4)
    np.save(folder / "x.npy", x)
    rounded = np.round(x.astype(np.float64), 1).astype(np.float32)
    return {"dir": folder, "model": folder / "tiny.keras", "x": folder / "x.npy",
            "direct": np.asarray(model.predict(rounded, verbose=0)),
            "grid_direct": np.asarray(model.predict(
                np.array([[0, 0, 0, 0], [1, 0.5, 0, 0]], np.float32), verbose=0))}


def test_predict_with_cache_reports_hit_rate_and_matches_direct(cli, files, tmp_path):
    cache, out = tmp_path / "c.db", tmp_path / "y.npy"
    args = ["predict", "--model", str(files["model"]), "--input", str(files["x"]),
            "--out", str(out), "--cache", str(cache), "--decimals", "1"]
    first = cli(*args)
    assert first.returncode == 0, first.stderr
    assert "hit rate 0.0%" in first.stdout
    y = np.load(out)
    np.testing.assert_allclose(y, files["direct"], atol=1e-6, rtol=0)
    second = cli(*args)
    assert second.returncode == 0, second.stderr
    assert "hit rate 100.0% (40 hits, 0 misses" in second.stdout
    np.testing.assert_allclose(np.load(out), y, atol=0, rtol=0)

    stats = cli("cache", "stats", "--cache", str(cache), "--json")
    assert stats.returncode == 0, stats.stderr
    report = json.loads(stats.stdout)
    assert report["integrity_check"] == "ok"
    (model_info,) = report["models"]
    assert model_info["hits"] == 40 and model_info["misses"] == 40
    assert model_info["entries"] == len(np.unique(np.round(np.load(files["x"]), 1), axis=0))
    cleared = cli("cache", "clear", "--cache", str(cache))
    assert cleared.returncode == 0 and f"cleared {model_info['entries']} entries" in cleared.stdout


def test_cache_warm_grid_then_predict_hits(cli, files, tmp_path):
    cache = tmp_path / "grid.db"
    warm = cli("cache", "warm", "--model", str(files["model"]), "--cache", str(cache),
               "--grid", "0=0:1:3; 1=0,0.5; *=0")
    assert warm.returncode == 0, warm.stderr
    assert "6 rows, 6 new entries" in warm.stdout
    from kbackend.cache import open_store

    with open_store(str(cache), create=False) as store:
        (info,) = store.namespaces()
        assert info.entries == 6
        from kbackend.cache.keys import decode_values, row_keys

        grid_rows = np.array([[0, 0, 0, 0], [1, 0.5, 0, 0]], np.float32)
        values = store.get_many(info.namespace, row_keys(grid_rows))
        assert all(v is not None for v in values)
        np.testing.assert_allclose(decode_values(values, (3,)), files["grid_direct"],
                                   atol=1e-6, rtol=0)


def test_corrupt_cache_file_is_a_one_line_error_and_is_not_overwritten(cli, files, tmp_path):
    cache = tmp_path / "important.db"
    cache.write_bytes(b"\x00\x01 precious bytes that are not SQLite" * 50)
    before = cache.read_bytes()
    result = cli("predict", "--model", str(files["model"]), "--input", str(files["x"]),
                 "--out", str(tmp_path / "y.npy"), "--cache", str(cache))
    assert result.returncode == 2
    assert one_line_error(result.stderr) and "is not an SQLite database" in result.stderr
    assert cache.read_bytes() == before
    assert not (tmp_path / "y.npy").exists()
    stats = cli("cache", "stats", "--cache", str(tmp_path / "absent.db"))
    assert stats.returncode == 2 and "does not exist" in stats.stderr
    assert not (tmp_path / "absent.db").exists()


def test_predict_refuses_a_model_that_does_not_load_and_wrong_features(cli, files, tmp_path):
    broken = tmp_path / "broken.keras"
    broken.write_bytes(b"garbage")
    result = cli("predict", "--model", str(broken), "--input", str(files["x"]),
                 "--out", str(tmp_path / "y.npy"))
    assert result.returncode == 2 and "is not a .keras archive" in result.stderr
    assert one_line_error(result.stderr)
    wrong = tmp_path / "wrong.npy"
    np.save(wrong, np.zeros((3, FEATURES + 1), np.float32))
    result = cli("predict", "--model", str(files["model"]), "--input", str(wrong),
                 "--out", str(tmp_path / "y.npy"))
    assert result.returncode == 2
    assert (f"expected shape (N, {FEATURES}) ({FEATURES} features per row), "
            f"received (3, {FEATURES + 1})") in result.stderr


@pytest.mark.slow
def test_export_command_checks_both_backends(cli, files, tmp_path):
    result = cli("export", str(files["model"]), "--format", "keras", "--out", str(tmp_path / "out"),
                 "--json")
    assert result.returncode == 0, result.stderr
    manifest = json.loads(result.stdout)
    assert manifest["ok"] and {c["backend"] for c in manifest["checks"]} == {"jax", "tensorflow"}
