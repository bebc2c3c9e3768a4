"""The batch-size x optimizer study: which batch size and optimizer reach a validation target
fastest on this hardware and backend.

- ``config``: the grid, learning-rate search, target and budgets (``StudyConfig``).
- ``executor``: runs the grid, one learning-rate search per cell over seeds, the step-time
  model, resumable via ``store``.
- ``store``: SQLite results store keyed by each run's full configuration.
- ``noise``: the gradient noise scale B_simple (McCandlish et al. 2018).
- ``analysis``: medians with order-statistic intervals; scaling regions, knees, the fastest
  cell, crossovers, each a verdict only where the intervals separate.
- ``report``: terminal table, markdown report and PNG plots.
"""

from kbackend.study.config import StudyConfig

__all__ = ["StudyConfig"]
