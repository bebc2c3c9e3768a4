"""Prediction-cache benchmark: cached lookups vs direct predict, and hit rate vs decimals.

    python scripts/bench_cache.py [--quick] [--out DIR] [--backends jax,tensorflow] [--repeats N]

One process per backend, side by side in one run. Per backend:
1. latency (median over repeats, first call excluded, methods interleaved) and throughput of
   ``model.predict``, ``predict_on_batch`` (kbackend's bucketed BatchPredictor), cache lookups that
   all hit (SQLite, and Redis when ``redis-server`` is installed) and lookups that all miss
   (SQLite), at batch 1 and batch 1024, for the seed MLP (64-786-256-160-10) trained briefly on
   digits;
2. hit rate vs decimals on a request stream drawn from the digits test split (rows repeat, as
   popular requests do; once exact, once with sensor noise of sigma 0.01), with how often the cached
   answer's class agrees with the exact model's and the largest probability difference.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kbackend.backend_choice import keras as import_keras
from kbackend.backends import impl
from kbackend.bench.spec import Benchmark, Rows, Settings
from kbackend.cache import CacheStore, PredictionCache, Rounding, open_store
from kbackend.data import load
from kbackend.model_sources import load_model
from kbackend.models import ModelOptions, build_model
from kbackend.serving.model import BatchPredictor

DECIMALS = ("exact", "3", "2", "1", "0")
BATCHES = (1, 1024)
NOISE = (0.0, 0.01)  # sensor noise added to each request (features are in [0, 1])


def _timed(methods: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds per call of each method over ``repeats`` calls, after one excluded warm-up
    call each; the methods take turns within every repeat, so drifting machine load hits all
    alike."""
    for fn in methods.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            start = time.perf_counter()
            np.asarray(fn())  # results are host arrays: the computation has finished
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(values)) for name, values in times.items()}


def _train_model(quick: bool, folder: Path) -> tuple[Any, Any, float]:
    keras = import_keras()
    data = load("digits", layout="flat")
    impl().set_random_seed(0)
    model = build_model("seed_mlp", data.info, ModelOptions(seed=0))
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    model.fit(data.x_train, data.y_train, batch_size=64, epochs=2 if quick else 8, verbose=0)
    accuracy = float(model.evaluate(data.x_test, data.y_test, verbose=0)[1])
    model.save(folder / "seed_mlp.keras")
    return load_model(folder / "seed_mlp.keras", serving=True), data, accuracy


def measure_cache(settings: Settings) -> Rows:
    """Latency rows (method x batch) and, in the summary, hit rate vs decimals."""
    redis_url = settings.options.get("redis_url")
    folder = Path(tempfile.mkdtemp(prefix="bench_cache."))
    try:
        model, data, accuracy = _train_model(settings.quick, folder)
        predictor = BatchPredictor(model)
        rng = np.random.default_rng(0)
        latency = []
        for batch in BATCHES:
            repeats = (settings.rounds(quick=5, full=30) if batch == 1
                       else settings.rounds(quick=3, full=10))
            x = data.x_train[rng.integers(0, len(data.x_train), batch)]
            methods, stores = _lookup_methods(model, predictor, x, folder, redis_url)
            for method, seconds in _timed(methods, repeats).items():
                latency.append({"method": method, "batch": batch, "repeats": repeats,
                                "median_ms": seconds * 1e3, "rows_per_s": batch / seconds})
            for store in stores:
                store.close()
        stream_len = 500 if settings.quick else 4000
        indices = rng.zipf(1.3, stream_len) % len(data.x_test)  # a few rows are very popular
        hit_rates = []
        for noise, decimals in [(n, d) for n in NOISE for d in DECIMALS]:
            stream = data.x_test[indices]
            if noise:
                stream = stream + rng.normal(0, noise, stream.shape)
            stream = np.clip(stream, 0, 1).astype(np.float32)
            store = open_store(str(folder / f"dec{decimals}_{noise}.db"))
            hit_rates.append({"noise_sigma": noise, "decimals": decimals,
                              **_hit_rate(model, predictor, store, decimals, stream)})
        return latency, {"test_accuracy": accuracy, "redis": bool(redis_url),
                         "hit_rate_vs_decimals": hit_rates,
                         "distinct_requested_rows": len(np.unique(indices))}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _lookup_methods(model: Any, predictor: BatchPredictor, x: np.ndarray, folder: Path,
                    redis_url: str | None) -> tuple[dict[str, Callable[[], Any]], list[CacheStore]]:
    """The ways to answer ``x`` that the latency rows time (direct predicts, cache lookups that
    all hit, SQLite and Redis when ``redis_url``, and lookups that all miss), and the stores they
    opened in ``folder`` (the caller closes them after timing)."""
    batch = len(x)
    methods: dict[str, Callable[[], Any]] = {
        "model.predict": functools.partial(model.predict, x, verbose=0, batch_size=len(x)),
        "predict_on_batch (bucketed)": functools.partial(predictor, x),
    }
    stores = [("sqlite", open_store(str(folder / f"hits{batch}.db")))]
    if redis_url:
        redis_store = open_store(redis_url)
        redis_store.clear()
        stores.append(("redis", redis_store))
    for name, store in stores:
        cache = PredictionCache(model, store, predictor=predictor)
        cache.predict(x)  # every later lookup of x is a hit
        methods[f"cache hit ({name})"] = functools.partial(cache.predict, x)
    miss_cache = PredictionCache(model, open_store(str(folder / f"miss{batch}.db")),
                                 predictor=predictor)
    offsets = iter(range(1, 10_000))  # a new offset each call: every row is new
    methods["cache miss (sqlite)"] = lambda: miss_cache.predict(x + np.float32(next(offsets)))
    return methods, [store for _, store in stores] + [miss_cache.store]


def _hit_rate(model: Any, predictor: BatchPredictor, store: CacheStore, decimals: str,
              stream: np.ndarray) -> dict[str, Any]:
    """``stream`` asked of a cache in ``store`` rounding to ``decimals``, in batches of 32: its
    hit rate and keys, and how its answers compare with the exact model's (closes ``store``)."""
    exact = predictor(stream)
    cache = PredictionCache(model, store, Rounding.parse(decimals), predictor=predictor)
    answers = np.concatenate([cache.predict(stream[i:i + 32])
                              for i in range(0, len(stream), 32)])
    stats = cache.stats()
    store.close()
    return {"requests": len(stream), "hit_rate": stats.hit_rate, "distinct_keys": stats.stored,
            "class_agreement": float(np.mean(answers.argmax(1) == exact.argmax(1))),
            "max_abs_prob_diff": float(np.max(np.abs(answers - exact)))}


@contextlib.contextmanager
def redis_server(settings: Settings) -> Iterator[dict[str, Any]]:
    """A throwaway ``redis-server`` for the workers while they run (``redis_url`` None when
    Redis is not installed: the Redis rows are left out)."""
    server = shutil.which("redis-server")
    if server is None:
        yield {"redis_url": None}
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([server, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                                "--appendonly", "no"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = None
        for _ in range(200):
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    url = f"redis://127.0.0.1:{port}/0"
                    break
            time.sleep(0.05)
        yield {"redis_url": url}
    finally:
        process.terminate()
        process.wait(timeout=10)


def _ratio(baseline_ms: float, ms: float) -> str:
    ratio = baseline_ms / ms
    return f"{ratio:.1f}x" if ratio >= 1 else f"{ratio:.2g}x"


def cache_table(payload: dict[str, Any]) -> str:
    """Latency per method and batch with ratios, then hit rate vs decimals, per backend."""
    lines = ["Median latency over repeats (first call excluded; the methods take turns within each "
             "repeat); throughput = rows / median latency. "
             "A shared, noisy machine: compare rows side by side, not across runs.", "",
             "| backend | method | batch | median latency (ms) | rows/s | vs model.predict "
             "| vs predict_on_batch |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    backends = [s["backend"] for s in payload["summaries"]]
    for backend in backends:
        for batch in BATCHES:
            rows = [r for r in payload["rows"] if r["backend"] == backend and r["batch"] == batch]
            if not rows:
                continue
            base = next(r["median_ms"] for r in rows if r["method"] == "model.predict")
            jitted = next(r["median_ms"] for r in rows
                          if r["method"].startswith("predict_on_batch"))
            for r in rows:
                lines.append(f"| {backend} | {r['method']} | {batch} | {r['median_ms']:.3f} | "
                             f"{r['rows_per_s']:,.0f} | {_ratio(base, r['median_ms'])} | "
                             f"{_ratio(jitted, r['median_ms'])} |")
    lines += ["", "Hit rate vs decimals (digits test rows drawn Zipf-popular, with Gaussian noise "
              "of the given sigma; batches of 32). Class agreement and max abs prob diff: cached "
              "answers vs the exact model on the unrounded requests.", "",
              "| backend | noise sigma | decimals | requests | hit rate | distinct keys "
              "| class agreement | max abs prob diff |",
              "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for summary in payload["summaries"]:
        for r in summary.get("hit_rate_vs_decimals", []):
            lines.append(f"| {summary['backend']} | {r['noise_sigma']:g} | {r['decimals']} "
                         f"| {r['requests']} | {r['hit_rate']:.1%} | {r['distinct_keys']} "
                         f"| {r['class_agreement']:.1%} | {r['max_abs_prob_diff']:.3g} |")
    return "\n".join(lines) + "\n"


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("bench_cache", "Prediction cache: cached lookups vs direct predict, and hit rate vs "
              "decimals (seed MLP on digits).", measure_cache,
              keys=("method", "batch"), values=("median_ms", "rows_per_s"),
              summary_fields=("test_accuracy", "redis", "distinct_requested_rows"),
              resources=redis_server, table=cache_table,
              note="median latency over repeats, first call excluded, methods interleaved"),
)
