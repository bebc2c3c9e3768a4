"""A study's report: a table in the terminal (rich), a markdown report, a JSON summary and PNG
plots (matplotlib, Agg backend). Every file is written atomically."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from kbackend.escaping import console_text, markdown_text
from kbackend.io import JsonObject
from kbackend.reports import markdown_rows, write_json_and_markdown
from kbackend.study.analysis import Analysis
from kbackend.study.auto_verdicts import AUTO_TIME_MODEL
from kbackend.study.device_profile import report_section as profile_section
from kbackend.study.plots import PLOTS, write_plots
from kbackend.study.report_sections import (
    caveats_section,
    conclusions,
    frontier_section,
    sources_section,
    table_rows,
    tested_metric,
)
from kbackend.study.study_record import StudyRecord
from kbackend.study.verdicts import format_value
from kbackend.task import metric_direction

CONSOLE_WIDTH = 100
# The console table's columns, most needed first: where the console is too narrow for all, the
# last ones are dropped whole (never cut or left blank; every column is in the report).
CONSOLE_COLUMNS = ("optimizer", "batch", "lr", "time (s)", "steps", "reached", "test")
_GAP = 2  # spaces between the console table's columns (rich: collapsed padding of 1)
# Metric names shortened in the console's test column header.
_SHORT_METRICS = {"accuracy": "acc", "sparse_categorical_accuracy": "acc",
                  "categorical_accuracy": "acc", "binary_accuracy": "acc",
                  "mean_absolute_error": "mae", "mean_squared_error": "mse",
                  "root_mean_squared_error": "rmse"}


def console_rows(study: StudyRecord) -> tuple[list[str], list[list[str]], list[bool]]:
    """The console table: ``CONSOLE_COLUMNS`` (the test column named by the task's metric),
    medians only (their intervals: the report), a rate on its grid's edge marked ``*``; and
    whether each cell reached."""
    metric = tested_metric(study).removeprefix("test_")  # test acc, test mae, ...
    header = [*CONSOLE_COLUMNS[:-1], f"test {_SHORT_METRICS.get(metric, metric)}"]
    rows, reached = [], []
    for c in study.all_cells:
        auto = c.auto or {}
        rows.append([
            c.optimizer,
            f"auto {auto.get('min')}-{auto.get('max')}" if auto else str(c.batch_size),
            format_value(c.learning_rate) + ("*" if c.lr_at_grid_edge else ""),
            format_value(c.time_to_target, ".3g"),
            format_value(c.steps_to_target, ".0f"),
            ("yes" if c.reached else "no")
            + (f" ({c.seeds_reached}/{c.seeds})" if c.seeds > 1 else ""),
            format_value(c.test_metric if c.test_metric is not None else c.test_accuracy, ".4f"),
        ])
        reached.append(bool(c.reached))
    return header, rows, reached


def fitting_columns(header: list[str], rows: list[list[str]], width: int) -> list[int]:
    """The columns (indices, in order) that fit ``width`` at their full width with
    ``_GAP`` spaces between them: the last of ``CONSOLE_COLUMNS`` are dropped first."""
    widths = [max(len(text) for text in [name, *(row[i] for row in rows)])
              for i, name in enumerate(header)]
    keep = list(range(len(header)))
    while len(keep) > 2 and sum(widths[i] for i in keep) + _GAP * (len(keep) - 1) > width:
        keep.pop()
    return keep


def print_table(study: StudyRecord, analysis: Analysis, console: Any = None) -> None:
    """The per-cell table (the columns that fit the console, at most ``CONSOLE_WIDTH``; every
    column is in the report) and the conclusions, printed with rich. The scaling exponents
    along each optimizer's batch sizes are in the report only."""
    console = console or Console()
    width = min(console.width, CONSOLE_WIDTH)
    target = study.target
    header, rows, reached = console_rows(study)
    keep = fitting_columns(header, rows, width)
    console.print(console_text(f"{study.config['model']} on {study.dataset['name']}: "
                               f"time to {target['metric']} {target['value']:g} "
                               f"({study.env['backend']})"), highlight=False)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1), show_edge=False,
                  collapse_padding=True)  # _GAP spaces between columns
    for index in keep:
        table.add_column(header[index], no_wrap=True, min_width=len(header[index]),
                         justify="left" if index in (0, 5) else "right")
    for row, hit in zip(rows, reached, strict=True):
        table.add_row(*(row[i] for i in keep), style=None if hit else "dim")
    console.print(table, width=width)
    dropped = [header[i] for i in range(len(header)) if i not in keep]
    console.print(console_text("(medians over seeds; *: best rate on its grid's edge; intervals"
                               + (f", {', '.join(dropped)}" if dropped else "")
                               + " and every column: the report)"), highlight=False)
    for line in conclusions(study, analysis, scaling=False):
        console.print(f"- {console_text(line)}", highlight=False)


def markdown(study: StudyRecord, analysis: Analysis, wall_time: float | None) -> str:
    """The markdown report."""
    config, env, info = study.config, study.env, study.dataset
    target = config["target"]
    header, rows = table_rows(study)
    epoch_cap = (f" or {config['max_epochs']} epochs, whichever is fewer"
                 if config.get("max_epochs") else "")
    lines = [
        f"# Batch-size x optimizer study: {markdown_text(config['model'])} on "
        f"{markdown_text(info['name'])}",
        "",
        f"Question: which batch size and optimizer reach {target['metric']} "
        f"{'>=' if metric_direction(target['metric']) == 'max' else '<='} {target['value']:g} "
        "in the least training "
        "time (evaluation and compilation excluded) on this machine?",
        "",
        f"- backend: {env['backend']}, engine: {config['engine']}, device: "
        f"{markdown_text(env['device'])}",
        f"- data: {info['num_train']} train / {info['num_val']} validation / "
        f"{info['num_test']} test",
        f"- grid: optimizers {', '.join(config['optimizers'])}; batch sizes "
        f"{', '.join(map(str, study.batch_sizes))}; {config['lr_grid_size']} learning rates per "
        f"cell (extended by up to {config.get('lr_extend', 0)} each way); budget "
        f"{config['max_steps']} steps per run{epoch_cap}; {config.get('seeds', 1)} seed(s) from "
        f"{config['seed']}",
        f"- versions: {', '.join(f'{k} {v}' for k, v in sorted(env['versions'].items()))}",
    ]
    if wall_time is not None:
        lines.append(f"- wall time of this invocation: {wall_time:.1f} s")
    lines += ["", "## Cells (best learning rate of each)", "",
              markdown_rows(header, rows).rstrip("\n")]
    seeds = config.get("seeds", 1)
    lines += ["", f"Each figure is the median over {seeds} seed(s) of the cell's best learning "
              "rate "
              "(the rate with the best median steps to target), with [smallest, largest] over the "
              "seeds; \"never\": a seed that did not reach the target. \"reached (k/N)\": k of N "
              "seeds reached it; a cell reaches when its median seed does. Time to target = "
              "median steps x the cell's steady seconds per step measured apart (see Caveats); "
              "evaluation and start-up are excluded. \"(edge)\": the best rate is on an end of "
              "the cell's grid, \"at the bound\": after the grid was extended as far as "
              f"--lr-extend ({config.get('lr_extend', 0)}) allows. Start-up is listed apart "
              "(\"~\": estimated from the first evaluation interval against the later ones).",
              "", "## Findings", ""]
    lines += [f"- {markdown_text(line)}" for line in conclusions(study, analysis)]
    lines += auto_section(study)
    lines += profile_section(study)
    lines += ["", *sources_section(study, analysis), "", *frontier_section(study, analysis),
              *caveats_section(study, analysis)]
    lines += ["", "## Plots", ""]
    lines += [f"![{name}](plots/{name})" for name in PLOTS]
    return "\n".join(lines) + "\n"


def auto_section(study: StudyRecord) -> list[str]:
    """The auto cells' part of the markdown report: what they are and each seed's ranges."""
    autos = study.auto_cells
    if not autos:
        return []
    bounds = autos[0].auto or {}
    lines = ["", "## Adaptive batch size (auto)", "",
             f"Each optimizer's auto cell grows its batch with the measured gradient noise scale "
             f"(`--batch-size auto:{bounds.get('min')}:{bounds.get('max')}`, learning-rate "
             f"scaling {bounds.get('lr_scaling')}), bounded by the study's smallest and largest "
             "fixed batch size, so the comparison stays within the same sizes. Its base rate (the "
             "rate at MIN) is searched like any cell's, with the same seeds; it is compared with "
             "the optimizer's fixed cell of least time to target (Findings). Samples to target: "
             "each step range's steps x its batch size up to the target step. Time to target: "
             f"{AUTO_TIME_MODEL} (interpolated in log-log between the grid's sizes), the fixed "
             "cells' model; it leaves out the estimator's measured steps (about 1.2-1.45x per "
             "step, docs/adaptive.md) and the compilation at each new size, which the runs' own "
             "clocks hold (median: " + ", ".join(
                 f"{c.optimizer} {format_value(c.time_to_target_runs, '.3g')} s"
                 for c in autos) + ").", ""]
    for cell in autos:
        seeds = cell.ranges or {}
        for seed, ranges in sorted(seeds.items(), key=lambda kv: int(kv[0])):
            steps = ", ".join(f"from step {r['step']}: {r['batch_size']}" for r in ranges)
            rate = format_value(cell.learning_rate)
            lines.append(f"- {cell.optimizer} (lr {rate}), seed {seed}: "
                         f"{steps or 'no ranges recorded'}")
    return lines


def write_report(study: StudyRecord, analysis: Analysis, out_dir: str | Path,
                 wall_time: float | None = None) -> dict[str, Path]:
    """Write report.md, summary.json and the plots under ``out_dir``; return their paths."""
    out = Path(out_dir)
    summary, report = write_json_and_markdown(
        out / "summary.json", summary_payload(study, analysis, wall_time),
        out / "report.md", markdown(study, analysis, wall_time))
    return {"report": report, "summary": summary, **write_plots(study, analysis, out / "plots")}


def summary_payload(study: StudyRecord, analysis: Analysis,
                    wall_time: float | None) -> JsonObject:
    """The study without its trajectories, plus the analysis: what ``study compare`` reads. The
    one place the analysis becomes JSON (``Analysis.to_json``)."""
    runs = [{"key": r.key, "config": {k: r.config.get(k) for k in (
                 "batch_size", "learning_rate", "seed", "max_steps", "eval_every",
                 "fused_steps")},
             "optimizer": r.config["optimizer"]["name"], "result": r.result}
            for r in study.runs]
    load, spent = study.machine_load, study.time_spent
    return {"study": study.study_id, "config": study.config, "env": study.env,
            "dataset": study.dataset, "batch_sizes": list(study.batch_sizes),
            "cells": [c.to_json() for c in study.cells], "runs": runs,
            "noise": None if study.noise is None else study.noise.to_json(),
            "step_times": None if study.step_times is None else study.step_times.to_json(),
            "machine_load": None if load is None else load.to_json(),
            "time_spent": None if spent is None else spent.to_json(),
            "added_seeds": None if study.added_seeds is None else study.added_seeds.to_json(),
            **({"auto_cells": [c.to_json() for c in study.auto_cells]} if study.auto_cells
               else {}),
            **({"device_profile": study.device_profile} if study.device_profile
               else {}),
            "analysis": analysis.to_json(), "wall_time": wall_time}
