"""Test sessions. Dependencies come from pyproject.toml (the project and its dependency groups).

    nox                      # default: the unit suite per backend (tests), lint
    nox -s extended          # the long suites per backend: slow, devices (and equivalence)
    nox -s "tests(jax)"      # the unit suite under one backend
    nox -s "unit(jax)"       # one suite under one backend: unit, slow, devices, or equivalence
    nox -s bench             # quick versions of the benchmark scripts
    nox -s ray               # the study on a local Ray instance (the `ray` extra)
"""

from __future__ import annotations

import os
import shutil

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_venv = "yes"
# The README's test command (`nox`): the unit suites and lint. The Ray study (2 minutes) runs in
# CI beside `extended`, which keeps the README's command under 15 minutes on 2 cores.
nox.options.sessions = ["tests", "lint"]

BACKENDS = ["jax", "tensorflow"]
PYPROJECT = nox.project.load_toml("pyproject.toml")
VIRTUAL_DEVICES = "8"
# One pytest-xdist worker per core. The unit and equivalence suites send whole files to one
# worker, so a module fixture is built once (`--dist loadgroup` would be finer, but pytest 9.2
# silently breaks its grouping: pytest-xdist issue 1386). The slow and devices suites share no
# module fixture worth keeping together, and by file one worker ran all of a file's tests while
# the other idled (devices(tensorflow): 5 min for 11 tests), so their tests spread one by one.
# The slowest tests are listed at the end of every suite, so CI logs show where the time goes.
BY_FILE = ("-n", "auto", "--dist", "loadfile", "--durations=15")
BY_TEST = ("-n", "auto", "--dist", "load", "--durations=15")
# suite: (marker expression, xdist options, extra environment, backends it runs under)
SUITES = {
    "unit": ("not slow and not equivalence and not devices and not ray", BY_FILE, {}, BACKENDS),
    "slow": ("slow and not equivalence and not devices and not ray", BY_TEST, {}, BACKENDS),
    # CPU devices must be split before the framework starts its runtime, hence a pytest process
    # of its own: kbackend's KBACKEND_VIRTUAL_DEVICES makes them when it loads a backend (JAX:
    # jax_num_cpu_devices, TensorFlow: logical CPU devices), so the suite also tests that variable.
    "devices": ("devices and not ray", BY_TEST, {"KBACKEND_VIRTUAL_DEVICES": VIRTUAL_DEVICES},
                BACKENDS),
    # The cross-backend property suite: a JAX driver with workers of both backends (hypothesis
    # profile `ci` unless HYPOTHESIS_PROFILE is set).
    "equivalence": ("equivalence and not ray", BY_FILE,
                    {"HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "ci")}, ["jax"]),
}
SHARED_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "shared", "data")


def _env(session: nox.Session, backend: str) -> dict[str, str]:
    # The persistent compilation cache stays on, in a folder of the session's own that each run
    # starts empty: the many identical programs the tests compile (one model, many runs, worker
    # processes) are compiled once per run, and no run depends on what an earlier one left
    # (JAX: the JAX sessions took 743 s without it, 475 s with it; TensorFlow's, per process and
    # published at exit, since 2026-12-03).
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
    """The package (editable, with its dependencies) and the dependency groups ``groups``, in one
    install: one resolution, and in a reused environment that already has them, a quick check."""
    requirements = [req for group in groups
                    for req in nox.project.dependency_groups(PYPROJECT, group)]
    session.install("-e", ".", *requirements)


def _suite(session: nox.Session, suite: str, backend: str, env: dict[str, str]) -> None:
    markers, parallel, extra, _ = SUITES[suite]
    session.log(f"suite {suite} ({backend})")
    session.run("pytest", *parallel, "-m", markers, *session.posargs, env=env | extra)


# The default `nox` (the README's test command) runs the unit suite of each backend; the long
# suites (whole multi-process jobs, benchmark smoke runs, 8 virtual devices, the cross-backend
# property suite) run in `extended`, which CI runs after it (.ci/run): nothing CI covers is lost,
# and the command a developer runs after each change stays short.
DEFAULT_SUITES = ("unit",)
EXTENDED_SUITES = ("slow", "devices", "equivalence")


def _suites(session: nox.Session, backend: str, names: tuple[str, ...]) -> None:
    """The suites ``names`` that run under ``backend``, one after another in one environment: one
    install and one compilation cache serve them all (a session per suite installed the same
    packages six times and compiled the same programs again in each)."""
    _install(session, "test")
    env = _env(session, backend)
    for suite in names:
        if backend in SUITES[suite][3]:
            _suite(session, suite, backend, env)


@nox.session
@nox.parametrize("backend", BACKENDS, ids=BACKENDS)
def tests(session: nox.Session, backend: str) -> None:
    """The unit suite under ``backend`` (part of the default `nox`)."""
    _suites(session, backend, DEFAULT_SUITES)


@nox.session
@nox.parametrize("backend", BACKENDS, ids=BACKENDS)
def extended(session: nox.Session, backend: str) -> None:
    """The long suites under ``backend``: slow, devices and (JAX) equivalence; CI runs them."""
    _suites(session, backend, EXTENDED_SUITES)


def _one_suite(suite: str, backends: list[str]):
    @nox.session(name=suite)
    @nox.parametrize("backend", backends, ids=backends)
    def run(session: nox.Session, backend: str) -> None:
        _install(session, "test")
        _suite(session, suite, backend, _env(session, backend))

    part = "tests" if suite in DEFAULT_SUITES else "extended"
    run.__doc__ = f"The {suite} suite alone, under one backend (part of `{part}`)."
    return run


unit, slow, devices, equivalence = (_one_suite(name, SUITES[name][3]) for name in SUITES)


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
    """ruff over the package, tests, scripts and this file; mypy over the package ([tool.mypy])."""
    # mypy checks kbackend's calls against the types its imports ship, so they are installed here,
    # not only the lint group: the package with its dependencies (NumPy, JAX, matplotlib), and the
    # test group for the typed packages kbackend imports beyond those (redis in the Redis
    # store). The session's environment is then the
    # development one that `mypy` runs clean in. The environment is reused, and uv links wheels
    # from its cache, so past the first run the install is a check of a few seconds.
    _install(session, "lint", "test")
    session.run("ruff", "check", "kbackend", "tests", "scripts", "noxfile.py")
    session.run("mypy", "kbackend")


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
