"""Predicted on another device (``kbackend study --device-profile FILE``, issue 37 item 3).

A device profile is a step-time curve measured elsewhere for the study's model: seconds per
train step at each batch size. The study's time model (time to target = steps to target x
seconds per step at the cell's batch size) is applied to it: the steps come from the runs
trained here, the step times from the profile, interpolated linearly in log batch size x log
seconds between the profile's sizes, never extrapolated (a study batch size outside the
profile's range is a one-line error before any training). An auto cell's runs: each step
range's steps x the profile's time at its size (``summaries.ranges_time``).

Two formats are read: ``{"device": "...", "step_time_s": {"32": 0.0011, ...}}`` (optionally
``"model"`` and ``"dataset"``, checked against the study's) and ``kbackend advise --json``
output (its ``measurements.batch_size`` curve, ``step_ms`` per batch size; its model and
dataset must be the study's). The profile only re-models time: it is kept out of the study's
identity and of every run's key, so a resumed study with a new profile trains nothing.
"""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kbackend.errors import ConfigError, path_errors
from kbackend.escaping import markdown_text
from kbackend.io import JsonObject
from kbackend.reports import markdown_rows
from kbackend.stats import log_log_interpolate, median_interval
from kbackend.study.auto_verdicts import auto_label, auto_verdict, best_fixed
from kbackend.study.cell_verdicts import fastest_verdict, verdict_settings
from kbackend.study.study_record import Cell, StudyRecord
from kbackend.study.summaries import cell_seconds_per_step, ranges_time
from kbackend.study.verdicts import Verdict, format_value, outcome_text

# A step time outside these bounds is no measurement of a train step (a nanosecond is a few
# cycles; a day per step trains nothing): refused when the profile is read, so that the
# predictions (steps x seconds) stay finite and printable.
MIN_STEP_S = 1e-9
MAX_STEP_S = 86_400.0
MAX_BATCH = 2**31 - 1
EXPECTED = ('expected {"device": "...", "step_time_s": {"32": 0.0011, ...}} (seconds per train '
            "step by batch size, measured for this model) or `kbackend advise --json` output")
FORMATS = ("step_time_s", "advise")


@dataclass(frozen=True)
class DeviceProfile:
    """A step-time curve measured on another device: seconds per train step by batch size."""

    device: str
    source: str
    format: str  # one of FORMATS
    step_time_s: dict[int, float]  # batch size -> seconds per step, sorted by batch size
    model: str | None = None
    dataset: str | None = None

    @property
    def batch_range(self) -> tuple[int, int]:
        return min(self.step_time_s), max(self.step_time_s)

    def step_time(self, batch_size: int) -> float:
        """Seconds per step at ``batch_size``: the measured value, or the log-log interpolation
        between the two measured sizes around it; ValueError outside the measured range."""
        low, high = self.batch_range
        if not low <= batch_size <= high:
            raise ConfigError(f"batch size {batch_size} is outside the profile's {low}-{high}")
        if batch_size in self.step_time_s:
            return self.step_time_s[batch_size]
        interpolated = log_log_interpolate(self.step_time_s, batch_size)
        assert interpolated is not None  # inside the range, checked above
        return interpolated

    def to_dict(self) -> JsonObject:
        return {"device": self.device, "source": self.source, "format": self.format,
                "model": self.model, "dataset": self.dataset,
                "step_time_s": {str(b): t for b, t in self.step_time_s.items()}}


def _refuse(path: str, what: str) -> ConfigError:
    return ConfigError(f"Invalid --device-profile {path[:80]!r}: {what}; {EXPECTED}.")


def _batch_size(path: str, key: Any) -> int:
    """A batch size of the curve: a positive integer (a JSON object's key: its digits)."""
    if isinstance(key, int) and not isinstance(key, bool) and 1 <= key <= MAX_BATCH:
        return key
    if isinstance(key, str) and key.strip().isdigit() and len(key) <= 12 \
            and 1 <= int(key) <= MAX_BATCH:
        return int(key)
    raise _refuse(path, f"batch size {str(key)[:40]!r} is not a positive integer (at most "
                        f"{MAX_BATCH:,})")


def _seconds(path: str, size: int, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise _refuse(path, f"the step time at batch {size} is {str(value)[:40]!r}, not a "
                            "positive number of seconds")
    if not MIN_STEP_S <= value <= MAX_STEP_S:
        raise _refuse(path, f"the step time at batch {size} is {value:g} s, outside "
                            f"{MIN_STEP_S:g}-{MAX_STEP_S:g} s (a nanosecond to a day)")
    return float(value)


def load_profile(path: str) -> DeviceProfile:
    """The profile in ``path``; anything wrong is one ``ConfigError`` line naming the file."""
    with path_errors(path, "--device-profile"):
        found = Path(path).is_file()
    if not found:
        raise _refuse(path, "file not found")
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as error:
        # RecursionError: JSON nested deeper than Python's parser recurses
        reason = textwrap.shorten(str(error), width=80, placeholder=" ...")
        raise _refuse(path, f"not JSON ({type(error).__name__}: {reason})") from None
    if not isinstance(data, dict):
        raise _refuse(path, f"a JSON {type(data).__name__}, not an object")
    pairs: list[tuple[Any, Any]]
    if "step_time_s" in data:
        curve = data["step_time_s"]
        if not isinstance(curve, dict):
            raise _refuse(path, "step_time_s is not an object of batch size -> seconds")
        kind, pairs = "step_time_s", list(curve.items())
    elif isinstance(data.get("measurements"), dict) and "batch_size" in data["measurements"]:
        rows = data["measurements"]["batch_size"]
        if not isinstance(rows, list) or not all(isinstance(r, dict) and "batch_size" in r
                                                 and "step_ms" in r for r in rows):
            raise _refuse(path, "measurements.batch_size is not a list of rows with batch_size "
                                "and step_ms")
        kind = "advise"
        pairs = [(r["batch_size"], r["step_ms"] / 1e3 if isinstance(r["step_ms"], (int, float))
                  and not isinstance(r["step_ms"], bool) else r["step_ms"]) for r in rows]
    else:
        raise _refuse(path, "no step times (neither step_time_s nor measurements.batch_size)")
    if not pairs:
        raise _refuse(path, "no step times (the curve is empty)")
    curve_s: dict[int, float] = {}
    for key, value in pairs:
        size = _batch_size(path, key)
        if size in curve_s:
            raise _refuse(path, f"batch size {size} is given twice")
        curve_s[size] = _seconds(path, size, value)
    names = {}
    for name in ("device", "model", "dataset"):
        value = data.get(name)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise _refuse(path, f"{name} is {value!r}, not a name")
        names[name] = value
    device = names["device"]
    if device is None and kind == "advise":
        platform = next((r.get("value") for r in data.get("recommendations") or []
                         if isinstance(r, dict) and r.get("setting") == "device"), None)
        device = f"{platform or 'device'} ({data.get('backend', '?')}, kbackend advise)"
    return DeviceProfile(device or Path(path).stem, str(path), kind,
                         dict(sorted(curve_s.items())), names["model"], names["dataset"])


def check_profile(profile: DeviceProfile, model: str, dataset: str,
                  batch_sizes: tuple[int, ...]) -> None:
    """The profile fits the study: measured for its model and data (where it says) and covering
    every fixed batch size (the auto cells grow between them); else one ``ConfigError``."""
    for name, wanted in (("model", model), ("dataset", dataset)):
        given = getattr(profile, name)
        if given is not None and given != wanted:
            raise ConfigError(f"Invalid --device-profile {profile.source[:80]!r}: measured for "
                              f"{name} {given!r}, this study trains {wanted!r}; a step-time "
                              "curve holds only for the model and data it was measured with.")
    low, high = profile.batch_range
    outside = [b for b in batch_sizes if not low <= b <= high]
    if outside:
        raise ConfigError(f"Invalid --device-profile {profile.source[:80]!r}: it covers batch "
                          f"sizes {low}-{high}, the study's {outside} lie outside; step times are "
                          "interpolated, never extrapolated: measure those sizes too.")


def _fixed(cell: Cell, profile: DeviceProfile) -> dict[str, Any]:
    per_step = profile.step_time(int(cell.batch_size))
    steps = (cell.intervals or {}).get("steps_to_target") or {}
    interval = {k: steps[k] * per_step for k in ("median", "low", "high") if k in steps}
    return {"optimizer": cell.optimizer, "batch_size": cell.batch_size,
            "steps_to_target": cell.steps_to_target, "reached": cell.reached,
            "seconds_per_step_here": cell_seconds_per_step(cell), "time_to_target_here":
            cell.time_to_target, "seconds_per_step": per_step,
            "time_to_target": cell.steps_to_target * per_step
            if cell.reached and cell.steps_to_target is not None else None,
            "interval": {**steps, **interval},
            "seed_times": {s: v * per_step for s, v in (cell.seed_steps or {}).items()}}


def _auto(cell: Cell, profile: DeviceProfile) -> dict[str, Any]:
    times: dict[str, float] = {}
    low = int((cell.auto or {}).get("min") or profile.batch_range[0])
    for seed, steps in (cell.seed_steps or {}).items():
        ranges = (cell.ranges or {}).get(seed) or [{"step": 0, "batch_size": low}]
        seconds = ranges_time(ranges, int(steps), profile.step_time) \
            if math.isfinite(steps) else None
        times[seed] = math.inf if seconds is None else seconds
    finite = [t for t in times.values() if math.isfinite(t)]
    reached = bool(cell.reached and finite)
    return {"optimizer": cell.optimizer, "batch_size": cell.batch_size,
            "label": auto_label(cell), "auto": cell.auto, "reached": reached,
            "steps_to_target": cell.steps_to_target,
            "time_to_target_here": cell.time_to_target,
            "time_to_target": float(np.median(list(times.values()))) if reached else None,
            "interval": median_interval(list(times.values())), "seed_times": times}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b and math.isfinite(a) else None


def predict(study: StudyRecord, profile: DeviceProfile) -> dict[str, Any]:
    """Each cell's time to target on the profile's device, the fastest cell there (the study's
    paired-seed verdict, with the profile's step-time ratio as a known factor) and each auto
    cell against its optimizer's best fixed batch size there (``auto_verdict``)."""
    settings = verdict_settings(study)
    cells = [_fixed(c, profile) for c in study.cells]
    # the study's cells with the profile's times: what the study's verdicts read
    proxies = [replace(c, time_to_target=p["time_to_target"],
                       seconds_per_step={"median": p["seconds_per_step"]})
               for c, p in zip(study.cells, cells, strict=True)]
    fastest = fastest_verdict(proxies, settings)
    fastest = replace(fastest, text=fastest.text.replace(" s to target", " s to target there"))
    autos, adaptive = [], []
    for cell in study.auto_cells:
        predicted = _auto(cell, profile)
        autos.append(predicted)
        verdict = auto_verdict(replace(cell, seed_times=predicted["seed_times"]), proxies,
                               settings)
        best = next((p for p in cells if p["optimizer"] == cell.optimizer
                     and p["batch_size"] == verdict.best_fixed), None)
        best_here = best_fixed(study.cells, cell.optimizer)
        adaptive.append({
            **verdict.to_json(), "time_to_target": predicted["time_to_target"],
            "best_fixed_time": best["time_to_target"] if best else None,
            "ratio": _ratio(predicted["time_to_target"], best["time_to_target"] if best
                            else None),
            "best_fixed_here": best_here.batch_size if best_here else None,
            "ratio_here": _ratio(cell.time_to_target, best_here.time_to_target
                                 if best_here else None)})
    return {"profile": profile.to_dict(), "time_model": "steps to target here x the profile's "
            "seconds per step (log-log interpolation between its batch sizes)",
            "cells": cells, "auto_cells": autos, "fastest": fastest.to_json(), "adaptive": adaptive}


def conclusion_lines(study: StudyRecord) -> list[str]:
    """The predictions' findings (terminal and report): the fastest cell there and here, the
    adaptive cells against the best fixed batch size there and here."""
    predicted = study.device_profile
    if not predicted:
        return []
    device = predicted["profile"]["device"]
    reached = [c for c in study.cells if c.reached and c.time_to_target]
    best_here = min(reached, key=lambda c: c.seconds) if reached else None
    here = (f"; here: {best_here.optimizer} at batch {best_here.batch_size}, "
            f"{best_here.time_to_target:.3g} s" if best_here else "")
    lines = [f"Predicted on {device} (steps here x its step times): "
             f"{predicted['fastest']['text']}{here}."]
    for x in predicted["adaptive"]:
        if x.get("best_fixed") is None:
            lines.append(f"Predicted on {device}: {x['text']}.")
            continue
        ratio, ratio_here = (format_value(x[k], ".2f") for k in ("ratio", "ratio_here"))
        paired = outcome_text(Verdict.from_json(x["time"]), "auto", f"batch {x['best_fixed']}",
                              "faster")
        lines.append(
            f"Predicted on {device}, {x['optimizer']}: {x['label']} / the best fixed batch size "
            f"there ({x['best_fixed']}): time {ratio}x (here: {ratio_here}x vs batch "
            f"{x['best_fixed_here']}); paired seeds: {paired}.")
    return lines


def report_section(study: StudyRecord) -> list[str]:
    """The markdown report's "Predicted on <device>" table, its findings and caveats."""
    predicted = study.device_profile
    if not predicted:
        return []
    profile = predicted["profile"]
    device = markdown_text(profile["device"])  # the user's text, in a heading and table cells
    curve = ", ".join(f"{b}: {1e3 * t:.3g}" for b, t in profile["step_time_s"].items())
    header = ["optimizer", "batch", "steps", "ms/step here", "time here (s)",
              f"ms/step on {device}", f"time on {device} (s)"]

    def there(c: JsonObject) -> str:
        low, high = (format_value(c["interval"].get(end)) for end in ("low", "high"))
        return f"{format_value(c['time_to_target'])} [{low}, {high}]" if c["reached"] \
            else "not reached"

    rows = [[c["optimizer"], str(c["batch_size"]), format_value(c["steps_to_target"], ".0f"),
             format_value(c["seconds_per_step_here"] and 1e3 * c["seconds_per_step_here"]),
             format_value(c["time_to_target_here"]), format_value(1e3 * c["seconds_per_step"]),
             there(c)] for c in predicted["cells"]]
    rows += [[c["optimizer"], c["label"], format_value(c["steps_to_target"], ".0f"), "by range",
              format_value(c["time_to_target_here"]), "by range", there(c)]
             for c in predicted["auto_cells"]]
    lines = ["", f"## Predicted on {device}", "",
             f"Time to target predicted from a step-time curve measured on {device} "
             f"(--device-profile {markdown_text(profile['source'])}, {profile['format']} format; "
             "ms per step "
             f"by batch size: {curve}): each cell's steps to target trained here x the profile's "
             "seconds per step at its batch size, interpolated in log-log between the profile's "
             "sizes (never extrapolated); an auto cell: each step range's steps x the profile's "
             "time at its size. Medians over seeds, [min, max]. Only compute is modelled: the "
             "input pipeline, compilation, evaluation and the other device's own convergence "
             "(precision, reductions) are not; the curve must be measured for this model.", "",
             markdown_rows(header, rows).rstrip("\n"), ""]
    lines += [f"- {markdown_text(line)}" for line in conclusion_lines(study)]
    return lines
