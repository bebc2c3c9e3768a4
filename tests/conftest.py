"""Shared test fixtures. Each nox session runs one backend (KERAS_BACKEND); tests never switch
the Keras backend inside one process: other backends run in subprocesses.

The command line runs in this process (``cli``) unless a fresh process is what a test checks
(``cli_process``): backend selection before Keras is imported, multi-process start-up, crashes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("KBACKEND_OFFLINE", "1")  # tests never reach the internet
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from kbackend.backend_choice import use_backend

BACKEND = use_backend()
if os.environ.get("KBACKEND_VIRTUAL_DEVICES"):
    # The devices session: make the virtual devices before any test starts the runtime (a test
    # that calls jax.devices() first would find one device). Tests spread over the workers one by
    # one, so any of them may be a worker's first.
    from kbackend.backends import impl

    impl()
# jit_compile for the Keras engines and TensorFlow's native loop in tests whose subject is not
# compilation: TensorFlow's XLA compilation costs most of a small run on a CPU (measured:
# mixed_bfloat16, 3 epochs of digits, 26 s with it and 3.6 s without; one tiny-study run 8 s and
# 2.3 s; a process's first native run, 2 digits epochs, 14.7 s and 1.3 s), while JAX's Keras
# engine without jit runs op by op (and JAX's native loop is XLA either way). The default (XLA on)
# keeps tests of its own on both backends. NO_JIT_FLAGS is the same choice on a command line.
JIT_FOR_SMALL_RUNS = BACKEND != "tensorflow"
NO_JIT_FLAGS: tuple[str, ...] = () if JIT_FOR_SMALL_RUNS else ("--no-jit",)
ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"


def mnist_dir() -> Path | None:
    """The folder holding mnist.npz ($KBACKEND_DATA_DIR, else ../shared/data), or None."""
    for candidate in (os.environ.get("KBACKEND_DATA_DIR"), SHARED_DATA):
        if candidate and (Path(candidate) / "mnist.npz").is_file():
            return Path(candidate)
    return None


@pytest.fixture
def backend() -> str:
    """The backend this test process runs on."""
    return BACKEND


@pytest.fixture
def data_dir() -> Path:
    """The folder with the real MNIST files; skips the test when they are not there."""
    found = mnist_dir()
    if found is None:
        pytest.skip("real MNIST files not found: set KBACKEND_DATA_DIR or provide ../shared/data")
    return found


@dataclass(frozen=True)
class CliResult:
    """What one in-process run of the command line returned and printed."""

    returncode: int
    stdout: str
    stderr: str


def one_line_error(stderr: str) -> bool:
    """One ``kbackend: error:`` line and no traceback (TensorFlow may log other lines first)."""
    errors = [line for line in stderr.splitlines() if line.startswith("kbackend: error:")]
    return len(errors) == 1 and "Traceback" not in stderr


@pytest.fixture
def cli(capsys):
    """``cli(*args)`` runs ``kbackend.cli.main(args)`` in this process; returns a ``CliResult``."""
    from kbackend.cli import main

    def run(*args: str) -> CliResult:
        capsys.readouterr()  # only this command's output
        try:
            code = main([str(arg) for arg in args])
        except SystemExit as exit_:  # argparse errors and --help
            code = 0 if exit_.code is None else exit_.code if isinstance(exit_.code, int) else 1
        out, err = capsys.readouterr()
        return CliResult(code, out, err)

    return run


def run_cli(*args: str, backend: str | None = None, env: dict | None = None,
            timeout: float = 300,
            cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m kbackend ARGS`` in a subprocess with KERAS_BACKEND set."""
    full_env = {**os.environ, "KERAS_BACKEND": backend or BACKEND, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "kbackend", *args], capture_output=True, text=True,
        env=full_env, timeout=timeout, cwd=cwd or ROOT,
    )


@pytest.fixture
def cli_process():
    """``cli_process(*args, backend=None, env=None, timeout=300)`` runs the command line in a
    fresh Python process; only for tests where the fresh process is the point."""
    return run_cli


@pytest.fixture
def engines_never_run(monkeypatch):
    """Replace every engine's train function with one that fails the test if it is called
    (a pre-run check must refuse the input before any training starts)."""
    from dataclasses import replace

    from kbackend.engines import ENGINES

    def forbidden(*args, **kwargs):
        raise AssertionError("training started although a pre-run check should have failed")

    for name, engine in list(ENGINES.items()):
        monkeypatch.setitem(ENGINES, name, replace(engine, train=forbidden))
