"""A prediction cache: rounded request rows keyed under a model fingerprint, in SQLite or Redis.

    from kbackend.cache import PredictionCache, Rounding, open_store
    cache = PredictionCache(model, open_store("cache.db"), Rounding(2))
    y = cache.predict(x)          # hits from the store, misses predicted in one call and stored
    cache.stats().hit_rate
"""

from kbackend.cache.core import CachedResult, CacheStats, PredictionCache
from kbackend.cache.grid import GridSpec, parse_grid
from kbackend.cache.keys import Rounding, model_fingerprint, row_keys
from kbackend.cache.redis_store import RedisStore
from kbackend.cache.sqlite_store import SQLiteStore
from kbackend.cache.store import CacheError, CacheStore, NamespaceInfo

__all__ = [
    "CacheError", "CacheStats", "CacheStore", "CachedResult", "GridSpec", "NamespaceInfo",
    "PredictionCache", "Rounding", "model_fingerprint", "open_store", "parse_grid", "row_keys",
]

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def open_store(spec: str, *, create: bool = True, busy_timeout_s: float = 30.0) -> CacheStore:
    """Open the store ``spec`` names: a Redis URL (``redis://host:port/db``) or an SQLite path.

    ``create=False`` refuses to create a missing SQLite file (for ``cache stats`` / ``clear``).
    """
    if spec.startswith(REDIS_SCHEMES):
        return RedisStore(spec)
    return SQLiteStore(spec, create=create, busy_timeout_s=busy_timeout_s)
