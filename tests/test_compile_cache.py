"""The persistent compilation caches: private to the user, off on request, reused by the next
process, and a corrupt entry is recompiled rather than fatal (JAX's, and TensorFlow's through
per-process folders and verified entries: kbackend.backends.compile_cache)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from typing import Any

import pytest

from kbackend.backends.compile_cache import (
    COMPILE_CACHE_ENV,
    compile_cache_folder,
    entry_digest,
    private_cache_folder,
    publish_entries,
)
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


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's cache (TensorFlow's: the test below)")
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


@pytest.mark.slow
def test_a_native_run_counts_its_compilations_and_compiles_at_most_five(tmp_path, monkeypatch):
    """The run's XLA programs, evaluation included, are counted into its history (goal: <= 5:
    the optimizer's init on JAX, the K-step call, the validation and test evaluations)."""
    from kbackend.training import TrainConfig, train

    monkeypatch.setenv("KBACKEND_CACHE_DIR", str(tmp_path))
    config = TrainConfig(engine="native", fused_steps=10, epochs=2, batch_size=64)  # 20 steps/epoch
    first = train(config).history.record.xla_programs
    assert 2 <= first["programs"] <= 5, first
    # The same run again in this process: every program is already built.
    assert train(config).history.record.xla_programs["programs"] <= first["programs"]


@pytest.mark.slow  # two fresh processes
@pytest.mark.skipif(BACKEND != "jax", reason="JAX counts the programs it loads from its cache")
def test_the_second_process_loads_the_runs_programs_from_the_cache(tmp_path):
    env = {**os.environ, "KBACKEND_CACHE_DIR": str(tmp_path), "KERAS_BACKEND": "jax"}
    env.pop(COMPILE_CACHE_ENV, None)
    script = ("from kbackend.training import TrainConfig, train; import json; print(json.dumps("
              "train(TrainConfig(engine='native', fused_steps=10, epochs=1, batch_size=64))"
              ".history.record.xla_programs))")

    def run() -> dict:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              env=env, cwd=ROOT, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    cold, warm = run(), run()
    assert cold["from_cache"] == 0 < cold["programs"]
    assert warm["from_cache"] == warm["programs"] == cold["programs"]  # loaded, none compiled


def test_tensorflow_entries_reach_the_shared_folder_whole_and_verified(tmp_path):
    """TensorFlow writes its cache entries in place and fails on a damaged one, so each process
    works in a private folder: verified entries copied in, its own published by rename."""
    shared = tmp_path / "shared"
    shared.mkdir()
    good = b"a compiled program"
    (shared / f"good.pb.{entry_digest(good)}").write_bytes(good)
    (shared / "damaged.pb.0123456789abcdef").write_bytes(b"cut sho")
    abandoned = shared / "process-999999999-x"  # a killed process's folder (no such pid)
    abandoned.mkdir()
    (abandoned / "half.pb").write_bytes(b"half")
    private = private_cache_folder(shared)
    assert sorted(p.name for p in private.iterdir()) == ["good.pb"]
    assert (private / "good.pb").read_bytes() == good
    assert not (shared / "damaged.pb.0123456789abcdef").exists()  # dropped, compiled again
    assert not abandoned.exists()
    (private / "new.pb").write_bytes(b"compiled here")  # what TensorFlow writes
    publish_entries(private, shared, frozenset({"good.pb"}))
    assert sorted(p.name for p in shared.iterdir()) == sorted(
        [f"good.pb.{entry_digest(good)}", f"new.pb.{entry_digest(b'compiled here')}"])
    assert not private.exists()
    publish_entries(private, shared)  # again, at exit, on a removed folder: nothing, no error


def test_tensorflow_entries_beyond_the_size_bound_go_least_recently_used_first(tmp_path,
                                                                               monkeypatch):
    from kbackend.backends import compile_cache

    shared = tmp_path / "shared"
    shared.mkdir()
    for age, name in enumerate(("old", "used", "newer")):
        data = name.encode() * 100  # 300-500 bytes each
        path = shared / f"{name}.pb.{entry_digest(data)}"
        path.write_bytes(data)
        os.utime(path, (1000 + age, 1000 + age))
    monkeypatch.setattr(compile_cache, "COMPILE_CACHE_MAX_BYTES", 1000)
    private = private_cache_folder(shared)  # copies every entry in, marking each used now
    assert all(p.stat().st_mtime > 1e6 for p in shared.iterdir())
    for age, name in enumerate(("old", "newer", "used")):  # last used: old, then newer, then used
        os.utime(next(shared.glob(f"{name}.pb.*")), (1 + age, 1 + age))
    (private / "fresh.pb").write_bytes(b"x" * 400)  # 1,600 bytes once published
    publish_entries(private, shared, frozenset({"old.pb", "used.pb", "newer.pb"}))
    assert sorted(p.name.split(".")[0] for p in shared.iterdir()) == ["fresh", "used"]


@pytest.mark.slow
@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's cache (JAX's: the tests above)")
def test_the_next_tensorflow_process_loads_entries_and_survives_a_corrupt_one(tmp_path):
    env = {**os.environ, "KBACKEND_CACHE_DIR": str(tmp_path), "KERAS_BACKEND": "tensorflow",
           "TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "device_executable_persistor=1"}
    env.pop(COMPILE_CACHE_ENV, None)
    env.pop("TF_XLA_FLAGS", None)
    code = ("from kbackend.backends import impl; impl(); import tensorflow as tf; print(float("
            "tf.function(lambda x: tf.reduce_sum(x @ x + 1.0), jit_compile=True)"
            "(tf.ones((32, 32)))))")

    def run() -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, cwd=ROOT, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split()[-1] == "33792.0"
        return done

    shared = tmp_path / "xla" / "tensorflow"
    first = run()
    entries = sorted(shared.glob("*.pb.*"))
    assert len(entries) == 1 and "Loading cached entry" not in first.stderr
    entries[0].write_bytes(b"not a compiled program")  # the name's digest no longer matches
    run()  # would fail with OutOfRangeError had TensorFlow read it
    (republished,) = sorted(shared.glob("*.pb.*"))  # the same program, compiled again
    assert republished.name.rsplit(".", 1)[0] == entries[0].name.rsplit(".", 1)[0]
    assert republished.name.rsplit(".", 1)[1] == entry_digest(republished.read_bytes())
    third = run()
    assert "Loading cached entry" in third.stderr
    assert sorted(shared.iterdir()) == [republished]  # nothing new, no private folder left


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's cache flag")
def test_a_child_gets_its_own_tensorflow_folder_and_a_users_setting_stays(tmp_path, monkeypatch):
    from kbackend.backends.tensorflow import ops

    monkeypatch.setenv("KBACKEND_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(COMPILE_CACHE_ENV, raising=False)
    parents = tmp_path / "xla" / "tensorflow" / "process-1-parent"
    monkeypatch.setenv(ops.TF_CACHE_PRIVATE_ENV, str(parents))
    monkeypatch.setenv("TF_XLA_FLAGS", f"--tf_xla_auto_jit=0 {ops.TF_CACHE_FLAG}={parents}")
    ops.start()  # as a child of a kbackend process: the parent's folder is not reused
    flags = os.environ["TF_XLA_FLAGS"].split()
    own = os.environ[ops.TF_CACHE_PRIVATE_ENV]
    assert flags == ["--tf_xla_auto_jit=0", f"{ops.TF_CACHE_FLAG}={own}"] and own != str(parents)
    assert os.path.isdir(own) and os.path.dirname(own) == str(tmp_path / "xla" / "tensorflow")
    users = f"{ops.TF_CACHE_FLAG}={tmp_path / 'mine'}"
    monkeypatch.setenv("TF_XLA_FLAGS", users)
    ops.start()
    assert os.environ["TF_XLA_FLAGS"] == users


@pytest.mark.slow
@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow counts traces of its XLA functions")
def test_a_function_collected_meanwhile_does_not_count_against_the_block():
    import gc

    import tensorflow as tf

    from kbackend.backends.tensorflow.ops import compilation_counter, jit_function

    earlier = jit_function(lambda x: x * 2.0)
    for n in (1, 2, 3):
        earlier(tf.ones((n,)))  # three traces, of a function a finished run left behind
    with compilation_counter() as counts:
        del earlier
        gc.collect()
        later = jit_function(lambda x: x + 1.0)  # held, as a trainer holds its functions
        later(tf.ones((2,)))
    assert counts["programs"] == 1  # a difference of sums said 1 - 3


# -- JAX's cache needs filelock (a size bound is set): declared, and enough in a fresh venv ------
def _declared_distributions() -> dict[str, Any]:
    """Every installed distribution kbackend's declared dependencies pull in (no extras)."""
    import importlib.metadata
    import tomllib

    from packaging.requirements import Requirement

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    found: dict[str, Any] = {}
    todo = [Requirement(text) for text in declared]
    while todo:
        requirement = todo.pop()
        name = requirement.name.lower().replace("_", "-")
        if name in found:
            continue
        found[name] = importlib.metadata.distribution(requirement.name)
        for text in found[name].requires or []:
            sub = Requirement(text)
            if sub.marker is None or sub.marker.evaluate({"extra": ""}):
                todo.append(sub)
    return found


def test_filelock_is_declared_and_importable():
    import importlib.util

    assert "filelock" in _declared_distributions()
    assert importlib.util.find_spec("filelock") is not None


def _fresh_venv(path, leave_out: tuple[str, ...] = ()):
    """A new venv holding exactly the declared dependencies (links to this environment's
    installed files, so nothing is downloaded) and kbackend from this checkout; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True,
                   timeout=120)
    python = path / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True, check=True).stdout
    site_packages = type(path)(site.strip())
    for name, distribution in _declared_distributions().items():
        if name in leave_out:
            continue
        tops = {file.parts[0] for file in distribution.files or []
                if file.parts and file.parts[0] not in ("..", "__pycache__")}
        for top in tops:
            source, target = type(path)(distribution.locate_file(top)), site_packages / top
            if source.exists() and not target.exists():
                target.symlink_to(source)
    (site_packages / "kbackend-checkout.pth").write_text(f"{ROOT}\n")
    return python


@pytest.mark.slow  # builds two venvs and starts JAX in each
@pytest.mark.skipif(BACKEND != "jax", reason="JAX's cache")
def test_a_fresh_venv_of_the_declared_dependencies_fills_the_jax_cache(tmp_path):
    # Not nox's venv (nox and virtualenv pull filelock in): only what pyproject.toml declares.
    def cache_entries(python, cache) -> tuple[int, str]:
        env = {**os.environ, "KBACKEND_CACHE_DIR": str(cache), "KERAS_BACKEND": "jax"}
        env.pop(COMPILE_CACHE_ENV, None)
        env.pop("PYTHONPATH", None)
        done = subprocess.run([str(python), "-c", JIT_ONCE], capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return len(list((cache / "xla" / "jax").glob("jit__lambda-*-cache"))), done.stderr

    declared = _fresh_venv(tmp_path / "declared")
    entries, stderr = cache_entries(declared, tmp_path / "cache-declared")
    assert entries == 1 and "filelock" not in stderr, stderr[-2000:]
    # The negative control: the same venv without filelock caches nothing, and JAX says why.
    without = _fresh_venv(tmp_path / "without", leave_out=("filelock",))
    entries, stderr = cache_entries(without, tmp_path / "cache-without")
    assert entries == 0 and "filelock" in stderr, stderr[-2000:]


# A native and an adaptive TF trainer: compile (a 0-step call), then two real 4-step calls; each
# new XLA program is one new entry in the process's private cache folder.
ONE_PROGRAM_PER_LOOP = """
import os, numpy as np
from tests.test_native_engine import toy_dataset, toy_model
from kbackend.backends import impl
from kbackend.backends.tensorflow.adaptive import AdaptiveTrainer
from kbackend.optim import OptimizerSpec
dataset = toy_dataset()
trainers = (impl().native_trainer(toy_model(dataset), OptimizerSpec("sgd", 0.1), dataset),
            AdaptiveTrainer(toy_model(dataset), OptimizerSpec("sgd", 0.1), dataset))
folder = os.environ["KBACKEND_TF_CACHE_PRIVATE"]  # set when the backend started
counts = []
for trainer in trainers:
    rows = trainer.put_epoch(np.arange(320).reshape(10, 32))
    trainer.compile(4, rows)
    before = len(os.listdir(folder))
    for start in (0, 4):
        trainer.fetch(trainer.run(rows, start, 4))
    counts.append((before, len(os.listdir(folder))))
import json; print(json.dumps(counts))
"""


@pytest.mark.slow  # a fresh process, so TensorFlow's cache folder is its own
@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's XLA loop")
def test_the_compiling_call_builds_the_program_every_later_call_runs(tmp_path):
    """The 0-step call that compiles a TF loop builds the one program every step count runs.
    Autograph's ``for i in tf.range(n)`` made XLA compile anew for each count (no retrace), so
    the first real call compiled again inside the training clock (0.9 s of a 6-step run's
    "time to target" on a CSV MLP). Counted as entries in the process's XLA cache."""
    env = {**os.environ, "KBACKEND_CACHE_DIR": str(tmp_path), "KERAS_BACKEND": "tensorflow"}
    for inherited in (COMPILE_CACHE_ENV, "TF_XLA_FLAGS", "KBACKEND_TF_CACHE_PRIVATE"):
        env.pop(inherited, None)
    done = subprocess.run([sys.executable, "-c", ONE_PROGRAM_PER_LOOP], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(before >= 1 and after == before for before, after in counts), counts
