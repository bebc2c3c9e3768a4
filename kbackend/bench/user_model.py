"""User models benchmark (issue 34, "No slower path for user models"): a user's builder against
the built-in model it copies, and a user's Conv1D + BatchNorm model against a hand-written loop.

    python scripts/bench_user_model.py [--quick] [--out DIR] [--backends jax,tensorflow]
        [--parts twin,conv] [--seeds 3] [--max-steps 8000] [--repeats N]

Each backend runs in its own worker process. Two parts:

**twin**: ``mlp_twin`` (``TWIN_SOURCE``), the built-in ``mlp`` (inputs-256-128-classes: Dense
and a ReLU ``Activation`` twice, Dense and a float32 softmax ``Activation``, Keras's default
Glorot-uniform kernels and zero biases, as kbackend/models.py builds it) written as a user's
builder file, compiled with sparse categorical cross-entropy and accuracy, and given as
``FILE.py:mlp_twin`` to ``prepare_workload``; against ``--model mlp``. Both train on
``mnist1d_large``: the same arrays (the built-in split passed to the twin as a dict of splits,
checked equal) with the native engine.

- *step*: steady us/step of whole native epochs (``epoch_runner``, K = the study's fused steps,
  its evaluation interval of ~1/6 epoch), Adam at the study's centre rate, at batch 32 and 256;
  both sides timed one epoch each per round, interleaved, after a compiling epoch. Reported:
  medians, spread (slowest / fastest round) and twin / built-in (goal: within 10%).
- *steps to target*: steps to val_accuracy 0.65 (the study's target for mnist1d_large), Adam at
  the study's centre rate (2e-3 at batch 32, times sqrt(batch / 32)), evaluated every K steps,
  at most ``--max-steps`` (8,000), over ``--seeds`` seeds, on the study's own path
  (``engines.native.Runs`` on the model as the study builds it; the sides alternate seed by
  seed); per side the median with its [min, max] over the seeds
  (``kbackend.stats.median_interval``) and the median train time. The intervals must overlap.
  Whether seed s gives both sides the same initial weights is reported too (it does: the same
  layers draw the same numbers, so the runs are the same runs).

**conv**: examples/models.py's ``conv1d_classifier`` (Conv1D(32, 5) + BatchNorm + ReLU +
MaxPool(2), the same with 64 filters, global average pooling, Dense logits) on
examples/make_data.py's ``sequences.npz`` (written into a temporary folder; 4,500 training
sequences after the validation split is held out), plain SGD at ``CONV_LR``: the native engine
(``epoch_runner`` with the model's compiled task) against ``impl().reference_conv1d_loop``
(the same network written by hand, from the same initial values:
kbackend/backends/<backend>/reference.py), at batch 64 and 256, one epoch each per round,
interleaved; medians, spread and native / reference (goal: within 1.1x). On a CPU the native
engine writes a conv model's steps out (``capabilities.unrolls_its_loop``: XLA:CPU runs a
convolution inside a loop far slower) in calls of ``MAX_UNROLLED_STEPS`` (8); the reference
makes the same choice (calls of 8 steps, written out). Elsewhere both run an epoch as one loop.
Every model an epoch runner trains (here and in *step*) is compiled with the run's optimizer
first (``compile_model``, as ``kbackend train`` does): TF's native loop trains with a compiled
model's own optimizer.
The native engine gathers each step's batch on the device from the epoch's shuffled indices;
the reference takes the first epoch's batches pre-stacked, as the engines benchmark's does.

``--quick``: twin with 1 seed at batch 256 and at most 64 steps, 2 rounds; conv at batch 64 on
4 steps of data in calls of 2, 1 round: a smoke run, not the figures.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from kbackend.backends import capabilities, impl
from kbackend.bench.engines import measure
from kbackend.bench.spec import Benchmark, Option, Rows, Settings, positive_int, say, subset_of
from kbackend.config import Target, TrainConfig
from kbackend.data.batching import epoch_batches, epochs_for_steps, steps_per_epoch
from kbackend.engines.keras_fit import compile_model
from kbackend.engines.native import Runs, epoch_runner, model_values
from kbackend.errors import ConfigError
from kbackend.models import ModelOptions, build_model
from kbackend.optim import OptimizerSpec
from kbackend.reports import format_value, markdown_rows
from kbackend.stats import median_interval
from kbackend.study.config import StudyConfig
from kbackend.study.executor import StudyRunner
from kbackend.task import CLASSIFICATION, Task
from kbackend.training import workload_of
from kbackend.workload import prepare_workload

PARTS = ("twin", "conv")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"  # a checkout's examples/ folder

TWIN_DATASET = "mnist1d_large"
TWIN_BATCH_SIZES = (32, 256)
TWIN_TARGET = Target("val_accuracy", 0.65)  # the study's target for mnist1d_large
SEEDS = 3
MAX_STEPS = 8000
QUICK_MAX_STEPS = 64
TWIN_SOURCE = '''"""The built-in mlp (kbackend/models.py), written as a user would."""
import keras


def mlp_twin(input_shape, num_classes):
    inputs = keras.Input(shape=input_shape, name="inputs")
    x = inputs
    for width in (256, 128):
        x = keras.layers.Dense(width)(x)
        x = keras.layers.Activation("relu")(x)
    x = keras.layers.Dense(num_classes)(x)
    outputs = keras.layers.Activation("softmax", dtype="float32", name="probabilities")(x)
    model = keras.Model(inputs, outputs, name="mlp_twin")
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model
'''

CONV_BATCH_SIZES = (64, 256)
CONV_LR = 0.05
QUICK_CONV_STEPS, QUICK_CONV_K = 4, 2


def study_plan(dataset: Any, batch_size: int) -> Any:
    """The default study's plan of an Adam run of the mlp at ``batch_size`` on ``dataset``
    (``StudyRunner.plan``): its centre learning rate (first of the grid), its evaluation
    interval and its K (the same: a call ends at each evaluation)."""
    config = StudyConfig(model="mlp", dataset=TWIN_DATASET, engine="native")
    runner = StudyRunner(config, None)
    runner.dataset = dataset  # what ``prepare`` loads: the plan reads its size
    return runner.plan("adam", batch_size, config.learning_rate_grid("adam", batch_size)[0])


class Tracked:
    """An epoch runner whose mean loss per epoch is kept (``losses``); ``compile_time`` is the
    runner's own where it has one (``bench.engines.measure`` reads it)."""

    def __init__(self, run: Callable[[], Any]) -> None:
        self.run = run
        self.losses: list[float] = []

    def __call__(self) -> None:
        self.losses.append(float(np.mean(self.run())))

    @property
    def compile_time(self) -> float:
        return self.run.compile_time  # type: ignore[attr-defined]  # absent: AttributeError


def native_runner(model: Any, dataset: Any, spec: OptimizerSpec, batch_size: int, fused: int,
                  task: Task) -> Tracked:
    """Whole native epochs of ``model`` compiled as ``kbackend train`` compiles it (``spec``'s
    optimizer, ``task``'s loss: on TF the native loop trains with the model's optimizer)."""
    compile_model(model, spec, TrainConfig(task=task))
    return Tracked(epoch_runner(model, dataset, spec, batch_size, fused, seed=0, task=task))


# -- part 1: the twin of the built-in mlp ------------------------------------------------------

def twin_workload(folder: Path, dataset: Any) -> Any:
    """The twin's workload: ``TWIN_SOURCE`` as a builder file, on ``dataset``'s splits."""
    path = folder / "twin_model.py"
    path.write_text(TWIN_SOURCE)
    splits = {name: dataset.split(name) for name in ("train", "val", "test")}
    return prepare_workload(f"{path}:mlp_twin", x=splits)


def same_data(a: Any, b: Any) -> bool:
    return all(np.array_equal(x, y) for name in ("train", "val", "test")
               for x, y in zip(a.split(name), b.split(name), strict=True))


def twin_step_rows(dataset: Any, workload: Any, batch_sizes: list[int],
                   repeats: int) -> list[dict[str, Any]]:
    """Steady us/step of both sides' native epochs, interleaved (one row per batch size)."""
    rows = []
    for batch in batch_sizes:
        per_epoch = steps_per_epoch(len(dataset.x_train), batch)
        plan = study_plan(dataset, batch)
        fused, spec = plan.fused_steps, OptimizerSpec("adam", plan.learning_rate)
        runners = {
            "built-in": native_runner(build_model("mlp", dataset.info, ModelOptions(seed=0)),
                                      dataset, spec, batch, fused, CLASSIFICATION),
            "twin": native_runner(workload.build(0), workload.dataset, spec, batch, fused,
                                  workload.task)}
        figures = measure(runners, per_epoch, batch, repeats)
        base, twin = figures["built-in"], figures["twin"]
        row = {"part": "twin step", "batch_size": batch, "fused_steps": fused,
               "steps_per_epoch": per_epoch, "learning_rate": spec.learning_rate,
               "ratio": twin["us_per_step"] / base["us_per_step"],
               **{f"{side}_{key}": figures[name][key]
                  for side, name in (("builtin", "built-in"), ("twin", "twin"))
                  for key in ("us_per_step", "spread", "compile_s", "epoch_s")}}
        row["within_goal"] = abs(row["ratio"] - 1.0) <= 0.10
        rows.append(row)
        say(f"twin step batch {batch:4d} K={fused:3d}: built-in "
            f"{row['builtin_us_per_step']:8.1f} us, twin {row['twin_us_per_step']:8.1f} us, "
            f"x{row['ratio']:.3f}")
    return rows


def run_to_target(runs: Runs, values: Any, task: Task, dataset: Any, plan: Any, seed: int,
                  max_steps: int) -> tuple[int | None, float]:
    """One run of the study's ``plan`` (seed ``seed``) to ``TWIN_TARGET``: its steps to the
    target (None: not reached within ``max_steps``) and its train time."""
    per_epoch = steps_per_epoch(len(dataset.x_train), plan.batch_size)
    config = TrainConfig(
        model="mlp", dataset=TWIN_DATASET, engine="native",
        optimizer=OptimizerSpec("adam", plan.learning_rate), batch_size=plan.batch_size,
        epochs=epochs_for_steps(max_steps, per_epoch), max_steps=max_steps,
        eval_every=plan.eval_every, fused_steps=plan.fused_steps, target=TWIN_TARGET, seed=seed,
        model_options=ModelOptions(seed=seed), on_divergence="record", task=task)
    history = runs.train(config, values)
    reached = history.record.target_reached
    return (int(reached["step"]) if reached else None), history.timing["train_time"]


def _interval(steps: list[int | None]) -> dict[str, Any]:
    """``median_interval`` of steps (not reached: infinite), infinities as None for JSON."""
    figures = median_interval([math.inf if s is None else s for s in steps])
    return {k: (None if isinstance(v, float) and math.isinf(v) else v)
            for k, v in figures.items()}


def twin_target_rows(dataset: Any, workload: Any, batch_sizes: list[int], seeds: list[int],
                     max_steps: int) -> list[dict[str, Any]]:
    """Steps to the target of both sides over ``seeds`` (one row per batch size)."""
    builtin_runs = Runs(build_model("mlp", dataset.info, ModelOptions(seed=0)), dataset)
    twin_runs = Runs(workload.build(0), workload.dataset)
    sides = {
        "builtin": (builtin_runs, CLASSIFICATION, lambda s: model_values(
            build_model("mlp", dataset.info, ModelOptions(seed=s)))),
        "twin": (twin_runs, workload.task, lambda s: model_values(workload.build(s)))}
    same_start = [max(float(np.max(np.abs(a - b))) for a, b in zip(
        *(sides[side][2](seed)[0] for side in ("builtin", "twin")), strict=True))
        for seed in seeds]
    rows = []
    for batch in batch_sizes:
        plan = study_plan(dataset, batch)
        budget = epochs_for_steps(max_steps, plan.eval_every) * plan.eval_every  # whole intervals
        row: dict[str, Any] = {"part": "twin steps to target", "batch_size": batch,
                               "target": f"{TWIN_TARGET.metric} {TWIN_TARGET.value}",
                               "learning_rate": plan.learning_rate, "seeds": seeds,
                               "eval_every": plan.eval_every, "max_steps": budget,
                               "initial_weights_max_diff": max(same_start)}
        for side in sides:
            row[f"{side}_steps"], row[f"{side}_train_s"] = [], []
        for seed in seeds:  # the sides alternate: load that comes and goes hits both
            for side, (runs, task, values) in sides.items():
                steps, seconds = run_to_target(runs, values(seed), task, dataset, plan, seed,
                                               budget)
                row[f"{side}_steps"].append(steps)
                row[f"{side}_train_s"].append(seconds)
        for side in sides:
            row[f"{side}_interval"] = _interval(row[f"{side}_steps"])
            row[f"{side}_median_train_s"] = float(np.median(row[f"{side}_train_s"]))
        low = [row[f"{s}_interval"]["low"] for s in sides]
        high = [row[f"{s}_interval"]["high"] for s in sides]
        ends = [[math.inf if v is None else v for v in pair] for pair in (low, high)]
        row["overlap"] = ends[0][0] <= ends[1][1] and ends[0][1] <= ends[1][0]
        medians = [row[f"{s}_interval"]["median"] for s in sides]
        row["ratio"] = medians[1] / medians[0] if None not in medians else None
        rows.append(row)
        say(f"twin steps to target batch {batch:4d}: built-in {row['builtin_steps']}, twin "
            f"{row['twin_steps']}, overlap {row['overlap']}")
    return rows


def measure_twin(settings: Settings, folder: Path) -> list[dict[str, Any]]:
    dataset = workload_of(TrainConfig(model="mlp", dataset=TWIN_DATASET)).dataset
    workload = twin_workload(folder, dataset)
    if not same_data(dataset, workload.dataset):
        raise ConfigError("The twin's workload does not hold the built-in split's arrays.")
    batch_sizes = [256] if settings.quick else list(TWIN_BATCH_SIZES)
    seeds = list(range(settings.options.get("seeds") or (1 if settings.quick else SEEDS)))
    max_steps = settings.options.get("max_steps") or (
        QUICK_MAX_STEPS if settings.quick else MAX_STEPS)
    rows = twin_step_rows(dataset, workload, batch_sizes, settings.rounds(quick=2, full=21))
    return rows + twin_target_rows(dataset, workload, batch_sizes, seeds, max_steps)


# -- part 2: the Conv1D + BatchNorm example against a hand-written loop ------------------------

def make_sequences(folder: Path) -> Path:
    """``examples/make_data.py``'s datasets written into ``folder``; the sequences' path."""
    script = EXAMPLES / "make_data.py"
    if not script.is_file():
        raise ConfigError(f"bench_user_model needs a checkout's examples/ folder: {script} "
                          "not found.")
    spec = importlib.util.spec_from_file_location("kbackend_bench_make_data", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with contextlib.redirect_stdout(sys.stderr):  # its one line, off the worker's stdout
        module.main(folder)
    return folder / "sequences.npz"


def conv_row(workload: Any, batch: int, quick: bool, repeats: int) -> dict[str, Any]:
    """The native engine against the reference loop at ``batch`` (one row)."""
    dataset = workload.dataset
    if quick:  # a few steps of data: a smoke run
        n = QUICK_CONV_STEPS * batch
        dataset = replace(dataset, x_train=dataset.x_train[:n], y_train=dataset.y_train[:n])
    model = workload.build(0)
    initial = model.get_weights()
    steps = steps_per_epoch(len(dataset.x_train), batch)
    unrolled = capabilities.unrolls_its_loop(model, impl().platform())
    fused = QUICK_CONV_K if quick else (capabilities.MAX_UNROLLED_STEPS if unrolled else steps)
    spec = OptimizerSpec("sgd", CONV_LR)
    order = epoch_batches(len(dataset.x_train), batch, seed=0, epoch=0)
    runners = {
        "native": native_runner(model, dataset, spec, batch, fused, workload.task),
        "reference": Tracked(impl().reference_conv1d_loop(
            initial, dataset.x_train[order], dataset.y_train[order], CONV_LR,
            steps_per_call=fused, unroll=unrolled))}
    figures = measure(runners, steps, batch, repeats)
    native, reference = figures["native"], figures["reference"]
    row = {"part": "conv1d vs reference", "batch_size": batch, "steps_per_epoch": steps,
           "fused_steps": fused, "unrolled": unrolled, "platform": impl().platform(),
           "learning_rate": CONV_LR, "ratio": native["us_per_step"] / reference["us_per_step"],
           **{f"{name}_{key}": figures[name][key] for name in ("native", "reference")
              for key in ("us_per_step", "spread", "compile_s", "epoch_s")},
           **{f"{name}_loss_first_last": [runners[name].losses[0], runners[name].losses[-1]]
              for name in ("native", "reference")}}
    row["within_goal"] = row["ratio"] <= 1.1
    say(f"conv batch {batch:4d} K={fused} unrolled={unrolled}: native "
        f"{native['us_per_step']:9.1f} us, reference {reference['us_per_step']:9.1f} us, "
        f"x{row['ratio']:.3f}")
    return row


def measure_conv(settings: Settings, folder: Path) -> list[dict[str, Any]]:
    models = EXAMPLES / "models.py"
    workload = prepare_workload(f"{models}:conv1d_classifier", str(make_sequences(folder)))
    batch_sizes = [64] if settings.quick else list(CONV_BATCH_SIZES)
    repeats = settings.rounds(quick=1, full=9)
    return [conv_row(workload, batch, settings.quick, repeats) for batch in batch_sizes]


def measure_user_model(settings: Settings) -> Rows:
    """The parts asked for (``--parts``) on the active backend."""
    parts = settings.options.get("parts") or list(PARTS)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kbackend-bench-user-model-") as tmp:
        if "twin" in parts:
            rows += measure_twin(settings, Path(tmp))
        if "conv" in parts:
            rows += measure_conv(settings, Path(tmp))
    return rows, {"parts": parts, "platform": impl().platform(),
                  "twin_rounds": settings.rounds(quick=2, full=21),
                  "conv_rounds": settings.rounds(quick=1, full=9)}


# -- the report --------------------------------------------------------------------------------

def _steps(interval: dict[str, Any]) -> str:
    def cell(value: Any) -> str:
        return "not reached" if value is None else format_value(value)

    return f"{cell(interval['median'])} [{cell(interval['low'])}, {cell(interval['high'])}]"


def user_model_table(payload: dict[str, Any]) -> str:
    """One table per part, a line per backend and batch size."""
    rows = payload["rows"]
    step = [r for r in rows if r["part"] == "twin step"]
    target = [r for r in rows if r["part"] == "twin steps to target"]
    conv = [r for r in rows if r["part"] == "conv1d vs reference"]
    out = []
    if step:
        out.append("Twin of the built-in mlp, native steady step (goal: within 10%):\n\n"
                   + markdown_rows(
                       ["backend", "batch", "K", "built-in us/step", "twin us/step",
                        "twin / built-in", "spread built-in, twin", "within 10%"],
                       ([r["backend"], str(r["batch_size"]), str(r["fused_steps"]),
                         f"{r['builtin_us_per_step']:.1f}", f"{r['twin_us_per_step']:.1f}",
                         f"{r['ratio']:.3f}",
                         f"{r['builtin_spread']:.2f}, {r['twin_spread']:.2f}",
                         format_value(r["within_goal"])] for r in step)))
    if target:
        out.append("Twin of the built-in mlp, steps to val_accuracy 0.65 (Adam at the study's "
                   "centre rate): median [min, max] over seeds:\n\n" + markdown_rows(
                       ["backend", "batch", "lr", "K = eval every", "seeds", "built-in steps",
                        "twin steps", "twin / built-in", "overlap", "same initial weights",
                        "train s built-in, twin (median)"],
                       ([r["backend"], str(r["batch_size"]), format_value(r["learning_rate"]),
                         str(r["eval_every"]), str(len(r["seeds"])),
                         _steps(r["builtin_interval"]), _steps(r["twin_interval"]),
                         format_value(r["ratio"]), format_value(r["overlap"]),
                         format_value(r["initial_weights_max_diff"] == 0.0),
                         f"{r['builtin_median_train_s']:.2f}, {r['twin_median_train_s']:.2f}"]
                        for r in target)))
    if conv:
        out.append("Conv1D + BatchNorm example, native engine vs hand-written reference loop "
                   "(SGD; goal: within 1.1x):\n\n" + markdown_rows(
                       ["backend", "batch", "K", "native us/step", "reference us/step",
                        "native / reference", "spread native, ref", "compile s native, ref",
                        "mean loss 1st -> last epoch, native; ref", "within 1.1x"],
                       ([r["backend"], str(r["batch_size"]),
                         f"{r['fused_steps']}{' written out' if r['unrolled'] else ''}",
                         f"{r['native_us_per_step']:.1f}", f"{r['reference_us_per_step']:.1f}",
                         f"{r['ratio']:.3f}",
                         f"{r['native_spread']:.2f}, {r['reference_spread']:.2f}",
                         f"{r['native_compile_s']:.1f}, {r['reference_compile_s']:.1f}",
                         "{:.3f} -> {:.3f}; {:.3f} -> {:.3f}".format(
                             *r["native_loss_first_last"], *r["reference_loss_first_last"]),
                         format_value(r["within_goal"])] for r in conv)))
    return "\n\n".join(out) + (
        "\n\nus/step: the median epoch over interleaved rounds after one compiling epoch; "
        "spread: slowest / fastest timed epoch. Compile s: exact for the native engine, the "
        "first epoch minus the median for the reference.\n")


BENCHMARKS = (
    Benchmark("bench_user_model", "User models (issue 34): a builder identical to the built-in "
              "mlp against --model mlp (step time, steps to target), and the Conv1D + BatchNorm "
              "example's native step against a hand-written reference loop.",
              measure_user_model, keys=("part", "batch_size"), values=("ratio",),
              summary_fields=("parts", "platform", "twin_rounds", "conv_rounds"),
              options=(Option("--parts", f"comma-separated parts (default {','.join(PARTS)})",
                              subset_of(PARTS)),
                       Option("--seeds", f"seeds of the steps-to-target runs (default {SEEDS};"
                              " --quick: 1)", positive_int),
                       Option("--max-steps", f"step budget of a run (default {MAX_STEPS}; "
                              f"--quick: {QUICK_MAX_STEPS})", positive_int)),
              table=user_model_table,
              note="ratios: twin / built-in (goal within 10%; steps: the seeds' intervals "
                   "overlap) and native / reference (goal <= 1.1x); medians over interleaved "
                   "rounds after a compiling epoch"),
)
