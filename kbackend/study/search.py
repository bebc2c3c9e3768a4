"""A cell's learning-rate search (``RateSearch``): every rate of its grid with every seed (one
by one, or as a population), the grid extended while the best rate sits on an end, later rates
pruned to the best steps to target so far, and the winner's cut-short seeds re-run in full.
"""

from __future__ import annotations

import math
from dataclasses import replace

from kbackend.study.populations import Populations
from kbackend.study.runner_protocol import CellRunner, StudyEvent
from kbackend.study.store import StoredRun
from kbackend.study.study_record import Cell
from kbackend.study.summaries import RunPlan, best_rate, rate_score, summarize_cell


class RateSearch:
    """The learning-rate search of each cell of ``runner``'s study."""

    def __init__(self, runner: CellRunner, auto_max: int = 0, lr_scaling: str = "") -> None:
        # ``auto_max``: the search of an auto cell (the adaptive batch size from the cell's
        # batch size, its MIN, up to this MAX, its rate scaled by ``lr_scaling``), run by run
        self.runner, self.auto_max, self.lr_scaling = runner, auto_max, lr_scaling

    def plan(self, optimizer: str, batch_size: int, learning_rate: float,
             budget: int | None = None, seed: int | None = None) -> RunPlan:
        """The runner's plan, made an auto cell's run where this search is one."""
        plan = self.runner.plan(optimizer, batch_size, learning_rate, budget, seed)
        if not self.auto_max:
            return plan
        return replace(plan, auto_max=self.auto_max, lr_scaling=self.lr_scaling)

    def extension_factors(self, optimizer: str, grid: tuple[float, ...]) -> tuple[float, float]:
        """The ratio a grid is extended by below and above: the study's ``lr_factor`` for a
        generated grid, the ratio of the two outermost rates at that end for an explicit one."""
        config = self.runner.config
        if optimizer not in config.learning_rates or len(grid) < 2:
            return config.lr_factor, config.lr_factor
        ordered = sorted(grid)
        return ordered[1] / ordered[0], ordered[-1] / ordered[-2]

    def run_cell(self, optimizer: str, batch_size: int) -> tuple[Cell, list[StoredRun]]:
        """Every learning rate of one cell, each with every seed, the grid extended while the
        best rate sits on an end of it (``lr_extend`` points each way at most); the cell's
        figures with their intervals, and every run it made."""
        runner = self.runner
        config, larger_is_better = runner.config, runner.larger_is_better
        grid = config.learning_rate_grid(optimizer, batch_size)
        by_rate: dict[float, list[StoredRun]] = {}
        runs: list[StoredRun] = []
        populations = Populations(runner)
        path = ({"path": "sequential", "members": len(grid) * config.seeds,
                 "reason": "an adaptive batch size trains one run at a time"} if self.auto_max
                else populations.path(optimizer, batch_size, grid))
        if path["path"] == "population":
            runs += populations.run(optimizer, batch_size, grid, by_rate)
        else:
            for learning_rate in grid:
                runs += self.run_rate(optimizer, batch_size, learning_rate, by_rate)
        low_factor, high_factor = self.extension_factors(optimizer, grid)
        extended = {"below": 0, "above": 0}
        while len(grid) > 1:
            best, tried = best_rate(by_rate, larger_is_better), sorted(by_rate)
            if best == tried[0] and extended["below"] < config.lr_extend:
                extended["below"] += 1
                rate = float(f"{tried[0] / low_factor:.4g}")
            elif best == tried[-1] and extended["above"] < config.lr_extend:
                extended["above"] += 1
                rate = float(f"{tried[-1] * high_factor:.4g}")
            else:
                break
            runner.on_event(StudyEvent("extend", runs=config.seeds))
            runs += self.run_rate(optimizer, batch_size, rate, by_rate)
        winner = best_rate(by_rate, larger_is_better)
        runs += self.complete_censored(optimizer, batch_size, winner, by_rate)
        tried = sorted(by_rate)
        edge = None
        if len(tried) > 1 and winner in (tried[0], tried[-1]):
            edge = "below" if winner == tried[0] else "above"
        assert winner is not None  # a cell tries at least one rate
        searched = Cell(optimizer, batch_size, lr_grid=tuple(grid), lr_tried=tuple(tried),
                        lr_extended=extended, lr_at_grid_edge=edge is not None, lr_edge=edge,
                        lr_at_bound=edge is not None and extended[edge] >= config.lr_extend,
                        population=path)
        return summarize_cell(searched, by_rate[winner]), runs

    def run_rate(self, optimizer: str, batch_size: int, learning_rate: float,
                 by_rate: dict[float, list[StoredRun]]) -> list[StoredRun]:
        """One learning rate of a cell with every seed, into ``by_rate``; returns its runs.

        With pruning, the rate's budget is the best median steps-to-target so far: a run that
        does not reach the target within it counts as never reaching it, which can only make
        this rate's median worse than the best one's, never better. Once the rate ranks behind
        the best one however its remaining seeds end (``cannot_win``), they are skipped: with
        no rate reaching yet, that is when even a best-case last seed leaves its median
        validation metric below the best rate's.
        """
        runner = self.runner
        config = runner.config
        best = best_rate(by_rate, runner.larger_is_better)
        best_score = (rate_score(by_rate[best], runner.larger_is_better)
                      if best is not None else None)
        pruned = config.prune and best_score is not None and math.isfinite(best_score[0])
        budget = (min(runner.full_budget(batch_size), math.ceil(best_score[0]))
                  if pruned and best_score is not None else None)
        records: list[StoredRun] = []
        for index, seed in enumerate(config.seed_values):
            if config.prune and best_score is not None and cannot_win(
                    records, config.seeds - index, best_score, runner.larger_is_better):
                runner.on_event(StudyEvent("pruned", runs=1))
                continue
            plan = self.plan(optimizer, batch_size, learning_rate, budget, seed)
            records.append(runner.run_one(plan))
        by_rate[learning_rate] = records
        return list(records)

    def complete_censored(self, optimizer: str, batch_size: int, rate: float | None,
                          by_rate: dict[float, list[StoredRun]]) -> list[StoredRun]:
        """Re-run, on the full budget, the seeds of the winning rate that a pruned budget cut
        short: the median is exact without them, the upper end of the interval is not."""
        if rate is None:
            return []
        runner = self.runner
        full = self.plan(optimizer, batch_size, rate).max_steps
        runs = []
        for index, record in enumerate(by_rate[rate]):
            if not record.result["reached"] and record.config["max_steps"] < full:
                runner.on_event(StudyEvent("extend", runs=1))
                plan = self.plan(optimizer, batch_size, rate, seed=record.seed)
                record = runner.run_one(plan)
                by_rate[rate][index] = record
                runs.append(record)
        return runs


def cannot_win(records: list[StoredRun], remaining: int,
               best_score: tuple[float, float, float, float], larger_is_better: bool) -> bool:
    """Whether a learning rate with ``records`` so far ranks behind ``best_score``
    (``rate_score``) however its ``remaining`` seeds end: each scored at its best case (the
    target reached at step 0, instantly, with the best possible metric), every part of the
    score is as low as it can get, so a best case still behind is behind for certain."""
    best_case = StoredRun("best case", "run", "", "", {}, {
        "steps_to_target": 0, "reached": True, "time_to_target": 0.0,
        "best_metric": BEST_CASE_METRIC if larger_is_better else -BEST_CASE_METRIC})
    return rate_score([*records, *[best_case] * remaining], larger_is_better) > best_score


# A finite stand-in for "the best metric a seed could reach" (``rate_score`` ignores infinities)
BEST_CASE_METRIC = 1e300
