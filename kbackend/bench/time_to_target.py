"""Time to target, whole processes: a plain Keras script against ``kbackend train --target``.

    python scripts/bench_time_to_target.py [--quick] [--out DIR] [--backends jax,tensorflow]
                                           [--repeats N]

Per backend (each in its own worker process), each side is a whole Python process, timed from
its start to its exit, on the same data and target:

- ``keras_script``: what a Keras user writes: the seed MLP (784-786-256-160-10), Adam 1e-3,
  batch 32, ``fit`` with validation at every epoch end and a callback that stops at the target.
- ``kbackend``: ``kbackend train --target`` with the fastest recipe kbackend knows, taken from
  its own MNIST study (docs/reproductions.md, 3 seeds per cell): the native engine (K fused
  steps per device call, the data on the device), Adam at batch 512 with that cell's best rate,
  2.53e-3: the lowest median time to 0.97 on both backends (165-240 steps; batch 256 and 1,024
  are not separated from it at 3 seeds), validation every 42 steps (``EVAL_EVERY``, the interval
  that minimizes the expected cost of finding the target: see there). K:
  21 on JAX (every call has one length, so the run compiles one train program); 1 on TF, whose
  one-step call is written out while TF's loop made this model's steps ~40% slower here (train
  time with compilation, 168 steps: 5.2-5.3 s at K = 1, 6.5-6.8 s at K = 21; on JAX K = 1 and
  K = 21 are within the runs' spread, docs/engines.md).

Both hold out the same 10% of the training split for validation (kbackend's split, which the
script loads from the file kbackend writes) and stop at the first validation past the target
(0.97 on MNIST; ``--quick``: 0.9 on the embedded digits). The sides alternate within every
repeat (ABAB, BABA, ...) so that load which comes and goes hits both alike. kbackend runs twice
per repeat: ``cold`` with an empty compilation cache and ``warm`` with the one the cold run
filled (JAX's persistent cache and TensorFlow's XLA cache, see README). Each side reports a
breakdown of its own process: imports, data, model build, compilation, training, evaluation.
Every repeat also times two commands a user runs before training, ``kbackend info`` and
``kbackend train --help``, as whole processes.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kbackend.backend_choice import selected_backend
from kbackend.bench.spec import Benchmark, Rows, Settings, median_of
from kbackend.bench.tuner import process_env, timed_process
from kbackend.data import load
from kbackend.errors import DataError
from kbackend.history import History
from kbackend.reports import markdown_table

# How often to validate. Every validation costs E seconds; validating every n steps finds the
# target on average n / 2 steps late, at s seconds a step. Over a run of S steps the expected cost
# S / n * E + n / 2 * s is least at n = sqrt(2 S E / s). Here S ~ 180 (the study's median steps of
# this cell) and E / s ~ 6,000 / (3 x 512) = 3.9 (a validation is a forward pass of the 6,000
# validation samples, a step forward and backward over 512: about three forward passes), so
# n ~ 37; 42, a multiple of JAX's K = 21, lies in the flat of that minimum (measured here: E / s =
# 4.1 on TF, 35 ms against 8.5 ms). Validating every 21 steps cost 8 validations to 0.97, not 4.
EVAL_EVERY = 42
RECIPES = {"jax": {"batch_size": 512, "fused_steps": 21, "eval_every": EVAL_EVERY, "lr": 2.53e-3},
           "tensorflow": {"batch_size": 512, "fused_steps": 1, "eval_every": EVAL_EVERY,
                          "lr": 2.53e-3}}
QUICK_RECIPE = {"batch_size": 64, "fused_steps": 5, "eval_every": 5, "lr": 3e-3}
TIMEOUT_S = 1800.0  # one whole process

# The plain Keras side: only numpy and keras, as a user would write it. It reads the splits
# from an .npz file so that both sides train and validate on the same samples.
KERAS_SCRIPT = r'''
import json, sys, time
start = time.perf_counter()
import numpy as np
import keras
imported = time.perf_counter()
splits, target, lr = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
batch, epochs = int(sys.argv[4]), int(sys.argv[5])
with np.load(splits) as data:
    x, y, x_val, y_val, x_test, y_test = (
        data[k] for k in ("x", "y", "x_val", "y_val", "x_test", "y_test"))
loaded = time.perf_counter()
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input(shape=x.shape[1:]),
                          keras.layers.Dense(786, activation="relu"),
                          keras.layers.Dense(256, activation="relu"),
                          keras.layers.Dense(160, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile(optimizer=keras.optimizers.Adam(lr), loss="sparse_categorical_crossentropy",
              metrics=["accuracy"])
built = time.perf_counter()
reached = {}
class StopAtTarget(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if logs["val_accuracy"] >= target:
            reached.update(epoch=epoch + 1, val_accuracy=float(logs["val_accuracy"]))
            self.model.stop_training = True
history = model.fit(x, y, batch_size=batch, epochs=epochs, validation_data=(x_val, y_val),
                    callbacks=[StopAtTarget()], verbose=0)
fitted = time.perf_counter()
test_loss, test_accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
done = time.perf_counter()
print(json.dumps({"imports_s": imported - start, "data_s": loaded - imported,
                  "build_s": built - loaded, "fit_s": fitted - built,
                  "test_eval_s": done - fitted, "reached": bool(reached),
                  "epochs": len(history.history["loss"]), "test_accuracy": float(test_accuracy)}))
'''


def _problem(quick: bool) -> tuple[str, float, dict[str, Any], int]:
    if quick:
        return "digits", 0.9, QUICK_RECIPE, 20
    os.environ["KBACKEND_OFFLINE"] = "1"  # MNIST from the local files: never time a download
    try:
        load("mnist", layout="flat")
    except DataError:
        raise DataError("bench_time_to_target needs MNIST: put mnist.npz in KBACKEND_DATA_DIR "
                        "(see docs/data.md), or run it with --quick (digits).") from None
    return "mnist", 0.97, RECIPES[selected_backend()], 10


def _write_splits(dataset_name: str, path: Path) -> None:
    data = load(dataset_name, layout="flat")
    np.savez(path, x=data.x_train, y=data.y_train, x_val=data.x_val, y_val=data.y_val,
             x_test=data.x_test, y_test=data.y_test)


def _keras_side(splits: Path, target: float, epochs: int, env: dict[str, str]) -> dict[str, Any]:
    seconds, out = timed_process(
        [sys.executable, "-c", KERAS_SCRIPT, str(splits), str(target), str(1e-3),
         "32", str(epochs)], env, TIMEOUT_S)
    return {"side": "keras_script", "cache": "-", "wall_s": seconds,
            **json.loads(out.splitlines()[-1])}


def _kbackend_side(dataset_name: str, target: float, recipe: dict[str, Any], epochs: int,
                   env: dict[str, str], cache: str, folder: Path) -> dict[str, Any]:
    history_path = folder / f"history-{cache}.json"
    argv = [sys.executable, "-m", "kbackend", "train", "--quiet", "--model", "seed_mlp",
            "--dataset", dataset_name, "--engine", "native", "--optimizer", "adam",
            "--lr", str(recipe["lr"]), "--batch-size", str(recipe["batch_size"]),
            "--fused-steps", str(recipe["fused_steps"]), "--eval-every", str(recipe["eval_every"]),
            "--epochs", str(epochs), "--target", str(target), "--history", str(history_path)]
    seconds, _ = timed_process(argv, env, TIMEOUT_S)
    history = History.load(history_path)
    timing, reached = history.timing, history.record.target_reached
    train_s = timing.get("train_time") or 0.0
    compile_s = timing.get("compile_time") or 0.0
    return {"side": "kbackend", "cache": cache, "wall_s": seconds,
            "compile_s": compile_s, "train_s": train_s - compile_s,
            "eval_s": timing.get("eval_time"), "engine_wall_s": timing.get("wall_time"),
            "reached": reached is not None,
            "steps": (reached or {}).get("step"),
            "test_accuracy": history.test.get("test_accuracy")}


# Commands a user runs before any training: whole processes, timed with the rest.
QUICK_COMMANDS = {"kbackend_info": ["info"], "kbackend_train_help": ["train", "--help"]}


def _command_side(name: str, argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    seconds, _ = timed_process([sys.executable, "-m", "kbackend", *argv], env, TIMEOUT_S)
    return {"side": name, "cache": "-", "wall_s": seconds}


def measure_time_to_target(settings: Settings) -> Rows:
    """Whole-process wall time to the target of both sides, interleaved repeats (see module)."""
    dataset_name, target, recipe, epochs = _problem(settings.quick)
    repeats = settings.rounds(quick=1, full=3)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kbackend-ttt-") as tmp:
        folder = Path(tmp)
        splits = folder / "splits.npz"
        _write_splits(dataset_name, splits)
        base_env = process_env("keras, kbackend.cli, kbackend.training",
                               KBACKEND_COMPILE_CACHE="1")
        # "cold": a repeat's cache folder starts empty; "warm": the cold run filled it (the same
        # code path, left out of the quick smoke run).
        caches = ("cold",) if settings.quick else ("cold", "warm")
        # the Keras script, kbackend's runs and the commands (every other repeat reversed)
        sides: list[Callable[[dict[str, str]], list[dict[str, Any]]]] = [
            lambda env: [_keras_side(splits, target, epochs, env)],
            lambda env: [_kbackend_side(dataset_name, target, recipe, epochs, env, cache, folder)
                         for cache in caches],
            lambda env: [_command_side(name, argv, env) for name, argv in QUICK_COMMANDS.items()]]
        for repeat in range(repeats):
            cache_dir = folder / f"cache-{repeat}"
            env = {**base_env, "KBACKEND_CACHE_DIR": str(cache_dir)}
            for side in sides if repeat % 2 == 0 else sides[::-1]:
                rows += [{"repeat": repeat, **row} for row in side(env)]
            shutil.rmtree(cache_dir, ignore_errors=True)
    return rows, _summary(rows, dataset_name, target, recipe)


def _summary(rows: list[dict[str, Any]], dataset_name: str, target: float,
             recipe: dict[str, Any]) -> dict[str, Any]:
    script = median_of(rows, side="keras_script", cache="-")
    summary: dict[str, Any] = {"dataset": dataset_name, "target": target, "recipe": recipe,
                               "keras_script_wall_s": script}
    for cache in ("cold", "warm"):
        ours = median_of(rows, side="kbackend", cache=cache)
        summary[f"kbackend_{cache}_wall_s"] = ours
        summary[f"ratio_{cache}"] = ours / script if ours and script else None
    for name in QUICK_COMMANDS:
        summary[f"{name}_wall_s"] = median_of(rows, side=name, cache="-")
    spread = [r["wall_s"] for r in rows if r["side"] == "keras_script"]
    summary["keras_script_spread"] = max(spread) / min(spread) if spread else None
    return summary


BREAKDOWN = ("wall_s", "imports_s", "data_s", "build_s", "fit_s", "test_eval_s", "compile_s",
             "train_s", "eval_s", "engine_wall_s", "test_accuracy")


def time_to_target_table(payload: dict[str, Any]) -> str:
    """Per backend: each side's median wall time and breakdown, and the kbackend / script ratios."""
    lines = ["Medians over interleaved repeats; every side is a whole process (interpreter start "
             "to exit). Keras script: imports, data, build (with compile), fit (training and "
             "epoch-end validation), test evaluation. kbackend: compile, train (without "
             "compile), eval (validation), engine wall (the engine's whole call).", ""]
    for summary in payload["summaries"]:
        backend = summary["backend"]
        rows = [r for r in payload["rows"] if r.get("backend") == backend]
        lines.append(f"{backend}: {summary.get('dataset')} to val_accuracy "
                     f"{summary.get('target')}, kbackend recipe {summary.get('recipe')}")
        lines.append("")
        table = []
        for side, cache in (("keras_script", "-"), ("kbackend", "cold"), ("kbackend", "warm")):
            ours = [r for r in rows if r["side"] == side and r["cache"] == cache]
            if ours:
                table.append({"side": side, "compile cache": cache, "runs": len(ours),
                              "reached": sum(bool(r.get("reached")) for r in ours),
                              **{k: median_of(rows, k, side=side, cache=cache) for k in BREAKDOWN}})
        lines.append(markdown_table(table,
                                    ["side", "compile cache", "runs", "reached", *BREAKDOWN]))
        for cache in ("cold", "warm"):
            ratio = summary.get(f"ratio_{cache}")
            if ratio is not None:
                lines.append(f"- kbackend ({cache} compile cache) / plain Keras script, median "
                             f"wall time: {ratio:.2f}")
        for name, argv in QUICK_COMMANDS.items():
            seconds = summary.get(f"{name}_wall_s")
            if seconds is not None:
                lines.append(f"- `kbackend {' '.join(argv)}`, median wall time: {seconds:.2f} s")
        lines.append("")
    return "\n".join(lines)


BENCHMARKS = (
    Benchmark("bench_time_to_target", "Whole processes from start to the validation target: a "
              "plain Keras script vs kbackend train --target (cold and warm compile cache).",
              measure_time_to_target, keys=("side", "cache", "repeat"),
              values=("wall_s",), summary_fields=("ratio_cold", "ratio_warm"),
              table=time_to_target_table,
              note="medians over interleaved repeats; each side is a whole process"),
)
