"""The study report's text: the results table's rows, the conclusions, the sources and their
verdicts, the frontier and the caveats (markdown lines; ``report`` puts them together)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from kbackend.hardware.knee import DEFAULT_MIN_GAIN
from kbackend.reports import markdown_rows
from kbackend.study.analysis import Analysis, StudyVerdicts
from kbackend.study.auto_verdicts import auto_label
from kbackend.study.cell_verdicts import RegionVerdict
from kbackend.study.device_profile import conclusion_lines as profile_conclusions
from kbackend.study.plots import pareto_cells
from kbackend.study.study_record import Cell, NoisePoint, StudyRecord
from kbackend.study.verdicts import (
    VERDICT_CONFIDENCE,
    VerdictSettings,
    format_value,
    outcome_text,
)
from kbackend.task import metric_direction


def _interval(cell: Cell, name: str, spec: str) -> str:
    """``median [low, high]`` of one of a cell's figures (``never`` for an infinite end)."""
    interval = (cell.intervals or {}).get(name)
    if not interval or not interval.get("n"):
        return format_value(getattr(cell, name), spec)
    return _span_of(interval, spec, missing="never")


def edge_label(cell: Cell) -> str:
    """Where the cell's best learning rate sits in its (extended) grid, if on an end."""
    if not cell.lr_at_grid_edge:
        return ""
    return " (edge, at the bound)" if cell.lr_at_bound else " (edge)"


def tested_metric(study: StudyRecord) -> str:
    """The task's test metric as the runs name it (test_accuracy for classifiers, test_mae...)."""
    return next((c.test_metric_name for c in study.all_cells if c.test_metric_name),
                "test_accuracy")


def table_rows(study: StudyRecord) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-cell table (terminal and markdown)."""
    metric = study.target["metric"]
    header = ["optimizer", "batch", "best lr", "reached", "steps", "epochs", "samples",
              "time to target (s)", f"best {metric}", tested_metric(study).replace("_", " "),
              "samples/s", "start-up (s)"]
    rows = []
    for c in study.all_cells:  # the auto cells last
        test_key = "test_metric" if c.test_metric is not None else "test_accuracy"
        reached = "yes" if c.reached else "NOT REACHED"
        if c.seeds > 1:
            reached += f" ({c.seeds_reached}/{c.seeds})"
        rows.append([
            c.optimizer, auto_label(c) if c.auto else str(c.batch_size),
            format_value(c.learning_rate) + edge_label(c), reached,
            _interval(c, "steps_to_target", ".0f"), format_value(c.epochs_to_target, ".2f"),
            format_value(c.samples_to_target, ".0f"), _interval(c, "time_to_target", ".3g"),
            _interval(c, "best_metric", ".4f"), _interval(c, test_key, ".4f"),
            format_value(c.samples_per_s, ",.0f"),
            format_value(c.startup_time, ".2f")
            + ("~" if c.startup_time_estimated else ""),
        ])
    return header, rows


def _regions_text(segments: Sequence[RegionVerdict]) -> str:
    parts = []
    for s in segments:
        k = f"k={s.exponent:.2f}"
        if math.isfinite(s.exponent_low):
            k += f" [{s.exponent_low:.2f}, {s.exponent_high:.2f}]"
        label = s.region if s.region_resolved else f"region not resolved (median: {s.region})"
        steps = {"b": "; fewer steps at the larger batch",
                 "a": "; more steps at the larger batch",
                 "equivalent": f"; steps equal within {s.verdict.margin:.0%}"}.get(
            s.outcome, "; steps not resolved")
        parts.append(f"{s.from_batch}->{s.to_batch}: {label} ({k}{steps}, "
                     f"{s.verdict.seeds} seeds)")
    return ", ".join(parts)


def conclusions(study: StudyRecord, analysis: Analysis, scaling: bool = True) -> list[str]:
    """One line per finding, for the terminal and the markdown report: each verdict only where
    the intervals of the compared cells separate. ``scaling=False`` (the terminal) leaves out
    each optimizer's critical batch and scaling exponents (the report has them)."""
    target = study.target
    verdicts = analysis.verdicts
    lines = []
    best = analysis.best
    if best:
        lines.append(
            f"Fastest median to {target['metric']} {target['value']:g}: {best.optimizer} at "
            f"batch {best.batch_size} (lr {best.learning_rate:g}), "
            f"{best.time_to_target:.2f} s of training, "
            f"{format_value(best.steps_to_target, '.0f')} steps.")
        lines.append(verdicts.fastest.text[0].upper() + verdicts.fastest.text[1:] + ".")
    else:
        lines.append(f"No cell reached {target['metric']} {target['value']:g} within its budget.")
    for optimizer, info in analysis.per_optimizer.items() if scaling else ():
        fit = info.knee
        knee_text = (f"B_crit ~ {fit.b_crit:.0f} (S_min ~ {fit.s_min or 0:.0f} steps, "
                     "median fit)" if fit.b_crit else fit.note)
        segments = verdicts.per_optimizer[optimizer].regions
        missing = f"; not reached at {list(info.not_reached)}" if info.not_reached else ""
        lines.append(f"{optimizer}: {knee_text}. "
                     f"{_regions_text(segments) or 'too few reached cells for regions'}{missing}.")
    knee = verdicts.throughput_knee
    if knee.batch_size is not None:
        lines.append(knee.text[0].upper() + knee.text[1:] + ".")
    elif analysis.throughput_knee is not None:
        plateau = "" if analysis.throughput_plateau_reached else \
            "; no plateau yet: larger batches may still gain"
        lines.append(f"Throughput knee (next doubling gains < {DEFAULT_MIN_GAIN:.0%} samples/s, "
                     f"from the runs' own clocks): batch {analysis.throughput_knee}{plateau}.")
    noise = study.noise
    if noise:
        b_simple = analysis.b_simple
        head = (f"Gradient noise scale B_simple ~ {b_simple:.0f} over training"
                if b_simple is not None else
                f"Gradient noise scale B_simple {analysis.b_simple_note or 'not estimated'}")
        lines.append(
            f"{head} ({noise.optimizer}, batch {noise.batch_size}, batch pair "
            f"{noise.small_batch}/{noise.big_batch}; per point: "
            + ", ".join(f"step {p.step}: {_point_b_simple(p)}" for p in noise.points) + ").")
    for x in verdicts.optimizers:
        lines.append(f"{x.challenger} vs {x.incumbent}: {x.text}.")
    for auto in verdicts.adaptive or ():  # the auto cells against the best fixed batch sizes
        lines.append(f"Adaptive batch size, {auto.text}.")
    lines += profile_conclusions(study)  # --device-profile: predicted on another device
    return lines


def _point_b_simple(point: NoisePoint) -> str:
    value = point.b_simple  # None where a summary was read without non-finite values restored
    if value is None or not math.isfinite(value) or value <= 0:
        return "not estimated"
    return f"{value:.0f}"


def _levels_text(settings: VerdictSettings) -> str:
    """Each look's interval level, e.g. ``93.40% at 3 seeds, 98.68% at 5-20``."""
    levels = settings.levels
    first = f"{levels.levels[0]:.2%} at {levels.schedule[0]} seeds"
    if len(levels.schedule) == 1:
        return first
    later = levels.schedule[1:]
    counts = f"{later[0]}" if len(later) == 1 else f"{later[0]}-{later[-1]}"
    return f"{first}, {levels.levels[1]:.2%} at {counts}"


def _seeds_note(verdicts: StudyVerdicts) -> str:
    added = verdicts.added_seeds
    schedule = (added.schedule if added else ()) or (verdicts.settings.seeds,)
    if len(schedule) < 2:
        return (f"No seeds were added (--max-seeds equal to --seeds: {schedule[0]}), so every "
                "verdict was read once.")
    assert added is not None  # a schedule of two or more looks was run
    return (f"Seeds were added round by round ({', '.join(map(str, schedule))} seeds) to the "
            "cells whose comparisons were unresolved and could still resolve: "
            f"{sum(len(r.runs) for r in added.rounds)} runs in "
            f"{len(added.rounds)} round(s), {added.seconds or 0.0:.1f} s including the frontier "
            f"runs; stopped: {added.stopped}. Each verdict says how many seeds it took.")


def sources_section(study: StudyRecord, analysis: Analysis) -> list[str]:
    """"What the sources claim, what this run shows": each claim with this run's three-way
    verdicts (A better, B better, equivalent within the margin, or not resolved after N seeds
    with the interval that remains)."""
    verdicts = analysis.verdicts
    settings = verdicts.settings
    lines = ["## What the sources claim, what this run shows", "",
             "Each comparison pairs the seeds (seed s starts every cell from the same weights "
             "and data order) and reads one interval: of the ratio A/B for times and steps "
             "(mean of the per-seed log ratios, t-interval; times add the paired step-time "
             "rounds), of the difference A - B for accuracies. It ends as A better, B better, "
             f"*equivalent* (the interval inside +-{settings.margin:.0%} for ratios, "
             f"+-{100 * settings.accuracy_margin:g} point for accuracies) or not "
             f"resolved. {settings.looks} look(s) at most, at interval levels "
             f"{_levels_text(settings)}, so the chance that a verdict is wrong is at most "
             f"{1 - VERDICT_CONFIDENCE:.0%} however the seed rounds stopped (the levels are set "
             "so that all looks together miss that often, simulated; coverage checked in "
             "tests/test_study_verdicts.py). "
             + _seeds_note(verdicts), ""]
    lines += ["**(a) SGD vs Adam across batch sizes.** Claim (the IPU article on batch sizes and "
              "optimizers): plain mini-batch SGD is the better choice at small batches, Adam at "
              "batches of hundreds. A = Adam, B = the other; time to target.", ""]
    if not verdicts.optimizers:
        lines.append("- Not measured: the study needs both adam and sgd (or momentum).")
    for x in verdicts.optimizers:
        lines.append(f"- {x.challenger} vs {x.incumbent}: {x.text}.")
        for p in x.per_batch:
            lines.append(f"  - B={p.batch_size}: " + outcome_text(
                p.verdict, x.challenger, x.incumbent, "faster"))
    lines += ["", "**(b) Scaling regions and the critical batch size.** Claim (Shallue et al. "
              "2018; McCandlish et al. 2018): steps to target first halve with every doubling of "
              "the batch (perfect scaling), then fall less (diminishing returns), then not at all "
              "(saturation); the gradient noise scale B_simple predicts the critical batch size "
              "B_crit within a small factor. Each step: A = the smaller batch, B = the larger; "
              "its exponent range comes from the paired steps-ratio interval.", ""]
    for optimizer, per in verdicts.per_optimizer.items():
        regions = _regions_text(per.regions) or "too few reached cells"
        lines.append(f"- {optimizer}: {regions}. {per.noise_agreement.text}.")
    if analysis.b_simple is None and study.noise:
        lines.append(f"- B_simple {analysis.b_simple_note}.")
    lines += ["", "**(c) Generalization.** Claim (Keskar et al. 2017, and the generalization-gap "
              "literature; the seed's caveat: larger batches may cost accuracy): larger batches "
              "reach lower test accuracy. Here: the test metric at the checkpoint with the best "
              "validation value within the frontier's equal budget (see the frontier below), "
              "smallest (A) vs largest (B) batch.", ""]
    for optimizer, per in verdicts.per_optimizer.items():
        lines.append(f"- {optimizer}: {per.generalization.text}.")
    lines += ["", "**(d) The throughput knee of this hardware.** Claim: samples/s rise with the "
              "batch size until the device is saturated; past the knee a bigger batch buys "
              "little speed.", "", f"- {verdicts.throughput_knee.text}."]
    curve = analysis.throughput
    if curve and curve[0].low is not None:
        lines.append("- samples/s per batch size: " + "; ".join(
            f"{p.batch_size}: {p.samples_per_s:,.0f} [{p.low or 0:,.0f}, {p.high or 0:,.0f}]"
            for p in curve) + ".")
    return lines


def frontier_rows(study: StudyRecord) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the time-vs-accuracy frontier: per cell its time to target and the best
    validation value and test metric reached within the equal budget (medians, [min, max])."""
    metric = study.target["metric"]
    header = ["optimizer", "batch", "time to target (s)", f"best {metric}", "test at best",
              "epoch of best", "seeds", "on the frontier"]
    cells = [c for c in study.cells if c.frontier]
    front = pareto_cells(study)
    rows = []
    for c in cells:
        f = c.frontier
        assert f is not None
        rows.append([c.optimizer, str(c.batch_size), _interval(c, "time_to_target", ".3g"),
                     _span_of(f.best_metric, ".4f"), _span_of(f.test_metric, ".4f"),
                     _span_of(f.best_epoch, ".2g"), str(f.seeds),
                     "yes" if (c.optimizer, c.batch_size) in front else ""])
    return header, rows


def _span_of(interval: dict[str, float], spec: str, missing: str = "-") -> str:
    """``median [low, high]`` (``missing`` for a value that is not finite; one seed: its value)."""
    if not interval or not interval.get("n"):
        return "-"
    if interval["n"] == 1:
        return format_value(interval["median"], spec)
    median, low, high = (format_value(interval[end], spec, missing)
                         for end in ("median", "low", "high"))
    return f"{median} [{low}, {high}]"


def frontier_section(study: StudyRecord, analysis: Analysis) -> list[str]:
    """The time-vs-accuracy frontier: table, its budget and the plot."""
    header, rows = frontier_rows(study)
    lines = ["## Time vs accuracy: the frontier", ""]
    if not rows:
        return [*lines, "Not measured (--frontier-epochs 0, or an engine other than native).", ""]
    epochs = study.config.get("frontier_epochs")
    metric = study.target["metric"]
    lines += [f"Each cell's best rate trained again per seed for the same budget, {epochs} "
              f"epochs (every cell alike), without stopping at the target: the best {metric} "
              "reached and the test metric of that very checkpoint (evaluated at each new best), "
              "beside the cell's time to target. \"On the frontier\": no other cell is both "
              "faster to the target and better at its best (medians).", "",
              markdown_rows(header, rows).rstrip("\n"), "", "![frontier](plots/frontier.png)", ""]
    return lines


def caveats_section(study: StudyRecord, analysis: Analysis) -> list[str]:
    """What may bias the figures: machine load, step-time spread, the target's granularity."""
    lines = ["## Caveats", ""]
    load = study.machine_load
    if load:
        lines.append(f"- Machine load (1-minute load average, {load.cpus} CPUs): "
                     f"{load.before:.2f} before the study, {load.after:.2f} after. Time "
                     "to target is steps x a step time measured apart in interleaved rounds, so "
                     "load that comes and goes affects every cell alike; the runs' own clocks "
                     "are kept in study.db but not ranked by.")
    step_times = study.step_times
    spread = analysis.verdicts.step_time_spread
    if step_times and spread:
        engine = step_times.engine
        study_engine = step_times.study_engine or study.config["engine"]
        source = (f"the {engine} engine's compiled step" +
                  ("" if engine == study_engine else
                   f" (the study trained with the {study_engine} engine, whose own step time is "
                   "not measured apart)"))
        unranked = spread.unranked_neighbours
        lines.append(
            f"- Step times: {source}, {step_times.repeats} interleaved rounds per cell"
            + (f", each timing whole calls for at least {1e3 * step_times.min_seconds:.0f} ms "
               "or 32 steps" if step_times.min_seconds else "") + ". "
            f"Their spread (slowest / fastest round) is {spread.median_ratio:.2f}x at the "
            f"median cell, {spread.worst_ratio:.2f}x at worst ({spread.worst})."
            + (f" Neighbouring batch sizes whose samples/s overlap and cannot be ranked: "
               f"{', '.join(unranked)}." if unranked else
               " Every pair of neighbouring batch sizes is separated in samples/s."))
    elif not step_times:
        lines.append("- No step times were measured apart (--step-time-repeats 0): time to "
                     "target comes from each run's own clock, which moves with machine load.")
    spent = study.time_spent
    if spent and spent.runs_trained:
        ratio = spent.whole_over_steady
        lines.append(
            f"- Where this process's time went, up to this report ({spent.runs_trained} runs "
            f"trained here; runs reused from study.db cost nothing): whole process "
            f"{spent.whole_process_s:.1f} s; "
            f"steady training {spent.steady_training_s:.1f} s; "
            f"start-ups (compilation, first calls, and building the model and each cell's "
            f"trainer: {spent.setup_s or 0.0:.1f} s) {spent.startup_s:.1f} s; "
            f"evaluation {spent.evaluation_s:.1f} s; around the runs (resets, data order, "
            f"test evaluations) {spent.around_runs_s:.1f} s; time model "
            f"{spent.time_model_s:.1f} s; "
            f"noise scale {spent.noise_scale_s:.1f} s; imports, data and checks "
            f"{spent.other_s:.1f} s. Whole / steady training: "
            + (f"{ratio:.1f}x (goal: at most 1.5x steady training + start-ups = "
               f"{spent.goal_s:.1f} s, {'met' if spent.goal_met else 'not met'})."
               if ratio else "undefined (no steady training).")
            + " The console's last line adds the analysis and the report.")
    info = study.dataset
    metric = study.target["metric"]
    if metric_direction(metric) == "max" and info.get("num_val"):
        lines.append(
            f"- \"best {metric}\" is the first value past the target, not the best a run would "
            "reach: a run stops at the first evaluation that passes the target. With "
            f"{info['num_val']} validation samples accuracy moves in steps of "
            f"{1 / info['num_val']:.2%}, so many cells show the same value just over the target.")
    return lines
