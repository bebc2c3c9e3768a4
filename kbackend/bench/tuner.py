"""Against Keras Tuner (issue 43, item 6): the same 18 cells searched by the tool a Keras user
would pick and by ``kbackend study``, whole processes, interleaved.

    python scripts/bench_tuner.py [--quick] [--out DIR] [--backends jax,tensorflow]
        [--repeats N] [--seeds 3] [--target 0.85] [--max-epochs 10]

The workload is a user's: examples/models.py's ``conv1d_classifier`` (Conv1D + BatchNorm
blocks, global average pooling, logits) on examples/make_data.py's ``sequences.npz``, written
into a temporary folder and split once (a seeded 10% of the training split held out for
validation) into one ``.npz`` with ``x_train``/``x_val``/``x_test`` that both tools read, so
both train and validate on the same samples. The cells: ``OPTIMIZERS`` x ``RATES`` (three per
optimizer, the study's centre rate at batch 32 and a factor sqrt(10) either side) x
``BATCH_SIZES``: 2 x 3 x 3 = 18, a budget of ``--max-epochs`` epochs per run, the target
val_accuracy ``--target``.

- ``keras_tuner``: what a Keras user writes (``TUNER_SCRIPT``: numpy, keras, keras_tuner): a
  ``keras_tuner.HyperModel`` whose ``build`` compiles the builder's model with the trial's
  optimizer and rate and whose ``fit`` picks the batch size from the hyperparameters, a
  callback that stops at the target at an epoch's end (``fit`` validates once an epoch), one
  seed per trial, ``GridSearch`` over the 18 cells, objective the trial's wall time to the
  target (a trial that never reaches it ranks after every one that does), in a fresh directory
  with ``overwrite=True``. Its pick: the best trial's cell.
- ``kbackend``: ``kbackend study`` with the same cells (``--lrs`` per optimizer,
  ``--lr-extend 0``), target, epoch budget and split, ``--seeds S --max-seeds S
  --frontier-epochs 0`` and every other option at its default: the time model, the noise scale
  and the confirmation of the recommended command on 3 held-out seeds included. Its pick: the
  Recommended cell (``summary.json``). Each repeat in a fresh ``--out``.

Why whole processes through the command line, not ``kbackend.study(...)`` beside
``tuner.search(...)`` in one process: a second search in a process that already ran one reuses
what the first compiled and imported (Keras's traced functions, kbackend's per-optimizer
programs), and a study in the process of a tuner search would find JAX or TensorFlow warm.
A fresh process per side and repeat starts both from the same place: what a user waits for
from typing the command to its answer. Each side's process gets an empty ``KBACKEND_CACHE_DIR``
(kbackend's persistent compilation cache and stored machine measurements start empty: nothing
of an earlier repeat is reused; Keras Tuner has no such cache), bytecode is written once
before the first repeat for both. The sides alternate which goes first, repeat by repeat.
Reported: each side's wall per repeat, medians, and kbackend / Keras Tuner as the geometric
mean of the paired per-repeat ratios with its t-interval (``verdicts.mean_interval`` on the
log ratios, 95%); each side's own split of its time (Keras Tuner: imports and ``search``;
kbackend: the study's ``time_spent``) and the cell each picked.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kbackend.bench.spec import (
    Benchmark,
    Option,
    Rows,
    Settings,
    geometric_interval,
    median_of,
    say,
)
from kbackend.bench.user_model import EXAMPLES, make_sequences
from kbackend.reports import format_value, markdown_rows
from kbackend.runtime.child import ChildFailed

OPTIMIZERS = ("sgd", "adam")
# The study's centre rate at batch 32 (kbackend.study.config.CENTRE_LR) and sqrt(10) either side.
RATES = {"sgd": (0.0632, 0.2, 0.632), "adam": (0.000632, 0.002, 0.00632)}
BATCH_SIZES = (32, 64, 128)
TARGET = 0.85  # docs/your-model.md's target for this workload
MAX_EPOCHS = 10
SEEDS = 3
VALIDATION_FRACTION = 0.1
LEVEL = 0.95
# --quick: a smoke run of every part, two cells on a small split
QUICK: dict[str, Any] = {"rates": {"sgd": (0.2,), "adam": (0.002,)}, "batch_sizes": (64,),
                         "target": 0.5, "max_epochs": 2, "seeds": 2, "n_train": 640,
                         "n_val": 160}
TIMEOUT_S = 3600.0
NOT_INSTALLED = "keras_tuner is not installed (pip install 'kbackend[bench]')"

# The Keras Tuner side, as a user writes it: numpy, keras and keras_tuner only. argv: the
# splits file, the builder file, a JSON of the grid, the tuner's directory.
TUNER_SCRIPT = r'''
import importlib.util, json, sys, time
start = time.perf_counter()
import numpy as np
import keras
import keras_tuner
imported = time.perf_counter()
splits, builder_file, grid, folder = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
spec = importlib.util.spec_from_file_location("user_models", builder_file)
models = importlib.util.module_from_spec(spec)
spec.loader.exec_module(models)
with np.load(splits) as data:
    x, y, x_val, y_val = (data[k] for k in ("x_train", "y_train", "x_val", "y_val"))
classes = int(max(y.max(), y_val.max())) + 1
target, seed = grid["target"], grid["seed"]
OPTIMIZERS = {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam}

class StopAtTarget(keras.callbacks.Callback):
    """Stops at the first epoch whose validation accuracy reaches the target."""
    def __init__(self):
        super().__init__()
        self.wall, self.epochs, self.best = None, 0, 0.0
    def on_train_begin(self, logs=None):
        self.start = time.perf_counter()
    def on_epoch_end(self, epoch, logs=None):
        self.epochs, self.best = epoch + 1, max(self.best, float(logs["val_accuracy"]))
        if logs["val_accuracy"] >= target:
            self.wall = time.perf_counter() - self.start
            self.model.stop_training = True

class Cells(keras_tuner.HyperModel):
    def build(self, hp):
        name = hp.Choice("optimizer", list(grid["rates"]))
        rate = grid["rates"][name][hp.Choice("rate", list(range(len(grid["rates"][name]))))]
        keras.utils.set_random_seed(seed)  # one seed per trial
        model = models.conv1d_classifier(x.shape[1:], classes)
        model.compile(optimizer=OPTIMIZERS[name](rate), loss=model.loss, metrics=["accuracy"])
        return model
    def fit(self, hp, model, *args, callbacks=(), **kwargs):
        stop = StopAtTarget()
        model.fit(*args, batch_size=hp.Choice("batch_size", grid["batch_sizes"]),
                  callbacks=[*callbacks, stop], **kwargs)
        # never reaching ranks after reaching; among those, the better accuracy first
        wall = stop.wall if stop.wall is not None else 1e6 * (2.0 - stop.best)
        return {"wall_to_target": wall, "best_val_accuracy": stop.best,
                "epochs": float(stop.epochs)}

cells = len(grid["rates"]["sgd"]) * len(grid["rates"]) * len(grid["batch_sizes"])
tuner = keras_tuner.GridSearch(Cells(), objective=keras_tuner.Objective("wall_to_target", "min"),
                               max_trials=cells, directory=folder, project_name="tuner",
                               overwrite=True, seed=seed)
searched = time.perf_counter()
tuner.search(x, y, validation_data=(x_val, y_val), epochs=grid["max_epochs"], verbose=0)
done = time.perf_counter()
best = tuner.get_best_hyperparameters(1)[0].values
trials = []
for trial in tuner.oracle.trials.values():
    hp = trial.hyperparameters.values
    metrics = {k: trial.metrics.get_last_value(k) for k in ("wall_to_target", "epochs")}
    trials.append({"optimizer": hp["optimizer"], "rate": hp["rate"],
                   "batch_size": hp["batch_size"], **metrics})
print(json.dumps({"imports_s": imported - start, "before_search_s": searched - imported,
                  "search_s": done - searched, "trials": len(trials), "trial_results": trials,
                  "reached": sum(1 for t in trials if (t["wall_to_target"] or 1e9) < 1e6),
                  "pick": {"optimizer": best["optimizer"], "batch_size": best["batch_size"],
                           "learning_rate": grid["rates"][best["optimizer"]][best["rate"]]}}))
'''


def tuner_available() -> bool:
    """Whether ``keras_tuner`` is installed (the optional extra ``kbackend[bench]``)."""
    return importlib.util.find_spec("keras_tuner") is not None


def grid(settings: Settings) -> dict[str, Any]:
    """The cells, target and budget both sides search (``--quick``: two cells, a small split)."""
    defaults: dict[str, Any] = QUICK if settings.quick else {
        "rates": RATES, "batch_sizes": BATCH_SIZES, "target": TARGET, "max_epochs": MAX_EPOCHS,
        "seeds": SEEDS}
    return {"rates": {o: list(rates) for o, rates in defaults["rates"].items()},
            "batch_sizes": list(defaults["batch_sizes"]),
            **{key: settings.options.get(key) or defaults[key]
               for key in ("target", "max_epochs", "seeds")},
            "seed": 0}


def write_splits(folder: Path, quick: bool) -> Path:
    """examples/make_data.py's sequences, split once (seeded) into the ``.npz`` both sides read."""
    with np.load(make_sequences(folder)) as data:
        x, y, x_test, y_test = (data[k] for k in ("x_train", "y_train", "x_test", "y_test"))
    order = np.random.default_rng(0).permutation(len(x))
    n_val = round(VALIDATION_FRACTION * len(x))
    val, train = order[:n_val], order[n_val:]
    if quick:
        train, val = train[:QUICK["n_train"]], val[:QUICK["n_val"]]
    path = folder / "splits.npz"
    np.savez(path, x_train=x[train], y_train=y[train], x_val=x[val], y_val=y[val],
             x_test=x_test, y_test=y_test)
    return path


# The kbackend side: ``python -m kbackend study ...`` (``cli.entrypoint``), with the confirmation's
# ``train`` runs timed (the study's ``time_spent`` counts them under "other"): the one addition,
# a clock around ``recommend.run_train``.
STUDY_SCRIPT = r'''
import sys, time
import kbackend.study.recommend as recommend
from kbackend import cli
run_train, spent = recommend.run_train, [0.0]
def timed_run_train(*args, **kwargs):
    start = time.perf_counter()
    try:
        return run_train(*args, **kwargs)
    finally:
        spent[0] += time.perf_counter() - start
recommend.run_train = timed_run_train
code = cli.main(sys.argv[1:], own_process=True)
print(f"bench_tuner confirmation_s={spent[0]!r}", flush=True)
cli._exit_now(code)
'''
CONFIRMATION_S = re.compile(r"^bench_tuner confirmation_s=([0-9.eE+-]+)$", re.M)


def study_argv(splits: Path, cells: dict[str, Any], out: Path, quick: bool) -> list[str]:
    """The ``kbackend study`` command of the kbackend side."""
    n_train = int(np.load(splits)["y_train"].shape[0])
    steps = cells["max_epochs"] * math.ceil(n_train / min(cells["batch_sizes"]))
    argv = [sys.executable, "-c", STUDY_SCRIPT, "study", "--no-progress",
            "--model", f"{EXAMPLES / 'models.py'}:conv1d_classifier", "--data", str(splits),
            "--optimizers", ",".join(cells["rates"]),
            "--batch-sizes", ",".join(map(str, cells["batch_sizes"])),
            *[f"--lrs={o}={','.join(map(str, rates))}" for o, rates in cells["rates"].items()],
            "--lr-extend", "0", "--target", str(cells["target"]),
            "--target-metric", "val_accuracy", "--max-epochs", str(cells["max_epochs"]),
            "--max-steps", str(steps), "--seeds", str(cells["seeds"]),
            "--max-seeds", str(cells["seeds"]), "--frontier-epochs", "0", "--out", str(out)]
    if quick:  # a smoke run: the confirmation and the time model with the fewest runs
        argv += ["--confirm-seeds", "1", "--step-time-repeats", "1", "--noise-points", "0"]
    return argv


def process_env(imports: str, **extra: str) -> dict[str, str]:
    """The whole-process sides' environment (offline, ``extra`` added) with bytecode on, as on a
    user's machine (with PYTHONDONTWRITEBYTECODE, as on this project's machines, every process
    compiled Keras and the backends from source again), that of ``imports`` written, untimed."""
    env = {**os.environ, "KBACKEND_OFFLINE": "1", "TF_CPP_MIN_LOG_LEVEL": "2", **extra,
           "PYTHONDONTWRITEBYTECODE": ""}
    subprocess.run([sys.executable, "-c", f"import {imports}"], env=env, capture_output=True,
                   timeout=600, check=False)
    return env


def timed_process(argv: list[str], env: dict[str, str],
                  timeout_s: float = TIMEOUT_S) -> tuple[float, str]:
    """Wall seconds of a whole process and its stdout; a failure raises with its last line."""
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout_s,
                          check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        what = "-c SCRIPT" if argv[1] == "-c" else " ".join(argv[1:4])  # a script: one line
        raise ChildFailed(f"{what} failed with exit {done.returncode}: {tail}")
    return seconds, done.stdout


def tuner_side(splits: Path, cells: dict[str, Any], folder: Path,
               env: dict[str, str]) -> dict[str, Any]:
    """One Keras Tuner search, a whole process."""
    seconds, out = timed_process(
        [sys.executable, "-c", TUNER_SCRIPT, str(splits), str(EXAMPLES / "models.py"),
         json.dumps(cells), str(folder)], env)
    return {"side": "keras_tuner", "wall_s": seconds, **json.loads(out.splitlines()[-1])}


RECOMMENDED = re.compile(r"^Recommended:\s+(\w+)\s+at\s+batch\s+(\d+),\s+lr\s+([0-9.eE+-]+)",
                         re.M)
# the confirmation line (the console may wrap it)
# what a goal judged on the ratio's estimate alone adds
UNRESOLVED = " by the estimate, not resolved (the interval includes 1.0)"
CONFIRMED = re.compile(r"reached\s+on\s+(\d+)\s+of\s+(\d+)\)|on\s+(\d+)\s+held-out\s+seeds:"
                       r"\s+the\s+target\s+was\s+not\s+reached")


def recommended(stdout: str) -> dict[str, Any]:
    """The study's Recommended cell and how many held-out seeds its command reached the target
    on, from what it printed (what the user reads)."""
    found = RECOMMENDED.search(stdout)
    if found is None:
        return {"pick": None, "confirmed_on": None}
    confirmed = CONFIRMED.search(stdout, found.end())
    return {"pick": {"optimizer": found[1], "batch_size": int(found[2]),
                     "learning_rate": float(found[3])},
            "confirmed_on": None if confirmed is None
            else f"{confirmed[1] or 0} of {confirmed[2] or confirmed[3]}"}


def kbackend_side(splits: Path, cells: dict[str, Any], out: Path, env: dict[str, str],
                  quick: bool) -> dict[str, Any]:
    """One ``kbackend study``, a whole process: its pick from what it printed, its own time
    accounting (``time_spent``) from ``summary.json``."""
    seconds, stdout = timed_process(study_argv(splits, cells, out, quick), env)
    (summary_path,) = out.glob("*/summary.json")
    spent = json.loads(summary_path.read_text()).get("time_spent") or {}
    confirmation = CONFIRMATION_S.search(stdout)
    return {"side": "kbackend", "wall_s": seconds, **recommended(stdout),
            "runs_trained": spent.get("runs_trained"),
            "confirmation_s": float(confirmation[1]) if confirmation else None,
            "time_spent": {k: v for k, v in spent.items() if k.endswith("_s")}}


def measure_tuner(settings: Settings) -> Rows:
    """Both sides on the same cells, whole processes, interleaved repeats (see the module)."""
    if not tuner_available():
        print(f"bench_tuner: {NOT_INSTALLED}; skipped.", file=sys.stderr)
        return ([{"side": "keras_tuner", "repeat": None, "note": NOT_INSTALLED}],
                {"skipped": NOT_INSTALLED})
    cells = grid(settings)
    repeats = settings.rounds(quick=1, full=3)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kbackend-bench-tuner-") as tmp:
        folder = Path(tmp)
        splits = write_splits(folder, settings.quick)
        base_env = process_env("keras, keras_tuner, kbackend.cli, kbackend.study.pipeline")
        for repeat in range(repeats):
            order = ("kbackend", "keras_tuner") if repeat % 2 == 0 else ("keras_tuner", "kbackend")
            for side in order:
                env = {**base_env, "KBACKEND_CACHE_DIR": str(folder / f"cache-{side}-{repeat}")}
                where = folder / f"{side}-{repeat}"
                row = (kbackend_side(splits, cells, where, env, settings.quick)
                       if side == "kbackend" else tuner_side(splits, cells, where, env))
                rows.append({"repeat": repeat, "first": order[0], **row})
                say(f"repeat {repeat} {side}: {row['wall_s']:.1f} s, pick {row['pick']}")
    return rows, tuner_summary(rows, cells, repeats)


def ratio_interval(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """kbackend / Keras Tuner: the geometric mean of the paired per-repeat ratios with its
    t-interval at ``LEVEL`` (unbounded with one repeat)."""
    walls: dict[int, dict[str, float]] = {}
    for row in rows:
        walls.setdefault(row["repeat"], {})[row["side"]] = row["wall_s"]
    logs = [math.log(w["kbackend"] / w["keras_tuner"]) for w in walls.values()
            if "kbackend" in w and "keras_tuner" in w]
    ratio, low, high = geometric_interval(logs, LEVEL) if logs else (None, None, None)
    return {"ratio": ratio, "low": low, "high": high, "pairs": len(logs), "level": LEVEL}


def tuner_summary(rows: list[dict[str, Any]], cells: dict[str, Any],
                  repeats: int) -> dict[str, Any]:
    """Medians, the paired ratio with its interval, whether the goal is met and the picks."""
    ratio = ratio_interval(rows)
    picks = {side: [r["pick"] for r in rows if r["side"] == side]
             for side in ("kbackend", "keras_tuner")}
    spent = [{**r["time_spent"], "confirmation_s": r.get("confirmation_s")}
             for r in rows if r["side"] == "kbackend" and r.get("time_spent")]
    return {"cells": cells, "n_cells": len(cells["batch_sizes"]) * sum(
                len(r) for r in cells["rates"].values()),
            "repeats": repeats, "kbackend_wall_s": median_of(rows, side="kbackend"),
            "keras_tuner_wall_s": median_of(rows, side="keras_tuner"), "ratio": ratio,
            # the goal: kbackend (3 seeds, confirmation included) at most 1.0x the tuner
            "goal_met": ratio["ratio"] is not None and ratio["ratio"] <= 1.0,
            "goal_resolved": ratio["high"] is not None and (ratio["high"] <= 1.0
                                                            or ratio["low"] > 1.0),
            "picks": picks,
            "same_pick": bool(picks["kbackend"]) and all(
                _same(a, b) for a, b in zip(picks["kbackend"], picks["keras_tuner"], strict=False)),
            "kbackend_time_spent_median": {
                k: median for k in (spent[0] if spent else {})
                if (median := median_of(spent, k)) is not None},
            "load": os.getloadavg()}


def _same(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    if a is None or b is None:
        return False
    return (a["optimizer"], a["batch_size"]) == (b["optimizer"], b["batch_size"]) and \
        math.isclose(a["learning_rate"], b["learning_rate"], rel_tol=1e-3)


def _pick(pick: dict[str, Any] | None) -> str:
    return "none" if not pick else (f"{pick['optimizer']} b{pick['batch_size']} "
                                    f"lr {pick['learning_rate']:g}")


SPENT = ("steady_training_s", "startup_s", "evaluation_s", "around_runs_s", "time_model_s",
         "noise_scale_s", "other_s", "confirmation_s")


def tuner_table(payload: dict[str, Any]) -> str:
    """Per backend: the repeats side by side, then the medians, the ratio and the picks."""
    out = []
    for summary in payload["summaries"]:
        backend = summary["backend"]
        if summary.get("skipped"):
            out.append(f"{backend}: skipped ({summary['skipped']})")
            continue
        rows = [r for r in payload["rows"] if r.get("backend") == backend]
        by_repeat: dict[int, dict[str, Any]] = {}
        for row in rows:
            by_repeat.setdefault(row["repeat"], {"first": row["first"]})[row["side"]] = row
        ratio = summary["ratio"]
        interval = ("unbounded (one repeat)" if ratio["high"] is None
                    else f"[{ratio['low']:.2f}, {ratio['high']:.2f}]")
        out.append(f"{backend}: {summary['n_cells']} cells, target val_accuracy "
                   f"{summary['cells']['target']}, <= {summary['cells']['max_epochs']} epochs; "
                   f"kbackend --seeds {summary['cells']['seeds']} (confirmation included), "
                   "Keras Tuner one seed per trial\n\n" + markdown_rows(
                       ["repeat", "first", "kbackend s", "Keras Tuner s", "ratio",
                        "kbackend pick (confirmed on)", "Keras Tuner pick (reached)"],
                       ([str(n), r["first"], f"{r['kbackend']['wall_s']:.1f}",
                         f"{r['keras_tuner']['wall_s']:.1f}",
                         f"{r['kbackend']['wall_s'] / r['keras_tuner']['wall_s']:.2f}",
                         f"{_pick(r['kbackend']['pick'])} ({r['kbackend']['confirmed_on']})",
                         f"{_pick(r['keras_tuner']['pick'])} ({r['keras_tuner']['reached']} of "
                         f"{r['keras_tuner']['trials']} trials)"]
                        for n, r in sorted(by_repeat.items())
                        if "kbackend" in r and "keras_tuner" in r)))
        out.append(f"- median wall: kbackend {format_value(summary['kbackend_wall_s'])} s, "
                   f"Keras Tuner {format_value(summary['keras_tuner_wall_s'])} s\n"
                   f"- kbackend / Keras Tuner (geometric mean of paired ratios, "
                   f"{ratio['level']:.0%} t-interval over {ratio['pairs']} repeats): "
                   f"{format_value(ratio['ratio'])} {interval}; goal <= 1.0x "
                   f"{'met' if summary['goal_met'] else 'not met'}"
                   f"{'' if summary['goal_resolved'] else UNRESOLVED}\n"
                   f"- same pick in every repeat: {format_value(summary['same_pick'])}\n"
                   "- kbackend's own time accounting (median s; other includes the "
                   "confirmation, shown apart): " + ", ".join(
                       f"{k[:-2].replace('_', ' ')} {summary['kbackend_time_spent_median'][k]:.1f}"
                       for k in ("whole_process_s", *SPENT)
                       if k in summary["kbackend_time_spent_median"]))
    return "\n\n".join(out) + "\n"


BENCHMARKS = (
    Benchmark("bench_tuner", "Against Keras Tuner (issue 43): the same 18 cells (2 optimizers x "
              "3 rates x 3 batch sizes) of a user's Conv1D + BatchNorm classifier searched by "
              "Keras Tuner (one seed per trial, a callback stopping at the target) and by "
              "kbackend study (--seeds 3, confirmation included), whole processes, interleaved.",
              measure_tuner, keys=("side", "repeat"), values=("wall_s",),
              summary_fields=("kbackend_wall_s", "keras_tuner_wall_s", "goal_met", "same_pick"),
              options=(Option("--seeds", f"kbackend's seeds per rate, also its --max-seeds "
                              f"(default {SEEDS}; --quick: {QUICK['seeds']})", int),
                       Option("--target", f"val_accuracy target (default {TARGET}; --quick: "
                              f"{QUICK['target']})", float),
                       Option("--max-epochs", f"epochs per run at most (default {MAX_EPOCHS}; "
                              f"--quick: {QUICK['max_epochs']})", int)),
              table=tuner_table,
              note="whole processes, interleaved; ratio: geometric mean of paired per-repeat "
                   "ratios with a 95% t-interval"),
)
