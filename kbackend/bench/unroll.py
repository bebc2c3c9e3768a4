"""Unroll benchmark: a conv model's K fused steps in a compiled loop vs written out one by one.

    python scripts/bench_unroll.py [--quick] [--out DIR] [--backends jax,tensorflow]
        [--dataset fashion_mnist] [--batch-size 128] [--fused-steps 4] [--repeats N]

(``--quick``: digits at batch 32, K = 2, one round: a smoke run, not the figure.)

XLA:CPU runs a convolution inside a while loop far slower than outside one, so the native
engine writes a conv model's K steps out on a CPU (``capabilities.unrolls_its_loop``). This
measures why: the default CNN (``kbackend.models.cnn``, SGD lr 0.01) on ``--dataset`` at
``--batch-size``, one epoch of ``--fused-steps`` steps per call, under each backend:

* ``loop K``: the K steps in the backend's loop (``lax.scan``; a ``tf.range`` loop in one XLA
  function), the unroll switched off;
* ``unrolled K``: the same K steps written out (what the engine runs on a CPU);
* ``unrolled K=1``: one step per call (the lone step, no loop at all).

Each configuration runs one compiling epoch (excluded; ``compile_s`` is the trainer's own
figure, on TF for an unrolled call including its first call's steps), then ``repeats``
interleaved rounds; the median is reported as s/step with its ratio to ``unrolled K``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kbackend import data as data_module
from kbackend.bench.engines import measure
from kbackend.bench.spec import Benchmark, Option, Rows, Settings, say
from kbackend.engines.native import epoch_runner
from kbackend.models import ModelOptions, build_model
from kbackend.optim import OptimizerSpec
from kbackend.reports import markdown_rows

LEARNING_RATE = 0.01


def runner(dataset: Any, batch_size: int, fused_steps: int, unroll: bool) -> Any:
    """One epoch per call of a fresh CNN, its K-step loop unrolled or not."""
    model = build_model("cnn", dataset.info, ModelOptions())
    run = epoch_runner(model, dataset, OptimizerSpec("sgd", LEARNING_RATE), batch_size,
                       fused_steps)
    run.trainer.unroll = unroll  # read when a call is traced: before its first compile
    return run


def measure_unroll(settings: Settings) -> Rows:
    """``loop K``, ``unrolled K`` and ``unrolled K=1`` on the active backend (one row each)."""
    # Quick: a smoke run on the embedded digits (no download, small convolutions).
    name = settings.options.get("dataset") or ("digits" if settings.quick else "fashion_mnist")
    batch_size = settings.options.get("batch_size") or (32 if settings.quick else 128)
    k = settings.options.get("fused_steps") or (2 if settings.quick else 4)
    repeats = settings.rounds(quick=1, full=3)
    full = data_module.load(name, layout="image")
    dataset = replace(full, x_train=full.x_train[: k * batch_size],
                      y_train=full.y_train[: k * batch_size])
    runners = {f"loop K={k}": runner(dataset, batch_size, k, False),
               f"unrolled K={k}": runner(dataset, batch_size, k, True),
               "unrolled K=1": runner(dataset, batch_size, 1, True)}
    figures = measure(runners, k, batch_size, repeats)
    base = figures[f"unrolled K={k}"]["us_per_step"]
    rows = []
    for config, fig in figures.items():
        row = {"dataset": name, "batch_size": batch_size, "config": config,
               "s_per_step": fig["us_per_step"] / 1e6, "x_unrolled": fig["us_per_step"] / base,
               "compile_s": fig["compile_s"], "spread": fig["spread"], "epoch_s": fig["epoch_s"]}
        rows.append(row)
        say(f"{config:14s} {row['s_per_step']:8.3f} s/step x{row['x_unrolled']:.1f} compile "
            f"{row['compile_s']:.1f}s")
    return rows, {"repeats": repeats, "fused_steps": k, "batch_size": batch_size,
                  "dataset": name}


def unroll_table(payload: dict[str, Any]) -> str:
    """One line per backend and configuration: median s/step and its ratio to unrolled K."""
    return markdown_rows(
        ["backend", "config", "s/step (median)", "x unrolled", "compile s", "spread"],
        ([row["backend"], row["config"], f"{row['s_per_step']:.3f}", f"{row['x_unrolled']:.1f}",
          f"{row['compile_s']:.1f}", f"{row['spread']:.2f}"] for row in payload["rows"]))


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("bench_unroll", "Unroll: a CNN's K fused steps in a compiled loop vs written out "
              "(the native engine's choice for conv models on a CPU).", measure_unroll,
              keys=("config",), values=("s_per_step", "x_unrolled", "compile_s"),
              summary_fields=("repeats", "fused_steps", "batch_size", "dataset"),
              options=(Option("--dataset", "image dataset (default fashion_mnist, quick digits)"),
                       Option("--batch-size", "batch size (default 128, quick 32)", int),
                       Option("--fused-steps", "K, steps per call (default 4, quick 2)", int)),
              table=unroll_table,
              note="median epoch (K steps, one call) over interleaved rounds after one "
                   "compiling epoch; x unrolled: s/step over unrolled K's"),
)
