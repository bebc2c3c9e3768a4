"""A prediction cache: rounded request rows keyed under a model fingerprint, in SQLite or Redis.

    from kbackend.cache import PredictionCache, Rounding, open_store
    cache = PredictionCache(model, open_store("cache.db"), Rounding(2))
    y = cache.predict(x)          # hits from the store, misses predicted in one call and stored
    cache.stats().hit_rate
"""

from kbackend.cache.core import CachedResult, CacheStats, PredictionCache
from kbackend.cache.grid import GridSpec, parse_grid
from kbackend.cache.keys import Rounding, model_fingerprint, row_keys
from kbackend.cache.store import CacheError, CacheStore, NamespaceInfo, open_store

__all__ = [
    "CacheError", "CacheStats", "CacheStore", "CachedResult", "GridSpec", "NamespaceInfo",
    "PredictionCache", "Rounding", "model_fingerprint", "open_store", "parse_grid", "row_keys",
]
