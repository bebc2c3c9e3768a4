"""The history's typed run record: saved and loaded, and histories written before it."""

from __future__ import annotations

import json

import pytest

from kbackend.history import History, RunRecord


def test_a_history_round_trips_with_its_record(tmp_path):
    history = History(step=[1, 2], loss=[0.5, 0.25], time=[0.1, 0.2],
                      evals=[{"step": 2, "val_accuracy": 0.75}])
    history.record.fused_steps, history.record.trace_counts = 2, {"2": 1}
    history.record.target_reached = {"step": 2, "epoch": 1, "train_time": 0.2}
    history.save(tmp_path / "h.json")
    stored = json.loads((tmp_path / "h.json").read_text())
    # Only the fields that are set are written.
    assert stored["record"] == {"fused_steps": 2, "trace_counts": {"2": 1},
                                "target_reached": {"step": 2, "epoch": 1, "train_time": 0.2}}
    assert "extra" not in stored
    assert History.load(tmp_path / "h.json") == history


def test_a_history_written_with_extra_loads(tmp_path):
    old = {"step": [1], "loss": [1.0], "time": [0.1], "evals": [], "test": {}, "timing": {},
           "stopped_early": False, "config": {}, "env": {},
           "extra": {"diverged": {"step": 1, "loss": "nan", "seen_in": "train_loss"},
                     "epochs_run": 1, "no_longer_recorded": 3}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    history = History.load(tmp_path / "old.json")
    assert history.record.diverged == {"step": 1, "loss": "nan", "seen_in": "train_loss"}
    assert history.record.epochs_run == 1
    assert history.record == RunRecord.from_dict(old["extra"])  # unknown keys left out


def test_a_history_has_no_extra_dict_any_more():
    history = History()
    assert not hasattr(history, "extra")
    with pytest.raises(TypeError):
        History(extra={"censored_at": 40})  # type: ignore[call-arg]


def test_record_update_takes_the_fields_that_are_set():
    record = RunRecord(engine="native", fused_steps=4)
    record.update(RunRecord(engine="data_parallel", devices=2))
    assert record == RunRecord(engine="data_parallel", fused_steps=4, devices=2)
