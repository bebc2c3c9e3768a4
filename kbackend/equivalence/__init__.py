"""Cross-backend equivalence: run one model under JAX and under TensorFlow and compare.

Keras cannot switch backends inside a process, so each backend runs in its own long-lived worker
(``pool.WorkerPool``); ``compare.compare_model`` feeds both the same model, weights and data and
reports the differences against ``tolerances.TOLERANCES``. ``strategies`` (hypothesis, a test
dependency) draws random models from ``grammar``. See docs/equivalence.md.
"""

from kbackend.equivalence.compare import (
    DEFAULT_OPTIMIZERS,
    DEFAULT_STEPS,
    Case,
    CaseError,
    Report,
    Row,
    compare_model,
    difference,
)
from kbackend.equivalence.pool import (
    EquivalenceError,
    WorkerCrashed,
    WorkerFailed,
    WorkerPool,
    WorkerTimeout,
)
from kbackend.equivalence.tolerances import KNOWN_DIVERGENCES, TOLERANCES

__all__ = ["DEFAULT_OPTIMIZERS", "DEFAULT_STEPS", "KNOWN_DIVERGENCES", "TOLERANCES", "Case",
           "CaseError", "EquivalenceError", "Report", "Row", "WorkerCrashed", "WorkerFailed",
           "WorkerPool", "WorkerTimeout", "compare_model", "difference"]
