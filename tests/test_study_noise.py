"""The gradient noise scale: the two-batch-size estimator on synthetic gradients, and the
per-batch gradients each backend computes for it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kbackend.adaptive import estimate_noise_scale, step_estimates
from kbackend.errors import ConfigError
from kbackend.study.noise import measure_noise_scale, squared_norm

# Tolerance of the Monte Carlo checks: within 5 standard errors of the mean over draws
# (a false failure has probability ~6e-7 per check) plus 1e-9 of the problem's scale for
# round-off; hypothesis derandomizes, so the drawn problems and batches are reproducible.
SIGMAS = 5.0


def _population(rng: np.random.Generator, dim: int, n: int) -> tuple[np.ndarray, float, float]:
    """Per-example gradients with a known mean |G|^2 and trace of their covariance."""
    mean = rng.normal(size=dim) * rng.uniform(0.1, 3.0)
    examples = mean + rng.normal(size=(n, dim)) * rng.uniform(0.1, 3.0, size=dim)
    full = examples.mean(axis=0)
    trace_sigma = float(np.mean(np.sum((examples - full) ** 2, axis=1)))  # population covariance
    return examples, float(full @ full), trace_sigma


def _batch_sq_norms(rng: np.random.Generator, examples: np.ndarray, batch: int,
                    draws: int) -> np.ndarray:
    """|mean gradient|^2 of ``draws`` batches drawn with replacement."""
    n = len(examples)
    counts = rng.multinomial(batch, np.full(n, 1.0 / n), size=draws)
    batch_means = counts @ examples / batch
    return np.sum(batch_means ** 2, axis=1)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(dim=st.integers(1, 40), n=st.integers(2, 300), small=st.integers(1, 16),
       ratio=st.integers(2, 32), seed=st.integers(0, 2 ** 32 - 1))
def test_estimator_recovers_known_grad_norm_and_trace(dim, n, small, ratio, seed):
    rng = np.random.default_rng(seed)
    examples, grad_sq, trace_sigma = _population(rng, dim, n)
    big = small * ratio
    draws = 2000
    estimate = estimate_noise_scale(_batch_sq_norms(rng, examples, small, draws),
                                    _batch_sq_norms(rng, examples, big, draws), small, big)
    scale = 1e-9 * (grad_sq + trace_sigma)
    assert abs(estimate.grad_sq - grad_sq) <= SIGMAS * estimate.grad_sq_se + scale
    assert abs(estimate.trace_sigma - trace_sigma) <= SIGMAS * estimate.trace_sigma_se + scale
    assert estimate.draws == draws and (estimate.small_batch, estimate.big_batch) == (small, big)


def test_estimator_converges_to_within_five_percent_with_many_draws():
    rng = np.random.default_rng(0)
    examples, grad_sq, trace_sigma = _population(rng, 20, 500)
    estimate = estimate_noise_scale(_batch_sq_norms(rng, examples, 4, 40000),
                                    _batch_sq_norms(rng, examples, 64, 40000), 4, 64)
    assert estimate.grad_sq == pytest.approx(grad_sq, rel=0.05)
    assert estimate.trace_sigma == pytest.approx(trace_sigma, rel=0.05)
    assert estimate.b_simple == pytest.approx(trace_sigma / grad_sq, rel=0.1)


@given(grad_sq=st.floats(1e-3, 1e3), trace_sigma=st.floats(1e-3, 1e3),
       small=st.integers(1, 64), extra=st.integers(1, 4096))
def test_exact_expectations_give_exact_values(grad_sq, trace_sigma, small, extra):
    big = small + extra
    expected = [grad_sq + trace_sigma / small], [grad_sq + trace_sigma / big]
    g, s = step_estimates(*map(np.asarray, expected), small, big)
    assert g[0] == pytest.approx(grad_sq, rel=1e-6, abs=1e-9 * trace_sigma)
    assert s[0] == pytest.approx(trace_sigma, rel=1e-6, abs=1e-9 * grad_sq * big)


def test_noise_scale_is_infinite_when_the_gradient_estimate_is_not_positive():
    estimate = estimate_noise_scale([1.0, 1.0], [0.1, 0.1], 1, 2)
    assert estimate.grad_sq < 0 and math.isinf(estimate.b_simple)


@pytest.mark.parametrize(("small", "big", "a", "b"), [
    (8, 8, [1.0], [1.0]), (16, 8, [1.0], [1.0]), (0, 8, [1.0], [1.0]),
    (4, 8, [1.0, 2.0], [1.0]), (4, 8, [], []),
])
def test_estimator_rejects_bad_input(small, big, a, b):
    with pytest.raises(ConfigError):
        estimate_noise_scale(a, b, small, big)


def _softmax_regression(dim: int, classes: int):
    import keras

    keras.utils.set_random_seed(1)
    inputs = keras.Input(shape=(dim,))
    outputs = keras.layers.Activation("softmax")(keras.layers.Dense(classes)(inputs))
    return keras.Model(inputs, outputs)


def test_inference_gradients_match_the_analytic_softmax_regression_gradient(backend):
    from kbackend.backends import impl

    rng = np.random.default_rng(0)
    dim, classes, batch = 6, 4, 12
    model = _softmax_regression(dim, classes)
    x = rng.normal(size=(batch, dim)).astype(np.float32)
    y = rng.integers(0, classes, size=batch).astype(np.int32)
    kernel, bias = (np.asarray(v) for v in model.get_weights())
    logits = x @ kernel + bias
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    delta = (probs - np.eye(classes)[y]) / batch
    grads = impl().gradients(model, x, y, training=False)[1]
    # float32 forward and backward pass against a float64 reference.
    np.testing.assert_allclose(grads[0], x.T @ delta, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grads[1], delta.sum(0), rtol=1e-4, atol=1e-6)
    expected = np.sum((x.T @ delta) ** 2) + np.sum(delta.sum(0) ** 2)
    assert squared_norm(grads) == pytest.approx(expected, rel=1e-4)


def test_measure_noise_scale_on_a_model_gives_finite_positive_estimates(backend):
    from kbackend.backends import impl

    rng = np.random.default_rng(0)
    model = _softmax_regression(5, 3)
    x = rng.normal(size=(200, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 1).astype(np.int32)
    def gradients(xb, yb):
        return impl().gradients(model, xb, yb, training=False)[1]

    estimate = measure_noise_scale(gradients, x, y, 4, 64, 16, rng)
    assert estimate.draws == 16 and estimate.trace_sigma > 0 and estimate.grad_sq > 0
    assert math.isfinite(estimate.b_simple) and estimate.b_simple > 0
