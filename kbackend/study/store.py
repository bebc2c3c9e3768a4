"""The study's results store: SQLite in WAL mode, one row per finished run, keyed by the run's
full configuration.

A run is written in one transaction when it finishes (its result and its whole trajectory), so
a killed study loses at most the run in flight, and a re-run skips every run already stored.
Writes that read first (``put``: insert unless present) use ``BEGIN IMMEDIATE``: in WAL mode a
deferred read-then-write transaction fails at once with "database is locked" under concurrency.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS results (
    key TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    study TEXT NOT NULL,
    backend TEXT NOT NULL,
    config TEXT NOT NULL,
    result TEXT NOT NULL,
    trajectory TEXT,
    finished_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS results_by_study ON results (study, backend, kind);
CREATE TABLE IF NOT EXISTS summaries (
    study TEXT NOT NULL,
    backend TEXT NOT NULL,
    device TEXT NOT NULL,
    payload TEXT NOT NULL,
    written_at REAL NOT NULL,
    PRIMARY KEY (study, backend, device)
);
"""


def config_key(config: dict[str, Any]) -> str:
    """A stable hash of a JSON-ready configuration (key order does not matter)."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class ResultStore:
    """Finished runs and noise-scale measurements of studies, in one SQLite file."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE ... COMMIT).
        self._connection = sqlite3.connect(self.path, timeout=60.0, isolation_level=None)
        self._connection.execute("PRAGMA journal_mode=WAL")
        self._connection.execute("PRAGMA synchronous=FULL")  # a commit survives power loss
        self._connection.execute("PRAGMA busy_timeout=60000")
        with self._write() as cursor:
            for statement in _SCHEMA.strip().split(";"):
                if statement.strip():
                    cursor.execute(statement)
            cursor.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)",
                           (str(SCHEMA_VERSION),))

    def close(self) -> None:
        self._connection.close()

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Cursor]:
        cursor = self._connection.cursor()
        cursor.execute("BEGIN IMMEDIATE")
        try:
            yield cursor
        except BaseException:
            cursor.execute("ROLLBACK")
            raise
        cursor.execute("COMMIT")

    def get(self, key: str) -> dict[str, Any] | None:
        """The stored record for ``key`` (config, result, trajectory), or None."""
        row = self._connection.execute(
            "SELECT key, kind, study, backend, config, result, trajectory, finished_at "
            "FROM results WHERE key = ?", (key,)).fetchone()
        return None if row is None else _record(row)

    def put(self, key: str, kind: str, study: str, backend: str, config: dict[str, Any],
            result: dict[str, Any], trajectory: dict[str, Any] | None = None) -> bool:
        """Store a finished run unless ``key`` is already stored; True if this call stored it."""
        with self._write() as cursor:
            if cursor.execute("SELECT 1 FROM results WHERE key = ?", (key,)).fetchone():
                return False
            cursor.execute(
                "INSERT INTO results VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (key, kind, study, backend, _dumps(config), _dumps(result),
                 None if trajectory is None else _dumps(trajectory), time.time()),
            )
        return True

    def records(self, study: str | None = None, backend: str | None = None,
                kind: str | None = None) -> list[dict[str, Any]]:
        """Stored records, optionally filtered, in the order they finished."""
        clauses, values = [], []
        for column, value in (("study", study), ("backend", backend), ("kind", kind)):
            if value is not None:
                clauses.append(f"{column} = ?")
                values.append(value)
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        rows = self._connection.execute(
            "SELECT key, kind, study, backend, config, result, trajectory, finished_at "
            f"FROM results{where} ORDER BY finished_at", values).fetchall()
        return [_record(row) for row in rows]

    def put_summary(self, study: str, backend: str, device: str, payload: dict[str, Any]) -> None:
        """Store (replace) the analysed summary of a study on one backend and device."""
        with self._write() as cursor:
            cursor.execute("INSERT OR REPLACE INTO summaries VALUES (?, ?, ?, ?, ?)",
                           (study, backend, device, _dumps(payload), time.time()))

    def summaries(self, study: str | None = None) -> list[dict[str, Any]]:
        """Stored summaries (payload dicts), optionally of one study, oldest first."""
        where, values = ("WHERE study = ?", [study]) if study else ("", [])
        rows = self._connection.execute(
            f"SELECT payload FROM summaries {where} ORDER BY written_at", values).fetchall()
        return [json.loads(row[0]) for row in rows]


def _dumps(payload: Any) -> str:
    # NaN / inf (a diverged loss, an undefined noise scale) are kept: Python's json reads them.
    return json.dumps(payload, sort_keys=True, default=str)


def _record(row: tuple) -> dict[str, Any]:
    key, kind, study, backend, config, result, trajectory, finished_at = row
    return {"key": key, "kind": kind, "study": study, "backend": backend,
            "config": json.loads(config), "result": json.loads(result),
            "trajectory": None if trajectory is None else json.loads(trajectory),
            "finished_at": finished_at}
