"""The training history every engine returns, in one format.

Per step: the step number (1-based), the train loss of that step and the cumulative training
wall time at its end. Per evaluation: validation loss and accuracy with the step, epoch and
training time when it was taken. Training time excludes evaluation, as MLCommons AlgoPerf does.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from kbackend.io import atomic_write_json, read_json
from kbackend.task import best_of


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
    extra: dict[str, Any] = field(default_factory=dict)

    def record_steps(self, steps: list[int], losses: list[float], times: list[float]) -> None:
        """Append per-step losses and their cumulative training times."""
        self.step.extend(int(s) for s in steps)
        self.loss.extend(float(v) for v in losses)
        self.time.extend(float(t) for t in times)

    def record_eval(self, **values: float) -> None:
        """Append one evaluation (e.g. step, epoch, train_time, val_loss, val_accuracy)."""
        self.evals.append({k: (float(v) if isinstance(v, float) else v) for k, v in values.items()})

    @property
    def steps_run(self) -> int:
        return self.step[-1] if self.step else 0

    def best(self, metric: str = "val_accuracy") -> float | None:
        """Best value of an evaluation metric (max for accuracy, min for loss and errors)."""
        values = [e[metric] for e in self.evals if metric in e]
        if not values:
            return None
        return best_of(metric, values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: str | os.PathLike) -> None:
        """Write the history as JSON, atomically."""
        atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> History:
        return cls(**read_json(path))
