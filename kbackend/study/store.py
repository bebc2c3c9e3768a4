"""The study's results store: SQLite in WAL mode, one row per finished run, keyed by the run's
full configuration.

A run is written in one transaction when it finishes (its result and its whole trajectory), so
a killed study loses at most the run in flight, and a re-run skips every run already stored.
Writes that read first (``put``: insert unless present) use ``BEGIN IMMEDIATE``: in WAL mode a
deferred read-then-write transaction fails at once with "database is locked" under concurrency.

Why opening is careful:
- A file is inspected read-only before anything is written, and only a kbackend study store
  (its SQLite application id), a new or empty file, or a store of an earlier kbackend is opened
  for writing. Anything else is refused with one line and left byte-identical: no tables added,
  no journal-mode switch, no ``-wal``/``-shm`` files beside it. The inspection opens the file
  ``immutable`` (no locks, no side files); only when a ``-wal`` file already lies beside it is the
  ordinary read-only mode needed to see the committed rows inside that journal.
- A store of an earlier kbackend (no application id, the same tables) is stamped with the id
  and schema version in one transaction, after re-checking its tables under the write lock.
- Every commit is followed by a WAL checkpoint, so ``study.db`` alone holds every committed run
  (a copy of that one file, or a kill, loses nothing that was committed).

A row whose JSON cannot be read (a damaged disk block, a hand edit) is not an error for the whole
store: it is moved, as stored, into the ``quarantine`` table (made when first needed; nothing is
deleted), one warning line names it, and the study goes on without it, so its run is trained
again and stored anew.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Protocol

from kbackend.cache.sqlite_store import APPLICATION_ID as CACHE_APPLICATION_ID
from kbackend.digests import json_digest
from kbackend.errors import KBackendError
from kbackend.io import JsonObject
from kbackend.sqlite import SQLITE_HEADER, connect, immediate_transaction

APPLICATION_ID = 0x6B62_7374  # "kbst": marks a file as a kbackend study store
SCHEMA_VERSION = 1
_HEADER_SIZE = 100
_BUSY_TIMEOUT_S = 60.0

# The tables and columns of every store so far (an earlier kbackend wrote the same ones, without
# the application id); the migration check compares a file against exactly these.
_COLUMNS = {
    "meta": ("name", "value"),
    "results": ("key", "kind", "study", "backend", "config", "result", "trajectory", "finished_at"),
    "summaries": ("study", "backend", "device", "payload", "written_at"),
}


_SCHEMA = """
CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE results (
    key TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    study TEXT NOT NULL,
    backend TEXT NOT NULL,
    config TEXT NOT NULL,
    result TEXT NOT NULL,
    trajectory TEXT,
    finished_at REAL NOT NULL
);
CREATE INDEX results_by_study ON results (study, backend, kind);
CREATE TABLE summaries (
    study TEXT NOT NULL,
    backend TEXT NOT NULL,
    device TEXT NOT NULL,
    payload TEXT NOT NULL,
    written_at REAL NOT NULL,
    PRIMARY KEY (study, backend, device)
);
"""

# Rows that could not be read, kept aside as stored (``content``: the row's columns as a JSON
# object; a BLOB value as its hex). Not in ``_COLUMNS``: a store without it is complete.
_QUARANTINE = """
CREATE TABLE IF NOT EXISTS quarantine (
    source TEXT NOT NULL,
    name TEXT NOT NULL,
    reason TEXT NOT NULL,
    content TEXT NOT NULL,
    quarantined_at REAL NOT NULL
)
"""
_RESULT_COLUMNS = "key, kind, study, backend, config, result, trajectory, finished_at"


class DamagedRow(ValueError):
    """A stored row whose JSON cannot be read, or whose values are not the expected kinds."""


class StudyStoreError(KBackendError):
    """The study store cannot be used: not a kbackend study store, corrupt, or unreadable."""


def config_key(config: JsonObject) -> str:
    """A stable hash of a JSON-ready configuration (key order does not matter)."""
    return json_digest(config, chars=64)


def _refuse(path: Path, what: str) -> StudyStoreError:
    return StudyStoreError(
        f"Study store {str(path)!r} {what}; it was left unchanged. Expected a kbackend study "
        "store (or no file): pass another --out folder or move the file away."
    )


def inspect_store(path: str | os.PathLike) -> str:
    """What ``path`` holds, read without writing: ``"new"`` (missing or empty: ours to create),
    ``"current"`` (a study store of this kbackend) or ``"legacy"`` (one of an earlier kbackend,
    to migrate). Raises ``StudyStoreError`` for anything else."""
    path = Path(path)
    if not os.path.lexists(path):
        return "new"
    if not path.is_file():
        raise _refuse(path, "is not a file (a directory, device or broken link)")
    wal = Path(f"{path}-wal")
    has_wal = wal.is_file() and wal.stat().st_size > 0
    size = path.stat().st_size
    if size == 0 and not has_wal:
        return "new"
    try:
        with open(path, "rb") as handle:
            header = handle.read(_HEADER_SIZE)
    except OSError as error:
        raise _refuse(path, f"cannot be read ({error.strerror})") from None
    if size and not header.startswith(SQLITE_HEADER):
        raise _refuse(path, f"is not an SQLite database (its first bytes are {header[:8]!r})")
    if size and len(header) < _HEADER_SIZE:
        raise _refuse(path, f"is truncated ({size} bytes, shorter than an SQLite header)")
    if size and not has_wal:
        _check_length(path, header, size)
    # immutable: no locks and no -wal/-shm files are made. It would ignore a -wal file's
    # committed rows, so with one present the ordinary read-only mode reads them too.
    uri = path.resolve().as_uri() + ("?mode=ro" if has_wal else "?mode=ro&immutable=1")
    try:
        conn = connect(uri, _BUSY_TIMEOUT_S, uri=True)
    except sqlite3.Error as error:
        raise _refuse(path, f"cannot be opened ({error})") from None
    try:
        conn.execute("BEGIN")  # one snapshot for every read below
        verdict = _classify(conn, path)
        problems = [row[0] for row in conn.execute("PRAGMA quick_check")]
        conn.execute("COMMIT")
    except sqlite3.DatabaseError as error:
        raise _refuse(path, f"is not a usable SQLite database ({error})") from None
    finally:
        conn.close()
    if problems != ["ok"]:
        raise _refuse(path, f"is corrupt (SQLite's quick_check: {'; '.join(problems[:3])})")
    return verdict


def _check_length(path: Path, header: bytes, size: int) -> None:
    """Refuse a file shorter than the page count its own header records (a truncated copy)."""
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    # The header's page count is valid only while its change counter matches (SQLite's rule).
    if pages and header[24:28] == header[92:96] and size < pages * page_size:
        raise _refuse(path, f"is truncated ({size} bytes; its header records {pages} pages of "
                            f"{page_size} bytes)")


def _classify(conn: sqlite3.Connection, path: Path) -> str:
    """``"new"``, ``"current"`` or ``"legacy"`` for the database ``conn`` reads; raises for
    anything that is not a kbackend study store."""
    app_id = conn.execute("PRAGMA application_id").fetchone()[0]
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    names = [row[0] for row in conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
        "ORDER BY name")]
    if app_id == APPLICATION_ID:
        if version != SCHEMA_VERSION:
            newer = (" (written by a newer kbackend: upgrade kbackend)"
                     if version > SCHEMA_VERSION else "")
            raise _refuse(path, f"has schema version {version}, this kbackend reads version "
                                f"{SCHEMA_VERSION}{newer}")
        missing = sorted(set(_COLUMNS) - set(names))
        if missing:
            raise _refuse(path, f"is a kbackend study store missing tables {missing}")
        return "current"
    if app_id == CACHE_APPLICATION_ID:
        raise _refuse(path, "is a kbackend prediction cache, not a study store")
    if app_id:
        raise _refuse(path, f"is an SQLite database of another application (application_id "
                            f"{app_id:#x}, tables {names})")
    if not names and not version:
        return "new"  # an empty SQLite file: nothing in it to protect
    if version or not set(names) & set(_COLUMNS):
        raise _refuse(path, f"is an SQLite database of another application (user_version "
                            f"{version}, tables {names})")
    reason = _legacy_mismatch(conn, names)
    if reason:
        raise _refuse(path, f"looks like a study store of an earlier kbackend but cannot be "
                            f"migrated: {reason}")
    return "legacy"


def _legacy_mismatch(conn: sqlite3.Connection, names: list[str]) -> str:
    """Why the tables in ``conn`` are not exactly an earlier kbackend's store ('' if they are)."""
    if set(names) != set(_COLUMNS):
        return f"it has tables {names}, expected exactly {sorted(_COLUMNS)}"
    for table, expected in _COLUMNS.items():
        columns = tuple(row[1] for row in conn.execute(f"PRAGMA table_info({table})"))
        if columns != expected:
            return f"table {table!r} has columns {list(columns)}, expected {list(expected)}"
    row = conn.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()
    if row is None or row[0] != str(SCHEMA_VERSION):
        found = "none" if row is None else repr(row[0])
        return f"its meta schema_version is {found}, expected '{SCHEMA_VERSION}'"
    return ""


@dataclass(frozen=True)
class StoredRun:
    """One row of the store's ``results``: a finished run (``kind`` ``"run"``) or a stored
    measurement (``"noise"``, ``"steptime"``, ``"frontier"``, ``"population_probe"``,
    ``"confirmation"``). ``config`` is what ``key`` hashes (``config_key``), ``result`` the
    figures, ``trajectory`` a run's per-step values (None for a measurement). Those three are
    kept as the JSON the store holds; ``to_dict`` is the row as the study's report reads it."""

    key: str
    kind: str
    study: str
    backend: str
    config: JsonObject
    result: JsonObject
    trajectory: JsonObject | None = None
    finished_at: float = field(default_factory=time.time)  # when it was stored: now

    @classmethod
    def keyed(cls, key_config: JsonObject, kind: str, study: str, backend: str,
              result: JsonObject, trajectory: JsonObject | None = None) -> StoredRun:
        """A run or measurement finished now, keyed by its ``key_config``."""
        return cls(config_key(key_config), kind, study, backend, key_config, result, trajectory)

    @property
    def seed(self) -> int:
        """The seed a run trained with."""
        return int(self.config["seed"])

    def as_stored(self) -> StoredRun:
        """This run as the SQLite store returns it: its payloads through JSON (tuples as
        lists, keys as strings, other values as text), for a store kept in memory."""
        def stored(payload: Any) -> Any:
            return None if payload is None else json.loads(_dumps(payload))
        return replace(self, config=stored(self.config), result=stored(self.result),
                       trajectory=stored(self.trajectory))

    def to_dict(self) -> JsonObject:
        """The run as the report and its JSON read it (one key per field)."""
        return {column.name: getattr(self, column.name) for column in fields(self)}

    @classmethod
    def from_dict(cls, row: JsonObject) -> StoredRun:
        """``to_dict``'s output read back."""
        return cls(**{column.name: row[column.name] for column in fields(cls)})


@dataclass(frozen=True)
class QuarantinedRow:
    """A row kept aside as unreadable: its table (``source``), its name (a run's key, a
    summary's study/backend/device), why, and its columns as stored (a JSON object)."""

    source: str
    name: str
    reason: str
    content: str
    quarantined_at: float


class RunStore(Protocol):
    """What a study reads and writes of its store: ``ResultStore`` (SQLite), or ``MemoryStore``
    (a Ray task's records, a test's store)."""

    def get(self, key: str) -> StoredRun | None: ...

    def put(self, run: StoredRun) -> bool: ...

    def records(self, study: str | None = None, backend: str | None = None,
                kind: str | None = None) -> list[StoredRun]: ...

    def put_summary(self, study: str, backend: str, device: str,
                    payload: JsonObject) -> None: ...


class MemoryStore:
    """A store in memory, for what needs no file: a Ray task's stand-in for ``ResultStore``
    (the driver's records of the task's cell, and ``added``: the records the task made, sent
    back to the driver, the only writer), or a test's. It returns what the SQLite store would
    (payloads through JSON, ``StoredRun.as_stored``)."""

    def __init__(self, records: Iterable[StoredRun] = ()) -> None:
        self._records = {r.key: r for r in records}
        self.added: list[StoredRun] = []
        self._summaries: dict[tuple[str, str, str], JsonObject] = {}

    def get(self, key: str) -> StoredRun | None:
        return self._records.get(key)

    def put(self, run: StoredRun) -> bool:
        if run.key in self._records:
            return False
        stored = run.as_stored()
        self._records[run.key] = stored
        self.added.append(stored)
        return True

    def records(self, study: str | None = None, backend: str | None = None,
                kind: str | None = None) -> list[StoredRun]:
        wanted = _filters(study, backend, kind)
        return sorted((r for r in self._records.values()
                       if all(getattr(r, column) == value for column, value in wanted.items())),
                      key=lambda r: r.finished_at)

    def put_summary(self, study: str, backend: str, device: str, payload: JsonObject) -> None:
        self._summaries.pop((study, backend, device), None)  # replaced: the newest comes last
        self._summaries[(study, backend, device)] = json.loads(_dumps(payload))

    def summaries(self, study: str | None = None) -> list[JsonObject]:
        return [payload for (of, _, _), payload in self._summaries.items()
                if study is None or of == study]


def _filters(study: str | None, backend: str | None, kind: str | None) -> dict[str, str]:
    """The columns a ``records`` call filters on, with their wanted values."""
    return {column: value for column, value in (("study", study), ("backend", backend),
                                                ("kind", kind)) if value is not None}


class ResultStore:
    """Finished runs and noise-scale measurements of studies, in one SQLite file.

    Opening refuses (``StudyStoreError``, file unchanged) anything but a kbackend study store, a
    new or empty file, or a store of an earlier kbackend (migrated in one transaction).
    """

    def __init__(self, path: str | os.PathLike,
                 warn: Callable[[str], None] | None = None) -> None:
        self.path = Path(path)
        # Where a quarantined row is reported (one line each): stderr unless told otherwise.
        self.warn = warn or _warn_on_stderr
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StudyStoreError(
                f"Cannot create the folder of study store {str(self.path)!r}: {error.strerror}. "
                "Expected a writable folder path: pass another --out folder.") from None
        inspect_store(self.path)  # before the first write: a refused file is never touched
        try:  # FULL: a commit survives power loss
            self._connection = connect(self.path, _BUSY_TIMEOUT_S, setup=self._initialize,
                                       synchronous="FULL")
        except sqlite3.Error as error:
            raise StudyStoreError(f"Cannot open study store {str(self.path)!r}: {error}.") from None

    def _initialize(self, connection: sqlite3.Connection) -> None:
        """Create a new store or migrate an earlier one, all in one transaction."""
        self._connection = connection
        with self._write() as cursor:
            # Checked again under the write lock: another process may have changed the file
            # since the read-only inspection.
            verdict = _classify(self._connection, self.path)
            if verdict == "new":
                for statement in _SCHEMA.strip().split(";"):
                    if statement.strip():
                        cursor.execute(statement)
                cursor.execute("INSERT INTO meta VALUES ('schema_version', ?)",
                               (str(SCHEMA_VERSION),))
            if verdict in ("new", "legacy"):
                cursor.execute(f"PRAGMA application_id={APPLICATION_ID}")
                cursor.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def close(self) -> None:
        self._connection.close()

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _errors(self) -> Iterator[None]:
        """SQLite's errors as one-line kbackend errors naming the store."""
        try:
            yield
        except sqlite3.Error as error:
            raise StudyStoreError(f"Study store {str(self.path)!r} failed: {error}.") from None

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Cursor]:
        """One ``BEGIN IMMEDIATE`` transaction, then a checkpoint: the write lock is taken before
        anything is read, and once committed the rows are in ``study.db`` itself."""
        with immediate_transaction(self._connection) as cursor:
            yield cursor
        # FULL waits (busy handler) for other writers and for readers of older snapshots, so
        # every committed frame is copied into the main file, not only those no reader needs.
        cursor.execute("PRAGMA wal_checkpoint(FULL)").fetchone()

    def get(self, key: str) -> StoredRun | None:
        """The stored run (or measurement) under ``key``, or None."""
        with self._errors():
            row = self._connection.execute(
                f"SELECT {_RESULT_COLUMNS} FROM results WHERE key = ?", (key,)).fetchone()
        records = [] if row is None else self._readable("results", [row], _record)
        return records[0] if records else None

    def put(self, run: StoredRun) -> bool:
        """Store a finished run unless its key is already stored; True if this call stored it.
        The row is the JSON of its fields (the columns of every store so far)."""
        with self._errors(), self._write() as cursor:
            if cursor.execute("SELECT 1 FROM results WHERE key = ?", (run.key,)).fetchone():
                return False
            cursor.execute(
                "INSERT INTO results VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (run.key, run.kind, run.study, run.backend, _dumps(run.config),
                 _dumps(run.result), None if run.trajectory is None else _dumps(run.trajectory),
                 run.finished_at),
            )
        return True

    def records(self, study: str | None = None, backend: str | None = None,
                kind: str | None = None) -> list[StoredRun]:
        """Stored runs and measurements, optionally filtered, in the order they finished."""
        wanted = _filters(study, backend, kind)
        where = f" WHERE {' AND '.join(f'{column} = ?' for column in wanted)}" if wanted else ""
        with self._errors():
            rows = self._connection.execute(
                f"SELECT {_RESULT_COLUMNS} FROM results{where} ORDER BY finished_at",
                list(wanted.values())).fetchall()
        return self._readable("results", rows, _record)

    def _readable(self, source: str, rows: list[tuple], read: Callable[[tuple], Any]) -> list[Any]:
        """``read`` of each of ``rows`` (of table ``source``); each damaged one quarantined (with
        a warning) and left out."""
        readable = []
        for row in rows:
            try:
                readable.append(read(row))
            except DamagedRow as error:
                self._quarantine(source, row, str(error))
        return readable

    def _quarantine(self, source: str, row: tuple, reason: str) -> None:
        """Move ``row`` of ``source`` (results or summaries) into ``quarantine``, as stored, in
        one transaction; a row another process moved (or rewrote) meanwhile is left alone."""
        columns = _COLUMNS[source]
        content = json.dumps(dict(zip(columns, row, strict=True)), sort_keys=True,
                             default=lambda value: value.hex() if isinstance(value, bytes)
                             else str(value))
        where = " AND ".join(f"{column} IS ?" for column in columns)
        name = row[0] if source == "results" else "/".join(map(str, row[:3]))
        with self._errors(), self._write() as cursor:
            cursor.execute(_QUARANTINE)
            if cursor.execute(f"DELETE FROM {source} WHERE {where}", row).rowcount:
                cursor.execute("INSERT INTO quarantine VALUES (?, ?, ?, ?, ?)",
                               (source, str(name), reason, content, time.time()))
        what = f"run {str(name)[:16]}" if source == "results" else f"summary {name}"
        self.warn(f"study store {str(self.path)!r}: the {what} could not be read ({reason}); "
                  "it was moved to the store's quarantine table and is left out (a run is "
                  "trained again)")

    def quarantined(self) -> list[QuarantinedRow]:
        """The rows kept aside as unreadable, oldest first."""
        with self._errors():
            if not self._connection.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' "
                                            "AND name = 'quarantine'").fetchone():
                return []
            rows = self._connection.execute(
                "SELECT source, name, reason, content, quarantined_at FROM quarantine "
                "ORDER BY quarantined_at").fetchall()
        return [QuarantinedRow(*row) for row in rows]

    def put_summary(self, study: str, backend: str, device: str, payload: JsonObject) -> None:
        """Store (replace) the analysed summary of a study on one backend and device."""
        with self._errors(), self._write() as cursor:
            cursor.execute("INSERT OR REPLACE INTO summaries VALUES (?, ?, ?, ?, ?)",
                           (study, backend, device, _dumps(payload), time.time()))

    def summaries(self, study: str | None = None) -> list[JsonObject]:
        """Stored summaries (payload dicts), optionally of one study, oldest first."""
        where, values = ("WHERE study = ?", [study]) if study else ("", [])
        with self._errors():
            rows = self._connection.execute(
                f"SELECT {', '.join(_COLUMNS['summaries'])} FROM summaries {where} "
                "ORDER BY written_at", values).fetchall()
        return self._readable("summaries", rows, lambda row: _json(row[3], "payload", dict))


def _dumps(payload: Any) -> str:
    # NaN / inf (a diverged loss, an undefined noise scale) are kept: Python's json reads them.
    return json.dumps(payload, sort_keys=True, default=str)


def _warn_on_stderr(line: str) -> None:
    sys.stderr.write(f"kbackend: warning: {line}\n")
    sys.stderr.flush()


def _json(text: Any, column: str, kind: type) -> Any:
    """``text`` parsed as JSON of type ``kind``; ``DamagedRow`` naming ``column`` otherwise."""
    try:
        value = json.loads(text)
    except (TypeError, ValueError, RecursionError) as error:
        raise DamagedRow(f"{column} is not JSON: {type(error).__name__}") from None
    if not isinstance(value, kind):
        raise DamagedRow(f"{column} is a JSON {type(value).__name__}, not an object")
    return value


def _record(row: tuple) -> StoredRun:
    """A results row as a ``StoredRun``; ``DamagedRow`` if any JSON column cannot be read."""
    key, kind, study, backend, config, result, trajectory, finished_at = row
    return StoredRun(key, kind, study, backend, _json(config, "config", dict),
                     _json(result, "result", dict),
                     None if trajectory is None else _json(trajectory, "trajectory", dict),
                     finished_at)
