"""Benchmark the adaptive batch size (issue 37): the estimator's overhead, and auto vs fixed.

  KERAS_BACKEND=jax python scripts/bench_adaptive.py overhead [--out runs/bench/adaptive]
  KERAS_BACKEND=jax python scripts/bench_adaptive.py compare  [--out runs/bench/adaptive]

``overhead``: one epoch of fused native steps (K = 8) per batch size with the plain trainer and
with the adaptive trainer (micro-batched gradients and the two norms), alternated, ``--repeats``
times after a compiling epoch; median us/step with [min, max], and the ratio of medians.

``compare``: per seed, ``train()`` on the native engine at every fixed batch size (each with the
best of a small learning-rate grid) and with ``--batch-size auto:MIN:MAX`` for each
``--lr-scaling``; steps, samples and train time (compilation included) to the validation target;
medians over seeds with [min, max]. The PNG plots each auto run's batch size over steps on top
of its measured B_simple. JSON and PNG are written atomically; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from kbackend.envinfo import environment
from kbackend.io import atomic_write, atomic_write_json


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def median_interval(values: list[float]) -> dict[str, Any]:
    """Median and [min, max] of the finite values (None where there are none)."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return {"median": None, "min": None, "max": None, "n": 0, "of": len(values)}
    return {"median": statistics.median(finite), "min": min(finite), "max": max(finite),
            "n": len(finite), "of": len(values)}


# -- overhead ------------------------------------------------------------------------------
def overhead(args: argparse.Namespace) -> dict[str, Any]:
    from kbackend.backends import adaptive, impl
    from kbackend.engines.loop import EpochRunner
    from kbackend.models import ModelOptions, build_model
    from kbackend.optim import OptimizerSpec
    from kbackend.training import TrainConfig, load_dataset

    config = TrainConfig(model=args.model, dataset=args.dataset, seed=0,
                         model_options=ModelOptions(seed=0))
    dataset = load_dataset(config)
    n = len(dataset.x_train)
    spec = OptimizerSpec("adam", 1e-3)
    rows = []
    for batch in args.batch_sizes:
        model_plain = build_model(args.model, dataset.info, config.model_options)
        model_adaptive = build_model(args.model, dataset.info, config.model_options)
        plain = impl().native_trainer(model_plain, spec, dataset)
        grown = adaptive().AdaptiveTrainer(model_adaptive, spec, dataset)
        runners = {"plain": EpochRunner(plain, n, batch, 8), "adaptive": EpochRunner(grown, n,
                                                                                      batch, 8)}
        steps = n // batch
        for runner in runners.values():
            runner()  # compiles
        times: dict[str, list[float]] = {"plain": [], "adaptive": []}
        for _ in range(args.repeats):
            for name, runner in runners.items():  # alternated: drift hits both alike
                start = time.perf_counter()
                runner()
                times[name].append((time.perf_counter() - start) / steps * 1e6)
            grown.take_noise_norms()
        row = {"batch_size": batch, "steps_per_epoch": steps,
               "plain_us_per_step": median_interval(times["plain"]),
               "adaptive_us_per_step": median_interval(times["adaptive"])}
        row["ratio"] = (row["adaptive_us_per_step"]["median"]
                        / row["plain_us_per_step"]["median"])
        rows.append(row)
        say(f"batch {batch:5d}: plain {row['plain_us_per_step']['median']:9.1f} us/step, "
            f"micro-batched {row['adaptive_us_per_step']['median']:9.1f} us/step, "
            f"ratio {row['ratio']:.2f}")
    return {"kind": "overhead", "model": args.model, "dataset": args.dataset,
            "fused_steps": 8, "repeats": args.repeats, "rows": rows}


# -- auto vs fixed -------------------------------------------------------------------------
def _run(config: Any, dataset: Any) -> dict[str, Any]:
    from kbackend.training import train

    result = train(config, dataset=dataset)
    history = result.history
    reached = history.record.target_reached
    ranges = (history.record.adaptive_batch or {}).get("ranges")
    if reached is not None:
        step = int(reached["step"])
        samples = _samples_to(step, ranges, config.batch_size)
        seconds = float(reached["train_time"])  # compilation included (the loop's clock)
    else:
        step = samples = seconds = None
    return {"steps": step, "samples": samples, "time_s": seconds,
            "compile_s": history.timing.get("compile_time"),
            "train_time_s": history.timing.get("train_time"),
            "steps_run": history.steps_run, "test": history.test,
            "adaptive": history.record.adaptive_batch,
            "best_val": max((e.get("val_accuracy", 0.0) for e in history.evals), default=None)}


def _samples_to(step: int, ranges: list[dict[str, Any]] | None, batch: int) -> int:
    """Samples the run used up to ``step`` (per step range where the batch grew)."""
    if not ranges:
        return step * batch
    total = 0
    bounds = [*ranges[1:], {"step": math.inf}]
    for current, following in zip(ranges, bounds, strict=True):
        end = min(step, following["step"])
        if end > current["step"]:
            total += (end - current["step"]) * current["batch_size"]
    return int(total)


def compare(args: argparse.Namespace) -> dict[str, Any]:
    from kbackend.adaptive import AutoBatchSize
    from kbackend.models import ModelOptions
    from kbackend.optim import OptimizerSpec
    from kbackend.training import Target, TrainConfig, load_dataset

    base = dict(model=args.model, dataset=args.dataset, engine="native", epochs=args.epochs,
                fused_steps=8, eval_every=args.eval_every, on_divergence="record",
                target=Target("val_accuracy", args.target), data_dir=args.data_dir)
    dataset = load_dataset(TrainConfig(**base, model_options=ModelOptions(seed=0)))
    cells: dict[str, dict[str, Any]] = {}
    for seed in args.seeds:
        options = ModelOptions(seed=seed)
        for batch in args.fixed:
            best = None
            for rate in args.rates:
                config = TrainConfig(**base, seed=seed, model_options=options, batch_size=batch,
                                     optimizer=OptimizerSpec(args.optimizer, rate))
                run = _run(config, dataset)
                say(f"seed {seed} batch {batch:4d} lr {rate:g}: steps {run['steps']} "
                    f"time {_fmt(run['time_s'])}")
                if best is None or _key(run) < _key(best):
                    best = {**run, "learning_rate": rate}
            cells.setdefault(f"fixed {batch}", {"runs": []})["runs"].append(best)
        for scaling in args.lr_scalings:
            for maximum in args.auto_max:
                name = f"auto {scaling} max {maximum or 'knee'}"
                best = None
                for rate in args.rates:
                    config = TrainConfig(**base, seed=seed, model_options=options,
                                         batch_size=args.auto_min,
                                         adaptive_batch=AutoBatchSize(args.auto_min,
                                                                      maximum or None),
                                         lr_scaling=scaling,
                                         optimizer=OptimizerSpec(args.optimizer, rate))
                    run = _run(config, dataset)
                    sizes = [r["batch_size"] for r in (run["adaptive"] or {}).get("ranges", [])]
                    say(f"seed {seed} {name} lr {rate:g}: steps {run['steps']} "
                        f"time {_fmt(run['time_s'])} sizes {sizes}")
                    if best is None or _key(run) < _key(best):
                        best = {**run, "learning_rate": rate}
                cells.setdefault(name, {"runs": []})["runs"].append(best)
    for cell in cells.values():
        runs = cell["runs"]
        cell["reached"] = sum(r["steps"] is not None for r in runs)
        for name in ("steps", "samples", "time_s"):
            cell[name] = median_interval([r[name] for r in runs])
    return {"kind": "compare", "model": args.model, "dataset": args.dataset,
            "optimizer": args.optimizer, "rates": args.rates, "target": args.target,
            "seeds": args.seeds, "epochs": args.epochs, "cells": cells,
            "auto_min": args.auto_min, "auto_max": args.auto_max,
            "eval_every": args.eval_every}


def _key(run: dict[str, Any]) -> tuple[float, float]:
    """Fewest steps to target first, then least time; a run that missed ranks last."""
    if run["steps"] is None:
        return (math.inf, -(run["best_val"] or 0.0))
    return (run["steps"], run["time_s"])


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}s"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib  # deferred: optional and slow to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for name, cell in result["cells"].items():
        if not name.startswith("auto"):
            continue
        for index, run in enumerate(cell["runs"]):
            ranges = (run["adaptive"] or {}).get("ranges") or []
            if not ranges:
                continue
            end = run["steps_run"]
            steps = [r["step"] for r in ranges] + [end]
            sizes = [r["batch_size"] for r in ranges]
            axis.step(steps, [*sizes, sizes[-1]], where="post",
                      label=f"{name} batch" if index == 0 else None)
            measured = [(r["step"], r["b_simple"]) for r in ranges if r["b_simple"]]
            if measured:
                axis.plot(*zip(*measured, strict=True), "o", markersize=3,
                          label=f"{name} B_simple" if index == 0 else None)
    axis.set_yscale("log", base=2)
    axis.set_xlabel("step")
    axis.set_ylabel("batch size / B_simple")
    axis.set_title(f"{result['model']} on {result['dataset']}: adaptive batch size")
    axis.legend(fontsize=7)
    figure.tight_layout()
    atomic_write(path, lambda tmp: figure.savefig(tmp, format="png", dpi=120))
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("overhead", "compare"))
    parser.add_argument("--out", type=Path, default=Path("runs/bench/adaptive"))
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--dataset", default="mnist1d_large")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32, 128, 512])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--fixed", type=int, nargs="+",
                        default=[8, 16, 32, 64, 128, 256, 512])
    parser.add_argument("--rates", type=float, nargs="+", default=[1e-3, 3e-3])
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--lr-scalings", nargs="+",
                        default=["sqrt", "linear", "adascale", "none"])
    parser.add_argument("--auto-min", type=int, default=8)
    parser.add_argument("--auto-max", type=int, nargs="+", default=[0, 512],
                        help="0: the default MAX (the throughput knee, probed once per machine)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=25,
                        help="steps between evaluations (growth happens at them)")
    parser.add_argument("--target", type=float, default=0.65)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    result = overhead(args) if args.mode == "overhead" else compare(args)
    result["env"] = environment()
    result["wall_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    from kbackend.backend_choice import selected_backend

    stem = f"{args.mode}_{args.model}_{args.dataset}_{selected_backend()}"
    atomic_write_json(args.out / f"{stem}.json", result)
    if args.mode == "compare":
        plot(result, args.out / f"{stem}.png")
        for name, cell in result["cells"].items():
            steps, seconds = cell["steps"], cell["time_s"]
            say(f"{name:16s} reached {cell['reached']}/{len(cell['runs'])}  steps "
                f"{steps['median']} [{steps['min']}, {steps['max']}]  time "
                f"{_fmt(seconds['median'])} [{_fmt(seconds['min'])}, {_fmt(seconds['max'])}]")
    say(f"wrote {args.out / stem}.json ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
