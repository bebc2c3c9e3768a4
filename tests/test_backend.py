"""Backend selection: the two supported backends work; torch and unknown names fail clearly."""

from __future__ import annotations

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
