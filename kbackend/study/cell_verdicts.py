"""The study's verdicts over its cells: the fastest cell, optimizer against optimizer, scaling
regions, the critical batch size over seeds against B_simple, generalization and the throughput
knee. A finding is stated only where the paired-seed intervals of the compared cells separate
(``kbackend.study.verdicts`` holds the interval arithmetic).
"""


from __future__ import annotations

import itertools
import math
import statistics
from typing import Any

from kbackend.hardware.knee import curve_knee
from kbackend.stats import median_interval
from kbackend.study.scaling import (
    PERFECT_SCALING_EXPONENT,
    SATURATION_EXPONENT,
    by_optimizer,
    fit_critical_batch,
)
from kbackend.study.verdicts import (
    DEFAULT_ACCURACY_MARGIN,
    DEFAULT_MARGIN,
    VERDICT_CONFIDENCE,
    LookLevels,
    decide,
    difference_verdict,
    open_bound,
    outcome_text,
    ratio_verdict,
    rounding_sd,
    span_text,
    step_time_log_ratios,
    trimmed_interval,
)
from kbackend.task import metric_direction

# -- verdicts: a finding is stated only where the intervals of the compared cells separate ------

def not_resolved(n: int) -> str:
    """The phrase for a comparison the intervals do not settle."""
    reason = " (one seed gives no interval)" if n < 2 else ""
    return f"not resolved at {n} seed{'s' if n != 1 else ''}{reason}"


def _span(interval: dict[str, Any] | None, spec: str = ".3g") -> str:
    if not interval or not interval.get("n"):
        return "-"

    def text(value: float) -> str:
        return "never" if math.isinf(value) else format(value, spec)

    if interval["n"] == 1:
        return text(interval["median"])
    return f"{text(interval['median'])} [{text(interval['low'])}, {text(interval['high'])}]"


def _time_interval(cell: dict[str, Any]) -> dict[str, Any] | None:
    return (cell.get("intervals") or {}).get("time_to_target")


def fastest_verdict(cells: list[dict[str, Any]], settings: dict[str, Any],
                    step_times: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fastest cell, stated only where the paired-seed verdict on time to target
    (``time_verdict``, the interval the other verdicts use) finds it faster than every other
    cell; otherwise the cells it is equivalent to or cannot be told apart from."""
    seeds = settings["seeds"]
    reached = [c for c in cells if c["reached"]]
    if not reached:
        return {"resolved": False, "outcome": "not_resolved", "seeds": 0, "cell": None,
                "ties": [], "text": "no cell reached the target"}
    leader = min(reached, key=lambda c: c["time_to_target"])
    name = f"{leader['optimizer']} at batch {leader['batch_size']}"
    versus = [(c, time_verdict(leader, c, settings, step_times)) for c in cells
              if c is not leader]
    ties = [(c, v) for c, v in versus if v["outcome"] != "a"]
    tie_names = [f"{c['optimizer']} at batch {c['batch_size']}" for c, _ in ties]
    paired = min((v["seeds"] for _, v in versus), default=seeds)
    shown = ", ".join(tie_names[:6]) + (
        f" and {len(tie_names) - 6} more" if len(tie_names) > 6 else "")
    time = f"{leader['time_to_target']:.3g} s"
    if not ties:
        outcome = "a"
        # the closest competitor: the largest leader/other ratio
        _, closest = max(versus, key=lambda cv: cv[1]["estimate"], default=(None, None))
        figures = "" if closest is None else (
            f"; vs the next: A/B {span_text(closest)} ({paired} seeds, "
            f"{closest['level']:.1%} interval)")
        text = f"fastest: {name}, {time} to target, faster than every other cell{figures}"
    elif all(v["outcome"] == "equivalent" for _, v in ties):
        outcome = "equivalent"
        text = (f"fastest: {name}, {time} to target, equivalent within "
                f"{settings['margin']:.0%} to {shown} ({paired} seeds)")
    else:
        outcome = "not_resolved"
        text = f"fastest: {not_resolved(paired)}: {name} ({time}) not shown faster than {shown}"
    return {"resolved": outcome != "not_resolved", "outcome": outcome, "seeds": paired,
            "cell": {"optimizer": leader["optimizer"], "batch_size": leader["batch_size"]},
            "ties": tie_names, "text": text}


def verdict_settings(study: dict[str, Any]) -> dict[str, Any]:
    """The seeds, margins and per-look interval level a study's verdicts are read with."""
    config = study.get("config", {})
    seeds = int(config.get("seeds", 1))
    max_seeds = max(seeds, int(config.get("max_seeds") or seeds))
    levels = LookLevels.of(seeds, max_seeds)
    return {"seeds": seeds, "max_seeds": max_seeds, "looks": len(levels.schedule),
            "level": levels.final, "levels": levels,
            "margin": float(config.get("margin", DEFAULT_MARGIN)),
            "accuracy_margin": float(config.get("accuracy_margin", DEFAULT_ACCURACY_MARGIN))}


def _key(cell: dict[str, Any]) -> tuple[str, int]:
    return cell["optimizer"], cell["batch_size"]


def time_verdict(a: dict[str, Any], b: dict[str, Any], settings: dict[str, Any],
                 step_times: dict[str, Any] | None) -> dict[str, Any]:
    """Three-way on time to target: paired seeds' steps ratio times the paired rounds' step-time
    ratio (or, without timings, the cells' median seconds per step as a known factor)."""
    rounds = step_time_log_ratios(step_times, _key(a), _key(b))
    scale = 1.0
    if rounds is None and a.get("reached") and b.get("reached") and a.get("steps_to_target") \
            and b.get("steps_to_target"):
        scale = (a["time_to_target"] / a["steps_to_target"]) / \
            (b["time_to_target"] / b["steps_to_target"])
    verdict = ratio_verdict(a.get("seed_steps") or {}, b.get("seed_steps") or {},
                            level=settings["levels"], margin=settings["margin"],
                            floor_sd=rounding_sd([a, b]), round_log_ratios=rounds, scale=scale,
                            bounds=(_budget_steps(a), _budget_steps(b)))
    verdict["cells"] = [list(_key(a)), list(_key(b))]
    return verdict


def _budget_steps(cell: dict[str, Any]) -> float | None:
    """The steps a cell's seeds that never reached the target ran (a lower bound of their
    steps to target), where the cell did not reach: its median steps run."""
    if cell.get("reached") or not cell.get("steps_run"):
        return None
    return float(cell["steps_run"])


def optimizer_comparison(cells: list[dict[str, Any]], challenger: str, incumbent: str,
                         settings: dict[str, Any],
                         step_times: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Per batch size, a three-way verdict on time to target (challenger = A, incumbent = B),
    and the crossover batch size where the resolved verdicts show one."""
    grouped = by_optimizer(cells)
    if challenger not in grouped or incumbent not in grouped:
        return None
    a = {c["batch_size"]: c for c in grouped[challenger]}
    b = {c["batch_size"]: c for c in grouped[incumbent]}
    per_batch = []
    for size in sorted(set(a) & set(b)):
        verdict = time_verdict(a[size], b[size], settings, step_times)
        winner = {"a": challenger, "b": incumbent}.get(verdict["outcome"])
        per_batch.append({"batch_size": size, "faster": winner, "outcome": verdict["outcome"],
                          "resolved": verdict["resolved"], "seeds": verdict["seeds"],
                          "verdict": verdict,
                          challenger: _span(_time_interval(a[size]), ".3g"),
                          incumbent: _span(_time_interval(b[size]), ".3g")})
    outcomes = [p["outcome"] for p in per_batch]
    result: dict[str, Any] = {"challenger": challenger, "incumbent": incumbent,
                              "per_batch": per_batch, "batch_size": None,
                              "resolved": bool(outcomes) and "not_resolved" not in outcomes}
    # A crossover: from some batch size up the challenger is faster at every size, and below it
    # every verdict is resolved the other way or equivalent.
    split = len(outcomes)
    while split > 0 and outcomes[split - 1] == "a":
        split -= 1
    if 0 < split < len(outcomes) and all(o in ("b", "equivalent") for o in outcomes[:split]):
        result["batch_size"] = per_batch[split]["batch_size"]
    groups: dict[str, list[str]] = {}
    for p in per_batch:
        label = {"a": f"{challenger} faster", "b": f"{incumbent} faster",
                 "equivalent": f"equivalent within {settings['margin']:.0%}"}.get(
            p["outcome"], f"not resolved after {p['verdict']['seeds']} seeds")
        bound = open_bound(p["verdict"])
        groups.setdefault(label, []).append(f"{p['batch_size']}"
                                            + (f" ({bound})" if bound else ""))
    result["text"] = "; ".join(f"{label} at batch {', '.join(sizes)}"
                               for label, sizes in groups.items()) or "no common batch size"
    if result["batch_size"] is not None:
        result["text"] += f" (crossover: {challenger} from batch {result['batch_size']} up)"
    return result


def region_of(exponent: float) -> str:
    """The scaling region a steps-vs-batch exponent falls in."""
    if exponent >= PERFECT_SCALING_EXPONENT:
        return "perfect scaling"
    if exponent <= SATURATION_EXPONENT:
        return "saturation"
    return "diminishing returns"


def region_verdicts(group: list[dict[str, Any]], settings: dict[str, Any]) -> list[dict[str, Any]]:
    """Each segment between neighbouring reached batch sizes B1 < B2: a three-way verdict on
    steps to target (A = B1, B = B2: ``b`` = the larger batch needs fewer steps, ``equivalent``
    = the same within the margin) and the range of its scaling exponent over that paired
    interval; the region is resolved (``region_resolved``) when the whole range is one region."""
    segments = []
    reached = [c for c in group if c["reached"]]
    for c1, c2 in itertools.pairwise(reached):
        span = math.log(c2["batch_size"] / c1["batch_size"])
        exponent = math.log(c1["steps_to_target"] / c2["steps_to_target"]) / span
        verdict = ratio_verdict(c1.get("seed_steps") or {}, c2.get("seed_steps") or {},
                                level=settings["levels"], margin=settings["margin"],
                                floor_sd=rounding_sd([c1, c2]))
        verdict["cells"] = [list(_key(c1)), list(_key(c2))]
        low = high = math.nan
        if verdict["seeds"] >= 2 and verdict["low"] > 0 and math.isfinite(verdict["high"]):
            # steps ratio B1/B2 = A/B: the exponent grows with it
            low, high = math.log(verdict["low"]) / span, math.log(verdict["high"]) / span
        region_resolved = math.isfinite(low) and region_of(low) == region_of(high)
        segments.append({"from": c1["batch_size"], "to": c2["batch_size"], "exponent": exponent,
                         "exponent_low": low, "exponent_high": high,
                         "region": region_of(exponent), "region_resolved": region_resolved,
                         "resolved": verdict["resolved"], "outcome": verdict["outcome"],
                         "seeds": verdict["seeds"], "verdict": verdict})
    return segments


def critical_batch_over_seeds(group: list[dict[str, Any]]) -> dict[str, Any]:
    """B_crit fitted to each seed's steps-to-target curve (the seeds are independent replicas of
    the whole curve), as a median with its order-statistic interval; seeds whose curve has no
    finite knee are counted apart."""
    seeds = sorted({s for c in group for s in (c.get("seed_steps") or {})}, key=int)
    values, missing = [], 0
    for seed in seeds:
        points = [(c["batch_size"], c["seed_steps"][seed]) for c in group
                  if math.isfinite(c.get("seed_steps", {}).get(seed, math.inf))]
        knee = fit_critical_batch(points)
        if knee.get("b_crit"):
            values.append(knee["b_crit"])
        else:
            missing += 1
    return {**median_interval(values), "seeds_without_knee": missing}


def noise_agreement(b_crit: dict[str, Any], b_simple: float | None, seeds: int) -> dict[str, Any]:
    """Does the gradient-noise estimate predict the measured critical batch size within 2x?"""
    if b_simple is None:
        return {"resolved": False, "text": "B_simple not estimated: nothing to compare"}
    if not b_crit.get("n"):
        return {"resolved": False, "text": "no seed's steps curve has a knee inside the grid"}
    low, high = b_simple / 2, b_simple * 2
    interval = f"B_crit {_span(b_crit, '.0f')} over {b_crit['n']} seed fits"
    if b_crit["n"] >= 2 and b_crit["seeds_without_knee"] == 0:
        if low <= b_crit["low"] and b_crit["high"] <= high:
            return {"resolved": True, "agree": True,
                    "text": f"{interval} lies within 2x of B_simple {b_simple:.0f}"}
        if b_crit["high"] < low or b_crit["low"] > high:
            return {"resolved": True, "agree": False,
                    "text": f"{interval} lies outside 2x of B_simple {b_simple:.0f}"}
    return {"resolved": False,
            "text": f"{interval} vs B_simple {b_simple:.0f}: {not_resolved(seeds)}"}


def seed_test_values(cell: dict[str, Any]) -> tuple[dict[str, float], str]:
    """A cell's per-seed test metric and where it comes from: the frontier's (the checkpoint of
    the best validation value within the equal budget) when measured, else the runs' at the
    target."""
    frontier = cell.get("frontier") or {}
    if frontier.get("seed_test"):
        return frontier["seed_test"], "frontier"
    return cell.get("seed_test") or {}, "target"


def test_metric_verdict(a: dict[str, Any], b: dict[str, Any], settings: dict[str, Any],
                        metric: str) -> dict[str, Any]:
    """Three-way on the test metric (A better = A's value better by ``metric_direction``): a
    difference with the accuracy margin for metrics where larger is better (accuracies, within
    [0, 1]), a ratio with the relative margin for errors and losses."""
    values_a, source = seed_test_values(a)
    values_b, _ = seed_test_values(b)
    if metric_direction(metric) == "max":
        verdict = difference_verdict(values_a, values_b, level=settings["levels"],
                                     margin=settings["accuracy_margin"], larger_is_better=True)
    else:
        verdict = ratio_verdict(values_a, values_b, level=settings["levels"],
                                margin=settings["margin"])
    verdict.update(cells=[list(_key(a)), list(_key(b))], source=source, metric=metric)
    return verdict


def generalization_verdict(group: list[dict[str, Any]], settings: dict[str, Any]) -> dict[str, Any]:
    """The test metric at the smallest against the largest batch size (A = smallest): of the
    checkpoint with the best validation value within the frontier's equal budget where it was
    measured, else of the runs stopped at the target (both batch sizes must have reached it)."""
    measured = [c for c in group if (c.get("frontier") or {}).get("seed_test")]
    candidates = measured if len(measured) >= 2 else \
        [c for c in group if c["reached"] and c.get("seed_test")]
    if len(candidates) < 2:
        return {"resolved": False, "outcome": "not_resolved", "seeds": 0,
                "text": "fewer than two batch sizes with test figures"}
    small, big = candidates[0], candidates[-1]
    metric = small.get("test_metric_name") or "test_accuracy"
    verdict = test_metric_verdict(small, big, settings, metric)
    where = ("at the best validation checkpoint within the equal budget"
             if verdict["source"] == "frontier" else "of the runs stopped at the target")
    text = (f"{metric} {where}, batch {small['batch_size']} (A) vs {big['batch_size']} (B): "
            + outcome_text(verdict, f"batch {small['batch_size']}", f"batch {big['batch_size']}",
                           "generalizes better"))
    larger = {"a": "lower", "b": "higher", "equivalent": "equivalent"}.get(verdict["outcome"])
    return {"resolved": verdict["resolved"], "outcome": verdict["outcome"],
            "seeds": verdict["seeds"], "larger_batch": larger, "verdict": verdict, "text": text}


def measured_throughput(step_times: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Samples/s per batch size from the time model's interleaved step timings, pooled over the
    optimizers of that batch size: the median with its order-statistic interval."""
    by_batch: dict[int, list[float]] = {}
    for cell in (step_times or {}).get("cells", []):
        by_batch.setdefault(cell["batch_size"], []).extend(
            cell["batch_size"] / s for s in cell["seconds"] if s > 0)
    curve = []
    for size, values in sorted(by_batch.items()):
        interval = median_interval(values)
        curve.append({"batch_size": size, "samples_per_s": interval["median"],
                      "low": interval["low"], "high": interval["high"], "n": interval["n"],
                      "coverage": interval["coverage"]})
    return curve


def doubling_gains(step_times: dict[str, Any] | None, level: float) -> list[dict[str, Any]]:
    """Per neighbouring pair of timed batch sizes, the interval of samples/s at the larger over
    the smaller, per doubling: per-round log ratios (rounds pair) of every optimizer timed at
    both, pooled, Yuen's trimmed interval at ``level`` (``verdicts.trimmed_interval``)."""
    cells = (step_times or {}).get("cells", [])
    sizes = sorted({c["batch_size"] for c in cells})
    optimizers = sorted({c["optimizer"] for c in cells})
    gains = []
    for b1, b2 in itertools.pairwise(sizes):
        per_doubling = 1.0 / math.log2(b2 / b1)
        logs = []
        for optimizer in optimizers:
            # seconds per sample at b1 over b2 = samples/s at b2 over b1
            ratios = step_time_log_ratios(step_times, (optimizer, b1), (optimizer, b2))
            logs += [(r + math.log(b2 / b1)) * per_doubling for r in ratios or []]
        estimate, low, high = trimmed_interval(logs, level)
        gains.append({"from": b1, "to": b2, "timings": len(logs), "gain": math.exp(estimate) - 1,
                      "low": math.exp(low) - 1, "high": math.exp(high) - 1})
    return gains


def throughput_knee_verdict(step_times: dict[str, Any] | None,
                            settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """The throughput knee (``kbackend.hardware.knee``'s definition: the first batch size whose
    next doubling gains less than 10% samples/s) with paired-round intervals of every gain:
    resolved when each gain before the knee is above 10% and the knee's own below, over their
    whole intervals. ``outcome`` is the three-way verdict at the knee's doubling (A = the knee,
    B = twice it, margin: the knee's 10%): ``equivalent`` where the doubling is flat, ``b``
    where every doubling gains (no plateau in the grid)."""
    curve = measured_throughput(step_times)
    timings = min((p["n"] for p in curve), default=0)
    if len(curve) < 2 or any("low" not in p for p in curve):
        return {"resolved": False, "outcome": "not_resolved", "batch_size": None, "seeds": None,
                "timings": timings,
                "text": "not measured: needs step timings at two or more batch sizes"}
    knee = curve_knee(curve)
    level = (settings or {}).get("level", VERDICT_CONFIDENCE)
    gains = doubling_gains(step_times, level)
    threshold = knee.min_gain
    resolved, outcome = True, "b"
    for index, gain in enumerate(gains):
        if index > knee.index:
            break
        at_knee = index == knee.index and knee.plateau_reached
        if at_knee:
            edge = math.log1p(threshold)
            low, high = math.log1p(max(gain["low"], -0.999999)), math.log1p(gain["high"])
            outcome = decide(low, high, edge, a_is_better_below=True)
            resolved = resolved and gain["high"] < threshold
        elif gain["low"] < threshold:
            resolved = False
    if not resolved:
        outcome = "not_resolved"
    where = (f"batch {knee.batch_size}" if knee.plateau_reached else
             f"no plateau up to batch {knee.batch_size}")
    figures = "; ".join(f"{g['from']}->{g['to']}: {g['gain']:+.0%} [{g['low']:+.0%}, "
                        f"{g['high']:+.0%}]" for g in gains)
    text = (f"throughput knee (next doubling gains < {threshold:.0%}): {where} "
            f"({level:.1%} intervals over {timings} paired timings per batch size; gains per "
            f"doubling {figures})" if resolved else
            f"throughput knee: not resolved after {timings} timings per batch size (median "
            f"curve: {where}; gains per doubling {figures})")
    return {"resolved": resolved, "outcome": outcome, "batch_size": knee.batch_size,
            "plateau_reached": knee.plateau_reached, "seeds": None, "timings": timings,
            "gains": gains, "text": text}


def step_time_spread(step_times: dict[str, Any] | None) -> dict[str, Any] | None:
    """How much the measured step times moved: max/min per cell, and the neighbouring batch
    sizes (same optimizer) whose samples/s intervals overlap, which cannot be ranked."""
    cells = (step_times or {}).get("cells", [])
    if not cells:
        return None
    ratios = {f"{c['optimizer']} B={c['batch_size']}": max(c["seconds"]) / min(c["seconds"])
              for c in cells if c["seconds"] and min(c["seconds"]) > 0}
    overlaps = []
    grouped: dict[str, list[dict[str, Any]]] = {}
    for cell in cells:
        grouped.setdefault(cell["optimizer"], []).append(cell)
    for optimizer, group in grouped.items():
        group.sort(key=lambda c: c["batch_size"])
        for c1, c2 in itertools.pairwise(group):
            t1 = [c1["batch_size"] / s for s in c1["seconds"]]
            t2 = [c2["batch_size"] / s for s in c2["seconds"]]
            if min(t2) <= max(t1) and min(t1) <= max(t2):
                overlaps.append(f"{optimizer} {c1['batch_size']}/{c2['batch_size']}")
    values = sorted(ratios.values())
    worst = max(ratios, key=lambda name: ratios[name]) if ratios else None
    return {"median_ratio": statistics.median(values) if values else None,
            "worst": worst, "worst_ratio": ratios.get(worst) if worst else None,
            "unranked_neighbours": overlaps}
