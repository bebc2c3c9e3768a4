"""Measurements shared by the benchmark scripts and ``kbackend advise``.

What runs a whole training (``train()``, an engine's steps) is measured one layer up, in
``kbackend.advise.engine_probe``; here Keras ``fit`` steps, memory and the matmul peak.

Every function builds what it measures, excludes the first (compiling) call, waits for results
before reading a clock (a Keras callback reads the step's loss, which blocks until it is
computed) and returns plain dicts ready for JSON.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from kbackend import data as data_module
from kbackend.backend_choice import keras as import_keras
from kbackend.backend_choice import selected_backend
from kbackend.backends import impl
from kbackend.data import DatasetInfo
from kbackend.errors import KBackendError, is_out_of_memory
from kbackend.hardware.measure import time_interleaved
from kbackend.models import SEED_MLP_WIDTHS, ModelOptions, build_model, model_layout
from kbackend.optim import OptimizerSpec
from kbackend.precision import precision_scope
from kbackend.runtime.child import run_in_child
from kbackend.task import CLASSIFICATION, Task
from kbackend.workload import Workload as PreparedWorkload

CHILD_PROBE_TIMEOUT_S = 600  # a measurement in a child process: framework start-up and one compile
# Input shapes of the MNIST-shaped synthetic workload, per model layout.
_SYNTHETIC_SHAPES = {"flat": (784,), "sequence": (28, 28)}


class OutOfMemory(KBackendError):
    """A measurement ran out of device memory (the batch is too large for this device)."""


@dataclass
class Workload:
    """A model name, the dataset description it is built for, and samples to feed it;
    ``recipe``: the ``workload()`` arguments that make it again (in another process).

    ``prepared``: the user's model and data (a ``kbackend.workload.Workload``) where the model
    or the data is not built in; its ``task`` (the model's compiled loss) is what every
    measurement trains, where built-in models train ``CLASSIFICATION``."""

    model: str
    info: DatasetInfo
    x: np.ndarray
    y: np.ndarray
    options: ModelOptions
    recipe: dict[str, Any] | None = None
    prepared: PreparedWorkload | None = None
    task: Task = CLASSIFICATION


def workload(model: str, dataset: str = "synthetic", *, data_dir: str | None = None,
             data_format: str = "channels_last", samples: int = 4096, seed: int = 0,
             options: ModelOptions | None = None) -> Workload:
    """Samples for ``model``: MNIST-shaped random data (``synthetic``) or a real dataset's train
    split."""
    layout = model_layout(model)
    options = replace(options or ModelOptions(), data_format=data_format)
    recipe = {"model": model, "dataset": dataset, "data_dir": data_dir, "data_format": data_format,
              "samples": samples, "seed": seed, "options": asdict(options)}
    if dataset == "synthetic":
        layout = "image" if layout == "spatial" else layout  # MNIST-shaped: images
        mnist_shape = (28, 28, 1) if data_format == "channels_last" else (1, 28, 28)
        shape = _SYNTHETIC_SHAPES.get(layout) or mnist_shape
        rng = np.random.default_rng(seed)
        x = rng.normal(size=(samples, *shape)).astype(np.float32)
        y = rng.integers(0, 10, size=samples).astype(np.int32)
        info = DatasetInfo("synthetic", shape, 10, "random", layout,
                           data_format if layout == "image" else None, samples, 0, 0)
        return Workload(model, info, x, y, options, recipe)
    loaded = data_module.load(dataset, layout=layout, data_format=data_format, data_dir=data_dir,
                              seed=seed)
    return Workload(model, loaded.info, loaded.x_train, loaded.y_train, options, recipe)


def user_workload(prepared: PreparedWorkload) -> Workload:
    """The measurements' ``Workload`` of a user's model and data (``training.workload_of``):
    its training split as samples, its task as the loss every measurement trains."""
    dataset = prepared.dataset
    return Workload(prepared.model_name, dataset.info, dataset.x_train, dataset.y_train,
                    prepared.options, None, prepared, prepared.task)


def make_model(work: Workload) -> Any:
    """A fresh model of ``work``: a built-in built by name, or the user's own."""
    if work.prepared is not None:
        return work.prepared.build(work.options.seed)
    return build_model(work.model, work.info, work.options)


def loss_of(work: Workload) -> Any:
    """The loss ``work``'s measurements compile: a user model's own, else the built-ins'."""
    if work.prepared is None:
        return "sparse_categorical_crossentropy"
    return work.task.loss_object()


def labels_of(work: Workload, y: np.ndarray) -> Any:
    """Rows of ``work``'s labels as ``fit`` takes them (a multi-output task's, by output)."""
    return work.task.fit_labels(y)


def train_step_memory(work: Workload, batch_size: int) -> dict[str, Any]:
    """MiB one train step of ``work``'s model at ``batch_size`` needs beyond its resident inputs
    (``impl().train_step_memory``: XLA's buffer assignment on JAX, the allocator's peak on TF).
    Where this process cannot measure it (TensorFlow's CPU allocator keeps statistics only when
    set up for them at start), a fresh process set up so measures the same workload; ``None``
    MiB, with the reason in ``memory_source``, if that cannot either."""
    found = _step_memory_here(work, batch_size)
    if found["step_memory_bytes"] is None and found.get("stats_env") and work.recipe:
        found = run_in_child("kbackend.hardware.probe:step_memory_of_recipe", selected_backend(),
                             {"recipe": work.recipe, "batch_size": batch_size},
                             extra_env=found["stats_env"], timeout_s=CHILD_PROBE_TIMEOUT_S)
        found["memory_source"] += " (in a child process set up for it)"
    size = found["step_memory_bytes"]
    return {"step_memory_mib": None if size is None else size / 2**20,
            "memory_source": found["memory_source"]}


def _step_memory_here(work: Workload, batch_size: int) -> dict[str, Any]:
    model = make_model(work)
    model.compile(optimizer=OptimizerSpec("sgd", 0.01).to_keras(), loss=loss_of(work),
                  jit_compile=True)
    return impl().train_step_memory(model, work.x[:batch_size],
                                    labels_of(work, work.y[:batch_size]))


def step_memory_of_recipe(recipe: dict[str, Any], batch_size: int) -> dict[str, Any]:
    """``impl().train_step_memory`` in this process of the workload ``recipe`` describes (a
    child's side of ``train_step_memory``)."""
    options: dict[str, Any] = {key: tuple(value) if isinstance(value, list) else value
                               for key, value in recipe["options"].items()}
    work = workload(**{**recipe, "options": ModelOptions(**options)})
    found = _step_memory_here(work, batch_size)
    found.pop("stats_env", None)
    return found


def _step_timer(times: list[float]) -> Any:
    # Any: mypy cannot see the classes of a module imported at run time (the bases below)
    keras: Any = import_keras()

    class StepTimer(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            times.append(time.perf_counter())

        def on_train_batch_end(self, batch, logs=None):
            float((logs or {}).get("loss", 0.0))  # waits for the step's results
            times.append(time.perf_counter())

    return StepTimer()


def warm_up() -> float:
    """Pay the one-time costs of a process's first ``fit`` (framework and data-adapter imports,
    backend start-up) on a tiny model, so no measurement includes them; the seconds it took."""
    start = time.perf_counter()
    keras = import_keras()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="softmax")])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(np.zeros((16, 4), np.float32), np.zeros(16, np.int32), batch_size=8, epochs=1,
              verbose=0)
    return time.perf_counter() - start


def optimizer_state_bytes(model: Any) -> int:
    """Bytes held by ``model``'s optimizer variables (moments, momenta, counters)."""
    return int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize
                   for v in model.optimizer.variables))


class FitProbe:
    """One compiled model at one batch size, its train step timed with Keras ``fit``.

    Construction builds and compiles the model and times a first ``fit`` (its first execution
    compiles and is timed apart). ``again()`` times another round on the same compiled model, so
    configurations can be measured round-robin: on a shared machine whose load changes over
    time, the median of interleaved rounds is steadier than one long measurement each.

    ``steps`` steps run per round (``steps_per_execution`` steps per call); ``build`` replaces
    the model builder, ``x`` the inputs (e.g. raw uint8 pixels) and ``source(x, y, batch_size)``
    the batch source handed to ``fit`` (e.g. a host-preprocessing ``PyDataset``). Raises
    ``OutOfMemory`` when the device cannot hold the batch.
    """

    def __init__(self, work: Workload, batch_size: int, *, steps: int = 20,
                 precision: str = "float32", jit_compile: bool | str = True,
                 run_eagerly: bool = False,
                 steps_per_execution: int = 1, optimizer: OptimizerSpec | None = None,
                 build: Callable[[Workload], Any] | None = None, x: np.ndarray | None = None,
                 source: Callable[[np.ndarray, np.ndarray, int], Any] | None = None) -> None:
        import_keras()
        self.batch_size = batch_size
        self.steps_per_execution = steps_per_execution
        x_all = work.x if x is None else x
        calls = max(2, -(-steps // steps_per_execution) + 1)
        index = np.arange(calls * steps_per_execution * batch_size) % len(x_all)
        xs, ys = x_all[index], labels_of(work, work.y[index])
        spec = optimizer or OptimizerSpec("sgd", 0.01)
        with self._oom_as_error():
            with precision_scope(precision):
                self.model = build(work) if build is not None else make_model(work)
            self.model.compile(optimizer=spec.to_keras(), loss=loss_of(work),
                               jit_compile=jit_compile, run_eagerly=run_eagerly,
                               steps_per_execution=steps_per_execution)
            self.inputs = {"x": source(xs, ys, batch_size)} if source is not None else \
                {"x": xs, "y": ys, "batch_size": batch_size}
            intervals = self._fit()
        self.first_call_s = float(intervals[0])
        self.rounds = [intervals[1:] / steps_per_execution]

    @contextmanager
    def _oom_as_error(self) -> Iterator[None]:
        try:
            yield
        except Exception as error:
            if is_out_of_memory(error):
                raise OutOfMemory(
                    f"batch {self.batch_size} does not fit in device memory") from error
            raise

    def _fit(self) -> np.ndarray:
        times: list[float] = []
        self.model.fit(**self.inputs, epochs=1, shuffle=False, verbose=0,
                       callbacks=[_step_timer(times)])
        return np.diff(times)

    def again(self) -> float:
        """Time one more round; returns its median seconds per step."""
        with self._oom_as_error():
            intervals = self._fit()
        # A repeated fit's first execution holds fit's own setup (data adapter, callbacks).
        self.rounds.append(intervals[1:] / self.steps_per_execution)
        return float(np.median(self.rounds[-1]))

    def result(self) -> dict[str, Any]:
        """Median step time (the median of the rounds' medians), spread, samples/s, compile time."""
        medians = [float(np.median(r)) for r in self.rounds]
        pooled = np.concatenate(self.rounds)
        step_s = float(np.median(medians))
        spe = self.steps_per_execution
        return {
            "batch_size": self.batch_size,
            "step_ms": 1e3 * step_s,
            "step_ms_p10": 1e3 * float(np.percentile(pooled, 10)),
            "step_ms_p90": 1e3 * float(np.percentile(pooled, 90)),
            "samples_per_s": self.batch_size / step_s,
            "compile_s": max(0.0, self.first_call_s - spe * step_s),
            "steps": int(pooled.size * spe),
            "rounds": len(self.rounds),
            "optimizer_state_bytes": optimizer_state_bytes(self.model),
            "params": int(self.model.count_params()),
            "variable_dtypes": sorted({str(v.dtype) for v in self.model.trainable_variables}),
        }


def fit_throughput(work: Workload, batch_size: int, **options: Any) -> dict[str, Any]:
    """Median time of a Keras ``fit`` train step at ``batch_size`` and the samples/s it gives
    (one round of ``FitProbe``; see it for the options)."""
    return FitProbe(work, batch_size, **options).result()


def steps_for(seconds: float, step_ms: float | None, low: int, high: int) -> int:
    """How many steps of ``step_ms`` fill about ``seconds`` of timing, within [low, high]."""
    if not step_ms:
        return low
    return int(min(high, max(low, seconds * 1e3 / step_ms)))


def throughput_curve(work: Workload, batch_sizes: list[int], *, steps: int = 20,
                     budget_s: float | None = None, seconds_per_point: float | None = None,
                     rounds: int = 1, **options: Any) -> list[dict[str, Any]]:
    """Keras ``fit`` throughput at each batch size, stopping at the first that runs out of memory
    or once ``budget_s`` seconds are spent (the rows say which). With ``seconds_per_point``, the
    step count adapts (at most ``steps``, at least 3) so each point times about that long. With
    ``rounds`` > 1, every size is re-timed round-robin that many times in all (``FitProbe``)."""
    probes: list[FitProbe] = []
    notes: list[dict[str, Any]] = []
    start = time.perf_counter()
    for batch_size in batch_sizes:
        if budget_s is not None and time.perf_counter() - start > budget_s:
            notes.append({"batch_size": batch_size, "note": "skipped: time budget spent"})
            break
        count = steps
        if seconds_per_point is not None and probes:
            last = probes[-1].result()
            step_ms = last["step_ms"] * batch_size / last["batch_size"]
            count = steps_for(seconds_per_point, step_ms, 3, steps)
        try:
            probes.append(FitProbe(work, batch_size, steps=count, **options))
        except OutOfMemory:
            notes.append({"batch_size": batch_size, "note": "out of memory"})
            break
    for _ in range(rounds - 1):
        for item in probes:
            item.again()
    return [item.result() for item in probes] + notes


def dense_train_flops(widths: list[int], batch_size: int) -> float:
    """FLOPs of one train step of a dense net with layer widths ``widths`` (inputs first).

    Forward: 2*B*in*out per layer; backward: twice that (gradients of inputs and of weights).
    Biases, activations and the optimizer update are O(B*width) and left out.
    """
    return 6.0 * batch_size * sum(a * b for a, b in itertools.pairwise(widths))


def numpy_matmul_flops(n: int = 2048, repeats: int = 10) -> dict[str, float]:
    """Measured FLOP/s of NumPy's (BLAS) float32 ``n x n`` matmul: median and best of
    ``repeats`` after a first call."""
    rng = np.random.default_rng(0)
    a, b = (rng.normal(size=(n, n)).astype(np.float32) for _ in range(2))
    timing = time_interleaved({0: lambda: a @ b}, repeats, wait=lambda product: product)[0]
    return {"n": n, "median_s": timing.median_s, "flops": 2.0 * n**3 / timing.median_s,
            "best_flops": 2.0 * n**3 / min(timing.times)}


def matmul_peak(n: int = 2048, repeats: int = 10) -> dict[str, Any]:
    """This machine's measured float32 matmul peak: the fastest call (a peak is the best the
    hardware did, which other load on a shared machine can only lower) of the backend's compiled
    and op-by-op matmul and NumPy's BLAS (a train step may use any of these kernels)."""
    candidates = {
        "backend_jit": impl().matmul_flops(n, "float32", repeats=repeats, jit=True)["best_flops"],
        "backend_eager": impl().matmul_flops(n, "float32", repeats=repeats,
                                             jit=False)["best_flops"],
        "numpy": numpy_matmul_flops(n, repeats)["best_flops"],
    }
    best = max(candidates, key=candidates.__getitem__)
    return {"n": n, "peak_flops": candidates[best], "peak_source": best,
            **{f"{k}_gflops": v / 1e9 for k, v in candidates.items()}}


def roofline(batch_size: int = 1024, *, steps: int = 20, matmul_n: int = 2048,
             steps_per_execution: int = 8, rounds: int = 3) -> dict[str, Any]:
    """The seed MLP's train-step FLOP rate as a fraction of this device's measured matmul peak.

    Peak and step are measured alternately for ``rounds`` rounds in one process (the model is
    compiled once, before the first round), and the fraction is computed per round: on a shared
    machine the load changes over time, and a ratio of neighbouring readings is steadier than a
    ratio of readings taken minutes apart. The median round is reported, with the spread.
    """
    fit = FitProbe(workload("seed_mlp", samples=batch_size * 4), batch_size, steps=steps,
                   steps_per_execution=steps_per_execution)
    flops = dense_train_flops([784, *SEED_MLP_WIDTHS, 10], batch_size)
    per_round = []
    for _ in range(rounds):
        peak = matmul_peak(matmul_n, repeats=5)
        step_s = fit.again()
        per_round.append({"step_ms": 1e3 * step_s, "model_gflops": flops / step_s / 1e9,
                          "peak_gflops": peak["peak_flops"] / 1e9,
                          "peak_source": peak["peak_source"],
                          "fraction_of_peak": flops / step_s / peak["peak_flops"]})
    fractions = [r["fraction_of_peak"] for r in per_round]
    median = sorted(per_round, key=lambda r: r["fraction_of_peak"])[len(per_round) // 2]
    return {"batch_size": batch_size, "train_step_flop": flops, **median,
            "fraction_min": min(fractions), "fraction_max": max(fractions), "rounds": rounds,
            "matmul_n": matmul_n, "steps_per_execution": steps_per_execution,
            "compile_s": max(0.0, fit.first_call_s
                             - steps_per_execution * median["step_ms"] / 1e3)}


def platforms() -> list[str]:
    """The device platforms present (``cpu`` always; ``gpu``/``tpu`` when found), deduplicated."""
    return list(dict.fromkeys(device["platform"] for device in impl().devices()))
