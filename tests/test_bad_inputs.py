"""Small bad inputs of predict, serve, cache warm and export: each a one-line error with exit
status 2 before any work, and no output file appears (issue 14, must hold 1 and 7).

Every case runs the command line in this process; a model file is only loaded after the flags
were checked, so most cases need none (the model path does not even exist). Cases with the real
model ({tiny}) are refused after it loads, and before the cache is created: no cache file appears.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from kbackend.cache import PredictionCache, Rounding, open_store
from kbackend.errors import ConfigError
from kbackend.io import strict_json_text
from tests.conftest import one_line_error
from tests.test_cache import FEATURES, rows, tiny_model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad_inputs")
    tiny_model(seed=1).save(folder / "tiny.keras")
    np.save(folder / "x.npy", rows(8))
    np.save(folder / "x3.npy", rows(8)[:, :3])
    (folder / "x.txt").write_text("0.1 0.2 0.3 0.4\n")
    (folder / "empty.keras").write_bytes(b"")
    whole = (folder / "tiny.keras").read_bytes()
    (folder / "truncated.keras").write_bytes(whole[: len(whole) // 2])
    return folder


# (argv with {model}/{x}/{out}/{cache} placeholders, what the one line must say)
CASES = {
    "predict decimals 400": (["predict", "--model", "{model}", "--input", "{x}", "--out", "{out}",
                              "--cache", "{cache}", "--decimals", "400"], "between -15 and 15"),
    "predict decimals -16": (["predict", "--model", "{model}", "--input", "{x}", "--out", "{out}",
                              "--cache", "{cache}", "--decimals", "-16"], "Received: -16"),
    "predict per-feature 99": (["predict", "--model", "{model}", "--input", "{x}", "--out",
                                "{out}", "--cache", "{cache}", "--decimals", "2,exact,99,1"],
                               "Received: 99"),
    "serve decimals 16": (["serve", "--model", "{model}", "--cache", "{cache}", "--decimals", "16"],
                          "between -15 and 15"),
    "cache warm chunk 0": (["cache", "warm", "--model", "{model}", "--cache", "{cache}",
                            "--input", "{x}", "--chunk", "0"], "Invalid --chunk 0"),
    "cache warm chunk -2": (["cache", "warm", "--model", "{model}", "--cache", "{cache}",
                             "--input", "{x}", "--chunk", "-2"], "Invalid --chunk -2"),
    "cache warm max-rows 0": (["cache", "warm", "--model", "{model}", "--cache", "{cache}",
                               "--grid", "*=0", "--max-rows", "0"], "Invalid --max-rows 0"),
    "export rows 0": (["export", "{model}", "--out", "{out}", "--rows", "0"], "Invalid rows 0"),
    "export atol -1": (["export", "{model}", "--out", "{out}", "--atol", "-1"], "Invalid atol -1"),
    "export atol nan": (["export", "{model}", "--out", "{out}", "--atol", "nan"],
                        "Invalid atol nan"),
    "predict empty model": (["predict", "--model", "{empty}", "--input", "{x}", "--out", "{out}"],
                            "is empty (0 bytes)"),
    "predict truncated model": (["predict", "--model", "{truncated}", "--input", "{x}", "--out",
                                 "{out}"], "is not a .keras archive"),
    "cache warm truncated model": (["cache", "warm", "--model", "{truncated}", "--cache",
                                    "{cache}", "--input", "{x}"], "is not a .keras archive"),
    # The grid's syntax is checked before the model file is even looked at ({model} is missing).
    "cache warm grid bogus": (["cache", "warm", "--model", "{model}", "--cache", "{cache}",
                              "--grid", "bogus"], "expected FEATURES=VALUES"),
    "cache warm grid overlap": (["cache", "warm", "--model", "{model}", "--cache", "{cache}",
                                "--grid", "0-2=0,1; 1=5; *=0"], "feature 1 appears in more"),
    "cache warm grid huge range": (["cache", "warm", "--model", "{model}", "--cache", "{cache}",
                                   "--grid", "0-999999999999=0,1"], "at least 10^"),
    "cache warm grid negative range": (["cache", "warm", "--model", "{model}", "--cache",
                                       "{cache}", "--grid", "3-1=0"], "LOW <= HIGH"),
    "cache warm input not npy": (["cache", "warm", "--model", "{model}", "--cache", "{cache}",
                                  "--input", "{text}"], "without a NumPy header"),
    # Checks that need the model run after it loads, and before the cache file is created.
    "cache warm grid feature 9": (["cache", "warm", "--model", "{tiny}", "--cache", "{cache}",
                                   "--grid", "9=0"], "the model takes 4 features"),
    "cache warm input shape": (["cache", "warm", "--model", "{tiny}", "--cache", "{cache}",
                                "--input", "{x3}"], "expected shape (N, 4)"),
    "cache warm decimals per feature": (["cache", "warm", "--model", "{tiny}", "--cache",
                                         "{cache}", "--grid", "*=0", "--decimals", "1,2"],
                                        "one value per feature"),
    "predict cached input shape": (["predict", "--model", "{tiny}", "--input", "{x3}", "--out",
                                    "{out}", "--cache", "{cache}"], "expected shape (N, 4)"),
    "predict decimals per feature": (["predict", "--model", "{tiny}", "--input", "{x}", "--out",
                                      "{out}", "--cache", "{cache}", "--decimals", "1,2"],
                                     "one value per feature"),
    "serve decimals per feature": (["serve", "--model", "{tiny}", "--port", "0", "--cache",
                                    "{cache}", "--decimals", "1,2"], "one value per feature"),
    "predict cache in a missing folder": (["predict", "--model", "{tiny}", "--input", "{x}",
                                           "--out", "{out}", "--cache", "{nowhere}"],
                                          "does not exist"),
    # Sizes: a model whose training state would not fit in memory is refused before it is built.
    "train gru units 1e9": (["train", "--model", "gru", "--units", "1000000000", "--history",
                             "{out}"], "Invalid --units 1000000000: "),
    "train mlp widths 1e9": (["train", "--model", "mlp", "--widths", "64,1000000000",
                              "--history", "{out}"], "Invalid --widths 64,1000000000: "),
    "train cnn filters 1e9": (["train", "--model", "cnn", "--filters", "1000000000,2",
                               "--history", "{out}"], "Invalid --filters 1000000000,2: "),
    "train cnn1d filters 1e9": (["train", "--model", "cnn1d", "--filters", "10,1000000000",
                                 "--history", "{out}", "--engine", "keras"],
                                "Invalid --filters 10,1000000000: "),
    "train mlp 10000 layers": (["train", "--model", "mlp", "--widths", ",".join(["1"] * 10000),
                                "--history", "{out}"], "expected at most 256 layers"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(cli, files, tmp_path, case):
    argv, message = CASES[case]
    # each command's output with the suffix it requires: predictions .npy, a history .json,
    # an export a folder
    out = {"predict": "out.npy", "train": "out.json"}.get(argv[0], "out")
    places = {"model": tmp_path / "never_loaded.keras", "x": files / "x.npy",
              "out": tmp_path / out, "cache": tmp_path / "cache.db",
              "empty": files / "empty.keras", "truncated": files / "truncated.keras",
              "tiny": files / "tiny.keras", "x3": files / "x3.npy", "text": files / "x.txt",
              "nowhere": tmp_path / "missing" / "cache.db"}
    if "model" in message or "archive" in message:
        places["model"] = files / "tiny.keras"
    result = cli(*[part.format(**{k: str(v) for k, v in places.items()}) for part in argv])
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert one_line_error(result.stderr), result.stderr
    assert message in result.stderr, result.stderr
    assert "File not found" not in result.stderr
    assert list(tmp_path.iterdir()) == []  # no output, cache, folder or temp file appeared


@pytest.mark.parametrize("decimals", [16, -16, 400, (2, 16), 1.5, True])
def test_rounding_refuses_decimals_that_overflow(decimals):
    with pytest.raises(ConfigError, match="Invalid decimals"):
        Rounding(decimals)


@pytest.mark.parametrize("decimals", [15, -15])
def test_rounding_at_the_limits_never_gives_nan(decimals):
    extremes = np.array([[3.4e38, -3.4e38, 1e-30, 0.123456789]], dtype=np.float32)
    assert np.isfinite(Rounding(decimals).apply(extremes)).all()


def test_cache_never_stores_a_nan_prediction(tmp_path):
    model = tiny_model(seed=3)
    model.set_weights([np.full_like(w, np.nan) for w in model.get_weights()])
    with open_store(str(tmp_path / "c.db")) as store:
        cache = PredictionCache(model, store)
        result = cache.lookup(rows(5))
        assert np.isnan(result.predictions).all()  # returned as the model gives it ...
        assert cache.stats().stored == 0  # ... but not kept
        assert not cache.lookup(rows(5)).hit.any()
    with pytest.raises(ConfigError, match="Invalid chunk"):
        PredictionCache(tiny_model(), open_store(str(tmp_path / "d.db"))).warm(rows(3), chunk=0)


def test_json_printed_is_strict():
    text = strict_json_text({"max_abs_diff": float("nan"), "rows": [1.0, float("inf")]})

    def refuse(constant):
        raise AssertionError(f"bare {constant}")

    parsed = json.loads(text, parse_constant=refuse)
    assert parsed["max_abs_diff"] is None and parsed["non_finite"] == {
        "/max_abs_diff": "NaN", "/rows/1": "Infinity"}


def test_cache_stats_json_is_strict(cli, files, tmp_path):
    cache = tmp_path / "c.db"
    assert cli("cache", "warm", "--model", files / "tiny.keras", "--cache", cache,
               "--grid", "*=0,1").returncode == 0
    result = cli("cache", "stats", "--cache", cache, "--json")
    assert result.returncode == 0
    json.loads(result.stdout, parse_constant=lambda c: pytest.fail(f"bare {c}"))
    assert FEATURES == 4


def _api_cases(files, tmp_path):
    from kbackend.cache import parse_grid
    from kbackend.io import read_arrays
    from kbackend.model_sources import load_model
    from kbackend.serving.export import export_model
    from kbackend.training import TrainConfig, train

    def cache(*args):
        store = open_store(str(tmp_path / "api.db"))
        try:
            PredictionCache(*[store if a == "STORE" else a for a in args])
        finally:
            store.close()

    model = tiny_model()
    return {
        "open_store(3)": (lambda: open_store(3), "Invalid cache"),
        "open_store(None)": (lambda: open_store(None), "Invalid cache"),
        "parse_grid(None)": (lambda: parse_grid(None, 4), "Invalid grid"),
        "parse_grid features '4'": (lambda: parse_grid("*=0", "4"), "Invalid features"),
        "train(None)": (lambda: train(None), "Invalid config"),
        "train save=3": (lambda: train(TrainConfig(), save=3), "Invalid --save path"),
        "load_model(None)": (lambda: load_model(None, serving=True), "Invalid model path"),
        "load_model('x'*300)": (lambda: load_model("x" * 300 + ".keras", serving=True),
                                "File name too long"),
        "read_arrays(None)": (lambda: read_arrays(None, "--input"), "Invalid --input"),
        "cache rounding 2": (lambda: cache(model, "STORE", 2), "Invalid rounding"),
        "cache model None": (lambda: cache(None, "STORE"), "expected a Keras model"),
        "cache store None": (lambda: PredictionCache(model, None), "Invalid store"),
        "export out None": (lambda: export_model(files / "tiny.keras", "keras", None),
                            "Invalid --out"),
        "export rows 1e7": (lambda: export_model(files / "tiny.keras", "keras", tmp_path / "e",
                                                 rows=10**7), "Invalid rows"),
    }


API_CASES = ["open_store(3)", "open_store(None)", "parse_grid(None)", "parse_grid features '4'",
             "train(None)", "train save=3", "load_model(None)", "load_model('x'*300)",
             "read_arrays(None)", "cache rounding 2", "cache model None", "cache store None",
             "export out None", "export rows 1e7"]


@pytest.mark.parametrize("case", API_CASES)
def test_python_api_arguments_raise_kbackends_own_one_line_errors(files, tmp_path, case):
    """Must hold 1: the Python API raises kbackend's errors (not TypeError / AttributeError /
    OSError from inside), before any work, and writes nothing but what it was asked to."""
    from kbackend.errors import KBackendError

    call, message = _api_cases(files, tmp_path)[case]
    with pytest.raises(KBackendError, match=message) as raised:
        call()
    assert "\n" not in str(raised.value)
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["api.db"])
