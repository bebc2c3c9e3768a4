"""The batch-size x optimizer study: which batch size and optimizer reach a validation target
fastest on this hardware and backend.

- ``config``: the grid, learning-rate search, target and budgets (``StudyConfig``).
- ``executor``: ``StudyRunner`` runs the grid, resumable via ``store``, composing ``search``
  (a cell's learning-rate search over seeds), ``populations`` (vmapped grids), ``step_times``
  (the time model) and ``noise_runs`` (the noise scale along training) through
  ``runner_protocol``; ``summaries``: run and cell figures; ``timing``: where the time went.
- ``store``: SQLite results store keyed by each run's full configuration.
- ``noise``: the gradient noise scale B_simple (McCandlish et al. 2018).
- ``analysis``: medians with order-statistic intervals; scaling regions, knees, the fastest
  cell, crossovers; the four questions' verdicts read with ``verdicts``.
- ``verdicts``: three-way verdicts (A better, B better, equivalent within a margin, not
  resolved) from paired-seed intervals, with their levels over the sequential looks.
- ``sequential``: seeds added round by round where a verdict could still resolve.
- ``frontier``: the best validation value each cell reaches on an equal budget, and the test
  metric of that checkpoint.
- ``report``: terminal table, markdown report and summary; ``plots``: the PNG plots.
"""

import importlib
import sys
import types
from typing import Any

from kbackend.study.config import StudyConfig

__all__ = ["StudyConfig"]


class _CallableStudy(types.ModuleType):
    """This package, callable: ``kbackend.study(model, x, y, ...)`` is ``kbackend.api.study``.

    The package and the function share a name (the issue's API is ``kbackend.study(...)``), and
    Python binds an imported subpackage to its parent's attribute, so the package itself answers
    the call; ``kbackend.study.StudyConfig`` and its submodules stay as they are.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return importlib.import_module("kbackend.api").study(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableStudy
