"""bench_adaptive (kbackend/bench/adaptive.py): its quick run in this process on the session's
backend (overhead rows with a finite ratio, auto vs fixed cells that reach digits' target, the
PNG of the batch-size trajectory, the markdown table), the samples count of a growing run, and
a bad --part refused before any worker. No timing thresholds."""

from __future__ import annotations

import json
import math

import pytest

from kbackend.bench.adaptive import _samples_to, adaptive_table
from kbackend.bench.registry import BENCHMARKS
from kbackend.bench.runner import run
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
