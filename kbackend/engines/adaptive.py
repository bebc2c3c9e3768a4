"""The adaptive batch size on the native engine (``--batch-size auto[:MIN:MAX]``, issue 37).

The run trains with ``backends.adaptive().AdaptiveTrainer``: the native fused steps with
micro-batched gradients, which return the two squared norms the online noise scale needs
(``kbackend.adaptive.NoiseScale``). The one epoch loop (``engines.loop``) asks
``AdaptiveBatch.at_evaluation`` at each evaluation point, after every dispatched call has been
fetched; when the policy grows the batch, the loop re-cuts the rest of the epoch's order into
batches of the new size and goes on with the same trainer, whose state (weights, optimizer slots
and count) runs through every size. Each (size, call length) compiles once.

Bounds: MIN is ``auto:MIN`` or 8 (``kbackend.adaptive.DEFAULT_MIN_BATCH``). MAX is ``auto::MAX``
or the throughput knee of this model on this machine (``kbackend.hardware.knee``, the definition
``advise`` uses), measured by ``probe_knee`` on the run's own compiled programs (each size it
probes is compiled once, for the probe and the run alike) and kept per machine, model and data
size (the measurement harness, ``hardware.measure``). Where a size runs out of device memory
before the knee, the probe stops there: MAX is then the largest size that fit (on several
devices, the data-parallel memory limit of the per-device shards). The probe's seconds are
recorded apart from the run's (``record.adaptive_batch["knee_probe"]``), like
``--fused-steps auto``'s.

The learning rate configured is the rate at MIN; ``--lr-scaling`` says how it follows the batch
(``kbackend.adaptive.scaled_learning_rate``; ``adascale`` is re-evaluated at every evaluation
point). A schedule is refused: the growing batch is the schedule (Smith et al. 2018), and a
schedule's horizon in steps means nothing while steps per epoch change.

Data parallel (``--engine data_parallel`` / ``--data-parallel`` / ``--devices N``, one process,
``shard_map``/``pmap`` on JAX, ``MirroredStrategy`` on TensorFlow): the trainer is the backend's
``DataParallelAdaptiveTrainer``, whose per-device shards are the micro-batches (each device's
gradient of its shard and their all-reduced mean: the estimator's two batch sizes at no extra
gradient). Everything else above is the same code. The batch is the
global one, doubling from MIN (default ``max(8, devices)``), so with a power-of-two device count
every size is a multiple of the devices with a power-of-two per-device batch
(``for_devices``); the knee probe times the data-parallel calls.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any

import numpy as np

from kbackend.adaptive import (
    DEFAULT_MEASURE_EVERY,
    DEFAULT_MIN_BATCH,
    AutoBatchSize,
    BatchBounds,
    BatchChange,
    GrowthPolicy,
    NoiseScale,
    compile_ahead_enabled,
    estimator_settings,
    scaled_learning_rate,
)
from kbackend.backends import adaptive as adaptive_backend
from kbackend.backends import impl
from kbackend.data import batching
from kbackend.engines import loop
from kbackend.engines.keras_fit import build_optimizer, compile_model
from kbackend.engines.plan import TrainPlan
from kbackend.errors import ConfigError, is_out_of_memory
from kbackend.hardware.knee import DEFAULT_MIN_GAIN, MeasuredGain, measured_gain
from kbackend.hardware.measure import KNEE, Budget, Clock, Timing, remembered, time_interleaved
from kbackend.history import History

DEFAULT_FUSED_STEPS = 8  # K of an adaptive run asked for ``--fused-steps auto``
# Steps per measured step of the one-device trainer (``bench_adaptive --part estimator`` sets 1,
# the every-step reference, in its worker process).
MEASURE_EVERY = DEFAULT_MEASURE_EVERY
ADASCALE_RELATIVE_CHANGE = 0.01  # a rate change below this is not recorded as a new range


def check_adaptive_options(config: Any) -> None:
    """One-line errors, before any work, for what an adaptive run cannot do."""
    spec = config.optimizer
    if spec.schedule != "constant" or spec.warmup_steps:
        raise ConfigError("--batch-size auto grows the batch instead of a learning-rate "
                          "schedule: use --schedule constant without warm-up.")


def for_devices(config: Any, devices: int) -> Any:
    """``config`` for a run on ``devices`` devices, checked before any work: on several, the
    device count must be a power of two
    (the doubling global batch then stays a multiple of it) and MIN at least one sample per
    device (the default MIN becomes ``max(8, devices)``)."""
    auto = config.adaptive_batch
    if auto is None or devices <= 1:
        return config
    if devices & (devices - 1):
        raise ConfigError(f"--batch-size auto doubles the global batch, which stays a multiple "
                          f"of the devices only on a power-of-two count: use --devices "
                          f"{1 << (devices.bit_length() - 1)}. Received: {devices} devices.")
    if auto.minimum is None:
        minimum = max(DEFAULT_MIN_BATCH, devices)
        if auto.maximum is not None:
            if auto.maximum < devices:
                raise ConfigError(f"--batch-size auto MAX {auto.maximum} is below the {devices} "
                                  "devices: each device needs at least one sample.")
            minimum = min(minimum, auto.maximum)
        return replace(config, batch_size=minimum,
                       adaptive_batch=AutoBatchSize(minimum, auto.maximum))
    if auto.minimum < devices:
        raise ConfigError(f"--batch-size auto MIN {auto.minimum} is below the {devices} devices: "
                          f"each device needs at least one sample (use auto:{devices}:... or "
                          "more).")
    return config


def plan_at(plan: TrainPlan, config: Any, batch_size: int, step: int, epoch: int,
            rest_of_epoch: int) -> TrainPlan:
    """The plan of the steps after ``step`` at ``batch_size``: ``rest_of_epoch`` steps left in
    the current ``epoch`` (1-based), then full epochs of the new size."""
    steps = batching.steps_per_epoch(plan.n_train, batch_size)
    if steps < 1:
        raise ConfigError(f"Batch size {batch_size} is larger than the training split "
                          f"({plan.n_train} samples).")
    total = step + rest_of_epoch + (plan.epochs - epoch) * steps
    if config.max_steps:
        total = min(total, config.max_steps)
    fused = min(plan.fused_steps, steps) if plan.fused_steps else DEFAULT_FUSED_STEPS
    return replace(plan, batch_size=batch_size, steps_per_epoch=steps, total_steps=total,
                   fused_steps=min(fused, steps), eval_every=config.eval_every or steps)


class AdaptiveBatch:
    """The growth decisions of one run: the smoothed noise scale, the current size and rate,
    and every step range (``ranges``: ``BatchChange`` from its first step on)."""

    def __init__(self, trainer: Any, config: Any, bounds: BatchBounds, base_rate: float,
                 reporter: Any = None, warmup_steps: int = 10,
                 fused_steps: int = DEFAULT_FUSED_STEPS) -> None:
        self.trainer, self.config, self.bounds = trainer, config, bounds
        self.scaling = config.lr_scaling
        self.base_batch, self.base_rate = bounds.minimum, base_rate
        decay = NoiseScale().decay
        between = getattr(trainer, "calls_between", None)  # (data parallel: every step, as was)
        if between is not None:  # the same memory and warm-up in steps at any spacing
            spacing = 1 if trainer.measure_every <= 1 else between(fused_steps) * fused_steps
            decay, warmup_steps = estimator_settings(spacing)
        self.policy = GrowthPolicy(bounds, warmup_steps)
        self.noise = NoiseScale(decay)
        self.batch_size, self.rate = bounds.minimum, base_rate
        self.interval = 0
        self.last_change: int | None = None
        self.reporter = reporter
        self.ranges = [BatchChange(0, self.batch_size, self.rate, math.nan)]
        trainer.set_learning_rate(self.rate)
        self._announce()

    def observe(self) -> None:
        """Fold in the noise norms of every call fetched since the last look."""
        for batch, micro, big in self.trainer.take_noise_norms():
            self.noise = self.noise.update_steps(micro, big, batch // micro.shape[1], batch)

    def at_evaluation(self, step: int) -> int | None:
        """At an evaluation point (all calls fetched): the new batch size, or None to keep it.
        Sets the trainer's rate for the next steps and records the range."""
        self.observe()
        self.interval += 1
        size = self.policy.decide(self.batch_size, self.noise, self.interval, self.last_change)
        rate = scaled_learning_rate(self.base_rate, size, self.base_batch, self.scaling,
                                    self.noise)
        grown = size != self.batch_size
        if not grown and abs(rate - self.rate) <= ADASCALE_RELATIVE_CHANGE * self.rate:
            return None
        self.trainer.set_learning_rate(rate)
        self.batch_size, self.rate = size, rate
        change = BatchChange(step, size, rate, self.noise.b_simple)
        self.ranges.append(change)
        self._announce()
        if grown:
            self.last_change = self.interval
            console = getattr(self.reporter, "console", None)
            if console is not None:
                console.print(f"{getattr(self.reporter, 'prefix', '')}{change.describe()}")
        return size if grown else None

    def _announce(self) -> None:
        """Tell a reporter that keeps the batch size and rate (TensorBoard's writer) what holds
        from the next step on."""
        changed = getattr(self.reporter, "batch_changed", None)
        if changed is not None:
            changed(self.batch_size, self.rate)

    def next_plan(self, plan: TrainPlan, step: int, epoch: int,
                  consumed: int) -> tuple[TrainPlan, np.ndarray, int] | None:
        """The loop's question at an evaluation point (``consumed`` samples of ``epoch`` used):
        None to go on as planned, else the plan at the grown size, the rest of the epoch's
        order cut into its batches and padded to a whole epoch's rows (so that the size's
        programs, compiled for that shape, serve it), and how many of those rows are real."""
        size = self.at_evaluation(step)
        if size is None:
            return None
        rest = epoch_rest(plan.n_train, size, self.config.seed, epoch - 1, self.config.shuffle,
                          consumed)
        new_plan = plan_at(plan, self.config, size, step, epoch, len(rest))
        self.compile_ahead(new_plan)
        padded = np.zeros((new_plan.steps_per_epoch, size), dtype=rest.dtype)
        padded[: len(rest)] = rest
        return new_plan, padded, len(rest)

    def compile_ahead(self, plan: TrainPlan) -> None:
        """Start compiling the next power of two's call in the background while ``plan``'s
        size trains (where the trainer can: JAX's; ``KBACKEND_ADAPTIVE_AHEAD=0`` turns it
        off)."""
        size = plan.batch_size * 2
        ahead = getattr(self.trainer, "compile_ahead", None)
        if ahead is None or size > self.bounds.maximum or not compile_ahead_enabled():
            return
        steps = batching.steps_per_epoch(plan.n_train, size)
        if steps >= 1:
            ahead(size, min(plan.fused_steps or DEFAULT_FUSED_STEPS, steps), steps)

    def record(self) -> dict[str, Any]:
        """What the run record keeps: bounds, scaling, every step range, the final estimate."""
        def number(value: float) -> float | None:
            return value if math.isfinite(value) else None

        return {"min": self.bounds.minimum, "max": self.bounds.maximum,
                "lr_scaling": self.scaling, "base_rate": self.base_rate,
                "ranges": [{"step": c.step, "batch_size": c.batch_size,
                            "learning_rate": c.learning_rate, "b_simple": number(c.b_simple)}
                           for c in self.ranges],
                "b_simple": number(self.noise.b_simple), "noise_steps": self.noise.steps,
                "grad_sq": number(self.noise.grad_sq),
                "trace_sigma": number(self.noise.trace_sigma)}


# -- MAX: the throughput knee --------------------------------------------------------------
KNEE_PROBE_FORMAT = KNEE.record_format  # format 1 (3 sequential calls per size): measured again
PROBE_ROUNDS = 5  # interleaved rounds per pair of sizes: [min, max] covers the median at 94 %
PROBE_REPEAT_S = 0.05  # each timed repeat runs a size's call this long at least (back to back)
PROBE_BUDGET_S = 30.0  # seconds a probe may take before a noisy pair is no longer re-measured
PROBE_MAX_REMEASURES = 24  # re-measurements of noisy pairs (and of a knee at MIN) per probe
PAIR_MAX_REMEASURES = 4  # ... and per pair, so that one noisy pair leaves the next some
DATA_BOUND_DIVISOR = 32  # MAX where the knee stays unresolved: the training split / 32
PROBE_CLOCK: Clock = time.perf_counter  # the probe's timer (tests slow it on purpose)


def data_bound(n_train: int, minimum: int) -> int:
    """MAX from the data where the knee stays unresolved: the largest power of two at or below
    the training split / ``DATA_BOUND_DIVISOR`` (at least 32 steps per epoch), at least MIN."""
    share = n_train // DATA_BOUND_DIVISOR
    return max(minimum, 1 << (share.bit_length() - 1)) if share >= 1 else minimum


class _KneeProbe:
    """One knee probe: pairs of sizes (s, 2 s) timed interleaved (``measure.time_interleaved``),
    each doubling's gain a median over rounds with its interval (``knee.measured_gain``),
    re-measured within a ``measure.Budget``."""

    def __init__(self, trainer: Any, n_train: int, minimum: int, fused_steps: int, seed: int,
                 clock: Clock, budget_s: float, rounds: int, repeat_s: float) -> None:
        self.trainer, self.n_train, self.minimum = trainer, n_train, minimum
        self.fused_steps, self.seed, self.clock, self.rounds = fused_steps, seed, clock, rounds
        self.repeat_s = repeat_s
        self.budget = Budget(budget_s, PROBE_MAX_REMEASURES, clock)
        self.calls: dict[tuple[int, int], Any] = {}
        self.lengths: dict[int, int] = {}  # each size's call length when last timed

    def call(self, size: int, length: int) -> Any:
        """The trainer's ``length``-step call at ``size``, compiled once (out of memory
        propagates)."""
        if (size, length) not in self.calls:
            rows = self.trainer.put_epoch(batching.epoch_batches(self.n_train, size, self.seed, 0))
            self.trainer.compile(length, rows)
            self.calls[size, length] = lambda: self.trainer.fetch(self.trainer.run(rows, 0, length))
        return self.calls[size, length]

    def measure(self, size: int, previous: dict[int, Timing] | None = None,
                ) -> tuple[MeasuredGain, dict[int, Timing]]:
        """Time ``size`` and ``2 size`` interleaved (equal call lengths), added to
        ``previous`` rounds of the same pair; the gain of the doubling."""
        length = min(self.fused_steps, batching.steps_per_epoch(self.n_train, 2 * size))
        fns = {size: self.call(size, length), 2 * size: self.call(2 * size, length)}
        self.lengths.update(dict.fromkeys(fns, length))
        timings = time_interleaved(fns, self.rounds, wait=lambda value: value, clock=self.clock,
                                   previous=previous, min_seconds=self.repeat_s)
        gain = measured_gain(timings[size], timings[2 * size], size * length,
                             2 * size * length)
        return gain, timings

    def unsettled(self, gain: MeasuredGain) -> bool:
        """Whether a doubling wants more rounds: its interval straddles the threshold, or its
        repeats are unsteady and it has had no re-measurement yet."""
        return gain.straddles or (not gain.steady and gain.rounds < 2 * self.rounds)

    def decide(self, size: int) -> tuple[MeasuredGain, dict[int, Timing]]:
        """The doubling from ``size``, re-measured while unsettled (rounds added) and, where it
        would put the knee at MIN, measured afresh once more before it is trusted."""
        gain, timings = self.settle(size)
        if size == self.minimum and gain.decided and gain.median < DEFAULT_MIN_GAIN \
                and self.budget.take():
            fresh, fresh_timings = self.settle(size)
            if not fresh.decided or fresh.median >= DEFAULT_MIN_GAIN:
                return fresh, fresh_timings  # the first measurement did not hold
        return gain, timings

    def settle(self, size: int) -> tuple[MeasuredGain, dict[int, Timing]]:
        """The doubling from ``size`` measured afresh, then re-measured while unsettled (at
        most ``PAIR_MAX_REMEASURES`` times, within the budget)."""
        gain, timings = self.measure(size)
        for _ in range(PAIR_MAX_REMEASURES):
            if not self.unsettled(gain) or not self.budget.take():
                break
            gain, timings = self.measure(size, timings)
        return gain, timings


def probe_knee(trainer: Any, n_train: int, minimum: int, fused_steps: int, seed: int = 0, *,
               clock: Clock | None = None, budget_s: float = PROBE_BUDGET_S,
               rounds: int = PROBE_ROUNDS, repeat_s: float = PROBE_REPEAT_S) -> dict[str, Any]:
    """The throughput knee of the adaptive trainer's own K-step calls: MIN and 2 MIN timed
    interleaved, then 2 MIN and 4 MIN, ... until a doubling gains less than
    ``DEFAULT_MIN_GAIN`` (the knee), the next size would pass the data bound or the training
    split (``probe_limit``; no plateau: the largest size), a size runs out of device memory
    (the largest that fit, ``out_of_memory_at``), or a doubling stays undecided within the
    budget (``resolved`` False, ``knee`` None): a noisy doubling is re-measured (rounds added)
    while the budget lasts, then decided by its median unless its repeats are unsteady and its
    interval straddles ``DEFAULT_MIN_GAIN`` (``MeasuredGain.decided``). A knee at MIN is
    measured twice. The trainer's state is put back."""
    saved = trainer.state_copy()
    probe = _KneeProbe(trainer, n_train, minimum, fused_steps, seed, clock or PROBE_CLOCK,
                       budget_s, rounds, repeat_s)
    medians: dict[int, Timing] = {}
    gains: list[dict[str, Any]] = []
    size, knee, out_of_memory_at, plateau = minimum, None, None, False
    # A call must fit one epoch (the helper refuses larger); beyond the data bound a batch
    # leaves fewer than 32 steps an epoch, so the probe times no further (its largest calls cost
    # the most) unless that leaves no doubling to time.
    limit = min(n_train, max(data_bound(n_train, minimum), 2 * minimum))
    try:
        while 2 * size <= limit:
            try:
                gain, timings = probe.decide(size)
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                if not probe.calls:
                    raise ConfigError(f"--batch-size auto MIN {minimum} does not fit in device "
                                      f"memory: pass a smaller auto:MIN.") from None
                knee, out_of_memory_at = size, 2 * size
                break
            medians.update(timings)
            gains.append({"from": size, **gain.to_dict()})
            if not gain.decided or gain.median < DEFAULT_MIN_GAIN:
                knee, plateau = (None, False) if not gain.decided else (size, True)
                break
            size *= 2
        else:
            knee = size  # still gaining at the largest size probed: no plateau
    finally:
        trainer.take_noise_norms()
        trainer.restore_state(saved)
    return {**_knee_record(medians, gains, knee, plateau, out_of_memory_at, probe),
            "probe_limit": limit}


def _knee_record(timings: dict[int, Timing], gains: list[dict[str, Any]], knee: int | None,
                 plateau: bool, out_of_memory_at: int | None, probe: _KneeProbe) -> dict[str, Any]:
    sizes = sorted(timings)
    return {"format": KNEE_PROBE_FORMAT, "knee": knee, "resolved": knee is not None,
            "sizes": sizes,
            "samples_per_s": [s * probe.lengths[s] / timings[s].median_s for s in sizes],
            "cv": [timings[s].robust_cv for s in sizes],
            "calls_per_repeat": [timings[s].calls for s in sizes], "gains": gains,
            "noisy": any(g["noisy"] for g in gains), "plateau_reached": plateau,
            "out_of_memory_at": out_of_memory_at, "rounds": probe.rounds,
            "repeat_s": probe.repeat_s,
            **probe.budget.record()}


def distrust_knee(entry: dict[str, Any]) -> str | None:
    """Why a stored knee entry is measured again before use (None: use it)."""
    if entry.get("format") != KNEE_PROBE_FORMAT or not isinstance(entry.get("resolved"), bool):
        return "an older or damaged entry"
    if entry["resolved"] and (type(entry.get("knee")) is not int):
        return "a damaged entry"
    if not entry["resolved"] and "repeat_s" not in entry:
        return "its curve was unresolved by the noise rule before repeats of 50 ms"
    return None  # an unresolved curve keeps its bound from the data until --reprobe


def knee_bound(entry: dict[str, Any], n_train: int, minimum: int) -> tuple[int, str, str]:
    """MAX from a knee probe's record, where it came from (``knee``, ``knee at MIN`` or
    ``data``) and the one line that says so."""
    largest = 1 << (n_train.bit_length() - 1)  # a batch must fit in the training split
    if not entry.get("resolved"):
        bound = min(data_bound(n_train, minimum), largest)
        return bound, "data", (
            f"MAX {bound} from the data (largest power of two <= training split / "
            f"{DATA_BOUND_DIVISOR}): the throughput knee stayed unresolved on this busy machine "
            f"after {entry.get('remeasured', 0)} re-measurements (--reprobe measures it again)")
    knee = min(int(entry["knee"]), largest)
    if knee >= data_bound(n_train, minimum) > minimum and not entry.get("plateau_reached") \
            and not entry.get("out_of_memory_at"):
        return knee, "data", (
            f"MAX {knee} from the data (largest power of two <= training split / "
            f"{DATA_BOUND_DIVISOR}): throughput still gained up to it on this machine")
    if knee <= minimum:
        return knee, "knee at MIN", (
            f"MAX {knee} = MIN: this machine's throughput knee for this model is at MIN "
            "(measured twice), so the batch will not grow; pass auto:MIN:MAX to let it")
    return knee, "knee", f"MAX {knee}: this machine's throughput knee"


def resolve_bounds(auto: AutoBatchSize, trainer: Any, model: Any, dataset: Any, spec: Any,
                   fused_steps: int, jit_compile: bool, seed: int = 0,
                   devices: int = 1) -> tuple[BatchBounds, dict[str, Any] | None]:
    """MIN and MAX of the run (a default MAX measured by ``probe_knee``, once per machine,
    measured again where stored unresolved, older or from elsewhere); the probe's record with
    ``note``, the line that says where MAX came from (None when MAX was given)."""
    n_train = len(dataset.x_train)
    minimum = auto.minimum or DEFAULT_MIN_BATCH
    if auto.maximum is not None:
        return auto.resolved(DEFAULT_MIN_BATCH, auto.maximum), None
    options = {"optimizer": spec.name, "minimum": minimum, "fused_steps": fused_steps,
               "xla": jit_compile, "devices": devices}
    entry = remembered(KNEE, model, dataset, options, distrust=distrust_knee, measure=lambda:
                       probe_knee(trainer, n_train, minimum, fused_steps, seed))
    maximum, source, note = knee_bound(entry, n_train, minimum)
    return auto.resolved(DEFAULT_MIN_BATCH, maximum), {**entry, "bound": source, "note": note}


def epoch_rest(n_train: int, batch_size: int, seed: int, epoch: int, shuffle: bool,
               consumed: int) -> np.ndarray:
    """The epoch's order after its first ``consumed`` samples, cut into full batches."""
    order = batching.epoch_order(n_train, seed, epoch, shuffle)[consumed:]
    steps = len(order) // batch_size
    return order[: steps * batch_size].reshape(steps, batch_size)


def make_trainer(model: Any, dataset: Any, plan: TrainPlan, config: Any) -> Any:
    """The adaptive trainer of ``plan``: micro-batched on one device, the data-parallel one on
    several (``plan.devices``, checked by ``for_devices``)."""
    module = adaptive_backend()
    if plan.devices > 1:
        return module.DataParallelAdaptiveTrainer(model, plan.optimizer, dataset,
                                                  devices=plan.devices,
                                                  batch_size=plan.batch_size,
                                                  dp_impl=config.dp_impl, task=config.task)
    return module.AdaptiveTrainer(model, plan.optimizer, dataset, jit_compile=config.jit_compile,
                                  task=config.task, measure_every=MEASURE_EVERY)


def train(model: Any, dataset: Any, plan: TrainPlan, config: Any,
          reporter: Any = None, trainer: Any = None) -> History:
    """Train ``model`` in place on the native engine (one device, or data parallel over
    ``plan.devices``) with a batch that grows with the measured noise scale
    (``config.adaptive_batch``, ``config.lr_scaling``); the history in kbackend's format, its
    step ranges in ``record.adaptive_batch``. ``trainer``: an ``AdaptiveTrainer`` of ``model``
    already reset to the run's start (``engines.native.Runs``: its sizes' programs are reused,
    and the Keras model is not compiled)."""
    check_adaptive_options(config)
    spec = plan.optimizer
    fused = plan.fused_steps or DEFAULT_FUSED_STEPS
    if trainer is None:
        compile_model(model, spec, config)  # for evaluate/predict/save afterwards (as native's)
        build_optimizer(model)
    backend = impl()
    with backend.compilation_counter() as compiled:
        trainer = trainer or make_trainer(model, dataset, plan, config)
        bounds, probe = resolve_bounds(config.adaptive_batch, trainer, model, dataset, spec,
                                       fused, config.jit_compile, config.seed, plan.devices)
        if bounds.maximum > plan.n_train:
            raise ConfigError(f"--batch-size auto MAX {bounds.maximum} is larger than the "
                              f"training split ({plan.n_train} samples).")
        console = getattr(reporter, "console", None)
        if probe is not None and probe["bound"] != "knee" and console is not None:
            console.print(f"{getattr(reporter, 'prefix', '')}batch size auto: {probe['note']}")
        controller = AdaptiveBatch(trainer, config, bounds, spec.learning_rate, reporter,
                                   fused_steps=fused)
        start_plan = plan_at(replace(plan, fused_steps=fused), config, bounds.minimum, 0, 0, 0)
        history = loop.native_history(spec)
        if plan.devices > 1:  # per-device batch at MIN; each range's is its size / devices
            history.record.devices, history.record.processes = plan.devices, plan.processes
            history.record.per_device_batch = bounds.minimum // plan.devices
        controller.compile_ahead(start_plan)
        history = loop.run(trainer, start_plan, config, reporter, history=history,
                           policy=controller)
        history.test = dict(zip(("test_loss", f"test_{config.task.metric}"),
                                trainer.evaluate_test(), strict=True))
    history.record.xla_programs = compiled
    history.record.adaptive_batch = {
        **controller.record(), "knee_probe": probe,
        "compile_ahead": {"enabled": compile_ahead_enabled(),
                          **getattr(trainer, "ahead_record", {"sizes": 0})},
        "trace_counts_by_size": {f"{size}x{length}": count for (size, length), count
                                 in sorted(trainer.trace_counts_by_size.items())}}
    return history
