"""The one environment description: the study's run identity is part of what every report stores."""

from __future__ import annotations

import os

from kbackend import __version__
from kbackend.envinfo import environment, environment_identity


def test_environment_holds_the_identity_the_study_keys_runs_by():
    identity = environment_identity()
    env = environment()
    assert {key: env[key] for key in identity} == identity
    assert set(identity) == {"backend", "versions", "device"}
    assert identity["versions"]["kbackend"] == __version__ and identity["versions"]["keras"]
    assert f"; {os.cpu_count()} cpus; " in identity["device"]
    assert env["cpu_count"] == os.cpu_count() and env["devices"]
