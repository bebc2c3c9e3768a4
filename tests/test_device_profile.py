"""Predicted on another device (``kbackend study --device-profile FILE``, issue 37 item 3): a
step-time curve measured elsewhere re-models each cell's time to target (steps here x its step
times); a bad profile is a one-line error before any training; it never changes what trains."""

from __future__ import annotations

import dataclasses
import json
import math
from functools import partial

import pytest

from kbackend.cli import main
from kbackend.commands import study as study_command
from kbackend.errors import ConfigError
from kbackend.io import read_json
from kbackend.study.config import StudyConfig
from kbackend.study.device_profile import DeviceProfile, load_profile, predict
from kbackend.study.executor import StudyRunner
from kbackend.study.pipeline import run_study
from kbackend.study.study_record import StudyRecord
from kbackend.training import Target
from tests.conftest import JIT_FOR_SMALL_RUNS

# Flat below a knee at 128: 1 ms per step up to 128, 4 ms at 512 (a device with parallel width
# to spare, e.g. a GPU on this small model).
FLAT = {"device": "synthetic-gpu", "step_time_s": {"32": 0.001, "128": 0.001, "512": 0.004}}

# sgd x (32, 128, auto) x 2 seeds, one rate: 6 runs of at most 300 steps on digits.
STUDY = StudyConfig(
    model="seed_mlp", dataset="digits", optimizers=("sgd",), batch_sizes=(32, 128, "auto"),
    learning_rates={"sgd": (0.1,)}, max_steps=300, engine="native",
    target=Target("val_accuracy", 0.9), noise_points=0, seeds=2, step_time_repeats=1,
    population="off", jit_compile=JIT_FOR_SMALL_RUNS,
)


def _write(path, payload):
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload))
    return str(path)


@pytest.fixture(scope="module")
def predicted(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile_study")
    profile = _write(out / "flat.json", FLAT)
    config = dataclasses.replace(STUDY, device_profile=profile)
    return out, config, run_study(config, out, show_progress=False, print_results=False)


@pytest.mark.slow
def test_a_flat_profile_predicts_the_larger_batch_faster_in_proportion(predicted):
    _, _, outcome = predicted
    study = outcome.study
    cells = {c["batch_size"]: c for c in study.device_profile["cells"]}
    here = {c.batch_size: c for c in study.cells}
    assert set(cells) == {32, 128}
    for size, cell in cells.items():
        assert here[size].reached
        assert cell["seconds_per_step"] == 0.001
        assert cell["time_to_target"] == here[size].steps_to_target * 0.001
        assert cell["seed_times"] == {s: v * 0.001 for s, v in here[size].seed_steps.items()}
        assert cell["time_to_target_here"] == here[size].time_to_target
    # the same step time: time there in proportion to steps (fewer at 128: faster there)
    ratio = cells[128]["time_to_target"] / cells[32]["time_to_target"]
    assert ratio == pytest.approx(here[128].steps_to_target / here[32].steps_to_target)
    assert here[128].steps_to_target < here[32].steps_to_target
    fastest = study.device_profile["fastest"]["cell"]
    assert fastest == {"optimizer": "sgd", "batch_size": 128}
    # the auto cell: every range between 32 and 128 costs 1 ms a step there
    (auto,) = study.device_profile["auto_cells"]
    (cell,) = study.auto_cells
    for seed, steps in cell.seed_steps.items():
        expected = steps * 0.001 if math.isfinite(steps) else math.inf
        assert auto["seed_times"][seed] == pytest.approx(expected, rel=1e-12)
    (adaptive,) = study.device_profile["adaptive"]
    assert adaptive["best_fixed"] == 128
    assert adaptive["ratio"] == pytest.approx(auto["time_to_target"] / cells[128]["time_to_target"])
    assert adaptive["ratio_here"] is not None and adaptive["time"]["seeds"] == 2


@pytest.mark.slow
def test_the_summary_and_the_report_hold_the_predictions(predicted):
    _, _, outcome = predicted
    summary = read_json(outcome.paths["summary"])
    assert summary["device_profile"]["profile"]["device"] == "synthetic-gpu"
    assert summary["device_profile"]["profile"]["step_time_s"] == FLAT["step_time_s"]
    assert [c["batch_size"] for c in summary["device_profile"]["cells"]] == [32, 128]
    report = outcome.paths["report"].read_text()
    assert "## Predicted on synthetic-gpu" in report
    assert "| optimizer | batch | steps | ms/step here | time here (s) | ms/step on synthetic-gpu" \
           " | time on synthetic-gpu (s) |" in report
    assert "| sgd | 128 |" in report and "| sgd | auto 32-128 (sqrt) |" in report
    assert "Predicted on synthetic-gpu (steps here x its step times): fastest" in report
    assert "compilation" in report  # the caveat: compute only


@pytest.mark.slow
def test_resuming_with_an_advise_profile_trains_nothing(predicted, tmp_path):
    out, config, first = predicted
    advice = tmp_path / "advice.json"
    assert main(["advise", "--quick", "--model", "seed_mlp", "--dataset", "digits",
                 "--budget", "10", "--json", str(advice)]) == 0
    profile = load_profile(str(advice))
    assert profile.format == "advise" and profile.model == "seed_mlp"
    assert profile.batch_range == (32, 256)

    def forbidden(runner, plan):
        raise AssertionError("a stored run was trained again")

    again = run_study(dataclasses.replace(config, device_profile=str(advice)), out,
                      show_progress=False, print_results=False, run_executor=forbidden)
    assert again.executed == 0
    assert again.study.study_id == first.study.study_id  # the identity is unchanged
    predicted_again = again.study.device_profile
    rows = {r["batch_size"]: r["step_ms"] / 1e3
            for r in read_json(advice)["measurements"]["batch_size"]}
    for cell, here in zip(predicted_again["cells"], again.study.cells, strict=True):
        assert cell["seconds_per_step"] == pytest.approx(profile.step_time(cell["batch_size"]))
        assert cell["time_to_target"] == here.steps_to_target * cell["seconds_per_step"]
    assert predicted_again["cells"][0]["seconds_per_step"] == rows[32]


def test_step_times_are_interpolated_in_log_log():
    profile = DeviceProfile("d", "p.json", "step_time_s", {32: 0.001, 128: 0.004})
    assert profile.step_time(64) == pytest.approx(0.002)  # the geometric mean
    assert profile.step_time(128) == 0.004
    with pytest.raises(ValueError, match="outside"):
        profile.step_time(256)


def test_the_profile_is_outside_the_identity():
    with_profile = StudyConfig(device_profile="a.json")
    assert with_profile.identity() == StudyConfig().identity()
    with pytest.raises(ConfigError, match="Invalid device_profile"):
        StudyConfig(device_profile="")


@pytest.mark.parametrize(("payload", "message"), [
    (None, "file not found"),
    ("{not json", "not JSON"),
    ([1, 2], "not an object"),
    ({"device": "x"}, "no step times"),
    ({"device": "x", "step_time_s": {}}, "the curve is empty"),
    ({"device": "x", "step_time_s": {"32": 0.0}}, "not a positive number"),
    ({"device": "x", "step_time_s": {"32": -0.001}}, "not a positive number"),
    ('{"device": "x", "step_time_s": {"32": NaN}}', "not a positive number"),
    ({"device": "x", "step_time_s": {"32": "fast"}}, "not a positive number"),
    ({"device": "x", "step_time_s": {"32.5": 0.001}}, "batch size '32.5' is not a positive"),
    ({"device": "x", "step_time_s": {"big": 0.001}}, "batch size 'big' is not a positive"),
    ({"device": "x", "step_time_s": {"32": 0.001, "032": 0.001}}, "given twice"),
    ({"measurements": {"batch_size": [{"batch_size": 32}]}}, "rows with batch_size"),
    ({"device": "x", "model": "mlp", "step_time_s": {"32": 0.001, "128": 0.001}},
     "measured for model 'mlp'"),
    ({"device": "x", "step_time_s": {"64": 0.001, "128": 0.001}}, "lie outside"),
    # issue 45: extreme step times and deep nesting are refused when the profile is read
    ({"device": "x", "step_time_s": {"32": 1e-300, "128": 0.001}}, "outside 1e-09-86400 s"),
    ({"device": "x", "step_time_s": {"32": 0.001, "128": 1e300}}, "outside 1e-09-86400 s"),
    ({"device": "x", "step_time_s": {"32": 0.001, "99999999999999999999": 0.001}},
     "is not a positive integer"),
    ('{"device": ' + "[" * 100_000 + "]" * 100_000 + "}", "not JSON (RecursionError"),
])
def test_a_bad_profile_is_a_one_line_error_before_training(tmp_path, monkeypatch, capsys,
                                                          payload, message):
    def forbidden(*args, **kwargs):
        raise AssertionError("training started despite a bad profile")

    monkeypatch.setattr("kbackend.study.executor.train", forbidden)
    # the fake run executor through the study command's seam (run_study(run_executor=...))
    monkeypatch.setattr(study_command, "run_study",
                        partial(study_command.run_study, run_executor=forbidden))
    path = tmp_path / "profile.json"
    if payload is not None:
        _write(path, payload)
    code = main(["study", "--dataset", "digits", "--model", "seed_mlp", "--batch-sizes", "32,128",
                 "--out", str(tmp_path / "out"), "--no-progress", "--device-profile", str(path)])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "--device-profile" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out" / "study.db").exists()  # nothing created, nothing trained


def test_a_profile_is_read_before_the_data_loads(tmp_path, monkeypatch, capsys):
    def forbidden(*args, **kwargs):
        raise AssertionError("the data was loaded before the profile was checked")

    monkeypatch.setattr(StudyRunner, "prepare", forbidden)
    path = _write(tmp_path / "profile.json", {"device": "x", "step_time_s": {"32": 1e300}})
    code = main(["study", "--dataset", "digits", "--out", str(tmp_path / "out"),
                 "--no-progress", "--device-profile", path])
    assert code == 2 and "outside" in capsys.readouterr().err


@pytest.mark.parametrize("epochs", ["2147483647", "1000001"])
def test_frontier_epochs_beyond_the_cap_is_refused_under_its_own_name_before_the_data(
        tmp_path, monkeypatch, capsys, epochs):
    def forbidden(*args, **kwargs):
        raise AssertionError("the data was loaded before --frontier-epochs was checked")

    monkeypatch.setattr(StudyRunner, "prepare", forbidden)
    code = main(["study", "--dataset", "digits", "--out", str(tmp_path / "out"),
                 "--no-progress", "--frontier-epochs", epochs])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "Invalid --frontier-epochs" in err and "1,000,000" in err and "max" not in err
    assert not (tmp_path / "out").exists()


def test_frontier_epochs_whose_steps_overflow_are_refused_once_the_data_is_known():
    config = dataclasses.replace(STUDY, frontier_epochs=1_000_000)
    config.check_frontier_steps(2147, (1, 128))  # 2,147,000,000 steps: within int32
    with pytest.raises(ConfigError, match=r"Invalid --frontier-epochs .* steps at batch size 1"):
        config.check_frontier_steps(2148, (1, 128))


def _cell(size, seed_steps, reached=True):
    finite = sorted(v for v in seed_steps.values())
    median = finite[len(finite) // 2]
    return {"optimizer": "sgd", "batch_size": size, "reached": reached,
            "steps_to_target": median if reached else None, "seed_steps": seed_steps,
            "time_to_target": median * 1e-3 * size if reached else None, "eval_every": 4,
            "steps_run": 200, "intervals": {"steps_to_target": {
                "median": median, "low": finite[0], "high": finite[-1], "n": 3}}}


def test_each_range_of_an_auto_run_costs_the_profile_time_at_its_size():
    profile = DeviceProfile("d", "p.json", "step_time_s", {16: 0.001, 64: 0.004})
    study = StudyRecord.from_json({"config": {"seeds": 3}, "cells": [
        _cell(16, {"0": 100.0, "1": 120.0, "2": 110.0}),
        _cell(64, {"0": math.inf, "1": math.inf, "2": 60.0}, reached=False)],
        "auto_cells": [{**_cell(16, {"0": 100.0, "1": 80.0, "2": math.inf}),
                        "batch_size": "auto", "auto": {"min": 16, "max": 64,
                                                       "lr_scaling": "sqrt"},
                        "ranges": {"0": [{"step": 0, "batch_size": 16},
                                         {"step": 48, "batch_size": 32}],
                                   "1": [{"step": 0, "batch_size": 16}],
                                   "2": [{"step": 0, "batch_size": 16}]}}]})
    predicted = predict(study, profile)
    fixed, never = predicted["cells"]
    assert fixed["time_to_target"] == 110 * 0.001
    assert fixed["interval"]["low"] == 100 * 0.001 and fixed["interval"]["high"] == 120 * 0.001
    assert never["time_to_target"] is None and never["seconds_per_step"] == 0.004
    (auto,) = predicted["auto_cells"]
    # seed 0: 48 steps at 16 (1 ms), 52 at 32 (2 ms: the log-log midpoint of 1 and 4 ms)
    assert auto["seed_times"]["0"] == pytest.approx(48 * 0.001 + 52 * 0.002)
    assert auto["seed_times"]["1"] == pytest.approx(80 * 0.001)
    assert auto["seed_times"]["2"] == math.inf
    assert auto["time_to_target"] == pytest.approx(48 * 0.001 + 52 * 0.002)  # the median seed
    (adaptive,) = predicted["adaptive"]
    assert adaptive["best_fixed"] == 16
    assert adaptive["ratio"] == pytest.approx(auto["time_to_target"] / (110 * 0.001))
    assert predicted["fastest"]["cell"] == {"optimizer": "sgd", "batch_size": 16}
