"""Multi-output models (issue 46 item 5): a model compiled with a loss per output (a dict or a
list, with ``loss_weights``) trains on the native engines and Keras fit; labels per output from
``.npz`` keys ``y_train_<output>`` or a dict from Python; the target names one output's metric
(``val_<output>_<metric>``, Keras's history name); bad input refused in one line.

The native engine's total loss is checked against Keras's own ``train_on_batch`` from the same
initial weights and batches (the weighted sum of the outputs' losses Keras fit minimizes).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import kbackend
from kbackend.backend_choice import keras as import_keras
from kbackend.config import TrainConfig
from kbackend.engines import native
from kbackend.engines.keras_fit import compile_model
from kbackend.errors import ConfigError, DataError, KBackendError
from kbackend.optim import OptimizerSpec
from kbackend.task import MultiOutputTask
from kbackend.workload import prepare_workload
from tests.conftest import JIT_FOR_SMALL_RUNS

keras = import_keras()
RNG = np.random.default_rng(0)
X = RNG.normal(size=(500, 8)).astype(np.float32)
W = RNG.normal(size=(8, 3))
CLASSES = np.argmax(X @ W, axis=1)  # a learnable 3-class head
VALUES = (X @ RNG.normal(size=(8, 2)) * 0.5).astype(np.float32)  # a 2-value regression head
LABELS = {"kind": CLASSES, "size": VALUES}


def two_heads(loss_form: str = "dict", weights: tuple[float, float] = (1.0, 0.5)) -> object:
    """A functional model with a classification head (``kind``, logits) and a regression head
    (``size``), compiled with a loss per output as a dict or a list, with loss weights."""
    inputs = keras.Input((8,), name="features")
    hidden = keras.layers.Dense(24, activation="tanh")(inputs)
    kind = keras.layers.Dense(3, name="kind")(hidden)
    size = keras.layers.Dense(2, name="size")(hidden)
    model = keras.Model(inputs, [kind, size])
    losses = [keras.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"]
    if loss_form == "dict":
        model.compile("sgd", loss=dict(zip(("kind", "size"), losses, strict=True)),
                      loss_weights={"kind": weights[0], "size": weights[1]},
                      metrics={"kind": ["accuracy"], "size": ["mae"]})
    else:
        model.compile("sgd", loss=losses, loss_weights=list(weights),
                      metrics=[["accuracy"], ["mae"]])
    return model


@pytest.mark.parametrize("loss_form", ["dict", "list"])
def test_the_task_is_a_weighted_loss_per_output(loss_form):
    workload = prepare_workload(two_heads(loss_form), None, x=X, y=LABELS)
    task = workload.task
    assert isinstance(task, MultiOutputTask)
    assert [(h.name, h.weight, h.task.sparse_labels) for h in task.heads] == \
        [("kind", 1.0, True), ("size", 0.5, False)]
    assert task.metric == "kind_accuracy"  # Keras's history name for the first output's metric
    # Labels packed side by side: one column of class indices, then the two regression values.
    assert workload.dataset.y_train.shape[1] == 3
    unpacked = task.unpack(workload.dataset.y_test)
    assert unpacked["kind"].dtype == np.int32 and unpacked["size"].shape[1:] == (2,)


def test_the_native_total_loss_is_keras_weighted_sum():
    """Same initial weights, batches in order and optimizer: the native engine's per-step loss
    is Keras ``train_on_batch``'s (the weighted sum of per-output losses) within 2e-5."""
    workload = prepare_workload(two_heads(), None, x=X, y=LABELS)
    native_model = workload.first_model()
    keras_model = two_heads()
    keras_model.set_weights(native_model.get_weights())
    data, spec, batch = workload.dataset, OptimizerSpec("adam", 3e-3), 16
    config = TrainConfig(model="user", optimizer=spec, batch_size=batch, epochs=1,
                         fused_steps=5, shuffle=False, task=workload.task,
                         jit_compile=JIT_FOR_SMALL_RUNS)
    compile_model(keras_model, spec, config)
    steps = len(data.x_train) // batch
    keras_losses = [float(keras_model.train_on_batch(
        data.x_train[i * batch:(i + 1) * batch],
        workload.task.unpack(data.y_train[i * batch:(i + 1) * batch]), return_dict=True)["loss"])
        for i in range(steps)]
    history = native.train(native_model, data, native.plan_of(config, data, spec), config)
    assert history.step == list(range(1, steps + 1))
    np.testing.assert_allclose(history.loss, keras_losses, rtol=2e-5, atol=1e-6)
    for got, want in zip(native_model.get_weights(), keras_model.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["native", "keras"])
def test_each_outputs_test_loss_and_metric_are_reported_and_sum_to_the_total(engine):
    """The test results name every output's loss and metric as Keras's ``evaluate`` does, and
    the total is their weighted sum (1.0 x kind + 0.5 x size), on both kinds of engine."""
    test = kbackend.train(two_heads(), X, LABELS, epochs=1, batch_size=64, engine=engine,
                          progress=False).history.test
    assert {"test_loss", "test_kind_loss", "test_size_loss", "test_kind_accuracy",
            "test_size_mae"} <= set(test)
    np.testing.assert_allclose(test["test_kind_loss"] + 0.5 * test["test_size_loss"],
                               test["test_loss"], rtol=1e-4)
    assert 0.0 <= test["test_kind_accuracy"] <= 1.0 and test["test_size_mae"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["native", "keras", "data_parallel", "keras_data_parallel"])
def test_each_engine_trains_both_heads_to_a_target_on_one_output(engine):
    """A target on the classification head's accuracy stops the run there; the regression head
    learns too (its validation error falls), on every engine (one device for the data-parallel
    ones: their replicas and per-device batches, the same labels packing)."""
    result = kbackend.train(two_heads(), X, LABELS, epochs=30, batch_size=32, learning_rate=0.1,
                            engine=engine, target=0.8, target_metric="val_kind_accuracy",
                            progress=False)
    history = result.history
    assert history.record.target_reached is not None
    assert history.evals[-1]["val_kind_accuracy"] >= 0.8
    assert "test_kind_accuracy" in history.test
    before = float(np.mean(np.abs(VALUES)))  # the error of predicting 0
    predicted = result.model.predict(X[:100], verbose=0)
    assert float(np.mean(np.abs(predicted[1] - VALUES[:100]))) < before


@pytest.mark.slow
def test_a_target_on_the_regression_output_reads_its_error():
    result = kbackend.train(two_heads(), X, LABELS, epochs=20, batch_size=32, learning_rate=0.1,
                            target=0.5, target_metric="val_size_mae", progress=False)
    evals = result.history.evals
    assert "val_size_mae" in evals[-1] and "val_kind_accuracy" not in evals[-1]
    assert evals[-1]["val_size_mae"] <= 0.5 and result.history.record.target_reached


@pytest.mark.slow
def test_the_cli_trains_a_saved_two_head_model_on_y_train_output_keys(tmp_path, cli):
    two_heads().save(tmp_path / "heads.keras")
    np.savez(tmp_path / "heads.npz", x_train=X[:400], y_train_kind=CLASSES[:400],
             y_train_size=VALUES[:400], x_val=X[400:], y_val_kind=CLASSES[400:],
             y_val_size=VALUES[400:])
    result = cli("train", "--model", tmp_path / "heads.keras", "--data", tmp_path / "heads.npz",
                 "--epochs", "5", "--lr", "0.1", "--target-metric", "val_kind_accuracy",
                 "--target", "0.99", "--history", tmp_path / "h.json",
                 "--save", tmp_path / "out.keras")
    assert result.returncode == 0, result.stderr
    history = json.loads((tmp_path / "h.json").read_text())
    assert history["evals"][-1]["val_kind_accuracy"] > 0.6
    saved = keras.saving.load_model(tmp_path / "out.keras")
    assert saved.output_names == ["kind", "size"]


def test_the_cli_refuses_a_target_on_an_output_the_model_lacks_with_exit_2(tmp_path, cli):
    two_heads().save(tmp_path / "heads.keras")
    np.savez(tmp_path / "heads.npz", x_train=X, y_train_kind=CLASSES, y_train_size=VALUES)
    result = cli("train", "--model", tmp_path / "heads.keras", "--data", tmp_path / "heads.npz",
                 "--target-metric", "val_colour_accuracy", "--target", "0.9")
    assert result.returncode == 2
    assert "val_<output>_<metric>" in result.stderr and "Traceback" not in result.stderr


def _bad_npz(tmp_path, **arrays):
    np.savez(tmp_path / "bad.npz", **arrays)
    return lambda: prepare_workload(two_heads(), str(tmp_path / "bad.npz"))


@pytest.mark.parametrize(("make", "error", "message"), [
    (lambda _: prepare_workload(two_heads(), None, x=X, y={**LABELS, "colour": CLASSES}),
     DataError, "Labels for output 'colour'.*no such output"),
    (lambda _: prepare_workload(two_heads(), None, x=X, y={"kind": CLASSES}),
     DataError, "Labels missing for output 'size'"),
    (lambda _: prepare_workload(two_heads(), None, x=X, y=CLASSES),
     DataError, "has 2 outputs \\['kind', 'size'\\]: give labels per output"),
    (lambda _: prepare_workload(two_heads(), None, x=X, y=LABELS, target_metric="val_colour_mae"),
     ConfigError, "val_<output>_<metric>, with <output> one of \\['kind', 'size'\\]"),
    (lambda _: prepare_workload(two_heads(), None, x=X, y=LABELS, target_metric="val_size_auc"),
     ConfigError, "Unsupported metric 'auc'"),
    (lambda _: prepare_workload(two_heads(), None, x=X, y={"kind": CLASSES, "size": X}),
     DataError, "each label has 8 values but the model's output has 2 units"),
    (lambda tmp: _bad_npz(tmp, x_train=X, y_train_kind=CLASSES, y_train_size=VALUES,
                          x_val=X[:50], y_val_kind=CLASSES[:50])(),
     DataError, "the val split misses y_val_size"),
    (lambda tmp: _bad_npz(tmp, x_train=X, y_train_kind=CLASSES, y_train_size=VALUES,
                          y_train=CLASSES)(), DataError, "use one form"),
], ids=["unknown-output", "missing-output", "one-array", "target-output", "target-metric",
        "label-shape", "npz-missing-val", "npz-both-forms"])
def test_bad_input_is_one_line_before_any_training(make, error, message, tmp_path,
                                                   engines_never_run):
    with pytest.raises(error, match=message) as raised:
        make(tmp_path)
    assert "\n" not in str(raised.value)


def test_an_uncompiled_two_output_model_is_one_line():
    inputs = keras.Input((8,))
    model = keras.Model(inputs, [keras.layers.Dense(3, name="a")(inputs),
                                 keras.layers.Dense(1, name="b")(inputs)])
    with pytest.raises(KBackendError, match="no compiled loss: compile it with a loss per "
                                            "output") as raised:
        prepare_workload(model, None, x=X, y={"a": CLASSES, "b": VALUES[:, 0]})
    assert "\n" not in str(raised.value)


@pytest.mark.slow
def test_a_study_of_a_two_head_model_recommends_a_train_command_on_its_target(tmp_path):
    """kbackend.study on a live two-output model and dict labels: the arrays are stored as
    y_<split>_<output> keys, the runs (and their noise-scale gradients, on the task's weighted
    loss) train both heads, and the recommended command names the output's target metric."""
    result = kbackend.study(two_heads(), X, LABELS, target=0.7,
                            target_metric="val_kind_accuracy", optimizers=("sgd",),
                            batch_sizes=(16, 64), seeds=2, max_steps=300, lr_grid_size=1,
                            step_time_repeats=0, out=tmp_path, progress=False)
    assert result.best is not None
    assert "--target-metric val_kind_accuracy" in result.best.command
    stored = np.load(next((tmp_path / "data").glob("arrays-*.npz")))
    assert {"y_train_kind", "y_train_size", "y_val_size", "y_test_kind"} <= set(stored.files)


def test_advise_follow_up_target_reads_the_regression_output_error():
    """advise's follow-up study target for an error metric on one output: half the validation
    error of predicting that output's training mean (the other outputs play no part)."""
    from kbackend.advise.advisor import study_target_flags

    workload = prepare_workload(two_heads(), None, x=X, y=LABELS, target_metric="val_size_mae")
    data = workload.dataset
    size_val, size_train = (workload.task.unpack(y)["size"] for y in (data.y_val, data.y_train))
    want = 0.5 * float(np.mean(np.abs(size_val - size_train.mean(axis=0))))
    assert study_target_flags(workload.task, data) == \
        f" --target-metric val_size_mae --target {want:.3g}"
