"""A training run's configuration and every check that can fail, run once before any work.

``TrainConfig`` checks each field on construction (types, ranges, names). ``check_run`` checks
what needs the data and the engine too (batch size against the training split and the devices,
fused steps against the engine and the epoch), and ``check_output_path`` (``kbackend.io``) that
a file can be written where the user asked, so that a bad value is a one-line error in the first
second, never a run lost after training.
"""

from __future__ import annotations

import numbers
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kbackend.adaptive import DEFAULT_MIN_BATCH, LR_SCALINGS, AutoBatchSize, parse_batch_size
from kbackend.data import check_batch_size
from kbackend.data.user import check_image_size
from kbackend.engine_facts import (
    DEFAULT_ENGINE,
    FACTS,
    EngineFacts,
    engine_facts,
    engines_where,
)
from kbackend.errors import ConfigError, check_declared, declared
from kbackend.models import ModelOptions
from kbackend.optim import OptimizerSpec
from kbackend.precision import PRECISIONS
from kbackend.task import CLASSIFICATION, Task, metric_direction, reaches

DP_IMPLS = ("shard_map", "pmap")
_COORDINATOR = re.compile(r"^[A-Za-z0-9_.\-]+:\d{1,5}$|^\[[0-9A-Fa-f:]+\]:\d{1,5}$")

# The built-in models' validation metrics; a user model's are ``val_loss`` and ``val_<its
# metric>`` (``kbackend.task``), checked against its task by ``check_run``.
MONITORS = ("val_accuracy", "val_loss")
# What ``kbackend.training.train`` does when a loss becomes NaN or infinite (the run stops either
# way, and no model is saved): raise ``Diverged``, or return the history with
# ``record.diverged`` (a study records the run as diverged and goes on).
DIVERGENCE_ACTIONS = ("raise", "record")


def check_validation_metric(what: str, metric: Any) -> None:
    """A target's or early stopping's metric: a validation metric whose direction is known."""
    if not isinstance(metric, str) or not metric.startswith("val_"):
        raise ConfigError(f"Invalid {what} {metric!r}: expected a validation metric such as "
                          "val_accuracy, val_loss or val_mae.")
    metric_direction(metric)  # an unknown direction is a one-line error


# When a target counts as reached, read from the evaluations so far (docs/study.md, "A crossing
# that holds"): ``first``, the first evaluation at or past it; ``mean2``, the mean of the last two
# evaluations (one lucky evaluation must be matched by the one before it); ``hold2``, the last
# two evaluations both.
CROSSING_RULES = ("first", "mean2", "hold2")
DEFAULT_CROSSING = "mean2"


@dataclass(frozen=True)
class Target:
    """Stop training once validation ``metric`` reaches ``value`` (>= where larger is better,
    <= for losses and errors: ``kbackend.task.metric_direction``), read by the ``crossing``
    rule (``CROSSING_RULES``)."""

    metric: str = "val_accuracy"
    value: float = field(default=0.9, metadata=declared(numbers.Real, finite=True,
                                                        shown="target value"))
    crossing: str = field(default=DEFAULT_CROSSING, metadata=declared(
        str, choices=CROSSING_RULES, shown="target crossing"))

    def __post_init__(self) -> None:
        check_declared(self)
        check_validation_metric("target metric", self.metric)
        if self.metric.endswith("accuracy") and not 0.0 < self.value <= 1.0:
            raise ConfigError(f"Invalid target {self.metric}={self.value!r}: accuracy can only "
                              "reach values in (0, 1].")
        if metric_direction(self.metric) == "min" and self.value <= 0.0:
            raise ConfigError(f"Invalid target {self.metric}={self.value!r}: a loss or error "
                              "target must be > 0.")

    @property
    def direction(self) -> str:
        """``"max"`` or ``"min"``: which way the metric improves."""
        return metric_direction(self.metric)

    def reached(self, record: dict[str, float]) -> bool:
        """Whether an evaluation record meets the target."""
        return self.metric in record and reaches(self.metric, record[self.metric], self.value)

    def reached_in(self, evals: Sequence[Mapping[str, Any]]) -> bool:
        """Whether the evaluations so far (oldest first) reach the target by its ``crossing``
        rule; the last one must carry the metric."""
        if not evals or self.metric not in evals[-1]:
            return False
        # the last two evaluations at most: read at every evaluation, so never the whole list
        values = [float(e[self.metric]) for e in evals[-2:] if self.metric in e]
        if self.crossing == "first":
            return reaches(self.metric, values[-1], self.value)
        if self.crossing == "mean2":
            return reaches(self.metric, sum(values[-2:]) / len(values[-2:]), self.value)
        return len(values) >= 2 and all(reaches(self.metric, v, self.value) for v in values[-2:])


# More epochs than any run needs; the step count (epochs x steps per epoch) must also stay
# below 2**31, JAX's int32 optimizer step (checked by ``check_run``).
MAX_EPOCHS = 1_000_000
MAX_STEPS = 2**31 - 1
# Seeds reach numpy.random.seed, which takes 0 <= seed < 2**32.
MAX_SEED = 2**32 - 1
# The longest timeout a flag may set (seconds): beyond about 9e9 s socket and thread waits raise
# OverflowError (a traceback after the job started); no wait of a run needs more than a week.
MAX_TIMEOUT_S = 7 * 24 * 3600
_TIMEOUT = declared(int, low=1, high=MAX_TIMEOUT_S, why="seconds, a week")


# The engines a run can name (``kbackend.engine_facts``): the declared choice of both configs
# and of their ``--engine`` flags.
ENGINE_CHOICES = tuple(FACTS)
# How a learning rate follows an adaptive batch (``kbackend.adaptive``), in both configs.
LR_SCALING = declared(str, choices=LR_SCALINGS, shown="--lr-scaling")
_SEED_RANGE = "NumPy's seed range"
_COUNT = declared(int, low=0)
_STR, _BOOL, _STR_OR_NONE = declared(str), declared(bool), declared((str, type(None)))


@dataclass
class TrainConfig:
    """Everything that defines a training run. Each field's type, bounds and choices are
    declared beside it (``errors.declared``) and checked by ``errors.check_declared``; the rules
    between fields are the ``_check_*`` methods."""

    model: str = field(default="seed_mlp", metadata=_STR)
    dataset: str = field(default="digits", metadata=_STR)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec,
                                     metadata=declared(OptimizerSpec))
    # A number, or ``"auto"`` / ``"auto:MIN:MAX"`` (``kbackend.adaptive``): the batch grows with
    # the measured gradient noise scale; ``batch_size`` is then MIN and ``adaptive_batch`` holds
    # the bounds.
    batch_size: int = field(default=32, metadata=declared(numbers.Integral))
    epochs: int = field(default=5, metadata=declared(int, low=1, high=MAX_EPOCHS))
    engine: str = field(default=DEFAULT_ENGINE, metadata=declared(str, choices=ENGINE_CHOICES))
    jit_compile: bool = field(default=True, metadata=_BOOL)
    steps_per_execution: int = field(default=1, metadata=declared(int, low=1))
    early_stopping: int = field(default=0, metadata=declared(
        numbers.Integral, low=0, why="patience, 0: off"))
    monitor: str = field(default="val_accuracy", metadata=_STR)
    seed: int = field(default=0, metadata=declared(int, low=0, high=MAX_SEED, why=_SEED_RANGE))
    model_options: ModelOptions = field(default_factory=ModelOptions,
                                        metadata=declared(ModelOptions))
    validation_fraction: float = field(default=0.1, metadata=declared(
        (int, float), low=0, high=1, open_high=True,
        why="0: no validation split, the test split stands in"))
    data_dir: str | None = field(default=None, metadata=declared((str, os.PathLike, type(None))))
    # Steps per compiled call of the native engine (K train steps fused into one device call);
    # 0: chosen by a short measured probe (kbackend.engines.native.probe_fused_steps); only
    # the engines that fuse steps (native, data_parallel) take a value other than 1..
    fused_steps: int = field(default=1, metadata=_COUNT)
    # Validate every this many steps (0: once per epoch). The Keras engine validates per epoch.
    eval_every: int = field(default=0, metadata=_COUNT)
    # Stop after this many steps (0: ``epochs`` decides).
    max_steps: int = field(default=0, metadata=_COUNT)
    # Each epoch's batches in a fresh order drawn from the seed; False: the dataset's own order
    # every epoch (the MNIST-1D paper's recipe; reproducing runs that did not shuffle).
    shuffle: bool = field(default=True, metadata=_BOOL)
    # Stop as soon as an evaluation reaches this target (None: train to the end).
    target: Target | None = field(default=None, metadata=declared((Target, type(None))))
    # Parallel runs (kbackend.distributed, docs/parallel.md).
    # Devices to split each batch over (0: all the job has); > 1 implies data parallelism.
    devices: int = field(default=0, metadata=declared(int, low=0, why="0: all"))
    # Run the data-parallel version of ``engine`` (keras -> keras_data_parallel,
    # native -> data_parallel).
    data_parallel: bool = field(default=False, metadata=_BOOL)
    # How the native data-parallel engine maps the step onto devices: shard_map or pmap.
    dp_impl: str = field(default="shard_map", metadata=declared(str, choices=DP_IMPLS))
    # Split the host CPU into this many virtual devices before the runtime starts (0: leave it).
    virtual_devices: int = field(default=0, metadata=declared(int, low=0, why="0: none"))
    # Multi-process job: this process is ``process_id`` of ``num_processes``; process 0 hosts
    # the coordinator at ``coordinator`` (HOST:PORT).
    num_processes: int = field(default=1, metadata=declared(int, low=1))
    process_id: int = field(default=0, metadata=declared(int))
    coordinator: str | None = field(default=None, metadata=_STR_OR_NONE)
    # Seconds to wait for the coordinator / a collective; seconds without heartbeat = dead peer.
    coordinator_timeout: int = field(default=60, metadata=_TIMEOUT)
    heartbeat_timeout: int = field(default=10, metadata=_TIMEOUT)
    # Keras dtype policy the model is built under: float32, mixed_bfloat16 or mixed_float16.
    precision: str = field(default="float32", metadata=declared(str, choices=PRECISIONS))
    # Record per-step input wait vs compute, utilization and memory (history.record.monitor).
    hardware_monitor: bool = field(default=False, metadata=_BOOL)
    # On a NaN / infinite loss: "raise" ``kbackend.errors.Diverged`` or "record" it and return.
    on_divergence: str = field(default="raise",
                               metadata=declared(str, choices=DIVERGENCE_ACTIONS))
    # The loss every engine trains and the metric it reports (``kbackend.task``): the built-in
    # models' softmax classification, or a user model's compiled (or inferred) task.
    task: Task = field(default=CLASSIFICATION, metadata=declared(Task))
    # A user data source's label column (CSV), and how a .keras model is loaded: with its
    # Lambda layers' code (unsafe), and from its saved weights instead of fresh ones.
    label: str | None = field(default=None, metadata=_STR_OR_NONE)
    unsafe_deserialization: bool = field(default=False, metadata=_BOOL)
    from_weights: bool = field(default=False, metadata=_BOOL)
    # An image folder's (height, width) to read every image at (None: the first image's size).
    image_size: tuple[int, int] | None = None
    # ``batch_size="auto[:MIN:MAX]"`` (set from it): the adaptive batch size's bounds, and how
    # the learning rate (the rate at MIN) follows the batch (``adaptive.LR_SCALINGS``).
    adaptive_batch: AutoBatchSize | None = field(default=None, metadata=declared(
        (AutoBatchSize, type(None)), why="pass batch_size='auto[:MIN:MAX]'"))
    lr_scaling: str = field(default="sqrt", metadata=LR_SCALING)

    def __post_init__(self) -> None:
        if isinstance(self.batch_size, str | AutoBatchSize):  # "auto[:MIN:MAX]" or a number
            parsed = (self.batch_size if isinstance(self.batch_size, AutoBatchSize)
                      else parse_batch_size(self.batch_size))
            if isinstance(parsed, AutoBatchSize):
                self.adaptive_batch = parsed
                self.batch_size = parsed.minimum or DEFAULT_MIN_BATCH
            else:
                self.batch_size = parsed
        check_declared(self)
        if self.image_size is not None:
            check_image_size(self.image_size)
        check_validation_metric("monitor", self.monitor)
        self._check_selection_split()
        self.check_processes()
        self._check_auto_batch()
        self._check_engine_supports()

    def _check_selection_split(self) -> None:
        """Early stopping and targets select on the validation split, never on the test split."""
        if self.validation_fraction == 0 and (self.early_stopping or self.target is not None):
            raise ConfigError("validation_fraction 0 validates on the test split: early stopping "
                              "and targets would select on the test set; hold out a validation "
                              "split.")

    def check_processes(self) -> None:
        """A multi-process job: this process's id among them, and the coordinator's address."""
        if not 0 <= self.process_id < self.num_processes:
            raise ConfigError(
                f"Invalid process_id {self.process_id!r}: expected an integer in "
                f"[0, {self.num_processes}) for num_processes={self.num_processes}.")
        if self.num_processes > 1:
            if not self.coordinator or not _COORDINATOR.match(self.coordinator):
                raise ConfigError(
                    f"Invalid coordinator {self.coordinator!r}: multi-process training needs "
                    "--coordinator HOST:PORT (e.g. 127.0.0.1:12355).")
            port = int(self.coordinator.rsplit(":", 1)[1])
            if not 0 < port < 65536:
                raise ConfigError(f"Invalid coordinator port {port}: expected 1-65535.")

    def _check_auto_batch(self) -> None:
        """``--batch-size auto``: the native engine in one process, a constant learning rate."""
        if self.adaptive_batch is None:
            return
        if not engine_facts(self.engine).auto_batch or self.num_processes > 1:
            raise ConfigError("--batch-size auto runs on the native engine in one process (one "
                              "device, or data parallel with --devices N): use --engine native "
                              "without --num-processes.")
        spec = self.optimizer
        if spec.schedule != "constant" or spec.warmup_steps:
            raise ConfigError("--batch-size auto grows the batch instead of a learning-rate "
                              "schedule: use --schedule constant without warm-up.")

    def _check_engine_supports(self) -> None:
        """What only some engines do: loss scaling (mixed_float16), the hardware monitor."""
        facts = engine_facts(self.engine)
        if self.precision == "mixed_float16" and not facts.loss_scaling:
            raise ConfigError(
                "mixed_float16 needs loss scaling, which only the keras engine applies "
                f"(LossScaleOptimizer). Received: engine={self.engine!r}; use mixed_bfloat16 or "
                "--engine keras.")
        if self.hardware_monitor and not facts.monitored:
            raise ConfigError(
                f"The hardware monitor is supported with engines {engines_where('monitored')} "
                f"(see docs/hardware.md). Received: engine={self.engine!r}.")

    def to_dict(self) -> dict[str, Any]:
        # (the task's Loss object is not copied: its description is what a history keeps)
        return {**asdict(replace(self, task=CLASSIFICATION)), "task": self.task.to_dict()}

    @property
    def metrics(self) -> tuple[str, ...]:
        """The validation metrics every engine reports for this run's task."""
        return ("val_loss", f"val_{self.task.metric}")


def check_metrics(config: TrainConfig) -> None:
    """A target or early-stopping metric the run's task does not report: a one-line error
    listing those it does (before any work)."""
    asked = [("target", config.target.metric)] if config.target is not None else []
    if config.early_stopping:
        asked.append(("early-stopping", config.monitor))
    for what, metric in asked:
        if metric not in config.metrics:
            raise ConfigError(f"Unknown {what} metric {metric!r} for this model: it reports "
                              f"{', '.join(config.metrics)} ({config.task.describe()}).")


def check_run(config: TrainConfig, n_train: int, engine: EngineFacts,
              devices: int = 1) -> None:
    """Everything about ``config`` that needs the data and the engine, checked before any work.

    ``engine``: the facts of the engine that will run (``config.engine``'s data-parallel twin
    in a parallel run); ``devices`` the devices each global batch is split over.
    """
    check_batch_size(config.batch_size, n_train)
    check_metrics(config)
    per_epoch = engine.steps_per_epoch(n_train, config.batch_size)
    total = per_epoch * config.epochs
    if total > MAX_STEPS:
        raise ConfigError(f"Invalid epochs {config.epochs:,}: {total:,} steps, more than "
                          f"{MAX_STEPS:,} (the optimizer's int32 step count).")
    if devices > 1 or config.num_processes > 1:
        check_batch_split(config.batch_size, devices, config.num_processes)
    if not engine.fuses_steps:
        if config.eval_every and config.eval_every % per_epoch:
            raise ConfigError(
                f"Invalid --eval-every {config.eval_every}: the {config.engine} engine validates "
                f"once per epoch ({per_epoch} steps); use a multiple of {per_epoch} or "
                "--engine native.")
        if config.fused_steps != 1:
            shown = "auto" if config.fused_steps == 0 else config.fused_steps
            raise ConfigError(
                f"Invalid --fused-steps {shown}: the {config.engine} engine runs one step per "
                "call; use --engine native to fuse steps, or --steps-per-execution with Keras fit.")
    # K against the epoch: ``engines.plan.TrainPlan.of``, which ``Engine.plan`` runs next.


def check_batch_split(batch_size: int, devices: int, processes: int = 1) -> int:
    """The per-device batch; ``ConfigError`` naming both numbers unless the split is even."""
    if batch_size % devices:
        raise ConfigError(
            f"Global batch size {batch_size} does not divide evenly over {devices} devices: "
            f"use a batch size that is a multiple of {devices} "
            f"(e.g. {devices * max(1, batch_size // devices)})."
        )
    if batch_size % processes:
        raise ConfigError(
            f"Global batch size {batch_size} does not divide evenly over {processes} processes."
        )
    return batch_size // devices
