"""The training history every engine returns, in one format.

Per step: the step number (1-based), the train loss of that step and the cumulative training
wall time at its end. Per evaluation: validation loss and accuracy with the step, epoch and
training time when it was taken. Training time excludes evaluation, as MLCommons AlgoPerf does.
What the engine reports about the run itself (K, steps per epoch, a divergence, the target's
step, the monitor's summary, ...) is the typed ``RunRecord`` in ``history.record``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from kbackend.io import atomic_write_json, read_json
from kbackend.task import best_of

# Evaluation entries that say where it was taken, not what it measured.
EVAL_POSITIONS = ("step", "epoch", "train_time")


@dataclass
class RunRecord:
    """What an engine reports about a run, each field None where it does not apply.

    Nested values (``diverged``, ``target_reached``, ``monitor``, ...) are JSON dicts: they are
    stored with the history as they are.
    """

    engine: str | None = None  # "native" or "data_parallel" (the trainer that ran)
    decay_steps: int | None = None  # the schedule's horizon
    fused_steps: int | None = None  # K as run
    fused_steps_asked: int | None = None  # K asked, where a trainer capped it
    fused_steps_probe: dict[str, Any] | None = None  # ``--fused-steps auto``'s measurements
    steps_per_epoch: int | None = None
    eval_every: int | None = None
    dropped_per_epoch: int | None = None  # samples each epoch leaves out
    epochs_run: int | None = None
    trace_counts: dict[str, int] | None = None  # compilations per call length
    xla_programs: dict[str, Any] | None = None  # XLA programs compiled by the run
    trainers_built: int | None = None  # ``Runs``: trainers (program sets) built so far
    population: dict[str, int] | None = None  # {"members", "index"} of a vmapped population
    # {"step", "loss", "seen_in"}: the first non-finite loss (train_loss, test_loss, weights)
    diverged: dict[str, Any] | None = None
    target_reached: dict[str, Any] | None = None  # {"step", "epoch", "train_time"}
    censored_at: int | None = None  # a population member stopped by the study's pruner
    monitor: dict[str, Any] | None = None  # ``--monitor``'s summary
    losses_are_execution_means: bool | None = None  # Keras fit with steps_per_execution > 1
    unrolled_loop: bool | None = None  # the trainer writes its K steps out
    xla: bool | None = None  # the native loop compiled with XLA
    # data parallel
    devices: int | None = None
    per_device_batch: int | None = None
    processes: int | None = None
    dp_impl: str | None = None
    replica_xla: bool | None = None
    losses_are_global_batch_means: bool | None = None
    validation_dropped: int | None = None
    # ``--batch-size auto``: bounds, LR scaling and every step range (batch size, rate, B_simple)
    adaptive_batch: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set, as JSON values."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> RunRecord:
        """A record from ``to_dict``'s output, or from the ``extra`` dict of a history written
        before the record existed (keys it does not know are left out)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    def update(self, other: RunRecord) -> None:
        """Take every field ``other`` sets."""
        for name, value in other.to_dict().items():
            setattr(self, name, value)


@dataclass
class History:
    """Loss trajectory, evaluations, test metrics and the run's configuration and environment."""

    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    time: list[float] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)
    test: dict[str, float] = field(default_factory=dict)
    timing: dict[str, float] = field(default_factory=dict)
    stopped_early: bool = False
    config: dict[str, Any] = field(default_factory=dict)
    env: dict[str, Any] = field(default_factory=dict)
    record: RunRecord = field(default_factory=RunRecord)

    def record_steps(self, steps: list[int], losses: list[float], times: list[float]) -> None:
        """Append per-step losses and their cumulative training times."""
        self.step.extend(int(s) for s in steps)
        self.loss.extend(float(v) for v in losses)
        self.time.extend(float(t) for t in times)

    def record_eval(self, **values: float) -> None:
        """Append one evaluation (e.g. step, epoch, train_time, val_loss, val_accuracy)."""
        self.evals.append({k: (float(v) if isinstance(v, float) else v) for k, v in values.items()})

    @property
    def history(self) -> dict[str, list[float]]:
        """Per-evaluation lists, as Keras's ``History.history``: ``loss`` and the metric of
        training (the mean since the last evaluation), ``val_loss`` and ``val_<metric>``; one
        entry per evaluation (``evals``' steps and times stay there), NaN where an evaluation
        lacks a figure."""
        names: dict[str, str] = {}
        for record in self.evals:
            for key in record:
                if key not in EVAL_POSITIONS:
                    names.setdefault(key, key.removeprefix("train_"))
        return {name: [float(e.get(key, math.nan)) for e in self.evals]
                for key, name in names.items()}

    @property
    def steps_run(self) -> int:
        return self.step[-1] if self.step else 0

    def best(self, metric: str = "val_accuracy") -> float | None:
        """Best value of an evaluation metric (max for accuracy, min for loss and errors)."""
        values = [e[metric] for e in self.evals if metric in e]
        return best_of(metric, values) if values else None

    def to_dict(self) -> dict[str, Any]:
        """The history as JSON values (the record's unset fields left out)."""
        return {**asdict(self), "record": self.record.to_dict()}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> History:
        """A history from ``to_dict``'s output, or from one written before the record existed
        (its ``extra`` dict becomes the record)."""
        values = dict(values)
        record = values.pop("record", None)
        legacy = values.pop("extra", None) or {}
        return cls(**values, record=RunRecord.from_dict(record if record is not None
                                                         else legacy))

    def save(self, path: str | os.PathLike) -> None:
        """Write the history as JSON, atomically."""
        atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> History:
        """Read a history ``save`` wrote (or one with the older ``extra`` dict)."""
        return cls.from_dict(read_json(path))
