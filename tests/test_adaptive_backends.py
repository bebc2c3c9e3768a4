"""Micro-batched gradients on the active backend (``backends.adaptive()``): their mean is the
full-batch gradient, and the two squared norms are those of the micro-batch gradients computed
one by one. Run under KERAS_BACKEND=jax and KERAS_BACKEND=tensorflow."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

# float32 forward and backward passes summed in a different order: relative 1e-5 of a gradient
# entry, absolute 1e-6 for entries near zero.
RTOL, ATOL = 1e-5, 1e-6


def _mlp(dim: int, classes: int, l2: float = 0.0, batch_norm: bool = False):
    import keras

    keras.utils.set_random_seed(3)
    regularizer = keras.regularizers.L2(l2) if l2 else None
    inputs = keras.Input(shape=(dim,))
    hidden = keras.layers.Dense(16, activation="relu", kernel_regularizer=regularizer)(inputs)
    if batch_norm:  # samples interact through the batch statistics
        hidden = keras.layers.BatchNormalization()(hidden)
    outputs = keras.layers.Dense(classes, activation="softmax")(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(loss="sparse_categorical_crossentropy", optimizer="sgd")
    return model


def _data(batch: int, dim: int, classes: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, dim)).astype(np.float32)
    y = rng.integers(0, classes, size=batch).astype(np.int32)
    return x, y


@pytest.mark.slow
@pytest.mark.parametrize(("batch", "micro_batches", "l2", "batch_norm"),
                         [(32, 4, 0.0, False), (64, 2, 0.0, False), (24, 8, 0.0, False),
                          (32, 2, 1e-3, False), (32, 2, 0.0, True)])
def test_mean_of_micro_batch_gradients_is_the_full_batch_gradient(backend, batch,
                                                                   micro_batches, l2,
                                                                   batch_norm):
    """The full batch's gradient for every model: one forward pass (BatchNorm's statistics
    those of the batch), the micro-batches picked out in the backward passes."""
    from kbackend.backends import adaptive, impl

    model = _mlp(6, 3, l2, batch_norm)
    x, y = _data(batch, 6, 3)
    loss, grads, micro_norms, batch_norm = adaptive().micro_batched_gradients(
        model, x, y, micro_batches)
    full_loss, full_grads = impl().gradients(model, x, y, training=True)
    assert len(grads) == len(full_grads) == len(model.trainable_variables)
    for got, expected in zip(grads, full_grads, strict=True):
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
    assert loss == pytest.approx(full_loss, rel=RTOL)
    assert micro_norms.shape == (micro_batches,)
    expected_batch_norm = sum(float(np.sum(g.astype(np.float64) ** 2)) for g in full_grads)
    assert batch_norm == pytest.approx(expected_batch_norm, rel=1e-4)


def test_micro_batch_norms_are_those_of_each_micro_batch(backend):
    from kbackend.backends import adaptive, impl

    model = _mlp(5, 4)
    x, y = _data(32, 5, 4, seed=1)
    _, _, micro_norms, batch_norm = adaptive().micro_batched_gradients(model, x, y, 4)
    one_by_one = []
    for rows in np.split(np.arange(32), 4):
        grads = impl().gradients(model, x[rows], y[rows], training=True)[1]
        one_by_one.append(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads))
    np.testing.assert_allclose(micro_norms, one_by_one, rtol=1e-4)
    # Micro-batches are noisier than their mean (E|G_b|^2 > E|G_B|^2): here, on one draw.
    assert np.mean(micro_norms) > batch_norm > 0


def test_the_weights_are_not_changed(backend):
    from kbackend.backends import adaptive

    model = _mlp(4, 2)
    before = [np.array(w) for w in model.get_weights()]
    adaptive().micro_batched_gradients(model, *_data(16, 4, 2), 2)
    for was, now in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(was, now)


def test_default_micro_batch_count_splits_the_batch(backend):
    from kbackend.backends import adaptive

    _, _, micro_norms, _ = adaptive().micro_batched_gradients(_mlp(4, 2), *_data(16, 4, 2))
    assert micro_norms.shape == (2,)  # adaptive.DEFAULT_MICRO_BATCHES


def test_both_packages_expose_the_same_adaptive_functions():
    import importlib.util
    import inspect

    names = ("micro_batched_gradients", "micro_batched_value_and_grad")
    sources = {}
    for package in ("jax", "tensorflow"):
        spec = importlib.util.find_spec(f"kbackend.backends.{package}.adaptive")
        assert spec is not None and spec.origin is not None
        sources[package] = Path(spec.origin).read_text(encoding="utf-8")
    for name in names:
        for source in sources.values():
            assert f"def {name}(" in source
    # The public entry point takes the same parameters on both backends.
    from kbackend.backends import adaptive

    parameters = list(inspect.signature(adaptive().micro_batched_gradients).parameters)
    assert parameters == ["model", "x", "y", "micro_batches", "task"]
