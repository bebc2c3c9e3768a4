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


def test_conflict_with_already_imported_keras_is_reported():
    # A fresh process, so that Keras can be imported there with a backend of the test's choosing.
    code = (
        "import os; os.environ['KERAS_BACKEND']='jax'; import keras; "
        "from kbackend.backend_choice import use_backend; use_backend('tensorflow')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "already imported with backend 'jax'" in result.stderr


def test_torch_is_not_importable_and_not_imported():
    # A fresh process: sys.modules here holds whatever other tests imported.
    code = (
        "import importlib.util, sys; assert importlib.util.find_spec('torch') is None, 'torch installed'; "
        "import kbackend.training, kbackend.models, kbackend.data, kbackend.cli; "
        "import kbackend.backends; kbackend.backends.impl(); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


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
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    imported, skipped, train_samples = json.loads(result.stdout.strip().splitlines()[-1])
    assert imported == [] and skipped
    assert train_samples > 1000  # scikit-learn imported normally once the frameworks were in


def test_a_library_process_keeps_keras_integrations():
    from kbackend.backend_choice import keras

    keras()
    import keras.src.wrappers.fixes as fixes

    assert fixes.sklearn is not None  # keras.wrappers works for a library user's code
