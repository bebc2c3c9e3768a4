"""The study store's safety: it refuses files it did not create (leaving them byte-identical),
migrates an earlier kbackend's store in one transaction, and keeps every committed run in
``study.db`` itself (no run only in ``study.db-wal``)."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

import kbackend.study.store as store_module
from kbackend.cache import open_store
from kbackend.errors import KBackendError
from kbackend.study import pipeline
from kbackend.study.store import (
    APPLICATION_ID,
    SCHEMA_VERSION,
    ResultStore,
    StoredRun,
    StudyStoreError,
    inspect_store,
)

# The schema an earlier kbackend wrote: the same tables, in WAL mode, with no application id.
LEGACY_SCHEMA = """
CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE results (key TEXT PRIMARY KEY, kind TEXT NOT NULL, study TEXT NOT NULL,
    backend TEXT NOT NULL, config TEXT NOT NULL, result TEXT NOT NULL, trajectory TEXT,
    finished_at REAL NOT NULL);
CREATE INDEX results_by_study ON results (study, backend, kind);
CREATE TABLE summaries (study TEXT NOT NULL, backend TEXT NOT NULL, device TEXT NOT NULL,
    payload TEXT NOT NULL, written_at REAL NOT NULL, PRIMARY KEY (study, backend, device));
INSERT INTO meta VALUES ('schema_version', '1');
INSERT INTO results VALUES ('k0', 'run', 's', 'jax', '{"lr": 0.1}', '{"reached": true}', NULL, 1.0);
"""


def snapshot(folder: Path) -> dict[str, str]:
    """Every entry in ``folder`` with its SHA-256 (files) or ``'dir'``: any change shows."""
    state = {}
    for entry in sorted(folder.rglob("*")):
        name = str(entry.relative_to(folder))
        state[name] = "dir" if entry.is_dir() else hashlib.sha256(entry.read_bytes()).hexdigest()
    return state


def sqlite_file(path: Path, script: str, *, wal: bool = False) -> None:
    connection = sqlite3.connect(path)
    if wal:
        connection.execute("PRAGMA journal_mode=WAL")
    connection.executescript(script)
    connection.commit()
    connection.close()


def real_store(path: Path, runs: int = 3) -> None:
    with ResultStore(path) as store:
        for index in range(runs):
            store.put(StoredRun(f"k{index}", "run", "s", "jax", {"i": index}, {"reached": True},
                                {"loss": [0.5] * 200}))


def foreign(path: Path) -> None:
    sqlite_file(path, "CREATE TABLE notes (text TEXT); INSERT INTO notes VALUES ('mine');")


def foreign_wal(path: Path) -> None:
    sqlite_file(path, "CREATE TABLE notes (text TEXT); INSERT INTO notes VALUES ('mine');",
                wal=True)


def foreign_results_table(path: Path) -> None:
    # Names a kbackend table but lacks its columns: the old code crashed with "no such column".
    sqlite_file(path, "CREATE TABLE results (key TEXT, value TEXT);", wal=True)


def other_application(path: Path) -> None:
    sqlite_file(path, "PRAGMA application_id = 1234; CREATE TABLE t (x);")


def empty_with_user_version(path: Path) -> None:
    sqlite_file(path, "PRAGMA user_version = 7;")


def cache_db(path: Path) -> None:
    with open_store(str(path)) as store:
        store.put_many("model", [(b"key", b"value")])


def random_bytes(path: Path) -> None:
    path.write_bytes(random.Random(0).randbytes(8192))


def short_text(path: Path) -> None:
    path.write_text("hello")


def header_only(path: Path) -> None:
    real_store(path)
    path.write_bytes(path.read_bytes()[:100])


def truncated(path: Path) -> None:
    real_store(path, runs=20)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def corrupt_pages(path: Path) -> None:
    real_store(path, runs=20)
    data = bytearray(path.read_bytes())
    data[4096:len(data)] = random.Random(1).randbytes(len(data) - 4096)  # all but page 1
    path.write_bytes(bytes(data))


def directory(path: Path) -> None:
    path.mkdir()
    (path / "inside").write_text("x")


def newer_version(path: Path) -> None:
    real_store(path)
    connection = sqlite3.connect(path)
    connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    connection.close()


def legacy_wrong_version(path: Path) -> None:
    older = LEGACY_SCHEMA.replace("'schema_version', '1'", "'schema_version', '0'")
    sqlite_file(path, older, wal=True)


def legacy_extra_table(path: Path) -> None:
    sqlite_file(path, LEGACY_SCHEMA + "CREATE TABLE extra (x);", wal=True)


BAD_STORES: dict[str, tuple[Callable[[Path], None], str]] = {
    "foreign sqlite": (foreign, "another application"),
    "foreign sqlite in WAL mode": (foreign_wal, "another application"),
    "foreign results table": (foreign_results_table, "cannot be migrated"),
    "other application id": (other_application, "application_id 0x4d2"),
    "empty with a user_version": (empty_with_user_version, "user_version 7"),
    "kbackend cache": (cache_db, "prediction cache"),
    "random bytes": (random_bytes, "not an SQLite database"),
    "short text": (short_text, "not an SQLite database"),
    "sqlite header only": (header_only, "truncated"),
    "truncated store": (truncated, "truncated"),
    "corrupt pages": (corrupt_pages, "SQLite"),
    "directory": (directory, "not a file"),
    "newer schema version": (newer_version, "newer kbackend"),
    "earlier store, unknown version": (legacy_wrong_version, "cannot be migrated"),
    "earlier store, extra table": (legacy_extra_table, "cannot be migrated"),
}


@pytest.mark.parametrize("case", BAD_STORES, ids=list(BAD_STORES))
def test_bad_store_is_refused_with_one_line_and_left_unchanged(tmp_path, case):
    make, expected = BAD_STORES[case]
    folder = tmp_path / "out"
    folder.mkdir()
    path = folder / "study.db"
    make(path)
    before = snapshot(folder)
    assert before, "the case made no file"
    with pytest.raises(StudyStoreError) as raised:
        ResultStore(path)
    message = str(raised.value)
    assert isinstance(raised.value, KBackendError)
    assert "\n" not in message and str(path) in message and expected in message, message
    assert snapshot(folder) == before  # byte-identical, and no -wal / -shm / -journal beside it


def test_snapshot_sees_what_the_old_store_did_to_a_foreign_file(tmp_path):
    # Negative control: opening a foreign file the way the old store did (connect, switch to
    # WAL, add tables) changes what snapshot() reports, so the check above can fail.
    folder = tmp_path / "out"
    folder.mkdir()
    foreign(folder / "study.db")
    before = snapshot(folder)
    connection = sqlite3.connect(folder / "study.db")
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT)")
    connection.commit()
    assert snapshot(folder) != before
    connection.close()


@pytest.mark.parametrize("make", [lambda path: None, lambda path: path.write_bytes(b"")],
                         ids=["missing", "zero bytes"])
def test_a_missing_or_empty_file_becomes_a_marked_store(tmp_path, make):
    path = tmp_path / "study.db"
    make(path)
    assert inspect_store(path) == "new"
    with ResultStore(path) as store:
        store.put(StoredRun("k", "run", "s", "jax", {}, {"reached": True}))
    header = path.read_bytes()[:100]
    assert int.from_bytes(header[68:72], "big") == APPLICATION_ID
    assert int.from_bytes(header[60:64], "big") == SCHEMA_VERSION
    assert inspect_store(path) == "current"
    with ResultStore(path) as store:
        assert [record.key for record in store.records()] == ["k"]


def test_an_earlier_store_is_migrated_in_place_keeping_its_runs(tmp_path):
    path = tmp_path / "study.db"
    sqlite_file(path, LEGACY_SCHEMA, wal=True)
    assert inspect_store(path) == "legacy"
    with ResultStore(path) as store:
        assert store.get("k0").result == {"reached": True}
        assert store.put(StoredRun("k1", "run", "s", "jax", {}, {"reached": False}))
    connection = sqlite3.connect(path)
    assert connection.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    assert connection.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    connection.close()
    assert inspect_store(path) == "current"
    with ResultStore(path) as store:
        assert [record.key for record in store.records()] == ["k0", "k1"]


def test_an_earlier_store_killed_with_its_runs_in_the_wal_keeps_them(tmp_path):
    # A killed earlier kbackend left its schema and runs only in study.db-wal: the inspection
    # must read the WAL (not judge the bare main file "empty") and the migration keep the rows.
    source = tmp_path / "live.db"
    killed = tmp_path / "killed"
    killed.mkdir()
    connection = sqlite3.connect(source, isolation_level=None)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA wal_autocheckpoint=0")
    connection.executescript(LEGACY_SCHEMA)
    shutil.copyfile(source, killed / "study.db")  # the files as a SIGKILL leaves them
    shutil.copyfile(f"{source}-wal", killed / "study.db-wal")
    connection.close()
    assert inspect_store(killed / "study.db") == "legacy"
    with ResultStore(killed / "study.db") as store:
        assert [record.key for record in store.records()] == ["k0"]
    assert inspect_store(killed / "study.db") == "current"


def test_a_failed_migration_leaves_the_earlier_store_unchanged(tmp_path, monkeypatch):
    # The id and version are set in the transaction that re-checks the tables: an error after
    # the first PRAGMA rolls both back, so the file is never half-converted.
    path = tmp_path / "study.db"
    sqlite_file(path, LEGACY_SCHEMA, wal=True)
    before = snapshot(tmp_path)
    real_classify = store_module._classify
    calls = []

    def classify_then_fail(connection, store_path):
        verdict = real_classify(connection, store_path)
        calls.append(verdict)
        if len(calls) == 2:  # the second check runs under the write lock, before migrating
            connection.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            raise sqlite3.OperationalError("disk I/O error (injected)")
        return verdict

    monkeypatch.setattr(store_module, "_classify", classify_then_fail)
    with pytest.raises(StudyStoreError, match="injected"):
        ResultStore(path)
    monkeypatch.undo()
    assert snapshot(tmp_path) == before
    assert inspect_store(path) == "legacy"


def test_copying_study_db_alone_keeps_every_committed_run(tmp_path):
    path = tmp_path / "study.db"
    copy = tmp_path / "copy" / "study.db"
    copy.parent.mkdir()
    with ResultStore(path) as store:
        for index in range(3):
            store.put(StoredRun(f"k{index}", "run", "s", "jax", {"i": index}, {"reached": True},
                                {"loss": [0.25] * 100}))
        store.put_summary("s", "jax", "cpu", {"v": 1})
        assert Path(f"{path}-wal").exists()  # the store is open: its WAL file is still there
        shutil.copyfile(path, copy)  # only study.db, not study.db-wal
    assert not Path(f"{copy}-wal").exists()
    with ResultStore(copy) as store:
        assert [record.key for record in store.records()] == ["k0", "k1", "k2"]
        assert store.summaries() == [{"v": 1}]


def test_copy_check_sees_rows_left_in_the_wal(tmp_path):
    # Negative control: a WAL database committed without a checkpoint loses its rows when
    # study.db alone is copied, so the test above can fail.
    path = tmp_path / "plain.db"
    copy = tmp_path / "copy.db"
    connection = sqlite3.connect(path, isolation_level=None)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA wal_autocheckpoint=0")
    connection.execute("CREATE TABLE t (x)")
    connection.execute("INSERT INTO t VALUES (1)")
    shutil.copyfile(path, copy)
    connection.close()
    reader = sqlite3.connect(copy)
    assert reader.execute("SELECT name FROM sqlite_master").fetchall() == []
    reader.close()


def test_study_command_refuses_a_foreign_store_with_exit_2(tmp_path, cli, monkeypatch):
    def no_training(*args, **kwargs):
        raise AssertionError("training started on a refused store")

    monkeypatch.setattr(pipeline.StudyRunner, "run", no_training)
    out = tmp_path / "out"
    out.mkdir()
    foreign(out / "study.db")
    before = snapshot(out)
    result = cli("study", "--out", out, "--no-progress")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "study.db" in lines[0] and "another application" in lines[0]
    assert "Traceback" not in result.stderr
    assert snapshot(out) == before

    result = cli("study", "compare", "--out", out)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert snapshot(out) == before


# --- damaged rows: quarantined, warned about, retrained (issue 45) ------------------------------

def _damage(path: Path, column: str, value: object, key: str = "k1") -> None:
    connection = sqlite3.connect(path)
    connection.execute(f"UPDATE results SET {column} = ? WHERE key = ?", (value, key))
    connection.commit()
    connection.close()


@pytest.mark.parametrize(("column", "value"), [
    ("config", '{"i": 1'), ("result", "[1, 2]"), ("trajectory", b"\xff\xfe"),
    ("result", "[" * 100_000)])
def test_a_damaged_row_is_quarantined_with_one_warning_and_the_rest_is_used(
        tmp_path, column, value):
    path = tmp_path / "study.db"
    real_store(path)
    _damage(path, column, value)
    warnings: list[str] = []
    with ResultStore(path, warn=warnings.append) as store:
        records = store.records()
        assert [r.key for r in records] == ["k0", "k2"]
        assert len(warnings) == 1 and "'k1'" not in warnings[0] and "run k1 " in warnings[0]
        assert column in warnings[0] and "\n" not in warnings[0]
        assert store.get("k1") is None  # gone from the results: the run is trained again
        assert store.put(StoredRun("k1", "run", "s", "jax", {"i": 1}, {"reached": False}))
        assert store.get("k1").result == {"reached": False}
        kept = store.quarantined()
        assert len(warnings) == 1  # reported once, when it was moved
    assert [(q.source, q.name) for q in kept] == [("results", "k1")]
    content = json.loads(kept[0].content)
    assert content[column] == (value.hex() if isinstance(value, bytes) else value)
    assert content["key"] == "k1" and content["study"] == "s"


def test_get_of_a_damaged_row_quarantines_it(tmp_path):
    path = tmp_path / "study.db"
    real_store(path)
    _damage(path, "config", "not json")
    warnings: list[str] = []
    with ResultStore(path, warn=warnings.append) as store:
        assert store.get("k1") is None
        assert store.get("k0") is not None
        assert [r.key for r in store.records()] == ["k0", "k2"]
    assert len(warnings) == 1
    assert inspect_store(path) == "current"  # the quarantine table keeps the store a store


def test_a_damaged_summary_is_quarantined(tmp_path):
    path = tmp_path / "study.db"
    warnings: list[str] = []
    with ResultStore(path, warn=warnings.append) as store:
        store.put_summary("s", "jax/native", "cpu", {"a": 1})
        store.put_summary("t", "jax/native", "cpu", {"b": 2})
    connection = sqlite3.connect(path)
    connection.execute("UPDATE summaries SET payload = '{' WHERE study = 's'")
    connection.commit()
    connection.close()
    with ResultStore(path, warn=warnings.append) as store:
        assert store.summaries() == [{"b": 2}]
        assert store.quarantined()[0].name == "s/jax/native/cpu"
    assert len(warnings) == 1 and "summary s/jax/native/cpu" in warnings[0]


@pytest.mark.slow
def test_a_study_retrains_a_damaged_run_and_reuses_the_rest(tmp_path, cli):
    out = tmp_path / "out"
    args = ("study", "--dataset", "digits", "--model", "seed_mlp", "--engine", "native",
            "--optimizers", "sgd", "--batch-sizes", "64,128", "--seeds", "1",
            "--lr-grid-size", "1", "--noise-points", "0", "--step-time-repeats", "0",
            "--frontier-epochs", "0", "--max-steps", "40", "--no-progress", "--out", str(out))
    first = cli(*args)
    assert first.returncode == 0, first.stderr
    connection = sqlite3.connect(out / "study.db")
    keys = [row[0] for row in connection.execute(
        "SELECT key FROM results WHERE kind = 'run' ORDER BY key")]
    connection.execute("UPDATE results SET result = '{\"reached\": tr' WHERE key = ?", (keys[0],))
    connection.commit()
    connection.close()
    second = cli(*args)
    assert second.returncode == 0, second.stderr
    warnings = [line for line in second.stderr.splitlines() if "kbackend: warning:" in line]
    assert len(warnings) == 1 and keys[0][:16] in warnings[0] and "quarantine" in warnings[0]
    assert f"1 runs trained, {len(keys) - 1} reused" in second.stdout
    with ResultStore(out / "study.db") as store:
        assert [q.name for q in store.quarantined()] == [keys[0]]
        assert store.get(keys[0]) is not None
