"""Populations benchmark: a study cell's runs as one vmapped program vs one after another.

    python scripts/bench_population.py [--quick] [--out DIR] [--backends jax]
        [--batch-sizes 8,32,128] [--members 9] [--repeats N]

A study cell trains its learning rates x seeds (the default study: 3 x 3 = 9 runs). Per model
(the default study's MLP 40-256-128-10 on ``mnist1d_large``; the seed MLP 64-786-256-160-10 on
``digits``) and batch size, ``Runs.probe_population`` compiles both paths, then times
``members`` runs of the same steps as one population and one member alone, in interleaved
rounds; reported are samples/s per path (all members' samples over the median round) and their
ratio, the figure the study's ``--population auto`` decides by (population when it is at least
``POPULATION_MIN_SPEEDUP``). The one-by-one time is one member's x the members (a cell's
members have identical shapes), as the study's probe measures it. On TensorFlow there is no
population trainer (``backends/tensorflow/population.py``): its rows say so.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from kbackend.backend_choice import active_backend
from kbackend.bench.spec import Benchmark, Option, Rows, Settings, int_list
from kbackend.data.batching import steps_per_epoch
from kbackend.engines.native import Runs, model_values
from kbackend.models import ModelOptions, build_model
from kbackend.optim import OptimizerSpec
from kbackend.reports import markdown_table
from kbackend.study.populations import POPULATION_MIN_SPEEDUP
from kbackend.training import TrainConfig, workload_of

BATCH_SIZES = (8, 32, 128)
MODELS = (("mlp", "mnist1d_large"), ("seed_mlp", "digits"))
MEMBERS = 9  # 3 learning rates x 3 seeds: a default study cell
STEPS = 64  # timed steps per member and round, in calls of K = 16 (at most one epoch)
FUSED = 16


def _members(value: str) -> int:
    members = int(value)
    if members < 2:
        raise argparse.ArgumentTypeError(f"expected at least 2 members, got {value!r}")
    return members


def measure_population(settings: Settings) -> Rows:
    """samples/s of a population of ``members`` runs against the same runs one by one."""
    batch_sizes = settings.options.get("batch_sizes") or ((8,) if settings.quick else BATCH_SIZES)
    members = settings.options.get("members") or (2 if settings.quick else MEMBERS)
    steps = 16 if settings.quick else STEPS
    repeats = settings.rounds(2, 5)
    rows = []
    for model_name, dataset_name in MODELS[:1] if settings.quick else MODELS:
        dataset = workload_of(TrainConfig(model=model_name, dataset=dataset_name)).dataset
        runs = Runs(build_model(model_name, dataset.info, ModelOptions(seed=0)), dataset)
        values = [model_values(build_model(model_name, dataset.info, ModelOptions(seed=m)))
                  for m in range(members)]
        for batch in batch_sizes:
            fused = min(FUSED, steps_per_epoch(len(dataset.x_train), batch))
            configs = [TrainConfig(model=model_name, dataset=dataset_name, engine="native",
                                   optimizer=OptimizerSpec("adam", 1e-3 * (1 + m % 3)),
                                   batch_size=batch, fused_steps=fused, eval_every=fused,
                                   seed=m, model_options=ModelOptions(seed=m))
                       for m in range(members)]
            probe = runs.probe_population(configs, values, steps, repeats,
                                          min_speedup=POPULATION_MIN_SPEEDUP)
            row: dict[str, Any] = {"model": model_name, "dataset": dataset_name,
                                   "batch_size": batch, "members": members,
                                   "path": probe["path"]}
            if "population_s" in probe:
                samples = members * probe["steps"] * batch
                pop, seq = (float(np.median(probe[k])) for k in ("population_s", "sequential_s"))
                row.update(population_samples_per_s=samples / pop,
                           sequential_samples_per_s=samples / seq,
                           population_over_sequential=seq / pop,
                           spread=max(max(probe[k]) / min(probe[k])
                                      for k in ("population_s", "sequential_s")))
            else:
                row["note"] = probe["reason"]
            rows.append(row)
    return rows, {"steps": steps, "repeats": repeats, "members": members,
                  "backend": active_backend()}


def population_table(payload: dict[str, Any]) -> str:
    """One row per backend, model and batch size: both paths' samples/s and their ratio."""
    lines = []
    for row in payload["rows"]:
        if "population_samples_per_s" in row:
            figures = {"population samples/s": f"{row['population_samples_per_s']:,.0f}",
                       "one by one samples/s": f"{row['sequential_samples_per_s']:,.0f}",
                       "population / one by one": f"{row['population_over_sequential']:.2f}x",
                       "spread": f"{row['spread']:.2f}"}
        else:
            figures = {"population samples/s": "n/a", "one by one samples/s": "",
                       "population / one by one": row["note"], "spread": ""}
        lines.append({"backend": row["backend"], "model": f"{row['model']} ({row['dataset']})",
                      "batch": row["batch_size"], "members": row["members"], **figures,
                      "--population auto": row["path"]})
    columns = ["backend", "model", "batch", "members", "population samples/s",
               "one by one samples/s", "population / one by one", "spread", "--population auto"]
    return (markdown_table(lines, columns)
            + "\n\nSamples/s of all members over the median of the interleaved rounds; spread: "
              "slowest / fastest round of either path. Above 1.00x the population is faster.")


BENCHMARKS = (
    Benchmark("bench_population", "A study cell's runs (learning rates x seeds) as one vmapped "
              "population vs one after another: samples/s per model and batch size.",
              measure_population, ["model", "batch_size"],
              ["population_samples_per_s", "sequential_samples_per_s",
               "population_over_sequential"],
              options=(Option("--batch-sizes", "comma-separated batch sizes (default "
                              f"{','.join(map(str, BATCH_SIZES))})", int_list),
                       Option("--members", f"runs per population (default {MEMBERS})", _members)),
              table=population_table,
              note="interleaved rounds after one compiling and one warm-up round of each path"),
)
