"""A process SIGKILLed at a chosen point of a save or a cache warm loses nothing it committed,
and the next run finds no partial file and no temp file, from its start on (issue 14, Tests:
crash tests).

The kill is injected, not timed: the child replaces one function with a wrapper that kills the
process when it is reached (after the temp file is complete but before the rename; after the
second chunk of a warm was committed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kbackend.cache import open_store
from kbackend.io import check_output_path
from kbackend.training import save_model
from tests.conftest import BACKEND, ROOT
from tests.test_cache import tiny_model

# Each test starts a fresh Python that imports Keras: tens of seconds on a loaded 2-core box.
pytestmark = pytest.mark.slow


def _run_until_killed(code: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                            text=True, cwd=ROOT, timeout=300,
                            env={**os.environ, "KERAS_BACKEND": BACKEND})
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    return result


def _temp_files(folder):
    return [p.name for p in folder.iterdir() if ".tmp" in p.name]


def test_save_killed_before_the_rename_keeps_the_old_model_and_the_next_save_cleans_up(tmp_path):
    target = tmp_path / "model.keras"
    target.write_bytes(b"the previous model")
    _run_until_killed(f"""
        import os, signal
        from kbackend import io
        from kbackend.training import save_model
        from tests.test_cache import tiny_model

        def kill_instead(source, destination):  # the temp file is complete and fsynced here
            os.kill(os.getpid(), signal.SIGKILL)

        io.os.replace = kill_instead
        save_model(tiny_model(), {str(target)!r})
    """)
    assert target.read_bytes() == b"the previous model"  # never a partial model
    assert len(_temp_files(tmp_path)) == 1  # the killed write's complete temp file
    check_output_path(target, "--save", suffix=".keras")  # the next run's start, before training
    assert _temp_files(tmp_path) == []
    save_model(tiny_model(), target)  # the next run's end
    assert _temp_files(tmp_path) == []
    assert target.stat().st_size > 1000


def test_cache_warm_killed_after_two_chunks_keeps_them_and_the_next_warm_completes(cli, tmp_path):
    model_path, inputs, cache = tmp_path / "tiny.keras", tmp_path / "x.npy", tmp_path / "c.db"
    tiny_model(seed=5).save(model_path)
    np.save(inputs, np.random.default_rng(0).random((40, 4), dtype=np.float32))
    _run_until_killed(f"""
        import os, signal
        from kbackend.cache import sqlite_store
        from kbackend.cli import main

        put_many, calls = sqlite_store.SQLiteStore.put_many, []

        def put_then_die_on_the_third(self, namespace, items):
            calls.append(len(items))
            if len(calls) == 3:  # two chunks committed, the third not yet written
                os.kill(os.getpid(), signal.SIGKILL)
            return put_many(self, namespace, items)

        sqlite_store.SQLiteStore.put_many = put_then_die_on_the_third
        main(["cache", "warm", "--model", {str(model_path)!r}, "--cache", {str(cache)!r},
              "--input", {str(inputs)!r}, "--chunk", "10"])
    """)
    with open_store(str(cache), create=False) as store:
        (info,) = store.namespaces()
        assert info.entries == 20 and store.integrity_check() == "ok"
    result = cli("cache", "warm", "--model", model_path, "--cache", cache, "--input", inputs,
                 "--chunk", "10")
    assert result.returncode == 0, result.stderr
    assert "20 new entries, 20 already cached" in result.stdout
    assert _temp_files(tmp_path) == []
