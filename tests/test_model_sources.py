"""Model sources: built-ins, .keras files, builder functions (files, modules, callables) and
keras.Model instances; fresh weights per seed; the header-first .keras check; one-line errors."""

from __future__ import annotations

import sys
import textwrap
import uuid
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kbackend.backend_choice import keras as import_keras
from kbackend.backend_choice import tensorflow_kept_out
from kbackend.data import DatasetInfo
from kbackend.errors import ConfigError, KBackendError
from kbackend.model_sources import (
    MAX_CONFIG_BYTES,
    ModelError,
    ModelSource,
    check_model_file,
    check_model_matches,
    parse_model_source,
)

keras = import_keras()

FLAT = DatasetInfo(name="toy", input_shape=(4,), num_classes=3, source="test", layout="flat",
                   data_format=None, num_train=8, num_val=0, num_test=0)

BUILDERS = textwrap.dedent('''
    import keras


    @keras.saving.register_keras_serializable(package="kbackend_test")
    class Scale(keras.layers.Layer):
        def __init__(self, factor=2.0, **kwargs):
            super().__init__(**kwargs)
            self.factor = factor

        def call(self, x):
            return x * self.factor

        def get_config(self):
            return {**super().get_config(), "factor": self.factor}


    @keras.saving.register_keras_serializable(package="kbackend_test")
    class Sub(keras.Model):
        def __init__(self, num_classes=3, **kwargs):
            super().__init__(**kwargs)
            self.num_classes = num_classes
            self.dense = keras.layers.Dense(num_classes)

        def call(self, x):
            return self.dense(x)

        def get_config(self):
            return {"num_classes": self.num_classes}


    def build(input_shape, num_classes):
        inputs = keras.Input(input_shape)
        x = keras.layers.Dense(8, activation="relu")(Scale()(inputs))
        return keras.Model(inputs, keras.layers.Dense(num_classes, activation="softmax")(x))


    def build_bare():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])


    def build_unbuilt(num_classes, extra=1):
        model = keras.Sequential([keras.layers.Dense(num_classes)])
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model


    def subclassed(num_classes):
        return Sub(num_classes)


    def raises():
        raise RuntimeError("no GPU for this model")


    def not_a_model():
        return 42


    def needs_hp(hp):
        return None


    def wrong_shape():
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])


    def two_outputs(input_shape):
        inputs = keras.Input(input_shape)
        return keras.Model(inputs, [keras.layers.Dense(3)(inputs), keras.layers.Dense(2)(inputs)])


    def two_inputs(input_shape):
        a, b = keras.Input(input_shape), keras.Input(input_shape)
        return keras.Model([a, b], keras.layers.Dense(3)(keras.layers.Add()([a, b])))
''')


@pytest.fixture
def builders(tmp_path: Path) -> Path:
    path = tmp_path / "models.py"
    path.write_text(BUILDERS)
    return path


def functional(units: int = 3) -> Any:
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(units, activation="softmax")(hidden))


def saved(tmp_path: Path, model: Any, name: str = "my.keras") -> Path:
    path = tmp_path / name
    with tensorflow_kept_out():  # on JAX, Keras's save would import TensorFlow (seconds)
        model.save(path)
    return path


def compile_config(model: Any) -> dict[str, Any]:
    with tensorflow_kept_out():  # as saved()
        return model.get_compile_config()


def weights(model: Any) -> list[np.ndarray]:
    return [np.asarray(w) for w in model.get_weights()]


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def io_shapes(model: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    return tuple(model.inputs[0].shape), tuple(model.outputs[0].shape)


# --- each kind builds ----------------------------------------------------------------------------


def test_builtin_name_builds_with_kbackend_models():
    source = parse_model_source("logistic")
    assert (source.kind, source.name, source.default_metric, source.layout) == (
        "builtin", "logistic", "val_accuracy", "flat")
    assert io_shapes(source.build(FLAT, seed=1)) == ((None, 4), (None, 3))


def test_builder_file_with_a_registered_custom_layer(builders, tmp_path):
    source = parse_model_source(f"{builders}:build")
    assert (source.kind, source.name, source.default_metric, source.layout) == (
        "builder", "models.py:build", None, "spatial")
    model = source.build(FLAT)
    assert io_shapes(model) == ((None, 4), (None, 3))
    assert "Scale" in [type(layer).__name__ for layer in model.layers]
    # The layer is registered: a model holding it saves and loads as a .keras source.
    loaded = parse_model_source(saved(tmp_path, model), from_weights=True).build(FLAT)
    assert same(weights(loaded), weights(model))


def test_builder_without_arguments_and_unbuilt_sequential(builders):
    assert io_shapes(parse_model_source(f"{builders}:build_bare").build(FLAT)) == (
        (None, 4), (None, 3))
    # Built for the data's shape; its own compile settings kept.
    model = parse_model_source(f"{builders}:build_unbuilt").build(FLAT)
    assert io_shapes(model) == ((None, 4), (None, 3))
    assert compile_config(model)["metrics"] == ["accuracy"]


def test_builder_returning_a_subclassed_model(builders):
    model = parse_model_source(f"{builders}:subclassed").build(FLAT)
    assert model.built and model.count_params() == 4 * 3 + 3


def test_builder_module(tmp_path, monkeypatch):
    package = f"kbtest_{uuid.uuid4().hex[:8]}"
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "builders.py").write_text(BUILDERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    source = parse_model_source(f"{package}.builders:build")
    assert (source.kind, source.name, source.module) == (
        "builder", f"{package}.builders:build", f"{package}.builders")
    assert io_shapes(source.build(FLAT)) == ((None, 4), (None, 3))
    with pytest.raises(ModelError, match=r"defines no 'nope': .*build, build_bare"):
        parse_model_source(f"{package}.builders:nope")


def test_callable_builder():
    def make(input_shape):
        return keras.Sequential([keras.Input(input_shape), keras.layers.Dense(3)])

    source = parse_model_source(make)
    assert source.kind == "builder" and source.name.endswith(":test_callable_builder.<locals>.make")
    assert io_shapes(source.build(FLAT)) == ((None, 4), (None, 3))


def test_instance_clones_with_fresh_or_its_own_weights():
    original = functional()
    source = parse_model_source(original)
    assert (source.kind, source.name) == ("instance", original.name)
    model = source.build(FLAT, seed=3)
    assert model is not original and io_shapes(model) == ((None, 4), (None, 3))
    assert not same(weights(model), weights(original))
    copied = parse_model_source(original, from_weights=True).build(FLAT, seed=3)
    assert copied is not original and same(weights(copied), weights(original))


def test_keras_file_keeps_compile_loss_and_metrics(tmp_path):
    original = functional()
    original.compile(optimizer="sgd", metrics=["accuracy"],
                     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    source = parse_model_source(saved(tmp_path, original))
    assert (source.kind, source.name, source.path) == ("keras_file", "my.keras",
                                                       tmp_path / "my.keras")
    model = source.build(FLAT, seed=0)
    assert io_shapes(model) == ((None, 4), (None, 3))
    config = compile_config(model)
    assert config["loss"] == compile_config(original)["loss"]
    assert config["loss"]["config"]["from_logits"] is True
    assert config["metrics"] == ["accuracy"]
    assert not same(weights(model), weights(original))


def test_keras_file_from_weights_gives_the_saved_weights(tmp_path):
    original = functional()
    original.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model = parse_model_source(saved(tmp_path, original), from_weights=True).build(FLAT, seed=5)
    assert same(weights(model), weights(original))
    assert compile_config(model)["loss"] == "sparse_categorical_crossentropy"


def test_uncompiled_keras_file_stays_uncompiled(tmp_path):
    model = parse_model_source(saved(tmp_path, functional())).build(FLAT)
    assert not compile_config(model)


SOURCES: dict[str, Callable[[Path, Path], Any]] = {
    "builtin": lambda tmp_path, builders: "logistic",
    "keras_file": lambda tmp_path, builders: saved(tmp_path, functional()),
    "builder file": lambda tmp_path, builders: f"{builders}:build",
    "instance": lambda tmp_path, builders: functional(),
    "callable": lambda tmp_path, builders: functional,
}


@pytest.mark.parametrize("kind", list(SOURCES))
def test_fresh_weights_follow_the_seed(kind, tmp_path, builders):
    source = parse_model_source(SOURCES[kind](tmp_path, builders))
    first, again, other = (weights(source.build(FLAT, seed=s)) for s in (7, 7, 8))
    assert same(first, again)
    assert not same(first, other)


def test_seed_defaults_to_the_options_seed():
    from kbackend.models import ModelOptions

    source = parse_model_source(functional())
    assert same(weights(source.build(FLAT, ModelOptions(seed=4))),
                weights(source.build(FLAT, seed=4)))


def test_a_keras_file_with_a_lambda_loads_only_when_unsafe_is_allowed(tmp_path):
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(3)(keras.layers.Lambda(lambda x: x * 2.0)(inputs))
    path = saved(tmp_path, keras.Model(inputs, outputs))
    with pytest.raises(ModelError, match=r"Lambda layer.*--unsafe-deserialization"):
        parse_model_source(path)
    source = parse_model_source(path, unsafe_deserialization=True)
    assert io_shapes(source.build(FLAT)) == ((None, 4), (None, 3))


def test_a_subclassed_model_in_a_keras_file_needs_from_weights_or_a_builder(builders, tmp_path):
    model = parse_model_source(f"{builders}:subclassed").build(FLAT)
    path = saved(tmp_path, model, "sub.keras")
    with pytest.raises(ModelError, match=r"subclassed model .*pass a builder"):
        parse_model_source(path).build(FLAT)
    loaded = parse_model_source(path, from_weights=True).build(FLAT)
    assert same(weights(loaded), weights(model))


def test_check_model_matches_accepts_open_dimensions():
    sequences = DatasetInfo(name="seq", input_shape=(8, 3), num_classes=2, source="test",
                            layout="sequence", data_format=None, num_train=8, num_val=0, num_test=0)
    inputs = keras.Input((None, 3))
    pooled = keras.layers.GlobalAveragePooling1D()(inputs)
    check_model_matches(keras.Model(inputs, keras.layers.Dense(2)(pooled)), sequences)
    with pytest.raises(ModelError, match=r"takes inputs of shape \(N, \?, 3\), the data \(toy\)"):
        check_model_matches(keras.Model(inputs, keras.layers.Dense(2)(pooled)), FLAT)


def test_fresh_copies_do_not_import_tensorflow(tmp_path):
    """Keras's clone_model and get_compile_config import TensorFlow on JAX when it is installed
    (seconds, and its C++ log lines); model sources keep it out."""
    if "tensorflow" in sys.modules:
        pytest.skip("TensorFlow is imported already (its backend, or an earlier test)")
    original = functional()
    original.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    parse_model_source(original).build(FLAT)
    parse_model_source(saved(tmp_path, original)).build(FLAT)
    assert "tensorflow" not in sys.modules


def test_serving_uses_the_same_file_check():
    from kbackend.serving import model as serving

    assert serving.check_model_file is check_model_file and serving.ModelError is ModelError
    assert issubclass(ModelError, ConfigError)


# --- errors: one line each -----------------------------------------------------------------------


def zip_with(path: Path, members: dict[str, bytes], *, compress: bool = False) -> Path:
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about a duplicate name
        with zipfile.ZipFile(path, "w", method) as archive:
            for name, data in members.items():
                archive.writestr(name.split("#")[0], data)  # "name#2": the same name again
    return path


CONFIG = b'{"class_name": "Sequential", "config": {}}'
LAMBDA_CONFIG = b'{"class_name": "Functional", "config": {"layers": [{"class_name": "Lambda"}]}}'


def subclassed_instance(tmp_path: Path, builders: Path) -> Any:
    class Tiny(keras.Model):
        def call(self, x):
            return x

    return Tiny()


# name -> (make the value from (tmp_path, builders file), stage, message)
ERRORS: dict[str, tuple[Callable[[Path, Path], Any], str, str]] = {
    "builder file missing": (lambda t, b: f"{t}/absent.py:build", "parse",
                             r"Builder file '.*absent\.py' not found"),
    "syntax error": (lambda t, b: (t / "bad.py").write_text("x = 1\ndef build(:\n") and
                     f"{t}/bad.py:build", "parse", r"bad\.py:2: syntax error"),
    "function missing": (lambda t, b: f"{b}:nope", "parse",
                         r"defines no 'nope': its functions and classes are Scale, Sub, build,"),
    "file without function": (lambda t, b: str(b), "parse", r"as FILE\.py:FUNCTION"),
    "not a .py file": (lambda t, b: f"{t}/models.txt:build", "parse", "package.module:FUNCTION"),
    "module missing": (lambda t, b: "kbtest_no_such_module.sub:build", "parse",
                       "Builder module 'kbtest_no_such_module.sub' not found"),
    "unknown name": (lambda t, b: "mlpp", "parse", r"Unknown model\. Expected one of \["),
    "from_weights of a builder": (lambda t, b: f"{b}:build", "parse weights",
                                  "Invalid from_weights for model 'models.py:build'"),
    "builder raising": (lambda t, b: f"{b}:raises", "build",
                        "Builder 'models.py:raises' raised RuntimeError: no GPU for this model"),
    "builder returning a non-model": (lambda t, b: f"{b}:not_a_model", "build",
                                      r"returned builtins\.int, expected a keras\.Model"),
    "builder needing arguments": (lambda t, b: f"{b}:needs_hp", "build",
                                  r"callable with no arguments, .*signature is \(hp\)"),
    ".keras missing": (lambda t, b: t / "absent.keras", "parse", "'.*absent.keras' not found"),
    ".keras empty": (lambda t, b: (t / "e.keras").write_bytes(b"") == 0 and t / "e.keras",
                     "parse", r"is empty \(0 bytes\)"),
    ".keras not a zip": (lambda t, b: (t / "n.keras").write_text("not a model") and t / "n.keras",
                         "parse", r"is not a \.keras archive"),
    ".keras unexpected member": (
        lambda t, b: zip_with(t / "u.keras", {"config.json": CONFIG, "run.sh": b"rm -rf /"}),
        "parse", "does not load as a Keras model: unexpected member 'run.sh'"),
    ".keras member outside assets": (
        lambda t, b: zip_with(t / "p.keras", {"config.json": CONFIG, "assets/../x": b""}),
        "parse", r"unexpected member 'assets/\.\./x'"),
    ".keras member twice": (
        lambda t, b: zip_with(t / "d.keras", {"config.json": CONFIG, "config.json#2": CONFIG}),
        "parse", "member 'config.json' appears more than once"),
    ".keras without config.json": (
        lambda t, b: zip_with(t / "c.keras", {"metadata.json": b"{}"}), "parse",
        "no config.json in the archive"),
    ".keras too many members": (
        lambda t, b: zip_with(t / "m.keras", {"config.json": CONFIG,
                                              **{f"assets/{i}": b"" for i in range(1000)}}),
        "parse", "lists 1001 members, expected at most 1000"),
    ".keras oversized config.json": (
        lambda t, b: zip_with(t / "o.keras", {"config.json": b" " * (MAX_CONFIG_BYTES + 1)},
                              compress=True),
        "parse", f"config.json is {MAX_CONFIG_BYTES + 1} bytes, expected at most"),
    ".keras config not JSON": (
        lambda t, b: zip_with(t / "j.keras", {"config.json": b"{"}), "parse",
        "config.json does not read as JSON"),
    ".keras lambda in safe mode": (
        lambda t, b: zip_with(t / "l.keras", {"config.json": LAMBDA_CONFIG}),
        "parse", "has a Lambda layer.*Pass --unsafe-deserialization"),
    "subclassed instance": (subclassed_instance, "parse",
                            r"subclassed model \(.*Tiny\).*pass a builder instead"),
    "not a model at all": (lambda t, b: 42, "parse", r"Invalid model: .*Received: int"),
    "multi-input model": (lambda t, b: f"{b}:two_inputs", "build",
                          "has 2 inputs: kbackend trains a model with several inputs on data "
                          "given as a dict"),
    "input-shape mismatch": (lambda t, b: f"{b}:wrong_shape", "build",
                             r"takes inputs of shape \(N, 5\), the data \(toy\) has \(N, 4\)"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_each_bad_source_is_a_one_line_model_error(case, tmp_path, builders):
    make, stage, message = ERRORS[case]
    value = make(tmp_path, builders)
    with pytest.raises(ModelError, match=message) as caught:
        if stage == "build":
            parse_model_source(value).build(FLAT)
        else:
            parse_model_source(value, from_weights=stage == "parse weights")
    assert "\n" not in str(caught.value)
    assert isinstance(caught.value, KBackendError) and caught.value.exit_status == 2


def test_a_functional_model_with_two_outputs_builds(builders):
    """Several outputs are a multi-output task (tests/test_multi_output.py), not a bad source."""
    model = parse_model_source(f"{builders}:two_outputs").build(FLAT)
    assert len(model.outputs) == 2


def test_archive_limits_are_keyword_arguments(tmp_path):
    path = zip_with(tmp_path / "x.keras", {"config.json": CONFIG, "model.weights.h5": b"0" * 100})
    assert check_model_file(path) == path
    with pytest.raises(ModelError, match="unpack to 142 bytes, expected at most 100"):
        check_model_file(path, max_bytes=100)
    with pytest.raises(ModelError, match="lists 2 members, expected at most 1"):
        check_model_file(path, max_members=1)


def test_a_builder_file_is_imported_once_per_version(builders):
    first = parse_model_source(f"{builders}:build")
    first.build(FLAT)
    count = len(sys.modules)
    first.build(FLAT)
    assert len(sys.modules) == count
    assert isinstance(first, ModelSource) and parse_model_source(first) is first
