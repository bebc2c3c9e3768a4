"""bench_adaptive ``--part timewin`` (issue 47, item 4): the time win of ``--batch-size auto``.

Per problem, seed and compile-cache state, three sides, each a whole ``train()`` in a fresh
child process (``runtime.child.run_in_child``), timed from the call to the evaluation that
reached the target (the trainer's build, the knee probe, every compilation and evaluation
included; the process start and the data load, alike for every side, not):

- ``auto``: ``--batch-size auto:MIN`` (MAX: the default, the throughput knee; the default
  ``sqrt`` scaling and estimator) at the rate found best at MIN;
- ``fixed MIN``: fixed MIN at that rate (the user's alternative without a study); goal:
  auto / fixed MIN <= ``GOALS["fixed_min"]`` (0.7);
- ``best fixed``: the best fixed size at its own tuned rate; goal: auto / best <=
  ``GOALS["best_fixed"]`` (1.2).

Cache states: ``cold``: every run gets an empty ``KBACKEND_CACHE_DIR`` (compile caches and the
stored knee probe empty: a user's first run; generated data files are copied in); ``warm``: one
folder per problem, filled first by an untimed run of each side (seed ``WARM_FILL_SEED``). The
sides alternate, their order rotated seed by seed, cold and warm interleaved per seed.

Rates and the best fixed size: ``--study DIR`` (a ``kbackend study`` report folder or its
summary.json) gives the problem (model, dataset, target), the optimizer of its recommended
cell, that optimizer's best rate at MIN (``--auto-min``, else the study's smallest batch size)
and the recommended cell (``recommend.ranked_cells``' first) as the best fixed size. Without
one, ``PROBLEMS``' rates, each overridable with ``--min-rate``, ``--best-batch``, ``--best-rate``:

- ``mnist``: seed_mlp on MNIST (from ``--data-dir`` / ``KBACKEND_DATA_DIR``; skipped with one
  line if missing), val_accuracy 0.97, adam, MIN 32 at 1e-3 (Keras's default rate), best fixed
  512 at 2.53e-3 (kbackend's MNIST study, the recipe of bench_time_to_target), evaluation every
  48 steps, 10 epochs at most;
- ``mnist1d_large``: mlp, val_accuracy 0.65, adam, MIN 8 at 1e-3, best fixed 128 at 4e-3 (the
  stored study of docs/adaptive.md "In the study": adam's fastest cell), evaluation every 24
  steps, 20 epochs at most;
- ``fashion_mnist``: seed_mlp on Fashion-MNIST (from the data folder, as MNIST), val_accuracy
  0.88, adam, MIN 32 at 1e-3, best fixed 512 at 3e-3 (the fastest of 256 at 2e-3, 512 at 2e-3
  and 3e-3, 1024 at 3e-3 and 5e-3, one JAX seed each: 7.1-9.4 s; docs/adaptive.md), evaluation
  every 48 steps, 20 epochs at most: the second problem whose best fixed run trains 5 s or more;
- ``--quick``: seed_mlp on digits to 0.9, auto:8:128 (no knee probe) at 3e-3, best fixed 32
  at 3e-3, 3 epochs, one seed, cold only: a smoke run.

Reported per problem, backend and cache state: each side's wall to the target (median [min,
max]) and steps; per goal the geometric mean of the paired per-seed ratios with its 95%
t-interval (``verdicts.mean_interval`` on the log ratios, as bench_tuner), met (estimate <=
bound) and resolved (the interval excludes the bound). A run that never reaches the target
counts at its whole ``train()`` wall, a lower bound of its time to the target: an auto miss
makes that seed's ratio a lower bound, so "met" is then never claimed and "not met" is resolved
only by an interval wholly above the bound; a comparator's miss, the other way round.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from kbackend.adaptive import AutoBatchSize
from kbackend.backend_choice import active_backend
from kbackend.bench.spec import geometric_interval, say, spread, spread_text
from kbackend.data.sources import cache_dir
from kbackend.errors import ConfigError, DataError
from kbackend.models import ModelOptions
from kbackend.optim import OptimizerSpec
from kbackend.reports import markdown_rows
from kbackend.runtime.child import run_in_child
from kbackend.study.pipeline import load_summaries
from kbackend.study.recommend import ranked_cells
from kbackend.study.study_record import StudyRecord
from kbackend.training import Target, TrainConfig, train, workload_of

LEVEL = 0.95
GOALS = {"fixed_min": 0.7, "best_fixed": 1.2}  # auto / other, wall to the target
SIDES = ("auto", "fixed_min", "best_fixed")
WARM_FILL_SEED = 1000  # the untimed runs that fill a warm cache: not one of the timed seeds
CHILD_TIMEOUT_S = 1800.0
FUSED_STEPS = 8

PROBLEMS: dict[str, dict[str, Any]] = {
    "mnist": {"model": "seed_mlp", "dataset": "mnist", "target": 0.97, "optimizer": "adam",
              "auto_min": 32, "min_rate": 1e-3, "best_batch": 512, "best_rate": 2.53e-3,
              "eval_every": 48, "epochs": 10},
    "mnist1d_large": {"model": "mlp", "dataset": "mnist1d_large", "target": 0.65,
                      "optimizer": "adam", "auto_min": 8, "min_rate": 1e-3, "best_batch": 128,
                      "best_rate": 4e-3, "eval_every": 24, "epochs": 20},
    "fashion_mnist": {"model": "seed_mlp", "dataset": "fashion_mnist", "target": 0.88,
                      "optimizer": "adam", "auto_min": 32, "min_rate": 1e-3, "best_batch": 512,
                      "best_rate": 3e-3, "eval_every": 48, "epochs": 20},
}
QUICK_PROBLEM = {"model": "seed_mlp", "dataset": "digits", "target": 0.9, "optimizer": "adam",
                 "auto_min": 8, "min_rate": 3e-3, "best_batch": 32, "best_rate": 3e-3,
                 "eval_every": 40, "epochs": 3, "auto_max": 128}
DEFAULT_CACHES = ("cold", "warm")
DEFAULT_SEEDS = (0, 1, 2, 3, 4)


# -- the problems -----------------------------------------------------------------------------
def study_problem(path: str, auto_min: int | None) -> dict[str, Any]:
    """The problem and rates of a stored study (see the module): one ``ConfigError`` line when
    it has no recommended cell or no cell of that optimizer at MIN."""
    (summary,) = load_summaries([path])
    study = StudyRecord.from_json(summary)
    ranked = ranked_cells(study)
    if not ranked:
        raise ConfigError(f"Invalid --study {path!r}: no cell reached the target.")
    best = ranked[0]
    optimizer = best.optimizer
    sizes = sorted(c.batch_size for c in study.cells if c.optimizer == optimizer
                   and isinstance(c.batch_size, int))
    minimum = auto_min or sizes[0]
    at_min = [c for c in study.cells if c.optimizer == optimizer
              and c.batch_size == minimum and math.isfinite(c.learning_rate)]
    if not at_min:
        raise ConfigError(f"Invalid --study {path!r}: no {optimizer} cell at batch size "
                          f"{minimum} (its sizes: {sizes}); pass --auto-min with one of them.")
    config = summary["config"]
    return {"model": config["model"], "dataset": config["dataset"],
            "target": float(config["target"]["value"]), "optimizer": optimizer,
            "auto_min": minimum, "min_rate": float(at_min[0].learning_rate),
            "best_batch": int(best.batch_size), "best_rate": float(best.learning_rate),
            "eval_every": int(config.get("eval_every") or 0) or PROBLEMS["mnist"]["eval_every"],
            "epochs": int(config.get("epochs") or 20), "source": f"study {path}"}


def problems(quick: bool, given: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The problems to measure, by name: the study's, the quick one, or ``--problems``
    (default every one of ``PROBLEMS``), with the rate options applied."""
    if given.get("study"):
        chosen = {"study": study_problem(given["study"], given.get("auto_min"))}
    elif quick:
        chosen = {"digits": {**QUICK_PROBLEM, "source": "quick defaults"}}
    else:
        names = given.get("problems") or list(PROBLEMS)
        chosen = {n: {**PROBLEMS[n], "source": "defaults (no --study)"} for n in names}
    for problem in chosen.values():
        for name in ("auto_min", "min_rate", "best_batch", "best_rate", "eval_every", "epochs"):
            if given.get(name) is not None and not (name == "auto_min" and given.get("study")):
                problem[name] = given[name]
    return chosen


# -- one run, in a child process --------------------------------------------------------------
def run_side(model: str, dataset: str, target: float, optimizer: str, rate: float,
             batch_size: int, auto: bool, seed: int, eval_every: int, epochs: int,
             jit: bool, data_dir: str | None = None,
             auto_max: int | None = None) -> dict[str, Any]:
    """One whole ``train()`` (the child's target): its wall to the target from the call (None
    where it never reached), its whole wall, steps and auto's step ranges."""
    config = TrainConfig(model=model, dataset=dataset, engine="native", seed=seed,
                         model_options=ModelOptions(seed=seed), batch_size=batch_size,
                         adaptive_batch=AutoBatchSize(batch_size, auto_max) if auto else None,
                         optimizer=OptimizerSpec(optimizer, rate), epochs=epochs,
                         fused_steps=FUSED_STEPS, eval_every=eval_every,
                         on_divergence="record", target=Target("val_accuracy", target),
                         data_dir=data_dir, jit_compile=jit)
    data = workload_of(config).dataset  # the same for every side: not timed
    evals: dict[int, float] = {}

    class Clock:
        """A reporter that notes when each evaluation's record arrives."""

        def epoch_end(self, epoch: int, epochs: int, record: dict[str, Any]) -> None:
            evals[int(record["step"])] = time.perf_counter()

    start = time.perf_counter()
    history = train(config, dataset=data, reporter=Clock()).history
    whole = time.perf_counter() - start
    reached = history.record.target_reached
    record = history.record.adaptive_batch or {}
    ranges = record.get("ranges") or []
    return {"wall_s": evals[int(reached["step"])] - start if reached else None,
            "run_wall_s": whole, "steps": int(reached["step"]) if reached else None,
            "steps_run": history.steps_run, "compile_s": history.timing.get("compile_time"),
            "adaptive": {"ranges": [{k: r.get(k) for k in ("step", "batch_size", "b_simple")}
                                    for r in ranges],
                         "maximum": record.get("max"),
                         "probe_seconds": (record.get("knee_probe") or {}).get("probe_seconds")}
            if auto else None}


def side_kwargs(problem: dict[str, Any], side: str, seed: int, opts: dict[str, Any]
                ) -> dict[str, Any]:
    """``run_side``'s arguments for ``side`` of ``problem``."""
    best = side == "best_fixed"
    return {"model": problem["model"], "dataset": problem["dataset"],
            "target": problem["target"], "optimizer": problem["optimizer"],
            "rate": problem["best_rate"] if best else problem["min_rate"],
            "batch_size": problem["best_batch"] if best else problem["auto_min"],
            "auto": side == "auto", "seed": seed, "eval_every": problem["eval_every"],
            "epochs": problem["epochs"], "jit": opts["jit"], "data_dir": opts["data_dir"],
            "auto_max": problem.get("auto_max")}


def _child(problem: dict[str, Any], side: str, seed: int, cache: Path,
           opts: dict[str, Any]) -> dict[str, Any]:
    return run_in_child("kbackend.bench.adaptive_timewin:run_side", active_backend(),
                        side_kwargs(problem, side, seed, opts), timeout_s=CHILD_TIMEOUT_S,
                        extra_env={"KBACKEND_CACHE_DIR": str(cache)})


def _fresh_cache(root: Path, name: str) -> Path:
    """An empty cache folder but for the generated data files of this process's cache (so a
    cold run compiles afresh without generating its data again)."""
    folder = root / name
    folder.mkdir(parents=True)
    for data_file in cache_dir().glob("mnist1d-*.npz"):
        shutil.copy2(data_file, folder / data_file.name)
    return folder


# -- the measurement --------------------------------------------------------------------------
def _ensure_data(problem: dict[str, Any], opts: dict[str, Any]) -> str | None:
    """None when the problem's data loads here (generated data is cached for the children),
    else the one line that says why it is skipped."""
    try:
        workload_of(TrainConfig(model=problem["model"], dataset=problem["dataset"],
                                data_dir=opts["data_dir"]))
    except DataError as error:
        return f"skipped: {error}"
    return None


def measure_problem(name: str, problem: dict[str, Any], opts: dict[str, Any]
                    ) -> list[dict[str, Any]]:
    """Every run of one problem (one row each), interleaved as the module says."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kbackend-timewin-") as tmp:
        root = Path(tmp)
        warm = _fresh_cache(root, "warm") if "warm" in opts["caches"] else None
        if warm is not None:
            for side in SIDES:  # untimed: fills the warm folder (programs, the knee probe)
                _child(problem, side, WARM_FILL_SEED, warm, opts)
        for index, seed in enumerate(opts["seeds"]):
            order = SIDES[index % 3:] + SIDES[:index % 3]
            for cache in opts["caches"]:
                for side in order:
                    folder = warm if cache == "warm" else _fresh_cache(root, f"{seed}-{side}")
                    run = _child(problem, side, seed, folder or root, opts)
                    rows.append({"part": "timewin", "case": f"{name} {cache} seed {seed} {side}",
                                 "problem": name, "cache": cache, "seed": seed, "side": side,
                                 "first": order[0], "load": os.getloadavg()[0], **run})
                    say(f"{name} {cache} seed {seed} {side:10s}: wall to target "
                        f"{_seconds(run['wall_s'])} (run {run['run_wall_s']:.2f} s), steps "
                        f"{run['steps']}")
    return rows


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


# -- the summary ------------------------------------------------------------------------------
def _time(run: dict[str, Any]) -> float:
    """A run's wall to the target; never reached: its whole run, a lower bound of it."""
    return run["wall_s"] if run["wall_s"] is not None else run["run_wall_s"]


def goal_verdict(auto: dict[int, dict[str, Any]], other: dict[int, dict[str, Any]],
                 bound: float) -> dict[str, Any]:
    """auto / other over the seeds both sides ran (runs by seed): the geometric mean of the
    per-seed ratios with its ``LEVEL`` t-interval, met and resolved as the module says."""
    seeds = sorted(set(auto) & set(other))
    logs = [math.log(_time(auto[s]) / _time(other[s])) for s in seeds]
    auto_missed = sum(auto[s]["wall_s"] is None for s in seeds)
    other_missed = sum(other[s]["wall_s"] is None for s in seeds)
    record: dict[str, Any] = {"bound": bound, "seeds": len(seeds), "level": LEVEL,
                              "auto_missed": auto_missed, "other_missed": other_missed}
    if not logs:
        return {**record, "ratio": None, "low": None, "high": None, "met": False,
                "resolved": False}
    ratio, low_r, high_r = geometric_interval(logs, LEVEL)
    met = ratio <= bound and not auto_missed
    if met:  # a comparator's miss only makes the ratio larger than it is: met stands
        resolved = high_r is not None and high_r <= bound
    else:  # an auto miss only makes the ratio smaller than it is: "not met" stands
        resolved = low_r is not None and low_r > bound and not other_missed
    return {**record, "ratio": ratio, "low": low_r, "high": high_r, "met": met,
            "resolved": resolved}


def summarize(rows: list[dict[str, Any]], chosen: dict[str, dict[str, Any]]
              ) -> list[dict[str, Any]]:
    """One ``timewin goals`` row per problem and cache state: each side's wall and steps to the
    target, the two goals' verdicts."""
    out = []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("part") == "timewin":
            groups.setdefault((row["problem"], row["cache"]), []).append(row)
    for (name, cache), runs in groups.items():
        by_side = {side: {r["seed"]: r for r in runs if r["side"] == side} for side in SIDES}
        problem = chosen.get(name, {})
        summary: dict[str, Any] = {
            "part": "timewin goals", "case": f"{name} {cache}", "problem": name,
            "cache": cache, "setup": {k: problem.get(k) for k in (
                "model", "dataset", "target", "optimizer", "auto_min", "min_rate",
                "best_batch", "best_rate", "eval_every", "source")}}
        for side, seeds in by_side.items():
            summary[side] = {"wall_s": spread([r["wall_s"] for r in seeds.values()]),
                             "steps": spread([r["steps"] for r in seeds.values()]),
                             "reached": sum(r["wall_s"] is not None for r in seeds.values()),
                             "seeds": len(seeds)}
        summary["goals"] = {goal: goal_verdict(by_side["auto"], by_side[goal], bound)
                            for goal, bound in GOALS.items()}
        out.append(summary)
        say(f"{name} {cache}: " + "; ".join(
            f"auto / {goal} {_ratio_text(summary['goals'][goal])}" for goal in GOALS))
    return out


def _ratio_text(verdict: dict[str, Any]) -> str:
    if verdict["ratio"] is None:
        return "no pairs"
    interval = ("unbounded" if verdict["high"] is None
                else f"[{verdict['low']:.2f}, {verdict['high']:.2f}]")
    state = "met" if verdict["met"] else "not met"
    resolved = "" if verdict["resolved"] else ", not resolved"
    missed = "".join(f", {verdict[k]} seed(s) {who} never reached" for k, who in (
        ("auto_missed", "auto"), ("other_missed", "the other side")) if verdict[k])
    return (f"{verdict['ratio']:.2f}x {interval} (goal <= {verdict['bound']}x: {state}"
            f"{resolved}{missed})")


def timewin(opts: dict[str, Any], given: dict[str, Any], quick: bool) -> list[dict[str, Any]]:
    """``--part timewin``: every problem's runs, then a goals row per problem and cache."""
    chosen = problems(quick, given)
    rows: list[dict[str, Any]] = []
    for name, problem in chosen.items():
        skipped = _ensure_data(problem, opts)
        if skipped:
            say(f"{name}: {skipped}")
            rows.append({"part": "timewin goals", "case": f"{name} skipped", "problem": name,
                         "skipped": skipped})
            continue
        rows += measure_problem(name, problem, opts)
    return rows + summarize(rows, chosen)


def timewin_options(quick: bool, given: dict[str, Any]) -> dict[str, Any]:
    """The part's seeds and cache states: given, else the quick or full defaults."""
    return {"seeds": given.get("seeds") or ([0] if quick else list(DEFAULT_SEEDS)),
            "caches": given.get("caches") or (["cold"] if quick else list(DEFAULT_CACHES))}


# -- the tables -------------------------------------------------------------------------------
def _side_text(side: dict[str, Any], fmt: str, field: str) -> str:
    return f"{spread_text(side[field], fmt)} ({side['reached']}/{side['seeds']})"


def tables(rows: list[dict[str, Any]]) -> list[str]:
    """The part's two tables (none without its rows): each side's wall and steps to the
    target, then the goals."""
    goals = [r for r in rows if r.get("part") == "timewin goals" and not r.get("skipped")]
    out = [f"Time win, skipped: {r['problem']}: {r['skipped']}" for r in rows
           if r.get("part") == "timewin goals" and r.get("skipped")]
    if not goals:
        return out
    out.append("Time win: wall seconds to the target per side, a whole train() in a fresh "
               "process (median [min, max], reached/seeds), and steps to the target:\n\n"
               + markdown_rows(
                   ["backend", "problem", "cache", "auto:MIN s", "fixed MIN s", "best fixed s",
                    "auto steps", "fixed MIN steps", "best fixed steps"],
                   ([r["backend"], _setup_text(r), r["cache"],
                     *(_side_text(r[side], ".2f", "wall_s") for side in SIDES),
                     *(_side_text(r[side], ".0f", "steps") for side in SIDES)]
                    for r in goals)))
    out.append("Time win goals: auto / other, geometric mean of the paired per-seed ratios "
               "with its 95% t-interval:\n\n" + markdown_rows(
                   ["backend", "problem", "cache", "against", "ratio [95%]", "goal", "verdict"],
                   ([r["backend"], r["problem"], r["cache"], goal.replace("_", " "),
                     _ratio_cell(r["goals"][goal]), f"<= {GOALS[goal]}x",
                     _verdict_cell(r["goals"][goal])]
                    for r in goals for goal in GOALS)))
    return out


def _setup_text(row: dict[str, Any]) -> str:
    setup = row.get("setup") or {}
    if not setup.get("model"):
        return row["problem"]
    return (f"{row['problem']} ({setup['model']}, {setup['optimizer']}, MIN {setup['auto_min']}"
            f" @ {setup['min_rate']:g}, best {setup['best_batch']} @ {setup['best_rate']:g}, "
            f"to {setup['target']:g})")


def _ratio_cell(verdict: dict[str, Any]) -> str:
    if verdict["ratio"] is None:
        return "-"
    if verdict["high"] is None:
        return f"{verdict['ratio']:.2f} (unbounded)"
    return f"{verdict['ratio']:.2f} [{verdict['low']:.2f}, {verdict['high']:.2f}]"


def _verdict_cell(verdict: dict[str, Any]) -> str:
    text = ("met" if verdict["met"] else "not met") + \
        ("" if verdict["resolved"] else ", not resolved")
    for key, who in (("auto_missed", "auto"), ("other_missed", "other")):
        if verdict[key]:
            text += f"; {who} missed {verdict[key]}/{verdict['seeds']}"
    return text
