"""The Redis store (redis-py): one cache shared by several machines.

Layout: one Redis hash per model fingerprint (``PREFIX:pred:<fingerprint>``, field = row key,
value = prediction), so a batch is one ``HMGET``, storing is ``HSETNX`` per field in one
pipeline (first value wins, like SQLite's ``INSERT OR IGNORE``), counting is ``HLEN`` and clearing
a model is one ``DEL``. Counters and model descriptions live in ``PREFIX:models`` (a hash of JSON)
and ``PREFIX:counters:<fingerprint>`` (``HINCRBY``, atomic across clients).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kbackend.cache.store import CacheError, NamespaceInfo

PREFIX = "kbackend"
MODELS_KEY = f"{PREFIX}:models"
SOCKET_TIMEOUT_S = 10.0


def _key(kind: str, namespace: str) -> str:
    return f"{PREFIX}:{kind}:{namespace}"


def _redact(url: str) -> str:
    """``url`` without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.split("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit((parts.scheme, user + netloc, parts.path, parts.query, parts.fragment))


class RedisStore:
    """A ``CacheStore`` in a Redis server, reached through ``url`` (``redis://host:port/db``)."""

    def __init__(self, url: str) -> None:
        try:
            import redis  # deferred: an optional extra, needed only for Redis stores
        except ImportError:
            raise CacheError(
                "The Redis cache needs the redis package: pip install 'kbackend[serve]' "
                "(or redis>=5)."
            ) from None
        self.url = url
        self._errors = (redis.RedisError, OSError)
        try:
            self._client = redis.Redis.from_url(
                url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=SOCKET_TIMEOUT_S
            )
            self._client.ping()
        except self._errors as error:
            raise CacheError(f"Cannot reach the Redis cache at {_redact(url)}: {error}.") from None
        except ValueError as error:
            raise CacheError(f"Invalid Redis URL {_redact(url)!r}: {error}.") from None

    def _call(self, what: str, action: Any) -> Any:
        try:
            return action()
        except self._errors as error:
            raise CacheError(
                f"Redis cache at {_redact(self.url)} failed to {what}: {error}."
            ) from None

    def get_many(self, namespace: str, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        key = _key("pred", namespace)
        return self._call("read", lambda: list(self._client.hmget(key, list(keys))))

    def put_many(self, namespace: str, items: Sequence[tuple[bytes, bytes]]) -> int:
        if not items:
            return 0

        def action() -> int:
            pipe = self._client.pipeline(transaction=True)  # MULTI/EXEC: all or nothing
            for key, value in items:
                pipe.hsetnx(_key("pred", namespace), key, value)
            return int(sum(pipe.execute()))

        return self._call("write", action)

    def register_model(self, namespace: str, description: dict[str, Any]) -> None:
        text = json.dumps(description, sort_keys=True)
        self._call("write", lambda: self._client.hset(MODELS_KEY, namespace, text))

    def add_counters(self, namespace: str, hits: int, misses: int) -> None:
        if not hits and not misses:
            return

        def action() -> None:
            pipe = self._client.pipeline(transaction=True)
            pipe.hincrby(_key("counters", namespace), "hits", int(hits))
            pipe.hincrby(_key("counters", namespace), "misses", int(misses))
            pipe.execute()

        self._call("write", action)

    def _known_namespaces(self) -> set[str]:
        keys = self._client.hkeys(MODELS_KEY)
        names = {k.decode() if isinstance(k, bytes) else k for k in keys}
        for kind in ("pred", "counters"):
            for key in self._client.scan_iter(match=_key(kind, "*"), count=1000):
                names.add(key.decode().rsplit(":", 1)[1])
        return names

    def namespaces(self) -> list[NamespaceInfo]:
        def action() -> list[NamespaceInfo]:
            result = []
            descriptions = self._client.hgetall(MODELS_KEY)
            for name in sorted(self._known_namespaces()):
                entries = int(self._client.hlen(_key("pred", name)))
                counters = self._client.hgetall(_key("counters", name))
                hits, misses = int(counters.get(b"hits", 0)), int(counters.get(b"misses", 0))
                if entries or hits or misses:
                    description = json.loads(descriptions.get(name.encode(), b"{}"))
                    result.append(NamespaceInfo(name, entries, hits, misses, description))
            return result

        return self._call("read", action)

    def clear(self, namespace: str | None = None) -> int:
        def action() -> int:
            names = self._known_namespaces() if namespace is None else {namespace}
            deleted = 0
            for name in names:
                pipe = self._client.pipeline(transaction=True)
                pipe.hlen(_key("pred", name))
                pipe.delete(_key("pred", name), _key("counters", name))
                deleted += int(pipe.execute()[0])
            return deleted

        return self._call("clear", action)

    def describe(self) -> str:
        return _redact(self.url)

    def close(self) -> None:
        self._client.close()
