"""The SQLite store: one file, WAL mode, safe for several threads and processes at once.

Why it is built this way:
- WAL mode lets readers run while one writer commits, and ``synchronous=NORMAL`` keeps the
  file consistent after a process crash (a killed writer loses at most its open transaction).
- Every write is one ``BEGIN IMMEDIATE`` transaction: it takes the write lock up front, so it
  waits on ``busy_timeout`` instead of failing at once with "database is locked" the way a
  deferred read-then-write transaction does in WAL mode (``kbackend.sqlite``, which the study's
  store shares).
- Each thread gets its own connection (and a forked child opens new ones): sqlite3 connections
  must not be shared across threads or processes.
- A file that is not a kbackend cache (not SQLite, corrupt, or another application's database)
  is refused before anything is written to it.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from kbackend.cache.store import CacheError, NamespaceInfo
from kbackend.errors import path_errors
from kbackend.io import check_output_path
from kbackend.sqlite import (
    SQLITE_HEADER,
    connect,
    immediate_transaction,
    is_locked,
    retry_while_locked,
)

APPLICATION_ID = 0x6B62_6361  # "kbca": marks a file as a kbackend prediction cache
SCHEMA_VERSION = 1
_MAX_PARAMS = 500  # keys per SELECT ... IN (...), well under SQLite's variable limit

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS models (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        fingerprint TEXT NOT NULL UNIQUE,
        description TEXT NOT NULL DEFAULT '{}',
        hits INTEGER NOT NULL DEFAULT 0,
        misses INTEGER NOT NULL DEFAULT 0,
        created REAL NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS predictions (
        model_id INTEGER NOT NULL REFERENCES models(id),
        key BLOB NOT NULL,
        value BLOB NOT NULL,
        PRIMARY KEY (model_id, key)
    ) WITHOUT ROWID""",
)

T = TypeVar("T")


def check_cache_file(path: Path) -> None:
    """Raise ``CacheError`` if ``path`` exists and is not an SQLite file (reads, never writes)."""
    with path_errors(path, "--cache path", CacheError):
        if not path.exists():
            return
        is_file = path.is_file()
    if not is_file:
        raise CacheError(f"Invalid cache path {str(path)!r}: expected an SQLite file, found a "
                         "directory or device.")
    with open(path, "rb") as handle:
        head = handle.read(len(SQLITE_HEADER))
    if head and head != SQLITE_HEADER:
        raise CacheError(
            f"Cache file {str(path)!r} is not an SQLite database (its first bytes are "
            f"{head[:8]!r}, expected {SQLITE_HEADER[:15]!r}); it was left unchanged: pass another "
            "--cache path."
        )


def _check_location(path: Path, create: bool) -> None:
    """The file exists (``create=False``) or its folder does, and it is not another kind of file."""
    with path_errors(path, "--cache path", CacheError):
        if not create and not path.exists():
            raise CacheError(f"Cache file {str(path)!r} does not exist.")
        check_cache_file(path)
        if path.parent and not path.parent.exists():
            raise CacheError(f"Cannot create cache {str(path)!r}: folder {str(path.parent)!r} "
                             "does not exist.")


def check_sqlite_cache(path: str | os.PathLike) -> None:
    """What opening ``path`` as a store would refuse, found without creating or changing it.

    An existing, non-empty file is opened (validated) and closed: an existing kbackend cache is
    left as it was, anything else is refused before a write. A missing (or empty) one needs a
    folder that exists and takes new files.
    """
    with path_errors(path, "--cache path", CacheError):
        path = Path(path)
        _check_location(path, create=True)
        existing = path.exists() and path.stat().st_size > 0
    if existing:
        SQLiteStore(path, create=False).close()
    else:
        check_output_path(path, "--cache")


class SQLiteStore:
    """A ``CacheStore`` in one SQLite file."""

    def __init__(self, path: str | os.PathLike, *, create: bool = True,
                 busy_timeout_s: float = 30.0) -> None:
        with path_errors(path, "--cache path", CacheError):
            self.path = Path(path)
        self.busy_timeout_s = float(busy_timeout_s)
        _check_location(self.path, create)
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._connections_lock = threading.Lock()
        self._pid = os.getpid()
        self._model_ids: dict[str, int] = {}
        self._connection()  # validate (and initialize) now, so a bad file fails at open

    # -- connections ---------------------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        if self._pid != os.getpid():  # forked: the parent's connections must not be used here
            self._local = threading.local()
            self._connections = []
            self._connections_lock = threading.Lock()
            self._pid = os.getpid()
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._open_connection()
            self._local.conn = conn
            with self._connections_lock:
                self._connections.append(conn)
        return conn

    def _open_connection(self) -> sqlite3.Connection:
        def setup(conn: sqlite3.Connection) -> None:
            self._validate(conn)
            self._retry(lambda: self._initialize(conn))

        try:
            # check_same_thread=False only so close() may close every thread's connection; each
            # connection is still used by the one thread that opened it.
            return self._retry(lambda: connect(self.path, self.busy_timeout_s, setup=setup,
                                               synchronous="NORMAL", check_same_thread=False))
        except sqlite3.DatabaseError as error:
            raise CacheError(
                f"Cache file {str(self.path)!r} is not a usable SQLite database ({error}); "
                "it was left unchanged: pass another --cache path."
            ) from None

    def _validate(self, conn: sqlite3.Connection) -> None:
        """Refuse corrupt files and other applications' databases (reads only)."""
        # One read transaction: both reads see the same snapshot. In autocommit mode another
        # process could commit its schema between them (app_id 0 read before, tables after).
        conn.execute("BEGIN")
        try:
            app_id = conn.execute("PRAGMA application_id").fetchone()[0]
            tables = {row[0] for row in
                      conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            conn.execute("COMMIT")
        if app_id == 0 and not tables:
            return  # a new, empty database: ours to initialize
        if app_id != APPLICATION_ID:
            raise CacheError(
                f"Cache file {str(self.path)!r} is an SQLite database of another application "
                f"(application_id {app_id}, tables {sorted(tables)}), not a kbackend cache; "
                "it was left unchanged: pass another --cache path."
            )
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise CacheError(
                f"Cache file {str(self.path)!r} has schema version {version}; this kbackend "
                f"understands up to {SCHEMA_VERSION}. Upgrade kbackend or use another cache."
            )

    def _initialize(self, conn: sqlite3.Connection) -> None:
        if conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID:
            return
        with immediate_transaction(conn):
            for statement in _SCHEMA:
                conn.execute(statement)
            conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _retry(self, action: Callable[[], T]) -> T:
        """Run ``action``, retrying while SQLite reports the database busy, up to a deadline.

        ``busy_timeout`` already makes SQLite wait inside each call; this is the backstop for the
        few places it does not apply (such as switching the journal mode).
        """
        try:
            return retry_while_locked(action, 2 * self.busy_timeout_s)
        except sqlite3.OperationalError as error:
            if not is_locked(error):
                raise CacheError(f"Cache {str(self.path)!r}: {error}.") from None
            raise CacheError(
                f"Cache {str(self.path)!r} stayed busy for {2 * self.busy_timeout_s:.0f}s "
                f"({error}); another process holds its write lock."
            ) from None

    def _run(self, action: Callable[[sqlite3.Connection], T]) -> T:
        conn = self._connection()
        try:
            return self._retry(lambda: action(conn))
        except sqlite3.DatabaseError as error:
            raise CacheError(f"Cache {str(self.path)!r} failed: {error}.") from None

    # -- models --------------------------------------------------------------------------------

    def _model_id(self, conn: sqlite3.Connection, namespace: str, create: bool) -> int | None:
        model_id = self._model_ids.get(namespace)
        if model_id is not None:
            return model_id
        row = conn.execute("SELECT id FROM models WHERE fingerprint = ?", (namespace,)).fetchone()
        if row is None and create:
            with immediate_transaction(conn):
                conn.execute(
                    "INSERT OR IGNORE INTO models (fingerprint, created) VALUES (?, ?)",
                    (namespace, time.time()),
                )
                row = conn.execute("SELECT id FROM models WHERE fingerprint = ?",
                                   (namespace,)).fetchone()
        if row is None:
            return None
        # Ids are AUTOINCREMENT and model rows are never deleted, so a remembered id stays valid.
        self._model_ids[namespace] = row[0]
        return row[0]

    def register_model(self, namespace: str, description: dict[str, Any]) -> None:
        text = json.dumps(description, sort_keys=True)

        def action(conn: sqlite3.Connection) -> None:
            model_id = self._model_id(conn, namespace, create=True)
            with immediate_transaction(conn):
                conn.execute("UPDATE models SET description = ? WHERE id = ?", (text, model_id))

        self._run(action)

    # -- entries -------------------------------------------------------------------------------

    def get_many(self, namespace: str, keys: Sequence[bytes]) -> list[bytes | None]:
        def action(conn: sqlite3.Connection) -> list[bytes | None]:
            model_id = self._model_id(conn, namespace, create=False)
            if model_id is None:
                return [None] * len(keys)
            found: dict[bytes, bytes] = {}
            unique = list(dict.fromkeys(keys))
            for start in range(0, len(unique), _MAX_PARAMS):
                chunk = unique[start:start + _MAX_PARAMS]
                marks = ",".join("?" * len(chunk))
                rows = conn.execute(
                    f"SELECT key, value FROM predictions WHERE model_id = ? AND key IN ({marks})",
                    (model_id, *chunk),
                )
                found.update(rows)
            return [found.get(key) for key in keys]

        return self._run(action)

    def put_many(self, namespace: str, items: Sequence[tuple[bytes, bytes]]) -> int:
        if not items:
            return 0

        def action(conn: sqlite3.Connection) -> int:
            model_id = self._model_id(conn, namespace, create=True)
            with immediate_transaction(conn):
                before = conn.total_changes
                conn.executemany(
                    "INSERT OR IGNORE INTO predictions (model_id, key, value) VALUES (?, ?, ?)",
                    [(model_id, key, value) for key, value in items],
                )
                return conn.total_changes - before

        return self._run(action)

    def add_counters(self, namespace: str, hits: int, misses: int) -> None:
        if not hits and not misses:
            return

        def action(conn: sqlite3.Connection) -> None:
            model_id = self._model_id(conn, namespace, create=True)
            with immediate_transaction(conn):
                conn.execute(
                    "UPDATE models SET hits = hits + ?, misses = misses + ? WHERE id = ?",
                    (int(hits), int(misses), model_id),
                )

        self._run(action)

    def namespaces(self) -> list[NamespaceInfo]:
        def action(conn: sqlite3.Connection) -> list[NamespaceInfo]:
            counts = dict(conn.execute(
                "SELECT model_id, COUNT(*) FROM predictions GROUP BY model_id"))
            result = []
            for model_id, fingerprint, description, hits, misses in conn.execute(
                "SELECT id, fingerprint, description, hits, misses FROM models ORDER BY id"
            ):
                entries = counts.get(model_id, 0)
                if entries or hits or misses:
                    result.append(NamespaceInfo(fingerprint, entries, hits, misses,
                                                json.loads(description)))
            return result

        return self._run(action)

    def clear(self, namespace: str | None = None) -> int:
        def action(conn: sqlite3.Connection) -> int:
            with immediate_transaction(conn):
                before = conn.total_changes
                if namespace is None:
                    conn.execute("DELETE FROM predictions")
                    deleted = conn.total_changes - before
                    conn.execute("UPDATE models SET hits = 0, misses = 0")
                else:
                    model_id = self._model_id(conn, namespace, create=False)
                    if model_id is None:
                        return 0
                    conn.execute("DELETE FROM predictions WHERE model_id = ?", (model_id,))
                    deleted = conn.total_changes - before
                    conn.execute("UPDATE models SET hits = 0, misses = 0 WHERE id = ?",
                                 (model_id,))
                return deleted

        return self._run(action)

    def integrity_check(self) -> str:
        """SQLite's ``PRAGMA integrity_check`` result (``'ok'`` for a sound file)."""
        return self._run(
            lambda conn: "; ".join(row[0] for row in conn.execute("PRAGMA integrity_check")))

    def count(self) -> int:
        """The number of stored predictions, over all models."""
        return self._run(
            lambda conn: conn.execute("SELECT COUNT(*) FROM predictions").fetchone()[0])

    def describe(self) -> str:
        return f"sqlite:{self.path}"

    def close(self) -> None:
        with self._connections_lock:
            for conn in self._connections:
                conn.close()
            self._connections.clear()
        self._local = threading.local()

    def __enter__(self) -> SQLiteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
