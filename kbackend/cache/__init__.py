"""A prediction cache: rounded request rows keyed under a model fingerprint, in SQLite or Redis.

    from kbackend.cache import PredictionCache, Rounding, open_store
    cache = PredictionCache(model, open_store("cache.db"), Rounding(2))
    y = cache.predict(x)          # hits from the store, misses predicted in one call and stored
    cache.stats().hit_rate
"""

import os
from typing import Any

from kbackend.cache.core import CachedResult, CacheStats, PredictionCache, check_cacheable
from kbackend.cache.grid import GridSpec, GridText, parse_grid, parse_grid_text
from kbackend.cache.keys import Rounding, row_keys
from kbackend.cache.redis_store import RedisStore
from kbackend.cache.sqlite_store import SQLiteStore, check_sqlite_cache
from kbackend.cache.store import CacheError, CacheStore, NamespaceInfo
from kbackend.serving.model import model_fingerprint  # what cache entries are keyed under

__all__ = [
    "CacheError", "CacheStats", "CacheStore", "CachedResult", "GridSpec", "GridText",
    "NamespaceInfo", "PredictionCache", "Rounding", "check_cacheable", "check_store",
    "model_fingerprint", "open_store", "parse_grid", "parse_grid_text", "row_keys",
]

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def _spec_text(spec: Any) -> str:
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str):
        raise CacheError(f"Invalid cache: expected an SQLite file path or a Redis URL "
                         f"(redis://host:port/db). Received: {spec!r} ({type(spec).__name__}).")
    return spec


def open_store(spec: str, *, create: bool = True, busy_timeout_s: float = 30.0) -> CacheStore:
    """Open the store ``spec`` names: a Redis URL (``redis://host:port/db``) or an SQLite path.

    ``create=False`` refuses to create a missing SQLite file (for ``cache stats`` / ``clear``).
    """
    spec = _spec_text(spec)
    if spec.startswith(REDIS_SCHEMES):
        return RedisStore(spec)
    return SQLiteStore(spec, create=create, busy_timeout_s=busy_timeout_s)


def check_store(spec: str) -> None:
    """Check the store ``spec`` names, creating and changing nothing: a command calls it before
    it loads a model (a bad ``--cache`` fails in the first second) and opens the store with
    ``open_store`` only once every other input was checked, so that a refused command leaves no
    new cache file behind. A Redis server is asked (and left unchanged); an existing SQLite file
    must be a kbackend cache of a known version; a new one needs an existing, writable folder.
    """
    spec = _spec_text(spec)
    if spec.startswith(REDIS_SCHEMES):
        RedisStore(spec).close()
        return
    check_sqlite_cache(spec)
