"""When to trust the recommendation: what the validation split can resolve (docs/study.md).

An accuracy measured on ``n`` validation samples moves in steps of ``1/n`` and, near a target
``p``, has a binomial standard error ``sqrt(p (1 - p) / n)``. When that error is large, one
evaluation can cross the target by luck and a cell's "steps to target" says more about the draw
than the cell (a 40-image split at a 0.9 target: steps of 0.025, a standard error of 0.047).

- ``before_training``: from the split's size alone, before any run: a warning when the standard
  error at the target exceeds ``MAX_STANDARD_ERROR`` or the granularity exceeds
  ``MAX_GRANULARITY``, with the sample count that would resolve it.
- ``after_training``: a warning when the best cells' plateau (the best validation value their
  frontier runs reach on an equal budget, median over seeds) lies below the target or within
  two standard errors above it: those runs reach it by a margin the split cannot tell from
  noise. Without frontier runs on those cells that train past their crossing
  (``--frontier-epochs 0``, or a budget shorter than the steps to the target) the plateau is
  not measured, and a one-line note says it was not checked (silence would read as "checked,
  fine").
- ``MIN_VALIDATION_SAMPLES``: below it a study is refused (a one-line error before any run).

Error metrics of regression (``val_mae``, losses) have no binomial error; they are not checked.
"""

from __future__ import annotations

import math

from kbackend.study.study_record import Cell, StudyRecord

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
    validation value of their frontier runs) lies below the target or within
    ``PLATEAU_STANDARD_ERRORS`` standard errors above it; a one-line note when none of them has
    frontier runs that trained past its crossing to read it from (``no_frontier``: why the
    study ran none); None otherwise."""
    if not _is_proportion(metric) or samples <= 0:
        return None
    ranked = sorted((c for c in study.cells if c.reached
                     and c.time_to_target is not None),
                    key=lambda c: c.seconds)[:cells]
    if not ranked:
        return None
    # the frontier's: runs on an equal budget that do not stop at the target (the study's own
    # runs stop there, so their best value is the crossing, not the plateau)
    measured = [c for c in ranked
                if c.frontier is not None and c.frontier.best_metric.get("median") is not None]
    past = [c for c in measured if _past_crossing(c)]
    if not past:
        if measured:  # a frontier that ends before the crossing shows no plateau
            cell = measured[0]
            frontier = cell.frontier
            assert frontier is not None
            epochs = _epochs_past(cell)
            why = (f" (they end at step {frontier.steps}, {frontier.epochs} epochs, before "
                   f"{cell.optimizer} at batch {cell.batch_size} reaches the target at step "
                   f"{_crossing(cell):g}: --frontier-epochs "
                   + (f"{epochs} or more would pass it)" if epochs else "sets their length)"))
        else:
            why = f" ({no_frontier})" if no_frontier else ""
        return (f"note: the plateau was not checked: it is read from frontier runs, and the "
                f"fastest cells have none that train past the target{why}; a target near "
                f"{metric}'s plateau is reached partly by luck, which the confirmation on "
                "held-out seeds shows.")
    error = standard_error(target, samples)
    plateau = max(c.frontier.best_metric["median"] for c in past if c.frontier is not None)
    if plateau - target > PLATEAU_STANDARD_ERRORS * error:
        return None
    where = ("below the target" if plateau < target else
             f"within {PLATEAU_STANDARD_ERRORS:g} standard errors of the target")
    return (f"warning: the best cells plateau at {metric} {plateau:.4g}, {where} {target:g} "
            f"(a standard error of {error:.3g} on {samples} validation samples): whether a "
            "run reaches it is partly luck; lower the target or validate on more samples.")


def _crossing(cell: Cell) -> float:
    """The step by which every seed of ``cell`` that reached the target had reached it (its
    median steps where the seeds' are not kept)."""
    reached = [v for v in (cell.seed_steps or {}).values() if math.isfinite(v)]
    return max(reached) if reached else float(cell.steps_to_target or 0.0)


def _epochs_past(cell: Cell) -> int | None:
    """The frontier epochs that would take ``cell``'s frontier runs past its crossing (their
    steps per epoch: their steps over their epochs); None where they trained no step."""
    frontier = cell.frontier
    if frontier is None or not frontier.steps or not frontier.epochs:
        return None
    return math.ceil(_crossing(cell) / (frontier.steps / frontier.epochs))


def _past_crossing(cell: Cell) -> bool:
    """Whether ``cell``'s frontier runs trained at least as far as its slowest seed took to
    reach the target (a frontier stored before its steps were kept counts, as it did)."""
    frontier = cell.frontier
    return frontier is not None and (frontier.steps is None or frontier.steps >= _crossing(cell))
