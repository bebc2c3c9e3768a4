"""Optimizer parity: ``to_optax(spec)`` (backends/jax) and ``spec.to_keras()`` give equal updates.

Runs under both backends: the Keras optimizer runs on the session's backend (JAX or TF) and the
optax transform on JAX in the same process, both fed the same 20 float32 gradients.
"""

from __future__ import annotations

import numpy as np
import pytest

from kbackend.errors import InternalError
from kbackend.optim import OPTIMIZERS, OptimizerSpec

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

from kbackend.backends.jax.optimizers import to_optax  # noqa: E402 (needs JAX, checked above)

SCHEDULES = {
    "constant": {},
    "cosine": {"schedule": "cosine", "decay_steps": 20},
    "exponential": {"schedule": "exponential", "decay_steps": 5, "decay_rate": 0.5},
    "warmup_cosine": {"schedule": "cosine", "decay_steps": 15, "warmup_steps": 5},
}
STEPS = 20


def _problem(seed: int = 0) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    rng = np.random.default_rng(seed)
    params = [rng.normal(size=(6, 4)).astype(np.float32), rng.normal(size=(4,)).astype(np.float32)]
    grads = [[rng.normal(size=p.shape).astype(np.float32) for p in params] for _ in range(STEPS)]
    return params, grads


def _keras_run(spec: OptimizerSpec, params, grads) -> list[np.ndarray]:
    import keras

    variables = [keras.Variable(p) for p in params]
    optimizer = spec.to_keras()
    optimizer.build(variables)
    for step_grads in grads:
        optimizer.apply([keras.ops.convert_to_tensor(g) for g in step_grads], variables)
    return [keras.ops.convert_to_numpy(v) for v in variables]


def _optax_run(spec: OptimizerSpec, params, grads, jit: bool) -> list[np.ndarray]:
    import jax.numpy as jnp

    transform = to_optax(spec)
    values = [jnp.asarray(p) for p in params]
    state = transform.init(values)
    update = jax.jit(transform.update) if jit else transform.update
    for step_grads in grads:
        updates, state = update([jnp.asarray(g) for g in step_grads], state, values)
        values = optax.apply_updates(values, updates)
    return [np.asarray(v) for v in values]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optax_and_keras_give_the_same_parameters(name, schedule):
    # A large epsilon makes the epsilon convention visible (optax.adam would differ here).
    spec = OptimizerSpec(name, 0.05, epsilon=1e-3, weight_decay=0.1, **SCHEDULES[schedule])
    params, grads = _problem()
    expected = _keras_run(spec, params, grads)
    # Run op by op, the optax transform repeats Keras's arithmetic exactly (adamw: the decay
    # and the Adam step are summed into one update before being added, a few ulps apart).
    for got, want in zip(_optax_run(spec, params, grads, jit=False), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    # Under jit, XLA contracts a*b - c*d into fused multiply-adds: a few ulps per step, which
    # a parameter that cancels to near zero turns into a large *relative* error; hence atol.
    for got, want in zip(_optax_run(spec, params, grads, jit=True), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(expected[0], params[0])  # the optimizer really moved the weights


def test_epsilon_is_added_to_the_uncorrected_root():
    """The documented convention, checked against a one-step closed form (Adam, t=1)."""
    spec = OptimizerSpec("adam", 0.1, epsilon=0.5)
    params, grads = [np.zeros(3, np.float32)], [[np.array([0.2, -1.0, 3.0], np.float32)]]
    (got,) = _optax_run(spec, params, grads, jit=False)
    g = grads[0][0].astype(np.float64)
    m, v = 0.1 * g, 0.001 * g**2
    alpha = 0.1 * np.sqrt(1 - 0.999) / (1 - 0.9)
    np.testing.assert_allclose(got, -alpha * m / (np.sqrt(v) + 0.5), rtol=1e-5)
    optax_convention = -0.1 * (m / 0.1) / (np.sqrt(v / 0.001) + 0.5)
    assert not np.allclose(got, optax_convention, rtol=1e-3)
    (keras_got,) = _keras_run(spec, params, grads)
    np.testing.assert_allclose(keras_got, got, rtol=1e-6)


def test_adamw_needs_params():
    spec = OptimizerSpec("adamw", 0.01)
    transform = to_optax(spec)
    zeros = [np.zeros(2, np.float32)]
    with pytest.raises(InternalError, match="params"):
        transform.update(zeros, transform.init(zeros))
