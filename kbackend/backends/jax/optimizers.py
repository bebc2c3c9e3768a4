"""kbackend's optimizers as optax transforms: ``to_optax(spec)`` for an ``OptimizerSpec``.

Each computes the update of ``spec.to_keras()`` in the order Keras 3.15's optimizers do
(``kbackend.optim`` writes the maths out; tests/test_optim_parity.py checks it against Keras):
mirroring the order of operations, not only the formula, keeps float32 results within a few ulps
of Keras's after many steps. As optax's transforms do, each is a pair of pure functions
``init(params) -> state`` and ``update(grads, state, params) -> (updates, state)`` whose updates
are added to the parameters (``optax.apply_updates``), and the learning rate is state
(``KerasOptState.learning_rate``, as ``optax.inject_hyperparams`` holds it): one compiled train
step serves every rate (the JAX trainers' ``reset``). The schedule is applied inside, so no
``optax.scale`` follows.

optax's own ``sgd(momentum=...)`` multiplies the rate outside the velocity and its ``adam`` adds
epsilon to the bias-corrected root (optax issue 571): both differ from Keras, hence these.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from kbackend.errors import InternalError
from kbackend.optim import OptimizerSpec, schedule_value

f32 = jnp.float32


class KerasOptState(NamedTuple):
    """State of every ``to_optax`` transform: the update count, the slot variables and the rate.

    The base learning rate is state, not a constant of the traced program (as Keras keeps it in
    a variable): one compiled train step serves every rate (the JAX trainer's ``reset``).
    """

    count: Any  # int32 scalar: updates applied so far (Keras's ``optimizer.iterations``)
    momentum: Any  # velocity (momentum / nesterov) or first moment (adam / adamw); () for sgd
    velocity: Any  # second moment (adam / adamw); () otherwise
    learning_rate: Any = None  # float32 scalar: the schedule's base rate (``spec.learning_rate``)


def _init(spec: OptimizerSpec, slots: int) -> Callable[[Any], KerasOptState]:
    """The init of a transform with ``slots`` zero-filled copies of the parameters (0-2)."""

    def init(params: Any) -> KerasOptState:
        return KerasOptState(
            count=jnp.zeros((), jnp.int32),
            momentum=jax.tree.map(jnp.zeros_like, params) if slots >= 1 else (),
            velocity=jax.tree.map(jnp.zeros_like, params) if slots >= 2 else (),
            learning_rate=jnp.asarray(spec.learning_rate, f32),
        )

    return init


def _rate(spec: OptimizerSpec, state: KerasOptState) -> Any:
    """The scheduled rate of this update (``lr_t``: the count of updates already applied)."""
    return f32(schedule_value(spec, state.count, jnp, learning_rate=state.learning_rate))


def keras_sgd(spec: OptimizerSpec) -> optax.GradientTransformation:
    """``p -= g * lr_t``."""

    def update(grads: Any, state: KerasOptState, params: Any = None) -> tuple[Any, KerasOptState]:
        lr = _rate(spec, state)
        return jax.tree.map(lambda g: -(g * lr), grads), state._replace(count=state.count + 1)

    return optax.GradientTransformation(_init(spec, 0), update)


def keras_momentum(spec: OptimizerSpec) -> optax.GradientTransformation:
    """``m = m * mu - g * lr_t``; ``p += m`` (``nesterov``: ``p += m * mu - g * lr_t``): the
    rate lives in the velocity, as in Keras's ``SGD(momentum=...)``."""
    nesterov = spec.name == "nesterov"

    def update(grads: Any, state: KerasOptState, params: Any = None) -> tuple[Any, KerasOptState]:
        lr = _rate(spec, state)
        mu = f32(spec.momentum)
        velocity = jax.tree.map(lambda m, g: m * mu - g * lr, state.momentum, grads)
        if nesterov:
            updates = jax.tree.map(lambda m, g: m * mu - g * lr, velocity, grads)
        else:
            updates = velocity
        return updates, state._replace(count=state.count + 1, momentum=velocity)

    return optax.GradientTransformation(_init(spec, 1), update)


def keras_adam(spec: OptimizerSpec) -> optax.GradientTransformation:
    """Adam with epsilon added to the uncorrected root (Keras's "epsilon hat"); ``adamw``
    decays the parameters first (``p -= p * wd * lr_t``), then takes the Adam step."""
    decoupled_decay = spec.name == "adamw"

    def update(grads: Any, state: KerasOptState, params: Any = None) -> tuple[Any, KerasOptState]:
        lr = _rate(spec, state)
        count = state.count + 1
        step = count.astype(f32)
        beta1_power = jnp.power(f32(spec.beta1), step)
        beta2_power = jnp.power(f32(spec.beta2), step)
        alpha = lr * jnp.sqrt(1 - beta2_power) / (1 - beta1_power)
        m = jax.tree.map(lambda m, g: m + (g - m) * (1 - spec.beta1), state.momentum, grads)
        v = jax.tree.map(lambda v, g: v + (jnp.square(g) - v) * (1 - spec.beta2),
                         state.velocity, grads)
        steps = jax.tree.map(lambda m, v: (m * alpha) / (jnp.sqrt(v) + spec.epsilon), m, v)
        if not decoupled_decay:
            updates = jax.tree.map(lambda s: -s, steps)
        else:
            if params is None:
                raise InternalError("adamw's weight decay needs the parameters: pass params=.")
            decay = f32(spec.weight_decay)
            # Keras decays first, then takes the Adam step. Written as (new - old), adding the
            # update back gives Keras's value exactly whenever it is within 2x of the old one.
            updates = jax.tree.map(lambda s, p: ((p - p * decay * lr) - s) - p, steps, params)
        return updates, KerasOptState(count=count, momentum=m, velocity=v,
                                      learning_rate=state.learning_rate)

    return optax.GradientTransformation(_init(spec, 2), update)


# Optimizer name (``kbackend.optim.OPTIMIZERS``) -> the transform computing its update.
TRANSFORMS: dict[str, Callable[[OptimizerSpec], optax.GradientTransformation]] = {
    "sgd": keras_sgd, "momentum": keras_momentum, "nesterov": keras_momentum,
    "adam": keras_adam, "adamw": keras_adam,
}


def to_optax(spec: OptimizerSpec) -> optax.GradientTransformation:
    """The optax transform with exactly the math of ``spec.to_keras()`` (its updates are added
    to the parameters; the learning rate, schedule included, is applied inside)."""
    return TRANSFORMS[spec.name](spec)
