"""Populations: a cell's initial grid (every learning rate x every seed) trained as one vmapped
program where that is faster (``Populations``): the choice of path (a measured probe, kept per
machine), the population's run with each member stored as the run it equals, and the pruner
that stops members whose rate can no longer win.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from kbackend.engine_facts import engine_facts
from kbackend.hardware.measure import POPULATION, remembered
from kbackend.history import History
from kbackend.study.runner_protocol import CellRunner, StudyEvent
from kbackend.study.store import StoredRun, config_key
from kbackend.study.summaries import RunPlan, median_or_inf, run_steps, trajectory_record

PROBE_STEPS = 8  # steps per timed round of the population probe (at least one call)
# The per-step speedup a population must show to be chosen. Members run in lockstep until the
# slowest stops and are pruned later than one by one: in the default study on a 2-core CPU the
# population path's steady training equalled the sequential path's at probe speedups of
# 1.1-1.4x (lockstep efficiency 0.86), and its extra compilations made the study slower
# (docs/study.md). Vmapped small models on a GPU are reported 10-100x faster.
POPULATION_MIN_SPEEDUP = 1.5
CPU_REASON = ("a CPU: vmapped members measured 0.8-1.4x per step on this project's CPUs "
              "(scripts/bench_population.py), below the 1.5x a population needs; not probed "
              "(--population on forces it)")


class Populations:
    """The population path of ``runner``'s study, cell by cell."""

    def __init__(self, runner: CellRunner) -> None:
        self.runner = runner

    def path(self, optimizer: str, batch_size: int,
             grid: tuple[float, ...]) -> dict[str, Any]:
        """How a cell's initial grid (every rate x every seed) is trained: ``{"path":
        "population" | "sequential", ...}`` with the reason or the probe's figures.

        ``population="auto"`` on an accelerator measures (``Runs.probe_population``: both
        paths compiled, then timed in interleaved rounds) and keeps the population when it is
        ``POPULATION_MIN_SPEEDUP`` faster; on a CPU it runs one by one without probing
        (``CPU_REASON``); the probe is stored in the study (a resumed study takes the same path)
        and in the kbackend cache folder (another study of the same cell on this machine and
        software reuses it). Grid extensions and pruning stay sequential.
        """
        runner = self.runner
        config, members = runner.config, len(grid) * runner.config.seeds
        if config.population == "off":
            return {"path": "sequential", "members": members, "reason": "--population off"}
        if not engine_facts(config.engine).compiled_cells:
            return {"path": "sequential", "members": members,
                    "reason": f"the {config.engine} engine trains one run at a time"}
        if members < 2:
            return {"path": "sequential", "members": members, "reason": "one run per cell"}
        if config.population == "on":
            return {"path": "population", "members": members, "reason": "--population on"}
        if runner.platform() == "cpu":
            return {"path": "sequential", "members": members, "reason": CPU_REASON}
        plans = self.plans(optimizer, batch_size, grid)
        configs = [runner.train_config(p) for p in plans]
        values = [runner.initial_values(p.seed) for p in plans]
        fused = configs[0].fused_steps
        steps = fused * -(-PROBE_STEPS // fused)  # whole calls
        options = {"optimizer": optimizer, "min_speedup": POPULATION_MIN_SPEEDUP,
                   "batch_size": batch_size, "fused_steps": fused, "members": members,
                   "steps": steps}
        key_config = {"kind": "population_probe", **runner.content_identity(), **options,
                      **runner.env}

        def measure() -> dict[str, Any]:  # once per machine (and software) for this cell
            runs = runner.native_runs()
            return remembered(POPULATION, runs.model, runs.dataset, options,
                              lambda: runs.probe_population(configs, values, steps,
                                                            min_speedup=POPULATION_MIN_SPEEDUP))

        return runner.stored_or_measured("population_probe", "probe", key_config, plans[0],
                                         measure)

    def plans(self, optimizer: str, batch_size: int,
              grid: tuple[float, ...]) -> list[RunPlan]:
        """Every rate x every seed of a cell's grid, on the full budget (members run in
        lockstep, so a pruned budget would save nothing)."""
        runner = self.runner
        return [runner.plan(optimizer, batch_size, rate, seed=seed)
                for rate in grid for seed in runner.config.seed_values]

    def run(self, optimizer: str, batch_size: int, grid: tuple[float, ...],
            by_rate: dict[float, list[StoredRun]]) -> list[StoredRun]:
        """The cell's grid x seeds as one population (the runs not yet stored), into
        ``by_rate``; returns the runs. Each member is stored as the run it equals."""
        runner = self.runner
        plans = self.plans(optimizer, batch_size, grid)
        records: dict[int, StoredRun] = {}
        missing = []
        censored = self.censored_runs()
        for index, plan in enumerate(plans):
            stored = runner.stored_run(plan)
            if stored is None and self.budgetless_key(plan) in censored:
                budget = censored[self.budgetless_key(plan)].config["max_steps"]
                stored = runner.stored_run(runner.plan(
                    optimizer, batch_size, plan.learning_rate, budget, plan.seed))
            if stored is not None:
                records[index] = stored
            else:
                missing.append(index)
        if len(missing) == 1:
            records[missing[0]] = runner.run_one(plans[missing[0]])
        elif missing:
            runner.on_event(StudyEvent("start", "population", plan=plans[missing[0]],
                                       runs=len(missing)))
            configs = [runner.train_config(plans[i]) for i in missing]
            values = [runner.initial_values(plans[i].seed) for i in missing]
            censor = self.pruner(plans, missing, records) if runner.config.prune else None
            elapsed = runner.time_spent.clock()
            histories = runner.native_runs().train_population(configs, values, censor)
            runner.time_spent.add(histories, elapsed())
            for index, history in zip(missing, histories, strict=True):
                plan = plans[index]
                censored_at = history.record.censored_at
                if censored_at is not None:  # the run a pruned budget would have made
                    plan = runner.plan(optimizer, batch_size, plan.learning_rate,
                                       censored_at, plan.seed)
                records[index] = runner.store_run(plan, history)
        ordered = [records[i] for i in range(len(plans))]
        for rate in grid:
            by_rate[rate] = [r for r, p in zip(ordered, plans, strict=True)
                             if p.learning_rate == rate]
        return ordered

    def pruner(self, plans: list[RunPlan], missing: list[int],
               stored: dict[int, StoredRun]) -> Callable[..., list[int]]:
        """The sequential path's pruning for a population: once some rate's median steps to
        target S is known, a member of another rate is stopped as soon as even reaching at the
        next evaluation could not bring its rate's median to S or below. The best rate's seeds
        run on (its interval needs them). ``plans`` are the cell's runs; the population trains
        ``plans[i] for i in missing`` (member m is ``missing[m]``); ``stored`` holds the others."""
        member_of = {index: m for m, index in enumerate(missing)}

        def censor(step: int, histories: list[History], active: set[int]) -> list[int]:
            steps: dict[float, list[float]] = {}
            hopeful: dict[float, list[float]] = {}
            for index, plan in enumerate(plans):
                if index in stored:
                    value = best_case = run_steps(stored[index])
                else:
                    m = member_of[index]
                    reached = histories[m].record.target_reached
                    value = float(reached["step"]) if reached else math.inf
                    best_case = float(step + plan.eval_every) if m in active else value
                steps.setdefault(plan.learning_rate, []).append(value)
                hopeful.setdefault(plan.learning_rate, []).append(best_case)
            best = min(median_or_inf(v) for v in steps.values())
            if not math.isfinite(best):
                return []
            return [m for m in active
                    if median_or_inf(hopeful[plans[missing[m]].learning_rate]) > best]

        return censor

    def budgetless_key(self, plan: RunPlan) -> str:
        """A run's key without its step budget: what a censored member is found by."""
        key_config = self.runner.run_key_config(plan)
        return config_key({k: v for k, v in key_config.items() if k != "max_steps"})

    def censored_runs(self) -> dict[str, StoredRun]:
        """This study's stored population members that its pruner stopped, by budgetless key
        (a resumed population finds them under the budget they stopped at)."""
        runner = self.runner
        found = {}
        assert runner.store is not None
        for record in runner.store.records(study=runner.study_id, kind="run"):
            if trajectory_record(record.trajectory).censored_at is not None:
                config = {k: v for k, v in record.config.items() if k != "max_steps"}
                found[config_key(config)] = record
        return found
