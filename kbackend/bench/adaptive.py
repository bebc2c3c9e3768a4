"""Adaptive batch size benchmark (issue 37): the estimator's overhead, and auto vs fixed.

    python scripts/bench_adaptive.py [--quick] [--out DIR] [--backends jax,tensorflow]
        [--part overhead|compare|both|reuse|estimator|timewin] [--model mlp]
        [--dataset mnist1d_large]
        [--batch-sizes 8,32,128,512] [--repeats N] [--fixed 8,16,...,512] [--rates 1e-3,3e-3]
        [--lr-scalings sqrt,linear,adascale,none] [--auto-min 8] [--auto-max 0,512]
        [--seeds 0,1,2] [--epochs 20] [--eval-every 25] [--target 0.65]

(``--quick``: the seed MLP on digits, overhead at batch 8 and 32 with 2 repeats on 512 of its
samples, compare with one seed, fixed 32 and 128, one rate, sqrt scaling, auto 8..128, 3 epochs,
and no XLA on TensorFlow (``--jit``): a smoke run, not the figures.)

``overhead``: one epoch of fused native steps (K = 8) per batch size with the plain trainer and
with the adaptive trainer (micro-batched gradients and the two norms), alternated, ``--repeats``
times after a compiling epoch; median us/step with [min, max], and the ratio of medians. With
``--devices N`` (N > 1; N virtual devices on a CPU) the two are the data-parallel trainer
and the data-parallel adaptive one (per-device norms), each batch size the global one.

``reuse``: auto runs (the first ``--lr-scalings``, MIN ``--auto-min``, the first non-zero
``--auto-max``, the first rate) as the study trains them, on one shared adaptive trainer
(``engines.native.Runs``: each size compiled once for all runs), against a fresh ``train()`` per
run; alternated, one pair per seed after a compiling round; wall seconds per run.

``estimator``: auto runs (the first ``--lr-scalings`` and rate, MIN ``--auto-min``, the first
non-zero ``--auto-max``) per seed with the every-step estimator and with the default (one
measured step in 16, the last of a fused call), alternated: the step each size was reached at
and the largest gap between the two, in evaluation intervals.

``timewin`` (issue 47): auto's wall to the target, a whole ``train()`` per run in a fresh
process, cold and warm compile caches, against fixed MIN and the best fixed size, with the
goals (<= 0.7x, <= 1.2x); ``[--problems mnist,mnist1d_large,fashion_mnist] [--study DIR]
[--caches cold,warm] [--min-rate R] [--best-batch B] [--best-rate R] [--seeds 0,1,2,3,4]``: see
``bench/adaptive_timewin.py``.

``compare``: per seed, ``train()`` on the native engine at every fixed batch size (each with the
best of the ``--rates``) and with ``--batch-size auto:MIN:MAX`` for each ``--lr-scalings`` and
``--auto-max`` (0: the default MAX, the throughput knee probed once per machine); steps,
samples and train time (compilation included) to the validation ``--target``; medians over
seeds with [min, max]. Each worker writes ``<out>/bench_adaptive_<backend>.png`` (written
atomically): each auto run's batch size over steps on top of its measured B_simple.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from kbackend.adaptive import DEFAULT_MEASURE_EVERY, AutoBatchSize
from kbackend.backend_choice import active_backend
from kbackend.backends import adaptive, impl
from kbackend.bench import adaptive_timewin
from kbackend.bench.spec import (
    Benchmark,
    Option,
    Rows,
    Settings,
    WorkerSpec,
    float_list,
    int_list,
    name_list,
    one_per_backend,
    say,
    spread,
    spread_text,
    subset_of,
)
from kbackend.data import batching
from kbackend.engines import adaptive as engine_adaptive
from kbackend.engines.loop import EpochRunner
from kbackend.engines.native import Runs, model_values
from kbackend.errors import KBackendError
from kbackend.escaping import plot_text
from kbackend.io import atomic_write
from kbackend.models import ModelOptions, build_model
from kbackend.optim import OptimizerSpec
from kbackend.reports import markdown_rows
from kbackend.study.summaries import adaptive_samples
from kbackend.training import Target, TrainConfig, train, workload_of

PARTS = ("overhead", "compare", "both", "reuse", "estimator", "timewin", "inflation")
FUSED_STEPS = 8
# measure_every of an adaptive trainer that never measures (the overhead part's structure row)
NEVER_MEASURED = 2**62

# Full and quick defaults of every option left out (quick: a smoke run of a few seconds).
FULL = {"model": "mlp", "dataset": "mnist1d_large", "batch_sizes": [8, 32, 128, 512],
        "fixed": [8, 16, 32, 64, 128, 256, 512], "rates": [1e-3, 3e-3],
        "lr_scalings": ["sqrt", "linear", "adascale", "none"], "auto_min": 8,
        "auto_max": [0, 512], "seeds": [0, 1, 2], "epochs": 20, "eval_every": 25,
        "target": 0.65}
QUICK = {"model": "seed_mlp", "dataset": "digits", "batch_sizes": [8, 32], "fixed": [32, 128],
         "rates": [3e-3], "lr_scalings": ["sqrt"], "auto_min": 8, "auto_max": [128],
         "seeds": [0], "epochs": 3, "eval_every": 40, "target": 0.9}
QUICK_OVERHEAD_SAMPLES = 512  # quick overhead epochs: the first 512 training samples


def _part(text: str) -> str:
    if text not in PARTS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(PARTS)}, got {text!r}")
    return text


def _jit(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


def _options(settings: Settings) -> dict[str, Any]:
    """Every option: the one given, else its quick or full default."""
    defaults = QUICK if settings.quick else FULL
    given = settings.options
    chosen = {name: given[name] if given.get(name) is not None else default
              for name, default in defaults.items()}
    chosen["part"] = given.get("part") or "both"
    chosen["optimizer"] = given.get("optimizer") or "adam"
    chosen["data_dir"] = given.get("data_dir")
    # TensorFlow's XLA compilation costs most of a small run on a CPU: quick runs skip it there.
    jit = given.get("jit")
    chosen["jit"] = jit if jit is not None else (not settings.quick
                                                  or impl().native_loop_uses_xla(False))
    chosen["repeats"] = settings.rounds(quick=2, full=7)
    chosen["overhead_samples"] = QUICK_OVERHEAD_SAMPLES if settings.quick else None
    chosen["devices"] = given.get("devices") or 1
    chosen["idle_calls"] = 20 if settings.quick else 100  # inflation: calls between compilations
    return chosen


def adaptive_workers(settings: Settings, backends: Any) -> list[WorkerSpec]:
    """One worker per backend; with ``--devices N`` (N > 1) each with N (virtual) devices."""
    devices = settings.options.get("devices") or 1
    if devices <= 1:
        return one_per_backend(settings, backends)
    return [WorkerSpec(f"{backend}, {devices} devices", backend, devices)
            for backend in backends]


class PacedEpochRunner(EpochRunner):
    """``EpochRunner``'s epoch with at most two calls in flight, as ``engines.loop`` runs them
    (a call's losses are read once the next one is dispatched). With a whole epoch of calls
    queued, XLA:CPU's all-reduce across 4 virtual devices deadlocked here ("Expected 4 threads
    to join the rendezvous, but only 2 of them arrived", 2 cores under load)."""

    def __call__(self) -> Any:
        rows = self.trainer.put_epoch(
            batching.epoch_batches(self.n_train, self.batch_size, self.seed, self.epoch))
        self.epoch += 1
        losses, pending, start = [], [], 0
        for length in self.lengths:
            self.compile_time += self.trainer.compile(length, rows)
            pending.append(self.trainer.run(rows, start, length))
            start += length
            if len(pending) == 2:
                losses.append(self.trainer.fetch(pending.pop(0)))
        losses += [self.trainer.fetch(handle) for handle in pending]
        return np.concatenate(losses)


def _trainers(model_plain: Any, model_adaptive: Any, spec: Any, dataset: Any, batch: int,
              opts: dict[str, Any]) -> tuple[Any, Any]:
    """The plain trainer and the adaptive one: native, or data parallel on ``--devices``."""
    devices = opts["devices"]
    if devices <= 1:
        return (impl().native_trainer(model_plain, spec, dataset, jit_compile=opts["jit"]),
                adaptive().AdaptiveTrainer(model_adaptive, spec, dataset,
                                           jit_compile=opts["jit"]))
    kwargs = dict(devices=devices, batch_size=batch, dp_impl="shard_map")
    return (impl().data_parallel_trainer(model_plain, spec, dataset, **kwargs),
            adaptive().DataParallelAdaptiveTrainer(model_adaptive, spec, dataset, **kwargs))


# -- overhead ------------------------------------------------------------------------------
def overhead(opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Per batch size: us/step of the plain and of the adaptive trainer, and their ratio; on
    one device also of the adaptive trainer that never measures (its fused call's structure
    alone: the plain steps around the per-call ``cond``, no measured step)."""
    dataset = _dataset(opts)
    if opts["overhead_samples"]:
        cut = opts["overhead_samples"]
        dataset = replace(dataset, x_train=dataset.x_train[:cut], y_train=dataset.y_train[:cut])
    n = len(dataset.x_train)
    spec, options = OptimizerSpec("adam", 1e-3), ModelOptions(seed=0)
    rows = []
    for batch in opts["batch_sizes"]:
        plain, grown = _trainers(build_model(opts["model"], dataset.info, options),
                                 build_model(opts["model"], dataset.info, options),
                                 spec, dataset, batch, opts)
        steps = n // batch
        fused = min(FUSED_STEPS, steps)
        kind = EpochRunner if opts["devices"] <= 1 else PacedEpochRunner
        runners = {"plain": kind(plain, n, batch, fused), "adaptive": kind(grown, n, batch, fused)}
        adaptive_trainers = [grown]
        if opts["devices"] <= 1:
            unmeasured = adaptive().AdaptiveTrainer(
                build_model(opts["model"], dataset.info, options), spec, dataset,
                jit_compile=opts["jit"], measure_every=NEVER_MEASURED)
            runners["unmeasured"] = kind(unmeasured, n, batch, fused)
            adaptive_trainers.append(unmeasured)
        for runner in runners.values():
            runner()  # compiles
        names = list(runners)
        times: dict[str, list[float | None]] = {name: [] for name in names}
        for repeat in range(opts["repeats"]):
            for trainer in adaptive_trainers:  # the norms kept since the last round
                trainer.take_noise_norms()
            for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                start = time.perf_counter()  # rotated each round: drift hits every trainer alike
                runners[name]()
                times[name].append((time.perf_counter() - start) / steps * 1e6)
        plain_us, adaptive_us = spread(times["plain"]), spread(times["adaptive"])
        ratio = _paired_ratio(times["adaptive"], times["plain"])
        row = {"part": "overhead", "case": f"batch {batch}", "batch_size": batch,
               "devices": opts["devices"],
               "steps_per_epoch": steps, "fused_steps": fused,
               "plain_us_per_step": plain_us["median"],
               "adaptive_us_per_step": adaptive_us["median"],
               "ratio": ratio["median"], "ratio_quartiles": ratio,
               "plain_us": plain_us, "adaptive_us": adaptive_us}
        if "unmeasured" in times:
            unmeasured_us = spread(times["unmeasured"])
            unmeasured = _paired_ratio(times["unmeasured"], times["plain"])
            row.update(unmeasured_us_per_step=unmeasured_us["median"], unmeasured_us=unmeasured_us,
                       unmeasured_ratio=unmeasured["median"], unmeasured_quartiles=unmeasured)
        rows.append(row)
        say(f"batch {batch:5d}: plain {row['plain_us_per_step']:9.1f} us/step, adaptive "
            f"{row['adaptive_us_per_step']:9.1f} us/step, ratio {row['ratio']:.2f}")
    return rows


def _paired_ratio(times: list[float | None], plain: list[float | None]) -> dict[str, Any]:
    """The per-round ratios ``times / plain`` (the two timed moments apart in each round, so
    drift cancels), in round order: their median and quartiles."""
    ratios = [t / p for t, p in zip(times, plain, strict=True) if t and p]
    if not ratios:
        nan = float("nan")
        return {"median": nan, "q1": nan, "q3": nan, "n": 0, "ratios": []}
    low, median, high = (statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1
                         else ratios * 3)
    return {"median": median, "q1": low, "q3": high, "n": len(ratios), "ratios": ratios}


def _quartiles_text(ratio: dict[str, float] | None, fallback: float) -> str:
    """``median [q1, q3]`` of a paired ratio (rows written before it was kept: the ratio)."""
    if not ratio:
        return f"{fallback:.2f}"
    return f"{ratio['median']:.2f} [{ratio['q1']:.2f}, {ratio['q3']:.2f}]"


# -- step-time inflation while compiling ahead ------------------------------------------------


def inflation(opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 47 item 2's cost: the adaptive trainer's K-step calls at the first batch size timed
    with nothing else running and while the next size (a new one each round: 2x, 4x, ... the
    batch) compiles ahead in its background thread, rounds alternating; per-step medians and
    their ratio, and the background compilations' seconds (what a used size hides)."""
    dataset = _dataset(opts)
    batch = opts["batch_sizes"][0]
    trainer = adaptive().AdaptiveTrainer(
        build_model(opts["model"], dataset.info, ModelOptions(seed=0)),
        OptimizerSpec("adam", 1e-3), dataset, jit_compile=opts["jit"])
    n = len(dataset.x_train)
    steps = n // batch
    fused = min(FUSED_STEPS, steps)
    order = np.random.default_rng(0).permutation(steps * batch).astype(np.int32)
    rows = trainer.put_epoch(order.reshape(steps, batch))
    trainer.compile(fused, rows)

    def call(index: int) -> float:
        start = time.perf_counter()
        trainer.fetch(trainer.run(rows, index * fused % (steps - fused + 1), fused))
        return (time.perf_counter() - start) / fused * 1e6

    for index in range(20):  # warm
        call(index)
    idle: list[float] = []
    busy: list[float] = []
    compiled_s: list[float] = []
    for round_index in range(opts["repeats"]):
        idle += [call(i) for i in range(opts["idle_calls"])]
        size = batch * 2 ** (round_index + 1)  # a size not compiled yet
        key = (size, fused)
        trainer.compile_ahead(size, fused, max(fused, n // size))
        trainer.ahead.start_pending()
        start, index = time.perf_counter(), 0
        while trainer.ahead.compiling(key):
            busy.append(call(index))
            index += 1
        compiled_s.append(time.perf_counter() - start)
        trainer.ahead.take(key)
        trainer.take_noise_norms()
    idle_us, busy_us = spread(idle), spread(busy)
    ratio = (busy_us["median"] / idle_us["median"] if busy_us["median"] is not None
             else math.nan)  # every compilation ended before a call could overlap it
    row = {"part": "inflation", "case": f"batch {batch}, K {fused}", "batch_size": batch,
           "idle_us": idle_us, "busy_us": busy_us, "ratio": ratio,
           "compile_s": spread(compiled_s)}
    say(f"batch {batch}: {idle_us['median']:.1f} us/step idle, {spread_text(busy_us, '.1f')} "
        f"while compiling ahead ({ratio:.2f}x); {row['compile_s']['median']:.2f} s per "
        f"background compilation")
    return [row]


# -- auto vs fixed -------------------------------------------------------------------------
def _run(config: Any, dataset: Any) -> dict[str, Any]:
    result = train(config, dataset=dataset)
    history = result.history
    reached = history.record.target_reached
    ranges = (history.record.adaptive_batch or {}).get("ranges")
    step: int | None = None
    samples: int | None = None
    seconds: float | None = None
    if reached is not None:
        step = int(reached["step"])
        samples = _samples_to(step, ranges, config.batch_size)
        seconds = float(reached["train_time"])  # compilation included (the loop's clock)
    return {"steps": step, "samples": samples, "time_s": seconds,
            "compile_s": history.timing.get("compile_time"),
            "train_time_s": history.timing.get("train_time"),
            "steps_run": history.steps_run, "test": history.test,
            "adaptive": history.record.adaptive_batch,
            "best_val": max((e.get("val_accuracy", 0.0) for e in history.evals), default=None)}


def _samples_to(step: int, ranges: list[dict[str, Any]] | None, batch: int) -> int:
    """Samples the run used up to ``step`` (per step range where the batch grew)."""
    return adaptive_samples(ranges, step) if ranges else step * batch


def _key(run: dict[str, Any]) -> tuple[float, float]:
    """Fewest steps to target first, then least time; a run that missed ranks last."""
    if run["steps"] is None:
        return (math.inf, -(run["best_val"] or 0.0))
    return (run["steps"], run["time_s"])


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}s"


def compare(opts: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per cell (fixed size, or auto scaling x MAX): its best-rate run of each seed."""
    base, dataset = _run_fields(opts), _dataset(opts)
    cells: dict[str, list[dict[str, Any]]] = {}

    def best_of_rates(name: str, seed: int, **fields: Any) -> None:
        runs = []
        for rate in opts["rates"]:
            config = TrainConfig(**base, **fields, seed=seed, model_options=ModelOptions(seed=seed),
                                 optimizer=OptimizerSpec(opts["optimizer"], rate))
            run = _run(config, dataset)
            sizes = [r["batch_size"] for r in (run["adaptive"] or {}).get("ranges", [])]
            say(f"seed {seed} {name} lr {rate:g}: steps {run['steps']} "
                f"time {_fmt(run['time_s'])}" + (f" sizes {sizes}" if sizes else ""))
            runs.append({**run, "seed": seed, "learning_rate": rate})
        cells.setdefault(name, []).append(min(runs, key=_key))  # the first of equals

    for seed in opts["seeds"]:
        for batch in opts["fixed"]:
            best_of_rates(f"fixed {batch}", seed, batch_size=batch)
        for scaling in opts["lr_scalings"]:
            for maximum in opts["auto_max"]:
                best_of_rates(f"auto {scaling} max {maximum or 'knee'}", seed,
                              batch_size=opts["auto_min"], lr_scaling=scaling,
                              adaptive_batch=AutoBatchSize(opts["auto_min"], maximum or None))
    rows = []
    for name, runs in cells.items():
        row: dict[str, Any] = {"part": "compare", "case": name,
                               "reached": sum(r["steps"] is not None for r in runs),
                               "seeds": len(runs),
                               **{field: spread([r[field] for r in runs])
                                  for field in ("steps", "samples", "time_s")},
                               "runs": runs}
        rows.append(row)
        steps, seconds = row["steps"], row["time_s"]
        say(f"{name:16s} reached {row['reached']}/{len(runs)}  steps {steps['median']} "
            f"[{steps['min']}, {steps['max']}]  time {_fmt(seconds['median'])} "
            f"[{_fmt(seconds['min'])}, {_fmt(seconds['max'])}]")
    return rows


def estimator(opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Auto runs (the first scaling and rate, MIN ``--auto-min``, the first non-zero
    ``--auto-max``) with the every-step estimator (``MEASURE_EVERY`` 1) and with the default
    (one step in ``DEFAULT_MEASURE_EVERY``, the last of a fused call), alternated per seed: the
    step each size was reached at, the largest gap between the two in evaluation intervals, and
    steps and time to the target."""
    maximum = next((m for m in opts["auto_max"] if m), 512)
    config, dataset = _auto_config(opts, maximum), _dataset(opts)
    rows = []
    for seed in opts["seeds"]:
        runs = {}
        for every in (1, DEFAULT_MEASURE_EVERY):
            engine_adaptive.MEASURE_EVERY = every
            try:
                run = _run(replace(config, seed=seed, model_options=ModelOptions(seed=seed)),
                           dataset)
            finally:
                engine_adaptive.MEASURE_EVERY = DEFAULT_MEASURE_EVERY
            runs[every] = {r["batch_size"]: r["step"] for r in run["adaptive"]["ranges"]}
            say(f"seed {seed} measured every {every}: sizes reached at {runs[every]}, steps "
                f"{run['steps']}, time {_fmt(run['time_s'])}")
            rows.append({"part": "estimator", "case": f"seed {seed} every {every}",
                         "seed": seed, "measure_every": every, "reached_at": runs[every],
                         "steps": run["steps"], "time_s": run["time_s"]})
        gaps = [abs(runs[1][size] - runs[DEFAULT_MEASURE_EVERY].get(size, math.inf))
                / opts["eval_every"] for size in runs[1]]
        rows[-1]["gap_intervals"] = rows[-2]["gap_intervals"] = max(gaps, default=0.0)
    return rows


def _run_fields(opts: dict[str, Any]) -> dict[str, Any]:
    """The ``TrainConfig`` fields every run of the benchmark shares, from its options."""
    return dict(model=opts["model"], dataset=opts["dataset"], engine="native",
                epochs=opts["epochs"], fused_steps=FUSED_STEPS, eval_every=opts["eval_every"],
                on_divergence="record", target=Target("val_accuracy", opts["target"]),
                data_dir=opts["data_dir"], jit_compile=opts["jit"])


def _dataset(opts: dict[str, Any]) -> Any:
    """The benchmark's dataset, as ``train()`` loads it for seed 0."""
    return workload_of(TrainConfig(**_run_fields(opts), model_options=ModelOptions(seed=0))).dataset


def _auto_config(opts: dict[str, Any], maximum: int) -> TrainConfig:
    """The benchmark's auto run from its options: MIN to ``maximum``, the first rate and scaling."""
    return TrainConfig(**_run_fields(opts), batch_size=opts["auto_min"],
                       lr_scaling=opts["lr_scalings"][0],
                       adaptive_batch=AutoBatchSize(opts["auto_min"], maximum),
                       optimizer=OptimizerSpec(opts["optimizer"], opts["rates"][0]))


def reuse(opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Auto runs as the study trains them (``engines.native.Runs``: one adaptive trainer, each
    size compiled once for all runs) against a fresh ``train()`` per run, alternated, one pair
    per seed after one unmeasured run of each; wall seconds per run, medians [min, max]."""
    maximum = next((m for m in opts["auto_max"] if m), 128)
    config, dataset = _auto_config(opts, maximum), _dataset(opts)

    def fresh(seed: int) -> Any:
        return build_model(config.model, dataset.info, ModelOptions(seed=seed))

    runs = Runs(fresh(0), dataset)
    cases: dict[str, Any] = {
        "fresh train() per run": lambda seed: train(replace(config, seed=seed),
                                                    model=fresh(seed), dataset=dataset),
        "Runs: one shared trainer": lambda seed: runs.train(replace(config, seed=seed),
                                                            model_values(fresh(seed))),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for index, seed in enumerate([opts["seeds"][0], *opts["seeds"]]):
        for name, run_one in cases.items():
            start = time.perf_counter()
            run_one(seed)
            if index:  # the first round compiles every size for both: not measured
                times[name].append(time.perf_counter() - start)
    fresh_times, shared_times = times.values()
    # Seeds stop at different steps: each seed's pair (same run both ways) is the comparison.
    paired = spread([b / a for a, b in zip(fresh_times, shared_times, strict=True)])
    rows: list[dict[str, Any]] = [
        {"part": "reuse", "case": name, "wall_s": spread(values),
         "ratio": spread([1.0] * len(values)) if index == 0 else paired}
        for index, (name, values) in enumerate(times.items())]
    for row in rows:
        say(f"{row['case']:26s} {_fmt(row['wall_s']['median'])} per run")
    say(f"shared / fresh, per seed: {paired['median']:.2f} [{paired['min']:.2f}, "
        f"{paired['max']:.2f}]")
    return rows


def plot(rows: list[dict[str, Any]], title: str, path: Path) -> bool:
    """Each auto run's batch size over steps and its measured B_simple, as a PNG at ``path``
    (written atomically); False (nothing written) where no auto run recorded a range."""
    import matplotlib  # deferred: optional and slow to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred (as above), after choosing the Agg backend

    figure, axis = plt.subplots(figsize=(7, 4))
    drawn = False
    for row in rows:
        if not row["case"].startswith("auto"):
            continue
        for index, run in enumerate(row["runs"]):
            ranges = (run["adaptive"] or {}).get("ranges") or []
            if not ranges:
                continue
            drawn = True
            steps = [r["step"] for r in ranges] + [run["steps_run"]]
            sizes = [r["batch_size"] for r in ranges]
            axis.step(steps, [*sizes, sizes[-1]], where="post",
                      label=f"{row['case']} batch" if index == 0 else None)
            measured = [(r["step"], r["b_simple"]) for r in ranges if r.get("b_simple")]
            if measured:
                axis.plot(*zip(*measured, strict=True), "o", markersize=3,
                          label=f"{row['case']} B_simple" if index == 0 else None)
    if drawn:
        axis.set_yscale("log", base=2)
        axis.set_xlabel("step")
        axis.set_ylabel("batch size / B_simple")
        axis.set_title(title)
        axis.legend(fontsize=7)
        figure.tight_layout()
        atomic_write(path, lambda tmp: figure.savefig(tmp, format="png", dpi=120))
    plt.close(figure)
    return drawn


def measure_adaptive(settings: Settings) -> Rows:
    """The ``--part`` asked for on the active backend: overhead rows, then compare rows."""
    opts = _options(settings)
    rows: list[dict[str, Any]] = []
    if opts["part"] in ("overhead", "both"):
        rows += overhead(opts)
    if opts["part"] == "reuse":
        rows += reuse(opts)
    if opts["part"] == "estimator":
        rows += estimator(opts)
    if opts["part"] == "inflation":
        rows += inflation(opts)
    if opts["part"] == "timewin":
        opts.update(adaptive_timewin.timewin_options(settings.quick, settings.options))
        rows += adaptive_timewin.timewin(opts, settings.options, settings.quick)
    plot_path = None
    if opts["part"] in ("compare", "both", "timewin"):
        compared = compare(opts) if opts["part"] != "timewin" else _timewin_plot_rows(rows)
        rows += compared if opts["part"] != "timewin" else []
        folder = settings.out
        path = Path(folder or ".") / f"bench_adaptive_{active_backend()}.png"
        title = (f"{plot_text(opts['model'])} on {plot_text(opts['dataset'])} "
                 f"({active_backend()}): adaptive batch size")
        try:
            if folder is not None and plot(compared, title, path):
                plot_path = str(path)
        except (OSError, KBackendError) as error:  # the figures stand without their plot
            say(f"no plot: {error}")
    summary = {name: opts[name] for name in ("part", "model", "dataset", "optimizer", "jit")}
    summary.update(fused_steps=FUSED_STEPS, plot=plot_path)
    if opts["part"] in ("overhead", "both"):
        summary.update(repeats=opts["repeats"], batch_sizes=opts["batch_sizes"],
                       devices=opts["devices"])
    if opts["part"] == "timewin":
        summary.update(seeds=opts["seeds"], caches=opts["caches"], goals=adaptive_timewin.GOALS,
                       load=os.getloadavg())
    if opts["part"] in ("compare", "both"):
        summary.update({name: opts[name] for name in (
            "fixed", "rates", "lr_scalings", "auto_min", "auto_max", "seeds", "epochs",
            "eval_every", "target")})
    return rows, summary


def _timewin_plot_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The timewin auto runs as ``plot`` reads them: one case per problem and cache state."""
    cases: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("part") == "timewin" and row["side"] == "auto":
            cases.setdefault(f"auto {row['problem']} {row['cache']}", []).append(row)
    return [{"case": case, "runs": runs} for case, runs in cases.items()]


def _section(rows: list[dict[str, Any]], part: str, title: str, header: list[str],
             cells: Any) -> list[str]:
    """The table of ``part``'s rows (``cells(row)`` a line each); none without its rows."""
    ours = [r for r in rows if r.get("part") == part]
    return [f"{title}:\n\n" + markdown_rows(header, (cells(r) for r in ours))] if ours else []


def adaptive_table(payload: dict[str, Any]) -> str:
    """A table per part that has rows (timewin's from its module), then the plots' paths."""
    rows = payload["rows"]
    devices = max((int(r.get("devices") or 1) for r in rows if r.get("part") == "overhead"),
                  default=1)
    where = f"data parallel on {devices} devices, global batch; " if devices > 1 else ""
    measured = "per-device-norm" if devices > 1 else "micro-batched"
    sections = (
        ("overhead",
         f"Overhead of the estimator ({where}K = 8 fused steps; median us/step [min, max]; "
         "ratios: median [quartiles] of the per-round ratios to the plain trainer)",
         ["backend", "batch", "plain us/step", f"{measured} us/step", "ratio",
          "never measuring: ratio"],
         lambda row: [row["backend"], str(row["batch_size"]),
                      spread_text(row["plain_us"], ".1f"),
                      spread_text(row["adaptive_us"], ".1f"),
                      _quartiles_text(row.get("ratio_quartiles"), row["ratio"]),
                      _quartiles_text(row.get("unmeasured_quartiles"),
                                      row["unmeasured_ratio"])
                      if "unmeasured_ratio" in row else "-"]),
        ("compare",
         "Auto vs fixed batch sizes (each seed's best rate; medians over the seeds that "
         "reached the target, [min, max]; time: train time to the target, compilation "
         "included)",
         ["backend", "cell", "reached", "steps to target", "samples to target",
          "time to target (s)"],
         lambda row: [row["backend"], row["case"], f"{row['reached']}/{row['seeds']}",
                      spread_text(row["steps"], ".0f"), spread_text(row["samples"], ".0f"),
                      spread_text(row["time_s"], ".2f")]),
        ("inflation",
         "Step-time inflation while the next size compiles ahead in the background (the "
         "adaptive trainer's calls, median us/step [min, max]; issue 47 item 2)",
         ["backend", "case", "idle us/step", "while compiling us/step", "ratio",
          "s per background compilation"],
         lambda row: [row["backend"], row["case"], spread_text(row["idle_us"], ".1f"),
                      spread_text(row["busy_us"], ".1f"), f"{row['ratio']:.2f}",
                      spread_text(row["compile_s"], ".2f")]),
        ("reuse",
         "Auto runs, each on a fresh train() vs on one shared trainer (the study's Runs); "
         "wall seconds per run after a compiling round, and each seed's ratio to its fresh "
         "run, median [min, max]",
         ["backend", "case", "s per run", "ratio to fresh (per seed)"],
         lambda row: [row["backend"], row["case"], spread_text(row["wall_s"], ".2f"),
                      spread_text(row["ratio"], ".2f")]),
        ("estimator",
         "Growth with the every-step estimator vs one step in 16 (the last of a fused "
         "call): the step each batch size was reached at; gap: the largest difference in "
         "evaluation intervals",
         ["backend", "case", "reached at (size: step)", "gap (intervals)", "steps to target",
          "time to target (s)"],
         lambda row: [row["backend"], row["case"],
                      ", ".join(f"{k}: {v}" for k, v in row["reached_at"].items()),
                      f"{row['gap_intervals']:.1f}", str(row["steps"]), _fmt(row["time_s"])]),
    )
    parts = [text for section in sections for text in _section(rows, *section)]
    parts += adaptive_timewin.tables(rows)
    plots = [s["plot"] for s in payload["summaries"] if s.get("plot")]
    if plots:
        parts.append("Batch-size trajectories over B_simple: " + ", ".join(plots))
    return "\n".join(parts) if parts else "(no rows)\n"


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("bench_adaptive", "Adaptive batch size (--batch-size auto): the noise-scale "
              "estimator's overhead per step, and steps, samples and time to a target of auto "
              "vs fixed batch sizes on the native engine.", measure_adaptive,
              keys=("part", "case"),
              summary_fields=("part", "model", "dataset", "plot"),
              options=(
                  Option("--part", "overhead, compare, both, reuse (auto runs on one "
                         "shared trainer vs a fresh train() each), estimator (growth with "
                         "the every-step estimator vs the default), timewin (auto's wall "
                         "to the target vs fixed MIN and the best fixed size, issue 47), or "
                         "inflation (step time while the next size compiles ahead, at the "
                         "first --batch-sizes) (default both)", _part),
                  Option("--model", "model (default mlp, quick seed_mlp)"),
                  Option("--dataset", "dataset (default mnist1d_large, quick digits)"),
                  Option("--data-dir", "data folder (default: kbackend's)"),
                  Option("--batch-sizes", "overhead: comma-separated batch sizes (default "
                         "8,32,128,512, quick 8,32)", int_list),
                  Option("--fixed", "compare: fixed batch sizes (default 8,16,32,64,128,256,"
                         "512, quick 32,128)", int_list),
                  Option("--rates", "compare: learning rates, each cell takes the best "
                         "(default 1e-3,3e-3, quick 3e-3)", float_list),
                  Option("--optimizer", "compare: optimizer (default adam)"),
                  Option("--lr-scalings", "compare: auto runs' scalings (default "
                         "sqrt,linear,adascale,none, quick sqrt)", name_list),
                  Option("--auto-min", "compare: auto MIN (default 8)", int),
                  Option("--auto-max", "compare: auto MAXes, 0 the default (the throughput "
                         "knee, probed once per machine) (default 0,512, quick 128)", int_list),
                  Option("--seeds", "compare: seeds (default 0,1,2, quick 0)", int_list),
                  Option("--epochs", "compare: epochs at most (default 20, quick 3)", int),
                  Option("--eval-every", "compare: steps between evaluations, where the batch "
                         "grows (default 25, quick 40)", int),
                  Option("--target", "compare: validation accuracy target (default 0.65, "
                         "quick 0.9)", float),
                  Option("--jit", "on or off: XLA compilation of the native steps (default "
                         "on; quick: off on tensorflow)", _jit),
                  Option("--problems", "timewin: problems (default "
                         "mnist,mnist1d_large,fashion_mnist)",
                         subset_of(tuple(adaptive_timewin.PROBLEMS))),
                  Option("--study", "timewin: a kbackend study report folder or its "
                         "summary.json: its problem, rate at MIN and best fixed cell"),
                  Option("--caches", "timewin: cold, warm or both (default cold,warm, quick "
                         "cold)", subset_of(adaptive_timewin.DEFAULT_CACHES)),
                  Option("--min-rate", "timewin: the rate at MIN of auto and fixed MIN "
                         "(default: the problem's)", float),
                  Option("--best-batch", "timewin: the best fixed batch size (default: the "
                         "problem's)", int),
                  Option("--best-rate", "timewin: the best fixed size's rate (default: the "
                         "problem's)", float),
                  Option("--devices", "overhead: N > 1 compares the data-parallel trainers "
                         "on N devices (N virtual devices on a CPU) (default 1)", int)),
              workers=adaptive_workers,
              table=adaptive_table,
              note="overhead: medians of alternated epochs after a compiling one; compare: "
                   "medians over seeds of each seed's best rate; time includes compilation"),
)
