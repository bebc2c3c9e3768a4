"""When to trust the recommendation: what the validation split can resolve (docs/study.md).

An accuracy measured on ``n`` validation samples moves in steps of ``1/n`` and, near a target
``p``, has a binomial standard error ``sqrt(p (1 - p) / n)``. When that error is large, one
evaluation can cross the target by luck and a cell's "steps to target" says more about the draw
than the cell (a 40-image split at a 0.9 target: steps of 0.025, a standard error of 0.047).

- ``before_training``: from the split's size alone, before any run: a warning when the standard
  error at the target exceeds ``MAX_STANDARD_ERROR`` or the granularity exceeds
  ``MAX_GRANULARITY``, with the sample count that would resolve it.
- ``after_training``: a warning when the best cells' plateau (the best validation value their
  frontier runs reach on an equal budget, median over seeds) lies within two standard errors of
  the target: those runs reach it by a margin the split cannot tell from noise. Without
  frontier runs on those cells (``--frontier-epochs 0``) the plateau is not measured, and a
  one-line note says it was not checked (silence would read as "checked, fine").
- ``MIN_VALIDATION_SAMPLES``: below it a study is refused (a one-line error before any run).

Error metrics of regression (``val_mae``, losses) have no binomial error; they are not checked.
"""

from __future__ import annotations

import math

from kbackend.study.study_record import StudyRecord

MAX_STANDARD_ERROR = 0.02
MAX_GRANULARITY = 0.01
MIN_VALIDATION_SAMPLES = 10
PLATEAU_STANDARD_ERRORS = 2.0


def _is_proportion(metric: str) -> bool:
    return metric.endswith("accuracy")


def standard_error(target: float, samples: int) -> float:
    """The binomial standard error of an accuracy ``target`` measured on ``samples``."""
    p = min(max(target, 0.0), 1.0)
    return math.sqrt(p * (1.0 - p) / samples) if samples > 0 else math.inf


def samples_to_resolve(target: float) -> int:
    """The fewest validation samples whose standard error at ``target`` is at most
    ``MAX_STANDARD_ERROR`` and whose granularity is at most ``MAX_GRANULARITY``."""
    p = min(max(target, 0.0), 1.0)
    return max(math.ceil(p * (1.0 - p) / MAX_STANDARD_ERROR ** 2),
               math.ceil(1.0 / MAX_GRANULARITY))


def before_training(metric: str, target: float, samples: int) -> str | None:
    """A one-line warning when ``samples`` validation samples cannot resolve ``metric`` at
    ``target``; None when they can (or the metric is not a proportion)."""
    if not _is_proportion(metric) or samples <= 0:
        return None
    error = standard_error(target, samples)
    if error <= MAX_STANDARD_ERROR and 1.0 / samples <= MAX_GRANULARITY:
        return None
    return (f"warning: the validation split has {samples} samples: {metric} moves in steps of "
            f"{1.0 / samples:.3g} and its standard error at the target {target:g} is "
            f"{error:.3g}, so one evaluation can cross the target by luck; about "
            f"{samples_to_resolve(target)} validation samples would resolve it to "
            f"{MAX_STANDARD_ERROR:g}.")


def after_training(study: StudyRecord, metric: str, target: float,
                   samples: int, cells: int = 3, no_frontier: str | None = None) -> str | None:
    """A one-line warning when the plateau of the ``cells`` fastest cells (the median best
    validation value of their frontier runs) lies within ``PLATEAU_STANDARD_ERRORS`` standard errors
    above the target; a one-line note when none of them has frontier runs to read it from
    (``no_frontier``: why the study ran none); None otherwise."""
    if not _is_proportion(metric) or samples <= 0:
        return None
    ranked = sorted((c for c in study.cells if c.reached
                     and c.time_to_target is not None),
                    key=lambda c: c.seconds)[:cells]
    # the frontier's: runs on an equal budget that do not stop at the target (the study's own
    # runs stop there, so their best value is the crossing, not the plateau)
    plateaus = [c.frontier.best_metric["median"] for c in ranked
                if c.frontier is not None and c.frontier.best_metric.get("median") is not None]
    if not ranked:
        return None
    if not plateaus:
        why = f" ({no_frontier})" if no_frontier else ""
        return (f"note: the plateau was not checked: it is read from frontier runs, and the "
                f"fastest cells have none{why}; a target near {metric}'s "
                "plateau is reached partly by luck, which the confirmation on held-out seeds "
                "shows.")
    error = standard_error(target, samples)
    plateau = max(plateaus)
    if plateau - target > PLATEAU_STANDARD_ERRORS * error:
        return None
    return (f"warning: the best cells plateau at {metric} {plateau:.4g}, within "
            f"{PLATEAU_STANDARD_ERRORS:g} standard errors ({error:.3g} each on {samples} "
            f"validation samples) of the target {target:g}: whether a run reaches it is partly "
            "luck; lower the target or validate on more samples.")
