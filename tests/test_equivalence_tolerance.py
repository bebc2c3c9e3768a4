"""The Adam step-1 tolerance is derived, not loosened: the measured gradient difference pushed
through Keras's first Adam step explains the weights' difference, and nothing else may remain.

Pure NumPy (no workers): the first step is ``w -= lr * g / (|g| + eps / sqrt(1 - beta2))``.
"""

from __future__ import annotations

import numpy as np

from kbackend.equivalence.compare import adam_step1_bound, compare_adam_step1, compare_arrays

ADAM = {"label": "adam", "name": "adam", "learning_rate": 1e-3}
EPS_HAT = 1e-7 / np.sqrt(1 - 0.999)


def first_adam_step(weights, gradient, rate=1e-3):
    w, g = weights.astype(np.float32), gradient.astype(np.float32)
    return (w - np.float32(rate) * g / (np.abs(g) + np.float32(EPS_HAT))).astype(np.float32)


def two_backends(seed=0):
    """Weights, and two gradients that differ only by float32 round-off (a few 1e-9 absolute), with
    some entries far below eps_hat (3e-6), where the first step amplifies that difference."""
    rng = np.random.default_rng(seed)
    weights = rng.normal(0, 0.01, (64, 32)).astype(np.float32)
    gradient = rng.normal(0, 1e-3, weights.shape).astype(np.float32)
    gradient[:4] *= 1e-4  # tiny gradients: |g| ~ 1e-7 << eps_hat
    other = (gradient + rng.normal(0, 4e-9, gradient.shape)).astype(np.float32)
    return weights, gradient, other


def test_roundoff_in_tiny_gradients_fails_the_plain_tolerance_and_is_explained():
    weights, grad_a, grad_b = two_backends()
    after_a, after_b = first_adam_step(weights, grad_a), first_adam_step(weights, grad_b)
    plain = compare_arrays("step1", "adam step 1: w", after_a, after_b)
    assert not plain.passed and plain.max_rel > 1e-5  # the failure, reproduced
    bound = adam_step1_bound(ADAM, grad_a, grad_b)
    derived = compare_adam_step1("adam step 1: w", after_a, after_b, bound)
    assert derived.passed and "amplification" in derived.note
    assert derived.max_rel == plain.max_rel  # the row still reports the real difference


def test_a_real_difference_is_not_explained_by_the_gradients():
    weights, grad_a, grad_b = two_backends()
    after_a = first_adam_step(weights, grad_a)
    after_b = first_adam_step(weights, grad_b)
    after_b[10, 3] += 1e-5  # a planted error ~3e-4 of the scale, where |g| >> eps_hat
    row = compare_adam_step1("adam step 1: w", after_a, after_b,
                             adam_step1_bound(ADAM, grad_a, grad_b))
    assert not row.passed


def test_equal_gradients_leave_no_room():
    weights, grad_a, _ = two_backends()
    bound = adam_step1_bound(ADAM, grad_a, grad_a)
    assert float(bound.max()) == 0.0
    after = first_adam_step(weights, grad_a)
    shifted = after.copy()
    shifted[0, 0] += 1e-6  # ~3e-5 of the scale: beyond step1 rtol 1e-5, not explained
    assert not compare_adam_step1("w", after, shifted, bound).passed


def test_the_bound_is_only_for_a_constant_rate_adam():
    g = np.ones(3)
    assert adam_step1_bound({"name": "sgd", "learning_rate": 0.1}, g, g) is None
    assert adam_step1_bound({**ADAM, "schedule": "cosine"}, g, g) is None
    assert adam_step1_bound({**ADAM, "name": "adamw"}, g, g) is not None
