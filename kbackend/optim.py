"""Optimizer specs: one description of an optimizer and its learning-rate schedule.

``OptimizerSpec.to_keras()`` builds the Keras optimizer (used by the Keras ``fit`` engine).
Learning-rate schedules are one formula (``schedule_value``) written with ``keras.ops``, so
they compute the same values on every backend.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from kbackend.backend import keras as import_keras
from kbackend.errors import ConfigError

OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw")
SCHEDULES = ("constant", "cosine", "exponential")


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer and its schedule, independent of the backend.

    ``decay_steps`` is the horizon of the cosine / exponential schedule (``None``: the whole run,
    filled in by the trainer with ``with_total_steps``). Exponential decay multiplies the rate by
    ``decay_rate`` every ``decay_steps`` steps (smoothly). ``warmup_steps`` ramps the rate
    linearly from 0 before the schedule starts.
    """

    name: str = "adam"
    learning_rate: float = 1e-3
    schedule: str = "constant"
    decay_steps: int | None = None
    decay_rate: float = 0.1
    warmup_steps: int = 0
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-7
    weight_decay: float = 1e-4

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ConfigError(
                f"Unknown optimizer. Expected one of {list(OPTIMIZERS)}. Received: {self.name!r}."
            )
        if self.schedule not in SCHEDULES:
            raise ConfigError(
                f"Unknown schedule. Expected one of {list(SCHEDULES)}. Received: {self.schedule!r}."
            )
        if not (isinstance(self.learning_rate, int | float) and math.isfinite(self.learning_rate)
                and self.learning_rate > 0):
            raise ConfigError(
                f"Invalid learning rate {self.learning_rate!r}: expected a finite number > 0."
            )
        if self.decay_steps is not None and self.decay_steps < 1:
            raise ConfigError(f"Invalid decay_steps {self.decay_steps!r}: expected >= 1.")
        if self.warmup_steps < 0:
            raise ConfigError(f"Invalid warmup_steps {self.warmup_steps!r}: expected >= 0.")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"Invalid momentum {self.momentum!r}: expected a value in [0, 1).")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError(f"Invalid betas ({self.beta1}, {self.beta2}): expected values in [0, 1).")
        if self.epsilon <= 0 or self.weight_decay < 0 or not 0 < self.decay_rate <= 1:
            raise ConfigError(
                "Invalid epsilon, weight_decay or decay_rate: expected epsilon > 0, "
                f"weight_decay >= 0, 0 < decay_rate <= 1. Received: {self.epsilon}, "
                f"{self.weight_decay}, {self.decay_rate}."
            )

    def with_total_steps(self, total_steps: int) -> OptimizerSpec:
        """This spec with ``decay_steps`` set to the run's length if it was left open."""
        if self.decay_steps is not None:
            return self
        return replace(self, decay_steps=max(1, int(total_steps) - self.warmup_steps))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def learning_rate_schedule(self) -> Any:
        """A float for constant rates without warmup, else a Keras ``LearningRateSchedule``."""
        if self.schedule == "constant" and self.warmup_steps == 0:
            return self.learning_rate
        return _keras_schedule_class()(self)

    def to_keras(self) -> Any:
        """The Keras optimizer this spec describes."""
        keras = import_keras()
        lr = self.learning_rate_schedule()
        if self.name == "sgd":
            return keras.optimizers.SGD(learning_rate=lr)
        if self.name in ("momentum", "nesterov"):
            return keras.optimizers.SGD(learning_rate=lr, momentum=self.momentum,
                                        nesterov=self.name == "nesterov")
        if self.name == "adam":
            return keras.optimizers.Adam(learning_rate=lr, beta_1=self.beta1, beta_2=self.beta2,
                                         epsilon=self.epsilon)
        return keras.optimizers.AdamW(learning_rate=lr, weight_decay=self.weight_decay,
                                      beta_1=self.beta1, beta_2=self.beta2, epsilon=self.epsilon)


def schedule_value(spec: OptimizerSpec, step: Any, ops: Any = None) -> Any:
    """The learning rate at ``step`` (0-based count of updates already applied).

    Written against an array namespace ``ops`` (``keras.ops`` by default; ``jax.numpy`` works
    too), so every backend evaluates the same formula.
    """
    if ops is None:
        ops = import_keras().ops
    step = ops.cast(step, "float32")
    lr = spec.learning_rate
    if spec.schedule == "constant":
        value = ops.ones_like(step) * lr
    else:
        horizon = float(spec.decay_steps or 1)
        progress = ops.maximum(step - spec.warmup_steps, 0.0)
        if spec.schedule == "cosine":
            fraction = ops.minimum(progress / horizon, 1.0)
            value = lr * 0.5 * (1.0 + ops.cos(math.pi * fraction))
        else:
            value = lr * ops.power(spec.decay_rate, progress / horizon)
    if spec.warmup_steps > 0:
        ramp = ops.minimum((step + 1.0) / float(spec.warmup_steps), 1.0)
        value = ops.where(step < spec.warmup_steps, lr * ramp, value)
    return value


_SCHEDULE_CLASS: Any = None


def _keras_schedule_class() -> Any:
    """Define (once, after Keras is imported) the Keras schedule wrapping ``schedule_value``."""
    global _SCHEDULE_CLASS
    if _SCHEDULE_CLASS is None:
        keras = import_keras()

        @keras.saving.register_keras_serializable(package="kbackend")
        class SpecSchedule(keras.optimizers.schedules.LearningRateSchedule):
            """A Keras schedule computing ``schedule_value`` for an ``OptimizerSpec``."""

            def __init__(self, spec: OptimizerSpec | dict) -> None:
                self.spec = spec if isinstance(spec, OptimizerSpec) else OptimizerSpec(**spec)

            def __call__(self, step: Any) -> Any:
                return schedule_value(self.spec, step)

            def get_config(self) -> dict[str, Any]:
                return {"spec": self.spec.to_dict()}

        _SCHEDULE_CLASS = SpecSchedule
    return _SCHEDULE_CLASS
