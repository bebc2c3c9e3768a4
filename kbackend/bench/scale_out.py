"""Scale-out on existing engines: one process vs two (``kbackend launch``) vs two devices.

    python scripts/bench_scale_out.py [--quick] [--out DIR] [--backends jax,tensorflow]
                                      [--repeats N]

Per backend (each in its own worker process), three whole ``kbackend train`` runs of the seed MLP
(784-786-256-160-10, SGD 0.05, batch 256, 2 epochs, K fused steps), alternating within every
repeat (ABC, BCA, CAB, ...) so load that comes and goes hits all alike:

- ``1 process``: ``--engine native`` on one device;
- ``2 processes``: ``kbackend launch -N 2 -- --engine data_parallel`` (``jax.distributed`` with
  gloo / ``MultiWorkerMirroredStrategy`` over gRPC, one CPU device per process);
- ``2 devices``: ``--engine data_parallel --devices 2`` in one process with two virtual CPU
  devices (``jax.shard_map`` / ``MirroredStrategy``).

Reported per configuration: steps/s over the training time (compilation and evaluation
excluded), the process's wall time, and the largest parameter difference after the 2 epochs from
the 1-process model of the same repeat (all three train on the same global batches). On one
2-core machine the processes and virtual devices share the same cores: the figures measure what
splitting and all-reducing cost, NOT a speed-up, and say so.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kbackend.bench.spec import Benchmark, Rows, Settings
from kbackend.data import load
from kbackend.errors import DataError
from kbackend.history import History
from kbackend.model_sources import load_model
from kbackend.reports import markdown_table

CONFIGS = ("1 process", "2 processes", "2 devices")
RECIPE = ["--model", "seed_mlp", "--optimizer", "sgd", "--lr", "0.05", "--batch-size", "256",
          "--epochs", "2", "--quiet"]


def _problem(quick: bool) -> tuple[str, int]:
    """(dataset, K): MNIST (210 steps per epoch, K = 42) where its files are found, else digits."""
    if not quick:
        try:
            load("mnist")
            return "mnist", 42
        except DataError:
            pass
    return "digits", 5


def _command(config: str, dataset: str, fused: int,
             folder: Path) -> tuple[list[str], dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if k != "KBACKEND_VIRTUAL_DEVICES"}
    train = [*RECIPE, "--dataset", dataset, "--fused-steps", str(fused),
             "--save", str(folder / "model.keras"), "--history", str(folder / "history.json")]
    base = [sys.executable, "-m", "kbackend"]
    if config == "1 process":
        return [*base, "train", *train, "--engine", "native", "--devices", "1"], env
    if config == "2 processes":
        return [*base, "launch", "-N", "2", "--", *train, "--engine", "data_parallel"], env
    env["KBACKEND_VIRTUAL_DEVICES"] = "2"
    return [*base, "train", *train, "--engine", "data_parallel", "--devices", "2"], env


def _run(config: str, dataset: str, fused: int, folder: Path) -> dict[str, Any]:
    folder.mkdir(parents=True)
    argv, env = _command(config, dataset, fused, folder)
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        return {"config": config, "note": f"failed (exit {done.returncode}): "
                + (done.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    history = History.load(folder / "history.json")
    timing, record = history.timing, history.record
    train_s = (timing.get("train_time") or 0.0) - (timing.get("compile_time") or 0.0)
    steps = len(history.loss)
    return {"config": config, "steps": steps, "steps_per_s": steps / train_s if train_s else None,
            "wall_s": wall, "compile_s": timing.get("compile_time"),
            "processes": record.processes or 1, "devices": record.devices or 1,
            "test_accuracy": history.test.get("test_accuracy"), "model": folder / "model.keras"}


def measure_scale_out(settings: Settings) -> Rows:
    """The three configurations, interleaved repeats (see the module docstring)."""
    dataset, fused = _problem(settings.quick)
    repeats = settings.rounds(quick=1, full=3)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kbackend-scale-out-") as scratch:
        for repeat in range(repeats):
            order = CONFIGS[repeat % 3:] + CONFIGS[:repeat % 3]
            done = {}
            for config in order:
                print(f"repeat {repeat + 1}/{repeats}: {config} ...", file=sys.stderr, flush=True)
                done[config] = _run(config, dataset, fused,
                                    Path(scratch) / f"{repeat}-{config.replace(' ', '-')}")
            reference = done["1 process"].get("model")
            for config in CONFIGS:
                row = {"repeat": repeat, "dataset": dataset, "fused_steps": fused, **done[config]}
                model = row.pop("model", None)
                if model is not None and reference is not None:
                    row["max_param_diff"] = max(
                        float(np.max(np.abs(a - b)))
                        for a, b in zip(load_model(reference).get_weights(),
                                        load_model(model).get_weights(), strict=True))
                rows.append(row)
    return rows, _summary(rows)


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for config in CONFIGS:
        rates = [r["steps_per_s"] for r in rows if r["config"] == config and r.get("steps_per_s")]
        diffs = [r["max_param_diff"] for r in rows
                 if r["config"] == config and "max_param_diff" in r]
        summary[config] = {
            "steps_per_s_median": float(np.median(rates)) if rates else None,
            "steps_per_s_range": [min(rates), max(rates)] if rates else None,
            "wall_s_median": float(np.median(
                [r["wall_s"] for r in rows if r["config"] == config and "wall_s" in r]
                or [np.nan])),
            "max_param_diff": max(diffs) if diffs else None}
    one = summary["1 process"]["steps_per_s_median"]
    for config in CONFIGS:
        rate = summary[config]["steps_per_s_median"]
        summary[config]["vs_1_process"] = rate / one if rate and one else None
    return summary


def scale_out_table(payload: dict[str, Any]) -> str:
    """Per backend and configuration: median steps/s (range), ratio to 1 process, wall time,
    largest parameter difference from the 1-process model."""
    table = []
    for summary in payload["summaries"]:
        for config in CONFIGS:
            figures = summary.get(config) or {}
            spread = figures.get("steps_per_s_range")
            table.append({
                "backend": summary.get("backend"), "configuration": config,
                "steps/s (median)": figures.get("steps_per_s_median"),
                "range": None if not spread else f"{spread[0]:.1f}-{spread[1]:.1f}",
                "vs 1 process": figures.get("vs_1_process"),
                "wall s (median)": figures.get("wall_s_median"),
                "max param diff": figures.get("max_param_diff")})
    note = ("Medians over interleaved repeats; steps/s over training time (compile and evaluation "
            "excluded). On one machine the processes and virtual devices share its cores: this "
            "measures the cost of splitting and all-reducing, not a speed-up.")
    return note + "\n\n" + markdown_table(table, list(table[0]) if table else [])


BENCHMARKS = (
    Benchmark("bench_scale_out", "One process vs two processes (launch) vs two devices, per "
              "backend: steps/s and the parameter difference after 2 epochs.",
              measure_scale_out, keys=("config", "repeat"),
              values=("steps_per_s", "wall_s", "max_param_diff"),
              table=scale_out_table),
)
