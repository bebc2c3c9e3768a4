"""Engines benchmark: Keras ``fit`` vs the native engine vs a hand-written compiled loop.

    python scripts/bench_engines.py [--quick] [--out DIR] [--backends jax,tensorflow]

The seed MLP (784-786-256-160-10, SGD lr 0.01) on MNIST-shaped synthetic data (784 inputs,
10 classes), at batch sizes 8, 32, 128, 1024, under each backend in its own subprocess, one after
the other in one run. Configurations, per backend and batch size:

* ``fit spe=1`` / ``fit spe=32``: ``model.fit`` with ``steps_per_execution`` 1 / 32, jit on;
* ``native K=1`` / ``K=32`` / ``K=epoch``: ``kbackend.engines.native`` (K fused steps per call);
* ``reference``: the floor, a minimal hand-written loop over the same network and data:
  one ``jax.lax.scan`` over pre-stacked batches with ``optax.sgd`` (JAX) or one XLA
  ``tf.function`` loop with ``assign_sub`` (TF), a whole epoch per call.

Each configuration first runs one (compiling) epoch, excluded; then every configuration runs one
epoch in turn, ``repeats`` rounds (interleaved, so a busy machine slows all alike), and the median
epoch is reported as us/step and samples/s, with the ratio to ``fit spe=1`` and the compile time
separately (exact for the native engine; first epoch minus the median for the others). Writes ``bench_engines.json`` (figures + environment of each backend)
and ``bench_engines.md`` (the table) to ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import numpy as np

BATCH_SIZES = (8, 32, 128, 1024)
LEARNING_RATE = 0.01
VAL_SAMPLES = 256
CONFIGS = ("fit spe=1", "fit spe=32", "native K=1", "native K=32", "native K=epoch", "reference")


def steps_per_epoch(batch_size: int, quick: bool) -> int:
    """Steps in one timed epoch: enough to amortize per-call costs, few at large batches."""
    full = {8: 128, 32: 128, 128: 64, 1024: 32}
    steps = full.get(batch_size, 64)
    return max(8, steps // 4) if quick else steps


def synthetic(batch_size: int, steps: int, seed: int = 0) -> Any:
    """MNIST-shaped data: ``steps * batch_size`` training samples, 784 features, 10 classes."""
    from kbackend import data as data_module

    rng = np.random.default_rng(seed)
    n = steps * batch_size + VAL_SAMPLES
    x = rng.random((n, 784), dtype=np.float32)
    y = rng.integers(0, 10, n)
    return data_module.from_arrays("synthetic_mnist", x, y, x[:VAL_SAMPLES], y[:VAL_SAMPLES],
                                   num_classes=10, validation_fraction=VAL_SAMPLES / n, seed=seed)


def fit_runner(dataset: Any, batch_size: int, spe: int) -> Any:
    """One epoch of ``model.fit`` per call (its per-call setup is part of fit's cost)."""
    import keras

    from kbackend.models import ModelOptions, build_model

    model = build_model("seed_mlp", dataset.info, ModelOptions())
    model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE),
                  loss="sparse_categorical_crossentropy", jit_compile=True,
                  steps_per_execution=spe)
    return lambda: model.fit(dataset.x_train, dataset.y_train, batch_size=batch_size,
                             epochs=1, shuffle=False, verbose=0)


def native_runner(dataset: Any, batch_size: int, fused: int) -> Any:
    """One epoch of the native engine per call (``kbackend.engines.native.EpochRunner``)."""
    from kbackend.engines.native import EpochRunner
    from kbackend.models import ModelOptions, build_model
    from kbackend.optim import OptimizerSpec

    model = build_model("seed_mlp", dataset.info, ModelOptions())
    return EpochRunner(model, dataset, OptimizerSpec("sgd", LEARNING_RATE), batch_size, fused)


def reference_runner(dataset: Any, batch_size: int, steps: int) -> Any:
    from kbackend.backends import impl

    x = dataset.x_train.reshape(steps, batch_size, 784)
    y = dataset.y_train.reshape(steps, batch_size)
    return impl_reference(impl().__name__)(x, y)


def measure(runners: dict[str, Any], steps: int, batch_size: int, repeats: int) -> dict:
    """Time one epoch of every runner, round-robin, ``repeats`` times after a compiling epoch.

    Interleaving spreads the load of a shared machine evenly over the configurations.
    """
    first, epochs = {}, {name: [] for name in runners}
    for name, run in runners.items():
        start = time.perf_counter()
        run()
        first[name] = time.perf_counter() - start
    names = list(runners)
    for repeat in range(repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            start = time.perf_counter()
            runners[name]()
            epochs[name].append(time.perf_counter() - start)
    figures = {}
    for name, seconds in epochs.items():
        median = statistics.median(seconds)
        compile_s = getattr(runners[name], "compile_time", first[name] - median)
        figures[name] = {"us_per_step": median / steps * 1e6,
                         "samples_per_s": steps * batch_size / median,
                         "compile_s": compile_s, "epoch_s": seconds}
    return figures


def impl_reference(module_name: str) -> Any:
    return _jax_reference if module_name.endswith("jax_backend") else _tf_reference


def _init_params(seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    sizes = (784, 786, 256, 160, 10)
    return [((rng.standard_normal((a, b)) * np.sqrt(2.0 / a)).astype(np.float32),
             np.zeros(b, np.float32)) for a, b in itertools.pairwise(sizes)]


def _jax_reference(x: np.ndarray, y: np.ndarray) -> Any:
    """A whole epoch in one ``lax.scan`` over pre-stacked device batches, plain optax SGD."""
    import jax
    import optax

    transform = optax.sgd(LEARNING_RATE)

    def loss_fn(params, xb, yb):
        h = xb
        for i, (w, b) in enumerate(params):
            h = h @ w + b
            if i < len(params) - 1:
                h = jax.nn.relu(h)
        return optax.softmax_cross_entropy_with_integer_labels(h, yb).mean()

    def step(carry, batch):
        params, opt_state = carry
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = transform.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    epoch = jax.jit(lambda carry, xs, ys: jax.lax.scan(step, carry, (xs, ys)), donate_argnums=0)
    params = jax.device_put(_init_params())
    state = {"carry": (params, transform.init(params))}
    xs, ys = jax.device_put(x), jax.device_put(y)

    def run() -> None:
        state["carry"], losses = epoch(state["carry"], xs, ys)
        jax.block_until_ready(losses)

    return run


def _tf_reference(x: np.ndarray, y: np.ndarray) -> Any:
    """A whole epoch in one XLA-compiled ``tf.function`` loop, plain SGD with ``assign_sub``."""
    import tensorflow as tf

    variables = [tf.Variable(a) for pair in _init_params() for a in pair]
    xs, ys = tf.identity(tf.constant(x)), tf.identity(tf.constant(y, tf.int32))

    @tf.function(jit_compile=True)
    def epoch(xs, ys):
        losses = tf.TensorArray(tf.float32, size=tf.shape(xs)[0])
        for i in tf.range(tf.shape(xs)[0]):
            with tf.GradientTape() as tape:
                h = xs[i]
                for layer in range(4):
                    h = tf.matmul(h, variables[2 * layer]) + variables[2 * layer + 1]
                    if layer < 3:
                        h = tf.nn.relu(h)
                loss = tf.reduce_mean(
                    tf.nn.sparse_softmax_cross_entropy_with_logits(labels=ys[i], logits=h))
            for variable, grad in zip(variables, tape.gradient(loss, variables), strict=True):
                variable.assign_sub(LEARNING_RATE * grad)
            losses = losses.write(i, loss)
        return losses.stack()

    return lambda: epoch(xs, ys).numpy()


def worker(batch_sizes: list[int], repeats: int, quick: bool) -> dict:
    from kbackend.backend import active_backend
    from kbackend.envinfo import environment

    rows = []
    for batch_size in batch_sizes:
        steps = steps_per_epoch(batch_size, quick)
        dataset = synthetic(batch_size, steps)
        fused = {"native K=1": 1, "native K=32": min(32, steps), "native K=epoch": steps}
        runners = {
            "fit spe=1": fit_runner(dataset, batch_size, 1),
            "fit spe=32": fit_runner(dataset, batch_size, 32),
            **{name: native_runner(dataset, batch_size, k) for name, k in fused.items()},
            "reference": reference_runner(dataset, batch_size, steps),
        }
        for name, figures in measure(runners, steps, batch_size, repeats).items():
            row = {"batch_size": batch_size, "config": name, "steps_per_epoch": steps,
                   "fused_steps": fused.get(name), **figures}
            rows.append(row)
            print(f"[{active_backend()}] batch {batch_size:5d} {name:15s} "
                  f"{row['us_per_step']:10.1f} us/step {row['samples_per_s']:12.0f} samples/s "
                  f"compile {row['compile_s']:.2f}s", file=sys.stderr, flush=True)
    return {"backend": active_backend(), "environment": environment(), "rows": rows}


def markdown(results: list[dict]) -> str:
    lines = ["| backend | batch | config | us/step | samples/s | x fit spe=1 | x reference | compile s |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for result in results:
        by_batch: dict[int, dict[str, dict]] = {}
        for row in result["rows"]:
            by_batch.setdefault(row["batch_size"], {})[row["config"]] = row
        for batch_size, rows in by_batch.items():
            base = rows["fit spe=1"]["samples_per_s"]
            floor = rows["reference"]["samples_per_s"]
            for name, row in rows.items():
                label = name if row["fused_steps"] in (None, 32) or name.endswith("K=1") or \
                    name.endswith("epoch") else f"{name} (K={row['fused_steps']})"
                lines.append(
                    f"| {result['backend']} | {batch_size} | {label} | {row['us_per_step']:.1f} | "
                    f"{row['samples_per_s']:.0f} | {row['samples_per_s'] / base:.2f} | "
                    f"{row['samples_per_s'] / floor:.2f} | {row['compile_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats (CI)")
    parser.add_argument("--out", default="bench_out", help="folder for the JSON and markdown")
    parser.add_argument("--backends", default="jax,tensorflow")
    parser.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)))
    parser.add_argument("--repeats", type=int, default=None, help="timed epochs per config")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    repeats = args.repeats or (2 if args.quick else 5)
    if args.worker:  # inside one backend's subprocess
        result = worker(batch_sizes, repeats, args.quick)
        Path(args.worker).write_text(json.dumps(result), encoding="utf-8")
        return 0

    from kbackend.io import atomic_write_json, atomic_write_text

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for backend in [b for b in args.backends.split(",") if b]:
        with tempfile.TemporaryDirectory() as tmp:
            result_path = Path(tmp) / "result.json"
            command = [sys.executable, __file__, "--worker", str(result_path),
                       "--batch-sizes", args.batch_sizes, "--repeats", str(repeats),
                       *(["--quick"] if args.quick else [])]
            env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
            subprocess.run(command, env=env, check=True)
            results.append(json.loads(result_path.read_text(encoding="utf-8")))
    table = markdown(results)
    atomic_write_json(out / "bench_engines.json", {"benchmark": "engines", "quick": args.quick,
                                                  "repeats": repeats, "results": results})
    atomic_write_text(out / "bench_engines.md", table)
    print(table)
    print(f"wrote {out / 'bench_engines.json'} and {out / 'bench_engines.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
