"""Engines benchmark: Keras ``fit`` vs the native engine vs a hand-written compiled loop.

    python scripts/bench_engines.py [--quick] [--out DIR] [--backends jax,tensorflow]
        [--batch-sizes 8,32,128,1024] [--repeats N]

The seed MLP (784-786-256-160-10, SGD lr 0.01) on MNIST-shaped synthetic data (784 inputs,
10 classes), at batch sizes 8, 32, 128, 1024, under each backend in its own process, one after
the other in one run. Configurations, per backend and batch size:

* ``fit spe=1`` / ``fit spe=32``: ``model.fit`` with ``steps_per_execution`` 1 / 32, jit on;
* ``native K=1`` / ``K=32`` / ``K=epoch``: ``kbackend.engines.native`` (K fused steps per call);
* ``native K=epoch, no XLA`` (TensorFlow only: ``--no-jit``, the same loop as a ``tf.function``
  graph without XLA; JAX's loop is always XLA);
* ``reference``: the floor, a minimal hand-written loop over the same network and data
  (``kbackend/backends/<backend>/reference.py``): one ``jax.lax.scan`` over pre-stacked batches
  with ``optax.sgd`` (JAX) or one XLA ``tf.function`` loop with ``assign_sub`` (TF), a whole
  epoch per call.

Each configuration first runs one (compiling) epoch, excluded; then every configuration runs one
epoch in turn, ``repeats`` rounds (interleaved, so a busy machine slows all alike), and the median
epoch is reported as us/step and samples/s, with the ratio to ``fit spe=1`` and the compile time
separately (exact for the native engine; first epoch minus the median for the others), and the
spread (slowest / fastest timed epoch) that shows how noisy the machine was.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

from kbackend import data as data_module
from kbackend.backend_choice import keras as import_keras
from kbackend.backends import impl
from kbackend.bench.spec import Benchmark, Option, Rows, Settings, int_list, say
from kbackend.engines.native import epoch_runner
from kbackend.hardware.measure import time_interleaved
from kbackend.models import ModelOptions, build_model
from kbackend.optim import OptimizerSpec

BATCH_SIZES = (8, 32, 128, 1024)
LAYER_SIZES = (784, 786, 256, 160, 10)
LEARNING_RATE = 0.01
VAL_SAMPLES = 256


def steps_per_epoch(batch_size: int, quick: bool) -> int:
    """Steps in one timed epoch: enough to amortize per-call costs, few at large batches."""
    full = {8: 128, 32: 128, 128: 64, 1024: 32}
    steps = full.get(batch_size, 64)
    return max(8, steps // 4) if quick else steps


def synthetic(batch_size: int, steps: int, seed: int = 0) -> Any:
    """MNIST-shaped data: ``steps * batch_size`` training samples, 784 features, 10 classes."""
    rng = np.random.default_rng(seed)
    n = steps * batch_size + VAL_SAMPLES
    x = rng.random((n, 784), dtype=np.float32)
    y = rng.integers(0, 10, n)
    return data_module.from_arrays("synthetic_mnist", x, y, x[:VAL_SAMPLES], y[:VAL_SAMPLES],
                                   num_classes=10, validation_fraction=VAL_SAMPLES / n, seed=seed)


def fit_runner(dataset: Any, batch_size: int, spe: int) -> Callable[[], Any]:
    """One epoch of ``model.fit`` per call (its per-call setup is part of fit's cost)."""
    keras = import_keras()
    model = build_model("seed_mlp", dataset.info, ModelOptions())
    model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE),
                  loss="sparse_categorical_crossentropy", jit_compile=True,
                  steps_per_execution=spe)
    return lambda: model.fit(dataset.x_train, dataset.y_train, batch_size=batch_size,
                             epochs=1, shuffle=False, verbose=0)


def native_runner(dataset: Any, batch_size: int, fused: int,
                  jit_compile: bool = True) -> Callable[[], Any]:
    """One epoch of the native engine per call (``kbackend.engines.native.epoch_runner``)."""
    model = build_model("seed_mlp", dataset.info, ModelOptions())
    return epoch_runner(model, dataset, OptimizerSpec("sgd", LEARNING_RATE), batch_size, fused,
                        jit_compile=jit_compile)


def initial_params(seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """He-initialized (weights, bias) of the seed MLP's layers, for the reference loops."""
    rng = np.random.default_rng(seed)
    return [((rng.standard_normal((a, b)) * np.sqrt(2.0 / a)).astype(np.float32),
             np.zeros(b, np.float32)) for a, b in itertools.pairwise(LAYER_SIZES)]


def reference_runner(dataset: Any, batch_size: int, steps: int) -> Callable[[], None]:
    """One epoch of the active backend's hand-written loop per call."""
    x = dataset.x_train.reshape(steps, batch_size, 784)
    y = dataset.y_train.reshape(steps, batch_size)
    return impl().reference_train_loop(initial_params(), x, y, LEARNING_RATE)


def measure(runners: dict[str, Any], steps: int, batch_size: int, repeats: int) -> dict:
    """Time one epoch of every runner, round-robin, ``repeats`` times after a compiling epoch.

    Interleaving spreads the load of a shared machine evenly over the configurations.
    """
    timings = time_interleaved(runners, repeats, wait=lambda result: result)
    figures = {}
    for name, timing in timings.items():
        seconds = list(timing.times)
        median = statistics.median(seconds)
        # Exact for the native engine; else the first epoch's excess (noise can hide it: >= 0).
        compile_s = getattr(runners[name], "compile_time",
                            max(0.0, timing.first_call_s - median))
        figures[name] = {"us_per_step": median / steps * 1e6,
                         "samples_per_s": steps * batch_size / median,
                         "compile_s": compile_s, "epoch_s": seconds,
                         "spread": max(seconds) / min(seconds)}
    return figures


def measure_engines(settings: Settings) -> Rows:
    """Every configuration at every batch size on the active backend (one row each)."""
    batch_sizes = settings.options.get("batch_sizes") or list(BATCH_SIZES)
    repeats = settings.rounds(quick=2, full=5)
    rows = []
    for batch_size in batch_sizes:
        steps = steps_per_epoch(batch_size, settings.quick)
        dataset = synthetic(batch_size, steps)
        fused = {"native K=1": 1, "native K=32": min(32, steps), "native K=epoch": steps}
        runners = {
            "fit spe=1": fit_runner(dataset, batch_size, 1),
            "fit spe=32": fit_runner(dataset, batch_size, 32),
            **{name: native_runner(dataset, batch_size, k) for name, k in fused.items()},
            "reference": reference_runner(dataset, batch_size, steps),
        }
        if not impl().native_loop_uses_xla(False):  # TensorFlow: a graph without XLA as well
            fused["native K=epoch, no XLA"] = steps
            runners["native K=epoch, no XLA"] = native_runner(dataset, batch_size, steps,
                                                              jit_compile=False)
        for name, figures in measure(runners, steps, batch_size, repeats).items():
            row = {"batch_size": batch_size, "config": name, "steps_per_epoch": steps,
                   "fused_steps": fused.get(name), **figures}
            rows.append(row)
            say(f"batch {batch_size:5d} {name:15s} {row['us_per_step']:10.1f} us/step "
                f"{row['samples_per_s']:12.0f} samples/s compile {row['compile_s']:.2f}s")
    return rows, {"repeats": repeats, "batch_sizes": batch_sizes}


def engines_table(payload: dict[str, Any]) -> str:
    """One line per backend, batch size and configuration, with ratios to fit and the floor."""
    lines = ["| backend | batch | config | us/step | samples/s | x fit spe=1 | x reference | "
             "compile s | spread |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    groups: dict[tuple[str, int], dict[str, dict]] = {}
    for row in payload["rows"]:
        groups.setdefault((row["backend"], row["batch_size"]), {})[row["config"]] = row
    for (backend, batch_size), rows in groups.items():
        base = rows["fit spe=1"]["samples_per_s"]
        floor = rows["reference"]["samples_per_s"]
        for name, row in rows.items():
            label = name if row["fused_steps"] in (None, 32) or name.endswith("K=1") or \
                name.endswith("epoch") else f"{name} (K={row['fused_steps']})"
            lines.append(
                f"| {backend} | {batch_size} | {label} | {row['us_per_step']:.1f} | "
                f"{row['samples_per_s']:.0f} | {row['samples_per_s'] / base:.2f} | "
                f"{row['samples_per_s'] / floor:.2f} | {row['compile_s']:.2f} | "
                f"{row['spread']:.2f} |")
    return "\n".join(lines) + "\n"


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("bench_engines", "Engines: Keras fit vs the native engine vs a hand-written "
              "compiled loop (seed MLP, SGD, synthetic MNIST-shaped data).", measure_engines,
              keys=("batch_size", "config"), values=("us_per_step", "samples_per_s", "compile_s"),
              summary_fields=("repeats",),
              options=(Option("--batch-sizes", "comma-separated batch sizes "
                              f"(default {','.join(map(str, BATCH_SIZES))})", int_list),),
              table=engines_table,
              note="median epoch over interleaved rounds after one compiling epoch; compile_s "
                   "exact for the native engine, first epoch minus the median otherwise"),
)
