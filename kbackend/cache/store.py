"""The storage interface of the prediction cache (``kbackend.cache.open_store`` picks an
implementation).

A store maps ``(namespace, key) -> value`` (all bytes, the namespace a model fingerprint) and
keeps per-namespace hit/miss counters and a short description of each model. Entries are
written once and never updated: a key is a rounded input row, so its prediction under one
model fingerprint never changes, and ``put_many`` keeps whichever value arrived first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from kbackend.errors import KBackendError


class CacheError(KBackendError):
    """A cache store cannot be opened or used (corrupt file, not a cache, server unreachable)."""


@dataclass
class NamespaceInfo:
    """What a store knows about one model fingerprint."""

    namespace: str
    entries: int
    hits: int = 0
    misses: int = 0
    model: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class CacheStore(Protocol):
    """A key-value store for cached predictions, safe for several threads and processes."""

    def get_many(self, namespace: str, keys: Sequence[bytes]) -> list[bytes | None]:
        """The stored value of each key (``None`` where absent), in the order of ``keys``."""
        ...

    def put_many(self, namespace: str, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Store every ``(key, value)`` not yet present, atomically; return how many were new."""
        ...

    def register_model(self, namespace: str, description: dict[str, Any]) -> None:
        """Remember what model a namespace belongs to (name, input and output shapes)."""
        ...

    def add_counters(self, namespace: str, hits: int, misses: int) -> None:
        """Add to the lifetime hit and miss counters of a namespace."""
        ...

    def namespaces(self) -> list[NamespaceInfo]:
        """Every namespace with entries or counters, with its entry count and counters."""
        ...

    def clear(self, namespace: str | None = None) -> int:
        """Delete the entries (and counters) of one namespace, or of all; return entries deleted."""
        ...

    def describe(self) -> str:
        """Where the store lives, for messages (a path or a URL without a password)."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...

