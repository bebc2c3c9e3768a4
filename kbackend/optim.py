"""Optimizer specs: one description of an optimizer and its learning-rate schedule.

``OptimizerSpec.to_keras()`` builds the Keras optimizer (the Keras ``fit`` engine and the native
TF engine use it); behind the backend boundary, ``kbackend.backends.jax.optimizers.to_optax(spec)``
builds an optax ``GradientTransformation`` (the JAX engines use it), so this module imports
neither JAX nor optax. Both compute the same math, operation for operation, so the same
gradients give the same parameters (tests/test_optim_parity.py, rtol 1e-6 in float32).

The one convention, Keras 3's (``lr_t`` is ``schedule_value`` at the count ``t`` of updates
already applied; ``g`` the gradient; all arithmetic in float32):

* ``sgd``:       ``p -= g * lr_t``
* ``momentum``:  ``m = m * mu - g * lr_t;  p += m``            (the rate lives in the velocity)
* ``nesterov``:  ``m = m * mu - g * lr_t;  p += m * mu - g * lr_t``
* ``adam``:      ``m += (g - m) * (1 - b1);  v += (g**2 - v) * (1 - b2)``;
  ``alpha = lr_t * sqrt(1 - b2**(t+1)) / (1 - b1**(t+1))``;  ``p -= m * alpha / (sqrt(v) + eps)``.
  Epsilon is added to the *uncorrected* ``sqrt(v)`` ("epsilon hat", Kingma & Ba sec. 2), as
  Keras does. optax's ``adam`` adds it to the bias-corrected one, so it would differ at large
  epsilon (optax issue 571): ``to_optax`` therefore uses kbackend's own transform, not
  ``optax.adam``. Default epsilon 1e-7 (Keras's).
* ``adamw``:     ``p -= p * wd * lr_t`` first (decoupled decay, scaled by the rate as in Keras
  and ``optax.adamw``), then the ``adam`` step.

optax's own ``sgd(momentum=...)`` multiplies the rate outside the velocity, which differs from
Keras as soon as the rate changes over time; that is why every optimizer here has its own
transform. Learning-rate schedules are one formula (``schedule_value``) written against an array
namespace (``keras.ops`` or ``jax.numpy``), so they compute the same values on every backend.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, replace
from typing import Any

from kbackend.backend_choice import keras as import_keras
from kbackend.errors import ConfigError

OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw")
SCHEDULES = ("constant", "cosine", "exponential")


# field -> what it must be, and the test of its range (each also a finite real number: NaN
# passes every comparison, Inf diverges)
_UNIT = ("a finite number in [0, 1)", lambda value: 0 <= value < 1)
_REAL_FIELDS = {
    "learning_rate": ("a finite number > 0", lambda value: value > 0),
    "decay_rate": ("a finite number in (0, 1]", lambda value: 0 < value <= 1),
    "momentum": _UNIT,
    "beta1": _UNIT,
    "beta2": _UNIT,
    "epsilon": ("a finite number > 0", lambda value: value > 0),
    "weight_decay": ("a finite number >= 0", lambda value: value >= 0),
}


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
        for field, (expected, admits) in _REAL_FIELDS.items():
            value = getattr(self, field)
            if not (isinstance(value, numbers.Real) and not isinstance(value, bool)
                    and math.isfinite(value) and admits(value)):
                raise ConfigError(f"Invalid {field}: expected {expected}. Received: {value!r}.")
        for field, low in (("decay_steps", 1), ("warmup_steps", 0)):
            value = getattr(self, field)
            if value is None and field == "decay_steps":  # the whole run (``with_total_steps``)
                continue
            if not (isinstance(value, numbers.Integral) and not isinstance(value, bool)):
                raise ConfigError(f"Invalid {field}: expected an integer. Received: {value!r}.")
            if value < low:
                raise ConfigError(f"Invalid {field}: expected >= {low}. Received: {value!r}.")

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


def schedule_value(spec: OptimizerSpec, step: Any, ops: Any = None,
                   learning_rate: Any = None) -> Any:
    """The learning rate at ``step`` (0-based count of updates already applied).

    Written against an array namespace ``ops`` (``keras.ops`` by default; ``jax.numpy`` works
    too), so every backend evaluates the same formula. ``learning_rate`` (a number or a
    scalar array) replaces ``spec.learning_rate`` as the base rate.
    """
    if ops is None:
        ops = import_keras().ops
    # keras.ops casts with ``cast``; NumPy-like namespaces (jax.numpy) with ``asarray``.
    step = ops.cast(step, "float32") if hasattr(ops, "cast") else ops.asarray(step, "float32")
    lr = spec.learning_rate if learning_rate is None else learning_rate
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
        # Any: mypy cannot see the classes of a module imported at run time (the base below)
        keras: Any = import_keras()

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
