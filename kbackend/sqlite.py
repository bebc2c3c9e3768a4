"""What both SQLite stores (the prediction cache, the study's results) do alike.

- Every connection is opened by ``connect``: autocommit (transactions explicit), SQLite's busy
  handler set, and for a writer the store's own set-up, WAL journal mode and its durability.
- A write that reads first runs in one ``BEGIN IMMEDIATE`` transaction
  (``immediate_transaction``): in WAL mode a deferred read-then-write transaction fails at once
  with "database is locked" under concurrency, ignoring ``busy_timeout``; an immediate one takes
  the write lock up front and waits.
- ``busy_timeout`` makes SQLite wait inside each call, but not everywhere (switching the journal
  mode, for one): ``retry_while_locked`` is the backstop there.

Each store keeps its own error messages, file checks and durability level.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file
# Words in an ``OperationalError``'s message when another connection holds the lock.
LOCK_WORDS = ("locked", "busy")
FIRST_RETRY_S = 0.001
LONGEST_RETRY_S = 0.1

T = TypeVar("T")


def is_locked(error: sqlite3.OperationalError) -> bool:
    """Whether ``error`` says another connection holds the database (worth waiting for)."""
    return any(word in str(error).lower() for word in LOCK_WORDS)


def retry_while_locked(action: Callable[[], T], timeout_s: float) -> T:
    """``action()``, called again while it raises a locked/busy ``OperationalError``.

    Waits from 1 ms, doubling up to 0.1 s, between tries; after ``timeout_s`` seconds the last
    locked error is raised, and any other ``OperationalError`` at once (``is_locked`` tells
    them apart for the caller's message).
    """
    deadline = time.monotonic() + timeout_s
    delay = FIRST_RETRY_S
    while True:
        try:
            return action()
        except sqlite3.OperationalError as error:
            if not is_locked(error) or time.monotonic() > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, LONGEST_RETRY_S)


def connect(path: str | os.PathLike, timeout_s: float, *, synchronous: str | None = None,
            setup: Callable[[sqlite3.Connection], None] | None = None, uri: bool = False,
            check_same_thread: bool = True) -> sqlite3.Connection:
    """A connection to ``path`` (``uri``: a ``file:`` URI) that waits up to ``timeout_s`` for
    another's lock, with ``isolation_level=None`` (transactions are explicit). Then
    ``setup(connection)`` (the store's checks and schema), and for a writer (``synchronous``:
    ``NORMAL`` or ``FULL``) WAL journal mode and that durability level. Closed if any step
    raises (``sqlite3.Error``s propagate for the store's own message)."""
    conn = sqlite3.connect(path, timeout=timeout_s, isolation_level=None, uri=uri,
                           check_same_thread=check_same_thread)
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(timeout_s * 1000)}")
        if setup is not None:
            setup(conn)
        if synchronous is not None:
            # The busy handler does not cover a journal-mode switch: retry while it is locked.
            retry_while_locked(lambda: conn.execute("PRAGMA journal_mode = WAL").fetchone(),
                               timeout_s)
            conn.execute(f"PRAGMA synchronous = {synchronous}")
    except BaseException:
        conn.close()
        raise
    return conn


@contextmanager
def immediate_transaction(connection: sqlite3.Connection) -> Iterator[sqlite3.Cursor]:
    """One ``BEGIN IMMEDIATE`` ... ``COMMIT`` transaction on ``connection`` (opened with
    ``isolation_level=None``), rolled back if the body raises; yields the cursor it runs on."""
    cursor = connection.cursor()
    cursor.execute("BEGIN IMMEDIATE")
    try:
        yield cursor
    except BaseException:
        if connection.in_transaction:  # SQLite may already have rolled back on some errors
            cursor.execute("ROLLBACK")
        raise
    cursor.execute("COMMIT")
