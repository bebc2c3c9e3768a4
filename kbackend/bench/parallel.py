"""Data-parallel scaling: step time and samples/s against device count (1, 2, 4, 8).

    python scripts/bench_parallel.py [--quick] [--out DIR] [--devices 1,2,4,8] [--repeats N]

Two series, each with its scaling efficiency:

- fixed per-device batch (weak scaling): the global batch grows with the devices;
  efficiency = samples/s(N) / (N * samples/s(1));
- fixed global batch (strong scaling): each device gets 1/N of the batch;
  efficiency = step time(1) / (N * step time(N)).

The step is kbackend's data-parallel engine step (``jax.shard_map``, gradients averaged with
``lax.pmean``, K steps fused in one ``lax.scan``), so this benchmark runs on JAX only
(``--backends`` is ignored). Each device count runs in its own process, because the number of
(virtual) devices is fixed when JAX starts. On a CPU the devices are virtual
(``KBACKEND_VIRTUAL_DEVICES``): they share the same cores, so the figures measure the overhead of
splitting and all-reducing, NOT a speed-up. With several GPUs or a TPU slice the same benchmark
measures real scaling (device counts beyond what exists are skipped).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kbackend.backends import impl
from kbackend.bench.spec import Benchmark, Option, Rows, Settings, WorkerSpec, int_list
from kbackend.data import from_arrays
from kbackend.engines.loop import EpochRunner
from kbackend.hardware.measure import time_interleaved
from kbackend.models import ModelOptions, build_model
from kbackend.optim import OptimizerSpec

SERIES = {"per_device": "fixed per-device batch", "global": "fixed global batch"}


def device_counts(settings: Settings, backends: Sequence[str]) -> list[WorkerSpec]:
    """One JAX worker per device count (the count is fixed when JAX starts)."""
    counts = settings.options.get("devices") or ([1, 2, 4] if settings.quick else [1, 2, 4, 8])
    return [WorkerSpec(f"jax, {count} device(s)", "jax", count) for count in counts]


def measure_parallel(settings: Settings) -> Rows:
    """Time the data-parallel engine's calls on this worker's devices (one row per series).

    Each timed call is what ``--engine data_parallel`` runs: K fused steps, the batches gathered
    on the host and sharded over the devices, gradients averaged with ``lax.pmean``.
    """
    devices, options = settings.devices or 1, settings.options
    fused = options.get("fused") or (5 if settings.quick else 20)
    repeats = settings.rounds(quick=3, full=7)
    backend = impl()
    if backend.device_count() < devices:
        note = f"skipped: only {backend.device_count()} devices"
        return [{"devices": devices, "series": series, "note": note} for series in SERIES], {}
    spec = OptimizerSpec("sgd", 0.01)
    rng = np.random.default_rng(0)
    platform = backend.platform()
    rows = []
    for series, batch in (("per_device", options["per_device_batch"] * devices),
                          ("global", options["global_batch"])):
        if batch % devices:
            rows.append({"devices": devices, "series": series,
                         "note": f"skipped: batch {batch} does not divide over {devices}"})
            continue
        # One epoch is exactly one call of ``fused`` steps.
        n = fused * batch
        x = rng.normal(size=(n + 10, 784)).astype("float32")
        y = rng.integers(0, 10, size=n + 10).astype("int32")
        dataset = from_arrays("synthetic", x, y, x[:10], y[:10], num_classes=10,
                              validation_fraction=10 / (n + 10))
        model = build_model("seed_mlp", dataset.info, ModelOptions(seed=0))
        trainer = backend.data_parallel_trainer(model, spec, dataset, devices=devices,
                                                batch_size=batch, dp_impl="shard_map")
        epoch = EpochRunner(trainer, len(dataset.x_train), batch, fused)
        # the first (compiling) call apart; an epoch returns once its losses are on the host
        timing = time_interleaved({series: epoch}, repeats, wait=lambda losses: losses)[series]
        step_time = timing.median_s / fused
        rows.append({"devices": devices, "series": series, "platform": platform,
                     "global_batch": batch, "per_device_batch": batch // devices,
                     "step_time_ms": step_time * 1e3, "samples_per_s": batch / step_time,
                     "repeats": repeats, "fused_steps": fused})
    return rows, {"devices": devices, "platform": platform}


def efficiencies(rows: list[dict[str, Any]]) -> None:
    """Add scaling efficiency to each measured row, relative to the 1-device row of its series."""
    base = {r["series"]: r for r in rows if r["devices"] == 1 and "note" not in r}
    for row in rows:
        ref = base.get(row["series"])
        if ref is None or "note" in row:
            continue
        n = row["devices"]
        if row["series"] == "per_device":
            row["efficiency"] = row["samples_per_s"] / (n * ref["samples_per_s"])
        else:
            row["efficiency"] = ref["step_time_ms"] / (n * row["step_time_ms"])


def parallel_table(payload: dict[str, Any]) -> str:
    """One line per device count and series; a warning first when the devices are virtual."""
    rows = payload["rows"]
    lines = []
    if all(r.get("platform", "cpu") == "cpu" for r in rows):
        lines.append("CPU virtual devices share the same cores: these figures measure the overhead "
                     "of data parallelism (splitting, all-reduce), not a speed-up.\n")
    lines.append("| devices | series | global batch | per-device batch | step time (ms) "
                 "| samples/s | scaling efficiency |")
    lines.append("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        if "note" in row:
            lines.append(f"| {row['devices']} | {SERIES[row['series']]} ({row['note']}) "
                         "| | | | | |")
            continue
        lines.append(f"| {row['devices']} | {SERIES[row['series']]} | {row['global_batch']} | "
                     f"{row['per_device_batch']} | {row['step_time_ms']:.3f} | "
                     f"{row['samples_per_s']:,.0f} | "
                     f"{row.get('efficiency', float('nan')):.2f} |")
    return "\n".join(lines) + "\n"


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("bench_parallel", "Data-parallel scaling of the native JAX step (seed MLP, SGD) "
              "against device count.", measure_parallel,
              keys=("devices", "series"), values=("step_time_ms", "samples_per_s", "efficiency"),
              options=(Option("--devices",
                              "comma-separated device counts (default 1,2,4,8; quick 1,2,4)",
                              int_list),
                       Option("--per-device-batch", "batch per device, weak scaling (default 64)",
                              int, 64),
                       Option("--global-batch", "global batch, strong scaling (default 256)",
                              int, 256),
                       Option("--fused", "steps per compiled call (default 20; quick 5)", int)),
              workers=device_counts, derive=efficiencies, table=parallel_table,
              note="median step time over repeated calls of K fused steps, compile excluded; "
                   "CPU virtual devices measure overhead, not speed-up"),
)
