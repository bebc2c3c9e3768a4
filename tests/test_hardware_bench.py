"""Benchmarks: the one runner (one child process per worker, valid JSON with the documented
fields, a markdown table), the registry every script stub goes through; and ``kbackend advise``
in quick mode. No timing thresholds anywhere."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kbackend.backend_choice import BACKENDS
from kbackend.bench.registry import BENCHMARKS
from kbackend.bench.runner import run
from kbackend.bench.spec import Benchmark, Settings
from kbackend.models import ModelOptions
from tests.conftest import BACKEND, ROOT

# Fields every benchmark JSON has (docs/hardware.md, "Benchmark output").
TOP_LEVEL_FIELDS = {"benchmark", "description", "quick", "keys", "values", "rows", "summaries",
                    "backends", "note"}


# Options that keep a quick run short where the script's quick mode still sweeps a grid.
QUICKER = {"bench_engines": ("--batch-sizes", "32"),
           # 8 steps: K = 8 fused steps, written out for a conv model on a CPU (40 compiled slowly)
           "reproduce_mnist1d": ("--models", "cnn", "--steps", "8")}


# Benchmarks whose smoke runs in one backend's session only, and why that covers the other.
ONCE = {"bench_parallel": "runs JAX workers whatever the backend",
        # Whole `kbackend` processes with the worker's backend: the orchestration is
        # backend-neutral, and TensorFlow's processes are tested where they are the subject
        # (test_parallel_processes: launch -N 2 against one process; test_train_flags:
        # train --target).
        "bench_scale_out": "whole processes, the orchestration backend-neutral",
        "bench_time_to_target": "whole processes, the orchestration backend-neutral",
        "bench_data_memory": "loading data is backend-free (one child process per case)"}


def check_report(out: Path, name: str, bench: Benchmark | None = None,
                 backends: tuple[str, ...] | list[str] = BACKENDS) -> dict:
    bench = bench or BENCHMARKS[name]
    workers = bench.workers(Settings(quick=True), backends)
    payload = json.loads((out / f"{name}.json").read_text())
    assert set(payload) >= TOP_LEVEL_FIELDS
    assert payload["benchmark"] == name and payload["quick"] is True
    assert list(payload["backends"]) == [w.label for w in workers]
    for worker in workers:
        result = payload["backends"][worker.label]
        assert "error" not in result, result.get("error")
        assert result["environment"]["backend"] == worker.backend
        assert result["environment"]["versions"]["keras"]
    assert {row["backend"] for row in payload["rows"]} == {w.backend for w in workers}
    for row in payload["rows"]:
        assert all(key in row for key in payload["keys"])
        if "note" not in row:  # measured rows carry every value column
            assert all(value in row for value in payload["values"]), row
    table = (out / f"{name}.md").read_text()
    if bench.table is None:
        assert all(f"({w.label})" in table for w in workers)
    return payload


def measure_tiny(settings: Settings):
    """A benchmark small enough for every test run (the child imports it from this module)."""
    import keras

    from kbackend.hardware.measure import time_interleaved

    x = keras.ops.ones((64, 64))
    timing = time_interleaved({0: lambda: keras.ops.matmul(x, x)}, rounds=3)[0]
    return [{"case": "matmul64", "median_ms": 1e3 * timing.median_s, "pid": os.getpid()}], \
        {"quick": settings.quick}


TINY = Benchmark("bench_tiny", "tiny", measure_tiny, ["case"], ["median_ms"], ["quick"])


@pytest.mark.slow
def test_runner_runs_each_backend_in_its_own_process(tmp_path, capsys):
    if BACKEND != "jax":
        pytest.skip("starts a worker of each backend whatever the session's: "
                    "once, in the JAX session")
    assert run(TINY, ["--quick", "--out", str(tmp_path / "out")]) == 0
    payload = check_report(tmp_path / "out", "bench_tiny", TINY)
    assert len({row["pid"] for row in payload["rows"]}) == 2  # two processes
    assert os.getpid() not in {row["pid"] for row in payload["rows"]}
    assert [s["quick"] for s in payload["summaries"]] == [True, True]
    assert "| case | median_ms (jax) | median_ms (tensorflow) |" in capsys.readouterr().out


def test_runner_refuses_bad_options_before_starting_any_worker(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    assert run(TINY, ["--out", str(blocker / "out")]) == 2
    assert run(TINY, ["--backends", "jax,torch", "--out", str(tmp_path)]) == 2
    assert run(TINY, ["--repeats", "0", "--out", str(tmp_path)]) == 2
    assert run(TINY, ["--repeats", "-1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "Invalid --repeats 0: expected an integer >= 1" in err
    assert "bench_tiny: error:" in err and "PyTorch-free" in err and "running" not in err
    assert not list(tmp_path.glob("*.json"))


@pytest.mark.slow
def test_a_failing_worker_is_reported_and_the_run_exits_1(tmp_path):
    broken = Benchmark("bench_broken", "broken", json.loads, ["case"], ["x"])  # takes no Settings
    assert run(broken, ["--backends", BACKEND, "--out", str(tmp_path)]) == 1
    payload = json.loads((tmp_path / "bench_broken.json").read_text())
    assert "TypeError" in payload["backends"][BACKEND]["error"]


def test_every_script_is_a_stub_of_a_registered_benchmark():
    scripts = sorted([*(ROOT / "scripts").glob("bench_*.py"),
                      *(ROOT / "scripts").glob("reproduce_*.py")])
    assert sorted(p.stem for p in scripts) == sorted(BENCHMARKS)
    for script in scripts:
        text = script.read_text()
        assert len(text.splitlines()) <= 15, f"{script.name} is more than a stub"
        assert "from kbackend.bench.runner import main" in text, script.name
        assert f'raise SystemExit(main("{script.stem}"))' in text, script.name


@pytest.mark.slow
def test_a_train_steps_memory_grows_with_its_batch():
    """``impl().train_step_memory`` (XLA's buffer assignment on JAX, the allocator's peak on TF)
    measures the step, not a constant: the seed MLP's activations and their gradients grow by
    ~(786 + 256 + 160 + 10) floats per sample, so 512 more samples add at least ~2.4 MiB."""
    from kbackend.hardware import probe

    work = probe.workload("seed_mlp", samples=640)
    small, big = (probe.train_step_memory(work, batch)["step_memory_mib"] for batch in (32, 544))
    assert small > 0 and big - small > 2.0


@pytest.mark.slow
def test_a_step_memory_this_process_cannot_measure_is_measured_in_a_child(monkeypatch):
    """Where this process's allocator keeps no statistics (TensorFlow's CPU allocator unless
    set up for them at start: so on the AMD machines here, not on the Intel ones), a child
    process with ``stats_env`` set measures the same workload, rebuilt from its recipe. Forced
    here on both backends: the parent's measurement reports no statistics."""
    from kbackend.hardware import probe

    measure_here = probe._step_memory_here

    def without_statistics(work, batch_size):
        found = measure_here(work, batch_size)
        # TensorFlow's own setting (a JAX child ignores it).
        return {**found, "step_memory_bytes": None,
                "stats_env": {"TF_CPU_ALLOCATOR_USE_BFC": "true"}}

    work = probe.workload("seed_mlp", samples=64, options=ModelOptions(widths=(48, 24)))
    here = measure_here(work, 32)["step_memory_bytes"]
    monkeypatch.setattr(probe, "_step_memory_here", without_statistics)
    found = probe.train_step_memory(work, 32)
    assert found["memory_source"].endswith("(in a child process set up for it)")
    assert found["step_memory_mib"] > 0
    if BACKEND == "jax":  # XLA's buffer assignment: the same program, the same bytes
        assert found["step_memory_mib"] == here / 2**20


def test_scaling_efficiency_is_relative_to_one_device():
    from kbackend.bench.parallel import efficiencies

    rows = [{"devices": 1, "series": "per_device", "samples_per_s": 100.0, "step_time_ms": 1.0},
            {"devices": 2, "series": "per_device", "samples_per_s": 150.0, "step_time_ms": 1.3},
            {"devices": 1, "series": "global", "samples_per_s": 100.0, "step_time_ms": 2.0},
            {"devices": 4, "series": "global", "samples_per_s": 200.0, "step_time_ms": 1.0},
            {"devices": 8, "series": "global", "note": "skipped: only 4 devices"}]
    efficiencies(rows)
    assert [r.get("efficiency") for r in rows] == [1.0, 0.75, 1.0, 0.5, None]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_benchmark_quick_mode_writes_valid_json(name, tmp_path):
    # Each backend's session runs every benchmark on its own backend, in this process where the
    # worker allows (no framework start-up per worker); the child-process path is
    # test_runner_runs_each_backend_in_its_own_process's.
    if name in ONCE and BACKEND != "jax":
        pytest.skip(f"{name}: {ONCE[name]}: once, in the JAX session")
    options = ["--quick", "--backends", BACKEND, "--out", str(tmp_path), *QUICKER.get(name, ())]
    assert run(BENCHMARKS[name], options, in_process=True) == 0
    payload = check_report(tmp_path, name, backends=[BACKEND])
    if name == "bench_data_format":
        assert all(r["step_memory_mib"] > 0 for r in payload["rows"] if "note" not in r)
    if name == "bench_data_format" and BACKEND == "tensorflow":
        row = next(r for r in payload["rows"] if r["data_format"] == "channels_first")
        # TF's NCHW convolution on a CPU is probed (impl().supports_channels_first_conv()):
        # where it is missing the row says "unsupported" instead of giving a number.
        if "note" in row:
            assert row["note"].startswith("unsupported")
        else:
            assert row["samples_per_s"] > 0
    if name == "bench_roofline":
        assert all(r["fraction_of_peak"] > 0 for r in payload["rows"])
    if name == "bench_precision":
        bf16 = [r for r in payload["rows"] if r["precision"] == "mixed_bfloat16"]
        assert bf16 and all(r["variable_dtypes"] == ["float32"] for r in bf16)  # float32 variables
    if name == "bench_time_to_target":  # whole processes, each reaching digits' 0.9
        assert {(r["side"], r["cache"]) for r in payload["rows"]} == {
            ("keras_script", "-"), ("kbackend", "cold"), ("kbackend_info", "-"),
            ("kbackend_train_help", "-")}
        assert all(r["wall_s"] > 0 for r in payload["rows"])
        assert all(r["reached"] for r in payload["rows"] if "reached" in r)
        assert payload["summaries"][0]["ratio_cold"] > 0
        assert payload["summaries"][0]["kbackend_info_wall_s"] > 0


def test_time_to_target_summary_and_table_from_planted_rows():
    from kbackend.bench.time_to_target import _summary, time_to_target_table

    rows = [{"backend": "jax", "side": "keras_script", "cache": "-", "wall_s": w, "reached": True}
            for w in (20.0, 22.0, 30.0)]
    rows += [{"backend": "jax", "side": "kbackend", "cache": c, "wall_s": w, "reached": True}
             for c, w in (("cold", 12.0), ("cold", 11.0), ("cold", 15.0), ("warm", 6.6),
                          ("warm", 7.0), ("warm", 9.0))]
    rows += [{"backend": "jax", "side": "kbackend_info", "cache": "-", "wall_s": w}
             for w in (1.2, 1.4, 3.0)]
    summary = _summary(rows, "mnist", 0.97, {"batch_size": 256})
    assert summary["ratio_cold"] == pytest.approx(12.0 / 22.0)
    assert summary["ratio_warm"] == pytest.approx(7.0 / 22.0)
    assert summary["keras_script_spread"] == pytest.approx(1.5)
    table = time_to_target_table({"summaries": [{"backend": "jax", **summary}], "rows": rows})
    assert "kbackend (warm compile cache) / plain Keras script, median wall time: 0.32" in table
    assert "| kbackend | cold | 3 | 3 | 12" in table
    assert "`kbackend info`, median wall time: 1.40 s" in table
    assert summary["kbackend_train_help_wall_s"] is None  # not measured: no line
    assert "train --help" not in table


@pytest.mark.slow
def test_advise_quick_prints_recommendations(cli, tmp_path):
    completed = cli("advise", "--model", "seed_mlp", "--dataset", "digits", "--quick",
                    "--json", str(tmp_path / "advice.json"))
    assert completed.returncode == 0, completed.stderr[-2000:]
    out = completed.stdout
    assert "Recommended settings for seed_mlp on digits" in out
    for setting in ("batch_size", "precision", "device"):
        assert setting in out
    assert "because:" in out and "samples/s" in out
    assert "kbackend study --model seed_mlp --dataset digits --batch-sizes" in out
    advice = json.loads((tmp_path / "advice.json").read_text())
    measured = [row["batch_size"] for row in advice["measurements"]["batch_size"]]
    batch = next(r["value"] for r in advice["recommendations"] if r["setting"] == "batch_size")
    assert batch in measured


def test_advise_rejects_a_bad_budget(cli):
    completed = cli("advise", "--budget", "-1")
    assert completed.returncode == 2
    assert "Invalid --budget" in completed.stderr and "Traceback" not in completed.stderr
