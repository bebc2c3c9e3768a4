"""The study's answer: the cell to train at, the ``kbackend train`` command (and Python call) that
trains there, and that command's own figures on held-out seeds (the confirmation).

The rule (docs/study.md, "When to trust the recommendation"): the cell with the fastest median
time to target, what the user asked for. Where the intervals over seeds cannot separate it
from others, the tie is stated, not broken by another criterion. The printed command carries
everything that decides the steps: engine, evaluation schedule (``--eval-every``), steps per
call, rate, batch size, target and the budget. The study then runs that command through the
command line's own ``main`` on seeds it never used (``confirm``); the Recommended line carries
what ``train`` reached there. A second cell is confirmed only when the first does not reach the
target on most held-out seeds.

Times, one vocabulary everywhere (the study, ``train``, the confirmation): *time to target* is
training time up to the evaluation that reached the target, without evaluation and without the
start-up (compilation, first calls); *wall to target* keeps the start-up in.
"""

from __future__ import annotations

import contextlib
import io
import math
import shlex
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kbackend.data.batching import steps_per_epoch
from kbackend.data.named import data_source
from kbackend.engine_facts import DEFAULT_ENGINE, engine_facts
from kbackend.history import History
from kbackend.io import JsonObject
from kbackend.stats import median_interval
from kbackend.study.cell_verdicts import time_verdict, verdict_settings
from kbackend.study.study_record import Cell, HeldOutRuns, StudyRecord
from kbackend.study.summaries import time_to_target

# Held-out seeds: far from any study's own (``StudyConfig.seed_values``: seed .. seed+max_seeds).
HELD_OUT_SEED = 10_000
CONFIRM_SEEDS = 3
MAX_CONFIRMED_CELLS = 2
DEFAULT_EPOCHS = 100
TIES_SHOWN = 4  # tied cells named on the Recommended line (all: Recommendation.tied_with)
# The command line's ``main``: argv (without the program name) -> exit status.
CommandLine = Callable[[Sequence[str]], int]


@dataclass(frozen=True)
class Interval:
    """A median over seeds with its [low, high] interval (``stats.median_interval``)."""

    median: float | None
    low: float | None = None
    high: float | None = None
    n: int | None = None

    @classmethod
    def of(cls, values: dict[str, float] | None) -> Interval | None:
        """The interval ``median_interval`` wrote as a dict, or None where there is none."""
        if not values or "median" not in values:
            return None
        n = values.get("n")
        return cls(_number(values.get("median")), _number(values.get("low")),
                   _number(values.get("high")), None if n is None else int(n))


@dataclass(frozen=True)
class Confirmation:
    """A cell's printed ``kbackend train`` command run on held-out seeds
    (``recommend.confirm_cell``): the seeds, how many reached the target, whether most did,
    and its steps, time and wall to target over them (a seed that did not reach: None ends)."""

    optimizer: str
    batch_size: int | str
    seeds: tuple[int, ...]
    reached: int
    confirmed: bool
    steps_to_target: Interval | None = None
    time_to_target: Interval | None = None
    wall_to_target: Interval | None = None

    @classmethod
    def of(cls, runs: HeldOutRuns) -> Confirmation:
        return cls(runs.optimizer, runs.batch_size, runs.held_out_seeds, int(runs.reached),
                   bool(runs.confirmed), Interval.of(runs.steps_to_target),
                   Interval.of(runs.time_to_target), Interval.of(runs.wall_to_target))


@dataclass(frozen=True)
class Recommendation:
    """The cell to train at: the fastest median time to target (``tie`` says which cells the
    intervals cannot separate from it); the ``kbackend train`` command and the Python call that
    train at it; what that command reached on held-out seeds (``confirmation``; the faster cells
    it did not confirm: ``passed_over``); ``edge``: its rate at the bound of the extended grid.
    ``result.best["batch_size"]`` still reads as the dict it used to be. Built by
    ``recommendation``."""

    optimizer: str
    batch_size: int | str
    learning_rate: float
    time_to_target: float
    steps_to_target: float
    intervals: dict[str, dict[str, float] | None]
    tied_with: tuple[tuple[str, int | str], ...]
    resolved: bool
    seeds: int
    command: str
    python: str
    confirmation: Confirmation | None = None
    edge: bool = False
    tie: str | None = None
    passed_over: tuple[Confirmation, ...] = ()
    warnings: tuple[str, ...] = ()

    def __getitem__(self, name: str) -> Any:
        """``best["batch_size"]``: the dict a Python user's code read before this record
        (documented in docs/your-model.md), kept for them; kbackend reads attributes."""
        return getattr(self, name)

    def to_dict(self) -> JsonObject:
        """The recommendation as JSON values (ties as lists)."""
        return {**asdict(self), "tied_with": [list(t) for t in self.tied_with]}


def ranked_cells(study: StudyRecord) -> list[Cell]:
    """The fixed-batch cells that reached the target, fastest median time to target first."""
    cells = [c for c in study.cells if c.reached and c.time_to_target]
    return sorted(cells, key=lambda c: (c.seconds, c.size))


def _cell_runs(study: StudyRecord, cell: Cell) -> list[JsonObject]:
    """The configs of ``cell``'s runs at its rate (a stored summary's too: ``StudyRecord.from_json``
    puts each run's optimizer back into its config)."""
    return [r.config for r in study.runs
            if (r.config.get("optimizer") or {}).get("name") == cell.optimizer
            and r.config.get("batch_size") == cell.batch_size
            and r.config.get("learning_rate") == cell.learning_rate]


def _schedule(study: StudyRecord, cell: Cell) -> dict[str, int]:
    """What the study's runs of ``cell`` were trained with that decides their steps and speed:
    the evaluation interval (engines that validate once an epoch have none to give), the fused
    steps (engines that fuse) and the full step budget; empty without stored runs."""
    runs = _cell_runs(study, cell)
    if not runs:
        return {}
    facts = engine_facts(study.config.get("engine", DEFAULT_ENGINE))
    schedule = {}
    if runs[0].get("eval_every") and not facts.evaluates_per_epoch:
        schedule["eval_every"] = int(runs[0]["eval_every"])
    if facts.fuses_steps and runs[0].get("fused_steps"):
        schedule["fused_steps"] = int(runs[0]["fused_steps"])
    schedule["max_steps"] = _full_budget(study, cell, schedule.get("eval_every", 1)) or \
        max(int(r["max_steps"]) for r in runs)
    return schedule


def _full_budget(study: StudyRecord, cell: Cell, every: int) -> int | None:
    """The cell's unpruned step budget (``StudyConfig.step_budget`` in whole evaluation
    intervals), as its first run had: the search cuts later rates' budgets to the best so far,
    so the recommended rate's own runs may have stopped short of it. None where the study does
    not say (no dataset or budget recorded)."""
    config, num_train = study.config, study.dataset.get("num_train")
    if not num_train or not config.get("max_steps"):
        return None
    budget = int(config["max_steps"])
    if config.get("max_epochs"):
        per_epoch = steps_per_epoch(int(num_train), int(cell.batch_size))
        budget = min(budget, int(config["max_epochs"]) * per_epoch)
    return -(-budget // every) * every


def train_arguments(study: StudyRecord, cell: Cell) -> list[str]:
    """The ``kbackend train`` flags that train at ``cell`` as the study's runs did."""
    config, target = study.config, study.target
    args = ["--model", config["model"],
            *data_source(config["dataset"], config.get("label") or None).to_flags()]
    if config.get("data_dir"):
        args += ["--data-dir", config["data_dir"]]
    if config.get("validation_fraction", 0.1) != 0.1:
        args += ["--validation-fraction", f"{config['validation_fraction']:g}"]
    if config.get("unsafe_deserialization"):
        args.append("--unsafe-deserialization")
    args += ["--engine", config.get("engine", DEFAULT_ENGINE), "--optimizer", cell.optimizer,
             "--lr", f"{cell.learning_rate:g}", "--batch-size", str(cell.batch_size)]
    for name, value in _schedule(study, cell).items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    if config.get("jit_compile") is False:
        args.append("--no-jit")
    args += ["--target-metric", target["metric"], "--target", f"{target['value']:g}",
             "--epochs", str(DEFAULT_EPOCHS)]
    return args


def _python_call(study: StudyRecord, cell: Cell) -> str:
    config, target = study.config, study.target
    extra = "".join(f"{name}={value}, " for name, value in _schedule(study, cell).items())
    return (f"kbackend.train({config['model']!r}, data={config['dataset']!r}, "
            f"engine={config.get('engine', DEFAULT_ENGINE)!r}, optimizer={cell.optimizer!r}, "
            f"learning_rate={cell.learning_rate:g}, batch_size={cell.batch_size}, "
            f"{extra}target={target['value']:g}, target_metric={target['metric']!r}, "
            f"epochs={DEFAULT_EPOCHS}, save='best.keras')")


def recommendation(study: StudyRecord) -> Recommendation | None:
    """The cell to train at (the fastest median time to target; the cells the paired time
    verdict does not show slower are named as ``tied_with``), with its command, Python call,
    whether its rate sits at the bound of the extended grid (``edge``) and, once ``confirm``
    ran, what ``train`` reached on held-out seeds (``confirmation``). None if no cell reached
    the target."""
    cells = ranked_cells(study)
    if not cells:
        return None
    confirmed = list(study.confirmation or ())
    best = cells[0]
    if len(confirmed) > 1 and not confirmed[0].confirmed and confirmed[1].confirmed:
        best = next(c for c in cells if c.key == confirmed[1].key)
    settings = verdict_settings(study)
    # The report's own paired verdict (``fastest_verdict``): a cell is tied unless it is shown
    # slower; equivalent within the margin is a tie too.
    tied = [c.key for c in cells if c is not best
            and time_verdict(best, c, settings, study.step_times).outcome != "a"]
    mine = next((c for c in confirmed if c.key == best.key), None)
    ties = ", ".join(f"{o} at batch {b}" for o, b in tied)
    return Recommendation(
        optimizer=best.optimizer, batch_size=best.batch_size, learning_rate=best.learning_rate,
        time_to_target=best.seconds, steps_to_target=best.steps,
        intervals={k: best.intervals.get(k) for k in ("time_to_target", "steps_to_target")},
        tied_with=tuple(tied), resolved=not tied and best.seeds > 1, seeds=best.seeds,
        command=shlex.join(["kbackend", "train", *train_arguments(study, best),
                            "--save", "best.keras"]),
        python=_python_call(study, best),
        confirmation=None if mine is None else Confirmation.of(mine),
        edge=bool(best.lr_at_bound),
        tie=f"tied with {ties}: the intervals over seeds cannot separate them" if ties else None,
        passed_over=tuple(Confirmation.of(c) for c in confirmed if c is not mine),
        warnings=tuple(study.warnings))


def _interval_text(figure: Interval | None, unit: str = "", spec: str = ".0f") -> str:
    """``median [low, high]``; an end that is not finite (a seed that never reached) "never"."""
    def number(value: float | None) -> str:
        return "never" if value is None else f"{value:{spec}}{unit}"
    if figure is None:
        return "not measured"
    return f"{number(figure.median)} [{number(figure.low)}, {number(figure.high)}]"


def recommendation_lines(best: Recommendation | None) -> list[str]:
    """What the study's console ends with: the cell to train at, what ``train`` reached with the
    printed command on held-out seeds, and the command and Python call."""
    if best is None:
        return ["No cell reached the target: nothing to recommend (raise the budget with "
                "--max-steps, or lower --target)."]
    names = [f"{o} at batch {b}" for o, b in best.tied_with]
    ties = ", ".join(names[:TIES_SHOWN]) + (
        f" and {len(names) - TIES_SHOWN} more"
        if len(names) > TIES_SHOWN else "")
    if best.seeds < 2:
        why = " (one seed: no interval, so not resolved; the fastest median)"
    elif ties:
        why = (f" (the fastest median time to target; tied with {ties}: the paired intervals "
               "over seeds do not show it faster)")
    else:
        why = " (resolved: the intervals separate it from every other cell)"
    edge = (" The rate is at the bound of the extended grid (edge): a better one may lie "
            "beyond it." if best.edge else "")
    lines = [f"Recommended: {best.optimizer} at batch {best.batch_size}, lr "
             f"{best.learning_rate:g}{' (edge)' if best.edge else ''}{why}.{edge}"]
    for other in best.passed_over:
        lines.append(f"  {other.optimizer} at batch {other.batch_size} was faster in the "
                     f"study but train reached the target on only {other.reached} of "
                     f"{len(other.seeds)} held-out seeds.")
    if best.confirmation is not None:
        lines.append("  " + confirmation_text(best.confirmation))
    lines += [f"  {warning}" for warning in best.warnings]
    return [*lines, f"  {best.command}", f"  {best.python}"]


def confirmation_text(confirmation: Confirmation) -> str:
    """One line of what the printed command reached on held-out seeds."""
    seeds = len(confirmation.seeds)
    if not confirmation.reached:
        return (f"Confirmed with this command on {seeds} held-out seeds: the target was not "
                "reached on any of them.")
    steps = _interval_text(confirmation.steps_to_target)
    time = _interval_text(confirmation.time_to_target, " s", ".3g")
    return (f"Confirmed with this command on {seeds} held-out seeds: train reaches the target in "
            f"{steps} steps, time to target {time} (median [min, max]; reached on "
            f"{confirmation.reached} of {seeds}).")


def run_train(command_line: CommandLine, arguments: list[str], seed: int) -> History | None:
    """``kbackend train ARGUMENTS --seed SEED`` through the command line's ``main`` (its output
    kept off the console); its history, None if the command failed."""
    with tempfile.TemporaryDirectory(prefix="kbackend-confirm-") as folder:
        path = Path(folder) / "history.json"
        with contextlib.redirect_stdout(io.StringIO()):
            status = command_line(["train", *arguments, "--seed", str(seed), "--quiet",
                                   "--history", str(path)])
        return History.load(path) if status == 0 and path.is_file() else None


def confirm_cell(study: StudyRecord, cell: Cell, command_line: CommandLine,
                 seeds: int = CONFIRM_SEEDS,
                 on_seed: Callable[[int], None] | None = None) -> HeldOutRuns:
    """The printed command's figures at ``cell`` on ``seeds`` held-out seeds: steps and time to
    target (median and [min, max]; a seed that did not reach counts as never), wall to target
    (start-up included) and how many seeds reached."""
    arguments = train_arguments(study, cell)
    first = HELD_OUT_SEED + int(study.config.get("seed", 0))
    figures: list[tuple[float, ...]] = []  # per seed: steps, time and wall to target
    failed = 0
    for seed in range(first, first + seeds):
        history = run_train(command_line, arguments, seed)
        if on_seed is not None:
            on_seed(seed)
        reached = history.record.target_reached if history is not None else None
        failed += int(history is None)
        figures.append((math.inf,) * 3 if reached is None or history is None
                       else (float(reached["step"]), *time_to_target(history)))
    steps, times, walls = ([seed_figures[i] for seed_figures in figures] for i in range(3))
    reached_count = sum(1 for s in steps if math.isfinite(s))
    return HeldOutRuns(
        cell.optimizer, cell.batch_size, cell.learning_rate, seeds,
        tuple(range(first, first + seeds)), reached_count, failed, reached_count * 2 > seeds,
        median_interval(steps), median_interval(times), median_interval(walls),
        cell.steps_to_target, cell.time_to_target, tuple(arguments))


def confirm(study: StudyRecord,
            confirm_one: Callable[[Cell], HeldOutRuns]) -> list[HeldOutRuns]:
    """Confirm the fastest cell (``confirm_one``: ``confirm_cell`` or its stored result); confirm
    the next one as well (at most ``MAX_CONFIRMED_CELLS``) only when the first does not reach
    the target on most held-out seeds."""
    confirmed: list[HeldOutRuns] = []
    for cell in ranked_cells(study)[:MAX_CONFIRMED_CELLS]:
        confirmed.append(confirm_one(cell))
        if confirmed[-1].confirmed:
            break
    return confirmed


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None
