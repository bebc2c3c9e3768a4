"""The one environment description: the study's run identity is part of what every report stores."""

from __future__ import annotations

import os

from kbackend import __version__
from kbackend.envinfo import environment, environment_identity, relevant_env


def test_environment_holds_the_identity_the_study_keys_runs_by():
    identity = environment_identity()
    env = environment()
    assert {key: env[key] for key in identity} == identity
    assert set(identity) == {"backend", "versions", "device"}
    assert identity["versions"]["kbackend"] == __version__ and identity["versions"]["keras"]
    assert f"; {os.cpu_count()} cpus; " in identity["device"]
    assert env["cpu_count"] == os.cpu_count() and env["devices"]


def test_only_the_frameworks_variables_are_listed(monkeypatch):
    monkeypatch.setenv("TF_CLI_CONFIG_FILE", "/home/me/.terraformrc")  # Terraform's, not TensorFlow's
    monkeypatch.setenv("TF_VAR_region", "eu")
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    monkeypatch.setenv("TF_CONFIG", "{}")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    listed = relevant_env()
    assert "TF_CLI_CONFIG_FILE" not in listed and "TF_VAR_region" not in listed
    assert {"TF_CPP_MIN_LOG_LEVEL", "TF_CONFIG", "XLA_FLAGS"} <= set(listed)
