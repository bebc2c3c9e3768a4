"""Test sessions. Dependencies come from pyproject.toml (the project and its dependency groups).

    nox                      # default: tests and slow for both backends, devices, equivalence, ray, lint
    nox -s "tests(jax)"      # one backend
    nox -s "devices(jax)"    # the multi-device tests, with 8 virtual CPU devices
    nox -s bench             # quick versions of the benchmark scripts
    nox -s ray               # the study on a local Ray instance (the `ray` extra)
"""

from __future__ import annotations

import os
import shutil

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["tests", "devices", "equivalence", "slow", "ray", "lint"]

BACKENDS = ["jax", "tensorflow"]
PYPROJECT = nox.project.load_toml("pyproject.toml")
VIRTUAL_DEVICES = "8"
# One pytest-xdist worker per core. Whole files go to one worker, so a module fixture is built
# once (`--dist loadgroup` would be finer, but pytest 9.2 silently breaks its grouping:
# pytest-xdist issue 1386). The slow tests share no module fixture worth keeping together.
# The slowest tests are listed at the end of every session, so CI logs show where the time goes.
PARALLEL = ("-n", "auto", "--dist", "loadfile", "--durations=15")
PARALLEL_SLOW = ("-n", "auto", "--dist", "load", "--durations=15")
# The devices tests are one file with no module fixture: by file, one worker ran all of them
# while the other idled (devices(tensorflow): 5 min for 11 tests).
PARALLEL_DEVICES = PARALLEL_SLOW
SHARED_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "shared", "data")


def _env(session: nox.Session, backend: str) -> dict[str, str]:
    # The persistent compilation cache stays on, in a folder of the session's own that each run
    # starts empty: the many identical programs the tests compile (one model, many runs, worker
    # processes) are compiled once per run, and no run depends on what an earlier one left
    # (JAX: the JAX sessions took 743 s without it, 475 s with it; TensorFlow has no such cache).
    cache = os.path.join(session.virtualenv.location, "kbackend-cache")
    shutil.rmtree(cache, ignore_errors=True)
    # Bytecode is written even where the machine sets PYTHONDONTWRITEBYTECODE (this one and CI
    # do, and uv installs no .pyc files): otherwise every Python process the tests start (xdist
    # workers, CLI runs, benchmark and equivalence workers, launched jobs) compiled JAX, Keras
    # and TensorFlow from source again (`kbackend info`: 5.4 s of CPU without bytecode, 2.6 s
    # with it). The first import writes it.
    env = {"KERAS_BACKEND": backend, "KBACKEND_OFFLINE": "1", "PYTHONHASHSEED": "0",
           "KBACKEND_COMPILE_CACHE": "1", "KBACKEND_CACHE_DIR": cache,
           "PYTHONDONTWRITEBYTECODE": ""}
    if "KBACKEND_DATA_DIR" not in os.environ and os.path.isdir(SHARED_DATA):
        env["KBACKEND_DATA_DIR"] = os.path.normpath(SHARED_DATA)
    return env


def _install(session: nox.Session, *groups: str) -> None:
    session.install("-e", ".")
    for group in groups:
        session.install(*nox.project.dependency_groups(PYPROJECT, group))


@nox.session
@nox.parametrize("backend", BACKENDS, ids=BACKENDS)
def tests(session: nox.Session, backend: str) -> None:
    """Unit and integration tests under one backend (slow, devices and equivalence tests excluded)."""
    _install(session, "test")
    session.run("pytest", *PARALLEL, "-m", "not slow and not equivalence and not devices and not ray",
                *session.posargs,
                env=_env(session, backend))


@nox.session
@nox.parametrize("backend", BACKENDS, ids=BACKENDS)
def devices(session: nox.Session, backend: str) -> None:
    """Tests marked `devices` under one backend, in a process started with 8 virtual CPU devices.

    CPU devices must be split before the framework starts its runtime, hence a session of its
    own. kbackend's own KBACKEND_VIRTUAL_DEVICES makes them when it loads a backend (JAX:
    jax_num_cpu_devices, TensorFlow: logical CPU devices), so the session also tests that variable.
    """
    _install(session, "test")
    env = _env(session, backend) | {"KBACKEND_VIRTUAL_DEVICES": VIRTUAL_DEVICES}
    session.run("pytest", *PARALLEL_DEVICES, "-m", "devices and not ray", *session.posargs, env=env)


@nox.session
def equivalence(session: nox.Session) -> None:
    """Cross-backend property suite (hypothesis profile `ci` unless HYPOTHESIS_PROFILE is set)."""
    _install(session, "test")
    env = _env(session, "jax") | {"HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "ci")}
    session.run("pytest", *PARALLEL, "-m", "equivalence and not ray", *session.posargs, env=env)


@nox.session
@nox.parametrize("backend", BACKENDS, ids=BACKENDS)
def slow(session: nox.Session, backend: str) -> None:
    """Long-running tests (real-data accuracy, end-to-end studies) under one backend."""
    _install(session, "test")
    session.run("pytest", *PARALLEL_SLOW, "-m", "slow and not equivalence and not devices and not ray",
                *session.posargs,
                env=_env(session, backend))


@nox.session
def ray(session: nox.Session) -> None:
    """The study on a local Ray instance (tests marked `ray`; the `ray` extra installed here only).

    The other sessions stay Ray-free (they deselect `ray`), so a default install is what they
    test. JAX only: the Ray executor is backend-neutral (it ships a cell's options to a worker and
    its stored records back; the worker trains with the same StudyRunner as the local executor),
    and the backends' own training is tested by the `tests` sessions; one backend keeps the
    session short. One pytest process, no xdist: the tests share one local Ray instance (a module
    fixture) and its worker processes, which Ray spreads over the cores itself.
    """
    session.install("-e", ".[ray]")
    session.install(*nox.project.dependency_groups(PYPROJECT, "test"))
    session.run("pytest", "-m", "ray", "--durations=15", *session.posargs,
                env=_env(session, "jax"))


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the package, tests, scripts and this file."""
    session.install(*nox.project.dependency_groups(PYPROJECT, "lint"))
    session.run("ruff", "check", "kbackend", "tests", "scripts", "noxfile.py")


@nox.session
def bench(session: nox.Session) -> None:
    """Quick versions of every benchmark in scripts/ (both backends, side by side)."""
    _install(session, "test")
    out = os.path.join(session.create_tmp(), "bench")
    for script in sorted(os.listdir("scripts")):
        if script.startswith("bench_") and script.endswith(".py"):
            # Cache off: the benchmarks report compile_s, a compilation, not a cache read.
            session.run("python", f"scripts/{script}", "--quick", "--out", out,
                        env=_env(session, "jax") | {"KBACKEND_COMPILE_CACHE": "0"})
