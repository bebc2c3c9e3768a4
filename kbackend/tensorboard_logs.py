"""TensorBoard event files: a run's scalars at each evaluation, and a study's HParams experiment.

Written with ``tf.summary`` (tensorflow-cpu writes event files without the ``tensorboard``
package); TensorFlow is imported only when a log folder is asked for, so a JAX run without
``--tensorboard`` never pays its start-up. The HParams plugin's summaries need the
``tensorboard`` package (the ``tensorboard`` extra), checked before any work.

``ScalarWriter`` is a loop reporter (the engines' one per-evaluation hook, ``epoch_end``) that
writes each evaluation's figures and passes every call on to the reporter it wraps.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from kbackend.errors import ConfigError
from kbackend.history import EVAL_POSITIONS
from kbackend.io import check_distinct_paths, check_output_folder
from kbackend.optim import OptimizerSpec, schedule_value

TENSORBOARD_EXTRA = "kbackend[tensorboard]"


def check_logdir(path: str | os.PathLike, flag: str = "--tensorboard",
                 inputs: Mapping[str, Any] | None = None) -> Path:
    """``path`` if it is (or can become) a writable folder that is none of ``inputs``; else a
    one-line ``ConfigError`` (run before any work). Only inputs that exist as paths count (a
    built-in dataset's name is no folder)."""
    existing = {name: value for name, value in (inputs or {}).items()
                if value is not None and _exists(str(value))}
    check_distinct_paths({flag: path}, existing)
    return check_output_folder(path, flag)


def _exists(source: str) -> bool:
    """Whether ``source`` (a path, or ``FILE.py:FUNCTION``) names something on disk."""
    return os.path.exists(source) or os.path.exists(source.rsplit(":", 1)[0])


def require_hparams_plugin() -> None:
    """A one-line ``ConfigError`` when the ``tensorboard`` package (its HParams plugin) is
    missing."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("study --tensorboard writes the HParams plugin's experiment, which "
                          f"needs the tensorboard package: pip install '{TENSORBOARD_EXTRA}'.")


def _tf() -> Any:
    import tensorflow as tf  # deferred: TensorFlow's start-up only where event files are asked for

    return tf


def evaluation_scalars(record: Mapping[str, Any], previous: Mapping[str, Any] | None,
                       batch_size: int, learning_rate: float,
                       auto: bool = False) -> dict[str, float]:
    """The scalars of one evaluation ``record`` (step, train_time, val_loss, val_<metric>,
    train_loss, ...): its finite figures, the learning rate, the batch size (``auto`` runs) and
    the samples per second of training since ``previous`` (None: since the start)."""
    scalars = {k: float(v) for k, v in record.items()
               if k not in EVAL_POSITIONS and isinstance(v, int | float) and not isinstance(v, bool)
               and math.isfinite(float(v))}
    scalars["learning_rate"] = float(learning_rate)
    if auto:
        scalars["batch_size"] = float(batch_size)
    before = previous or {"step": 0, "train_time": 0.0}
    steps = record["step"] - before["step"]
    seconds = record.get("train_time", 0.0) - before.get("train_time", 0.0)
    if steps > 0 and seconds > 0:
        scalars["samples_per_s"] = steps * batch_size / seconds
    return scalars


class ScalarWriter:
    """A loop reporter writing each evaluation's scalars under ``logdir`` (one event file), and
    passing every call to ``inner``. ``batch_changed`` is the ``--batch-size auto`` controller's
    note of a new batch size and rate, which then hold from the next step on."""

    def __init__(self, logdir: str | os.PathLike, spec: OptimizerSpec, batch_size: int,
                 auto: bool = False, inner: Any = None) -> None:
        self.spec, self.batch_size, self.auto, self.inner = spec, batch_size, auto, inner
        self.rate: float | None = None  # set by an auto run's controller
        self.previous: dict[str, Any] | None = None
        self.writer = _tf().summary.create_file_writer(str(logdir))
        self.console = getattr(inner, "console", None)
        self.prefix = getattr(inner, "prefix", "")

    def steps_done(self, *args: Any) -> None:
        live = getattr(self.inner, "steps_done", None)
        if live is not None:
            live(*args)

    def batch_changed(self, batch_size: int, learning_rate: float) -> None:
        self.batch_size, self.rate = batch_size, learning_rate

    def epoch_end(self, epoch: int, epochs: int, record: dict[str, Any]) -> None:
        step = int(record["step"])
        # the schedule's rate at the update that ends at ``step`` (a 1-based count)
        rate = (self.rate if self.rate is not None
                else float(schedule_value(self.spec, max(step - 1, 0), ops=np)))
        scalars = evaluation_scalars(record, self.previous, self.batch_size, rate, self.auto)
        tf = _tf()
        with self.writer.as_default():
            for name, value in scalars.items():
                tf.summary.scalar(name, value, step=step)
        self.writer.flush()
        self.previous = record
        if self.inner is not None:
            self.inner.epoch_end(epoch, epochs, record)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


@contextmanager
def scalar_writer(logdir: str | os.PathLike | None, spec: OptimizerSpec, batch_size: int,
                  auto: bool, inner: Any) -> Iterator[Any]:
    """The reporter a run reports to: a ``ScalarWriter`` around ``inner`` (closed when the run
    ends) where ``logdir`` is given, else ``inner`` itself."""
    if logdir is None:
        yield inner
        return
    writer = ScalarWriter(logdir, spec, batch_size, auto=auto, inner=inner)
    try:
        yield writer
    finally:
        writer.close()


def write_run(logdir: str | os.PathLike, points: Iterable[tuple[int, Mapping[str, float]]],
              hparams: Mapping[str, Any] | None = None,
              metrics: Mapping[str, float | None] | None = None) -> None:
    """One run's folder: its scalars at each step, and (for an HParams experiment) the run's
    hparams and its final metrics at step 0 (those that are None or not finite are left out)."""
    tf = _tf()
    writer = tf.summary.create_file_writer(str(logdir))
    with writer.as_default():
        for step, scalars in points:
            for name, value in scalars.items():
                tf.summary.scalar(name, value, step=step)
        if hparams is not None:
            from tensorboard.plugins.hparams import api as hp  # deferred: the optional extra

            hp.hparams(dict(hparams))
        for name, metric in (metrics or {}).items():
            if metric is not None and math.isfinite(metric):
                tf.summary.scalar(name, metric, step=0)
    writer.flush()
    writer.close()


def write_experiment(logdir: str | os.PathLike, hparams: Mapping[str, list[Any]],
                     metrics: Mapping[str, str]) -> None:
    """The HParams experiment at ``logdir``'s top: each hparam with its values, each metric
    (tag -> display name)."""
    tf = _tf()
    from tensorboard.plugins.hparams import api as hp  # deferred: the optional extra

    writer = tf.summary.create_file_writer(str(logdir))
    with writer.as_default():
        hp.hparams_config(
            hparams=[hp.HParam(name, hp.Discrete(sorted(set(values))))
                     for name, values in hparams.items()],
            metrics=[hp.Metric(tag, display_name=name) for tag, name in metrics.items()])
    writer.flush()
    writer.close()
