"""Training as a Python API: ``train(TrainConfig(...))`` -> trained model + ``History``.

This is what ``kbackend train`` calls. It loads and validates the data, builds the model,
runs the chosen engine, evaluates on the test split, and optionally saves the model and the
history (atomically).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kbackend import data as data_module
from kbackend import distributed
from kbackend.backend_choice import keras as import_keras
from kbackend.config import MONITORS, Target, TrainConfig, check_metrics
from kbackend.engines import Engine, get_engine
from kbackend.engines import adaptive as adaptive_engine
from kbackend.engines.plan import TrainPlan
from kbackend.envinfo import environment
from kbackend.errors import ConfigError, Diverged
from kbackend.history import History
from kbackend.io import atomic_write, check_output_path
from kbackend.model_sources import parse_model_source
from kbackend.precision import precision_scope
from kbackend.task import MultiOutputTask, Task
from kbackend.tensorboard_logs import check_logdir, scalar_writer
from kbackend.workload import Workload, prepare_workload, unwrap

__all__ = ["MONITORS", "Diverged", "Target", "TrainConfig", "TrainResult", "save_model",
           "train", "workload_of"]

# How each place a divergence can show (``history.record.diverged["seen_in"]``) is reported.
_DIVERGENCE_SIGNS = {
    "train_loss": "the train loss became {loss}",
    "test_loss": "the test loss became {loss}",
    "weights": "the trained weights became NaN or infinite",
}


@dataclass
class TrainResult:
    """A trained Keras model, its history, the dataset it was trained on and the configuration
    it ran with (its ``task`` the one the engines trained)."""

    model: Any
    history: History
    dataset: data_module.Dataset
    config: TrainConfig | None = None


def workload_of(config: TrainConfig) -> Workload:
    """The ``Workload`` (model source, data, task) ``config``'s model and dataset name."""
    return prepare_workload(
        config.model, config.dataset, label=config.label, image_size=config.image_size,
        validation_fraction=config.validation_fraction, seed=config.seed,
        data_dir=config.data_dir, options=config.model_options,
        target_metric=config.target.metric if config.target is not None else None,
        unsafe_deserialization=config.unsafe_deserialization, from_weights=config.from_weights)


def for_task(config: TrainConfig, task: Task, *, target: float | None,
             target_metric: str | None, monitor: str | None) -> TrainConfig:
    """``config`` training ``task`` (its workload's), its metrics checked (``check_metrics``):
    the ``target`` value on ``target_metric``, and early stopping on ``monitor``, each by
    default the task's own metric (``val_`` + ``task.metric``; a monitor not named follows the
    target's metric). The rule of both front doors, ``kbackend train`` and ``kbackend.train``."""
    metric = target_metric or f"val_{task.metric}"
    config = replace(config, task=task, target=None if target is None else Target(metric, target),
                     monitor=monitor or metric)
    check_metrics(config)
    return config


def _test_results(model: Any, dataset: Any, config: TrainConfig,
                  test: dict[str, float]) -> dict[str, float]:
    """The test split's loss and metric: the native engines' own (``test``), else Keras's
    ``evaluate``; a multi-output task's per-output losses and metrics beside them, named as
    Keras's ``evaluate`` names them (``test_kind_loss``, ``test_size_mae``)."""
    batch_size = max(config.batch_size, 256)
    if not test:  # the Keras engines: compiled with the task's loss and metrics
        results = model.evaluate(dataset.x_test, config.task.fit_labels(dataset.y_test),
                                 batch_size=batch_size, verbose=0, return_dict=True)
        return {f"test_{key}": float(value) for key, value in results.items()}
    if isinstance(config.task, MultiOutputTask):
        outputs = model.predict(dataset.x_test, batch_size=batch_size, verbose=0)
        return {**config.task.output_results(outputs, dataset.y_test, "test"), **test}
    return test


def train(
    config: TrainConfig,
    *,
    dataset: data_module.Dataset | None = None,
    model: Any = None,
    reporter: Any = None,
    save: str | os.PathLike | None = None,
    history_path: str | os.PathLike | None = None,
    workload: Workload | None = None,
    tensorboard: str | os.PathLike | None = None,
) -> TrainResult:
    """Train ``config.model`` on ``config.dataset`` with ``config.engine``.

    Every check that can fail (options, output paths, data, batch size against the data and the
    devices, fused steps against the engine) runs before any training starts. ``dataset`` and
    ``model`` may be passed to reuse them; the model is trained in place. The model and data
    ``config`` names (built-in names, ``.keras`` files, builders, data sources alike) are
    prepared as a ``Workload`` (``kbackend.workload``), or passed as one; its task (the
    compiled loss and metric) replaces ``config.task``.

    A run whose train loss becomes NaN or infinite stops (at most one compiled call late) and
    saves no model; the history, if asked for, is written with ``record.diverged``. Then
    ``Diverged`` is raised, or with ``config.on_divergence == "record"`` the result returned.
    ``tensorboard``: a folder for TensorBoard event files, the scalars of every evaluation.
    """
    _check_request(config, dataset, save=save, history_path=history_path,
                   tensorboard=tensorboard)
    engine = get_engine(distributed.engine_name(config))
    distributed.prepare(config)  # virtual devices, multi-process start-up, device checks
    run = _prepare(engine, config, dataset=dataset, model=model, workload=workload)
    history = _train_and_test(engine, run, reporter, tensorboard)
    diverged = (history.record.diverged
                or non_finite_result(run.model, history, check_weights=save is not None))
    if diverged:
        history.record.diverged = diverged
    # Only process 0 writes; the small history first, so a full disk loses the least.
    if history_path is not None and distributed.is_chief():
        history.save(history_path)
    model = unwrap(run.model)  # the user's own model (named inputs: without kbackend's front)
    if save is not None and distributed.is_chief() and not diverged:
        save_model(model, save)
    if diverged and run.config.on_divergence == "raise":
        raise _diverged_error(diverged, run.config, history_path)
    return TrainResult(model, history, run.dataset, run.config)


@dataclass(frozen=True)
class _Run:
    """What a run trains, settled before training starts: the configuration (a workload's task,
    ``--batch-size auto``'s checks applied), the dataset, the model and the engine's plan."""

    config: TrainConfig
    dataset: data_module.Dataset
    model: Any
    plan: TrainPlan


def _check_request(config: TrainConfig, dataset: data_module.Dataset | None, *,
                   save: str | os.PathLike | None, history_path: str | os.PathLike | None,
                   tensorboard: str | os.PathLike | None) -> None:
    """The checks of ``train``'s own arguments: the config's type, the output paths, and a
    dataset built in Python (which skipped ``load()``'s checks)."""
    if not isinstance(config, TrainConfig):
        raise ConfigError(f"Invalid config: expected a kbackend.training.TrainConfig. Received: "
                          f"{type(config).__name__}.")
    if save is not None:
        check_output_path(save, "--save", suffix=".keras")
    if history_path is not None:
        check_output_path(history_path, "--history")
    if tensorboard is not None:
        check_logdir(tensorboard, inputs={"--data": config.dataset, "--model": config.model,
                                          "--save": save, "--history": history_path})
    if dataset is not None:  # one built in Python skipped load()'s checks
        data_module.validate_dataset(dataset)


def _prepare(engine: Engine, config: TrainConfig, *, dataset: data_module.Dataset | None,
             model: Any, workload: Workload | None) -> _Run:
    """The run's dataset, plan and model, each checked before the next (the model's training
    state against memory before it is built). One path for every model and dataset, built-in
    names included: a ``Workload`` (prepared here from ``config`` unless passed), its task
    trained; or, for a ``dataset`` passed, ``config.model``'s source built on it."""
    if workload is None and dataset is None:
        with precision_scope(config.precision):
            workload = workload_of(config)
    if workload is not None:
        config, dataset = replace(config, task=workload.task), workload.dataset
    assert dataset is not None
    devices = distributed.device_count(config) if distributed.is_parallel(config) else 1
    config = adaptive_engine.for_devices(config, devices)  # --batch-size auto's checks
    # Every number from the batch size to the step, once, after the checks (``Engine.plan``).
    plan = engine.plan(config, len(dataset.x_train), devices)
    if model is None:  # a source checks the model's training state before building it
        with precision_scope(config.precision):
            model = (workload.build(config.seed) if workload is not None else
                     _builtin_source(config).build(dataset.info, config.model_options))
    return _Run(config, dataset, model, plan)


def _builtin_source(config: TrainConfig) -> Any:
    """``config.model``'s source for a ``dataset`` passed alone: a built-in model only. A user's
    model trains its compiled task, read from it when its workload is prepared (``workload=``);
    built here on a bare dataset it would train ``config.task`` instead."""
    source = parse_model_source(config.model)
    if source.own_task:
        raise ConfigError(f"train(config, dataset=...) builds a built-in model only; for "
                          f"{config.model!r} pass model= or workload= (kbackend.workload).")
    return source


def _train_and_test(engine: Engine, run: _Run, reporter: Any,
                    tensorboard: str | os.PathLike | None) -> History:
    """Train ``run`` with ``engine`` (or the adaptive batch's loop), timed, then evaluate on the
    test split; the history holds the run's configuration and environment."""
    config, plan, model, dataset = run.config, run.plan, run.model, run.dataset
    start = time.perf_counter()
    with scalar_writer(tensorboard if distributed.is_chief() else None, plan.optimizer,
                       plan.batch_size, config.adaptive_batch is not None, reporter) as reporter:
        if config.adaptive_batch is not None:  # the native engines with a growing batch
            history = adaptive_engine.train(model, dataset, plan, config, reporter)
        else:
            history = engine(model, dataset, plan, config, reporter)
    history.timing["wall_time"] = time.perf_counter() - start
    history.test = _test_results(model, dataset, config, history.test)
    history.config = {**config.to_dict(), "optimizer": plan.optimizer.to_dict(),
                      "dataset_info": dataset.info.to_dict(), "params": int(model.count_params())}
    history.env = environment()
    return history


def _diverged_error(diverged: dict[str, Any], config: TrainConfig,
                    history_path: str | os.PathLike | None) -> Diverged:
    """The error that reports ``diverged`` (``history.record.diverged``) to the user."""
    written = f"; the history was written to {history_path}" if history_path is not None else ""
    seen_in = diverged.get("seen_in", "train_loss")
    what = _DIVERGENCE_SIGNS[seen_in].format(loss=diverged["loss"])
    return Diverged(
        f"Training diverged at step {diverged['step']}: {what}. "
        f"Expected finite losses; lower the learning rate (received lr="
        f"{config.optimizer.learning_rate:g}) or add warmup. No model was saved{written}.",
        step=int(diverged["step"]))


def non_finite_result(model: Any, history: History, *,
                      check_weights: bool) -> dict[str, Any] | None:
    """The divergence the engine's losses did not show: a NaN test loss, or (when the model is to
    be saved) NaN weights after a last step whose loss was still finite; None if all is finite."""
    test_loss = history.test.get("test_loss", 0.0)
    if not math.isfinite(test_loss):
        return {"step": history.steps_run, "loss": str(test_loss), "seen_in": "test_loss"}
    if check_weights and not all(np.isfinite(np.asarray(w)).all() for w in model.get_weights()):
        return {"step": history.steps_run, "loss": None, "seen_in": "weights"}
    return None


def save_model(model: Any, path: str | os.PathLike) -> Path:
    """Save ``model`` as a ``.keras`` file, atomically (a crash never leaves a partial file)."""
    import_keras()
    return atomic_write(path, lambda tmp: model.save(tmp))
