"""kbackend.sqlite: the retry loop and the immediate transaction both stores share."""

from __future__ import annotations

import sqlite3

import pytest

from kbackend.sqlite import immediate_transaction, retry_while_locked


def _flaky(failures: list[str]):
    """An action raising each of ``failures`` (as OperationalError) in turn, then returning 42."""
    calls = []

    def action() -> int:
        calls.append(1)
        if len(calls) <= len(failures):
            raise sqlite3.OperationalError(failures[len(calls) - 1])
        return 42

    return action, calls


def test_a_locked_database_is_tried_again():
    action, calls = _flaky(["database is locked", "database table is busy"])
    assert retry_while_locked(action, timeout_s=5.0) == 42
    assert len(calls) == 3


def test_another_error_is_raised_at_once():
    action, calls = _flaky(["no such table: models"])
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        retry_while_locked(action, timeout_s=5.0)
    assert len(calls) == 1


def test_a_lock_held_past_the_timeout_is_raised():
    action, calls = _flaky(["database is locked"] * 1000)
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        retry_while_locked(action, timeout_s=0.0)
    assert len(calls) <= 2


def test_the_transaction_commits_or_rolls_back(tmp_path):
    connection = sqlite3.connect(tmp_path / "t.db", isolation_level=None)
    connection.execute("CREATE TABLE t (x INTEGER)")
    with immediate_transaction(connection) as cursor:
        cursor.execute("INSERT INTO t VALUES (1)")
    with pytest.raises(RuntimeError), immediate_transaction(connection) as cursor:
        cursor.execute("INSERT INTO t VALUES (2)")
        raise RuntimeError("the body failed")
    assert connection.execute("SELECT x FROM t").fetchall() == [(1,)]
    assert not connection.in_transaction
    connection.close()


def test_a_second_writer_waits_for_the_first(tmp_path):
    """BEGIN IMMEDIATE takes the write lock: a second one fails as locked (and is retried)."""
    first = sqlite3.connect(tmp_path / "t.db", isolation_level=None)
    second = sqlite3.connect(tmp_path / "t.db", isolation_level=None, timeout=0.0)
    with immediate_transaction(first), pytest.raises(sqlite3.OperationalError, match="locked"):
        retry_while_locked(lambda: second.execute("BEGIN IMMEDIATE"), timeout_s=0.05)
    first.close()
    second.close()
