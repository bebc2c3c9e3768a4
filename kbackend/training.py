"""Training as a Python API: ``train(TrainConfig(...))`` -> trained model + ``History``.

This is what ``kbackend train`` calls. It loads and validates the data, builds the model,
runs the chosen engine, evaluates on the test split, and optionally saves the model and the
history (atomically).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kbackend import data as data_module
from kbackend.backend import keras as import_keras
from kbackend.errors import ConfigError
from kbackend.history import History
from kbackend.io import atomic_write
from kbackend.models import ModelOptions, build_model, model_layout
from kbackend.optim import OptimizerSpec

MONITORS = ("val_accuracy", "val_loss")


@dataclass(frozen=True)
class Target:
    """Stop training once validation ``metric`` reaches ``value`` (>= for accuracy, <= for loss)."""

    metric: str = "val_accuracy"
    value: float = 0.9

    def __post_init__(self) -> None:
        if self.metric not in MONITORS:
            raise ConfigError(f"Invalid target metric. Expected one of {list(MONITORS)}. Received: {self.metric!r}.")
        if self.metric == "val_accuracy" and not 0.0 < self.value <= 1.0:
            raise ConfigError(
                f"Invalid target val_accuracy={self.value!r}: accuracy can only reach values in (0, 1]."
            )
        if self.metric == "val_loss" and self.value <= 0.0:
            raise ConfigError(f"Invalid target val_loss={self.value!r}: cross-entropy targets must be > 0.")

    def reached(self, record: dict[str, float]) -> bool:
        """Whether an evaluation record meets the target."""
        if self.metric not in record:
            return False
        if self.metric == "val_accuracy":
            return record[self.metric] >= self.value
        return record[self.metric] <= self.value


@dataclass
class TrainConfig:
    """Everything that defines a training run."""

    model: str = "seed_mlp"
    dataset: str = "digits"
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    batch_size: int = 32
    epochs: int = 5
    engine: str = "keras"
    jit_compile: bool = True
    steps_per_execution: int = 1
    early_stopping: int = 0
    monitor: str = "val_accuracy"
    seed: int = 0
    model_options: ModelOptions = field(default_factory=ModelOptions)
    validation_fraction: float = 0.1
    data_dir: str | None = None
    # Steps per compiled call of the native engine (K train steps fused into one device call);
    # 0: chosen by a short measured probe (kbackend.engines.native.probe_fused_steps).
    fused_steps: int = 1
    # Validate every this many steps (0: once per epoch). The Keras engine validates per epoch.
    eval_every: int = 0
    # Stop after this many steps (0: ``epochs`` decides).
    max_steps: int = 0
    # Stop as soon as an evaluation reaches this target (None: train to the end).
    target: Target | None = None
    # --- parallel (issue 6); see kbackend/parallel and docs/parallel.md ---
    # Devices to split each batch over (0: all the job has); > 1 implies data parallelism.
    devices: int = 0
    # Run the data-parallel version of ``engine`` (keras -> keras_data_parallel, native -> data_parallel).
    data_parallel: bool = False
    # How the native data-parallel engine maps the step onto devices: shard_map or pmap.
    dp_impl: str = "shard_map"
    # Split the host CPU into this many virtual devices before the runtime starts (0: leave it).
    virtual_devices: int = 0
    # Multi-process job: this process is ``process_id`` of ``num_processes``; process 0 hosts
    # the coordinator at ``coordinator`` (HOST:PORT).
    num_processes: int = 1
    process_id: int = 0
    coordinator: str | None = None
    # Seconds to wait for the coordinator / a collective; seconds without heartbeat = dead peer.
    coordinator_timeout: int = 60
    heartbeat_timeout: int = 10
    # Keras dtype policy the model is built under: float32, mixed_bfloat16 or mixed_float16.
    precision: str = "float32"
    # Record per-step input wait vs compute, utilization and memory (history.extra["monitor"]).
    hardware_monitor: bool = False

    def __post_init__(self) -> None:
        for name in ("fused_steps", "eval_every", "max_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ConfigError(f"Invalid {name} {getattr(self, name)!r}: expected an integer >= 0.")
        if not isinstance(self.epochs, int) or self.epochs < 1:
            raise ConfigError(f"Invalid epochs {self.epochs!r}: expected a positive integer.")
        if not isinstance(self.steps_per_execution, int) or self.steps_per_execution < 1:
            raise ConfigError(
                f"Invalid steps_per_execution {self.steps_per_execution!r}: expected >= 1."
            )
        if self.early_stopping < 0:
            raise ConfigError(f"Invalid early_stopping patience {self.early_stopping!r}: expected >= 0.")
        if self.monitor not in MONITORS:
            raise ConfigError(f"Invalid monitor. Expected one of {list(MONITORS)}. Received: {self.monitor!r}.")
        from kbackend.parallel import validate_options

        validate_options(self)
        from kbackend.hardware.precision import PRECISIONS

        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"Invalid precision. Expected one of {list(PRECISIONS)}. Received: {self.precision!r}.")
        if self.precision == "mixed_float16" and self.engine != "keras":
            raise ConfigError(
                "mixed_float16 needs loss scaling, which only the keras engine applies "
                f"(LossScaleOptimizer). Received: engine={self.engine!r}; use mixed_bfloat16 or "
                "--engine keras.")
        from kbackend.hardware.monitor import MONITORED_ENGINES

        if self.hardware_monitor and self.engine not in MONITORED_ENGINES:
            raise ConfigError(
                f"The hardware monitor is supported with engines {list(MONITORED_ENGINES)} "
                f"(see docs/hardware.md). Received: engine={self.engine!r}.")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TrainResult:
    """A trained Keras model, its history and the dataset it was trained on."""

    model: Any
    history: History
    dataset: data_module.Dataset


def load_dataset(config: TrainConfig) -> data_module.Dataset:
    """The dataset of ``config`` in the layout its model takes."""
    return data_module.load(
        config.dataset,
        layout=model_layout(config.model),
        data_format=config.model_options.data_format,
        validation_fraction=config.validation_fraction,
        seed=config.seed,
        data_dir=config.data_dir,
    )


def train(
    config: TrainConfig,
    *,
    dataset: data_module.Dataset | None = None,
    model: Any = None,
    reporter: Any = None,
    save: str | os.PathLike | None = None,
    history_path: str | os.PathLike | None = None,
) -> TrainResult:
    """Train ``config.model`` on ``config.dataset`` with ``config.engine``.

    All input checks (data, batch size, options) run before any training starts. ``dataset`` and
    ``model`` may be passed to reuse them; the model is trained in place.
    """
    from kbackend import parallel
    from kbackend.engines import get_engine
    from kbackend.envinfo import environment

    parallel.prepare(config)  # virtual devices, multi-process start-up, device and batch checks
    engine = get_engine(parallel.engine_name(config))
    dataset = dataset if dataset is not None else load_dataset(config)
    data_module.check_batch_size(config.batch_size, len(dataset.x_train))
    if save is not None and not str(save).endswith(".keras"):
        raise ConfigError(f"Invalid --save path {str(save)!r}: expected a file name ending in .keras.")
    steps_per_epoch = -(-len(dataset.x_train) // config.batch_size)
    spec = config.optimizer.with_total_steps(steps_per_epoch * config.epochs)
    if model is None:
        from kbackend.hardware.precision import precision_scope

        with precision_scope(config.precision):
            model = build_model(config.model, dataset.info, config.model_options)
    start = time.perf_counter()
    history = engine(model, dataset, spec, config, reporter)
    history.timing["wall_time"] = time.perf_counter() - start
    test_loss, test_accuracy = model.evaluate(
        dataset.x_test, dataset.y_test, batch_size=max(config.batch_size, 256), verbose=0
    )
    history.test = {"test_loss": float(test_loss), "test_accuracy": float(test_accuracy)}
    history.config = {**config.to_dict(), "optimizer": spec.to_dict(),
                      "dataset_info": dataset.info.to_dict(), "params": int(model.count_params())}
    history.env = environment()
    if save is not None and parallel.is_chief():  # only process 0 writes
        save_model(model, save)
    if history_path is not None and parallel.is_chief():
        history.save(history_path)
    return TrainResult(model, history, dataset)


def save_model(model: Any, path: str | os.PathLike) -> Path:
    """Save ``model`` as a ``.keras`` file, atomically (a crash never leaves a partial file)."""
    import_keras()
    return atomic_write(path, lambda tmp: model.save(tmp))
