"""The study end to end on the active backend: report and plots, resume after an exception or a
kill, time to target without evaluation, never-reached cells, bad input before training."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from kbackend.cli import main
from kbackend.errors import ConfigError, DataError
from kbackend.io import NON_FINITE_KEY
from kbackend.study.config import StudyConfig
from kbackend.study.executor import StudyRunner
from kbackend.study.noise_runs import NoiseMeasurement
from kbackend.study.pipeline import compare, run_study
from kbackend.study.plots import PLOTS
from kbackend.study.populations import Populations
from kbackend.study.runner_protocol import NotStored
from kbackend.study.step_times import ROUND_CALLS, StepTimeModel, timed_steps
from kbackend.study.store import ResultStore, StoredRun
from kbackend.study.study_record import NoisePoint, StepTimes
from kbackend.training import Target
from tests.conftest import BACKEND, JIT_FOR_SMALL_RUNS, NO_JIT_FLAGS, ROOT

DIGITS = {"model": "seed_mlp", "dataset": "digits"}  # small and embedded: the tests' data
# 2 optimizers x 2 batch sizes x 2 seeds, a 60-step budget, one learning rate each (the search,
# its pruning and the grid's extension are tested with a stand-in engine below). SGD at lr 1e-4
# cannot reach the target in 60 steps: a never-reached cell. The study's default engine
# (native: each cell's runs share its compiled programs); TINY_KERAS runs Keras fit instead.
# Without XLA on TensorFlow (conftest's JIT_FOR_SMALL_RUNS): compilation is not the subject here.
TINY = StudyConfig(
    model="seed_mlp", dataset="digits", optimizers=("sgd", "adam"), batch_sizes=(64, 256),
    learning_rates={"sgd": (1e-4,), "adam": (3e-3,)}, max_steps=60, engine="native",
    target=Target("val_accuracy", 0.9), noise_points=2, noise_draws=4, seeds=2,
    step_time_repeats=1, population="off",  # one run at a time: the populations' own tests below
    jit_compile=JIT_FOR_SMALL_RUNS,
)
TINY_KERAS = dataclasses.replace(TINY, engine="keras")
# The resume tests need only the runs (the same run keys as TINY's): no noise scale, no time model.
RESUMED = dataclasses.replace(TINY, noise_points=0, step_time_repeats=0)
RESUMED_ARGS = ["study", "--model", "seed_mlp", "--dataset", "digits", "--optimizers", "sgd,adam",
                "--batch-sizes", "64,256", "--lrs",
                "sgd=0.0001", "--lrs", "adam=0.003", "--max-steps", "60", "--engine", "native",
                "--target", "0.9", "--noise-points", "0", "--noise-draws", "4", "--seeds", "2",
                "--step-time-repeats", "0", "--population", "off", "--no-progress", *NO_JIT_FLAGS]
TINY_RUNS = 8


def _run_grid(config, out_dir, run_executor=None) -> StudyRunner:
    """The study's runs into ``out_dir/study.db`` (no report): what resumption is about."""
    with ResultStore(out_dir / "study.db") as store:
        runner = StudyRunner(config, store, run_executor=run_executor)
        runner.run()
    return runner


def _outcomes(out_dir) -> dict[str, tuple]:
    """Every stored run: key -> (reached, steps to target)."""
    with ResultStore(out_dir / "study.db") as store:
        return {r.key: (r.result["reached"], r.result["steps_to_target"])
                for r in store.records(kind="run")}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The tiny study, uninterrupted."""
    out = tmp_path_factory.mktemp("baseline")
    return out, run_study(TINY, out, show_progress=False, print_results=False)


@pytest.mark.slow
def test_tiny_study_writes_report_plots_and_reports_unreached_cells(baseline):
    import matplotlib.image

    _, result = baseline
    study = result.study.to_json()  # the record as summary.json holds it
    assert result.executed == TINY_RUNS and result.skipped == 0
    cells = {(c["optimizer"], c["batch_size"]): c for c in study["cells"]}
    assert sorted(cells) == [("adam", 64), ("adam", 256), ("sgd", 64), ("sgd", 256)]
    for batch in (64, 256):
        sgd, adam = cells["sgd", batch], cells["adam", batch]
        assert not sgd["reached"]
        assert sgd["steps_to_target"] is None and sgd["time_to_target"] is None
        assert sgd["best_metric"] < 0.9 and sgd["steps_run"] >= 60
        assert adam["reached"] and adam["best_metric"] >= 0.9 and adam["steps_to_target"] <= 60 + 21
        assert adam["samples_to_target"] == pytest.approx(
            adam["epochs_to_target"] * study["dataset"]["num_train"])
        assert adam["samples_per_s"] > 0 and 0.0 < adam["test_accuracy"] <= 1.0
    assert result.analysis.best.optimizer == "adam"
    assert all(len(r["trajectory"]["step"]) == r["result"]["steps_run"] for r in study["runs"])
    noise = study["noise"]
    assert noise["points"][0]["step"] == 0 and len(noise["points"]) == 2
    assert all(np.isfinite(p["trace_sigma"]) for p in noise["points"])

    folder = result.paths["report"].parent
    report = (folder / "report.md").read_text()
    assert report.count("NOT REACHED (0/2)") == 2 and "| adam | 64 |" in report
    summary = json.loads((folder / "summary.json").read_text())
    assert len(summary["cells"]) == 4 and summary["env"]["backend"] == BACKEND
    assert sorted(r["config"]["seed"] for r in study["runs"]) == [0] * 4 + [1] * 4
    for name in PLOTS:
        data = (folder / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        image = matplotlib.image.imread(folder / "plots" / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


@pytest.mark.slow
def test_the_study_accounts_for_its_time(baseline):
    _, result = baseline
    account = result.time_spent
    assert account.runs_trained == TINY_RUNS
    runs = result.study.runs
    steady = sum(r.result["train_time"] - r.result["startup_time"] for r in runs)
    assert account.steady_training_s == pytest.approx(steady, rel=1e-6)
    assert account.evaluation_s == pytest.approx(sum(r.result["eval_time"] for r in runs))
    # A cell's start-up holds building its trainer (and the study's model and initial values),
    # not only the compilation inside the runs' training clocks.
    compiled = sum(r.result["startup_time"] for r in runs)
    assert account.setup_s > 0
    assert account.startup_s == pytest.approx(compiled + account.setup_s, rel=1e-6)
    parts = ("steady_training_s", "startup_s", "evaluation_s", "around_runs_s", "time_model_s",
             "noise_scale_s", "report_s", "other_s")
    assert all(getattr(account, k) >= 0 for k in parts) and account.time_model_s > 0
    # The parts add up to the whole process (the runs' wall time holds their three parts).
    assert sum(getattr(account, k) for k in parts) == pytest.approx(account.whole_process_s,
                                                                    rel=1e-6)
    assert account.whole_over_steady == pytest.approx(account.whole_process_s / steady)
    folder = result.paths["report"].parent
    assert "Where this process's time went" in (folder / "report.md").read_text()
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["time_spent"]["runs_trained"] == TINY_RUNS


def test_time_accounting_states_the_goal_and_reused_runs():
    from kbackend.study.pipeline import accounting_line, time_accounting
    from kbackend.study.timing import TimeSpent

    spent = TimeSpent(runs=9, runs_wall=14.0, training=11.0, startup=3.0, evaluation=2.0,
                      step_times=1.0, noise=1.0)
    account = time_accounting(spent, call_seconds=17.0, process=19.0, report_seconds=1.0)
    assert account.steady_training_s == 8.0 and account.around_runs_s == 1.0
    assert account.whole_process_s == 20.0 and account.other_s == 3.0
    assert account.goal_s == 15.0 and not account.goal_met  # 1.5 x 8 + 3
    assert account.whole_over_steady == 2.5
    assert "2.5x" in accounting_line(account) and "not met" in accounting_line(account)
    met = time_accounting(spent, call_seconds=12.0, process=13.0, report_seconds=1.0)
    assert met.goal_met and ", met)" in accounting_line(met)
    nothing = time_accounting(TimeSpent(), call_seconds=1.0, process=3.0)
    assert nothing.whole_over_steady is None
    assert "no run trained" in accounting_line(nothing)


@pytest.mark.slow
def test_the_console_table_fits_100_columns(baseline):
    import io

    from rich.console import Console

    from kbackend.study.analysis import analyze
    from kbackend.study.report import print_table

    study = baseline[1].study
    out = io.StringIO()
    print_table(study, analyze(study), Console(file=out, width=100, highlight=False))
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 100
    end = next(i for i, line in enumerate(lines) if line.startswith("(medians"))
    table = [line for line in lines[:end] if line.strip().startswith(("sgd", "adam"))]
    assert len(table) == len(study.cells)  # one line per cell: nothing wrapped
    assert "…" not in "\n".join(table) and any(" no (" in line for line in table)


@pytest.mark.slow
def test_rerun_skips_every_finished_run(baseline):
    out, first = baseline
    again = run_study(TINY, out, show_progress=False, print_results=False)
    assert again.executed == 0 and again.skipped == TINY_RUNS + 2  # + noise, step times
    assert ([c["run_key"] for c in again.study.to_json()["cells"]]
            == [c["run_key"] for c in first.study.to_json()["cells"]])


@pytest.mark.slow
def test_resume_after_an_exception_mid_grid(tmp_path, baseline):
    if BACKEND != "jax":
        pytest.skip("the resume logic is above the backends: once, in the JAX session (the slow "
                    "killed-process resume test runs on both)")
    calls = []

    def failing_third_run(runner, plan):
        calls.append(plan)
        if len(calls) == 3:
            raise RuntimeError("simulated crash")
        return runner.train_here(plan)

    with pytest.raises(RuntimeError, match="simulated crash"):
        _run_grid(RESUMED, tmp_path, failing_third_run)
    with ResultStore(tmp_path / "study.db") as store:
        finished = {r.key: r.finished_at for r in store.records(kind="run")}
    assert len(finished) == 2  # the third run was in flight

    assert _run_grid(RESUMED, tmp_path).executed == TINY_RUNS - 2
    with ResultStore(tmp_path / "study.db") as store:
        after = {r.key: r.finished_at for r in store.records(kind="run")}
    assert all(after[key] == stamp for key, stamp in finished.items())  # not redone
    assert _outcomes(tmp_path) == _outcomes(baseline[0])


@pytest.mark.slow
def test_resume_after_the_process_is_killed_at_an_injected_point(tmp_path, baseline):
    """SIGKILL right after the second run is committed (an injected kill point, not a timed
    one): the store file alone holds both runs, no temp file is left, and the resumed study
    redoes neither and ends with the uninterrupted study's outcomes."""
    code = textwrap.dedent(f"""
        import os, signal
        from kbackend.study import store
        from kbackend.cli import main

        put, committed = store.ResultStore.put, []

        def put_then_die_after_the_second_run(self, run):
            stored = put(self, run)
            if run.kind == "run" and stored:
                committed.append(run.key)
                if len(committed) == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
            return stored

        store.ResultStore.put = put_then_die_after_the_second_run
        main({[*RESUMED_ARGS, "--out", str(tmp_path)]!r})
    """)
    env = {**os.environ, "KERAS_BACKEND": BACKEND, "KBACKEND_OFFLINE": "1"}
    killed = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    db = tmp_path / "study.db"
    copy = tmp_path / "copy" / "study.db"
    copy.parent.mkdir()
    copy.write_bytes(db.read_bytes())  # the file the docs name, without its -wal companion
    with ResultStore(copy) as store:
        assert len(store.records(kind="run")) == 2
    with ResultStore(db) as store:
        finished = {r.key: r.finished_at for r in store.records(kind="run")}
    assert len(finished) == 2
    assert [p.name for p in tmp_path.iterdir() if ".tmp" in p.name] == []

    resumed = _run_grid(RESUMED, tmp_path)
    with ResultStore(db) as store:
        after = {r.key: r.finished_at for r in store.records(kind="run")}
        assert {r.study for r in store.records(kind="run")} == {resumed.study_id}
    assert all(after[key] == stamp for key, stamp in finished.items())
    assert resumed.executed == TINY_RUNS - 2
    assert _outcomes(tmp_path) == _outcomes(baseline[0])


@pytest.mark.slow
def test_time_to_target_excludes_evaluation(tmp_path, monkeypatch):
    delay = 0.3
    original_build = StudyRunner.build_model

    def model_with_slow_evaluation(self, seed=None):
        # Slow down every validation batch (the validation split fits in one batch of 256):
        # the delay runs inside Keras's evaluation loop, as a slow evaluation would.
        model = original_build(self, seed)
        make_test_function = model.make_test_function

        def make_slow_test_function(force=False):
            function = make_test_function(force)
            if not getattr(model.test_function, "slowed", False):
                inner = model.test_function

                def slow(*args, **kwargs):
                    time.sleep(delay)
                    return inner(*args, **kwargs)

                slow.slowed = True
                model.test_function = slow
            return function

        model.make_test_function = make_slow_test_function
        return model

    monkeypatch.setattr(StudyRunner, "build_model", model_with_slow_evaluation)
    with ResultStore(tmp_path / "study.db") as store:
        runner = StudyRunner(TINY_KERAS, store)
        runner.prepare()
        record = runner.run_one(runner.plan("adam", 256, 3e-3))
    result, evals = record.result, record.trajectory["evals"]
    assert result["reached"] and len(evals) >= 2
    # Every validation slept `delay` inside the engine's wall time; none of it is training time.
    assert result["eval_time"] >= len(evals) * delay
    assert result["time_to_target"] <= result["wall_time"] - len(evals) * delay
    assert result["time_to_target_raw"] == evals[-1]["train_time"]
    assert result["time_to_target"] == pytest.approx(
        result["time_to_target_raw"] - result["startup_time"])


@pytest.mark.parametrize(("reported", "expected", "estimated"), [
    (None, 4.5, True), (3.0, 4.5, True), (5.0, 5.0, False),
])
def test_startup_is_taken_out_of_time_to_target(reported, expected, estimated):
    from kbackend.history import History
    from kbackend.study.summaries import RunPlan, summarize_run

    history = History()
    history.record_steps(list(range(1, 31)), [1.0] * 30, [4.5 + 0.05 * s for s in range(1, 31)])
    for step in (10, 20, 30):  # 0.05 s per step after a start-up of 4.5 s
        history.record_eval(step=step, epoch=step // 10, train_time=4.5 + 0.05 * step,
                            val_loss=0.1, val_accuracy=0.5 + 0.015 * step)
    history.record.target_reached = {"step": 30, "epoch": 3, "train_time": 6.0}
    history.timing.update(train_time=6.0, eval_time=1.0)
    if reported is not None:
        history.timing["compile_time"] = reported
    plan = RunPlan("sgd", 10, 0.1, 30, 10, 10)
    result = summarize_run(history, plan, Target("val_accuracy", 0.9), num_train=100).to_json()
    assert result["startup_time"] == pytest.approx(expected)
    assert result["startup_time_estimated"] is estimated
    assert result["time_to_target"] == pytest.approx(6.0 - expected)
    assert result["samples_to_target"] == 300 and result["epochs_to_target"] == pytest.approx(3.0)
    assert result["samples_per_s"] == pytest.approx(300 / (6.0 - expected))


def _fake_history(plan, steps_to_target):
    """A finished run's history as an engine returns it, without training."""
    from kbackend.history import History

    history = History()
    steps = min(plan.max_steps, steps_to_target or plan.max_steps)
    history.record_steps(list(range(1, steps + 1)), [1.0] * steps,
                         [0.01 * s for s in range(1, steps + 1)])
    reaches = bool(steps_to_target and steps_to_target <= plan.max_steps)
    history.record_eval(step=steps, epoch=1, train_time=0.01 * steps, val_loss=0.1,
                        val_accuracy=0.95 if reaches else 0.5)
    if steps_to_target and steps_to_target <= plan.max_steps:
        history.record.target_reached = {"step": steps, "epoch": 1, "train_time": 0.01 * steps}
    history.timing.update(train_time=0.01 * steps, eval_time=0.0, wall_time=0.01 * steps)
    history.test = {"test_accuracy": 0.9, "test_loss": 0.3}
    return history


def test_learning_rate_search_prunes_and_picks_the_fewest_steps(tmp_path):
    # Stand-in engine: steps to target by learning rate (None: never reached).
    outcome = {0.1: 300, 0.01: None, 1.0: 120, 0.3: 200}
    budgets = []

    def execute(runner, plan):
        budgets.append((plan.learning_rate, plan.max_steps))
        return _fake_history(plan, outcome[plan.learning_rate])

    config = StudyConfig(**DIGITS, optimizers=("sgd",), batch_sizes=(1294,), max_steps=1000,
                         engine="keras",
                         learning_rates={"sgd": (0.1, 0.01, 1.0, 0.3)}, noise_points=0,
                         seeds=1, lr_extend=0, step_time_repeats=0)
    with ResultStore(tmp_path / "study.db") as store:
        study = StudyRunner(config, store, run_executor=execute).run().to_json()
    # One step per epoch at batch 1294 (the keras engine evaluates every epoch).
    assert budgets == [(0.1, 1000), (0.01, 300), (1.0, 300), (0.3, 120)]
    (cell,) = study["cells"]
    assert cell["learning_rate"] == 1.0 and cell["steps_to_target"] == 120
    assert cell["lr_at_grid_edge"] and cell["lr_at_bound"] and len(study["runs"]) == 4
    assert study["noise"] is None


@pytest.fixture
def no_training(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("training started despite bad input")

    monkeypatch.setattr("kbackend.study.executor.train", forbidden)
    monkeypatch.setattr("kbackend.study.noise_runs.train", forbidden)


@pytest.mark.parametrize(("make", "error", "message"), [
    (lambda: StudyConfig(batch_sizes=(8, 100_000)), DataError, "larger than the training split"),
    (lambda: StudyConfig(target=Target("val_accuracy", 1.5)), ConfigError, "can only reach"),
    (lambda: StudyConfig(target=Target("val_loss", 0.0)), ConfigError, "must be > 0"),
    (lambda: StudyConfig(batch_sizes=()), ConfigError, "Empty batch-size list"),
    (lambda: StudyConfig(optimizers=("sgd", "lamb")), ConfigError, "Unknown optimizer"),
    (lambda: StudyConfig(seeds=0), ConfigError, "Invalid seeds 0"),
    (lambda: StudyConfig(lr_extend=-1), ConfigError, "Invalid lr_extend -1"),
    (lambda: StudyConfig(max_epochs=-1), ConfigError, "Invalid max_epochs -1"),
    (lambda: StudyConfig(population="maybe"), ConfigError, "Invalid population 'maybe'"),
    # TensorFlow has no population trainer; Keras fit trains one run at a time on both.
    (lambda: StudyConfig(population="on", engine="keras" if BACKEND == "jax" else "native"),
     ConfigError, "--population on needs the native engine on JAX"),
])
def test_bad_input_fails_before_any_training(tmp_path, no_training, make, error, message):
    with pytest.raises(error, match=message):
        run_study(make(), tmp_path, show_progress=False, print_results=False)
    assert list(tmp_path.iterdir()) == []  # not even an empty study.db


@pytest.mark.parametrize(("flags", "message"), [
    (["--target", "1.5"], "accuracy can only reach"),
    (["--batch-sizes", ""], "Empty batch-size list"),
    (["--batch-sizes", "8,100000"], "larger than the training split"),
    (["--optimizers", "sgd,lion"], "Unknown optimizer"),
    (["--seeds", "0"], "Invalid seeds 0"),
    (["--lr-extend", "-1"], "Invalid lr_extend -1"),
    (["--target", "-0.5"], "val_accuracy"),
])
def test_cli_bad_input_is_a_one_line_error(tmp_path, no_training, capsys, flags, message):
    assert main(["study", "--out", str(tmp_path), "--no-progress", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_no_jit_reaches_the_keras_engine_and_keys_only_the_runs_it_changes(tmp_path):
    from kbackend.cli import build_parser
    from kbackend.commands.study import config_from_args

    args = build_parser().parse_args(["study", "--engine", "keras", "--no-jit"])
    assert config_from_args(args).jit_compile is False
    assert config_from_args(build_parser().parse_args(["study"])).jit_compile is True
    keys = {}
    for jit in (True, False):
        config = dataclasses.replace(TINY_KERAS, jit_compile=jit)
        with ResultStore(tmp_path / f"{jit}.db") as store:
            runner = StudyRunner(config, store)
            runner.prepare()
            plan = runner.plan("adam", 64, 3e-3)
            assert runner.train_config(plan).jit_compile is jit
            keys[jit] = runner.run_key_config(plan)
    # Off is part of what a run is; on keeps the keys runs had before the option existed.
    assert "jit_compile" not in keys[True] and keys[False].pop("jit_compile") is False
    assert keys[False] == keys[True]
    assert config.identity() == dataclasses.replace(TINY_KERAS, jit_compile=True).identity()


@pytest.mark.slow
def test_compare_puts_backends_side_by_side(baseline, tmp_path, capsys):
    folder = baseline[1].paths["report"].parent
    other = copy.deepcopy(json.loads((folder / "summary.json").read_text()))
    other["env"]["backend"] = "other"
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert main(["study", "compare", str(folder), str(tmp_path / "other.json"),
                 "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert f"{BACKEND}/native time (s)" in text and "other/native time (s)" in text
    assert text.count("| sgd | 64 |") == 1 and "not reached" in text
    assert (tmp_path / "compare.md").is_file()
    # Each study's line states the report's verdicts, intervals and all (not the medians'
    # answers, which the report may call unresolved); a summary from before seeds, its medians'.
    verdicts = other["analysis"]["verdicts"]
    line = compare([other])
    assert verdicts["fastest"]["text"] in line and verdicts["throughput_knee"]["text"] in line
    assert all(x["text"] in line for x in verdicts["optimizers"])
    del other["analysis"]["verdicts"]
    assert "fastest adam" in compare([other])


def _without(summary, *keys):
    broken = copy.deepcopy(summary)
    holder = broken
    for key in keys[:-1]:
        holder = holder[key]
    del holder[keys[-1]]
    return json.dumps(broken)


@pytest.mark.slow
@pytest.mark.parametrize(("make", "message"), [
    (lambda s: "", "not JSON"),
    (lambda s: "{bad", "not JSON"),
    (lambda s: json.dumps(s)[:300], "not JSON"),
    (lambda s: b"\x8c\x00\xff".decode("latin-1"), "not JSON"),
    (lambda s: "[1, 2]", "study is missing"),
    (lambda s: "{}", "study is missing"),
    (lambda s: "NaN", "study is missing"),
    (lambda s: _without(s, "config"), "config is missing"),
    (lambda s: _without(s, "config", "target"), "config.target is missing"),
    (lambda s: json.dumps({k: v for k, v in s.items() if k != NON_FINITE_KEY}
                          | {"cells": [{"x": 1}]}),
     "cells.0. lacks optimizer"),
    (lambda s: json.dumps({**s, "cells": [{"x": 1}]}), "non-finite numbers names fields"),
    (lambda s: json.dumps({**s, "config": {**s["config"], "optimizers": "x"}}),
     "config.optimizers is missing or not a list"),
    (lambda s: _without(s, "analysis", "best"), "analysis lacks best"),
], ids=["empty", "bad-json", "truncated", "binary", "list", "empty-object", "nan", "no-config",
        "no-target", "bad-cell", "dangling-non-finite", "bad-optimizers", "no-best"])
def test_compare_refuses_a_bad_summary_with_one_line(baseline, tmp_path, capsys, make, message):
    folder = baseline[1].paths["report"].parent
    good = json.loads((folder / "summary.json").read_text())
    bad = tmp_path / "bad.json"
    bad.write_text(make(good), encoding="latin-1")
    assert main(["study", "compare", str(folder), str(bad), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kbackend: error: Invalid study summary") and "\n" not in err, err
    assert re.search(message, err), err
    assert not (tmp_path / "compare.md").exists()


def test_noise_batch_larger_than_the_training_split_is_refused_before_training(monkeypatch):
    calls = _planted(lambda rate, seed: 10)
    config = dataclasses.replace(TINY, noise_big_batch=100_000, noise_small_batch=8)
    with pytest.raises(ConfigError, match=r"the big batch \(100000\) is larger than the training "
                                          r"split \(1294 samples\)"):
        StudyRunner(config, None, run_executor=calls).prepare()
    assert calls == []


class _Planted(list):
    """A stand-in run executor (``StudyRunner(run_executor=...)``): ``outcome(learning_rate,
    seed)`` is the run's steps to target (None: never reached); the list holds the (learning
    rate, seed, budget) of every run it was asked to train."""

    def __init__(self, outcome):
        super().__init__()
        self.outcome = outcome

    def __call__(self, runner, plan):
        self.append((plan.learning_rate, plan.seed, plan.max_steps))
        return _fake_history(plan, self.outcome(plan.learning_rate, plan.seed))


def _planted(outcome) -> _Planted:
    return _Planted(outcome)


def _one_cell(**overrides):
    options = {**DIGITS, "optimizers": ("sgd",), "batch_sizes": (1294,), "max_steps": 1000,
               "engine": "keras", "noise_points": 0, "seeds": 3, "lr_extend": 0,
               "step_time_repeats": 0, **overrides}
    return StudyConfig(**options)


def test_max_epochs_caps_the_budget_where_the_epochs_end_first(tmp_path):
    budgets = {}

    def execute(runner, plan):
        budgets[plan.batch_size] = plan.max_steps
        return _fake_history(plan, None)

    config = _one_cell(batch_sizes=(8, 1294), seeds=1, max_epochs=3,
                       learning_rates={"sgd": (0.1,)})
    with ResultStore(tmp_path / "study.db") as store:
        study = StudyRunner(config, store, run_executor=execute).run().to_json()
    # Batch 8: 3 epochs of 161 steps (483) is under max_steps, rounded up to whole evaluation
    # intervals (the keras engine evaluates every 162 steps). Batch 1294: one step per epoch.
    assert budgets == {8: 486, 1294: 3}
    assert [cell["reached"] for cell in study["cells"]] == [False, False]
    # Without the cap, a stored study keeps its identity (its store key) from before the option.
    digits = StudyConfig(dataset="digits")  # a dataset with no budget of its own
    assert "max_epochs" not in digits.identity()
    assert digits.identity()["max_steps"] == 3000
    assert StudyConfig(dataset="digits", max_epochs=3).identity()["max_epochs"] == 3
    # MNIST's default budget: 20,000 steps or 8 epochs (batch 8: 6,750 steps per epoch; batch
    # 1,024: 52), the same question as the flags that say so.
    mnist = StudyConfig(dataset="mnist")
    assert (mnist.step_budget(6750), mnist.step_budget(52)) == (20_000, 416)
    explicit = StudyConfig(dataset="mnist", max_steps=20_000, max_epochs=8)
    assert mnist.identity() == explicit.identity()
    assert StudyConfig(dataset="mnist", max_epochs=0).step_budget(52) == 20_000


def test_seeds_pick_the_rate_with_the_best_median_and_give_intervals(tmp_path):
    # Rate 0.1 has the luckiest seed (50) but rate 1.0 the best median (200 < 300).
    steps = {(0.1, 0): 50, (0.1, 1): 300, (0.1, 2): None, (1.0, 0): 250, (1.0, 1): 200,
             (1.0, 2): 150}
    calls = _planted(lambda lr, seed: steps[lr, seed])
    config = _one_cell(learning_rates={"sgd": (0.1, 1.0)}, prune=False)
    with ResultStore(tmp_path / "study.db") as store:
        study = StudyRunner(config, store, run_executor=calls).run().to_json()
        assert sorted((lr, seed) for lr, seed, _ in calls) == sorted(steps)
        (cell,) = study["cells"]
        assert cell["learning_rate"] == 1.0 and cell["steps_to_target"] == 200
        assert cell["reached"] and cell["seeds"] == 3 and cell["seeds_reached"] == 3
        interval = cell["intervals"]["steps_to_target"]
        assert (interval["low"], interval["median"], interval["high"]) == (150, 200, 250)
        assert interval["coverage"] == pytest.approx(0.75)
        # Every seed is its own stored run: a second pass trains nothing.
        calls.clear()
        again = StudyRunner(config, store, run_executor=calls)
        again.run()
        assert calls == [] and again.executed == 0
        assert len({r.key for r in store.records(kind="run")}) == 6


def test_a_tie_on_median_steps_is_broken_by_steps_not_by_a_clock():
    from kbackend.study.summaries import best_rate

    def record(steps, seconds):
        return StoredRun("k", "run", "s", "jax", {}, {
            "steps_to_target": steps, "reached": True, "time_to_target": seconds,
            "best_metric": 0.95})

    # Same median (200); 0.1 has the smaller mean steps but the slower clock (a loaded machine).
    by_rate = {0.1: [record(150, 9.0), record(200, 9.0), record(210, 9.0)],
               1.0: [record(190, 1.0), record(200, 1.0), record(300, 1.0)]}
    assert best_rate(by_rate, larger_is_better=True) == 0.1
    # Equal steps everywhere: only then does the clock decide.
    by_rate[0.1] = [record(190, 9.0), record(200, 9.0), record(300, 9.0)]
    assert best_rate(by_rate, larger_is_better=True) == 1.0


def test_a_cell_reaches_only_when_its_median_seed_does(tmp_path):
    planted = _planted(lambda lr, seed: 100 if seed == 0 else None)
    with ResultStore(tmp_path / "study.db") as store:
        (cell,) = StudyRunner(_one_cell(learning_rates={"sgd": (0.1,)}), store,
                              run_executor=planted).run().to_json()["cells"]
    assert not cell["reached"] and cell["steps_to_target"] is None and cell["seeds_reached"] == 1
    assert math.isinf(cell["intervals"]["steps_to_target"]["high"])


def test_pruning_with_seeds_keeps_the_winner_exact(tmp_path):
    # 0.1: median 300 (the budget of later rates). 1.0: two seeds reach under 300, one never
    # does within the pruned budget: it wins on its median, and its cut-short seed is re-run on
    # the full budget for the interval's upper end. 0.01: two misses, its last seed is skipped.
    steps = {(0.1, 0): 300, (0.1, 1): 280, (0.1, 2): 400, (1.0, 0): 120, (1.0, 1): 700,
             (1.0, 2): 200, (0.01, 0): None, (0.01, 1): 900, (0.01, 2): 10}
    calls = _planted(lambda lr, seed: steps[lr, seed])
    config = _one_cell(learning_rates={"sgd": (0.1, 1.0, 0.01)})
    with ResultStore(tmp_path / "study.db") as store:
        (cell,) = StudyRunner(config, store, run_executor=calls).run().to_json()["cells"]
    assert calls == [(0.1, 0, 1000), (0.1, 1, 1000), (0.1, 2, 1000),
                     (1.0, 0, 300), (1.0, 1, 300), (1.0, 2, 300),
                     (0.01, 0, 200), (0.01, 1, 200),
                     (1.0, 1, 1000)]
    assert cell["learning_rate"] == 1.0 and cell["steps_to_target"] == 200
    interval = cell["intervals"]["steps_to_target"]
    assert (interval["low"], interval["high"]) == (120, 700)


def test_a_rate_behind_on_its_metric_skips_its_last_seed_when_no_rate_reaches(tmp_path):
    # No run reaches the target, so rates rank by their median best validation accuracy. 0.1's
    # is 0.60. 1.0's first two seeds reach 0.40 and 0.50: even a perfect third seed leaves its
    # median at 0.50, so it is skipped. 0.01's 0.30 and 0.70 could still make a median of 0.70
    # with a good third seed: it runs (and, at 0.65, wins on its median 0.65).
    accuracy = {(0.1, 0): 0.6, (0.1, 1): 0.55, (0.1, 2): 0.62, (1.0, 0): 0.4, (1.0, 1): 0.5,
                (1.0, 2): 0.99, (0.01, 0): 0.3, (0.01, 1): 0.7, (0.01, 2): 0.65}
    calls = []

    def execute(runner, plan):
        calls.append((plan.learning_rate, plan.seed))
        history = _fake_history(plan, None)
        history.evals[-1]["val_accuracy"] = accuracy[plan.learning_rate, plan.seed]
        return history

    config = _one_cell(learning_rates={"sgd": (0.1, 1.0, 0.01)})
    with ResultStore(tmp_path / "study.db") as store:
        (cell,) = StudyRunner(config, store, run_executor=execute).run().to_json()["cells"]
    assert calls == [(0.1, 0), (0.1, 1), (0.1, 2), (1.0, 0), (1.0, 1),
                     (0.01, 0), (0.01, 1), (0.01, 2)]
    assert cell["learning_rate"] == 0.01 and not cell["reached"]
    # The same study without pruning trains every seed and picks the same rate.
    calls.clear()
    with ResultStore(tmp_path / "unpruned.db") as store:
        (cell,) = StudyRunner(dataclasses.replace(config, prune=False), store,
                              run_executor=execute).run().to_json()["cells"]
    assert len(calls) == 9 and cell["learning_rate"] == 0.01


def test_a_store_written_with_extra_resumes_with_the_same_figures(tmp_path):
    # An earlier kbackend stored each run's engine facts as an "extra" dict in its trajectory;
    # the figures re-derived from such a store are the ones its "record" gives.
    def execute(runner, plan):
        history = _fake_history(plan, 30 if plan.seed != 1 else None)
        history.record.dropped_per_epoch = 5  # samples counted as the native engine runs them
        return history

    config = _one_cell(batch_sizes=(64,), learning_rates={"sgd": (0.1, 1.0)})
    with ResultStore(tmp_path / "study.db") as store:
        first = StudyRunner(config, store, run_executor=execute).run().to_json()
    with sqlite3.connect(tmp_path / "study.db") as db:
        rows = db.execute("SELECT key, trajectory FROM results WHERE kind = 'run'").fetchall()
        for key, text in rows:
            trajectory = json.loads(text)
            trajectory["extra"] = trajectory.pop("record")
            db.execute("UPDATE results SET trajectory = ? WHERE key = ?",
                       (json.dumps(trajectory), key))
    assert rows and all("dropped_per_epoch" in json.loads(text)["record"] for _, text in rows)
    with ResultStore(tmp_path / "study.db") as store:
        runner = StudyRunner(config, store,
                             run_executor=lambda runner, plan: pytest.fail("trained"))
        again = runner.run().to_json()
        assert all("extra" in r.trajectory for r in store.records(kind="run"))
    assert runner.executed == 0
    assert [r["result"] for r in again["runs"]] == [r["result"] for r in first["runs"]]
    assert again["cells"] == first["cells"]
    reached = [r["result"] for r in again["runs"] if r["result"]["reached"]]
    assert reached and all(r["drops_partial_batch"] and r["samples_to_target"] == 30 * 64
                           for r in reached)


def test_a_stored_trajectory_gives_its_record_or_its_older_extra():
    from kbackend.history import RunRecord
    from kbackend.study.summaries import history_from_trajectory, trajectory_record

    facts = {"censored_at": 40, "population": {"members": 4, "index": 1},
             "diverged": {"step": 3, "loss": "nan", "seen_in": "train_loss"}}
    assert trajectory_record({"record": facts}) == RunRecord(**facts)
    # Keys no RunRecord field holds any more are left out.
    assert trajectory_record({"extra": {**facts, "gone": 1}}) == RunRecord(**facts)
    assert trajectory_record(None) == trajectory_record({}) == RunRecord()
    trajectory = {"step": [1, 2], "loss": [1.0, 0.5], "time": [0.1, 0.2],
                  "evals": [{"step": 2, "epoch": 1, "train_time": 0.2, "val_accuracy": 0.95}],
                  "extra": {"steps_per_epoch": 2}}
    # Stored before the target's step was kept: the reaching evaluation is the last one.
    history = history_from_trajectory(trajectory, {"reached": True, "test_loss": 0.3})
    assert history.record == RunRecord(steps_per_epoch=2, target_reached={
        "step": 2, "epoch": 1, "train_time": 0.2})
    assert history.test == {"test_loss": 0.3}


@pytest.mark.slow
def test_seeds_change_the_runs_and_the_same_seed_repeats_them(tmp_path):
    config = StudyConfig(**DIGITS, optimizers=("adam",), batch_sizes=(64,),
                         learning_rates={"adam": (3e-3,)},
                         max_steps=40, engine="native", target=Target("val_accuracy", 0.9),
                         noise_points=0, seeds=2)
    with ResultStore(tmp_path / "study.db") as store:
        runner = StudyRunner(config, store)
        runner.prepare()
        first, again, other = (runner.execute(runner.plan("adam", 64, 3e-3, seed=seed))
                               for seed in (0, 0, 1))
    # Multi-threaded XLA reductions differ by ~1e-9 between identical calls: 1e-5 relative.
    np.testing.assert_allclose(again.loss, first.loss, rtol=1e-5)
    reached_at = [(h.record.target_reached or {}).get("step") for h in (first, again)]
    assert reached_at[0] is not None and reached_at[0] == reached_at[1]
    assert not np.allclose(other.loss[:5], first.loss[:5], rtol=1e-3)


@pytest.mark.parametrize(("optimum", "extend", "tried", "best", "at_bound"), [
    # The grid is 0.1272, 1.272, 12.72 (centre 0.2 at batch 32, square-root scaled to 1294).
    (127.2, 2, [0.1272, 1.272, 12.72, 127.2, 1272.0], 127.2, False),  # moved inside
    (1e6, 2, [0.1272, 1.272, 12.72, 127.2, 1272.0], 1272.0, True),   # stops at its bound
    (1e-4, 1, [0.01272, 0.1272, 1.272, 12.72], 0.01272, True),
    (1.272, 2, [0.1272, 1.272, 12.72], 1.272, False),                # interior: no extension
])
def test_grid_extends_until_the_best_rate_is_inside_or_at_its_bound(
        tmp_path, optimum, extend, tried, best, at_bound):
    # Steps to target grow by 50 per decade away from the optimum learning rate.
    calls = _planted(lambda lr, seed: 100 + round(50 * abs(math.log10(lr / optimum))))
    config = _one_cell(lr_grid_size=3, lr_factor=10.0, lr_extend=extend, seeds=1)
    with ResultStore(tmp_path / "study.db") as store:
        (cell,) = StudyRunner(config, store, run_executor=calls).run().cells
    assert cell.lr_tried == pytest.approx(tried) and cell.learning_rate == pytest.approx(best)
    assert cell.lr_at_grid_edge is at_bound and cell.lr_at_bound is at_bound
    assert len(calls) == len(tried)
    from kbackend.study.report_sections import edge_label

    assert edge_label(cell) == (" (edge, at the bound)" if at_bound else "")


def test_time_model_times_cells_interleaved_and_multiplies_median_steps(tmp_path, monkeypatch):
    planted = _planted(lambda lr, seed: {0: 100, 1: 120, 2: 90}[seed])
    order = []

    def step_timer(self, cell, steps):
        label = (cell.optimizer, cell.batch_size)
        return lambda: order.append(label)

    monkeypatch.setattr(StepTimeModel, "timer", step_timer)
    config = _one_cell(optimizers=("sgd", "adam"), batch_sizes=(647, 1294), step_time_repeats=3,
                       learning_rates={"sgd": (0.1,), "adam": (0.01,)})
    with ResultStore(tmp_path / "study.db") as store:
        study = StudyRunner(config, store, run_executor=planted).run().to_json()
        # Batch size by batch size (the cells one comparison at a batch size reads are timed
        # moments apart): one untimed warm-up call each, then three rounds, each starting one
        # cell later and timing ROUND_CALLS calls of each cell back to back (the fastest kept).
        cells = [("sgd", 647), ("adam", 647), ("sgd", 1294), ("adam", 1294)]
        rounds = [cells, cells[1:] + cells[:1], cells[2:] + cells[:2]]
        assert order == cells + [c for turn in rounds for c in turn for _ in range(ROUND_CALLS)]
        for cell in study["cells"]:
            per_step = cell["seconds_per_step"]
            assert per_step["n"] == 3 and cell["time_model"] == "steps x step time"
            interval = cell["intervals"]["time_to_target"]
            assert interval["median"] == pytest.approx(100 * per_step["median"])
            assert interval["low"] == pytest.approx(90 * per_step["low"])
            assert interval["high"] == pytest.approx(120 * per_step["high"])
            assert cell["time_to_target_runs"] == pytest.approx(1.0)  # the runs' own clocks
        order.clear()
        again = StudyRunner(config, store, run_executor=planted).run()  # stored: not measured
        assert order == [] and again.to_json()["step_times"] == study["step_times"]


@pytest.mark.parametrize(("call_seconds", "fused", "most", "steps"), [
    (0.0045, 4, 64, 28),   # 7 calls of 4 steps reach 30 ms
    (0.04, 4, 64, 4),      # one call already lasts longer: one call
    (1e-6, 4, 64, 64),     # never 30 ms: capped at the most steps
    (0.0, 5, 35, 35),      # a call too fast to clock: the most steps
    (0.0045, 1, 64, 7),    # one step per call
])
def test_timed_calls_last_30_ms_or_hold_the_most_steps_in_whole_calls(call_seconds, fused, most,
                                                                     steps):
    assert timed_steps(call_seconds, fused, most) == steps


def test_an_undefined_noise_scale_retries_once_with_a_wider_batch_pair(tmp_path, monkeypatch):
    planted = _planted(lambda lr, seed: 100)
    pairs = []

    def measure_noise(self, plan, checkpoints, small=None, big=None):
        pairs.append((small, big))
        grad_sq = -1.0 if len(pairs) == 1 else 2.0  # the first pair cannot tell |G|^2 apart
        return [NoisePoint(step, grad_sq, 100.0, 0.0, 0.0, small, big, 4, 100.0 / grad_sq)
                for step in checkpoints]

    monkeypatch.setattr(NoiseMeasurement, "measure", measure_noise)
    config = _one_cell(batch_sizes=(16, 64), learning_rates={"sgd": (0.1,)}, noise_points=2,
                       seeds=1)
    with ResultStore(tmp_path / "study.db") as store:
        noise = StudyRunner(config, store, run_executor=planted).run().noise
    assert pairs == [(16, 64), (4, 256)]
    assert noise is not None and (noise.small_batch, noise.big_batch) == (4, 256)
    assert noise.first_try is not None and noise.first_try["small_batch"] == 16
    from kbackend.study.scaling import training_noise_scale

    assert training_noise_scale(noise) == pytest.approx(50.0)


def test_report_states_sources_verdicts_and_caveats(tmp_path, monkeypatch):
    # Planted: sgd needs half adam's steps at batch 16, adam a quarter of sgd's at batch 64.
    steps = {("sgd", 16): 100, ("adam", 16): 200, ("sgd", 64): 80, ("adam", 64): 20}
    spread = {0: 0.9, 1: 1.0, 2: 1.1}

    def execute(runner, plan):
        planted = steps[plan.optimizer, plan.batch_size] * spread[plan.seed]
        return _fake_history(plan, round(planted))

    def measure_step_times(self, cells):  # planted: 10 ms per step, +-2% over three rounds
        from kbackend.stats import median_interval

        seconds = [0.0098, 0.01, 0.0102]
        return StepTimes.from_json({"engine": "native", "study_engine": "keras", "repeats": 3,
                                    "cells": [{"optimizer": c.optimizer,
                                               "batch_size": c.batch_size,
                                               "learning_rate": c.learning_rate,
                                               "seconds": seconds,
                                               "seconds_per_step": median_interval(seconds)}
                                              for c in cells]})

    monkeypatch.setattr(StudyRunner, "measure_step_times", measure_step_times)
    config = _one_cell(optimizers=("sgd", "adam"), batch_sizes=(16, 64), step_time_repeats=3,
                       learning_rates={"sgd": (0.1,), "adam": (0.01,)})
    result = run_study(config, tmp_path, show_progress=False, print_results=False,
                       run_executor=execute)
    report = result.paths["report"].read_text()
    assert "## What the sources claim, what this run shows" in report and "## Caveats" in report
    assert "1 look(s) at most, at interval levels 90.00% at 3 seeds, so" in report
    for claim in ("**(a) SGD vs Adam", "**(b) Scaling regions", "**(c) Generalization",
                  "**(d) The throughput knee"):
        assert claim in report
    # the fastest cell read with the verdicts' paired-seed interval (adam at 64 vs the next)
    assert "Fastest: adam at batch 64, " in report and "faster than every other cell" in report
    assert ("adam vs sgd: sgd faster at batch 16; adam faster at batch 64 (crossover: adam "
            "from batch 64 up)") in report
    assert "B=16: sgd faster (A/B 2x [" in report
    assert "whose own step time is not measured apart" in report  # keras: native step timed
    assert "Machine load (1-minute load average" in report
    assert "first value past the target" in report
    assert "| sgd | 16 | 0.1 | yes (3/3) | 100 [90, 110] |" in report
    for name in PLOTS:
        assert (result.paths["report"].parent / "plots" / name).read_bytes()[:4] == b"\x89PNG"


def test_a_diverged_run_is_recorded_and_the_study_goes_on(tmp_path):
    config = StudyConfig(**DIGITS, optimizers=("sgd",), batch_sizes=(128,), engine="native",
                         max_steps=20,
                         learning_rates={"sgd": (1e30, 0.1)}, noise_points=0, seeds=1,
                         lr_extend=0, step_time_repeats=0, prune=False)
    with ResultStore(tmp_path / "study.db") as store:
        study = StudyRunner(config, store).run().to_json()
    by_rate = {r["config"]["learning_rate"]: r["result"] for r in study["runs"]}
    assert by_rate[1e30]["diverged"] and not by_rate[1e30]["reached"]
    assert not by_rate[0.1]["diverged"] and by_rate[0.1]["steps_run"] > 0


def test_the_default_study_is_mnist1d_large_with_a_resolving_validation_split(tmp_path):
    from kbackend.cli import build_parser
    from kbackend.commands.study import config_from_args

    from_cli = config_from_args(build_parser().parse_args(["study"]))
    assert from_cli.identity() == StudyConfig(engine="native").identity()  # one set of defaults
    with ResultStore(tmp_path / "study.db") as store:
        runner = StudyRunner(from_cli, store)
        runner.prepare()
    assert (from_cli.dataset, from_cli.model) == ("mnist1d_large", "mlp")
    assert (from_cli.resolved_max_steps, from_cli.resolved_max_epochs) == (8000, 40)
    assert from_cli.evals_per_epoch == 6
    assert runner.dataset.info.num_val >= 1000
    assert runner.batch_sizes == (8, 16, 32, 64, 128, 256, 512, 1024)
    assert from_cli.resolved_target == Target("val_accuracy", 0.65)
    assert runner.total_runs() == 3 * 8 * 3 * 3  # optimizers x batch sizes x rates x seeds


# -- populations: a cell's grid x seeds as one vmapped program (JAX) ---------------------------

POPULATED = StudyConfig(
    **DIGITS, optimizers=("sgd", "adam"), batch_sizes=(16, 64),
    learning_rates={"sgd": (0.03, 0.1), "adam": (1e-3, 3e-3)}, max_steps=300, engine="native",
    target=Target("val_accuracy", 0.9), noise_points=0, seeds=2, step_time_repeats=0, lr_extend=0)


def _cell_answers(study):
    return [(c["optimizer"], c["batch_size"], c["learning_rate"], c["steps_to_target"],
             c["intervals"]["steps_to_target"]["low"], c["intervals"]["steps_to_target"]["high"])
            for c in study["cells"]]


@pytest.mark.slow
@pytest.mark.skipif(BACKEND != "jax", reason="populations are JAX's vmap")
def test_a_population_study_gives_the_sequential_answers_and_resumes(tmp_path):
    sequential = _run_grid(dataclasses.replace(POPULATED, population="off"), tmp_path / "seq")
    together = _run_grid(dataclasses.replace(POPULATED, population="on"), tmp_path / "pop")
    assert sequential.executed > 0 and together.executed > 0
    with (ResultStore(tmp_path / "seq" / "study.db") as a,
          ResultStore(tmp_path / "pop" / "study.db") as b):
        seq_runs = {r.key: r.to_dict() for r in a.records(kind="run")}
        pop_runs = {r.key: r.to_dict() for r in b.records(kind="run")}
    # A pruned member is stored as the pruned run it equals (its budget: where it stopped); a
    # run both paths stored (same key) has the same outcome.
    for record in pop_runs.values():
        if "censored_at" in record["trajectory"]["record"]:
            assert record["config"]["max_steps"] == record["result"]["steps_run"]
            assert not record["result"]["reached"]
    # A run both paths trained to the target (their budgets may differ: pruning cuts a later
    # rate's budget sequentially, a population trains the full one) took the same steps.
    def reached(runs):
        return {(c["optimizer"]["name"], c["batch_size"], c["learning_rate"], c["seed"]):
                r["result"]["steps_to_target"] for r in runs.values()
                for c in [r["config"]] if r["result"]["reached"]}

    seq_reached, pop_reached = reached(seq_runs), reached(pop_runs)
    shared = set(seq_reached) & set(pop_reached)
    assert len(shared) >= 4
    assert {k: pop_reached[k] for k in shared} == {k: seq_reached[k] for k in shared}
    assert all(r["trajectory"]["record"]["population"]["members"] == 4 for r in pop_runs.values())
    # The cells' answers agree (best rate, median steps and interval).
    answers = {}
    for name in ("seq", "pop"):
        with ResultStore(tmp_path / name / "study.db") as store:
            runner = StudyRunner(dataclasses.replace(
                POPULATED, population="off" if name == "seq" else "on"), store)
            answers[name] = _cell_answers(runner.run().to_json())
            assert runner.executed == 0  # everything stored: resumption trains nothing
    assert answers["seq"] == answers["pop"]
    # A population missing two members trains only those two, as a population of two.
    victims = sorted(k for k, r in pop_runs.items() if r["config"]["batch_size"] == 64
                     and r["config"]["optimizer"]["name"] == "adam")[:2]
    with sqlite3.connect(tmp_path / "pop" / "study.db") as db:
        db.executemany("DELETE FROM results WHERE key = ?", [(k,) for k in victims])
    with ResultStore(tmp_path / "pop" / "study.db") as store:
        runner = StudyRunner(dataclasses.replace(POPULATED, population="on"), store)
        runner.run()
        assert runner.executed == 2
        kept = set(pop_runs) - set(victims)
        retrained = [r for r in store.records(kind="run") if r.key not in kept]
        assert [r.trajectory["record"]["population"]["members"] for r in retrained] == [2, 2]


def test_the_population_pruner_stops_only_runs_that_cannot_win():
    from kbackend.history import History
    from kbackend.study.summaries import RunPlan

    runner = StudyRunner(dataclasses.replace(POPULATED, seeds=3), None)
    plans = [RunPlan("sgd", 16, rate, 300, 10, 10, seed)
             for rate in (0.1, 1.0) for seed in (0, 1, 2)]
    histories = [History() for _ in plans]
    for m, step in ((0, 40), (1, 60)):  # rate 0.1: two of three seeds reached by step 60
        histories[m].record.target_reached = {"step": step}
    censor = Populations(runner).pruner(plans, list(range(6)), {})
    # Rate 0.1's median is 60; rate 1.0 has nothing yet: reaching at step 70 gives it 70 > 60.
    assert sorted(censor(60, histories, {2, 3, 4, 5})) == [3, 4, 5]
    # At step 50 rate 0.1's median is not known yet: nobody is stopped.
    histories[1].record.target_reached = None
    assert censor(50, histories, {1, 2, 3, 4, 5}) == []
    # Rate 1.0 with two seeds in at 30 and 50: median 50 < 60, so rate 0.1's last seed is the
    # one that cannot win (its best case, reaching at 70, leaves the median at 60).
    histories[1].record.target_reached = {"step": 60}
    histories[3].record.target_reached = {"step": 30}
    histories[4].record.target_reached = {"step": 50}
    assert censor(60, histories, {2, 5}) == [2]


def test_auto_runs_one_by_one_on_a_cpu_without_probing(monkeypatch):
    from kbackend.engines.native import Runs

    def forbidden(*args, **kwargs):
        raise AssertionError("probed on a CPU")

    monkeypatch.setattr(Runs, "probe_population", forbidden)
    runner = StudyRunner(dataclasses.replace(POPULATED, population="auto"), None)
    runner.prepare()
    path = Populations(runner).path("adam", 16, (1e-3, 3e-3))
    assert path["path"] == "sequential" and "a CPU" in path["reason"] and path["members"] == 4


def test_a_stored_view_reads_the_store_and_never_trains(tmp_path):
    # The Ray driver's view of its cells (StudyRunner.stored_view, run executor stored_only):
    # a stored cell reads back as the local runner made it; an unstored one raises NotStored
    # before anything trains or is measured.
    config = _one_cell(batch_sizes=(64,), seeds=2, learning_rates={"sgd": (0.1, 1.0)})
    planted = _planted(lambda rate, seed: 30 if rate == 1.0 else None)
    with ResultStore(tmp_path / "study.db") as store:
        runner = StudyRunner(config, store, run_executor=planted)
        runner.prepare()
        view = runner.stored_view("tpu")
        with pytest.raises(NotStored):
            view.run_cell("sgd", 64)
        with pytest.raises(NotStored):
            view.native_runs()
        assert planted == [] and view.platform() == "tpu" != runner.platform()
        cell = runner.run_cell("sgd", 64)
        trained = len(planted)
        assert view.run_cell("sgd", 64) == cell and len(planted) == trained == 4
        assert runner.run_executor is planted and view.store is store
