"""The auto cells' verdicts: per optimizer, the adaptive batch size against the best fixed batch
size (the optimizer's fixed cell with the least time to target) on steps, samples and time to
target, each a paired-seed ratio like the study's other verdicts (``verdicts.ratio_verdict``).

Per seed: steps to target; samples = steps x batch size (the auto run: each range's steps x its
size up to the target step); time = the fixed cell's steps x its seconds per step, the auto
run's steps at each size x the fixed cells' seconds per step at that size
(``auto_cells.modelled_time``; the run's own clock where a size cannot be modelled).
"""

from __future__ import annotations

import math
from typing import Any

from kbackend.study.summaries import cell_seconds_per_step
from kbackend.study.verdicts import outcome_text, ratio_verdict, rounding_sd

# How an auto cell's time to target is modelled (the fixed cells': steps x step time).
AUTO_TIME_MODEL = "steps at each size x the fixed cells' step times"


def _budget(cell: dict[str, Any]) -> float | None:
    """A never-reached cell's median steps run (the lower bound of its steps)."""
    return None if cell.get("reached") or not cell.get("steps_run") else float(cell["steps_run"])


def auto_label(cell: dict[str, Any]) -> str:
    """``auto 16-128 (sqrt)``: an auto cell's name in the report."""
    auto = cell.get("auto") or {}
    return f"auto {auto.get('min')}-{auto.get('max')} ({auto.get('lr_scaling')})"


def auto_verdict(auto: dict[str, Any], cells: list[dict[str, Any]],
                 settings: dict[str, Any]) -> dict[str, Any]:
    """One optimizer's auto cell against its best fixed batch size: ``steps``, ``samples`` and
    ``time`` verdicts (A = auto, B = the fixed cell), the headline ``outcome`` the time's."""
    optimizer = auto["optimizer"]
    fixed = [c for c in cells if c["optimizer"] == optimizer and c.get("reached")
             and c.get("time_to_target") is not None]
    record: dict[str, Any] = {"optimizer": optimizer, "auto": auto.get("auto"),
                              "label": auto_label(auto)}
    if not fixed:
        return {**record, "best_fixed": None, "outcome": "not_resolved", "resolved": False,
                "seeds": 0, "text": f"{optimizer}: {auto_label(auto)} not compared: no fixed "
                                    "batch size reached the target"}
    best = min(fixed, key=lambda c: c["time_to_target"])
    size = int(best["batch_size"])
    steps_b = {s: float(v) for s, v in (best.get("seed_steps") or {}).items()}
    per_step = cell_seconds_per_step(best) or math.nan
    level, margin = settings["levels"], settings["margin"]
    floor = rounding_sd([auto, best])
    bounds = (_budget(auto), _budget(best))
    steps = ratio_verdict(auto.get("seed_steps") or {}, steps_b, level=level, margin=margin,
                          floor_sd=floor, bounds=bounds)
    samples_bounds = (None, None if bounds[1] is None else bounds[1] * size)
    samples = ratio_verdict(auto.get("seed_samples") or {}, {s: v * size for s, v in
                                                             steps_b.items()},
                            level=level, margin=margin, floor_sd=floor, bounds=samples_bounds)
    times = ratio_verdict(auto.get("seed_times") or {}, {s: v * per_step for s, v in
                                                         steps_b.items()},
                          level=level, margin=margin, floor_sd=floor)
    name_b = f"batch {size}"
    text = (f"{optimizer}: {auto_label(auto)} vs the best fixed batch size ({size}): time: "
            f"{outcome_text(times, 'auto', name_b, 'faster')}; steps: "
            f"{outcome_text(steps, 'auto', name_b, 'in fewer steps')}; samples: "
            f"{outcome_text(samples, 'auto', name_b, 'on fewer samples')}")
    return {**record, "best_fixed": size, "steps": steps, "samples": samples, "time": times,
            "outcome": times["outcome"], "resolved": times["resolved"], "seeds": times["seeds"],
            "cells": [[optimizer, "auto"], [optimizer, size]], "text": text}


def auto_verdicts(study: dict[str, Any], settings: dict[str, Any]) -> list[dict[str, Any]]:
    """Every auto cell's verdict (none in a study without ``auto``)."""
    return [auto_verdict(cell, study["cells"], settings) for cell in study.get("auto_cells") or []]
