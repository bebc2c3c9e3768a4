"""bench_tuner (kbackend/bench/tuner.py): the cells both sides search, the kbackend command it
times, the paired ratio's interval, reading the study's pick from what it printed, the table,
the skip without Keras Tuner; and (slow) its quick measurement, both sides as whole processes.
No timing thresholds."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest

from kbackend.bench import tuner
from kbackend.bench.registry import BENCHMARKS
from kbackend.bench.spec import Settings
from kbackend.runtime.child import ChildFailed
from tests.conftest import BACKEND


def rows_from(walls: list[tuple[float, float]], picks=None) -> list[dict]:
    """Rows of repeats with (kbackend, Keras Tuner) walls; the same pick unless given."""
    pick = {"optimizer": "adam", "batch_size": 64, "learning_rate": 0.002}
    rows = []
    for repeat, (ours, theirs) in enumerate(walls):
        first = "kbackend" if repeat % 2 == 0 else "keras_tuner"
        ours_pick, their_pick = picks[repeat] if picks else (pick, pick)
        rows += [{"repeat": repeat, "first": first, "side": "kbackend", "wall_s": ours,
                  "pick": ours_pick, "confirmed_on": "3 of 3", "confirmation_s": 4.0,
                  "time_spent": {"whole_process_s": ours - 1, "steady_training_s": 10.0,
                                 "other_s": 5.0}},
                 {"repeat": repeat, "first": first, "side": "keras_tuner", "wall_s": theirs,
                  "pick": their_pick, "trials": 18, "reached": 15}]
    return rows


def test_the_full_grid_is_18_cells_and_both_sides_get_the_same():
    cells = tuner.grid(Settings())
    assert cells["rates"] == {"sgd": [0.0632, 0.2, 0.632], "adam": [0.000632, 0.002, 0.00632]}
    assert cells["batch_sizes"] == [32, 64, 128] and cells["seeds"] == 3
    assert sum(len(r) for r in cells["rates"].values()) * len(cells["batch_sizes"]) == 18
    # The middle rate is the study's own centre at batch 32.
    from kbackend.study.config import CENTRE_LR
    assert all(cells["rates"][o][1] == CENTRE_LR[o] for o in tuner.OPTIMIZERS)
    assert tuner.grid(Settings(options={"seeds": 1, "target": 0.8}))["seeds"] == 1
    assert tuner.grid(Settings(quick=True))["batch_sizes"] == [64]


def test_the_kbackend_command_is_the_goals(tmp_path):
    """--seeds 3 --max-seeds 3 --frontier-epochs 0, the same cells (no grid extension), the
    target, an epoch budget that binds before the step budget, and the confirmation at its
    default (3 held-out seeds) in the full run."""
    splits = tmp_path / "splits.npz"
    np.savez(splits, y_train=np.zeros(4500, dtype=np.int64))
    argv = tuner.study_argv(splits, tuner.grid(Settings()), tmp_path / "out", quick=False)
    text = " ".join(argv)
    for flags in ("--seeds 3", "--max-seeds 3", "--frontier-epochs 0", "--lr-extend 0",
                  "--optimizers sgd,adam", "--batch-sizes 32,64,128", "--target 0.85",
                  "--max-epochs 10", "--max-steps 1410", "--lrs=sgd=0.0632,0.2,0.632",
                  "--lrs=adam=0.000632,0.002,0.00632"):
        assert flags in text, flags
    assert "--confirm-seeds" not in text and argv[3] == "study"
    assert "--confirm-seeds 1" in " ".join(
        tuner.study_argv(splits, tuner.grid(Settings(quick=True)), tmp_path, quick=True))


def test_the_ratio_is_the_geometric_mean_of_paired_ratios_with_a_t_interval():
    steady = tuner.ratio_interval(rows_from([(50.0, 100.0), (40.0, 80.0), (60.0, 120.0)]))
    assert steady["ratio"] == pytest.approx(0.5) and steady["pairs"] == 3
    assert steady["low"] == pytest.approx(0.5) and steady["high"] == pytest.approx(0.5)
    noisy = tuner.ratio_interval(rows_from([(50.0, 100.0), (90.0, 100.0), (70.0, 100.0)]))
    assert noisy["ratio"] == pytest.approx(math.exp(np.mean(np.log([0.5, 0.9, 0.7]))))
    assert noisy["low"] < noisy["ratio"] < noisy["high"]
    one = tuner.ratio_interval(rows_from([(50.0, 100.0)]))
    assert one["ratio"] == pytest.approx(0.5) and one["low"] is None and one["high"] is None


def test_summary_goal_and_same_pick():
    summary = tuner.tuner_summary(rows_from([(50.0, 100.0), (40.0, 90.0)]),
                                  tuner.grid(Settings()), 2)
    assert summary["n_cells"] == 18 and summary["goal_met"] and summary["same_pick"]
    assert summary["kbackend_wall_s"] == 45.0 and summary["keras_tuner_wall_s"] == 95.0
    assert summary["kbackend_time_spent_median"]["confirmation_s"] == 4.0
    other = {"optimizer": "sgd", "batch_size": 32, "learning_rate": 0.2}
    mine = {"optimizer": "sgd", "batch_size": 32, "learning_rate": 0.632}
    slower = tuner.tuner_summary(rows_from([(120.0, 100.0)], picks=[(mine, other)]),
                                 tuner.grid(Settings()), 1)
    assert not slower["goal_met"] and not slower["goal_resolved"] and not slower["same_pick"]


def test_the_studys_pick_is_read_from_what_it_printed():
    stdout = ("...\nRecommended: adam at batch 64, lr 0.00632 (edge) (the fastest median time "
              "to target; tied with sgd at batch 32: ...).\n  Confirmed with this command on 3 "
              "held-out seeds: train reaches the target in 350 [300, 400] steps, time to target "
              "1.20 [1.1, 1.3] s (median [min, max]; reached\non 2 of 3).\n  kbackend train ...\n"
              "bench_tuner confirmation_s=4.25\n")
    found = tuner.recommended(stdout)
    assert found == {"pick": {"optimizer": "adam", "batch_size": 64, "learning_rate": 0.00632},
                     "confirmed_on": "2 of 3"}
    assert tuner.CONFIRMATION_S.search(stdout)[1] == "4.25"
    assert tuner.recommended("No cell reached the target: nothing to recommend")["pick"] is None
    # A command that reached the target on none of its held-out seeds (the console may wrap).
    missed = ("Recommended: sgd at batch 32, lr 0.632 (edge) (resolved).\n  Confirmed with this "
              "command on 3 held-out seeds: the target was not\nreached on any of them.\n")
    assert tuner.recommended(missed)["confirmed_on"] == "0 of 3"


def test_the_table_shows_repeats_ratio_and_picks():
    rows = [{**row, "backend": BACKEND} for row in rows_from([(50.0, 100.0), (40.0, 90.0)])]
    summary = {"backend": BACKEND, **tuner.tuner_summary(rows, tuner.grid(Settings()), 2)}
    table = tuner.tuner_table({"rows": rows, "summaries": [summary]})
    assert "| 0 | kbackend | 50.0 | 100.0 | 0.50 | adam b64 lr 0.002 (3 of 3) |" in table
    assert "| 1 | keras_tuner | 40.0 | 90.0 | 0.44 |" in table
    assert "goal <= 1.0x met" in table and "same pick in every repeat: yes" in table
    assert "confirmation 4.0" in table


def test_without_keras_tuner_it_skips_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(tuner, "tuner_available", lambda: False)
    rows, summary = tuner.measure_tuner(Settings(quick=True))
    assert rows == [{"side": "keras_tuner", "repeat": None, "note": tuner.NOT_INSTALLED}]
    assert summary == {"skipped": tuner.NOT_INSTALLED}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'kbackend[bench]'" in err
    table = tuner.tuner_table({"rows": rows, "summaries": [{"backend": BACKEND, **summary}]})
    assert "skipped" in table
    assert BENCHMARKS["bench_tuner"].measure is tuner.measure_tuner


@pytest.mark.slow
def test_quick_measurement_runs_both_tools_on_the_same_cells():
    """Both sides as whole processes on the quick grid (2 cells): each picks a cell of the grid,
    Keras Tuner ran every trial, kbackend confirmed its pick and accounted its time."""
    pytest.importorskip("keras_tuner")
    rows, summary = tuner.measure_tuner(Settings(quick=True))
    assert [r["side"] for r in rows] == ["kbackend", "keras_tuner"]
    ours, theirs = rows
    cells = tuner.grid(Settings(quick=True))
    for pick in (ours["pick"], theirs["pick"]):
        assert pick["learning_rate"] in cells["rates"][pick["optimizer"]]
        assert pick["batch_size"] in cells["batch_sizes"]
    assert theirs["trials"] == 2 and theirs["search_s"] > 0 and theirs["wall_s"] > 0
    assert {(t["optimizer"], t["batch_size"]) for t in theirs["trial_results"]} == {
        ("sgd", 64), ("adam", 64)}
    assert ours["confirmed_on"] == "1 of 1" and ours["confirmation_s"] > 0
    assert ours["runs_trained"] >= 2 * cells["seeds"] and ours["time_spent"]["whole_process_s"] > 0
    assert summary["ratio"]["ratio"] == pytest.approx(ours["wall_s"] / theirs["wall_s"])
    assert summary["n_cells"] == 2 and isinstance(summary["same_pick"], bool)


def test_a_failed_whole_process_is_one_line_naming_it():
    """A side that fails raises one line: what ran (a ``-c`` script by its flag, not its text)
    and its last stderr line."""
    script = "import sys\nprint('working')\nsys.exit('no such model')"
    with pytest.raises(ChildFailed, match=r"^-c SCRIPT failed with exit 1: no such model$"):
        tuner.timed_process([sys.executable, "-c", script, "arg"], dict(os.environ))
    with pytest.raises(ChildFailed, match=r"^-m json\.tool /no/such/file failed with exit \d+: "):
        tuner.timed_process([sys.executable, "-m", "json.tool", "/no/such/file"],
                            dict(os.environ))
