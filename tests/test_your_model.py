"""Your model, your data (issue 34): any compiled loss trained by every engine, targets on any
metric, user sources from the command line and from Python, and bad input refused in one line.

Each loss family is checked against Keras's own ``train_on_batch`` (the loss Keras fit
minimizes), so "any loss" means the same loss, not merely some loss that goes down.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

import kbackend
import kbackend.backend_choice
from kbackend.backend_choice import keras as import_keras
from kbackend.config import Target, TrainConfig
from kbackend.data import from_arrays
from kbackend.engines import native
from kbackend.engines.keras_fit import compile_model
from kbackend.errors import ConfigError, DataError, KBackendError
from kbackend.optim import OptimizerSpec
from kbackend.task import infer_task, metric_direction, task_of_model
from kbackend.training import train
from kbackend.workload import prepare_workload
from tests.conftest import JIT_FOR_SMALL_RUNS

keras = import_keras()
RNG = np.random.default_rng(0)
X = RNG.normal(size=(420, 8)).astype(np.float32)
W = RNG.normal(size=(8, 3))
CLASSES = np.argmax(X @ W, axis=1)


def _model(units: int, activation: str | None, loss, metrics) -> object:
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(units, activation=activation)])
    model.compile("sgd", loss=loss, metrics=metrics)
    return model


# family: (output units, activation, loss, metrics, labels)
FAMILIES = {
    "sparse-logits": (3, None, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      ["accuracy"], CLASSES),
    "categorical": (3, "softmax", "categorical_crossentropy", ["accuracy"],
                    np.eye(3, dtype=np.float32)[CLASSES]),
    "binary-logits": (1, None, keras.losses.BinaryCrossentropy(from_logits=True), ["accuracy"],
                      (CLASSES == 0).astype(np.float32)),
    "mse": (1, None, "mse", ["mae"], (X @ W[:, 0]).astype(np.float32)),
    "huber": (1, None, keras.losses.Huber(delta=0.5), ["mae"], (X @ W[:, 1]).astype(np.float32)),
    "mae": (2, None, "mae", ["mse"], (X @ W[:, :2]).astype(np.float32)),
}


def _dataset(family: str):
    units, activation, loss, metrics, labels = FAMILIES[family]
    model = _model(units, activation, loss, metrics)
    task = task_of_model(model, labels)
    workload_labels = labels if task.sparse_labels else labels.reshape(len(labels), -1)
    data = from_arrays(family, X[:320], workload_labels[:320], X[320:], workload_labels[320:],
                       num_classes=units, validation_fraction=0.2, seed=0,
                       sparse_labels=task.sparse_labels)
    return model, task, data


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_loss_family_trains_as_keras_trains_it(family):
    """The native engine's step losses equal Keras's ``train_on_batch`` on the model compiled
    with the user's loss (same weights, batches and optimizer), and the metric is the model's."""
    keras_model, task, data = _dataset(family)
    native_model = keras.models.clone_model(keras_model)
    native_model.set_weights(keras_model.get_weights())
    spec = OptimizerSpec("sgd", 0.05)
    batch = 16  # 256 training samples: 16 whole batches, no partial one
    config = TrainConfig(model=family, optimizer=spec, batch_size=batch, epochs=1,
                         fused_steps=4, shuffle=False, task=task,
                         jit_compile=JIT_FOR_SMALL_RUNS)
    compile_model(keras_model, spec, config)
    keras_losses = [float(keras_model.train_on_batch(
        data.x_train[i:i + batch], data.y_train[i:i + batch], return_dict=True)["loss"])
        for i in range(0, len(data.x_train) - batch + 1, batch)]
    history = native.train(native_model, data, native.plan_of(config, data, spec), config)
    np.testing.assert_allclose(history.loss, keras_losses, rtol=2e-5, atol=1e-6)
    metric = f"val_{task.metric}"
    assert set(history.evals[-1]) >= {"val_loss", metric}
    want = keras_model.evaluate(data.x_val, data.y_val, verbose=0, return_dict=True)
    # the native evaluator against Keras's evaluate of the same weights (copied back)
    keras_model.set_weights(native_model.get_weights())
    want = keras_model.evaluate(data.x_val, data.y_val, verbose=0, return_dict=True)
    assert history.evals[-1]["val_loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-5)
    assert history.evals[-1][metric] == pytest.approx(want[task.metric], rel=1e-4, abs=1e-5)


@pytest.mark.parametrize(("name", "direction"), [
    ("val_accuracy", "max"), ("val_binary_accuracy", "max"), ("val_auc", "max"),
    ("test_precision", "max"), ("val_loss", "min"), ("val_mae", "min"),
    ("val_mean_squared_error", "min"), ("val_huber_loss", "min"), ("train_loss", "min"),
])
def test_metric_direction(name, direction):
    assert metric_direction(name) == direction


def test_an_unknown_metric_direction_is_refused():
    with pytest.raises(ConfigError, match="Unknown direction for metric 'val_widgets'"):
        metric_direction("val_widgets")


@pytest.mark.parametrize(("labels", "units", "loss", "metric"), [
    (np.array([0, 2, 1]), 3, "sparse_categorical_crossentropy", "accuracy"),
    (np.array([0, 1, 1]), 1, "binary_crossentropy", "binary_accuracy"),
    (np.eye(3)[[0, 2, 1]], 3, "categorical_crossentropy", "accuracy"),
    (np.array([0.5, 1.5, -2.0]), 1, "mean_squared_error", "mae"),
])
def test_an_uncompiled_model_task_is_inferred_from_the_labels(labels, units, loss, metric):
    task = infer_task(labels, units)
    assert (task.loss_name, task.metric, task.source) == (loss, metric, "inferred")


@pytest.mark.slow
def test_a_target_on_a_regression_error_stops_there(tmp_path):
    """``val_mae`` <= target: the direction of an error, on the native and Keras engines."""
    np.savez(tmp_path / "reg.npz", x=X, y=(X @ W[:, 0]).astype(np.float32))
    for engine, fused in (("native", 4), ("keras", 1)):
        config = TrainConfig(model=f"{tmp_path / 'build.py'}:reg",
                             dataset=str(tmp_path / "reg.npz"),
                             engine=engine, fused_steps=fused, epochs=20, batch_size=16,
                             optimizer=OptimizerSpec("adam", 1e-2), target=Target("val_mae", 0.6),
                             jit_compile=JIT_FOR_SMALL_RUNS)
        (tmp_path / "build.py").write_text(
            "import keras\n"
            "def reg(input_shape):\n"
            "    m = keras.Sequential([keras.Input(input_shape), keras.layers.Dense(16, "
            "activation='relu'), keras.layers.Dense(1)])\n"
            "    m.compile('adam', loss='mse', metrics=['mae'])\n"
            "    return m\n")
        result = train(config)
        reached = result.history.record.target_reached
        assert result.history.stopped_early
        assert result.history.evals[-1]["val_mae"] <= 0.6
        assert reached["step"] == result.history.evals[-1]["step"]
        assert "test_mae" in result.history.test
        assert result.history.config["task"]["loss"] == "mse"


@pytest.mark.slow
def test_the_python_api_takes_arrays_and_a_tf_dataset():
    tf = pytest.importorskip("tensorflow")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    model.compile("adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    result = kbackend.train(model, X[:360], CLASSES[:360], validation_data=(X[360:], CLASSES[360:]),
                            epochs=15, learning_rate=0.05, progress=False)
    assert result.history.best("val_accuracy") > 0.8  # a linear problem, learnt
    assert result.config.task.from_logits and result.dataset.info.num_val == 60
    stream = tf.data.Dataset.from_tensor_slices((X[:360], CLASSES[:360])).batch(32)
    again = kbackend.train(model, stream, validation_data=(X[360:], CLASSES[360:]), epochs=2,
                           progress=False, engine="keras")
    # no test split given: 36 samples (10%) held out as one, by a fixed draw
    assert again.dataset.info.num_train == 324 and again.dataset.info.num_test == 36
    assert again.history.evals


def test_fresh_weights_per_seed_and_the_compiled_task_kept():
    model = _model(3, "softmax", "sparse_categorical_crossentropy", ["accuracy"])
    first = prepare_workload(model, None, x=X, y=CLASSES, seed=0)
    second = prepare_workload(model, None, x=X, y=CLASSES, seed=1)
    a, b = first.build(0), second.build(1)
    assert not np.allclose(a.get_weights()[0], b.get_weights()[0])
    np.testing.assert_allclose(first.build(0).get_weights()[0], a.get_weights()[0])
    assert first.task.source == "compiled" and first.task.loss_name == \
        "sparse_categorical_crossentropy"


def _bad(model_kwargs=None, **data):
    model = _model(**(model_kwargs or {"units": 3, "activation": "softmax",
                                       "loss": "sparse_categorical_crossentropy",
                                       "metrics": ["accuracy"]}))
    return lambda: prepare_workload(model, None, **{"x": X, "y": CLASSES, **data})


@pytest.mark.parametrize(("make", "error", "message"), [
    (_bad(y=CLASSES + 0.5), DataError, "expected integer class indices"),
    (_bad(y=CLASSES + 3), DataError, "labels must lie in \\[0, 3\\)"),
    (_bad(y=np.where(CLASSES == 0, np.nan, 1.0)), DataError, "NaN"),
    (_bad(x=X[:, :5]), KBackendError, "takes inputs of shape"),
    (_bad({"units": 1, "activation": "sigmoid", "loss": "binary_crossentropy",
           "metrics": ["accuracy"]}, y=CLASSES * 2.0), DataError, "expected values in \\[0, 1\\]"),
    (_bad({"units": 2, "activation": None, "loss": "mse", "metrics": ["mae"]},
          y=X[:, :3]), DataError, "the model's output has 2 units"),
    (_bad({"units": 1, "activation": None, "loss": "mse", "metrics": ["auc"]},
          y=X[:, 0], target_metric="val_auc"), ConfigError, "Unsupported metric 'auc'"),
    (_bad({"units": 1, "activation": None, "loss": "mse", "metrics": ["accuracy"]},
          y=X[:, 0]), ConfigError, "for the regression loss"),
], ids=["float-labels", "label-too-large", "nan-labels", "input-shape", "binary-range",
        "output-units", "auc", "accuracy-for-regression"])
def test_bad_input_is_one_line_before_any_training(make, error, message, engines_never_run):
    with pytest.raises(error, match=message) as raised:
        make()
    assert "\n" not in str(raised.value)


def test_an_unknown_target_metric_lists_the_model_metrics(tmp_path, cli):
    np.savez(tmp_path / "bin.npz", x=X, y=(CLASSES == 0).astype(np.int64))
    result = cli("train", "--data", str(tmp_path / "bin.npz"), "--model", "mlp",
                 "--target-metric", "val_mae", "--target", "0.3", "--epochs", "1")
    assert result.returncode == 2
    assert "val_mae" in result.stderr and "val_accuracy" in result.stderr


@pytest.mark.slow
def test_the_cli_trains_a_user_builder_on_a_csv_and_saves_it(tmp_path, cli):
    rows = ["a,b,c,d,e,f,g,h,y"] + [",".join(f"{v:.5f}" for v in row) + f",{t:.5f}"
                                     for row, t in zip(X, X @ W[:, 0], strict=True)]
    (tmp_path / "data.csv").write_text("\n".join(rows) + "\n")
    (tmp_path / "models.py").write_text(
        "import keras\n"
        "def build(input_shape):\n"
        "    m = keras.Sequential([keras.Input(input_shape), keras.layers.Dense(16, "
        "activation='relu'), keras.layers.BatchNormalization(), keras.layers.Dense(1)])\n"
        "    m.compile('adam', loss=keras.losses.Huber(), metrics=['mae'])\n"
        "    return m\n")
    result = cli("train", "--model", f"{tmp_path / 'models.py'}:build", "--data",
                 str(tmp_path / "data.csv"), "--label", "y", "--epochs", "3", "--lr", "0.01",
                 "--save", str(tmp_path / "m.keras"), "--history", str(tmp_path / "h.json"))
    assert result.returncode == 0, result.stderr
    assert "loss huber_loss, metric mae" in result.stdout and "test_mae" in result.stdout
    history = json.loads((tmp_path / "h.json").read_text())
    assert history["config"]["model"].endswith("models.py:build")
    assert history["config"]["dataset"].endswith("data.csv")
    saved = keras.saving.load_model(tmp_path / "m.keras")
    assert saved.count_params() == history["config"]["params"]


def test_the_package_top_names_train_and_study(monkeypatch):
    import kbackend.api
    from kbackend.api import train
    from kbackend.study.config import StudyConfig

    assert kbackend.train is train
    assert callable(kbackend.study) and kbackend.study.StudyConfig is StudyConfig
    monkeypatch.setattr(kbackend.api, "study", lambda *args, **kwargs: ("api.study", args, kwargs))
    assert kbackend.study("m.py:build", target=0.9) == ("api.study", ("m.py:build",),
                                                        {"target": 0.9})


@pytest.mark.slow
@pytest.mark.skipif(kbackend.backend_choice.active_backend() != "jax",
                    reason="populations are JAX's vmap")
@pytest.mark.parametrize("family", ["huber", "binary-logits"])
def test_a_population_trains_the_user_loss_as_its_runs_alone(family):
    """The vmapped population of a cell, on the user's loss: each member equals its run."""
    model, task, data = _dataset(family)
    runs = native.Runs(model, data)
    configs = [TrainConfig(model=family, optimizer=OptimizerSpec("adam", rate), batch_size=16,
                           epochs=2, fused_steps=4, seed=seed, task=task, eval_every=8)
               for rate, seed in ((1e-2, 0), (3e-3, 1))]
    values = []
    for seed in (0, 1):
        keras.utils.set_random_seed(seed)
        values.append(native.model_values(keras.models.clone_model(model)))
    population = runs.train_population(configs, values)
    for member, config, value in zip(population, configs, values, strict=True):
        alone = runs.train(config, value)
        np.testing.assert_allclose(member.loss, alone.loss, rtol=1e-5)
        metric = f"val_{task.metric}"
        np.testing.assert_allclose([e[metric] for e in member.evals],
                                   [e[metric] for e in alone.evals], rtol=1e-5, atol=1e-6)
        assert member.test.keys() == alone.test.keys() == {"test_loss", f"test_{task.metric}"}


@pytest.mark.slow
def test_a_study_of_a_user_model_names_its_metric_and_resumes(tmp_path):
    """kbackend.study on arrays: a recommendation with the command, the report named after the
    user's model and data, and a second call reusing every stored run."""
    sys.path.insert(0, str(tmp_path))
    (tmp_path / "user_models.py").write_text(
        "import keras\n"
        "def reg(input_shape):\n"
        "    m = keras.Sequential([keras.Input(input_shape), keras.layers.Dense(16, "
        "activation='relu'), keras.layers.Dense(1)])\n"
        "    m.compile('adam', loss='mse', metrics=['mae'])\n"
        "    return m\n")
    try:
        import user_models  # written by this test, importable by name for the study

        y = (X @ W[:, 0]).astype(np.float32)
        kwargs = dict(target=1.0, target_metric="val_mae", optimizers=("adam",),
                      batch_sizes=(16, 64), seeds=2, out=tmp_path / "out", progress=False,
                      lr_grid_size=1, noise_points=0, step_time_repeats=0, max_steps=800)
        first = kbackend.study(user_models.reg, X, y, **kwargs)
        assert first.best is not None and "--target-metric val_mae" in first.best.command
        assert first.report_path.parent.name.startswith("arrays-")
        assert "user_models-reg" in first.report_path.parent.name
        assert all(row["reached"] for row in first.rows)
        again = kbackend.study(user_models.reg, X, y, **kwargs)  # every run from the store
        assert [(r["optimizer"], r["batch_size"], r["steps_to_target"], r["learning_rate"])
                for r in again.rows] == [(r["optimizer"], r["batch_size"],
                                          r["steps_to_target"], r["learning_rate"])
                                         for r in first.rows]
        assert again.report_path == first.report_path
        # With an auto cell: the fixed runs come from the store, the auto cell (a regression
        # loss: the noise scale works for any loss) is the last row, with its verdict.
        auto = kbackend.study(user_models.reg, X, y, **{**kwargs, "batch_sizes": (16, 64, "auto")})
        assert [r["batch_size"] for r in auto.rows] == [16, 64, "auto"]
        assert auto.rows[-1]["auto"] == {"min": 16, "max": 64, "lr_scaling": "sqrt"}
        assert auto.rows[-1]["seeds"] == 2
        assert [v.optimizer for v in auto.analysis.verdicts.adaptive] == ["adam"]
    finally:
        sys.path.remove(str(tmp_path))


def _two_input_model():
    numbers = keras.Input((8,), name="numbers")
    tokens = keras.Input((6,), name="tokens", dtype="int32")
    embedded = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 4)(tokens))
    hidden = keras.layers.Dense(16, activation="relu")(
        keras.layers.Concatenate()([numbers, embedded]))
    model = keras.Model({"numbers": numbers, "tokens": tokens},
                        keras.layers.Dense(3)(hidden))
    model.compile("adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["native", "keras"])
def test_a_two_input_model_trains_on_a_dict_and_saves_as_itself(engine, tmp_path):
    """Named inputs (a dict of arrays, token ids for an Embedding among them): every engine
    trains them; the saved model is the user's, with its two inputs, predicting as trained."""
    tokens = (np.abs(X[:, :6]) * 8).astype(np.int32) % 50
    x = {"numbers": X, "tokens": tokens}
    result = kbackend.train(_two_input_model(), x, CLASSES, epochs=8, learning_rate=0.02,
                            engine=engine, progress=False, save=tmp_path / "two.keras")
    assert result.history.best("val_accuracy") > 0.7
    saved = keras.saving.load_model(tmp_path / "two.keras")
    assert sorted(t.name for t in saved.inputs) == ["numbers", "tokens"]
    sample = {"numbers": X[:5], "tokens": tokens[:5]}
    np.testing.assert_allclose(saved.predict(sample, verbose=0),
                               result.model.predict(sample, verbose=0), rtol=1e-5, atol=1e-6)


def test_dict_inputs_that_do_not_match_the_model_are_one_line():
    x = {"numbers": X, "words": X[:, :6]}
    with pytest.raises(KBackendError, match="takes inputs named") as raised:
        prepare_workload(_two_input_model(), None, x=x, y=CLASSES)
    assert "\n" not in str(raised.value)


# A model that starts with TextVectorization trains: tests/test_string_front.py.


def test_a_study_cell_trains_its_own_optimizer_not_the_compiled_one():
    """A user model compiled with Adam, in a study cell asking for SGD: the cell's trainer
    steps with SGD (on TensorFlow the native loop could take the model's own optimizer)."""
    model, task, data = _dataset("mse")
    model.compile("adam", loss="mse", metrics=["mae"])
    runs = native.Runs(model, data)
    config = TrainConfig(model="mse", optimizer=OptimizerSpec("sgd", 0.05), batch_size=16,
                         epochs=1, fused_steps=4, task=task)
    trainer = runs.trainer(config)
    if hasattr(trainer, "optimizer"):  # TensorFlow: the Keras optimizer the loop steps with
        assert type(trainer.optimizer).__name__ == "SGD"
    else:  # JAX: the optax transform made from the cell's spec
        assert trainer.spec.name == "sgd"
    assert runs.train(config, native.model_values(model)).steps_run == 16


# The recommendation's rule, command and confirmation: tests/test_recommend.py.
