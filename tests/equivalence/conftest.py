"""Fixtures of the cross-backend equivalence suite (run by ``nox -s equivalence``).

One ``WorkerPool`` (a JAX and a TensorFlow worker process) serves the whole session, so the
start-up cost of both frameworks is paid once. Hypothesis profiles: ``ci`` (few examples,
derandomized, so CI time is stable) and ``thorough`` (many more, for local runs); choose with
HYPOTHESIS_PROFILE (default ``ci``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from kbackend.equivalence import TOLERANCES, Report, WorkerPool

ROOT = Path(__file__).resolve().parents[2]
REPRO_DIR = ROOT / ".hypothesis" / "equivalence"

_COMMON = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow,
                                                       HealthCheck.function_scoped_fixture]}
settings.register_profile("ci", max_examples=3, derandomize=True, print_blob=True, **_COMMON)
# KBACKEND_EQUIV_EXAMPLES sets the number of examples of the thorough profile (default 200).
settings.register_profile("thorough",
                          max_examples=int(os.environ.get("KBACKEND_EQUIV_EXAMPLES", "200")),
                          **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def pool():
    """The session's workers, one per backend (both started in parallel)."""
    with WorkerPool(timeout=float(os.environ.get("KBACKEND_EQUIV_TIMEOUT", "300"))) as workers:
        workers.start()
        yield workers


def write_reproducer(pool: WorkerPool, case, weights, x, y) -> str:
    """Save a failing case (model with its weights, inputs, targets) and return a command that
    re-runs the comparison with ``kbackend equiv``."""
    digest = hashlib.sha1(case.to_json().encode()).hexdigest()[:10]
    folder = REPRO_DIR / digest
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "case.json").write_text(case.to_json() + "\n")
    model_path = folder / "model.keras"
    pool.call(pool.backends[0], "evaluate", source=case.source, weights=weights, x=x, y=None,
              loss=None, optimizers=[], save_path=str(model_path))
    np.savez(folder / "x.npz", *x)
    np.savez(folder / "y.npz", *y)
    loss = case.loss.removesuffix("_from_logits")
    logits = " --from-logits" if case.loss.endswith("_from_logits") else ""
    return (f"python -m kbackend equiv {model_path} --inputs {folder / 'x.npz'} "
            f"--targets {folder / 'y.npz'} --loss {loss}{logits}")


# quantity -> (max relative difference, its absolute difference, row name) over the session,
# among rows that passed by the relative criterion (rows passing by atol only are round-off
# around zero: their relative difference says nothing)
LARGEST: dict[str, tuple[float, float, str]] = {}
KNOWN_SEEN: dict[str, int] = {}


def record(report: Report) -> None:
    """Remember the largest passing differences per quantity (printed at the end of the run)."""
    for row in report.rows:
        rtol = TOLERANCES[row.quantity].rtol
        if (row.passed and row.max_rel <= rtol
                and row.max_rel > LARGEST.get(row.quantity, (-1.0,))[0]):
            LARGEST[row.quantity] = (row.max_rel, row.max_abs, row.name)
    for name in report.known_divergences():
        KNOWN_SEEN[name] = KNOWN_SEEN.get(name, 0) + 1


def pytest_terminal_summary(terminalreporter) -> None:
    if not LARGEST:
        return
    write = terminalreporter.write_line
    write("largest passing cross-backend differences per quantity (relative to tensor scale):")
    for quantity, (rel, abs_, name) in sorted(LARGEST.items()):
        write(f"  {quantity:<9} rel {rel:.3g}  abs {abs_:.3g}  ({name})")
    for name, count in sorted(KNOWN_SEEN.items()):
        write(f"  known divergence {name} explained failures in {count} example(s)")


def assert_no_unexplained_failures(report: Report, pool: WorkerPool, case, weights, x, y) -> None:
    """Fail with the differing rows, the model config and a reproducing command."""
    record(report)
    if not report.unexplained:
        return
    command = write_reproducer(pool, case, weights, x, y)
    raise AssertionError(
        f"{report.summary()}\n{report.table(only_failures=True)}\n"
        f"model case: {case.to_json()}\nreproduce: {command}")


@pytest.fixture(scope="session")
def channels_first_everywhere(pool) -> None:
    """Skip unless channels_first convolution and pooling run on every backend of the pool."""
    for backend in pool.backends:
        error = pool.call(backend, "ping", probe=True)["channels_first_error"]
        if error is not None:
            pytest.skip(f"channels_first does not run on {backend} here "
                        f"(known divergence tf-cpu-channels-first): {error}")
