"""A minimal ``OptimizerSpec`` -> optax adapter for the data-parallel JAX engine.

Private stand-in: once ``OptimizerSpec.to_optax()`` exists (native engine, issue 3), replace the
body of ``optax_transform`` with ``return spec.to_optax()``.
"""

from __future__ import annotations

from typing import Any

from kbackend.optim import OptimizerSpec, schedule_value


def optax_transform(spec: OptimizerSpec) -> Any:
    """The optax ``GradientTransformation`` ``spec`` describes (same schedule formula as Keras)."""
    import optax

    if spec.schedule == "constant" and spec.warmup_steps == 0:
        lr: Any = spec.learning_rate
    else:
        def lr(count: Any) -> Any:  # count: updates already applied, as in Keras
            return schedule_value(spec, count)
    if spec.name == "sgd":
        return optax.sgd(lr)
    if spec.name in ("momentum", "nesterov"):
        return optax.sgd(lr, momentum=spec.momentum, nesterov=spec.name == "nesterov")
    if spec.name == "adam":
        return optax.adam(lr, b1=spec.beta1, b2=spec.beta2, eps=spec.epsilon)
    return optax.adamw(lr, b1=spec.beta1, b2=spec.beta2, eps=spec.epsilon,
                       weight_decay=spec.weight_decay)
