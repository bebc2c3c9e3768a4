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
from dataclasses import dataclass
from functools import partial

from kbackend.io import JsonObject
from kbackend.study.study_record import Cell, StudyRecord
from kbackend.study.summaries import cell_seconds_per_step
from kbackend.study.verdicts import (
    Verdict,
    VerdictSettings,
    budget_steps,
    outcome_text,
    ratio_verdict,
    rounding_sd,
)

# How an auto cell's time to target is modelled (the fixed cells': steps x step time).
AUTO_TIME_MODEL = "steps at each size x the fixed cells' step times"


def best_fixed(cells: list[Cell], optimizer: str) -> Cell | None:
    """``optimizer``'s fixed cell with the least time to target (None: none reached)."""
    reached = [c for c in cells if c.optimizer == optimizer and c.reached
               and c.time_to_target is not None]
    return min(reached, key=lambda c: c.seconds, default=None)


def auto_label(cell: Cell) -> str:
    """``auto 16-128 (sqrt)``: an auto cell's name in the report."""
    auto = cell.auto or {}
    return f"auto {auto.get('min')}-{auto.get('max')} ({auto.get('lr_scaling')})"


@dataclass(frozen=True)
class AutoVerdict:
    """One optimizer's auto cell (``auto``: its bounds and rate scaling) against its best fixed
    batch size (``best_fixed``; None where no fixed cell reached): the ``steps``, ``samples``
    and ``time`` verdicts (A = auto, B = the fixed cell), the headline being the time's."""

    optimizer: str
    auto: dict[str, int | str] | None
    label: str
    text: str
    best_fixed: int | None = None
    steps: Verdict | None = None
    samples: Verdict | None = None
    time: Verdict | None = None

    @property
    def outcome(self) -> str:
        return "not_resolved" if self.time is None else self.time.outcome

    @property
    def resolved(self) -> bool:
        return self.outcome != "not_resolved"

    @property
    def seeds(self) -> int:
        return 0 if self.time is None else self.time.seeds

    def to_json(self) -> JsonObject:
        head = {"optimizer": self.optimizer, "auto": self.auto, "label": self.label,
                "best_fixed": self.best_fixed}
        if self.steps is None or self.samples is None or self.time is None:
            return {**head, "outcome": self.outcome, "resolved": self.resolved,
                    "seeds": self.seeds, "text": self.text}
        return {**head, "steps": self.steps.to_json(), "samples": self.samples.to_json(),
                "time": self.time.to_json(), "outcome": self.outcome,
                "resolved": self.resolved, "seeds": self.seeds,
                "cells": [[self.optimizer, "auto"], [self.optimizer, self.best_fixed]],
                "text": self.text}


def auto_verdict(auto: Cell, cells: list[Cell],
                 settings: VerdictSettings) -> AutoVerdict:
    """One optimizer's auto cell against its best fixed batch size: ``steps``, ``samples`` and
    ``time`` verdicts (A = auto, B = the fixed cell), the headline ``outcome`` the time's."""
    optimizer = auto.optimizer
    best = best_fixed(cells, optimizer)
    if best is None:
        return AutoVerdict(optimizer, auto.auto, auto_label(auto),
                           f"{optimizer}: {auto_label(auto)} not compared: no fixed "
                           "batch size reached the target")
    size = int(best.batch_size)
    steps_b = {s: float(v) for s, v in (best.seed_steps or {}).items()}
    per_step = cell_seconds_per_step(best) or math.nan
    verdict = partial(ratio_verdict, level=settings.levels, margin=settings.margin,
                      floor_sd=rounding_sd([auto, best]))
    budget = budget_steps(best)
    steps = verdict(auto.seed_steps or {}, steps_b, bounds=(budget_steps(auto), budget))
    samples = verdict(auto.seed_samples or {}, {s: v * size for s, v in steps_b.items()},
                      bounds=(None, None if budget is None else budget * size))
    times = verdict(auto.seed_times or {}, {s: v * per_step for s, v in steps_b.items()})
    name_b = f"batch {size}"
    text = (f"{optimizer}: {auto_label(auto)} vs the best fixed batch size ({size}): time: "
            f"{outcome_text(times, 'auto', name_b, 'faster')}; steps: "
            f"{outcome_text(steps, 'auto', name_b, 'in fewer steps')}; samples: "
            f"{outcome_text(samples, 'auto', name_b, 'on fewer samples')}")
    return AutoVerdict(optimizer, auto.auto, auto_label(auto), text, size, steps,
                       samples, times)


def auto_verdicts(study: StudyRecord, settings: VerdictSettings) -> list[AutoVerdict]:
    """Every auto cell's verdict (none in a study without ``auto``)."""
    return [auto_verdict(cell, study.cells, settings) for cell in study.auto_cells]
