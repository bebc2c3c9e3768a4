"""``PredictionCache``: a model behind a store, with rounding, batched lookups and statistics."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from kbackend.cache.keys import Rounding, decode_values, encode_value, row_keys
from kbackend.cache.store import CacheError, CacheStore
from kbackend.errors import ConfigError
from kbackend.serving.model import (
    BatchPredictor,
    check_servable,
    input_shape,
    model_fingerprint,
    output_shape,
    takes_strings,
    validate_inputs,
)

_LATENCY_WINDOW = 10_000  # latencies kept for percentiles (the most recent calls)


@dataclass(frozen=True)
class CacheStats:
    """Counts and latencies of one ``PredictionCache`` since it was created."""

    rows: int
    hits: int
    misses: int
    calls: int
    stored: int
    latency_ms_p50: float
    latency_ms_p95: float
    latency_ms_mean: float

    @property
    def hit_rate(self) -> float:
        return self.hits / self.rows if self.rows else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "hit_rate": self.hit_rate}


@dataclass(frozen=True)
class CachedResult:
    """Predictions for a batch and which rows came from the cache."""

    predictions: np.ndarray
    hit: np.ndarray  # bool per row
    rounded: np.ndarray  # the inputs the predictions belong to


def check_cacheable(model: Any, rounding: Rounding | None = None) -> tuple[int, ...]:
    """The output row shape of ``model`` if its predictions can be cached with ``rounding``
    (one input and one output, per-feature decimals matching its features, a fixed output
    shape), else a one-line error. Commands call it before they open (and so create) a store."""
    check_servable(model)
    if takes_strings(model):
        raise CacheError("Cannot cache a model that takes strings (its first layers are string "
                         "preprocessing): the cache keys rows of numbers. Run it without --cache.")
    (rounding or Rounding()).check(input_shape(model))
    shape = output_shape(model)
    fixed = tuple(int(d) for d in shape if d is not None)
    if len(fixed) < len(shape):
        raise CacheError(f"Cannot cache a model whose output shape {shape} is not fixed.")
    return fixed


class PredictionCache:
    """Answers predictions from ``store`` where it can, and from ``model`` (one batched call)
    where not.

    Each request row is rounded by ``rounding`` and keyed by its bytes under the model's
    fingerprint. Use ``predict`` (returns predictions) or ``lookup`` (also says which rows hit).
    """

    def __init__(self, model: Any, store: CacheStore, rounding: Rounding | None = None,
                 *, max_batch: int = 1024, predictor: Any = None) -> None:
        if not isinstance(store, CacheStore):
            raise CacheError("Invalid store: expected a CacheStore (from "
                             "kbackend.cache.open_store). "
                             f"Received: {type(store).__name__}.")
        if rounding is not None and not isinstance(rounding, Rounding):
            raise ConfigError(f"Invalid rounding: expected a kbackend.cache.Rounding (e.g. "
                              f"Rounding(2)) or None. Received: {rounding!r}.")
        check_servable(model)
        self.model = model
        self.store = store
        self.rounding = rounding or Rounding()
        self.predictor = predictor or BatchPredictor(model, max_batch=max_batch)
        self.input_shape = self.predictor.input_shape
        self.output_shape: tuple[int, ...] = check_cacheable(model, self.rounding)
        self.fingerprint = model_fingerprint(model)
        self.store.register_model(self.fingerprint, {
            "name": getattr(model, "name", "model"),
            "input_shape": list(self.input_shape),
            "output_shape": list(self.output_shape),
        })
        self._lock = threading.Lock()
        self._rows = self._hits = self._calls = self._stored = 0
        self._unflushed_hits = self._unflushed_misses = 0
        self._latencies: deque[float] = deque(maxlen=_LATENCY_WINDOW)

    def lookup(self, x: Any) -> CachedResult:
        """Predictions for batch ``x`` (validated), hits from the store, misses predicted
        together."""
        start = time.perf_counter()
        batch = validate_inputs(x, self.input_shape)
        rounded = self.rounding.apply(batch)
        keys = row_keys(rounded)
        stored = self.store.get_many(self.fingerprint, keys)
        hit = np.array([value is not None for value in stored], dtype=bool)
        predictions = np.empty((len(batch), *self.output_shape), dtype=np.float32)
        if hit.any():
            found = [v for v in stored if v is not None]
            predictions[hit] = decode_values(found, self.output_shape)
        new = 0
        if not hit.all():
            # Each distinct missing key is predicted once, in one batched call, and stored.
            first_of_key: dict[bytes, int] = {}
            for index in np.flatnonzero(~hit):
                first_of_key.setdefault(keys[index], int(index))
            unique_rows = list(first_of_key.values())
            fresh = self.predictor(rounded[unique_rows])
            # A NaN / infinite prediction (a diverged model) is returned but never stored: a
            # cache entry outlives the request and would serve the NaN as an answer.
            finite = np.isfinite(fresh.reshape(len(fresh), -1)).all(axis=1)
            new = self.store.put_many(self.fingerprint, [
                (keys[i], encode_value(row))
                for i, row, ok in zip(unique_rows, fresh, finite, strict=True) if ok])
            by_key = dict(zip(first_of_key, fresh, strict=True))
            for index in np.flatnonzero(~hit):
                predictions[index] = by_key[keys[index]]
        elapsed = time.perf_counter() - start
        with self._lock:
            hits = int(hit.sum())
            self._rows += len(batch)
            self._hits += hits
            self._calls += 1
            self._stored += new
            self._unflushed_hits += hits
            self._unflushed_misses += len(batch) - hits
            self._latencies.append(elapsed)
        return CachedResult(predictions, hit, rounded)

    def predict(self, x: Any) -> np.ndarray:
        """Predictions for batch ``x`` (see ``lookup``)."""
        return self.lookup(x).predictions

    def warm(self, x: Any, chunk: int = 1024, progress: Any = None) -> int:
        """Look up (and so store) every row of ``x`` in chunks; return how many entries were new."""
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ConfigError(f"Invalid chunk {chunk!r}: expected a positive number of rows.")
        before = self._stored
        array = np.asarray(x)
        for start in range(0, len(array), chunk):
            self.lookup(array[start:start + chunk])
            if progress is not None:
                progress(min(start + chunk, len(array)))
        return self._stored - before

    def stats(self) -> CacheStats:
        """Hit and miss counts and call latencies (ms) of this cache object."""
        with self._lock:
            latencies = np.array(self._latencies) * 1e3 if self._latencies else np.zeros(1)
            return CacheStats(
                rows=self._rows, hits=self._hits, misses=self._rows - self._hits, calls=self._calls,
                stored=self._stored,
                latency_ms_p50=float(np.percentile(latencies, 50)),
                latency_ms_p95=float(np.percentile(latencies, 95)),
                latency_ms_mean=float(latencies.mean()),
            )

    def flush_stats(self) -> None:
        """Add the hits and misses counted since the last flush to the store's lifetime counters."""
        with self._lock:
            hits, misses = self._unflushed_hits, self._unflushed_misses
            self._unflushed_hits = self._unflushed_misses = 0
        self.store.add_counters(self.fingerprint, hits, misses)
