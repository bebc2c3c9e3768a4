"""The study's PNG plots: loss trajectories, steps and time to target per batch size (with the
scaling regions), throughput, the noise scale and the frontier (``write_plots``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kbackend.escaping import plot_text
from kbackend.hardware.knee import DEFAULT_MIN_GAIN
from kbackend.io import atomic_write
from kbackend.study.analysis import Analysis
from kbackend.study.study_record import Cell, StudyRecord
from kbackend.task import metric_direction

PLOTS = ("loss_trajectories.png", "steps_to_target.png", "time_to_target.png",
         "throughput.png", "noise_scale.png", "frontier.png")
REGION_COLOURS = {"perfect scaling": "#2ca02c", "diminishing returns": "#ff7f0e",
                  "saturation": "#d62728"}


def pareto_cells(study: StudyRecord) -> set[tuple[str, int]]:
    """The cells no other cell beats on both time to target and best validation value (medians;
    a cell that never reached the target has no time and is never on it)."""
    metric = study.target["metric"]
    sign = 1.0 if metric_direction(metric) == "max" else -1.0
    points = [((c.optimizer, c.size), c.seconds,
               sign * c.frontier.best_metric["median"])
              for c in study.cells if c.frontier and c.time_to_target
              and c.frontier.best_metric.get("n")]
    return {key for key, t, m in points
            if not any(t2 <= t and m2 >= m and (t2 < t or m2 > m) for _, t2, m2 in points)}


def _pyplot() -> Any:
    import matplotlib  # deferred: heavy, and needed only for the plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred (as above), after choosing the Agg backend

    return plt


def _save(fig: Any, path: Path, legend: Any = None, fontsize: float | None = 7) -> Path:
    """``fig`` as a PNG at ``path``; ``legend``: an axes given a legend if it has labels."""
    if legend is not None and legend.get_legend_handles_labels()[0]:
        legend.legend(fontsize=fontsize)
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


PLOT_POINTS = 400  # points per drawn trajectory: a 6-inch axis at 110 dpi has ~660 pixels


def _thin(*columns: np.ndarray) -> list[np.ndarray]:
    """Every k-th point (and the last) of equally long columns, at most ``PLOT_POINTS`` of them:
    drawing thousands of per-step points per line cost most of the report's time and shows
    nothing more at this size (the losses are smoothed first)."""
    n = len(columns[0])
    if n <= PLOT_POINTS:
        return list(columns)
    index = np.unique(np.append(np.arange(0, n, -(-n // PLOT_POINTS)), n - 1))
    return [np.asarray(c)[index] for c in columns]


def write_plots(study: StudyRecord, analysis: Analysis, out: Path) -> dict[str, Path]:
    """Every plot of the report, as PNG files under ``out``."""
    return {
        "loss_trajectories.png": _plot_trajectories(study, out / "loss_trajectories.png"),
        "steps_to_target.png": _plot_steps(study, analysis, out / "steps_to_target.png"),
        "time_to_target.png": _plot_time(study, out / "time_to_target.png"),
        "throughput.png": _plot_throughput(study, analysis, out / "throughput.png"),
        "noise_scale.png": _plot_noise(study, analysis, out / "noise_scale.png"),
        "frontier.png": _plot_frontier(study, out / "frontier.png"),
    }


def _plot_frontier(study: StudyRecord, path: Path) -> Path:
    """Best validation value within the equal budget against time to target, per cell (median
    and [min, max] both ways), labelled by batch size; the frontier's cells joined."""
    plt = _pyplot()
    colours = optimizer_colours(study)
    metric = study.target["metric"]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    front = pareto_cells(study)
    points = []
    for optimizer in study.config["optimizers"]:
        cells = [c for c in study.cells if c.optimizer == optimizer and c.frontier
                 and c.time_to_target and c.frontier.best_metric.get("n")]
        if not cells:
            continue
        times, time_bars = _error_bars([_interval(c, "time_to_target", c.seconds)
                                        for c in cells])
        best, best_bars = _error_bars([c.frontier.best_metric for c in cells if c.frontier])
        ax.errorbar(times, best, xerr=time_bars, yerr=best_bars, fmt="o", capsize=2,
                    color=colours[optimizer], label=optimizer)
        for cell, t, m in zip(cells, times, best, strict=True):
            ax.annotate(str(cell.batch_size), (t, m), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
            if (cell.optimizer, cell.batch_size) in front:
                points.append((t, m))
    if points:
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], "-", color="grey", lw=1,
                label="frontier (medians)")
    _target_line(ax, study)
    epochs = study.config.get("frontier_epochs")
    ax.set(xscale="log", xlabel="time to target (s): steps x step time",
           ylabel=f"best {plot_text(metric)} within {epochs} epochs",
           title="Time to target vs the best each cell reaches (labels: batch size)")
    return _save(fig, path, legend=ax)


def _batch_ticks(ax: Any, sizes: Sequence[int]) -> None:
    """Label a log batch-size axis with the batch sizes themselves."""
    from matplotlib.ticker import NullFormatter, NullLocator  # deferred: heavy, plots only

    if sizes:
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(sizes, [str(s) for s in sizes])


def optimizer_colours(study: StudyRecord) -> dict[str, str]:
    """One colour per optimizer, the same in every plot."""
    return {name: f"C{index % 10}" for index, name in enumerate(study.config["optimizers"])}


def _target_line(ax: Any, study: StudyRecord) -> None:
    target = study.target
    ax.axhline(target["value"], color="grey", ls="--", lw=1,
               label=f"target {plot_text(target['metric'])} {target['value']:g}")


def _interval(cell: Cell, name: str, median: float) -> dict[str, float]:
    """The cell's interval of figure ``name``, else ``median`` as a zero-width one."""
    return (cell.intervals or {}).get(name) or {"median": median, "low": median, "high": median}


def _error_bars(values: list[dict[str, float]]) -> tuple[np.ndarray, np.ndarray]:
    """Medians and (below, above) distances to the interval ends (open ends drawn to the median)."""
    medians = np.array([v["median"] for v in values], dtype=float)
    lows = np.array([v["low"] if math.isfinite(v["low"]) else v["median"] for v in values])
    highs = np.array([v["high"] if math.isfinite(v["high"]) else v["median"] for v in values])
    return medians, np.vstack([np.maximum(medians - lows, 0), np.maximum(highs - medians, 0)])


def _plot_trajectories(study: StudyRecord, path: Path) -> Path:
    plt = _pyplot()
    optimizers = study.config["optimizers"]
    colours = optimizer_colours(study)
    runs = {r.key: r for r in study.runs}
    # The optimizer's colour, lighter for smaller batches.
    shade = dict(zip(study.batch_sizes, np.linspace(0.35, 1.0, len(study.batch_sizes)),
                     strict=True))
    metric = study.target["metric"]
    fig, axes = plt.subplots(3, len(optimizers), figsize=(4.2 * len(optimizers), 10), squeeze=False)
    for column, optimizer in enumerate(optimizers):
        colour = colours[optimizer]
        for cell in (c for c in study.cells if c.optimizer == optimizer):
            run = runs.get(cell.run_key)
            trajectory = run.trajectory if run is not None else None
            if not trajectory or not trajectory["step"]:
                continue
            alpha = float(shade[cell.size])
            startup = cell.startup_time or 0.0
            steps, loss, times = _thin(
                np.asarray(trajectory["step"]),
                _smooth(np.asarray(trajectory["loss"], dtype=float)),
                np.maximum(np.asarray(trajectory["time"], dtype=float) - startup, 0.0))
            label = f"B={cell.batch_size}" + ("" if cell.reached else " (not reached)")
            style = "-" if cell.reached else ":"
            axes[0, column].plot(steps, loss, style, color=colour, alpha=alpha, label=label)
            # Wall time after the run's start-up (compilation), as time to target counts it.
            axes[1, column].plot(times, loss, style, color=colour, alpha=alpha)
            evals = [e for e in trajectory["evals"] if metric in e]
            axes[2, column].plot([max(e["train_time"] - startup, 0.0) for e in evals],
                                 [e[metric] for e in evals], style, marker=".", color=colour,
                                 alpha=alpha)
        axes[0, column].set_title(f"{optimizer} (the median seed of each cell)")
        axes[0, column].set(xscale="log", yscale="log", xlabel="step",
                            ylabel="train loss (smoothed)")
        axes[1, column].set(yscale="log", xlabel="training time after start-up (s)",
                            ylabel="train loss (smoothed)")
        axes[2, column].set(xlabel="training time after start-up (s)",
                            ylabel=f"validation {plot_text(metric)}")
        _target_line(axes[2, column], study)
        axes[2, column].legend(fontsize=7)
        axes[0, column].legend(fontsize=7)
    fig.suptitle("Trajectories of each cell's best learning rate")
    return _save(fig, path)


def _plot_steps(study: StudyRecord, analysis: Analysis, path: Path) -> Path:
    plt = _pyplot()
    optimizers = study.config["optimizers"]
    colours = optimizer_colours(study)
    fig, axes = plt.subplots(1, len(optimizers), figsize=(4.5 * len(optimizers), 4), squeeze=False)
    b_simple = analysis.b_simple
    for ax, optimizer in zip(axes[0], optimizers, strict=True):
        info = analysis.per_optimizer[optimizer]
        for segment in info.regions:
            ax.axvspan(segment.low, segment.high, color=REGION_COLOURS[segment.region],
                       alpha=0.15, lw=0)
        reached = [c for c in study.cells if c.optimizer == optimizer and c.reached]
        if reached:
            sizes = np.array([c.batch_size for c in reached], dtype=float)
            steps, bars = _error_bars([_interval(c, "steps_to_target", c.steps)
                                       for c in reached])
            ax.errorbar(sizes, steps, yerr=bars, fmt="o-", capsize=3, color=colours[optimizer],
                        label="steps to target (median, [min, max] over seeds)")
            ax.plot(sizes, steps[0] * sizes[0] / sizes, ":", color="grey", label="perfect scaling")
            fit = info.knee
            if fit.b_crit and fit.s_min is not None:
                grid = np.geomspace(sizes.min(), sizes.max(), 50)
                ax.plot(grid, fit.s_min * (1 + fit.b_crit / grid), "--", color="k", lw=1,
                        label=f"fit, B_crit={fit.b_crit:.0f}")
                ax.axvline(fit.b_crit, color="k", lw=1)
        missed = [c for c in study.cells if c.optimizer == optimizer and not c.reached]
        if missed:  # not reached: at least the steps run (the budget), drawn as open markers
            ax.plot([c.batch_size for c in missed],
                    [max(c.steps_run or 1, 1) for c in missed],
                    "^", mfc="none", color=colours[optimizer], label="not reached (steps run)")
        if b_simple and math.isfinite(b_simple) and b_simple > 0:
            ax.axvline(b_simple, color="purple", lw=1, label=f"B_simple={b_simple:.0f}")
        _auto_line(ax, study, optimizer, "steps_to_target", colours[optimizer], "steps")
        ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="steps to target",
               title=optimizer)
        _batch_ticks(ax, study.batch_sizes)
        ax.legend(fontsize=7)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, alpha=0.3) for c in REGION_COLOURS.values()]
    fig.legend(handles, list(REGION_COLOURS), loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return _save(fig, path)


def _plot_time(study: StudyRecord, path: Path) -> Path:
    plt = _pyplot()
    colours = optimizer_colours(study)
    fig, ax = plt.subplots(figsize=(6, 4))
    for optimizer in study.config["optimizers"]:
        cells = [c for c in study.cells if c.optimizer == optimizer and c.reached]
        if cells:
            times, bars = _error_bars([_interval(c, "time_to_target", c.seconds) for c in cells])
            ax.errorbar([c.batch_size for c in cells], times, yerr=bars, fmt="o-", capsize=3,
                        color=colours[optimizer], label=optimizer)
        _auto_line(ax, study, optimizer, "time_to_target", colours[optimizer], "s")
    ax.set(xscale="log", yscale="log", xlabel="batch size",
           ylabel="time to target (s): steps x step time",
           title="Time to target, median and [min, max] (missing: not reached)")
    _batch_ticks(ax, study.batch_sizes)
    return _save(fig, path, legend=ax, fontsize=None)  # none: no cell reached


def _auto_line(ax: Any, study: StudyRecord, optimizer: str, name: str, colour: str,
               unit: str) -> None:
    """The optimizer's auto cell (adaptive batch size) as a dashed level across the batch
    sizes it spans, its [min, max] over seeds shaded: it has no single batch size."""
    for cell in study.auto_cells:
        value = getattr(cell, name)
        if cell.optimizer != optimizer or not cell.reached or not value:
            continue
        bounds = cell.auto or {}
        low, high = bounds.get("min"), bounds.get("max")
        interval = (cell.intervals or {}).get(name) or {}
        ends = [interval.get("low"), interval.get("high")]
        if all(e is not None and math.isfinite(e) for e in ends):
            ax.fill_between([low, high], [ends[0]] * 2, [ends[1]] * 2, color=colour, alpha=0.12,
                            lw=0)
        ax.plot([low, high], [value, value], "--", color=colour,
                label=f"{optimizer} auto {low}-{high}: {value:.3g} {unit}")


def _plot_throughput(study: StudyRecord, analysis: Analysis, path: Path) -> Path:
    plt = _pyplot()
    colours = optimizer_colours(study)
    fig, ax = plt.subplots(figsize=(6, 4))
    timed = study.step_times.cells if study.step_times else ()
    for optimizer in study.config["optimizers"]:
        cells = sorted((c for c in timed if c.optimizer == optimizer), key=lambda c: c.batch_size)
        if not cells:
            continue
        sizes = np.array([c.batch_size for c in cells], dtype=float)
        per_step = [c.seconds_per_step for c in cells]
        ax.plot(sizes, sizes / np.array([p["median"] for p in per_step]), "o-",
                color=colours[optimizer], label=optimizer)
        ax.fill_between(sizes, sizes / np.array([p["high"] for p in per_step]),
                        sizes / np.array([p["low"] for p in per_step]),
                        color=colours[optimizer], alpha=0.2, lw=0)
    curve = analysis.throughput
    if not timed and curve:  # no timings apart: the runs' own clocks
        ax.plot([p.batch_size for p in curve], [p.samples_per_s for p in curve], "o-",
                color="k", label="median over runs (run clocks)")
    if analysis.throughput_knee:
        ax.axvline(analysis.throughput_knee, color="grey", ls="--",
                   label=f"knee (next doubling < {DEFAULT_MIN_GAIN:.0%}): "
                         f"{analysis.throughput_knee}")
    ax.set(xscale="log", yscale="log", xlabel="batch size",
           ylabel="samples/s (median, band: [min, max])", title="Training throughput")
    _batch_ticks(ax, [p.batch_size for p in curve])
    return _save(fig, path, legend=ax)


def _plot_noise(study: StudyRecord, analysis: Analysis, path: Path) -> Path:
    """B_simple at each measurement point: steps on a linear axis from 0 (no symlog, so no
    ticks at negative steps and step 0 drawn at 0), every point inside the axes; points whose
    estimate is not positive are marked "not estimated" along the bottom, never plotted as
    values."""
    plt = _pyplot()
    colours = optimizer_colours(study)
    fig, ax = plt.subplots(figsize=(6, 4))
    noise = study.noise
    estimated_values: list[float] = []
    if noise:
        colour = colours.get(noise.optimizer, "k")
        points = [p for p in noise.points
                  if math.isfinite(p.b_simple) and p.b_simple > 0 and p.grad_sq > 0]
        missing = [p for p in noise.points if p not in points]
        if points:
            values = np.array([p.b_simple for p in points])
            estimated_values = list(values)
            errors = np.array([p.b_simple * math.sqrt(
                (p.trace_sigma_se / p.trace_sigma) ** 2 + (p.grad_sq_se / p.grad_sq) ** 2)
                               if p.trace_sigma > 0 and math.isfinite(p.trace_sigma_se)
                               and math.isfinite(p.grad_sq_se) else 0.0 for p in points])
            ax.errorbar([p.step for p in points], values,
                        yerr=[np.minimum(errors, values * 0.9), errors], fmt="o-", capsize=3,
                        color=colour,
                        label=f"B_simple ({noise.optimizer}, B={noise.batch_size})")
        for p in missing:
            ax.annotate("not estimated", (p.step, 0.02), xycoords=("data", "axes fraction"),
                        rotation=90, fontsize=7, ha="center", va="bottom", color=colour)
        steps = [p.step for p in noise.points]
        margin = max(1.0, 0.05 * (max(steps) - min(steps)))
        ax.set_xlim(min(steps) - margin, max(steps) + margin)
    for optimizer, info in analysis.per_optimizer.items():
        if info.knee.b_crit:
            estimated_values.append(info.knee.b_crit)
            ax.axhline(info.knee.b_crit, color=colours.get(optimizer, "k"), ls="--",
                       label=f"measured knee B_crit ({optimizer})")
    if estimated_values:
        ax.set_ylim(min(estimated_values) / 3, max(estimated_values) * 3)
    ax.set(yscale="log", xlabel="training step", ylabel="batch size",
           title="Gradient noise scale vs measured knee")
    return _save(fig, path, legend=ax)
