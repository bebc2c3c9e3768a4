"""Backend selection: the two supported backends work; torch and unknown names fail clearly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kbackend.backend_choice import BACKENDS, requested_backend, validate_backend
from kbackend.errors import BackendError
from tests.conftest import BACKEND


@pytest.mark.parametrize("name", BACKENDS)
def test_supported_backends_validate(name):
    assert validate_backend(name) == name
    assert validate_backend(name.upper()) == name


def test_torch_is_refused_as_pytorch_free():
    with pytest.raises(BackendError, match="PyTorch-free"):
        validate_backend("torch")


def test_unknown_backend_lists_choices():
    with pytest.raises(BackendError, match=r"Expected one of .*jax.*Received: backend='numpy'"):
        validate_backend("numpy")


def test_requested_backend_reads_env(monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    assert requested_backend() == "tensorflow"
    assert requested_backend("jax") == "jax"


@pytest.mark.parametrize("name", BACKENDS)
def test_info_runs_under_each_backend(cli, cli_process, name):
    if name == BACKEND:
        result = cli("info")
    else:
        # A fresh process: this one has imported Keras with the session's backend. The --backend
        # flag must override KERAS_BACKEND (the session's) before anything imports Keras.
        result = cli_process("info", "--backend", name, backend=BACKEND)
    assert result.returncode == 0, result.stderr
    assert f"backend:            {name}" in result.stdout
    assert "keras:" in result.stdout and "optax:" in result.stdout
    assert "devices:" in result.stdout and "cpu" in result.stdout.lower()
    assert "image data format:  channels_last" in result.stdout


@pytest.mark.parametrize(("value", "message"), [
    ("torch", "kbackend is PyTorch-free"),
    ("mxnet", "Expected one of"),
])
def test_bad_backend_env_is_one_line_error(cli_process, value, message):
    # A fresh process: the bad KERAS_BACKEND must be refused before anything imports Keras.
    result = cli_process("info", backend=value)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


@pytest.mark.slow
def test_conflict_with_already_imported_keras_is_reported():
    # A fresh process, so that Keras can be imported there with a backend of the test's choosing.
    code = (
        "import os; os.environ['KERAS_BACKEND']='jax'; import keras; "
        "from kbackend.backend_choice import use_backend; use_backend('tensorflow')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    assert "already imported with backend 'jax'" in result.stderr


@pytest.mark.slow
def test_torch_is_not_importable_and_not_imported():
    # A fresh process: sys.modules here holds whatever other tests imported.
    code = (
        "import importlib.util, sys; "
        "assert importlib.util.find_spec('torch') is None, 'torch installed'; "
        "import kbackend.training, kbackend.models, kbackend.data, kbackend.cli; "
        "import kbackend.backends; kbackend.backends.impl(); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_a_command_process_imports_the_frameworks_without_their_unused_integrations():
    # A fresh process, as a command's own: here Keras was imported with its integrations.
    code = (
        "import json, sys; from kbackend import backend_choice as bc; "
        f"bc.skip_optional_imports(); bc.use_backend({BACKEND!r}); "
        "from kbackend.backends import impl; impl(); keras = bc.keras(); "
        f"imported = [n for n in bc.OPTIONAL_IMPORTS[{BACKEND!r}] if n in sys.modules]; "
        "import keras.src.wrappers.fixes as fixes; skipped = fixes.sklearn is None; "
        "from kbackend.data import load; digits = load('digits'); "  # scikit-learn's data
        "import matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot; "
        "print(json.dumps([imported, skipped, len(digits.x_train)]))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    imported, skipped, train_samples = json.loads(result.stdout.strip().splitlines()[-1])
    assert imported == [] and skipped
    assert train_samples > 1000  # scikit-learn imported normally once the frameworks were in


def test_a_library_process_keeps_keras_integrations():
    from kbackend.backend_choice import keras

    keras()
    import keras.src.wrappers.fixes as fixes

    assert fixes.sklearn is not None  # keras.wrappers works for a library user's code


# -- the order Keras follows: KERAS_BACKEND, then keras.json's "backend", then the default ------
@pytest.fixture
def keras_home(tmp_path, monkeypatch):
    """A temporary KERAS_HOME, no KERAS_BACKEND and, for the decision alone, no imported Keras
    (this process imported it: then Keras's own backend would decide)."""
    import kbackend.backend_choice as choice

    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    monkeypatch.delitem(sys.modules, "keras", raising=False)
    monkeypatch.setattr(choice, "_chosen", None)
    return tmp_path


def _write_config(folder, text):
    (folder / "keras.json").write_text(text)
    return str(folder / "keras.json")


@pytest.mark.parametrize(("config", "env", "flag", "expected"), [
    (None, None, None, ("jax", "default")),
    ('{"backend": "tensorflow"}', None, None, ("tensorflow", "CONFIG")),
    ('{"backend": "jax", "floatx": "float32"}', None, None, ("jax", "CONFIG")),
    ('{"backend": "tensorflow"}', "jax", None, ("jax", "KERAS_BACKEND")),
    ('{"backend": "tensorflow"}', "", None, ("tensorflow", "CONFIG")),  # empty: not set (Keras)
    ('{"backend": "jax"}', "jax", "tensorflow", ("tensorflow", "--backend")),
    ('{"floatx": "float32"}', None, None, ("jax", "default")),  # no "backend" key
    ("not json", None, None, ("jax", "default")),  # Keras ignores a file it cannot parse
    ('["tensorflow"]', None, None, ("jax", "default")),
], ids=["nothing", "config", "config-jax", "env-first", "empty-env", "flag-first", "no-key",
        "not-json", "not-an-object"])
def test_the_backend_follows_keras_order_and_says_what_decided(keras_home, monkeypatch, config,
                                                                 env, flag, expected):
    from kbackend.backend_choice import backend_decision

    path = _write_config(keras_home, config) if config is not None else None
    if env is not None:
        monkeypatch.setenv("KERAS_BACKEND", env)
    backend, source = expected
    assert backend_decision(flag) == (backend, path if source == "CONFIG" else source)


@pytest.mark.parametrize(("value", "message"), [
    ('"torch"', "kbackend is PyTorch-free"),
    ('"mxnet"', "Expected one of ['jax', 'tensorflow']. Received: backend='mxnet'"),
    ("3", "expected a string"),
])
def test_a_bad_backend_in_keras_json_is_refused_naming_the_file(keras_home, value, message):
    from kbackend.backend_choice import backend_decision

    path = _write_config(keras_home, f'{{"backend": {value}}}')
    with pytest.raises(BackendError, match="Invalid backend") as caught:
        backend_decision()
    assert f"(from {path})" in str(caught.value) and message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_keras_imported_before_kbackend_chose_decides_in_place_of_the_default(keras_home,
                                                                              monkeypatch):
    from types import SimpleNamespace

    from kbackend.backend_choice import backend_decision

    imported = SimpleNamespace(backend=SimpleNamespace(backend=lambda: "tensorflow"))
    monkeypatch.setitem(sys.modules, "keras", imported)
    assert backend_decision() == ("tensorflow", "Keras, already imported")


def _fresh_env(keras_home) -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    return {**env, "KERAS_HOME": str(keras_home)}


@pytest.mark.slow
def test_info_says_keras_json_decided_and_torch_there_is_refused(tmp_path):
    # Fresh processes without KERAS_BACKEND: the file decides. torch is refused before any
    # framework is imported; the other backend than the default is then the one that runs.
    path = _write_config(tmp_path, '{"backend": "torch"}')
    refused = subprocess.run([sys.executable, "-m", "kbackend", "info"], capture_output=True,
                             text=True, timeout=120, env=_fresh_env(tmp_path))
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip().splitlines() == [
        f"kbackend: error: Invalid backend 'torch' (from {path}): kbackend is PyTorch-free. "
        "Expected one of ['jax', 'tensorflow']; set KERAS_BACKEND=jax or KERAS_BACKEND=tensorflow."]
    _write_config(tmp_path, '{"backend": "tensorflow"}')
    result = subprocess.run([sys.executable, "-m", "kbackend", "info", "--json"],
                            capture_output=True, text=True, timeout=300,
                            env=_fresh_env(tmp_path))
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert (info["backend"], info["backend_source"]) == ("tensorflow", path)


@pytest.mark.slow
def test_with_no_keras_json_the_default_is_written_for_keras_too(tmp_path):
    # Keras writes keras.json on its first import with its own default (tensorflow), which would
    # decide the next run: kbackend writes its default there first, in Keras's format.
    code = ("import kbackend.backend_choice as c, sys; print(c.use_backend(), c.backend_source());"
            "import keras; print(keras.backend.backend())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env=_fresh_env(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["jax", "default", "jax"]
    assert json.loads((tmp_path / "keras.json").read_text()) == {
        "floatx": "float32", "epsilon": 1e-07, "backend": "jax",
        "image_data_format": "channels_last"}
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120, env=_fresh_env(tmp_path))
    assert again.stdout.split() == ["jax", str(tmp_path / "keras.json"), "jax"], again.stderr
