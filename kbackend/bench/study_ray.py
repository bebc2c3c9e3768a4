"""The study on Ray benchmark: one small study with the local executor and on a local Ray
instance with 1 and 2 workers, side by side.

    python scripts/bench_study_ray.py [--quick] [--out DIR] [--backends jax] [--repeats N]

Each repeat runs the study (``seed_mlp`` on ``digits``: 2 optimizers x 2 batch sizes, 2 learning
rates x 2 seeds per cell; no noise scale, no time model) into a fresh store once per
configuration, in an order rotated by the repeat. A Ray configuration starts its own local
instance (127.0.0.1, ``workers`` CPUs, one cell per CPU) before its timer and shuts it down after:
its wall time holds the workers' start (a process importing Keras and the backend each), the
cells' shipping and their compilations, as a fresh study on Ray pays them. Reported: the median
wall time per configuration, its ratio to the local executor's, and per cell whether the Ray
study's results equal the local one's (same learning rate, reach and steps to target; best
validation metric and test accuracy within 1e-6). On a 2-core machine this measures Ray's
overhead, not a speed-up: two workers share the two cores with the driver. Without Ray
installed (``kbackend[ray]``) the Ray rows say so.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kbackend.backend_choice import active_backend
from kbackend.bench.spec import Benchmark, Rows, Settings
from kbackend.reports import markdown_table
from kbackend.study.config import RAY_EXTRA, StudyConfig
from kbackend.study.pipeline import run_study
from kbackend.study.ray_executor import start_ray
from kbackend.study.study_record import StudyRecord
from kbackend.training import Target

STUDY = StudyConfig(
    model="seed_mlp", dataset="digits", optimizers=("sgd", "adam"), batch_sizes=(32, 128),
    learning_rates={"sgd": (0.1, 0.3), "adam": (1e-3, 3e-3)}, max_steps=300, lr_extend=0,
    target=Target("val_accuracy", 0.93), seeds=2, noise_points=0, step_time_repeats=0,
    engine="native", population="off",
)
QUICK_STUDY = replace(STUDY, optimizers=("adam",), learning_rates={"adam": (3e-3,)},
                      seeds=1, max_steps=120)
CONFIGURATIONS = (("local", 0), ("ray", 1), ("ray", 2))  # (executor, local Ray workers)
TOLERANCE = 1e-6


def _label(executor: str, workers: int) -> str:
    return "local" if executor == "local" else f"ray, {workers} worker{'s' * (workers > 1)}"


def cells_equal(local: StudyRecord, other: StudyRecord) -> tuple[int, int, float]:
    """(cells equal, cells, largest metric difference): equal when the learning rate, reach and
    steps to target are identical and best metric and test accuracy within ``TOLERANCE``."""
    ours, theirs = ({c.key: c for c in study.cells} for study in (local, other))
    equal, worst = 0, 0.0
    for key, cell in ours.items():
        twin = theirs.get(key)
        if twin is None:
            continue
        same = all(getattr(twin, k) == getattr(cell, k)
                   for k in ("learning_rate", "reached", "steps_to_target", "seed_steps"))
        diffs = [abs(getattr(twin, k) - getattr(cell, k)) for k in ("best_metric", "test_accuracy")
                 if getattr(twin, k) is not None and getattr(cell, k) is not None]
        worst = max([worst, *diffs])
        equal += same and all(d <= TOLERANCE for d in diffs)
    return equal, len(ours), worst


def measure_study_ray(settings: Settings) -> Rows:
    """Wall time of the same study per executor, and the Ray studies' per-cell equality."""
    config = QUICK_STUDY if settings.quick else STUDY
    repeats = settings.rounds(1, 2)
    try:
        import ray  # deferred: Ray is an optional extra (kbackend[ray])
    except ImportError:
        ray = None
    configurations = [c for c in CONFIGURATIONS if c[0] == "local" or ray is not None]
    walls: dict[str, list[float]] = {_label(*c): [] for c in configurations}
    starts: dict[str, list[float]] = {_label(*c): [] for c in configurations}
    studies: dict[str, StudyRecord] = {}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(repeats):
            shift = repeat % len(configurations)
            for executor, workers in configurations[shift:] + configurations[:shift]:
                label = _label(executor, workers)
                study_config = replace(config, executor=executor, workers=workers)
                start = time.perf_counter()
                if executor == "ray":
                    start_ray(study_config, active_backend())
                starts[label].append(time.perf_counter() - start)
                try:
                    start = time.perf_counter()
                    result = run_study(study_config, Path(folder) / f"{repeat}-{executor}{workers}",
                                       show_progress=False, print_results=False)
                    walls[label].append(time.perf_counter() - start)
                finally:
                    if executor == "ray":
                        ray.shutdown()
                studies.setdefault(label, result.study)
    rows = []
    local = statistics.median(walls["local"])
    for executor, workers in CONFIGURATIONS:
        label = _label(executor, workers)
        row: dict[str, Any] = {"executor": label, "workers": workers,
                               "cells": len(studies["local"].cells),
                               "runs": len(studies["local"].runs)}
        if label not in walls:
            row["note"] = f"Ray is not installed: pip install '{RAY_EXTRA}'"
        else:
            equal, _, worst = cells_equal(studies["local"], studies[label])
            row.update(wall_s=statistics.median(walls[label]), walls_s=walls[label],
                       over_local=statistics.median(walls[label]) / local,
                       ray_start_s=statistics.median(starts[label]) if executor == "ray" else 0.0,
                       cells_equal=equal, max_metric_diff=worst)
        rows.append(row)
    return rows, {"repeats": repeats, "study": config.to_dict(), "backend": active_backend()}


def study_ray_table(payload: dict[str, Any]) -> str:
    """One row per backend and executor: median wall time, ratio to local, equal cells."""
    lines = []
    for row in payload["rows"]:
        if "wall_s" in row:
            figures = {"study wall s (median)": f"{row['wall_s']:.1f}",
                       "/ local": f"{row['over_local']:.2f}x",
                       "Ray start s": f"{row['ray_start_s']:.1f}" if row["workers"] else "-",
                       "cells equal to local": f"{row['cells_equal']}/{row['cells']}",
                       "max metric diff": f"{row['max_metric_diff']:.1g}"}
        else:
            figures = {"study wall s (median)": "n/a", "/ local": row["note"], "Ray start s": "",
                       "cells equal to local": "", "max metric diff": ""}
        lines.append({"backend": row["backend"], "executor": row["executor"],
                      "cells x runs": f"{row['cells']} x {row['runs']}", **figures})
    columns = ["backend", "executor", "cells x runs", "study wall s (median)", "/ local",
               "Ray start s", "cells equal to local", "max metric diff"]
    return (markdown_table(lines, columns)
            + "\n\nWall time of `run_study` per configuration (a fresh store each), median over "
              "interleaved repeats; Ray start: `ray.init` of a local instance, outside the wall "
              "time. Equal: same learning rate, reach and steps to target per seed; metrics "
              f"within {TOLERANCE:g}.")


BENCHMARKS = (
    Benchmark("bench_study_ray", "The same small study with the local executor and on a local "
              "Ray instance with 1 and 2 workers: wall time and per-cell result equality.",
              measure_study_ray, ["executor"], ["wall_s", "over_local", "cells_equal"],
              table=study_ray_table,
              note="interleaved repeats; each configuration a fresh store (and a fresh Ray "
                   "instance); on a 2-core machine this measures Ray's overhead"),
)
