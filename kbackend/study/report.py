"""A study's report: a table in the terminal (rich), a markdown report, a JSON summary and PNG
plots (matplotlib, Agg backend). Every file is written atomically."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kbackend.hardware.knee import DEFAULT_MIN_GAIN
from kbackend.io import atomic_write
from kbackend.reports import markdown_rows, write_json_and_markdown

PLOTS = ("loss_trajectories.png", "steps_to_target.png", "time_to_target.png",
         "throughput.png", "noise_scale.png")
REGION_COLOURS = {"perfect scaling": "#2ca02c", "diminishing returns": "#ff7f0e",
                  "saturation": "#d62728"}


def _fmt(value: Any, spec: str = ".3g", missing: str = "-") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return missing
    return format(value, spec)


def _interval(cell: dict[str, Any], name: str, spec: str) -> str:
    """``median [low, high]`` of one of a cell's figures (``not reached`` for an infinite end)."""
    interval = (cell.get("intervals") or {}).get(name)
    if not interval or not interval.get("n"):
        return _fmt(cell.get(name), spec)
    if interval["n"] == 1:
        return _fmt(interval["median"], spec, missing="-")
    ends = [_fmt(interval[end], spec, missing="never") for end in ("low", "high")]
    return f"{_fmt(interval['median'], spec, missing='never')} [{ends[0]}, {ends[1]}]"


def edge_label(cell: dict[str, Any]) -> str:
    """Where the cell's best learning rate sits in its (extended) grid, if on an end."""
    if not cell.get("lr_at_grid_edge"):
        return ""
    return " (edge, at the bound)" if cell.get("lr_at_bound") else " (edge)"


def table_rows(study: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-cell table (terminal and markdown)."""
    metric = study["config"]["target"]["metric"]
    header = ["optimizer", "batch", "best lr", "reached", "steps", "epochs", "samples",
              "time to target (s)", f"best {metric}", "test acc", "samples/s", "start-up (s)"]
    rows = []
    for c in study["cells"]:
        seeds = c.get("seeds", 1)
        reached = "yes" if c["reached"] else "NOT REACHED"
        if seeds > 1:
            reached += f" ({c.get('seeds_reached', 0)}/{seeds})"
        rows.append([
            c["optimizer"], str(c["batch_size"]), _fmt(c["learning_rate"]) + edge_label(c), reached,
            _interval(c, "steps_to_target", ".0f"), _fmt(c["epochs_to_target"], ".2f"),
            _fmt(c["samples_to_target"], ".0f"), _interval(c, "time_to_target", ".2f"),
            _interval(c, "best_metric", ".4f"), _interval(c, "test_accuracy", ".4f"),
            _fmt(c["samples_per_s"], ",.0f"),
            _fmt(c.get("startup_time"), ".2f") + ("~" if c.get("startup_time_estimated") else ""),
        ])
    return header, rows


def conclusions(study: dict[str, Any], analysis: dict[str, Any]) -> list[str]:
    """One line per finding, for the terminal and the markdown report."""
    target = study["config"]["target"]
    lines = []
    best = analysis["best"]
    if best:
        lines.append(
            f"Fastest to {target['metric']} {target['value']:g}: {best['optimizer']} at batch "
            f"{best['batch_size']} (lr {best['learning_rate']:g}), {best['time_to_target']:.2f} s "
            f"of training, {best['steps_to_target']} steps.")
    else:
        lines.append(f"No cell reached {target['metric']} {target['value']:g} within its budget.")
    for optimizer, info in analysis["per_optimizer"].items():
        knee = info["knee"]
        knee_text = f"B_crit ~ {knee['b_crit']:.0f} (S_min ~ {knee['s_min']:.0f} steps)" \
            if knee.get("b_crit") else knee.get("note", "")
        regions = ", ".join(f"{s['from']}->{s['to']}: {s['region']} (k={s['exponent']:.2f})"
                            for s in info["regions"])
        missing = f"; not reached at {info['not_reached']}" if info["not_reached"] else ""
        lines.append(f"{optimizer}: {knee_text}. {regions or 'too few reached cells for regions'}{missing}.")
    if analysis["throughput_knee"] is not None:
        plateau = "" if analysis.get("throughput_plateau_reached", True) else \
            "; no plateau yet: larger batches may still gain"
        lines.append(f"Throughput knee (next doubling gains < {DEFAULT_MIN_GAIN:.0%} samples/s): "
                     f"batch {analysis['throughput_knee']}{plateau}.")
    noise = study.get("noise")
    if noise:
        lines.append(
            f"Gradient noise scale B_simple ~ {_fmt(analysis['b_simple'], '.0f')} over training "
            f"({noise['optimizer']}, batch {noise['batch_size']}; per point: "
            + ", ".join(f"step {p['step']}: {_fmt(p['b_simple'], '.0f')}" for p in noise["points"])
            + ").")
    for x in analysis["crossovers"]:
        lines.append(f"{x['challenger']} vs {x['incumbent']}: {x['note']}.")
    return lines


def print_table(study: dict[str, Any], analysis: dict[str, Any], console: Any = None) -> None:
    """The per-cell table and the conclusions, printed with rich."""
    console = console or Console()
    target = study["config"]["target"]
    header, rows = table_rows(study)
    table = Table(title=f"{study['config']['model']} on {study['dataset']['name']}: time to "
                        f"{target['metric']} {target['value']:g} ({study['env']['backend']}, "
                        f"{study['config']['engine']} engine)")
    for name in header:
        table.add_column(name, justify="left" if name in ("optimizer", "reached") else "right")
    for row in rows:
        table.add_row(*row, style=None if row[3].startswith("yes") else "dim")
    console.print(table)
    for line in conclusions(study, analysis):
        console.print(f"- {line}", highlight=False)


def markdown(study: dict[str, Any], analysis: dict[str, Any], wall_time: float | None) -> str:
    """The markdown report."""
    config, env, info = study["config"], study["env"], study["dataset"]
    target = config["target"]
    header, rows = table_rows(study)
    lines = [
        f"# Batch-size x optimizer study: {config['model']} on {info['name']}",
        "",
        f"Question: which batch size and optimizer reach {target['metric']} "
        f"{'>=' if 'acc' in target['metric'] else '<='} {target['value']:g} in the least training "
        "time (evaluation and compilation excluded) on this machine?",
        "",
        f"- backend: {env['backend']}, engine: {config['engine']}, device: {env['device']}",
        f"- data: {info['num_train']} train / {info['num_val']} validation / {info['num_test']} test",
        f"- grid: optimizers {', '.join(config['optimizers'])}; batch sizes "
        f"{', '.join(map(str, study['batch_sizes']))}; {config['lr_grid_size']} learning rates per "
        f"cell; budget {config['max_steps']} steps per run; seed {config['seed']}",
        f"- versions: {', '.join(f'{k} {v}' for k, v in sorted(env['versions'].items()))}",
    ]
    if wall_time is not None:
        lines.append(f"- wall time of this invocation: {wall_time:.1f} s")
    lines += ["", "## Cells (best learning rate of each)", "", markdown_rows(header, rows).rstrip("\n")]
    lines += ["", "\"(edge)\": the best rate is at the edge of the cell's grid; a wider grid may do "
              "better. Time to target counts training time only: evaluation and the per-run start-up "
              "(compilation, first-call overhead) are excluded; start-up is listed apart "
              "(\"~\": estimated from the first evaluation interval against the later ones, "
              "when that exceeds the compile time the engine reports).",
              "", "## Findings", ""]
    lines += [f"- {line}" for line in conclusions(study, analysis)]
    lines += ["", "## Plots", ""]
    lines += [f"![{name}](plots/{name})" for name in PLOTS]
    return "\n".join(lines) + "\n"


def write_report(study: dict[str, Any], analysis: dict[str, Any], out_dir: str | Path,
                 wall_time: float | None = None) -> dict[str, Path]:
    """Write report.md, summary.json and the plots under ``out_dir``; return their paths."""
    out = Path(out_dir)
    summary, report = write_json_and_markdown(out / "summary.json", summary_payload(study, analysis, wall_time),
                                              out / "report.md", markdown(study, analysis, wall_time))
    paths = {"report": report, "summary": summary}
    for name, path in write_plots(study, analysis, out / "plots").items():
        paths[name] = path
    return paths


def summary_payload(study: dict[str, Any], analysis: dict[str, Any],
                    wall_time: float | None) -> dict[str, Any]:
    """The study without its trajectories, plus the analysis: what ``study compare`` reads."""
    runs = [{"key": r["key"], "config": {k: r["config"][k] for k in ("batch_size", "learning_rate",
                                                                     "max_steps", "eval_every")},
             "optimizer": r["config"]["optimizer"]["name"], "result": r["result"]}
            for r in study["runs"]]
    return {"study": study["study"], "config": study["config"], "env": study["env"],
            "dataset": study["dataset"], "batch_sizes": study["batch_sizes"],
            "cells": study["cells"], "runs": runs, "noise": study["noise"],
            "analysis": analysis, "wall_time": wall_time}


# -- plots -----------------------------------------------------------------------------------

def _pyplot() -> Any:
    import matplotlib  # deferred: heavy, and needed only for the plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred (as above), after choosing the Agg backend

    return plt


def _save(fig: Any, path: Path) -> Path:
    plt = _pyplot()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight"))
    plt.close(fig)
    return path


def _smooth(values: np.ndarray) -> np.ndarray:
    """A centred moving average over ~2% of the run (per-step losses at small batches are noisy)."""
    window = max(1, len(values) // 50)
    if window == 1:
        return values
    kernel = np.ones(window) / window
    padded = np.pad(values, (window // 2, window - 1 - window // 2), mode="edge")
    return np.convolve(padded, kernel, mode="valid")


def write_plots(study: dict[str, Any], analysis: dict[str, Any], out: Path) -> dict[str, Path]:
    """Every plot of the report, as PNG files under ``out``."""
    return {
        "loss_trajectories.png": _plot_trajectories(study, out / "loss_trajectories.png"),
        "steps_to_target.png": _plot_steps(study, analysis, out / "steps_to_target.png"),
        "time_to_target.png": _plot_time(study, out / "time_to_target.png"),
        "throughput.png": _plot_throughput(analysis, out / "throughput.png"),
        "noise_scale.png": _plot_noise(study, analysis, out / "noise_scale.png"),
    }


def _batch_ticks(ax: Any, sizes: list[int]) -> None:
    """Label a log batch-size axis with the batch sizes themselves."""
    from matplotlib.ticker import NullFormatter, NullLocator  # deferred: heavy, plots only

    if sizes:
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(sizes, [str(s) for s in sizes])


def _optimizers(study: dict[str, Any]) -> list[str]:
    return list(study["config"]["optimizers"])


def _plot_trajectories(study: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    optimizers = _optimizers(study)
    runs = {r["key"]: r for r in study["runs"]}
    colours = plt.get_cmap("viridis")(np.linspace(0, 0.9, len(study["batch_sizes"])))
    colour = dict(zip(study["batch_sizes"], colours, strict=True))
    metric = study["config"]["target"]["metric"]
    fig, axes = plt.subplots(3, len(optimizers), figsize=(4.2 * len(optimizers), 10), squeeze=False)
    for column, optimizer in enumerate(optimizers):
        for cell in (c for c in study["cells"] if c["optimizer"] == optimizer):
            trajectory = (runs.get(cell["run_key"]) or {}).get("trajectory")
            if not trajectory or not trajectory["step"]:
                continue
            steps = np.asarray(trajectory["step"])
            loss = _smooth(np.asarray(trajectory["loss"], dtype=float))
            label = f"B={cell['batch_size']}" + ("" if cell["reached"] else " (not reached)")
            style = "-" if cell["reached"] else ":"
            axes[0, column].plot(steps, loss, style, color=colour[cell["batch_size"]], label=label)
            # Wall time after the run's start-up (compilation), as time to target counts it.
            startup = cell.get("startup_time") or 0.0
            times = np.maximum(np.asarray(trajectory["time"], dtype=float) - startup, 0.0)
            axes[1, column].plot(times, loss, style, color=colour[cell["batch_size"]])
            evals = [e for e in trajectory["evals"] if metric in e]
            axes[2, column].plot([max(e["train_time"] - startup, 0.0) for e in evals],
                                 [e[metric] for e in evals], style, marker=".",
                                 color=colour[cell["batch_size"]])
        axes[0, column].set_title(optimizer)
        axes[0, column].set(xscale="log", yscale="log", xlabel="step", ylabel="train loss (smoothed)")
        axes[1, column].set(yscale="log", xlabel="training time after start-up (s)",
                            ylabel="train loss (smoothed)")
        axes[2, column].set(xlabel="training time after start-up (s)", ylabel=f"validation {metric}")
        axes[2, column].axhline(study["config"]["target"]["value"], color="grey", ls="--", lw=1)
        axes[0, column].legend(fontsize=7)
    fig.suptitle("Trajectories of each cell's best learning rate")
    return _save(fig, path)


def _plot_steps(study: dict[str, Any], analysis: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    optimizers = _optimizers(study)
    fig, axes = plt.subplots(1, len(optimizers), figsize=(4.5 * len(optimizers), 4), squeeze=False)
    b_simple = analysis.get("b_simple")
    for ax, optimizer in zip(axes[0], optimizers, strict=True):
        info = analysis["per_optimizer"][optimizer]
        for segment in info["regions"]:
            ax.axvspan(segment["from"], segment["to"], color=REGION_COLOURS[segment["region"]],
                       alpha=0.15, lw=0)
        points = [p for p in info["steps_to_target"] if p["reached"]]
        if points:
            sizes = np.array([p["batch_size"] for p in points], dtype=float)
            steps = np.array([p["steps"] for p in points], dtype=float)
            ax.plot(sizes, steps, "o-", color="k", label="steps to target")
            ax.plot(sizes, steps[0] * sizes[0] / sizes, ":", color="grey", label="perfect scaling")
            knee = info["knee"]
            if knee.get("b_crit"):
                grid = np.geomspace(sizes.min(), sizes.max(), 50)
                ax.plot(grid, knee["s_min"] * (1 + knee["b_crit"] / grid), "--", color="C0",
                        label=f"fit, B_crit={knee['b_crit']:.0f}")
                ax.axvline(knee["b_crit"], color="C0", lw=1)
        missed = [c for c in study["cells"] if c["optimizer"] == optimizer and not c["reached"]]
        if missed:  # not reached: at least the steps run (the budget), drawn as open markers
            ax.plot([c["batch_size"] for c in missed], [max(c["steps_run"], 1) for c in missed],
                    "^", mfc="none", color="red", label="not reached (steps run)")
        if b_simple and math.isfinite(b_simple) and b_simple > 0:
            ax.axvline(b_simple, color="purple", lw=1, label=f"B_simple={b_simple:.0f}")
        ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="steps to target",
               title=optimizer)
        _batch_ticks(ax, study["batch_sizes"])
        ax.legend(fontsize=7)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, alpha=0.3) for c in REGION_COLOURS.values()]
    fig.legend(handles, list(REGION_COLOURS), loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return _save(fig, path)


def _plot_time(study: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for optimizer in _optimizers(study):
        cells = [c for c in study["cells"] if c["optimizer"] == optimizer and c["reached"]]
        if cells:
            ax.plot([c["batch_size"] for c in cells], [c["time_to_target"] for c in cells], "o-",
                    label=optimizer)
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="training time to target (s)",
           title="Time to target (missing points: not reached)")
    _batch_ticks(ax, study["batch_sizes"])
    ax.legend()
    return _save(fig, path)


def _plot_throughput(analysis: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    curve = analysis["throughput"]
    if curve:
        ax.plot([p["batch_size"] for p in curve], [p["samples_per_s"] for p in curve], "o-")
    if analysis["throughput_knee"]:
        ax.axvline(analysis["throughput_knee"], color="C1", ls="--",
                   label=f"knee (next doubling < {DEFAULT_MIN_GAIN:.0%}): {analysis['throughput_knee']}")
        ax.legend()
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="samples/s (median over runs)",
           title="Training throughput")
    _batch_ticks(ax, [p["batch_size"] for p in curve])
    return _save(fig, path)


def _plot_noise(study: dict[str, Any], analysis: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    noise = study.get("noise")
    if noise:
        points = [p for p in noise["points"] if math.isfinite(p["b_simple"]) and p["b_simple"] > 0]
        steps = [max(p["step"], 1) for p in points]
        values = [p["b_simple"] for p in points]
        errors = [p["b_simple"] * math.sqrt((p["trace_sigma_se"] / p["trace_sigma"]) ** 2
                                            + (p["grad_sq_se"] / p["grad_sq"]) ** 2)
                  if p["trace_sigma"] > 0 and math.isfinite(p["trace_sigma_se"]) else 0.0
                  for p in points]
        ax.errorbar(steps, values, yerr=[np.minimum(errors, np.array(values) * 0.99), errors],
                    fmt="o-", capsize=3, label=f"B_simple ({noise['optimizer']}, B={noise['batch_size']})")
    for index, (optimizer, info) in enumerate(analysis["per_optimizer"].items()):
        if info["knee"].get("b_crit"):
            ax.axhline(info["knee"]["b_crit"], color=f"C{index + 1}", ls="--",
                       label=f"measured knee B_crit ({optimizer})")
    ax.set(xscale="symlog", yscale="log", xlabel="training step",
           ylabel="batch size", title="Gradient noise scale vs measured knee")
    ax.legend(fontsize=7)
    return _save(fig, path)
