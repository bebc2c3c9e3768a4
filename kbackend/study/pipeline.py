"""A whole study from the outside: run (or resume) it with a progress bar, analyse it, write the
report; and compare studies run on different backends or devices side by side."""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from kbackend.data.named import data_source
from kbackend.errors import ConfigError, DataError, OutputError
from kbackend.escaping import console_text, markdown_text
from kbackend.io import atomic_write_text, check_output_folder, read_json
from kbackend.model_sources import model_kind
from kbackend.reports import markdown_rows
from kbackend.study import trust
from kbackend.study.analysis import Analysis, analyze
from kbackend.study.config import StudyConfig
from kbackend.study.device_profile import check_profile, load_profile, predict
from kbackend.study.executor import RunExecutor, StudyRunner
from kbackend.study.exports import write_runs_csv, write_tensorboard
from kbackend.study.frontier import why_no_frontier
from kbackend.study.recommend import (
    CONFIRM_SEEDS,
    HELD_OUT_SEED,
    CommandLine,
    confirm,
    confirm_cell,
    ranked_cells,
    train_arguments,
)
from kbackend.study.report import CONSOLE_WIDTH, print_table, write_report
from kbackend.study.results import recommendation, recommendation_lines
from kbackend.study.runner_protocol import StudyEvent
from kbackend.study.store import ResultStore, RunStore
from kbackend.study.study_record import Cell, HeldOutRuns, MachineLoad, StudyRecord, TimeAccount
from kbackend.study.timing import TimeSpent
from kbackend.task import metric_direction
from kbackend.tensorboard_logs import check_logdir, require_hparams_plugin
from kbackend.workload import WARNING

DB_NAME = "study.db"


def report_dir(out: Path, study: StudyRecord) -> Path:
    """Where one study's report goes: one folder per dataset, model, backend and engine. A
    user's model or data is named with the start of its content digest: two sources with the
    same file name (``a/cls.npz``, ``b/cls.npz``) or one edited never share a folder."""
    config, digests = study.config, study.digests
    parts = [folder_name(config["dataset"]), folder_name(config["model"]),
             study.env["backend"], config["engine"]]
    if data_source(config["dataset"]).by_content and digests.get("data"):
        parts[0] += f"-{digests['data'][:8]}"
    if getattr(model_kind(config["model"]), "by_content", True) and digests.get("model"):
        parts[1] += f"-{digests['model'][:8]}"
    return out / "_".join(parts)


def folder_name(source: str) -> str:
    """``source`` as one folder name: a built-in name as it is, a path by its file name
    (``data/train.npz`` -> ``train.npz``, ``models.py:build`` -> ``models.py-build``)."""
    name = source.rstrip("/").replace("\\", "/").rsplit("/", 1)[-1].replace(":", "-")
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) or "_"


class _ProgressEvents:
    """Feeds runner events to a rich progress bar over the grid (with an ETA)."""

    def __init__(self, progress: Any, task: Any, console: Any, lines: bool) -> None:
        self.progress, self.task, self.console = progress, task, console
        self.lines = lines  # one line per run where no live bar can be drawn (logs, CI)
        self.skipped = 0
        self.label = ""

    # What the bar counts (one step each) and what it names while it runs
    COUNTED = ("run", "noise", "timing", "confirm")
    NAMED = ("run", "noise", "timing", "probe", "population", "confirm")

    def __call__(self, event: StudyEvent) -> None:
        if event.phase == "extend":  # a grid extension or a re-run: more runs than planned
            self.progress.update(self.task, total=self.progress.tasks[0].total + event.runs)
        elif event.phase == "pruned":  # a seed a pruned rate no longer needs
            self.progress.advance(self.task, event.runs)
        elif event.phase == "start" and event.what in self.NAMED:
            self.label = self._label(event)
            self.progress.update(self.task, description=self.label)
        elif event.phase in ("finished", "skipped") and event.what in self.COUNTED:
            self.skipped += event.phase == "skipped"
            self.progress.advance(self.task)
            if event.phase == "finished" and event.what == "run" and event.plan is not None:
                self.label = event.plan.label()  # a population's members finish together
            if self.lines and event.phase == "finished" and event.what == "run":
                assert event.record is not None  # a finished run is stored
                result = event.record.result
                outcome = (f"reached in {result['steps_to_target']} steps, "
                           f"{result['time_to_target']:.2f} s" if result["reached"] else
                           f"not reached in {result['steps_run']} steps")
                done = int(self.progress.tasks[0].completed)
                self.console.print(f"[{done}/{int(self.progress.tasks[0].total)}] {self.label}: "
                                   f"{outcome}", highlight=False)

    @staticmethod
    def _label(event: StudyEvent) -> str:
        """What the bar says while ``event``'s run or measurement goes on."""
        plan = event.plan
        if event.what == "run" and plan is not None:
            return plan.label()
        if event.what == "noise" and plan is not None:
            return f"noise scale along {plan.label()}"
        cell = f"{plan.optimizer} B={plan.batch_size}" if plan is not None else ""
        return {"probe": f"{cell}: population or one by one? (probe)",
                "confirm": "confirming: the printed train command, held-out seeds",
                "population": f"{cell}: {event.runs} runs as one population"}.get(
                    event.what, "steady step times, interleaved")


# The goal for the study's overhead: the whole process takes at most this many times the
# wall time its runs spent in train steps, plus their start-ups (one per cell when compiled once).
OVERHEAD_GOAL = 1.5


def process_seconds() -> float:
    """Seconds since this process started (interpreter start-up and imports included)."""
    return max(time.time() - psutil.Process().create_time(), 0.0)


def time_accounting(spent: TimeSpent, call_seconds: float, process: float,
                    report_seconds: float | None = None) -> TimeAccount:
    """Where the study's time went, from the process's start: the runs' steady training,
    their start-ups (compilation and first calls, and building the model, the seeds' initial
    values and each cell's trainer: ``setup_s``), evaluation, the work around the runs (data
    order, resets, test evaluations), the time model, the noise scale, the report (when known)
    and the rest (imports, data, checks, store commits), with the ratio the overhead goal is
    stated in: whole process / steady training, goal at most ``OVERHEAD_GOAL`` x steady +
    start-ups."""
    steady = spent.steady_training
    report = report_seconds or 0.0
    whole = process + report
    accounted = spent.runs_wall + spent.setup + spent.step_times + spent.noise + report
    startup = spent.startup + spent.setup  # compilation and first calls, and the builds
    goal = OVERHEAD_GOAL * steady + startup
    return TimeAccount(
        runs_trained=spent.runs, whole_process_s=whole, this_call_s=call_seconds,
        before_call_s=max(process - call_seconds, 0.0),
        steady_training_s=steady, startup_s=startup, setup_s=spent.setup,
        evaluation_s=spent.evaluation,
        around_runs_s=max(spent.runs_wall - spent.training - spent.evaluation, 0.0),
        time_model_s=spent.step_times, noise_scale_s=spent.noise,
        added_seeds_s=spent.added_seeds, added_seed_runs=spent.added_seed_runs,
        frontier_runs=spent.frontier_runs,
        report_s=report_seconds, other_s=max(whole - accounted, 0.0),
        whole_over_steady=whole / steady if steady > 0 else None,
        goal_s=goal, goal_met=bool(steady > 0 and whole <= goal))


def accounting_line(account: TimeAccount) -> str:
    """The accounting in one line (the console's last line of a study)."""
    if not account.runs_trained:
        return (f"whole process {account.whole_process_s:.1f} s; no run trained in this "
                "process (every run was reused from the store)")
    ratio = account.whole_over_steady
    parts = [f"steady training {account.steady_training_s:.1f} s",
             f"start-up {account.startup_s:.1f} s (of it building the model and trainers "
             f"{account.setup_s or 0.0:.1f} s)",
             f"evaluation {account.evaluation_s:.1f} s",
             f"around runs {account.around_runs_s:.1f} s",
             f"time model {account.time_model_s:.1f} s",
             f"noise scale {account.noise_scale_s:.1f} s"]
    if account.added_seed_runs or account.frontier_runs:
        parts.append(f"(of all these, added seeds and frontier: {account.added_seeds_s:.1f} s, "
                     f"{account.added_seed_runs} added-seed and {account.frontier_runs} "
                     "frontier runs)")
    if account.report_s is not None:
        parts.append(f"analysis and report {account.report_s:.1f} s")
    parts.append(f"other (imports, data, checks) {account.other_s:.1f} s")
    line = f"whole process {account.whole_process_s:.1f} s = {', '.join(parts)}"
    if not ratio:
        return line
    verdict = "met" if account.goal_met else "not met"
    return (f"{line}; whole / steady training {ratio:.1f}x (goal: at most {OVERHEAD_GOAL:g}x "
            f"steady + start-ups = {account.goal_s:.1f} s, {verdict})")


def _confirmations(runner: StudyRunner, study: StudyRecord, command_line: CommandLine,
                   seeds: int) -> list[HeldOutRuns]:
    """``recommend.confirm`` with each cell's figures stored (keyed by content, the command's
    arguments and the held-out seeds): a resumed study does not train them again."""
    def confirm_one(cell: Cell) -> HeldOutRuns:
        key_config = {"kind": "confirmation", **runner.content_identity(),
                      "arguments": train_arguments(study, cell), "seeds": seeds,
                      "first_seed": HELD_OUT_SEED + runner.config.seed, **runner.env}
        return HeldOutRuns.from_json(runner.stored_or_measured(
            "confirmation", "confirm", key_config, None,
            lambda: confirm_cell(study, cell, command_line, seeds).to_json()))
    return confirm(study, confirm_one)


def _prepared_runner(config: StudyConfig, out: Path, run_executor: RunExecutor | None,
                     say: Callable[[str], None]) -> tuple[StudyRunner, Any]:
    """The study's runner with its data read and every input check done (before the store is
    created or opened), its model's warnings said through ``say``: the runner and the device
    profile (or None)."""
    runner = StudyRunner(config, None, run_executor=run_executor)
    # Read and checked here, in the driver (it only re-models time), before the data loads.
    profile = None if config.device_profile is None else load_profile(config.device_profile)
    runner.prepare()
    for note in runner.workload.notes if runner.workload is not None else ():
        if note.startswith(WARNING):  # what the user's model does that they may not mean
            say(note)
    if profile is not None:
        check_profile(profile, config.model, config.dataset, runner.batch_sizes)
    # The report's folder too: a file in its place is a one-line error now, not after the runs.
    check_output_folder(report_dir(out, StudyRecord(config=config.to_dict(), env=runner.env,
                                                    digests=runner.digests)), "report")
    return runner, profile


def _run_with_progress(runner: StudyRunner, out: Path, console: Any, show_progress: bool,
                       command_line: CommandLine | None,
                       confirm_seeds: int) -> tuple[StudyRecord, _ProgressEvents]:
    """Run (or resume) the study in ``runner.store`` under a progress bar, then confirm its
    recommendation with ``command_line``; the study and the progress events (what was reused)."""
    config = runner.config
    confirming = command_line is not None and confirm_seeds > 0
    total = runner.total_runs() + (1 if config.noise_points else 0) + \
        (1 if config.step_time_repeats else 0) + (1 if confirming else 0)
    with Progress(TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                  console=console, disable=not show_progress, transient=False) as progress:
        task = progress.add_task("study", total=total)
        events = _ProgressEvents(progress, task, console,
                                 lines=show_progress and not console.is_terminal)
        runner.on_event = events
        legacy = runner.legacy_runs()
        if legacy and show_progress:
            console.print(f"{legacy} runs in {out / DB_NAME} predate content keys: kept in "
                          "the store, never reused (each run is now keyed by what it "
                          "trains: model, data and options)", highlight=False)
        study = runner.run()
        if confirming and ranked_cells(study):
            assert command_line is not None
            study = replace(study, confirmation=tuple(
                _confirmations(runner, study, command_line, confirm_seeds)))
    return study, events


def _write_outputs(study: StudyRecord, analysis: Analysis, out: Path,
                   wall_time: float, started_at: float,
                   tensorboard: str | os.PathLike | None) -> dict[str, Path]:
    """The report, ``runs.csv`` and the TensorBoard runs; their paths. A failed write is a
    one-line ``OutputError``: the runs are stored, so a re-run writes the report from them."""
    try:
        paths = write_report(study, analysis, report_dir(out, study), wall_time)
        paths["runs"] = write_runs_csv(study, report_dir(out, study), started_at)
        if tensorboard is not None:
            write_tensorboard(study, tensorboard)
    except OSError as error:
        raise OutputError(f"Could not write the report under {str(out)!r}: "
                          f"{error.strerror or error}; every run is kept in the store, so "
                          "running the command again writes it.") from None
    return paths


@dataclass(frozen=True)
class StudyOutcome:
    """What ``run_study`` returns: the study, its analysis, the paths it wrote (report, summary,
    plots, runs.csv), this call's wall time, the runs it trained and reused, where the time
    went."""

    study: StudyRecord
    analysis: Analysis
    paths: dict[str, Path]
    wall_time: float
    executed: int
    skipped: int
    time_spent: TimeAccount



def run_study(config: StudyConfig, out_dir: str | Path, *, show_progress: bool = True,
              console: Any = None, print_results: bool = True,
              run_executor: RunExecutor | None = None, command_line: CommandLine | None = None,
              confirm_seeds: int = CONFIRM_SEEDS,
              tensorboard: str | os.PathLike | None = None,
              store: RunStore | None = None) -> StudyOutcome:
    """Run or resume ``config`` with its results in ``store`` (default: the SQLite store
    ``out_dir/study.db``, opened after the input checks); write the report,
    ``runs.csv`` beside it and, with ``tensorboard``, a TensorBoard run folder per run and the
    HParams experiment there. ``run_executor`` trains each run (default: in this process,
    ``StudyRunner.train_here``). ``command_line`` (the train command's entry): the recommended
    cell's printed ``kbackend train`` command is run through it on ``confirm_seeds`` held-out
    seeds (``recommend.confirm``). All input checks run before any training; returns the
    ``StudyOutcome``."""
    console = console or Console(stderr=True)
    out = Path(out_dir)
    if tensorboard is not None:  # the HParams plugin installed, the folder writable, no input
        require_hparams_plugin()
        check_logdir(tensorboard, inputs={"--model": config.model, "--data": config.dataset,
                                          "--out": out / DB_NAME})
    started_at = time.time()  # runs stored before it are reused (runs.csv's ``reused``)
    start = time.perf_counter()
    load_before = os.getloadavg()[0]

    def say(line: str) -> None:
        if show_progress or print_results:  # progress=False: nothing said
            console.print(line, highlight=False, markup=False)
    runner, profile = _prepared_runner(config, out, run_executor, say)
    target = config.resolved_target
    num_val = len(runner.dataset.x_val) if runner.dataset else 0
    warning = trust.before_training(target.metric, target.value, num_val)
    if warning:
        say(warning)
    with _opened(store, out) as records:
        runner.store = records
        study, events = _run_with_progress(runner, out, console, show_progress, command_line,
                                           confirm_seeds)
        plateau = trust.after_training(study, target.metric, target.value, num_val,
                                       no_frontier=why_no_frontier(config))
        if plateau:
            say(plateau)
        study = _completed(replace(study, warnings=tuple(w for w in (warning, plateau) if w)),
                           profile, runner.time_spent, start, load_before)
        wall_time = study.time_spent.this_call_s if study.time_spent else 0.0
        before_report = time.perf_counter()
        analysis = analyze(study)
        paths = _write_outputs(study, analysis, out, wall_time, started_at, tensorboard)
        # One summary per backend, engine and device: what `study compare` puts side by side.
        records.put_summary(study.study_id, f"{study.env['backend']}/{config.engine}",
                            study.env["device"], read_json(paths["summary"]))
    assert study.time_spent is not None
    account = time_accounting(runner.time_spent, wall_time, study.time_spent.whole_process_s,
                              report_seconds=time.perf_counter() - before_report)
    if print_results:
        print_results_of(study, analysis, f"wall time {wall_time:.1f} s: {runner.executed} runs "
                         f"trained, {events.skipped} reused from {console_text(out / DB_NAME)}; "
                         f"report: {console_text(paths['report'])}", account)
    return StudyOutcome(study, analysis, paths, wall_time, runner.executed, events.skipped,
                        account)


def _completed(study: StudyRecord, profile: Any, spent: TimeSpent, start: float,
               load_before: float) -> StudyRecord:
    """``study`` with what the pipeline adds after its runs: the device profile's prediction,
    the machine's load and where the time went (up to the report: the report cannot time its
    own writing, the console line can)."""
    if profile is not None:
        study = replace(study, device_profile=predict(study, profile))
    wall_time = time.perf_counter() - start
    return replace(study, machine_load=MachineLoad(load_before, os.getloadavg()[0],
                                                   os.cpu_count()),
                   time_spent=time_accounting(spent, wall_time, process_seconds()))


@contextmanager
def _opened(store: RunStore | None, out: Path) -> Iterator[RunStore]:
    """``store``, or the SQLite store in ``out`` (opened here, closed after)."""
    if store is not None:
        yield store
        return
    with ResultStore(out / DB_NAME) as opened:
        yield opened


def print_results_of(study: StudyRecord, analysis: Analysis, wall_line: str,
                     account: TimeAccount) -> None:
    """The console's answer and wall time first, then the table and the findings, then where
    the time went."""
    stdout = Console() if Console().is_terminal else Console(width=CONSOLE_WIDTH)
    for line in recommendation_lines(recommendation(study)):
        stdout.print(line, highlight=False, soft_wrap=True, markup=False)  # '[min, max]'
    stdout.print(wall_line, highlight=False)
    print_table(study, analysis, console=stdout)
    stdout.print(f"Time: {accounting_line(account)}", highlight=False)


# -- comparison across backends / devices --------------------------------------------------------

def load_summaries(paths: Iterable[str | Path],
                   out_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """Summaries from report folders / summary.json files, or every one stored in
    ``out_dir/study.db`` when no path is given."""
    summaries = []
    for path in map(Path, paths):
        file = path / "summary.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"No study summary at {str(file)!r}: expected a study report folder "
                              "or its summary.json.")
        summaries.append(_read_summary(file))
    if not summaries and out_dir is not None:
        db = Path(out_dir) / DB_NAME
        if not db.is_file():
            raise ConfigError(f"No study results at {str(db)!r}: run `kbackend study --out "
                              f"{out_dir}` first, or pass report folders to compare.")
        with ResultStore(db) as store:
            summaries = store.summaries()
    if not summaries:
        raise ConfigError("Nothing to compare: no study summaries found.")
    return summaries


# What ``compare`` reads of a summary: (path of keys, expected type); cells need these keys.
_SUMMARY_FIELDS = ((("study",), str), (("config",), dict), (("config", "model"), str),
                   (("config", "dataset"), str), (("config", "engine"), str),
                   (("config", "optimizers"), list), (("config", "target"), dict),
                   (("config", "target", "metric"), str),
                   (("config", "target", "value"), (int, float)), (("env",), dict),
                   (("env", "backend"), str), (("env", "device"), str), (("cells",), list),
                   (("analysis",), dict), (("analysis", "crossovers"), list))
_CELL_FIELDS = ("optimizer", "batch_size", "reached", "time_to_target", "steps_to_target")


def _read_summary(file: Path) -> dict[str, Any]:
    """A study summary read from ``file`` and checked to hold what ``compare`` reads; anything
    else is one ``DataError`` line naming the file and what was wrong."""
    def refuse(what: str) -> DataError:
        return DataError(f"Invalid study summary {str(file)!r}: {what}. Expected the "
                         "summary.json a kbackend study report folder holds.")

    try:
        summary = read_json(file)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise refuse(f"not JSON ({type(error).__name__}: {str(error)[:80]})") from None
    except (KeyError, IndexError, TypeError):  # its non-finite map names fields it lacks
        raise refuse("its list of non-finite numbers names fields the file lacks") from None
    for keys, kind in _SUMMARY_FIELDS:
        value: Any = summary
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        if not isinstance(value, kind) or isinstance(value, bool):
            kind_name = getattr(kind, "__name__", "number")
            raise refuse(f"{'.'.join(keys)} is missing or not a {kind_name}")
    absent = [k for k in ("best", "throughput_knee") if k not in summary["analysis"]]
    if absent:
        raise refuse(f"analysis lacks {', '.join(absent)}")
    for index, cell in enumerate(summary["cells"]):
        missing = [k for k in _CELL_FIELDS if not isinstance(cell, dict) or k not in cell]
        if missing:
            raise refuse(f"cells[{index}] lacks {', '.join(missing)}")
    return summary


def _column(summary: dict[str, Any]) -> str:
    return f"{summary['env']['backend']}/{summary['config']['engine']}"


def compare(summaries: list[dict[str, Any]]) -> str:
    """A markdown comparison of studies of the same question (grouped by study id)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for summary in summaries:
        groups.setdefault(summary["study"], []).append(summary)
    lines = []
    for study_id, group in groups.items():
        config = group[0]["config"]
        target = config["target"]
        relation = ">=" if metric_direction(target["metric"]) == "max" else "<="
        lines += [f"## Study {study_id}: {markdown_text(config['model'])} on "
                  f"{markdown_text(config['dataset'])}, {markdown_text(target['metric'])} "
                  f"{relation} {target['value']:g}", ""]
        columns = [_column(s) for s in group]
        header = ["optimizer", "batch"] + [f"{c} time (s)" for c in columns] + \
                 [f"{c} steps" for c in columns] + [f"{c} samples/s" for c in columns]
        table = []
        keys = sorted({(c["optimizer"], c["batch_size"]) for s in group for c in s["cells"]},
                      key=lambda k: (config["optimizers"].index(k[0])
                                     if k[0] in config["optimizers"] else 99, k[1]))
        cells = [{(c["optimizer"], c["batch_size"]): c for c in s["cells"]} for s in group]
        for key in keys:
            times, steps, speeds = [], [], []
            for by_key in cells:
                cell = by_key.get(key)
                reached = cell if cell is not None and cell["reached"] else None
                times.append(f"{reached['time_to_target']:.2f}" if reached else "not reached")
                steps.append(f"{reached['steps_to_target']:.0f}" if reached else "-")
                speed = None if cell is None else cell.get("samples_per_s")
                speeds.append(f"{speed:,.0f}" if speed and math.isfinite(speed) else "-")
            table.append([key[0], str(key[1]), *times, *steps, *speeds])
        lines += [markdown_rows(header, table)]
        for summary in group:
            b_simple = summary["analysis"].get("b_simple")
            noise = (f"B_simple ~ {b_simple:.0f}" if b_simple and math.isfinite(b_simple)
                     else "B_simple n/a")
            best_text, knee, cross = _verdict_texts(summary["analysis"])
            lines.append(f"- {markdown_text(_column(summary))} on "
                         f"{markdown_text(summary['env']['device'])}: {best_text}; "
                         f"{knee}; {noise}; {cross}")
        lines.append("")
    return "\n".join(lines)


def _verdict_texts(analysis: dict[str, Any]) -> tuple[str, str, str]:
    """The fastest cell, the throughput knee and the optimizer crossovers as the study's report
    states them: with the seeds' intervals ("not resolved at N seeds" where they overlap). Read
    from a stored summary's JSON (``Analysis.to_json``), old files included.
    Summaries written before the study had seeds give their medians' answers."""
    verdicts = analysis.get("verdicts")
    if verdicts:
        cross = "; ".join(f"{x['challenger']} vs {x['incumbent']}: {x['text']}"
                          for x in verdicts["optimizers"])
        return verdicts["fastest"]["text"], verdicts["throughput_knee"]["text"], cross
    best = analysis["best"]
    best_text = (f"fastest {best['optimizer']} at batch {best['batch_size']} "
                 f"({best['time_to_target']:.2f} s)") if best else "no cell reached the target"
    cross = "; ".join(f"{x['challenger']} vs {x['incumbent']}: {x['note']}"
                      for x in analysis["crossovers"])
    return best_text, f"throughput knee {analysis['throughput_knee']}", cross


def write_comparison(summaries: list[dict[str, Any]], out: str | Path) -> Path:
    return atomic_write_text(Path(out), "# Study comparison\n\n" + compare(summaries))
