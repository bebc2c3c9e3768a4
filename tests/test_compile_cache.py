"""The persistent compilation cache: private to the user, off on request, reused by the next
process, and a corrupt entry is recompiled rather than fatal (JAX; TensorFlow's stays off, see
kbackend.backends.compile_cache)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from kbackend.backends.compile_cache import COMPILE_CACHE_ENV, compile_cache_folder
from tests.conftest import BACKEND, ROOT

# A fresh process: the cache folder is read once, when the backend starts.
JIT_ONCE = ("from kbackend.backends import impl; impl(); import jax, jax.numpy as jnp; "
            "print(float(jax.jit(lambda x: (x @ x + 1.0).sum())(jnp.ones((32, 32)))))")


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_folder_is_private_to_the_user(tmp_path, monkeypatch):
    monkeypatch.setenv("KBACKEND_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(COMPILE_CACHE_ENV, raising=False)
    (tmp_path / "xla").mkdir(mode=0o755)
    (tmp_path / "xla").chmod(0o755)  # made by someone's umask: tightened, not trusted as is
    folder = compile_cache_folder("jax")
    assert folder == tmp_path / "xla" / "jax"
    assert _mode(folder) == 0o700 and _mode(folder.parent) == 0o700


@pytest.mark.parametrize("value", ["0", "off", "False"])
def test_it_can_be_turned_off(tmp_path, monkeypatch, value):
    monkeypatch.setenv("KBACKEND_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(COMPILE_CACHE_ENV, value)
    assert compile_cache_folder("jax") is None
    assert not (tmp_path / "xla").exists()


def test_no_compile_cache_flag_turns_it_off(cli, monkeypatch):
    monkeypatch.delenv(COMPILE_CACHE_ENV, raising=False)
    monkeypatch.setattr(os, "environ", os.environ.copy())  # the flag writes the variable
    assert cli("--help").returncode == 0  # parsing alone changes nothing
    assert COMPILE_CACHE_ENV not in os.environ
    result = cli("study", "compare", "--no-compile-cache", "/nonexistent/kbackend-report")
    assert result.returncode == 2  # refused after the flag took effect, before any work
    assert os.environ[COMPILE_CACHE_ENV] == "0"


@pytest.mark.skipif(BACKEND != "jax", reason="the persistent cache is JAX's (TensorFlow's stays off)")
def test_the_next_process_reuses_entries_and_survives_a_corrupt_one(tmp_path):
    env = {**os.environ, "KBACKEND_CACHE_DIR": str(tmp_path), "KERAS_BACKEND": "jax"}
    env.pop(COMPILE_CACHE_ENV, None)

    def run() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", JIT_ONCE], capture_output=True, text=True,
                              env=env, cwd=ROOT, timeout=300)

    first = run()
    assert first.returncode == 0, first.stderr[-2000:]
    entries = sorted((tmp_path / "xla" / "jax").glob("jit__lambda-*-cache"))
    assert len(entries) == 1, "the program was written to the cache"
    entries[0].write_bytes(b"not a compiled program")
    second = run()
    assert second.returncode == 0, second.stderr[-2000:]
    assert second.stdout.split()[-1] == first.stdout.split()[-1] == "33792.0"
    assert "Error reading persistent compilation cache entry" in second.stderr


def test_a_native_run_counts_its_compilations_and_compiles_at_most_five(tmp_path, monkeypatch):
    """The run's XLA programs, evaluation included, are counted into its history (goal: <= 5:
    the optimizer's init on JAX, the K-step call, the validation and test evaluations)."""
    from kbackend.training import TrainConfig, train

    monkeypatch.setenv("KBACKEND_CACHE_DIR", str(tmp_path))
    config = TrainConfig(engine="native", fused_steps=10, epochs=2, batch_size=64)  # 20 steps/epoch
    first = train(config).history.extra["xla_programs"]
    assert 2 <= first["programs"] <= 5, first
    # The same run again in this process: every program is already built.
    assert train(config).history.extra["xla_programs"]["programs"] <= first["programs"]


@pytest.mark.slow  # two fresh processes
@pytest.mark.skipif(BACKEND != "jax", reason="the persistent cache is JAX's (TensorFlow's stays off)")
def test_the_second_process_loads_the_runs_programs_from_the_cache(tmp_path):
    env = {**os.environ, "KBACKEND_CACHE_DIR": str(tmp_path), "KERAS_BACKEND": "jax"}
    env.pop(COMPILE_CACHE_ENV, None)
    script = ("from kbackend.training import TrainConfig, train; import json; print(json.dumps("
              "train(TrainConfig(engine='native', fused_steps=10, epochs=1, batch_size=64))"
              ".history.extra['xla_programs']))")

    def run() -> dict:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              env=env, cwd=ROOT, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    cold, warm = run(), run()
    assert cold["from_cache"] == 0 < cold["programs"]
    assert warm["from_cache"] == warm["programs"] == cold["programs"]  # loaded, none compiled
