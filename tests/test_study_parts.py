"""The study's injected parts: the record store (``ResultStore`` in SQLite, ``MemoryStore``: one
protocol, the same answers), the stored runs (``StoredRun``, JSON only at the store and the
report), the event sink (``StudyEvent``), and a store written by an earlier kbackend's ``put``
resuming with nothing retrained. Runs are trained by a stand-in executor: no engine runs here.
"""

from __future__ import annotations

import json
import sqlite3
import time

import pytest

from kbackend.study.executor import StudyRunner
from kbackend.study.pipeline import DB_NAME, run_study
from kbackend.study.runner_protocol import StudyEvent
from kbackend.study.store import MemoryStore, ResultStore, StoredRun
from tests.test_study_executor import _one_cell, _planted

# Two rates x two seeds of one cell; rate 1.0 reaches at step 30, rate 0.1 never does.
CONFIG = _one_cell(batch_sizes=(64,), seeds=2, learning_rates={"sgd": (0.1, 1.0)})


def _outcome(rate: float, seed: int) -> int | None:
    return 30 if rate == 1.0 else None


def _forbidden(runner, plan):
    raise AssertionError(f"trained {plan.label()}: it was stored")


@pytest.fixture(params=["sqlite", "memory"])
def store(request, tmp_path):
    if request.param == "memory":
        yield MemoryStore()
    else:
        with ResultStore(tmp_path / DB_NAME) as opened:
            yield opened


def test_both_stores_keep_the_first_run_and_return_its_json(store):
    run = StoredRun("k1", "run", "s", "jax", {"sizes": (8, 16), "seed": 3},
                    {"reached": True, "steps": {1: 2.5}}, {"step": [1, 2]})
    assert store.put(run)
    assert not store.put(StoredRun("k1", "run", "s", "jax", {}, {"reached": False}))
    stored = store.get("k1")
    # What SQLite gives back for a tuple and an int key: the JSON of them (a list, a string)
    assert stored.config == {"sizes": [8, 16], "seed": 3} and stored.seed == 3
    assert stored.result == {"reached": True, "steps": {"1": 2.5}}
    assert stored.trajectory == {"step": [1, 2]} and store.get("missing") is None
    store.put(StoredRun("k2", "noise", "s", "tensorflow", {}, {"b_simple": 4.0}))
    assert [r.key for r in store.records()] == ["k1", "k2"]
    assert [r.key for r in store.records(kind="noise")] == ["k2"]
    assert [r.key for r in store.records(study="s", backend="jax")] == ["k1"]
    assert store.records(study="other") == []
    with pytest.raises(AttributeError):
        stored.result = {}  # frozen: a stored run is changed by making a new one


def test_a_stored_run_is_json_only_as_the_report_reads_it():
    run = StoredRun("k", "run", "s", "jax", {"seed": 1}, {"reached": False}, None, 12.5)
    row = run.to_dict()
    assert row == {"key": "k", "kind": "run", "study": "s", "backend": "jax",
                   "config": {"seed": 1}, "result": {"reached": False}, "trajectory": None,
                   "finished_at": 12.5}
    assert StoredRun.from_dict(json.loads(json.dumps(row))) == run
    keyed = StoredRun.keyed({"b": 1, "a": 2}, "run", "s", "jax", {})
    assert keyed.key == StoredRun.keyed({"a": 2, "b": 1}, "run", "s", "jax", {}).key


def test_a_recording_sink_sees_each_run_start_finish_and_then_be_reused(store):
    events: list[StudyEvent] = []
    planted = _planted(_outcome)
    study = StudyRunner(CONFIG, store, events.append, run_executor=planted).run().to_json()
    runs = [e for e in events if e.what == "run"]
    assert [e.phase for e in runs] == ["start", "finished"] * 4 and len(planted) == 4
    finished = [e.record for e in runs if e.phase == "finished"]
    assert all(isinstance(r, StoredRun) for r in finished)
    assert {r.key for r in finished} == {r["key"] for r in study["runs"]}
    assert all(e.plan is not None and e.plan.batch_size == 64 for e in runs)

    events.clear()
    again = StudyRunner(CONFIG, store, events.append, run_executor=_forbidden)
    assert again.run().to_json()["cells"] == study["cells"] and again.executed == 0
    assert [e.phase for e in events if e.what == "run"] == ["skipped"] * 4


@pytest.mark.slow
def test_a_study_on_the_memory_store_gives_the_sqlite_studys_answers(tmp_path):
    on_disk = run_study(CONFIG, tmp_path / "disk", show_progress=False, print_results=False,
                        run_executor=_planted(_outcome))
    memory = MemoryStore()
    in_memory = run_study(CONFIG, tmp_path / "memory", show_progress=False,
                          print_results=False, run_executor=_planted(_outcome), store=memory)
    assert not (tmp_path / "memory" / DB_NAME).exists()  # the injected store, no file
    assert in_memory.executed == on_disk.executed == 4
    assert in_memory.study.to_json()["cells"] == on_disk.study.to_json()["cells"]
    assert len(memory.summaries()) == 1  # what `study compare` reads, kept there too
    again = run_study(CONFIG, tmp_path / "memory", show_progress=False, print_results=False,
                      run_executor=_forbidden, store=memory)
    assert again.executed == 0 and again.skipped == 4


def _put_as_before(path, run: StoredRun) -> None:
    """A row as ``ResultStore.put`` wrote it before runs were typed (commit 9819043): its
    arguments (key, kind, study, backend, config, result, trajectory) and its SQL, verbatim."""
    def dumps(payload):
        return json.dumps(payload, sort_keys=True, default=str)

    with sqlite3.connect(path) as connection:
        connection.execute(
            "INSERT INTO results VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (run.key, run.kind, run.study, run.backend, dumps(run.config), dumps(run.result),
             None if run.trajectory is None else dumps(run.trajectory), time.time()))
    connection.close()


def test_a_store_written_by_the_earlier_put_resumes_with_nothing_retrained(tmp_path):
    first = StudyRunner(CONFIG, MemoryStore(), run_executor=_planted(_outcome))
    study = first.run().to_json()
    assert isinstance(first.store, MemoryStore)
    made = first.store.added
    assert len(made) == 4
    old, new = tmp_path / "old.db", tmp_path / "new.db"
    ResultStore(old).close()
    for run in made:
        _put_as_before(old, run)
    with ResultStore(new) as store:
        for run in made:
            store.put(run)
    # The same columns, byte for byte, whichever put wrote them
    columns = "key, kind, study, backend, config, result, trajectory"
    rows = [sqlite3.connect(path).execute(f"SELECT {columns} FROM results ORDER BY key")
            .fetchall() for path in (old, new)]
    assert rows[0] == rows[1] and len(rows[0]) == 4
    with ResultStore(old) as store:
        resumed = StudyRunner(CONFIG, store, run_executor=_forbidden)
        assert resumed.run().to_json()["cells"] == study["cells"]
        assert resumed.executed == 0 and resumed.legacy_runs() == 0


def test_the_progress_bar_counts_and_names_what_the_events_say():
    import io

    from rich.console import Console
    from rich.progress import Progress

    from kbackend.study.pipeline import _ProgressEvents
    from kbackend.study.summaries import RunPlan

    console = Console(file=io.StringIO(), width=200)
    plan = RunPlan("sgd", 64, 0.1, 100, 10, 10, seed=1)
    reached = StoredRun("k", "run", "s", "jax", {}, {
        "reached": True, "steps_to_target": 30, "time_to_target": 0.25, "steps_run": 30})
    with Progress(console=console, disable=True) as progress:
        task = progress.add_task("study", total=4)
        events = _ProgressEvents(progress, task, console, lines=True)
        events(StudyEvent("extend", runs=2))  # a grid extension: 6 planned
        events(StudyEvent("start", plan=plan))
        assert events.label == plan.label()
        events(StudyEvent("finished", plan=plan, record=reached))
        events(StudyEvent("skipped", plan=plan, record=reached))
        events(StudyEvent("start", "noise", plan=plan))
        assert events.label == f"noise scale along {plan.label()}"
        events(StudyEvent("skipped", "noise", record=reached))
        events(StudyEvent("start", "probe", plan=plan))
        assert events.label == "sgd B=64: population or one by one? (probe)"
        events(StudyEvent("finished", "probe", record=reached))  # a probe is not a bar step
        events(StudyEvent("skipped", "frontier", record=reached))  # nor a frontier run
        events(StudyEvent("pruned", runs=1))
        assert progress.tasks[0].total == 6 and progress.tasks[0].completed == 4
    assert events.skipped == 2  # the reused run and the reused noise scale
    assert console.file.getvalue().splitlines() == [
        f"[1/6] {plan.label()}: reached in 30 steps, 0.25 s"]
