"""The one environment description: the study's run identity is part of what every report stores."""

from __future__ import annotations

import os
import subprocess
import sys

from kbackend import __version__
from kbackend.envinfo import environment, environment_identity, relevant_env
from tests.conftest import ROOT


def test_environment_holds_the_identity_the_study_keys_runs_by():
    identity = environment_identity()
    env = environment()
    assert {key: env[key] for key in identity} == identity
    assert set(identity) == {"backend", "versions", "device"}
    assert identity["versions"]["kbackend"] == __version__ and identity["versions"]["keras"]
    assert f"; {os.cpu_count()} cpus; " in identity["device"]
    assert env["cpu_count"] == os.cpu_count() and env["devices"]


def test_only_the_frameworks_variables_are_listed(monkeypatch):
    # Terraform's, not TensorFlow's
    monkeypatch.setenv("TF_CLI_CONFIG_FILE", "/home/me/.terraformrc")
    monkeypatch.setenv("TF_VAR_region", "eu")
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    monkeypatch.setenv("TF_CONFIG", "{}")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    listed = relevant_env()
    assert "TF_CLI_CONFIG_FILE" not in listed and "TF_VAR_region" not in listed
    assert {"TF_CPP_MIN_LOG_LEVEL", "TF_CONFIG", "XLA_FLAGS"} <= set(listed)


def test_info_imports_neither_keras_nor_tensorflow():
    """``kbackend info`` describes the environment without paying for Keras's import (a fresh
    process: this one has imported Keras already)."""
    code = ("import sys; from kbackend.cli import main; code = main(['info', '--json']); "
            "print(code, 'keras' in sys.modules, 'tensorflow' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, timeout=120, env={**os.environ, "KERAS_BACKEND": "jax"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "0 False False"
    assert '"image_data_format": "channels_last"' in result.stdout
