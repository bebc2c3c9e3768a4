"""Benchmark scripts: one subprocess per backend, valid JSON with the documented fields, a
markdown table; and ``kbackend advise`` in quick mode. No timing thresholds anywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kbackend.backend import BACKENDS
from kbackend.hardware.benchmarks import BENCHMARKS
from tests.conftest import BACKEND, ROOT

# Fields every benchmark JSON has (docs/hardware.md, "Benchmark output").
TOP_LEVEL_FIELDS = {"benchmark", "description", "quick", "keys", "values", "rows", "summaries",
                    "backends", "note"}


def run_script(script: Path, out: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "KBACKEND_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(script), "--quick", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def check_report(out: Path, name: str) -> dict:
    payload = json.loads((out / f"{name}.json").read_text())
    assert set(payload) >= TOP_LEVEL_FIELDS
    assert payload["benchmark"] == name and payload["quick"] is True
    assert set(payload["backends"]) == set(BACKENDS)
    for backend, result in payload["backends"].items():
        assert "error" not in result, result.get("error")
        assert result["environment"]["backend"] == backend
        assert result["environment"]["versions"]["keras"]
    assert {row["backend"] for row in payload["rows"]} == set(BACKENDS)
    for row in payload["rows"]:
        assert all(key in row for key in payload["keys"])
        if "note" not in row:  # measured rows carry every value column
            assert all(value in row for value in payload["values"]), row
    table = (out / f"{name}.md").read_text()
    assert all(f"({backend})" in table for backend in BACKENDS)
    return payload


def test_runner_runs_each_backend_in_its_own_process(tmp_path):
    script = tmp_path / "bench_tiny.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from kbackend.hardware.bench import Benchmark, main

        def measure(quick):
            import keras
            from kbackend.hardware.timing import time_calls
            x = keras.ops.ones((64, 64))
            timing = time_calls(lambda: keras.ops.matmul(x, x), repeats=3)
            return [{{"case": "matmul64", "median_ms": 1e3 * timing.median_s, "pid": __import__("os").getpid()}}], {{"quick": quick}}

        if __name__ == "__main__":
            raise SystemExit(main(Benchmark("bench_tiny", "tiny", measure, ["case"], ["median_ms"], ["quick"]), __file__))
    """))
    completed = run_script(script, tmp_path / "out", timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    payload = check_report(tmp_path / "out", "bench_tiny")
    assert len({row["pid"] for row in payload["rows"]}) == 2  # two processes
    assert [s["quick"] for s in payload["summaries"]] == [True, True]
    assert "| case | median_ms (jax) | median_ms (tensorflow) |" in completed.stdout


def test_every_script_is_a_registered_benchmark():
    scripts = sorted(p.stem for p in (ROOT / "scripts").glob("bench_*.py"))
    assert set(BENCHMARKS) <= set(scripts)
    for name in scripts:
        assert f'BENCHMARKS["{name}"]' in (ROOT / "scripts" / f"{name}.py").read_text() or name not in BENCHMARKS


@pytest.mark.slow
@pytest.mark.skipif(BACKEND != "jax", reason="each script runs both backends itself; once per CI run")
@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_benchmark_script_quick_mode_writes_valid_json(name, tmp_path):
    completed = run_script(ROOT / "scripts" / f"{name}.py", tmp_path)
    assert completed.returncode == 0, completed.stderr[-3000:]
    payload = check_report(tmp_path, name)
    if name == "bench_data_format":
        tf_first = [r for r in payload["rows"] if r["backend"] == "tensorflow"
                    and r["data_format"] == "channels_first"]
        # TF's NCHW convolution on a CPU is probed (impl().supports_channels_first_conv()):
        # where it is missing the row says "unsupported" instead of giving a number.
        row = tf_first[0]
        if "note" in row:
            assert row["note"].startswith("unsupported")
        else:
            assert row["samples_per_s"] > 0
    if name == "bench_roofline":
        assert all(r["fraction_of_peak"] > 0 for r in payload["rows"])
    if name == "bench_precision":
        bf16 = [r for r in payload["rows"] if r["precision"] == "mixed_bfloat16"]
        assert all(r["variable_dtypes"] == ["float32"] for r in bf16)  # float32 variables


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
