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

from kbackend.equivalence import Report, WorkerPool

ROOT = Path(__file__).resolve().parents[2]
REPRO_DIR = ROOT / ".hypothesis" / "equivalence"

_COMMON = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow,
                                                       HealthCheck.function_scoped_fixture]}
settings.register_profile("ci", max_examples=6, derandomize=True, print_blob=True, **_COMMON)
settings.register_profile("thorough", max_examples=200, **_COMMON)
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


def assert_no_unexplained_failures(report: Report, pool: WorkerPool, case, weights, x, y) -> None:
    """Fail with the differing rows, the model config and a reproducing command."""
    if not report.unexplained:
        return
    command = write_reproducer(pool, case, weights, x, y)
    raise AssertionError(
        f"{report.summary()}\n{report.table(only_failures=True)}\n"
        f"model case: {case.to_json()}\nreproduce: {command}")
