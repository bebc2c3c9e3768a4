"""bench_adaptive (kbackend/bench/adaptive.py): its quick run in this process on the session's
backend (overhead rows with a finite ratio, auto vs fixed cells that reach digits' target, the
PNG of the batch-size trajectory, the markdown table), the samples count of a growing run, and
a bad --part refused before any worker. No timing thresholds."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from kbackend.bench.adaptive import _samples_to, adaptive_table
from kbackend.bench.adaptive_timewin import PROBLEMS, problems, summarize, tables
from kbackend.bench.registry import BENCHMARKS
from kbackend.bench.runner import run
from kbackend.errors import ConfigError
from tests.conftest import BACKEND


# Benchmark smoke runs (79 s and 55 s on JAX in CI's default suite): the slow suite's.
@pytest.mark.slow
def test_quick_run_measures_overhead_and_auto_vs_fixed(tmp_path):
    out = tmp_path / "out"
    options = ["--quick", "--backends", BACKEND, "--out", str(out)]
    assert run(BENCHMARKS["bench_adaptive"], options, in_process=True) == 0
    payload = json.loads((out / "bench_adaptive.json").read_text())
    assert "error" not in payload["backends"][BACKEND]
    overhead = [r for r in payload["rows"] if r["part"] == "overhead"]
    assert [r["batch_size"] for r in overhead] == [8, 32]
    for row in overhead:
        assert row["plain_us_per_step"] > 0 and row["adaptive_us_per_step"] > 0
        assert math.isfinite(row["ratio"]) and row["ratio"] > 0
        assert row["plain_us"]["n"] == row["adaptive_us"]["n"] == 2  # quick: 2 repeats
        # the ratio is the median of the per-round ratios (not a ratio of medians)
        paired = row["ratio_quartiles"]
        assert paired["n"] == len(paired["ratios"]) == 2
        assert row["ratio"] == pytest.approx(statistics.median(paired["ratios"]))
        assert paired["q1"] <= row["ratio"] <= paired["q3"]
        # the adaptive trainer that never measures: the fused call's structure alone
        assert row["unmeasured_us"]["n"] == 2 and math.isfinite(row["unmeasured_ratio"])
    compare = {r["case"]: r for r in payload["rows"] if r["part"] == "compare"}
    assert list(compare) == ["fixed 32", "fixed 128", "auto sqrt max 128"]
    for name, row in compare.items():
        assert row["reached"] == row["seeds"] == 1, name  # digits' 0.9 within 3 epochs
        assert row["steps"]["median"] > 0 and row["time_s"]["median"] > 0
    auto = compare["auto sqrt max 128"]["runs"][0]
    sizes = [r["batch_size"] for r in auto["adaptive"]["ranges"]]
    assert sizes[0] == 8 and sizes == sorted(sizes)
    assert compare["fixed 32"]["samples"]["median"] == 32 * compare["fixed 32"]["steps"]["median"]
    plot = out / f"bench_adaptive_{BACKEND}.png"
    assert payload["summaries"][0]["plot"] == str(plot)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "bench_adaptive.md").read_text()
    assert "| backend | batch | plain us/step | micro-batched us/step | ratio |" in table
    assert f"| {BACKEND} | auto sqrt max 128 | 1/1 |" in table


@pytest.mark.slow
def test_quick_reuse_part_times_both_ways_of_running_auto_runs(tmp_path):
    """``--part reuse``: a fresh ``train()`` per auto run and the study's shared trainer, both
    timed over the same seeds (finite figures and the table; no timing thresholds)."""
    out = tmp_path / "out"
    options = ["--quick", "--backends", BACKEND, "--part", "reuse", "--out", str(out)]
    assert run(BENCHMARKS["bench_adaptive"], options, in_process=True) == 0
    payload = json.loads((out / "bench_adaptive.json").read_text())
    rows = [r for r in payload["rows"] if r["part"] == "reuse"]
    assert [r["case"] for r in rows] == ["fresh train() per run", "Runs: one shared trainer"]
    assert all(r["wall_s"]["n"] == 1 and r["wall_s"]["median"] > 0 for r in rows)
    assert rows[0]["ratio"]["median"] == 1.0 and math.isfinite(rows[1]["ratio"]["median"])
    assert "one shared trainer" in (out / "bench_adaptive.md").read_text()


@pytest.mark.slow
def test_quick_inflation_part_times_steps_while_the_next_size_compiles_ahead(tmp_path):
    """``--part inflation``: the adaptive trainer's steps timed idle and while each next size
    compiles in the background (two rounds, sizes 16 and 32 after 8); finite figures, every
    background compilation waited for, and the table (no timing thresholds)."""
    out = tmp_path / "out"
    options = ["--quick", "--backends", BACKEND, "--part", "inflation", "--out", str(out)]
    assert run(BENCHMARKS["bench_adaptive"], options, in_process=True) == 0
    payload = json.loads((out / "bench_adaptive.json").read_text())
    (row,) = [r for r in payload["rows"] if r["part"] == "inflation"]
    assert row["batch_size"] == 8 and row["idle_us"]["n"] == 2 * 20
    assert row["compile_s"]["n"] == 2 and row["compile_s"]["min"] > 0
    assert math.isfinite(row["idle_us"]["median"]) and row["idle_us"]["median"] > 0
    # a compilation that ended before the next call leaves no busy call: NaN, never a number
    assert math.isfinite(row["ratio"]) == (row["busy_us"]["n"] > 0 and
                                          math.isfinite(row["busy_us"]["median"]))
    assert "compiles ahead in the background" in (out / "bench_adaptive.md").read_text()


@pytest.mark.slow
def test_quick_timewin_part_runs_every_side_in_a_fresh_process(tmp_path):
    """``--part timewin --quick``: auto, fixed MIN and the best fixed size on digits, each a
    whole train() in a child with an empty cache, to the target; the goals row and tables."""
    out = tmp_path / "out"
    options = ["--quick", "--backends", BACKEND, "--part", "timewin", "--out", str(out)]
    assert run(BENCHMARKS["bench_adaptive"], options, in_process=True) == 0
    payload = json.loads((out / "bench_adaptive.json").read_text())
    runs = {r["side"]: r for r in payload["rows"] if r["part"] == "timewin"}
    assert list(runs) == ["auto", "fixed_min", "best_fixed"]
    for side, run_row in runs.items():
        assert run_row["cache"] == "cold" and run_row["seed"] == 0, side
        assert 0 < run_row["wall_s"] <= run_row["run_wall_s"], side  # digits' 0.9 is reached
        assert run_row["steps"] > 0, side
    sizes = [r["batch_size"] for r in runs["auto"]["adaptive"]["ranges"]]
    assert sizes[0] == 8 and sizes == sorted(sizes) and sizes[-1] <= 128
    assert runs["auto"]["adaptive"]["maximum"] == 128  # auto:8:128: no knee probe
    (goals,) = [r for r in payload["rows"] if r["part"] == "timewin goals"]
    for goal in ("fixed_min", "best_fixed"):
        verdict = goals["goals"][goal]
        assert verdict["seeds"] == 1 and verdict["high"] is None and not verdict["resolved"]
        ratio = runs["auto"]["wall_s"] / runs[goal]["wall_s"]
        assert verdict["ratio"] == pytest.approx(ratio)
    table = (out / "bench_adaptive.md").read_text()
    assert "Time win goals" in table and f"| {BACKEND} | digits | cold | best fixed |" in table


def test_samples_count_each_step_range_at_its_batch_size():
    ranges = [{"step": 0, "batch_size": 8}, {"step": 40, "batch_size": 32},
              {"step": 100, "batch_size": 128}]
    assert _samples_to(50, ranges, 8) == 40 * 8 + 10 * 32
    assert _samples_to(110, ranges, 8) == 40 * 8 + 60 * 32 + 10 * 128
    assert _samples_to(50, None, 16) == 800


def test_table_of_one_part_and_a_cell_that_missed():
    missed = {"median": None, "min": None, "max": None, "n": 0, "of": 2}
    payload = {"rows": [{"backend": "jax", "part": "compare", "case": "fixed 8", "reached": 0,
                         "seeds": 2, "steps": missed, "samples": missed, "time_s": missed}],
               "summaries": [{"backend": "jax", "plot": None}]}
    table = adaptive_table(payload)
    assert "| jax | fixed 8 | 0/2 | - | - | - |" in table
    assert "Overhead" not in table and "trajectories" not in table


def test_table_of_an_even_number_of_seeds():
    # The median of two seeds' steps is a float (it crashed the table once, losing the JSON).
    steps = {"median": 250.5, "min": 240, "max": 261, "n": 2, "of": 2}
    payload = {"rows": [{"backend": "jax", "part": "compare", "case": "auto sqrt max 512",
                         "reached": 2, "seeds": 2, "steps": steps, "samples": steps,
                         "time_s": {"median": 1.5, "min": 1.0, "max": 2.0, "n": 2, "of": 2}}],
               "summaries": [{"backend": "jax", "plot": None}]}
    assert "| 250 [240, 261] |" in adaptive_table(payload)


def test_a_bad_part_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run(BENCHMARKS["bench_adaptive"], ["--part", "all", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "--part" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


# -- --part timewin (issue 47, item 4) --------------------------------------------------------
def _run(problem, cache, seed, side, wall, steps=100, whole=None):
    return {"part": "timewin", "problem": problem, "cache": cache, "seed": seed, "side": side,
            "wall_s": wall, "run_wall_s": whole if whole is not None else (wall or 0) + 1.0,
            "steps": steps if wall is not None else None}


def _goals(walls):
    """The goals row of made-up runs: ``walls`` side -> per-seed wall (None: never reached)."""
    rows = [_run("p", "cold", seed, side, wall, whole=12.0 if wall is None else None)
            for side, values in walls.items() for seed, wall in enumerate(values)]
    (summary,) = summarize(rows, {"p": PROBLEMS["mnist1d_large"]})
    return summary


def test_timewin_goal_met_and_resolved():
    # auto 0.5x fixed MIN on every seed (tight), 1.0x the best fixed size
    summary = _goals({"auto": [5.0, 5.2, 4.8], "fixed_min": [10.0, 10.3, 9.7],
                      "best_fixed": [5.0, 5.1, 4.9]})
    goal = summary["goals"]["fixed_min"]
    assert goal["ratio"] == pytest.approx(0.5, rel=0.02)
    assert goal["met"] and goal["resolved"] and goal["high"] < 0.7
    best = summary["goals"]["best_fixed"]
    assert best["met"] and best["resolved"] and best["low"] < 1.0 < best["high"] < 1.2
    assert summary["auto"]["wall_s"]["median"] == 5.0 and summary["auto"]["reached"] == 3
    assert summary["fixed_min"]["steps"]["median"] == 100


def test_timewin_goal_not_met_and_unresolved():
    summary = _goals({"auto": [20.0, 21.0, 19.0], "fixed_min": [10.0, 10.0, 10.0],
                      "best_fixed": [10.0, 30.0, 5.0]})
    not_met = summary["goals"]["fixed_min"]
    assert not not_met["met"] and not_met["resolved"] and not_met["low"] > 0.7
    wide = summary["goals"]["best_fixed"]  # 2x, 0.7x, 3.8x: the interval spans 1.2
    assert not wide["met"] and not wide["resolved"] and wide["low"] < 1.2 < wide["high"]
    table = "\n".join(tables([{**summary, "backend": "jax"}]))
    assert "| jax | p | cold | fixed min |" in table and "not met, not resolved" in table


def test_timewin_a_seed_that_never_reaches():
    # auto never reached on seed 2: its whole run (12 s) stands in, a lower bound; the estimate
    # may be under the bound, but "met" is not claimed
    summary = _goals({"auto": [1.0, 1.0, None], "fixed_min": [10.0, 10.0, 10.0],
                      "best_fixed": [1.0, 1.0, 1.0]})
    goal = summary["goals"]["fixed_min"]
    assert goal["auto_missed"] == 1 and not goal["met"] and not goal["resolved"]
    assert summary["auto"]["reached"] == 2 and summary["auto"]["wall_s"]["n"] == 2
    # the comparator never reached: a met goal stands, resolved by its interval
    summary = _goals({"auto": [1.0, 1.1, 0.9], "fixed_min": [10.0, 10.0, None],
                      "best_fixed": [1.0, 1.0, 1.0]})
    goal = summary["goals"]["fixed_min"]
    assert goal["other_missed"] == 1 and goal["met"] and goal["resolved"]
    assert "other missed 1/3" in "\n".join(tables([{**summary, "backend": "jax"}]))


def test_timewin_one_seed_is_unbounded():
    summary = _goals({"auto": [1.0], "fixed_min": [2.0], "best_fixed": [1.0]})
    assert summary["goals"]["fixed_min"]["high"] is None
    assert summary["goals"]["fixed_min"]["met"] and not summary["goals"]["fixed_min"]["resolved"]


def _cell(optimizer, batch, rate, seconds):
    return {"optimizer": optimizer, "batch_size": batch, "learning_rate": rate,
            "reached": True, "time_to_target": seconds, "steps_to_target": 100.0}


def test_timewin_rates_from_a_stored_study(tmp_path):
    summary = {"study": "s", "config": {"model": "mlp", "dataset": "mnist1d_large",
                                        "engine": "native", "optimizers": ["sgd", "adam"],
                                        "target": {"metric": "val_accuracy", "value": 0.65}},
               "env": {"backend": "jax", "device": "cpu"},
               "cells": [_cell("sgd", 8, 0.1, 0.6), _cell("sgd", 32, 0.3, 0.2),
                         _cell("sgd", 128, 1.0, 0.4), _cell("adam", 8, 1e-3, 0.5),
                         {**_cell("sgd", "auto", 0.05, 0.1), "reached": False}],
               "analysis": {"crossovers": [], "best": None, "throughput_knee": None}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    (study,) = problems(False, {"study": str(tmp_path)}).values()
    assert (study["model"], study["dataset"], study["target"]) == ("mlp", "mnist1d_large", 0.65)
    assert (study["optimizer"], study["auto_min"], study["min_rate"]) == ("sgd", 8, 0.1)
    assert (study["best_batch"], study["best_rate"]) == (32, 0.3)
    assert problems(False, {"study": str(tmp_path), "auto_min": 128})["study"]["min_rate"] == 1.0
    with pytest.raises(ConfigError, match="no sgd cell at batch size 16"):
        problems(False, {"study": str(tmp_path / "summary.json"), "auto_min": 16})
    # without a study: the documented defaults, each overridable
    chosen = problems(False, {"problems": ["mnist1d_large"], "best_rate": 5e-3})
    assert chosen["mnist1d_large"]["best_rate"] == 5e-3
    assert chosen["mnist1d_large"]["auto_min"] == 8
