"""A user's model or data that does not fit (issue 45): each a one-line answer, exit 2, before
any work, with the files already there unchanged; or, where the issue says so, a warning and
training goes on."""

from __future__ import annotations

import numpy as np
import pytest

from kbackend.backend_choice import keras as import_keras
from tests.conftest import one_line_error

keras = import_keras()
RNG = np.random.default_rng(0)
X = RNG.normal(size=(200, 8)).astype(np.float32)
Y = (X[:, 0] > 0).astype(np.int64) + (X[:, 1] > 0.5)
QUICK = ["--epochs", "1", "--max-steps", "2", "--quiet", "--fused-steps", "1"]
OLD = b"an earlier file"


def _outputs(tmp_path) -> list[str]:
    """--save and --history at files that are there already (a refusal leaves them as they are)."""
    (tmp_path / "old.keras").write_bytes(OLD)
    (tmp_path / "old.json").write_bytes(OLD)
    return ["--save", str(tmp_path / "old.keras"), "--history", str(tmp_path / "old.json")]


def _refused(result, message: str, tmp_path=None) -> None:
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert one_line_error(result.stderr), result.stderr[-3000:]
    assert message in result.stderr, result.stderr[-2000:]
    if tmp_path is not None:
        for name in ("old.keras", "old.json"):
            assert (tmp_path / name).read_bytes() == OLD


@pytest.mark.slow
def test_a_saved_flat_model_trains_on_a_built_in_dataset_reshaped(tmp_path, cli):
    # A non-built-in model on a built-in dataset: the model's input shape decides the layout.
    saved = cli("train", "--dataset", "digits", "--model", "logistic", *QUICK,
                "--save", str(tmp_path / "flat.keras"))
    assert saved.returncode == 0, saved.stderr
    again = cli("train", "--model", str(tmp_path / "flat.keras"), "--dataset", "digits", *QUICK)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "digits reshaped from (8, 8, 1) to the model's input shape (64,)" in again.stdout


def test_a_model_whose_input_size_differs_from_a_built_in_dataset_is_one_line(tmp_path, cli):
    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(10, activation="softmax")])
    model.save(tmp_path / "ten.keras")
    result = cli("train", "--model", str(tmp_path / "ten.keras"), "--dataset", "digits", *QUICK,
                 *_outputs(tmp_path))
    _refused(result, "takes inputs of shape (N, 10), the data (digits) has (N, 8, 8, 1)",
             tmp_path)


EXITS = ("import sys\n\n\ndef build():\n    sys.exit({code})\n\n\n"
         "def data():\n    sys.exit({code})\n")


@pytest.mark.parametrize("code", [0, 3])
@pytest.mark.parametrize("where", ["model", "data"])
@pytest.mark.parametrize("command", ["train", "study", "advise"])
def test_sys_exit_in_a_users_function_is_one_line_naming_it(tmp_path, cli, code, where,
                                                            command):
    (tmp_path / "user.py").write_text(EXITS.format(code=code))
    source = ["--model", f"{tmp_path / 'user.py'}:build"] if where == "model" else \
        ["--data", f"{tmp_path / 'user.py'}:data"]
    extra = {"train": [*QUICK, *_outputs(tmp_path)],
             "study": ["--out", str(tmp_path / "study"), "--target", "0.5"], "advise": []}
    result = cli(command, *source, *extra[command])
    named = "Builder 'user.py:build'" if where == "model" else "user.py:data()"
    _refused(result, f"{named} called sys.exit({code})",
             tmp_path if command == "train" else None)
    assert not (tmp_path / "study").exists()


def test_sys_exit_while_a_builder_file_is_imported_is_one_line(tmp_path, cli):
    (tmp_path / "user.py").write_text("import sys\nsys.exit(0)\n\n\ndef build():\n    pass\n")
    result = cli("train", "--model", f"{tmp_path / 'user.py'}:build", *QUICK)
    _refused(result, "called sys.exit(0) while it was imported")


@pytest.mark.parametrize("labels", [np.zeros(200, np.int64), np.full(200, 3)],
                         ids=["all-zero", "all-three"])
def test_one_class_npz_is_one_line(tmp_path, cli, labels):
    np.savez(tmp_path / "one.npz", x=X, y=labels)
    result = cli("train", "--data", str(tmp_path / "one.npz"), *QUICK, *_outputs(tmp_path))
    _refused(result, "needs at least two classes", tmp_path)


def test_one_class_folder_and_one_class_names_are_one_line(tmp_path, cli):
    (tmp_path / "pets" / "cats").mkdir(parents=True)
    keras.utils.save_img(tmp_path / "pets" / "cats" / "a.png", np.zeros((4, 4, 1)))
    result = cli("train", "--data", str(tmp_path / "pets"), *QUICK, *_outputs(tmp_path))
    _refused(result, "one class subfolder (cats/): classification needs at least two classes",
             tmp_path)
    rows = ["a,b,label"] + [f"{a:.3f},{b:.3f},cat" for a, b in X[:, :2]]
    (tmp_path / "cats.csv").write_text("\n".join(rows) + "\n")
    result = cli("train", "--data", str(tmp_path / "cats.csv"), "--label", "label", *QUICK)
    _refused(result, "every label of the training split is 'cat'")


def test_the_python_api_refuses_x_and_data_together():
    import kbackend
    from kbackend.errors import ConfigError

    with pytest.raises(ConfigError, match="Data given twice") as raised:
        kbackend.train("mlp", X, Y, data="digits")
    assert "\n" not in str(raised.value)


def _builder_file(tmp_path, body: str, name: str = "m.py") -> str:
    (tmp_path / name).write_text(f"import keras\n\n\ndef build(input_shape, num_classes):\n{body}")
    return f"{tmp_path / name}:build"


TOP_K = """    model = keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                              keras.layers.Dense(num_classes, activation="softmax")])
    model.compile(loss="sparse_categorical_crossentropy",
                  metrics=[keras.metrics.SparseTopKCategoricalAccuracy(k=2)])
    return model
"""


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["native", "keras"])
def test_a_top_k_metric_is_reported_and_targeted_as_itself(tmp_path, engine):
    # Keras's own SparseTopKCategoricalAccuracy(k=2) on the trained model gives the reported
    # validation value (per sample, so the means agree); top-1 accuracy differs.
    import kbackend

    x = RNG.normal(size=(300, 8)).astype(np.float32)
    y = np.argmax(x[:, :4] + 0.5 * RNG.normal(size=(300, 4)), axis=1)
    namespace: dict = {}
    exec(compile("import keras\ndef build(input_shape, num_classes):\n" + TOP_K, "m", "exec"),
         namespace)
    result = kbackend.train(namespace["build"](input_shape=(8,), num_classes=4), x, y,
                            validation_data=(x[:100], y[:100]), epochs=2, engine=engine,
                            fused_steps=1, target=0.99, progress=False)
    metric = "val_sparse_top_k_categorical_accuracy"
    assert result.config.task.metric_args == (("k", 2),) and result.config.target.metric == metric
    reported = result.history.evals[-1][metric]
    keras_top2 = keras.metrics.SparseTopKCategoricalAccuracy(k=2)
    keras_top2.update_state(y[:100], result.model.predict(x[:100], verbose=0))
    top1 = float(np.mean(np.argmax(result.model.predict(x[:100], verbose=0), 1) == y[:100]))
    assert reported == pytest.approx(float(keras_top2.result()), abs=1e-6)
    assert reported != pytest.approx(top1)


def test_a_model_with_only_an_unsupported_metric_is_refused_naming_it(tmp_path, cli):
    source = _builder_file(tmp_path, TOP_K.replace(
        "keras.metrics.SparseTopKCategoricalAccuracy(k=2)", "keras.metrics.AUC()"))
    result = cli("train", "--model", source, *QUICK, *_outputs(tmp_path))
    _refused(result, "Unsupported metric 'auc'", tmp_path)


def test_a_softmax_compiled_from_logits_warns_in_one_line_and_trains(tmp_path, cli):
    source = _builder_file(tmp_path, TOP_K.replace(
        '"sparse_categorical_crossentropy"',
        "keras.losses.SparseCategoricalCrossentropy(from_logits=True)").replace(
        "keras.metrics.SparseTopKCategoricalAccuracy(k=2)", '"accuracy"'))
    result = cli("train", "--model", source, *QUICK)
    assert result.returncode == 0, result.stderr[-2000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "ends in a softmax" in warnings[0]
    assert "from_logits=True" in warnings[0]


def test_lr_scaling_with_a_fixed_batch_size_is_one_line(tmp_path, cli, engines_never_run):
    result = cli("train", "--lr-scaling", "linear", "--batch-size", "32", *QUICK,
                 *_outputs(tmp_path))
    _refused(result, "--lr-scaling linear sets how the learning rate follows a growing batch",
             tmp_path)


@pytest.mark.parametrize("command", ["train", "study"])
@pytest.mark.parametrize("model", ["builtin", "user"])
def test_an_error_metric_target_on_a_classifier_is_one_line(tmp_path, cli, command, model):
    source = [] if model == "builtin" else ["--model", _builder_file(tmp_path, TOP_K.replace(
        "keras.metrics.SparseTopKCategoricalAccuracy(k=2)", '"accuracy"'))]
    extra = [*QUICK, *_outputs(tmp_path)] if command == "train" else \
        ["--out", str(tmp_path / "study")]
    result = cli(command, *source, "--target-metric", "val_mae", "--target", "0.1", *extra)
    message = "Unknown target metric 'val_mae'" if model == "builtin" else \
        "Invalid metric 'mae' for the classifier's loss sparse_categorical_crossentropy"
    _refused(result, message, tmp_path if command == "train" else None)
    assert not (tmp_path / "study").exists()


DENSE_HEAD = """    model = keras.Sequential([keras.Input(input_shape),
                              keras.layers.Dense(num_classes, activation="softmax")])
    model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model
"""


@pytest.mark.parametrize("data", ["digits", "npz"])
def test_an_output_that_cannot_match_the_labels_is_one_line(tmp_path, cli, data,
                                                            engines_never_run):
    np.savez(tmp_path / "x.npz", x=RNG.normal(size=(100, 4, 2)).astype(np.float32),
             y=RNG.integers(0, 3, 100))
    source = ["--dataset", "digits"] if data == "digits" else ["--data", str(tmp_path / "x.npz")]
    result = cli("train", "--model", _builder_file(tmp_path, DENSE_HEAD), *source, *QUICK,
                 *_outputs(tmp_path))
    shape = "(N, 8, 8, 10)" if data == "digits" else "(N, 4, 3)"
    _refused(result, f"gives outputs of shape {shape}, and its loss "
                     "sparse_categorical_crossentropy takes class indices", tmp_path)
