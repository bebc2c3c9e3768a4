"""Benchmarks of the hardware-facing training settings (docs/hardware.md): batch size, jit,
data format, precision, optimizer, preprocessing, roofline, device choice and prefetch.

Each ``measure_*`` function returns ``(rows, summary)`` for the active backend (one worker
process per backend); ``BENCHMARKS`` describes them for the registry. Quick mode uses fewer and
smaller cases so that ``nox -s bench`` stays short; the figures are then rough.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kbackend.advise.engine_probe import engine_throughput
from kbackend.backend_choice import keras as import_keras
from kbackend.backends import impl
from kbackend.bench.spec import Benchmark, Option, Rows, Settings, int_list
from kbackend.hardware import probe
from kbackend.hardware.inputs import iterate_batches, monitored_batches
from kbackend.hardware.knee import DEFAULT_MIN_GAIN, curve_knee
from kbackend.hardware.monitor import StepMonitor
from kbackend.hardware.prefetch import Prefetcher
from kbackend.models import ModelOptions, build_model
from kbackend.optim import OptimizerSpec
from kbackend.training import TrainConfig, train


def interleaved(factories: dict[str, Any], settings: Settings) -> dict[str, dict[str, Any]]:
    """Compile every case (``name -> () -> FitProbe``), then time them round-robin: 3 rounds in
    full mode (medians of the round medians), 1 in quick mode, ``--repeats`` if given. On a
    shared machine a change of load then hits every case alike."""
    probes = {name: make() for name, make in factories.items()}
    for _ in range(settings.rounds(quick=1, full=3) - 1):
        for item in probes.values():
            item.again()
    return {name: item.result() for name, item in probes.items()}


def measure_throughput(settings: Settings) -> Rows:
    """Samples/s of the seed MLP vs batch size (powers of two up to memory or budget), and the knee.

    Full mode times every size in 3 interleaved rounds (medians of the round medians)."""
    sizes = settings.options.get("batch_sizes") or (
        [16, 64, 256, 1024] if settings.quick else [2**k for k in range(3, 16)])
    budget = settings.options.get("budget_s") or (None if settings.quick else 240.0)
    work = probe.workload("seed_mlp", samples=4096)
    rows = probe.throughput_curve(work, sizes, steps=8 if settings.quick else 30,
                                  budget_s=budget,
                                  seconds_per_point=None if settings.quick else 2.0,
                                  rounds=settings.rounds(quick=1, full=3))
    measured = [r for r in rows if "samples_per_s" in r]
    knee = curve_knee(measured)
    for row in rows:
        row["model"] = "seed_mlp"
    return rows, {"knee_batch_size": knee.batch_size, "knee_samples_per_s": knee.throughput,
                  "plateau_reached": knee.plateau_reached,
                  "min_gain_per_doubling": DEFAULT_MIN_GAIN,
                  "largest_measured": measured[-1]["batch_size"] if measured else None}


def measure_jit(settings: Settings) -> Rows:
    """Compiled vs eager train steps: Keras fit with jit_compile on/off, run_eagerly, fused steps,
    and the native engine when it is registered."""
    batch, steps = (64, 8) if settings.quick else (128, 40)
    work = probe.workload("seed_mlp", samples=2048)
    cases: list[tuple[str, dict[str, Any]]] = [
        ("fit jit_compile=True", {"jit_compile": True}),
        ("fit jit_compile=False", {"jit_compile": False}),
        ("fit run_eagerly=True", {"jit_compile": False, "run_eagerly": True}),
        ("fit steps_per_execution=8", {"jit_compile": True, "steps_per_execution": 8}),
    ]
    rows = []
    for name, options in cases:
        eager_steps = min(steps, 8) if options.get("run_eagerly") else steps
        spe = options.get("steps_per_execution", 1)
        rows.append({"config": name, **probe.fit_throughput(
            work, batch, steps=max(eager_steps, 2 * spe), **options)})
    # Engines run through train() are timed per epoch (the native engine waits for results only
    # at epoch ends), so per-epoch overheads count: compare them with the keras engine timed alike.
    engine_steps = 16 if settings.quick else 64
    rows.append({"config": "keras engine (train, per-epoch timing)",
                 **engine_throughput(work, batch, "keras", steps=engine_steps)})
    for fused in (1, 8):
        rows.append({"config": f"native fused_steps={fused} (train, per-epoch timing)",
                     **engine_throughput(work, batch, "native", steps=engine_steps,
                                               fused_steps=fused)})
    return rows, {"batch_size": batch}


def measure_data_format(settings: Settings) -> Rows:
    """The CNN in channels_last vs channels_first: step time, and the memory a step needs beyond
    its inputs (reported as unsupported where the backend lacks NCHW convolutions)."""
    batch, steps = (32, 6) if settings.quick else (128, 30)
    rows, factories, works = [], {}, {}
    for data_format in ("channels_last", "channels_first"):
        if data_format == "channels_first" and not impl().supports_channels_first_conv():
            rows.append({"data_format": data_format, "batch_size": batch,
                         "note": "unsupported (no NCHW Conv2D on this device and build)"})
            continue
        work = works[data_format] = probe.workload("cnn", data_format=data_format, samples=1024)
        factories[data_format] = lambda work=work: probe.FitProbe(work, batch, steps=steps)
    rows += [{"data_format": name, **row, **probe.train_step_memory(works[name], batch)}
             for name, row in interleaved(factories, settings).items()]
    return rows, {"model": "cnn", "batch_size": batch}


def precision_accuracy(precision: str, steps: int) -> dict[str, Any]:
    """Validation accuracy of the seed MLP on digits after ``steps`` Adam steps under
    ``precision``."""
    config = TrainConfig(model="seed_mlp", dataset="digits", batch_size=32, epochs=100,
                         max_steps=steps, precision=precision, seed=0, engine="keras")
    result = train(config)
    return {"val_accuracy": result.history.best("val_accuracy"),
            "test_accuracy": result.history.test["test_accuracy"], "budget_steps": steps,
            "variable_dtypes": sorted({str(v.dtype) for v in result.model.trainable_variables})}


def measure_precision(settings: Settings) -> Rows:
    """float32 vs mixed_bfloat16 vs mixed_float16 (loss-scaled): step time, and accuracy in a
    fixed budget of steps."""
    batch, steps, budget = (128, 6, 40) if settings.quick else (512, 30, 400)
    support = impl().precision_support()
    work = probe.workload("seed_mlp", samples=4096)
    rows: list[dict[str, Any]] = []
    factories: dict[str, Callable[[], Any]] = {}
    for precision in ("float32", "mixed_bfloat16", "mixed_float16"):
        if not support.get(precision, {}).get("runs", True):
            rows.append({"precision": precision, "note": "unsupported on this device"})
            continue
        factories[precision] = functools.partial(probe.FitProbe, work, batch, steps=steps,
                                                 precision=precision)
    for precision, row in interleaved(factories, settings).items():
        rows.append({"precision": precision, **row,
                     "hardware_accelerated": support.get(precision, {}).get("accelerated"),
                     **precision_accuracy(precision, budget)})
    return rows, {"batch_size": batch, "accuracy_budget_steps": budget}


def measure_optimizers(settings: Settings) -> Rows:
    """SGD vs momentum vs Adam: step time and optimizer-state memory on a small and a large MLP."""
    batch, steps = (64, 6) if settings.quick else (128, 30)
    sizes = {"small (784-64-10)": (64,), "large (784-2048-2048-10)": (2048, 2048)}
    rows = []
    for size, widths in sizes.items():
        work = probe.workload("mlp", samples=1024, options=ModelOptions(widths=widths))
        factories = {name: lambda work=work, name=name: probe.FitProbe(
            work, batch, steps=steps, optimizer=OptimizerSpec(name, 0.01))
            for name in ("sgd", "momentum", "adam")}
        for name, row in interleaved(factories, settings).items():
            rows.append({"model": size, "optimizer": name, **row,
                         "optimizer_state_mib": row["optimizer_state_bytes"] / 2**20})
    return rows, {"batch_size": batch}


def _preprocessed_model(work: probe.Workload, mean: float, std: float) -> Any:
    keras = import_keras()
    inputs = keras.Input(shape=work.info.input_shape, dtype="uint8", name="pixels")
    x = keras.layers.Rescaling(1.0 / 255.0)(inputs)
    x = keras.layers.Normalization(mean=mean, variance=std**2)(x)
    return keras.Model(inputs, build_model(work.model, work.info, work.options)(x))


def measure_preprocessing(settings: Settings) -> Rows:
    """Rescaling + normalization of raw uint8 pixels on the host (NumPy per batch) vs inside the
    model (Keras layers, on the device); the same batch source feeds both."""
    batch, steps = (128, 8) if settings.quick else (256, 40)
    work = probe.workload("seed_mlp", samples=4096)
    raw = np.random.default_rng(0).integers(0, 256, size=work.x.shape, dtype=np.uint8)
    mean, std = float(raw.mean() / 255.0), float(raw.std() / 255.0)

    def host(batch_x: np.ndarray) -> np.ndarray:
        return ((batch_x.astype(np.float32) / 255.0 - mean) / std).astype(np.float32)

    def source(transform):
        return lambda x, y, b: monitored_batches(x, y, b, transform=transform)

    factories = {
        "host (NumPy per batch)": lambda: probe.FitProbe(work, batch, steps=steps, x=raw,
                                                         source=source(host)),
        "device (layers in the model)": lambda: probe.FitProbe(
            work, batch, steps=steps, x=raw, source=source(None),
            build=lambda w: _preprocessed_model(w, mean, std)),
    }
    rows = [{"preprocessing": name, **row}
            for name, row in interleaved(factories, settings).items()]
    return rows, {"batch_size": batch}


def measure_roofline(settings: Settings) -> Rows:
    """The seed MLP's train-step FLOP rate as a fraction of the matmul peak measured in the same
    run."""
    row = probe.roofline(256 if settings.quick else 1024, steps=16 if settings.quick else 40,
                         matmul_n=1024 if settings.quick else 2048,
                         rounds=settings.rounds(quick=2, full=5))
    return [{"model": "seed_mlp", **row}], {}


def measure_device(settings: Settings) -> Rows:
    """Each available device: the MLP at batch 1024 and the GRU at batch 8 (small-batch
    recurrent)."""
    steps = 6 if settings.quick else 30
    cases = [("seed_mlp", 256 if settings.quick else 1024), ("gru", 8)]
    rows = []
    for platform in probe.platforms():
        for model, batch in cases:
            with impl().device_scope(platform):
                work = probe.workload(model, samples=max(1024, batch * 4))
                rows.append({"device": platform, "model": model,
                             **probe.fit_throughput(work, batch, steps=steps)})
    return rows, {"platforms": probe.platforms()}


def slow_host_preprocessing(delay_s: float) -> Any:
    """A deliberately slow host transform: ``delay_s`` of waiting (I/O-like) plus a rescale."""

    def transform(batch_x: np.ndarray) -> np.ndarray:
        time.sleep(delay_s)
        return (batch_x.astype(np.float32) / 255.0).astype(np.float32)

    return transform


def prefetch_loop(work: probe.Workload, raw: np.ndarray, batch: int, steps: int, delay_s: float,
                  mode: str) -> dict[str, Any]:
    """``train_on_batch`` over a slow host pipeline, without prefetch or with it; monitored."""
    model = build_model(work.model, work.info, work.options)
    model.compile(optimizer=OptimizerSpec("sgd", 0.01).to_keras(),
                  loss="sparse_categorical_crossentropy")
    epochs = -(-(steps + 1) * batch // len(raw))
    batches = iterate_batches(raw, work.y, batch, epochs=epochs,
                              transform=slow_host_preprocessing(delay_s))
    monitor = StepMonitor(utilization_interval=0.1)
    if mode == "none":
        source = monitor.timed(batches)
    else:
        source = Prefetcher(batches, depth=2, to_device=mode == "prefetch + to_device",
                            monitor=monitor)
    monitor.start()
    for done, (x, y) in enumerate(source, start=1):
        model.train_on_batch(x, y)  # returns Python floats: the step has finished
        monitor.step_end(samples=len(x))
        if done > steps:
            break
    if hasattr(source, "close"):
        source.close()
    summary = monitor.stop()
    return {"prefetch": mode, "batch_size": batch, "host_delay_ms": 1e3 * delay_s,
            "step_ms": 1e3 * summary["median_step_s"], "samples_per_s": summary["samples_per_s"],
            "input_wait_share": summary["input_wait_share"], "verdict": summary["verdict"]}


def measure_prefetch(settings: Settings) -> Rows:
    """A deliberately slow host preprocessing function with and without background prefetch."""
    batch, steps, delay = (128, 10, 0.01) if settings.quick else (256, 60, 0.02)
    work = probe.workload("seed_mlp", samples=4096)
    raw = np.random.default_rng(0).integers(0, 256, size=work.x.shape, dtype=np.uint8)
    rows = [prefetch_loop(work, raw, batch, steps, delay, mode)
            for mode in ("none", "prefetch", "prefetch + to_device")]
    return rows, {"host_delay_ms": 1e3 * delay}


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("bench_throughput", "Throughput (samples/s) of the seed MLP vs batch size, with the "
              f"knee (where doubling the batch gains < {DEFAULT_MIN_GAIN:.0%}).",
              measure_throughput, ["model", "batch_size"],
              ["samples_per_s", "step_ms", "compile_s"],
              ["knee_batch_size", "knee_samples_per_s", "plateau_reached", "largest_measured"],
              options=(Option("--batch-sizes", "comma-separated batch sizes (default powers of two "
                              "8-32768; quick 16,64,256,1024)", int_list),
                       Option("--budget-s", "stop adding batch sizes after this many seconds "
                              "(default 240; quick: none)", float))),
    Benchmark("bench_jit", "Compiled vs eager train steps (Keras fit and the native engine).",
              measure_jit, ["config"], ["step_ms", "samples_per_s", "compile_s"]),
    Benchmark("bench_data_format", "CNN train step: channels_last vs channels_first.",
              measure_data_format, ["data_format", "batch_size"],
              ["step_ms", "samples_per_s", "compile_s", "step_memory_mib"]),
    Benchmark("bench_precision", "float32 vs mixed_bfloat16 vs mixed_float16 (loss-scaled): step "
              "time (seed MLP) and accuracy on digits in a fixed step budget.", measure_precision,
              ["precision"], ["step_ms", "samples_per_s", "val_accuracy", "hardware_accelerated"],
              ["batch_size", "accuracy_budget_steps"]),
    Benchmark("bench_optimizers", "SGD vs momentum vs Adam: step time and optimizer-state memory.",
              measure_optimizers, ["model", "optimizer"], ["step_ms", "optimizer_state_mib"]),
    Benchmark("bench_preprocessing", "Preprocessing raw uint8 pixels on the host vs on the device.",
              measure_preprocessing, ["preprocessing"], ["samples_per_s", "step_ms"]),
    Benchmark("bench_roofline",
              "Roofline: the seed MLP's train-step FLOP rate vs the measured matmul peak.",
              measure_roofline, ["model", "batch_size"],
              ["model_gflops", "peak_gflops", "fraction_of_peak", "fraction_min", "fraction_max",
               "peak_source"]),
    Benchmark("bench_device",
              "Device choice: the MLP at a large batch and the GRU at batch 8 on each device.",
              measure_device, ["device", "model", "batch_size"], ["step_ms", "samples_per_s"]),
    Benchmark("bench_prefetch",
              "A slow host preprocessing function with and without background prefetch.",
              measure_prefetch, ["prefetch", "host_delay_ms"],
              ["samples_per_s", "step_ms", "input_wait_share", "verdict"]),
)
