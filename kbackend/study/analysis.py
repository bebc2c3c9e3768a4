"""What a study's cells say: scaling regions of steps-to-target, the critical batch size, the
throughput knee (``kbackend.hardware.knee``'s one definition), the fastest cell and where Adam
overtakes SGD.

Everything here is plain Python over the cell records the runner returns (no training), so the
conclusions can be recomputed from a stored study and tested on made-up numbers.

Regions (Shallue et al. 2018): between two neighbouring batch sizes B1 < B2 with steps to
target S1, S2, the scaling exponent k = log(S1 / S2) / log(B2 / B1) is 1 when doubling the batch
halves the steps (perfect scaling) and 0 when it saves none (saturation). k >= 0.7 is marked
perfect scaling, k <= 0.2 saturation, anything between diminishing returns.

Knee (McCandlish et al. 2018): steps to target follow S(B) = S_min (1 + B_crit / B); a
least-squares fit of S = a + b / B (relative errors) gives S_min = a and B_crit = b / a, the
batch size where the run takes twice the minimum number of steps. It is compared with the
measured gradient noise scale B_simple, which predicts it.
"""

from __future__ import annotations

import itertools
import math
import statistics
from typing import Any

from kbackend.hardware.knee import curve_knee
from kbackend.stats import median_coverage, median_interval
from kbackend.study.auto_verdicts import auto_verdicts
from kbackend.study.verdicts import (
    DEFAULT_ACCURACY_MARGIN,
    DEFAULT_MARGIN,
    VERDICT_CONFIDENCE,
    decide,
    difference_verdict,
    look_level,
    mean_interval,
    outcome_text,
    ratio_verdict,
    rounding_sd,
    seed_schedule,
    span_text,
    step_time_log_ratios,
)
from kbackend.task import metric_direction

PERFECT_SCALING_EXPONENT = 0.7
SATURATION_EXPONENT = 0.2
# A fitted knee more than this factor outside the studied batch sizes is reported as outside.
KNEE_EXTRAPOLATION = 2.0


def _by_optimizer(cells: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    grouped: dict[str, list[dict[str, Any]]] = {}
    for cell in cells:
        grouped.setdefault(cell["optimizer"], []).append(cell)
    for group in grouped.values():
        group.sort(key=lambda c: c["batch_size"])
    return grouped


def scaling_regions(points: list[tuple[int, float]]) -> list[dict[str, Any]]:
    """Label each segment between neighbouring (batch size, steps to target) points."""
    segments = []
    for (b1, s1), (b2, s2) in itertools.pairwise(points):
        exponent = math.log(s1 / s2) / math.log(b2 / b1)
        if exponent >= PERFECT_SCALING_EXPONENT:
            region = "perfect scaling"
        elif exponent <= SATURATION_EXPONENT:
            region = "saturation"
        else:
            region = "diminishing returns"
        segments.append({"from": b1, "to": b2, "exponent": exponent, "region": region})
    return segments


def fit_critical_batch(points: list[tuple[int, float]]) -> dict[str, Any]:
    """Fit S(B) = S_min (1 + B_crit / B) to (batch size, steps) points (relative least squares).

    ``b_crit`` is None when the fit has no finite positive knee: ``beyond_grid`` says whether
    steps still fall in proportion at the largest batch (knee above the grid) or never did
    (knee below it).
    """
    if len(points) < 2:
        return {"s_min": None, "b_crit": None,
                "note": "fewer than two batch sizes reached the target"}
    # Weighted normal equations for S = a + b u, u = 1 / B, weights 1 / S^2.
    rows = [(1.0 / s, (1.0 / b) / s, 1.0) for b, s in points]  # (1/S, u/S, S/S)
    saa = sum(r[0] ** 2 for r in rows)
    sab = sum(r[0] * r[1] for r in rows)
    sbb = sum(r[1] ** 2 for r in rows)
    sa_y = sum(r[0] * r[2] for r in rows)
    sb_y = sum(r[1] * r[2] for r in rows)
    det = saa * sbb - sab * sab
    if abs(det) < 1e-300:
        return {"s_min": None, "b_crit": None, "note": "degenerate fit"}
    a = (sa_y * sbb - sab * sb_y) / det
    b = (saa * sb_y - sab * sa_y) / det
    smallest, largest = min(p[0] for p in points), max(p[0] for p in points)
    # A knee far outside the grid is an extrapolation, not a measurement.
    if a <= 1e-9 * max(p[1] for p in points) or b / a > KNEE_EXTRAPOLATION * largest:
        return {"s_min": None, "b_crit": None, "beyond_grid": "above",
                "note": f"no saturation within the grid: B_crit > {largest}"}
    if b <= 0 or b / a < smallest / KNEE_EXTRAPOLATION:
        return {"s_min": a, "b_crit": None, "beyond_grid": "below",
                "note": f"saturated over the whole grid: B_crit < {smallest}"}
    return {"s_min": a, "b_crit": b / a, "note": ""}


def throughput_curve(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median steady-state samples/s per batch size over every run (all optimizers and rates)."""
    by_batch: dict[int, list[float]] = {}
    for run in runs:
        value = run["result"].get("samples_per_s")
        if value is not None and math.isfinite(value) and value > 0:
            by_batch.setdefault(run["config"]["batch_size"], []).append(value)
    return [{"batch_size": b, "samples_per_s": statistics.median(v), "runs": len(v)}
            for b, v in sorted(by_batch.items())]


def _time(cell: dict[str, Any] | None) -> float:
    if cell is None or not cell["reached"]:
        return math.inf
    return cell["time_to_target"]


def crossover(cells: list[dict[str, Any]], challenger: str,
              incumbent: str) -> dict[str, Any] | None:
    """The smallest batch size from which ``challenger`` reaches the target in less training time
    than ``incumbent`` at that and every larger studied batch size (None if both are absent)."""
    grouped = _by_optimizer(cells)
    if challenger not in grouped or incumbent not in grouped:
        return None
    a = {c["batch_size"]: c for c in grouped[challenger]}
    b = {c["batch_size"]: c for c in grouped[incumbent]}
    sizes = sorted(s for s in set(a) & set(b)
                   if math.isfinite(_time(a[s])) or math.isfinite(_time(b[s])))
    wins = [_time(a[s]) < _time(b[s]) for s in sizes]
    result: dict[str, Any] = {"challenger": challenger, "incumbent": incumbent,
                              "batch_size": None, "wins": dict(zip(sizes, wins, strict=True))}
    if not sizes:
        result["note"] = "neither reached the target at any common batch size"
    elif all(wins):
        result["note"] = f"{challenger} is faster at every batch size studied"
    elif not wins[-1]:
        result["note"] = f"{challenger} does not overtake {incumbent} within the grid"
    else:
        first = len(wins)
        while first > 0 and wins[first - 1]:
            first -= 1
        result["batch_size"] = sizes[first]
        result["note"] = f"{challenger} is faster from batch size {sizes[first]} up"
    return result


def analyze(study: dict[str, Any]) -> dict[str, Any]:
    """Conclusions of a study result (the runner's output)."""
    cells = study["cells"]
    per_optimizer = {}
    for optimizer, group in _by_optimizer(cells).items():
        points = [(c["batch_size"], float(c["steps_to_target"])) for c in group if c["reached"]]
        fastest = min(group, key=_time)
        per_optimizer[optimizer] = {
            "steps_to_target": [{"batch_size": c["batch_size"], "steps": c["steps_to_target"],
                                 "reached": c["reached"]} for c in group],
            "regions": scaling_regions(points),
            "knee": fit_critical_batch(points),
            "fastest": None if not fastest["reached"] else
            {"batch_size": fastest["batch_size"], "time_to_target": fastest["time_to_target"]},
            "not_reached": [c["batch_size"] for c in group if not c["reached"]],
        }
    measured = measured_throughput(study.get("step_times"))
    # The time model's interleaved timings when there are any; else the runs' own clocks.
    curve = measured or throughput_curve(study["runs"])
    knee = curve_knee(curve) if curve else None
    reached = [c for c in cells if c["reached"]]
    best = min(reached, key=_time) if reached else None
    crossovers = [x for x in (crossover(cells, "adam", "sgd"), crossover(cells, "adam", "momentum"))
                  if x is not None]
    noise = study.get("noise")
    settings = verdict_settings(study)
    seeds = settings["seeds"]
    b_simple = training_noise_scale(noise)
    step_times = study.get("step_times")
    verdicts: dict[str, Any] = {
        "seeds": seeds, "coverage": median_coverage(seeds),
        "confidence": VERDICT_CONFIDENCE, "level": settings["level"],
        "looks": settings["looks"], "margin": settings["margin"],
        "accuracy_margin": settings["accuracy_margin"],
        "added_seeds": study.get("added_seeds"),
        "fastest": fastest_verdict(cells, settings, step_times),
        "optimizers": [x for x in (optimizer_comparison(cells, "adam", "sgd", settings, step_times),
                                   optimizer_comparison(cells, "adam", "momentum", settings,
                                                        step_times))
                       if x is not None],
        "per_optimizer": {},
        "throughput_knee": throughput_knee_verdict(step_times, settings),
        "step_time_spread": step_time_spread(step_times),
    }
    if study.get("auto_cells"):  # the adaptive batch size against each best fixed one
        verdicts["adaptive"] = auto_verdicts(study, settings)
    for optimizer, group in _by_optimizer(cells).items():
        b_crit = critical_batch_over_seeds(group)
        verdicts["per_optimizer"][optimizer] = {
            "regions": region_verdicts(group, settings),
            "b_crit": b_crit,
            "noise_agreement": noise_agreement(b_crit, b_simple, b_crit.get("n") or seeds),
            "generalization": generalization_verdict(group, settings),
        }
    return {
        "verdicts": verdicts,
        "per_optimizer": per_optimizer,
        "throughput": curve,
        "throughput_knee": None if knee is None else knee.batch_size,
        "throughput_plateau_reached": None if knee is None else knee.plateau_reached,
        "best": None if best is None else {
            "optimizer": best["optimizer"], "batch_size": best["batch_size"],
            "learning_rate": best["learning_rate"], "time_to_target": best["time_to_target"],
            "steps_to_target": best["steps_to_target"]},
        "crossovers": crossovers,
        "b_simple": b_simple,
        "b_simple_note": noise_scale_note(noise),
    }


def training_noise_scale(noise: dict[str, Any] | None) -> float | None:
    """B_simple over training: the ratio of the tr(Sigma) and |G|^2 estimates averaged over the
    measurement points after initialization. One point's |G|^2 near the target is small and
    noisy, so its ratio alone can be off by an order of magnitude. None when it is not a
    finding: no measurement, or an average estimate that is not positive (``noise_scale_note``
    says which)."""
    if not noise or not noise.get("points"):
        return None
    points = [p for p in noise["points"] if p["step"] > 0] or noise["points"]
    grad_sq = sum(p["grad_sq"] for p in points)
    trace = sum(p["trace_sigma"] for p in points)
    if not (grad_sq > 0 and trace > 0 and math.isfinite(grad_sq) and math.isfinite(trace)):
        return None
    return trace / grad_sq


def noise_scale_note(noise: dict[str, Any] | None) -> str:
    """Why ``training_noise_scale`` gave no value ('' when it gave one)."""
    if not noise or not noise.get("points"):
        return "not estimated: no measurement (--noise-points 0)"
    if training_noise_scale(noise) is not None:
        return ""
    points = [p for p in noise["points"] if p["step"] > 0] or noise["points"]
    grad_sq = sum(p["grad_sq"] for p in points)
    trace = sum(p["trace_sigma"] for p in points)
    pair = f"batch pair {noise.get('small_batch')}/{noise.get('big_batch')}"
    if not grad_sq > 0:
        return (f"not estimated: the |G|^2 estimate is not positive ({grad_sq:.3g}) with the "
                f"{pair}: the gradient is too small against its noise to measure with "
                f"{noise.get('draws')} draws")
    return (f"not estimated: the tr(Sigma) estimate is not positive ({trace:.3g}) with the "
            f"{pair}")


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
    looks = len(seed_schedule(seeds, max_seeds))
    return {"seeds": seeds, "max_seeds": max_seeds, "looks": looks, "level": look_level(looks),
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
                            level=settings["level"], margin=settings["margin"],
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
    grouped = _by_optimizer(cells)
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
        groups.setdefault(label, []).append(str(p["batch_size"]))
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
                                level=settings["level"], margin=settings["margin"],
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
        verdict = difference_verdict(values_a, values_b, level=settings["level"],
                                     margin=settings["accuracy_margin"], larger_is_better=True)
    else:
        verdict = ratio_verdict(values_a, values_b, level=settings["level"],
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
    both, pooled, t-interval at ``level``."""
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
        estimate, low, high = mean_interval(logs, level)
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
