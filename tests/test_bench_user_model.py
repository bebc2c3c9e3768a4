"""bench_user_model (kbackend/bench/user_model.py): its quick measurement in this process, and the
hand-written Conv1D + BatchNorm reference loop it times the native engine against: the loop
trains, and one of its steps is Keras's SGD step on the same weights and batch. No timing
thresholds."""

from __future__ import annotations

import importlib.util
import math
from types import SimpleNamespace

import numpy as np
import pytest

from kbackend.backends import impl
from kbackend.bench.spec import Settings
from kbackend.bench.user_model import (
    CONV_LR,
    measure_user_model,
    study_plan,
    user_model_table,
)
from tests.conftest import BACKEND, ROOT

STEP_FIELDS = {"part", "batch_size", "fused_steps", "ratio", "builtin_us_per_step",
               "twin_us_per_step", "builtin_spread", "twin_spread", "within_goal"}
TARGET_FIELDS = {"part", "batch_size", "learning_rate", "seeds", "builtin_steps", "twin_steps",
                 "builtin_interval", "twin_interval", "overlap", "ratio",
                 "initial_weights_max_diff", "eval_every", "max_steps"}
CONV_FIELDS = {"part", "batch_size", "fused_steps", "unrolled", "ratio", "native_us_per_step",
               "reference_us_per_step", "native_spread", "reference_spread",
               "native_loss_first_last", "reference_loss_first_last", "within_goal"}


def examples_module(name: str):
    spec = importlib.util.spec_from_file_location(f"examples_{name}", ROOT / "examples" /
                                                  f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def conv1d_model(seed: int = 0):
    impl().set_random_seed(seed)
    return examples_module("models").conv1d_classifier((64, 1), 4)


def sequences(n: int):
    x, y = examples_module("make_data").sequences(n=n)
    return x, y.astype(np.int32)


@pytest.mark.slow
def test_quick_measurement_rows_and_table():
    rows, summary = measure_user_model(Settings(quick=True, options={"max_steps": 14}))
    parts = {row["part"]: row for row in rows}
    assert list(parts) == ["twin step", "twin steps to target", "conv1d vs reference"]
    step, target, conv = parts.values()
    assert set(step) >= STEP_FIELDS and set(target) >= TARGET_FIELDS and set(conv) >= CONV_FIELDS
    assert step["batch_size"] == target["batch_size"] == 256 and conv["batch_size"] == 64
    assert step["ratio"] > 0 and conv["ratio"] > 0
    assert step["ratio"] == pytest.approx(step["twin_us_per_step"] / step["builtin_us_per_step"])
    assert target["seeds"] == [0] and len(target["twin_steps"]) == 1
    assert target["max_steps"] % target["eval_every"] == 0 and target["max_steps"] >= 14
    # The twin is the built-in mlp: the same seed draws the same initial weights.
    assert target["initial_weights_max_diff"] == 0.0
    # The reference trains the same model from the same values as the native engine: the two
    # first epochs' losses agree closely (different batch orders, the same data).
    native_first, reference_first = (conv[f"{side}_loss_first_last"][0]
                                     for side in ("native", "reference"))
    assert math.isfinite(native_first) and reference_first == pytest.approx(native_first, rel=0.1)
    assert summary["parts"] == ["twin", "conv"]
    table = user_model_table({"rows": [{**row, "backend": BACKEND} for row in rows]})
    assert "twin / built-in" in table and "native / reference" in table and "overlap" in table


def test_the_study_plan_is_the_studys():
    plan = study_plan(SimpleNamespace(x_train=range(10_800)), 32)
    assert (plan.optimizer, plan.learning_rate) == ("adam", 0.002)  # the study's centre rate
    assert plan.fused_steps == plan.eval_every == 56  # ~6 evaluations per 337-step epoch


@pytest.mark.slow
def test_reference_conv1d_loop_trains():
    """Over a few epochs the reference's mean loss falls (a reference that does not train
    would flatter the engine)."""
    x, y = sequences(8 * 32)
    order = np.arange(len(x)).reshape(8, 32)
    loop = impl().reference_conv1d_loop(conv1d_model().get_weights(), x[order], y[order],
                                        CONV_LR, steps_per_call=4, unroll=True)
    means = [float(np.mean(loop())) for _ in range(6)]
    assert all(math.isfinite(m) for m in means)
    assert means[-1] < means[0] - 0.1, means
    weights = loop.weights()
    assert [w.shape for w in weights] == [w.shape for w in conv1d_model().get_weights()]


def test_one_reference_step_is_kerass_sgd_step():
    """One reference step from a Keras model's weights on one batch: the loss Keras computes
    in training mode, the weights SGD's ``w - lr * grad`` with Keras's gradients, and the
    moving mean and variance Keras's (``impl().gradients`` writes its updates back), to a
    thousandth of the step (measured: <= 5e-5 of it, float rounding). The reference normalizes
    in Keras's form; the (h - mean) form's gradients differed from Keras's by ~1% on JAX."""
    import keras

    x, y = sequences(32)
    model = conv1d_model(seed=3)
    before = model.get_weights()
    loop = impl().reference_conv1d_loop(before, x[None], y[None], CONV_LR, steps_per_call=1,
                                        unroll=True)
    (loss,) = loop()
    model.compile(optimizer=keras.optimizers.SGD(CONV_LR),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    keras_loss, grads = impl().gradients(model, x, y, training=True)
    assert loss == pytest.approx(keras_loss, rel=1e-5)
    grad_of = {id(v): g for v, g in zip(model.trainable_variables, grads, strict=True)}
    for variable, start, got in zip(model.weights, before, loop.weights(), strict=True):
        if id(variable) in grad_of:
            expected = start - CONV_LR * grad_of[id(variable)]
        else:  # moving statistics, updated by Keras's training-mode call
            expected = keras.ops.convert_to_numpy(variable.value)
        step = np.max(np.abs(expected - start))
        assert step > 0, variable.path
        assert np.max(np.abs(got - expected)) <= 1e-3 * step + 1e-7, variable.path
