"""A ``.keras`` file with the user's own registered classes (issue 45): the missing class named
in one line, and ``--import MODULE`` (a module name or FILE.py) imported by the command and by
every process it starts (``model_sources.IMPORT_ENV``)."""

from __future__ import annotations

import importlib
import json
import os
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from kbackend import model_sources
from kbackend.model_sources import IMPORT_ENV, ModelError, load_model, register_imports
from tests.conftest import BACKEND, one_line_error

LAYERS = '''
import keras


@keras.saving.register_keras_serializable(package="{package}")
class Scale(keras.layers.Layer):
    def __init__(self, factor=2.0, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * self.factor

    def get_config(self):
        return {{**super().get_config(), "factor": self.factor}}
'''


@pytest.fixture
def custom_model(tmp_path, monkeypatch):
    """(folder, module name, model path): a module registering ``Scale`` under a package name
    unique to this test, and a digits-shaped model using it saved beside it; the class is then
    unregistered and the module forgotten, as in a fresh process."""
    import keras

    monkeypatch.setenv(IMPORT_ENV, "[]")  # whatever --import records is undone after the test
    monkeypatch.setattr(model_sources, "_imported", set())
    package = f"pkg{uuid.uuid4().hex[:8]}"
    name = f"layers_{package}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(LAYERS.format(package=package)))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    model = keras.Sequential([keras.Input((8, 8, 1)), module.Scale(0.5), keras.layers.Flatten(),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    path = tmp_path / "custom.keras"
    model.save(path)
    keras.saving.get_custom_objects().pop(f"{package}>Scale")
    sys.modules.pop(name)
    sys.path.remove(str(tmp_path))
    return tmp_path, name, path


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


TRAIN = ("train", "--dataset", "digits", "--epochs", "1", "--fused-steps", "1", "--quiet")


def test_an_unregistered_class_is_named_in_one_line(custom_model, cli, tmp_path):
    folder, name, path = custom_model
    before = _snapshot(folder)
    result = cli(*TRAIN, "--model", path, "--save", folder / "out.keras")
    assert result.returncode == 2
    assert one_line_error(result.stderr), result.stderr
    assert "'Scale'" in result.stderr and f"--import {name}" in result.stderr
    assert _snapshot(folder) == before  # nothing written


def test_train_with_import_of_a_module_name_or_a_file_succeeds(custom_model, cli, monkeypatch):
    folder, name, path = custom_model
    monkeypatch.chdir(folder)  # a module name is found from the working folder, as python -m
    result = cli(*TRAIN, "--model", path, "--import", name, "--save", folder / "out.keras")
    assert result.returncode == 0, result.stderr
    assert (folder / "out.keras").is_file()
    # recorded for the processes the command started; undone on return in this process
    assert json.loads(os.environ[IMPORT_ENV]) == []


def test_import_of_a_file_reaches_the_one_loader(custom_model, monkeypatch):
    folder, name, path = custom_model
    with pytest.raises(ModelError, match="uses the class 'Scale'"):
        load_model(path)
    register_imports([str(folder / f"{name}.py")])
    assert next(type(layer).__name__ for layer in load_model(path).layers) == "Scale"


@pytest.mark.parametrize(("spec", "message"), [
    ("missing_file.py", "file not found"), ("not a module", "expected a module name"),
    ("no_such_module_kb45", "No module named 'no_such_module_kb45'"),
    ("exits_kb45", "failed to import: SystemExit: 0")])
def test_a_bad_import_is_one_line_before_any_work(cli, monkeypatch, engines_never_run, spec,
                                                  message, tmp_path):
    monkeypatch.setenv(IMPORT_ENV, "[]")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "exits_kb45.py").write_text("import sys\nsys.exit(0)\n")
    result = cli(*TRAIN, "--import", spec)
    assert result.returncode == 2 and one_line_error(result.stderr), result.stderr
    assert "--import" in result.stderr and message in result.stderr


def _subparser(parser, names):
    import argparse

    for name in names:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


@pytest.mark.parametrize("command", [["train"], ["study"], ["equiv"], ["serve"], ["predict"],
                                     ["export"], ["cache", "warm"], ["advise"], ["launch"]])
def test_every_command_that_loads_a_model_takes_import(command):
    from kbackend.cli import build_parser

    parser = _subparser(build_parser(command[0]), command)
    flags = {o: a for a in parser._actions for o in a.option_strings}
    assert flags["--import"].dest == "imports" and flags["--import"].default == []


def child_layer_names(path: str) -> list[str]:
    """Run in a child process (``run_in_child``): the layer classes of the model at ``path``."""
    return [type(layer).__name__ for layer in load_model(path).layers]


@pytest.mark.slow  # two child processes
def test_a_child_process_inherits_the_imports(custom_model, monkeypatch):
    from kbackend.runtime.child import ChildFailed, run_in_child

    folder, name, path = custom_model
    target = f"{__name__}:child_layer_names"
    with pytest.raises(ChildFailed, match="uses the class 'Scale'"):
        run_in_child(target, BACKEND, {"path": str(path)}, timeout_s=120)
    monkeypatch.chdir(folder)
    register_imports([name], import_now=False)
    monkeypatch.chdir("/")  # the child starts elsewhere: the recorded folder finds the module
    assert run_in_child(target, BACKEND, {"path": str(path)}, timeout_s=120)[0] == "Scale"


def test_ray_workers_get_the_imports(custom_model):
    from kbackend.study.ray_executor import worker_env

    folder, name, _path = custom_model
    register_imports([str(folder / f"{name}.py")], import_now=False)
    assert json.loads(worker_env(BACKEND)[IMPORT_ENV]) == [{"file": str(folder / f"{name}.py")}]


def test_the_one_loader_names_the_lambda_flag_only_where_a_command_has_it(tmp_path):
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Lambda(lambda t: t * 2.0),
                              keras.layers.Dense(2)])
    path = tmp_path / "lambda.keras"
    model.save(path)
    with pytest.raises(ModelError, match="Pass --unsafe-deserialization"):
        load_model(path)
    with pytest.raises(ModelError) as raised:
        load_model(path, serving=True)
    assert "--unsafe-deserialization" not in str(raised.value)
    assert "loads only models without Lambda layers" in str(raised.value)


@pytest.mark.slow  # a two-process job
def test_launch_workers_get_the_imports(custom_model, cli, monkeypatch):
    """``launch -N 2 --import MODULE`` trains a .keras file with the user's registered layer in
    every process; without it each process names the class in its one-line error (exit 2)."""
    folder, name, path = custom_model
    monkeypatch.chdir(folder)
    args = ("--", "--model", str(path), "--dataset", "digits", "--epochs", "1", "--quiet")
    refused = cli("launch", "-N", "2", *args)
    output = refused.stdout + refused.stderr
    assert refused.returncode == 2 and "uses the class 'Scale'" in output, output[-2000:]
    result = cli("launch", "-N", "2", "--import", name, *args)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
