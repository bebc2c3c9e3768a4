"""The study's typed results (``study_record``) read back from and written to the JSON summary.json
has always held: the same keys in the same order (a report of a resumed study keeps its bytes),
partial records read with defaults. No training."""

from __future__ import annotations

import json
import math

from kbackend.study.study_record import (
    AddedSeeds,
    Cell,
    Frontier,
    HeldOutRuns,
    NoisePoint,
    NoiseScale,
    StepTimes,
    StudyRecord,
    TimeAccount,
)

INTERVAL = {"median": 100.0, "low": 90.0, "high": 120.0, "n": 3, "coverage": 0.75}
SEARCH = {"optimizer": "sgd", "batch_size": 32, "lr_grid": [0.1, 0.3], "lr_tried": [0.03, 0.1, 0.3],
          "lr_extended": {"below": 1, "above": 0}, "lr_at_grid_edge": True, "lr_edge": "below",
          "lr_at_bound": True, "population": {"path": "sequential", "members": 6,
                                              "reason": "--population off"}}
FIGURES = {"learning_rate": 0.03, "seeds": 3, "seed_values": [0, 1, 2], "reached": True,
           "seeds_reached": 3, "steps_to_target": 100.0, "samples_to_target": 3200.0,
           "epochs_to_target": 2.5, "time_to_target": 0.5, "time_to_target_raw": 1.5,
           "steps_run": 100.0, "best_metric": 0.91, "test_accuracy": 0.9, "test_metric": 0.9,
           "samples_per_s": 6400.0, "startup_time": 1.0, "startup_time_estimated": False,
           "train_time": 4.5, "wall_time": 6.0, "seed_steps": {"0": 90.0, "1": 100.0, "2": 120.0},
           "seed_test": {"0": 0.9}, "test_metric_name": "test_accuracy", "eval_every": 10,
           "fused_steps": 2, "run_key": "k1", "run_keys": ["k0", "k1", "k2"],
           "intervals": {"steps_to_target": INTERVAL, "time_to_target": INTERVAL,
                         "time_to_target_runs": INTERVAL}}


def test_a_fixed_cell_reads_back_to_the_same_record_in_the_same_order():
    frontier = {"epochs": 2, "seeds": 3, "metric": "val_accuracy", "test_metric_name": None,
                "best_metric": INTERVAL, "test_metric": INTERVAL, "best_epoch": INTERVAL,
                "seed_best": {"0": 0.9}, "seed_test": {"0": 0.8}}
    record = {**SEARCH, **FIGURES, "frontier": frontier,
              "time_to_target_runs": 1.4, "time_model": "steps x step time",
              "seconds_per_step": INTERVAL}
    cell = Cell.from_json(record)
    assert cell.size == 32 and cell.steps == 100.0 and cell.seconds == 0.5
    assert list(cell.to_json().items()) == list(record.items())
    # no time model, frontier or measured step time yet: those keys are left out, as they were
    bare = {**SEARCH, **FIGURES}
    assert list(Cell.from_json(bare).to_json()) == list(bare)


def test_an_auto_cell_reads_back_with_its_own_parts():
    record = {**SEARCH, **FIGURES, "batch_size": "auto",
              "auto": {"min": 16, "max": 128, "lr_scaling": "sqrt"},
              "seed_samples": {"0": 6000.0}, "seed_times": {"0": 0.4},
              "ranges": {"0": [{"step": 0, "batch_size": 16}]}, "time_to_target_runs": 1.2,
              "time_model": "run clocks", "largest_batch": None}
    assert list(Cell.from_json(record).to_json().items()) == list(record.items())


def test_a_cell_that_never_reached_counts_as_infinitely_slow():
    cell = Cell.from_json({"optimizer": "adam", "batch_size": 64, "reached": False,
                           "steps_to_target": None})
    assert cell.steps == math.inf and cell.seconds == math.inf and cell.seeds_reached == 0


def test_step_times_keep_the_order_they_were_read_in():
    fresh = {"engine": "native", "study_engine": "keras", "repeats": 3, "min_seconds": 0.03,
             "round_calls": 3,
             "cells": [{"optimizer": "sgd", "batch_size": 32, "learning_rate": 0.1,
                        "steps_per_call": 64, "fused_steps": 2, "warm_up_s": 0.5,
                        "seconds": [0.01, 0.011, 0.012], "seconds_per_step": INTERVAL,
                        "cv": 0.05}]}
    times = StepTimes.from_json(fresh)
    assert times is not None and times.seconds() == {("sgd", 32): (0.01, 0.011, 0.012)}
    assert times.to_json() == fresh and list(times.to_json()) == list(fresh)
    # as the store returns it (sorted keys): written back sorted, as summary.json always had
    stored = {k: fresh[k] for k in sorted(fresh)}
    stored["cells"] = [{k: c[k] for k in sorted(c)} for c in fresh["cells"]]
    again = StepTimes.from_json(stored)
    assert again is not None and list(again.to_json()) == sorted(fresh)
    assert list(again.to_json()["cells"][0]) == sorted(fresh["cells"][0])
    assert StepTimes.from_json(None) is None


def test_a_study_record_reads_a_summary_back():
    summary = {"study": "s1", "config": {"seeds": 3, "target": {"metric": "val_accuracy",
                                                                 "value": 0.9}},
               "env": {"backend": "jax"}, "batch_sizes": [32], "cells": [{**SEARCH, **FIGURES}],
               "runs": [{"key": "k1", "config": {"batch_size": 32, "learning_rate": 0.03},
                         "optimizer": "sgd", "result": {"reached": True}}],
               "added_seeds": {"schedule": [3, 5], "max_seeds": 5,
                               "rounds": [{"seeds": 5, "cells": [["sgd", 32]],
                                           "runs": [["sgd", 32, 3]]}],
                               "seconds": 1.0, "recorded_seconds": 0.5, "frontier_seconds": 0.0,
                               "budget": None, "stopped": "max_seeds reached",
                               "frontier_epochs": 0},
               "time_spent": {"runs_trained": 3, "whole_process_s": 10.0}}
    study = StudyRecord.from_json(summary)
    assert study.study_id == "s1" and study.target["value"] == 0.9
    assert study.cells[0].key == ("sgd", 32) and study.batch_sizes == (32,)
    # summary.json keeps a run's optimizer beside its config: read back into it
    (run,) = study.runs
    assert run.key == "k1" and run.config["optimizer"] == {"name": "sgd"}
    assert isinstance(study.added_seeds, AddedSeeds)
    assert study.added_seeds.to_json() == summary["added_seeds"]
    # an accounting written before a part was counted reads it as 0
    assert isinstance(study.time_spent, TimeAccount) and study.time_spent.setup_s == 0
    assert study.to_json()["cells"] == [{**SEARCH, **FIGURES}]


def test_the_noise_scale_frontier_and_confirmation_read_back_as_typed_records():
    """The records a study stores or writes (the noise scale, a cell's frontier, the held-out
    seeds' confirmation) read back from their JSON to equal records."""
    point = NoisePoint(10, 2.0, 40.0, 0.1, 0.2, 8, 64, 4, 20.0)
    noise = NoiseScale("sgd", 32, 0.1, 8, 64, 4, (point,), 20.0)
    frontier = Frontier(2, 3, "val_accuracy", "test_accuracy", INTERVAL, INTERVAL, INTERVAL,
                        {"0": 0.9}, {"0": 0.8})
    held_out = HeldOutRuns("sgd", 32, 0.1, 2, (10_000, 10_001), 1, 0, False, INTERVAL,
                           INTERVAL, INTERVAL, 100.0, 0.5, ("--model", "seed_mlp"))
    for record in (noise, frontier, held_out):
        assert type(record).from_json(json.loads(json.dumps(record.to_json()))) == record
    cell = Cell.from_json({**SEARCH, **FIGURES, "frontier": frontier.to_json()})
    study = StudyRecord(cells=[cell], noise=noise, confirmation=(held_out,))
    again = StudyRecord.from_json(json.loads(json.dumps(study.to_json())))
    assert again.cells[0].frontier == frontier and again.noise == noise
    assert again.confirmation == (held_out,)
    assert Cell.from_json({**SEARCH, **FIGURES}).frontier is None  # none measured
