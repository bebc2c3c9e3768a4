"""``kbackend advise``: a short, bounded probe of this machine that recommends training settings.

It measures, on the active backend and the devices present: throughput vs batch size (and its
knee), fused steps (the native engine's ``fused_steps`` when that engine is registered, else Keras
``steps_per_execution``), the data format (image models) and the precision policy; with more than
one device platform, each platform. Every recommendation carries the figures behind it. Batch size
also changes what a run converges to, so the advice ends with the ``kbackend study`` command that
checks the recommended batch size for accuracy.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from kbackend.advise.engine_probe import engine_throughput
from kbackend.backend_choice import active_backend
from kbackend.backends import impl
from kbackend.data.named import DataSource, data_source
from kbackend.hardware import probe
from kbackend.hardware.knee import DEFAULT_MIN_GAIN, Knee, curve_knee
from kbackend.models import ModelOptions
from kbackend.task import metric_direction
from kbackend.training import TrainConfig, workload_of

# A setting other than the default is recommended only when it is at least this much faster:
# shared machines make smaller differences noise.
MIN_SPEEDUP = 1.10
# Each measurement aims at about this many seconds of steady steps (bounded below and above).
TARGET_MEASURE_S = 1.5


@dataclass
class Advice:
    """Measurements, recommendations (each with its evidence) and the commands to run next."""

    model: str
    dataset: str
    backend: str
    quick: bool
    # The loss and metric every measurement trains (a user model's compiled loss).
    task: str = ""
    measurements: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    recommendations: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    train_command: str = ""
    study_command: str = ""
    elapsed_s: float = 0.0
    budget_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def recommend(self, setting: str, value: Any, evidence: str) -> None:
        self.recommendations.append({"setting": setting, "value": value, "evidence": evidence})


def _steps_for(previous_step_ms: float | None, quick: bool) -> int:
    """Enough steps for about TARGET_MEASURE_S of timing, given the last measured step time."""
    return probe.steps_for(TARGET_MEASURE_S, previous_step_ms, *((4, 10) if quick else (6, 30)))


def _fmt(row: dict[str, Any]) -> str:
    return f"{row['samples_per_s']:,.0f} samples/s ({row['step_ms']:.2f} ms/step)"


def _round_robin(probes: list[probe.FitProbe], left: Callable[[], float], reserve_s: float,
                 max_rounds: int) -> int:
    """Re-time every probe in turn, round after round, while more than ``reserve_s`` of the budget
    is left (at most ``max_rounds`` rounds); the number of extra rounds run."""
    rounds = 0
    while rounds < max_rounds and left() > reserve_s:
        for item in probes:
            item.again()
        rounds += 1
    return rounds


def recommend_batch_size(advice: Advice, curve: list[dict[str, Any]]) -> Knee:
    """Record the measured throughput ``curve`` and recommend its knee; return the knee."""
    advice.measurements["batch_size"] = curve
    knee = curve_knee(curve)
    best = max(curve, key=lambda r: r["samples_per_s"])
    gains = ", ".join(f"{g:+.0%}" for g in knee.gains)
    advice.recommend(
        "batch_size", knee.batch_size,
        f"throughput knee: {knee.throughput:,.0f} samples/s at batch {knee.batch_size}; "
        f"per-doubling gains {gains or 'n/a'} (knee: next doubling < {DEFAULT_MIN_GAIN:.0%}); "
        f"best measured {best['samples_per_s']:,.0f} samples/s at batch {best['batch_size']} "
        f"(medians of {curve[0]['rounds']} interleaved round(s))"
        + ("" if knee.plateau_reached else "; no plateau yet: larger batches may still help"))
    return knee


def _source_flags(model: str, data: DataSource, unsafe: bool) -> str:
    """The ``--model`` and data flags that name this workload on a command line."""
    return shlex.join(["--model", model, *data.to_flags(),
                       *(["--unsafe-deserialization"] if unsafe else [])])


# The follow-up study's target where its data has no default (the user's): a metric this
# fraction of the way from a constant guess's value to a perfect one (half the error of
# predicting the training labels' mean or most common class: a target any model that learns
# something reaches, and a poor one does not).
BASELINE_FRACTION = 0.5


def _constant_guess(task: Any, dataset: Any) -> float:
    """The validation metric of one guess for every sample: the most common training class
    (the accuracy of class-index labels), else the training labels' mean, in the model's own
    metric."""
    y_val = np.asarray(dataset.y_val)
    if task.sparse_labels and task.metric.endswith("accuracy"):
        guess = np.zeros((len(y_val), dataset.info.num_classes), np.float32)
        guess[:, np.bincount(np.asarray(dataset.y_train, np.int64).ravel()).argmax()] = 1.0
        outputs = guess
    else:
        y_val = y_val.astype(np.float32)
        mean = np.mean(np.asarray(dataset.y_train, dtype=np.float32), axis=0)
        outputs = task.as_outputs(np.broadcast_to(mean, y_val.shape).astype(np.float32))
    return float(np.mean(np.asarray(task.per_sample_metric(y_val, outputs))))


def study_target_flags(task: Any, dataset: Any, data: DataSource | None = None) -> str:
    """The ``--target-metric`` and ``--target`` the follow-up study on ``data`` (default: the
    source ``dataset`` was read from) needs for ``task``, by the study's one rule
    (``study.targets.study_target``): none where the data source's default target is on the
    model's metric (a built-in dataset's); else ``BASELINE_FRACTION`` of the way from a
    constant guess's validation value (``_constant_guess``) to a perfect one for an accuracy
    or an error metric (``mae``, ...), and 0.9 for another score."""
    metric = f"val_{task.metric}"
    default = (data or data_source(dataset.info.name)).default_target()
    if default is not None and default.metric == metric:
        return ""
    if metric_direction(metric) == "max":
        if not task.metric.endswith("accuracy"):
            return f" --target-metric {metric} --target 0.9"
        guess = _constant_guess(task, dataset)
        return f" --target-metric {metric} --target {guess + BASELINE_FRACTION * (1 - guess):.3g}"
    error = _constant_guess(task, dataset)
    return f" --target-metric {metric} --target {BASELINE_FRACTION * error:.3g}"


class _Budget:
    """The probe's time budget, counted from its first measurement (not start-up or data)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.start = seconds, time.perf_counter()

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)


def _throughput_curve(work: Any, advice: Advice, budget: _Budget,
                      log: Callable[[str], None]) -> tuple[list[probe.FitProbe], Knee]:
    """1. Throughput vs batch size (each size compiled once, then re-timed round-robin) and
    its knee, recommended."""
    quick, num_train = advice.quick, len(work.x)
    sizes = [32, 256] if quick else [2**k for k in range(4, 13)]
    sizes = [b for b in sizes if b <= num_train] or [num_train]
    probes: list[probe.FitProbe] = []
    previous = None
    for batch in sizes:
        if len(probes) >= 2 and budget.left() < budget.seconds * 0.6:  # time for the rest
            advice.skipped.append(f"batch sizes >= {batch} (time budget)")
            break
        steps = _steps_for(previous and previous * batch / probes[-1].batch_size, quick)
        try:
            probes.append(probe.FitProbe(work, batch, steps=steps))
        except probe.OutOfMemory:
            advice.skipped.append(f"batch sizes >= {batch} (out of device memory)")
            break
        row = probes[-1].result()
        previous = row["step_ms"]
        log(f"  batch {batch:>5}: {_fmt(row)}, compile {row['compile_s']:.1f}s")
    extra = _round_robin(probes, budget.left, budget.seconds * 0.45, 1 if quick else 4)
    curve = [item.result() for item in probes]
    if extra:
        log(f"  re-timed every batch size {extra} more time(s), round-robin: "
            + ", ".join(f"{r['batch_size']}: {r['samples_per_s']:,.0f}/s" for r in curve))
    return probes, recommend_batch_size(advice, curve)


def _variants_at(work: Any, config: TrainConfig, base_probe: probe.FitProbe,
                 steps: int, support: dict[str, dict[str, bool]], advice: Advice,
                 budget: _Budget, log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """2.-4. The data format (built-in image models) and precision policies at the knee's batch
    size, timed round-robin with ``base_probe`` (float32, one step per call); their results by
    name, the base under ``"base"``."""
    batch = base_probe.batch_size
    compare: dict[str, probe.FitProbe] = {}
    if not _convolves(work):
        advice.skipped.append("data format (a built-in model's option, compared on the "
                              "built-in image datasets; your model's layers set their own)")
    elif impl().supports_channels_first_conv():
        first = workload_of(replace(config, model_options=ModelOptions(
            data_format="channels_first")))
        compare["channels_first"] = probe.FitProbe(probe.user_workload(first), batch,
                                                   steps=steps)
    for name in ("mixed_bfloat16", "mixed_float16"):
        if not support.get(name, {}).get("runs"):
            advice.skipped.append(f"precision {name} (does not run on this device)")
        elif name == "mixed_bfloat16" or budget.left() > budget.seconds * 0.2:
            compare[name] = probe.FitProbe(work, batch, steps=steps, precision=name)
        else:
            advice.skipped.append(f"precision {name} (time budget)")
    _round_robin([base_probe, *compare.values()], budget.left, 0.0, 1 if advice.quick else 3)
    results = {"base": base_probe.result(),
               **{name: item.result() for name, item in compare.items()}}
    log(f"  at batch {batch}: base (float32, 1 step per call) {_fmt(results['base'])}; "
        + "; ".join(f"{name} {_fmt(row)}" for name, row in results.items() if name != "base"))
    return results


def _convolves(work: Any) -> bool:
    """Whether the data format is this workload's choice: a model whose options set it (a
    built-in) on data arranged by it (a built-in image dataset, read in the image layout)."""
    first = work.prepared.source.data_format(ModelOptions(data_format="channels_first"))
    return first == "channels_first" and work.info.data_format is not None


def _recommend_fused(advice: Advice, work: Any, batch: int, steps: int) -> int:
    """The native engine's fused steps, 1 against 8, timed through train() (not interleaved)."""
    rows = [{"fused": fused, **engine_throughput(work, batch, "native", steps=max(32, steps),
                                                 fused_steps=fused)} for fused in (1, 8)]
    advice.measurements["fused"] = rows
    speedup = rows[1]["samples_per_s"] / rows[0]["samples_per_s"]
    fused = 8 if speedup >= MIN_SPEEDUP else 1
    advice.recommend("fused_steps", fused,
                     f"at batch {batch}: 1 -> {_fmt(rows[0])}, 8 -> {_fmt(rows[1])} "
                     f"(x{speedup:.2f}; recommended when >= x{MIN_SPEEDUP:.2f})")
    return fused


def _recommend_data_format(advice: Advice, results: dict[str, dict[str, Any]]) -> str:
    """channels_first where it runs and is ``MIN_SPEEDUP`` faster, else channels_last."""
    if "channels_first" not in results:
        advice.recommend("data_format", "channels_last",
                         "channels_first convolutions fail on this build (probed)")
        return "channels_last"
    rows = [{"data_format": "channels_last", **results["base"]},
            {"data_format": "channels_first", **results["channels_first"]}]
    advice.measurements["data_format"] = rows
    speedup = rows[1]["samples_per_s"] / rows[0]["samples_per_s"]
    data_format = "channels_first" if speedup >= MIN_SPEEDUP else "channels_last"
    advice.recommend("data_format", data_format,
                     f"channels_last {_fmt(rows[0])}, channels_first {_fmt(rows[1])} "
                     f"(x{speedup:.2f})")
    return data_format


def _recommend_precision(advice: Advice, results: dict[str, dict[str, Any]],
                         support: dict[str, dict[str, bool]]) -> str:
    """The fastest precision policy where it is ``MIN_SPEEDUP`` faster than float32."""
    base = results["base"]
    rows = [{"precision": "float32", "accelerated": True, **base}] + [
        {"precision": name, "accelerated": support[name]["accelerated"], **results[name]}
        for name in ("mixed_bfloat16", "mixed_float16") if name in results]
    advice.measurements["precision"] = rows
    fastest = max(rows, key=lambda r: r["samples_per_s"])
    speedup = fastest["samples_per_s"] / base["samples_per_s"]
    precision = fastest["precision"] if speedup >= MIN_SPEEDUP else "float32"
    figures = "; ".join(f"{r['precision']} {_fmt(r)}" for r in rows)
    advice.recommend("precision", precision,
                     f"{figures} (x{speedup:.2f} for the fastest; hardware support: "
                     + ", ".join(f"{k} {'accelerated' if v['accelerated'] else 'emulated'}"
                                 for k, v in support.items() if k != "float32")
                     + "; check accuracy: reduced precision can cost some)")
    return precision


def _recommend_device(advice: Advice, work: Any, batch: int, steps: int, budget: _Budget,
                      log: Callable[[str], None]) -> None:
    """5. Device platforms (measured only when there is a choice)."""
    platforms = probe.platforms()
    if len(platforms) == 1:
        advice.recommend("device", platforms[0], f"only {platforms[0]} devices are present")
        return
    if budget.left() <= 0:
        advice.skipped.append("device comparison (time budget)")
        return
    rows = []
    for platform in platforms:
        with impl().device_scope(platform):
            row = probe.fit_throughput(work, batch, steps=steps)
        rows.append({"device": platform, **row})
        log(f"  device {platform}: {_fmt(row)}")
    advice.measurements["device"] = rows
    fastest = max(rows, key=lambda r: r["samples_per_s"])
    advice.recommend("device", fastest["device"],
                     "; ".join(f"{r['device']} {_fmt(r)}" for r in rows))


def advise(model: str, dataset: str, *, data_dir: str | None = None, quick: bool = False,
           budget_s: float = 100.0, log: Callable[[str], None] = print,
           label: str | None = None, unsafe_deserialization: bool = False,
           image_size: tuple[int, int] | None = None) -> Advice:
    """Run the probe within about ``budget_s`` seconds (measurements left over are skipped and
    listed). Configurations are compiled once and timed round-robin (``FitProbe``), so a change
    of machine load hits all of them alike.

    ``model`` is a built-in name, a ``.keras`` path or a builder (``FILE.py:FUNCTION``);
    ``dataset`` a built-in name or a data source (``label``: a CSV's label column), as
    ``kbackend train`` takes them. A user's model is measured with its compiled loss (else the
    one inferred from the labels); the data format, a built-in model's option, is not compared
    for it."""
    config = TrainConfig(model=model, dataset=dataset, label=label, data_dir=data_dir,
                         unsafe_deserialization=unsafe_deserialization, image_size=image_size)
    prepared = workload_of(config)  # built-in names and the user's sources alike
    for note in prepared.notes:
        log(f"  {note}")
    work = probe.user_workload(prepared)
    data = data_source(dataset, label)
    target = study_target_flags(prepared.task, prepared.dataset, data)
    advice = Advice(model, dataset, active_backend(), quick, work.task.describe())
    log(f"  {work.model}: {advice.task}")
    probe.warm_up()
    budget = _Budget(budget_s)
    probes, knee = _throughput_curve(work, advice, budget, log)
    batch = knee.batch_size
    steps = _steps_for(probes[knee.index].result()["step_ms"], quick)
    fused_value = _recommend_fused(advice, work, batch, steps)
    support = impl().precision_support()
    results = _variants_at(work, config, probes[knee.index], steps, support, advice, budget,
                           log)
    convolves = _convolves(work)
    data_format = _recommend_data_format(advice, results) if convolves else "channels_last"
    precision = _recommend_precision(advice, results, support)
    _recommend_device(advice, work, batch, steps, budget, log)
    source = _source_flags(model, data, unsafe_deserialization)
    advice.train_command = (f"kbackend train {source} --batch-size {batch} "
                            f"--engine native --fused-steps {fused_value} --precision {precision}"
                            + (f" --data-format {data_format}" if convolves else ""))
    study_sizes = sorted({max(1, batch // 4), batch, min(len(work.x), batch * 4)})
    advice.study_command = (f"kbackend study {source} "
                            f"--batch-sizes {','.join(str(b) for b in study_sizes)}{target}")
    advice.elapsed_s = time.perf_counter() - budget.start
    advice.budget_s = budget_s
    return advice


def format_advice(advice: Advice) -> str:
    """The recommendations as text: one block per setting with its evidence, then the commands."""
    lines = [f"Recommended settings for {advice.model} on {advice.dataset} "
             f"({advice.backend} backend, measurements took {advice.elapsed_s:.0f}s of a "
             f"{advice.budget_s:.0f}s budget"
             + (f"; {advice.task}" if advice.task else "") + "):"]
    for item in advice.recommendations:
        lines.append(f"  {item['setting']:<20} {item['value']}")
        lines.append(f"  {'':<20} because: {item['evidence']}")
    if advice.skipped:
        lines.append("Not measured: " + "; ".join(advice.skipped))
    lines.append(f"Train with:  {advice.train_command}")
    lines.append("Batch size changes what training converges to; confirm it for accuracy with:")
    lines.append(f"  {advice.study_command}")
    return "\n".join(lines)
