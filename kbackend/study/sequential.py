"""Sequential seeds: after the first ``seeds``, more seeds of a cell's best learning rate only
where a verdict on the sources' questions is unresolved and could still resolve.

Round by round (``verdicts.seed_schedule``: 3, 5, 8, 12, 18, 20 seeds by default), the
comparisons the report answers (the optimizers at each batch size, each scaling step, the
smallest against the largest batch size's test metric) are read; a cell gets the next round's
seeds when one of its comparisons is unresolved and ``verdicts.could_resolve`` says the added
seeds could settle it.
The rounds stop when no comparison can move, at ``max_seeds``, or when ``seed_budget`` seconds
of added seeds are spent (checked before each run; by default half the recorded time of the
grid's runs, which keeps a study within about 1.5x of its time without them). The frontier runs
come after the rounds, outside the budget: seeds have its first claim. Which rule stops them
does not change the verdicts' error: each look has its share of the error in the level of its
intervals (``verdicts.LookLevels``).

Added seeds are ordinary runs (full budget, the cell's best rate): stored under their own keys,
so a re-run reuses them. The frontier runs (``frontier``) follow the seeds each cell has.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kbackend.study.cell_verdicts import (
    generalization_verdict,
    optimizer_comparison,
    region_verdicts,
    verdict_settings,
)
from kbackend.study.config import AUTO_SEED_BUDGET_SHARE
from kbackend.study.frontier import measure_frontier, why_no_frontier
from kbackend.study.runner_protocol import CellRunner, StudyEvent
from kbackend.study.scaling import COMPARED, by_optimizer
from kbackend.study.store import StoredRun
from kbackend.study.study_record import AddedSeeds, Cell, SeedRound, StepTimes, StudyRecord
from kbackend.study.summaries import summarize_cell
from kbackend.study.verdicts import Verdict, VerdictSettings, could_resolve, seed_schedule


def open_comparisons(cells: list[Cell], step_times: StepTimes | None,
                     settings: VerdictSettings) -> list[Verdict]:
    """The verdicts of the comparisons the report answers (their ``cells`` are the
    (optimizer, batch size) pairs each reads)."""
    found = []
    for challenger, incumbent in COMPARED:
        comparison = optimizer_comparison(cells, challenger, incumbent, settings, step_times)
        found += [entry.verdict for entry in comparison.per_batch] if comparison else []
    for group in by_optimizer(cells).values():
        found += [segment.verdict for segment in region_verdicts(group, settings)]
        general = generalization_verdict(group, settings).verdict
        if general is not None:
            found.append(general)
    return found


def cells_to_extend(cells: list[Cell], step_times: StepTimes | None,
                    settings: VerdictSettings) -> set[tuple[str, int | str]]:
    """The cells of every comparison that is unresolved and could still resolve."""
    wanted: set[tuple[str, int | str]] = set()
    for verdict in open_comparisons(cells, step_times, settings):
        if could_resolve(verdict, settings.max_seeds, settings.level):
            wanted.update(verdict.cells)
    return wanted


def generalization_cells(cells: list[Cell]) -> set[tuple[str, int]]:
    """The cells the generalization verdicts compare (each optimizer's smallest and largest
    batch size): the only ones whose added seeds get frontier runs too."""
    return {(o, c.size) for o, group in by_optimizer(cells).items() for c in (group[0], group[-1])}


def seed_budget_seconds(config: Any, runs: list[StoredRun]) -> float:
    """The seconds added seeds and frontier runs may take (0: no limit): ``seed_budget``, or
    by default ``AUTO_SEED_BUDGET_SHARE`` of the recorded time of the grid's runs before them
    (every rate, seed and extension). Recorded times, not this process's clock: a resumed study
    reads the same and decides alike."""
    if config.seed_budget is not None:
        return float(config.seed_budget)
    return AUTO_SEED_BUDGET_SHARE * sum(r.result.get("wall_time") or 0.0 for r in runs)


def _stored(runner: CellRunner, key: str) -> StoredRun:
    """The stored run under ``key``: a cell's own runs, all in the store once it is summarized."""
    record = runner.stored_record(key)
    if record is None:
        raise LookupError(f"Run {key} of a summarized cell is missing from the study's store.")
    return record


class _SeedRounds:
    """The added seeds' runs of ``extend_seeds``: each cell's records, the runs trained, and the
    recorded seconds spent against the seed budget."""

    def __init__(self, runner: CellRunner, cells: list[Cell],
                 runs: list[StoredRun], budget: float) -> None:
        self.runner, self.runs, self.budget = runner, runs, budget
        self.records = {c.key: [_stored(runner, k) for k in c.run_keys] for c in cells}
        self.spent = 0.0  # recorded seconds of the added seeds, stored or trained now
        self.out_of_budget = False

    def add(self, cell: Cell, count: int) -> tuple[Cell, list[tuple[str, int | str, int]]]:
        """Train ``cell``'s missing seeds up to ``count`` (until the budget is spent); the cell
        with its figures over all its seeds, and [optimizer, batch size, seed] of each run
        added."""
        runner, key = self.runner, cell.key
        have = {int(r.config["seed"]) for r in self.records[key]}
        added = []
        for seed in (runner.config.seed + i for i in range(count)):
            if seed in have:
                continue
            if self.budget and self.spent >= self.budget:
                self.out_of_budget = True
                break
            runner.on_event(StudyEvent("extend", runs=1))
            record = runner.run_one(runner.plan(cell.optimizer, int(cell.batch_size),
                                                cell.learning_rate, seed=seed))
            self.spent += record.result.get("wall_time") or 0.0
            self.records[key].append(record)
            self.runs.append(record)  # the study's runs
            runner.time_spent.added_seed_runs += 1
            added.append((cell.optimizer, cell.batch_size, seed))
        self.records[key].sort(key=lambda r: r.config["seed"])
        return summarize_cell(cell, self.records[key]), added


def extend_seeds(runner: CellRunner, cells: list[Cell], runs: list[StoredRun],
                 step_times: StepTimes | None) -> AddedSeeds:
    """Add the frontier runs and seed rounds to ``cells`` (each cell replaced in the list by
    its figures over its seeds and its frontier); new runs are appended to ``runs``. Returns
    what was added: the schedule, each round's cells and seeds, the recorded seconds spent
    against the budget and why the rounds stopped."""
    config = runner.config
    settings = verdict_settings(StudyRecord(config=config.to_dict()))
    schedule = seed_schedule(config.seeds, settings.max_seeds)
    frontier = why_no_frontier(config) is None
    budget = seed_budget_seconds(config, runs) if len(schedule) > 1 or frontier else 0.0
    elapsed = runner.time_spent.clock()
    seeds = _SeedRounds(runner, cells, runs, budget)
    rounds: list[SeedRound] = []
    stopped = "max_seeds reached" if len(schedule) == 1 else "no open verdict could still resolve"
    for count in schedule[1:]:
        wanted = cells_to_extend(cells, step_times, settings)
        if not wanted:
            break
        added = []
        for index, cell in enumerate(cells):
            if cell.key in wanted and not seeds.out_of_budget:
                cells[index], cell_added = seeds.add(cell, count)
                added += cell_added
        rounds.append(SeedRound(count, tuple(sorted(wanted)), tuple(added)))
        if seeds.out_of_budget:
            stopped = f"seed budget spent ({seeds.spent:.1f} of {budget:.1f} s)"
            break
    else:
        if len(schedule) > 1:
            stopped = "max_seeds reached"
    frontier_seconds = _frontiers(runner, cells) if frontier else 0.0
    seconds = elapsed()
    runner.time_spent.added_seeds += seconds
    return AddedSeeds(tuple(schedule), settings.max_seeds, tuple(rounds), seconds, seeds.spent,
                      frontier_seconds, budget or None, stopped,
                      config.frontier_epochs if frontier else 0)


def _frontiers(runner: CellRunner, cells: list[Cell]) -> float:
    """The frontier after the seeds (the seeds have the budget's first claim): every cell on
    its first seeds, the generalization verdicts' cells on all they have (each cell replaced
    in the list by one with its ``frontier``); the seconds spent."""
    general = generalization_cells(cells)
    seconds = 0.0
    for index, cell in enumerate(cells):
        seeds = [int(s) for s in cell.seed_values]
        frontier, spent = measure_frontier(
            runner, cell, seeds if cell.key in general else seeds[:runner.config.seeds])
        cells[index] = replace(cell, frontier=frontier)
        seconds += spent
    return seconds
