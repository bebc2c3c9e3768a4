"""Three-way verdicts on paired seeds, sequential seeds and the frontier: the intervals'
coverage and the sequential rule's error checked by simulation (NumPy, no training), the
outcome logic table-driven, and small planted studies that add seeds or stop at their budget."""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import replace

import numpy as np
import pytest

from kbackend.cli import main
from kbackend.errors import ConfigError
from kbackend.study.cell_verdicts import verdict_settings
from kbackend.study.config import StudyConfig
from kbackend.study.executor import StudyRunner
from kbackend.study.plots import pareto_cells
from kbackend.study.report_sections import frontier_rows
from kbackend.study.store import ResultStore
from kbackend.study.study_record import StudyRecord
from kbackend.study.verdicts import (
    CALIBRATION_STUDIES,
    DEFAULT_MAX_SEEDS,
    VERDICT_CONFIDENCE,
    LookLevels,
    Verdict,
    could_resolve,
    decide,
    difference_verdict,
    joint_miss,
    mean_interval,
    open_bound,
    outcome_text,
    ratio_verdict,
    seed_schedule,
    t_quantile,
    trimmed_mean,
)
from kbackend.training import Target
from tests.test_study_executor import _fake_history, _one_cell


def _seeds(values) -> dict[str, float]:
    return {str(i): float(v) for i, v in enumerate(values)}


@pytest.mark.parametrize(("n", "spread"), [(3, "lognormal"), (5, "lognormal"), (10, "lognormal"),
                                          (3, "skewed"), (10, "skewed")])
def test_the_paired_ratio_interval_covers_the_true_ratio_at_its_level(n, spread):
    """Seed-to-seed log ratios drawn around a known true log ratio: the 90% interval holds it in
    90% of 3,000 studies with a log-normal spread (exact), and in at least 85% with a strongly
    skewed one (gamma, shape 2: 86-88% measured, the t-interval's known weakness)."""
    rng = np.random.default_rng(n)
    truth, level, trials = math.log(1.3), 0.9, 3000
    if spread == "lognormal":
        draws = truth + rng.normal(0.0, 0.2, size=(trials, n))
    else:  # skewed: gamma with shape 2, centred on its mean
        draws = truth + (rng.gamma(2.0, 0.1, size=(trials, n)) - 0.2)
    covered = 0
    for logs in draws:
        _, low, high = mean_interval(list(logs), level)
        covered += low <= truth <= high
    if spread == "lognormal":
        assert abs(covered / trials - level) < 0.02
    else:
        assert level - 0.05 < covered / trials < level + 0.02


def test_step_time_rounds_widen_the_time_ratio_to_its_level():
    """Time = steps x step time: the steps' seed ratios and the step times' round ratios are two
    samples; their summed interval covers the sum of both true log ratios at its level."""
    rng = np.random.default_rng(7)
    covered, trials = 0, 3000
    for _ in range(trials):
        seeds = list(rng.normal(0.3, 0.2, size=5))
        rounds = list(rng.normal(-0.1, 0.05, size=5))
        _, low, high = mean_interval(seeds, 0.9, rounds=rounds)
        covered += low <= 0.2 <= high
    assert abs(covered / trials - 0.9) < 0.02


def test_trimmed_rounds_cover_the_ratio_between_bursts_of_load():
    """Ten rounds of step-time log ratios spread 0.1 around -0.1, each round with a 10% chance of
    a burst that moves it by +-1.5 (one cell slowed, as measured at load 6-14): the trimmed
    round mean's interval still covers -0.1 + the seeds' 0.3 in 90% (+-3 points) of studies, and
    its median width is under half the plain mean's, whose coverage the bursts push up to ~99%
    at the cost of width."""
    rng = np.random.default_rng(11)
    covered, widths, plain_widths, trials = 0, [], [], 3000
    for _ in range(trials):
        seeds = list(rng.normal(0.3, 0.1, size=5))
        bursts = rng.random(10) < 0.1
        rounds = rng.normal(-0.1, 0.1, size=10) + bursts * rng.choice([-1.5, 1.5], size=10)
        _, low, high = mean_interval(seeds, 0.9, rounds=list(rounds))
        covered += low <= 0.2 <= high
        widths.append(high - low)
        plain = rounds.mean() + 0.3, rounds.std(ddof=1) / math.sqrt(10)
        plain_widths.append(2 * 1.83 * math.hypot(plain[1], np.std(seeds, ddof=1) / math.sqrt(5)))
    assert abs(covered / trials - 0.9) < 0.03
    assert np.median(widths) < 0.5 * np.median(plain_widths)


def test_trimmed_mean_is_the_plain_mean_below_five_values_and_drops_the_ends_above():
    assert trimmed_mean([1.0, 2.0, 4.0]) == pytest.approx((7 / 3, np.var([1, 2, 4], ddof=1) / 3, 2))
    mean, variance, df = trimmed_mean([0.0, 0.1, 0.2, 0.3, 9.0])  # g = 1: 0.0 and 9.0 dropped
    assert mean == pytest.approx(0.2) and df == 2
    winsorized = [0.1, 0.1, 0.2, 0.3, 0.3]
    assert variance == pytest.approx(4 * np.var(winsorized, ddof=1) / (3 * 2))


def test_an_open_comparison_states_the_tightest_bound_its_interval_supports():
    """Not resolved: "within 1.3x either way" from the larger of high and 1/low (a ratio), or
    the larger end in points (a difference); answered or unbounded verdicts state none."""
    ratio = Verdict("ratio", seeds=3, level=0.95, margin=0.2, censored=False, estimate=1.0,
                    low=0.8, high=1.25, outcome="not_resolved")
    assert open_bound(ratio) == "within 1.2x either way"
    assert open_bound(replace(ratio, low=0.5)) == "within 2x either way"
    assert "A and B within 2x either way" in outcome_text(replace(ratio, low=0.5), "A", "B",
                                                          "faster")
    assert open_bound(replace(ratio, outcome="a")) is None
    assert open_bound(replace(ratio, low=-math.inf)) is None
    difference = replace(ratio, kind="difference", low=-0.004, high=0.021)
    assert open_bound(difference) == "within 2.1 pt either way"


def look_level(looks, confidence=VERDICT_CONFIDENCE):
    """Bonferroni's equal split: each of ``looks`` intervals at 1 - alpha / looks (the baseline
    the calibrated ``LookLevels`` are compared with)."""
    return 1.0 - (1.0 - confidence) / max(1, looks)


def _sequential(rng, truth, spread, max_seeds, level, trials, margin=0.1):
    """Simulated studies of one comparison under the sequential rule: (outcomes, seeds used)."""
    schedule = seed_schedule(3, max_seeds)
    outcomes, used = [], []
    for _ in range(trials):
        logs = list(truth + rng.normal(0.0, spread, size=max_seeds))
        for count in schedule:
            a = {str(i): math.exp(v) for i, v in enumerate(logs[:count])}
            b = {str(i): 1.0 for i in range(count)}
            verdict = ratio_verdict(a, b, level=level, margin=margin)
            final = level.final if isinstance(level, LookLevels) else level
            if verdict.resolved or not could_resolve(verdict, max_seeds, final):
                break
        outcomes.append(verdict.outcome)
        used.append(count)
    return outcomes, used


def test_sequential_seeds_keep_wrong_verdicts_under_the_stated_share_when_equal():
    """Truth "equal" (ratio 1, seeds spread 20%): with each look at level 1 - 0.1 / looks, at most
    10% of the verdicts say A or B is better, however the rounds stopped; reading each look at
    90% instead (the stopping rule not accounted for) says so more often."""
    rng = np.random.default_rng(1)
    looks = len(seed_schedule(3, 10))
    counted, used = _sequential(rng, 0.0, 0.2, 10, look_level(looks), 2000)
    wrong = sum(o in ("a", "b") for o in counted) / len(counted)
    assert wrong <= (1 - VERDICT_CONFIDENCE) + 0.02
    naive, _ = _sequential(np.random.default_rng(1), 0.0, 0.2, 10, VERDICT_CONFIDENCE, 2000)
    assert sum(o in ("a", "b") for o in naive) / len(naive) > wrong
    assert max(used) <= 10


def test_sequential_seeds_resolve_a_known_difference_in_the_right_direction():
    """Truth: A takes 1.6x B's time (seeds spread 20%): resolved B better in most studies, with
    more seeds than the first 3, and never A."""
    rng = np.random.default_rng(2)
    looks = len(seed_schedule(3, 10))
    outcomes, used = _sequential(rng, math.log(1.6), 0.2, 10, look_level(looks), 500)
    assert outcomes.count("b") / len(outcomes) > 0.9 and "a" not in outcomes
    assert np.median(used) > 3


@pytest.mark.parametrize(("low", "high", "margin", "a_below", "outcome"), [
    (-0.5, -0.2, 0.1, True, "a"),          # A's time wholly smaller: A better
    (0.2, 0.5, 0.1, True, "b"),
    (-0.05, 0.08, 0.1, True, "equivalent"),
    (-0.09, -0.02, 0.1, True, "equivalent"),  # inside the margin wins over a direction
    (-0.2, 0.05, 0.1, True, "not_resolved"),
    (0.02, 0.05, 0.0, True, "b"),          # no margin: never equivalent
    (0.02, 0.05, 0.1, False, "equivalent"),
    (0.03, 0.09, 0.01, False, "a"),        # accuracy difference: larger is better for A
    (-math.inf, math.inf, 0.1, True, "not_resolved"),
    (math.nan, math.nan, 0.1, True, "not_resolved"),
])
def test_three_way_outcomes(low, high, margin, a_below, outcome):
    assert decide(low, high, margin, a_is_better_below=a_below) == outcome


def test_verdict_records_and_censored_seeds():
    level = look_level(1)
    record = ratio_verdict(_seeds([100, 110, 105, 98, 102]), _seeds([200, 210, 190, 205, 195]),
                           level=level, margin=0.1)
    assert record.outcome == "a" and record.resolved and record.seeds == 5
    assert record.low < record.estimate < record.high < 1
    # its JSON record: every field, in the order summary.json has always had them
    assert list(record.to_json()) == ["kind", "seeds", "level", "margin", "censored", "estimate",
                                      "low", "high", "outcome", "resolved", "sd",
                                      "round_variance"]
    assert Verdict.from_json(record.to_json()) == record
    # A never reached in one seed: only "B better" could stand, so A better is not stated
    censored = ratio_verdict(_seeds([100, math.inf, 105]), _seeds([200, 210, 190]),
                             level=level, margin=0.1)
    assert censored.censored and censored.outcome == "not_resolved"
    # B never reached in any seed: at least the steps it ran, so A (which reached) is better
    never = _seeds([math.inf] * 3)
    assert ratio_verdict(_seeds([100, 120, 110]), never, level=level, margin=0.1,
                         bounds=(None, 400.0)).outcome == "a"
    unbounded = ratio_verdict(_seeds([100, 120, 110]), never, level=level, margin=0.1)
    assert unbounded.outcome == "not_resolved"  # no bound: nothing to say
    assert "sd" not in unbounded.to_json()  # no interval was computed
    # every seed at the same evaluation, every 30 steps: the rounding floor keeps it open
    tied = ratio_verdict(_seeds([70, 70, 70]), _seeds([60, 60, 60]), level=0.9, margin=0.1,
                         floor_sd=math.sqrt(2 * (30 / 65) ** 2 / 12))
    assert tied.outcome == "not_resolved"
    accuracy = difference_verdict(_seeds([0.90, 0.91, 0.905]), _seeds([0.902, 0.909, 0.904]),
                                  level=0.9, margin=0.01, larger_is_better=True)
    assert accuracy.outcome == "equivalent" and accuracy.kind == "difference"


def test_seed_schedule_and_look_levels():
    assert seed_schedule(3, 10) == [3, 5, 8, 10]
    assert seed_schedule(3, 3) == [3]
    assert seed_schedule(2, 4) == [2, 3, 4]
    assert look_level(4, 0.9) == pytest.approx(0.975) and look_level(1, 0.9) == pytest.approx(0.9)


# -- planted studies: seeds added where a verdict can move, stopped by the budget ---------------

SGD_FACTORS = [1.0, 1.3, 0.8, 1.1, 0.9, 1.2, 0.95, 1.05, 1.15, 0.85]
ADAM_FACTORS = [1.3, 0.8, 1.0, 1.1, 0.95, 1.2, 0.9, 1.0, 1.1, 0.85]


class _PlantedPair(list):
    """A run executor: Adam needs 1.6x SGD's steps, spread over the seeds so that 3 seeds do
    not resolve it; the list holds the (optimizer, seed) of every run trained."""

    def __call__(self, runner, plan):
        self.append((plan.optimizer, plan.seed))
        factors = SGD_FACTORS if plan.optimizer == "sgd" else ADAM_FACTORS
        base = 100 if plan.optimizer == "sgd" else 160
        return _fake_history(plan, round(base * factors[plan.seed]))


def _pair_config(**overrides):
    return _one_cell(optimizers=("sgd", "adam"), learning_rates={"sgd": (0.1,), "adam": (0.01,)},
                     **overrides)


def _adam_vs_sgd(study):
    from kbackend.study.analysis import analyze

    (comparison,) = analyze(study).verdicts.optimizers
    (entry,) = comparison.per_batch
    return entry.verdict


def test_a_study_resolves_with_added_seeds_and_reuses_them(tmp_path):
    calls = _PlantedPair()
    with ResultStore(tmp_path / "study.db") as store:
        fixed = StudyRunner(_pair_config(max_seeds=3), store, run_executor=calls).run()
        assert _adam_vs_sgd(fixed).outcome == "not_resolved" and len(calls) == 6
        calls.clear()
        study = StudyRunner(_pair_config(max_seeds=10, seed_budget=0.0), store,
                            run_executor=calls).run()
        verdict = _adam_vs_sgd(study)
        # resolved at the look that reads it (5 or 8 seeds: LookLevels' second or third)
        n = verdict.seeds
        assert verdict.outcome == "b" and verdict.resolved and n in (5, 8)
        assert sorted(calls) == sorted((o, s) for o in ("adam", "sgd") for s in range(3, n))
        added = study.added_seeds
        assert added.schedule == (3, 5, 8, 10) and len(added.rounds) == [5, 8].index(n) + 1
        assert all(c.seeds == n for c in study.cells)
        calls.clear()
        again = StudyRunner(_pair_config(max_seeds=10, seed_budget=0.0), store,
                            run_executor=calls)
        again.run()
        assert calls == [] and again.executed == 0  # added seeds are stored runs


def test_added_seeds_stop_at_the_seed_budget(tmp_path):
    calls = _PlantedPair()
    with ResultStore(tmp_path / "study.db") as store:
        study = StudyRunner(_pair_config(max_seeds=10, seed_budget=1e-9), store,
                            run_executor=calls).run()
    # one added run, then the budget is spent: that cell has 4 seeds, the other 3
    assert len(calls) == 7 and study.added_seeds.stopped.startswith("seed budget spent")
    verdict = _adam_vs_sgd(study)
    assert verdict.outcome == "not_resolved" and verdict.seeds == 3
    assert sorted(c.seeds for c in study.cells) == [3, 4]


@pytest.mark.parametrize(("flags", "message"), [
    (["--margin", "-0.1"], "Invalid margin -0.1"),
    (["--accuracy-margin", "1.5"], "Invalid accuracy_margin 1.5"),
    (["--seeds", "4", "--max-seeds", "3"], "Invalid --max-seeds 3: expected at least --seeds (4)"),
    (["--seed-budget", "-1"], "Invalid seed_budget -1.0"),
    (["--frontier-epochs", "-1"], "Invalid --frontier-epochs (frontier_epochs) -1"),
])
def test_bad_verdict_flags_are_one_line_errors_before_any_work(tmp_path, capsys, flags, message):
    assert main(["study", "--out", str(tmp_path), "--no-progress", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "study.db").exists()
    with pytest.raises(ConfigError):
        StudyConfig(margin=float("nan"))


def test_the_frontier_table_from_a_stored_study():
    """The frontier's table and its Pareto cells from a study's stored cells (no training)."""
    def cell(optimizer, batch, seconds, best):
        interval = {"median": best, "low": best - 0.01, "high": best + 0.01, "n": 3}
        return {"optimizer": optimizer, "batch_size": batch, "time_to_target": seconds,
                "reached": True, "intervals": {}, "frontier": {
                    "seeds": 3, "best_metric": interval, "test_metric": interval,
                    "best_epoch": {"median": 4.0, "low": 3.0, "high": 5.0, "n": 3}}}

    study = StudyRecord.from_json(
        {"config": {"target": {"metric": "val_accuracy", "value": 0.65}, "frontier_epochs": 5},
         "cells": [cell("sgd", 8, 0.5, 0.70), cell("sgd", 64, 0.1, 0.68),
                   cell("adam", 8, 0.6, 0.69), cell("adam", 64, 0.05, 0.66)]})
    assert pareto_cells(study) == {("sgd", 8), ("sgd", 64), ("adam", 64)}
    header, rows = frontier_rows(study)
    assert header[3] == "best val_accuracy" and len(rows) == 4
    assert rows[0][3] == "0.7000 [0.6900, 0.7100]" and rows[0][-1] == "yes" and rows[2][-1] == ""


def test_frontier_runs_record_the_best_checkpoint_and_are_reused(tmp_path):
    """Native engine, digits: each cell's best rate trains 2 epochs per seed without stopping at
    the target; the best validation value is the best of its evaluations, the test metric is
    taken there, and a second pass trains no frontier run again."""
    from tests.conftest import JIT_FOR_SMALL_RUNS

    config = StudyConfig(model="seed_mlp", dataset="digits", optimizers=("adam",),
                         batch_sizes=(128,), learning_rates={"adam": (3e-3,)}, max_steps=40,
                         engine="native", target=Target("val_accuracy", 0.5), noise_points=0,
                         seeds=2, step_time_repeats=0, population="off", frontier_epochs=2,
                         jit_compile=JIT_FOR_SMALL_RUNS)
    with ResultStore(tmp_path / "study.db") as store:
        runner = StudyRunner(config, store)
        (cell,) = runner.run().to_json()["cells"]
        assert runner.time_spent.frontier_runs == 2
        frontier = cell["frontier"]
        assert frontier["epochs"] == 2 and frontier["seeds"] == 2
        for record in store.records(kind="frontier"):
            result = record.result
            values = [e["val_accuracy"] for e in result["evals"]]
            assert result["best_metric"] == max(values)
            assert result["step"] == result["evals"][values.index(max(values))]["step"]
            assert result["steps_run"] == 2 * (1294 // 128)  # no stop at the target
            assert 0 < result["test_metric"] <= 1
        again = StudyRunner(config, store)
        again.run()
        assert again.time_spent.frontier_runs == 0 and again.executed == 0


def test_look_levels_spend_the_error_mostly_at_the_first_look():
    levels = LookLevels.of(3, 10)
    assert levels.schedule == (3, 5, 8, 10)
    spent = [1 - level for level in levels.levels]
    assert spent[0] == pytest.approx(sum(spent[1:]))  # FIRST_LOOK_SHARE: half at the first look
    assert spent[1] == pytest.approx(spent[2]) == pytest.approx(spent[3])
    assert levels.at(3) == levels.at(2) == levels.levels[0]
    assert levels.at(4) == levels.at(5) == levels.levels[1]  # a round cut short: its look's
    assert levels.at(10) == levels.final == levels.levels[-1]
    assert LookLevels.of(3, 3).levels == (pytest.approx(0.9),)


def _any_look_misses(schedule, levels, studies, rng):
    """Share of simulated studies (normal seeds, truth 0) in which some look's t-interval at
    its level misses 0: drawn apart from ``verdicts.joint_miss``'s own fixed draw."""
    draws = rng.standard_normal((studies, schedule[-1]))
    missed = np.zeros(studies, dtype=bool)
    for n, level in zip(schedule, levels, strict=True):
        seeds = draws[:, :n]
        t = np.abs(seeds.mean(axis=1)) / (seeds.std(axis=1, ddof=1) / math.sqrt(n))
        missed |= t > t_quantile(0.5 + level / 2, n - 1)
    return missed.mean()


@pytest.mark.parametrize("max_seeds", [5, 10, 20])
def test_calibrated_looks_miss_together_at_the_stated_share_and_spend_more_than_bonferroni(
        max_seeds):
    """The looks read nested seeds, so their misses overlap: the calibrated levels miss jointly
    with probability just under 10% (an independent simulation of 100,000 studies: within
    0.3 points of the 9.87% aimed at, three standard errors), where summing the shares
    (Bonferroni) misses less: each look's interval is narrower than Bonferroni's. A look on one
    seed has no interval (never misses)."""
    levels = LookLevels.of(3, max_seeds)
    miss = _any_look_misses(levels.schedule, levels.levels, 100_000, np.random.default_rng(11))
    assert abs(miss - 0.0987) < 0.003, miss
    assert sum(1 - level for level in levels.levels) > (1 - VERDICT_CONFIDENCE) + 0.01
    bonferroni = [1 - (1 - VERDICT_CONFIDENCE) * (1 - level) / sum(1 - x for x in levels.levels)
                  for level in levels.levels]
    assert _any_look_misses(levels.schedule, bonferroni, 100_000,
                            np.random.default_rng(11)) < miss - 0.01
    # on its own draw: two simulation standard errors under the stated share, to 0.1%
    aim = (1 - VERDICT_CONFIDENCE) - 2 * math.sqrt(0.09 / CALIBRATION_STUDIES)
    assert aim - 0.002 < joint_miss(levels.schedule, levels.levels) <= aim
    with warnings.catch_warnings():  # a first look on one seed: no NaN, no warning
        warnings.simplefilter("error")
        one = LookLevels.of(1, max_seeds)
    assert one.schedule[0] == 1 and joint_miss(one.schedule, one.levels) <= aim


def test_the_report_states_each_looks_level():
    from kbackend.study.report_sections import _levels_text

    settings = verdict_settings(StudyRecord(config={"seeds": 3, "max_seeds": 20}))
    first, later = settings.levels.levels[:2]
    assert _levels_text(settings) == f"{first:.2%} at 3 seeds, {later:.2%} at 5-20"
    assert first < 0.95 and later > 0.98  # the calibrated levels, not Bonferroni's (95%, 99%)
    two = verdict_settings(StudyRecord(config={"seeds": 3, "max_seeds": 5}))
    assert _levels_text(two).endswith(f"{two.levels.levels[1]:.2%} at 5")


def test_twenty_seeds_answer_more_equal_comparisons_than_ten_without_more_wrong_verdicts():
    """Truth "equal" and seeds spread 15% (the default study's open comparisons): up to 20
    seeds at the calibrated levels answer far more comparisons (equivalent) than up to 10 at
    Bonferroni's, and still say A or B better in at most 10% of the studies."""
    ten, _ = _sequential(np.random.default_rng(5), 0.0, 0.15, 10,
                         look_level(len(seed_schedule(3, 10))), 600, margin=0.2)
    twenty, used = _sequential(np.random.default_rng(5), 0.0, 0.15, 20, LookLevels.of(3, 20),
                               600, margin=0.2)
    assert twenty.count("equivalent") > ten.count("equivalent") + 0.2 * 600
    assert sum(o in ("a", "b") for o in twenty) / 600 <= (1 - VERDICT_CONFIDENCE) + 0.02
    assert max(used) <= 20


@pytest.mark.slow
@pytest.mark.parametrize("spread", [0.1, 0.2, 0.35])
def test_spent_looks_keep_wrong_verdicts_under_ten_percent_when_equal(spread):
    """Truth "equal" (ratio 1): the sequential rule with the error spent over the looks says A
    or B is better in at most 10% of simulated studies (plus simulation noise), at the default
    margin (1.2x) and the old one (1.1x), up to 10 seeds and up to the default's 20."""
    for margin, max_seeds in itertools.product((0.2, 0.1), (10, DEFAULT_MAX_SEEDS)):
        outcomes, _ = _sequential(np.random.default_rng(3), 0.0, spread, max_seeds,
                                  LookLevels.of(3, max_seeds), 2000, margin=margin)
        wrong = sum(o in ("a", "b") for o in outcomes) / len(outcomes)
        assert wrong <= (1 - VERDICT_CONFIDENCE) + 0.015, (spread, margin, max_seeds, wrong)


def test_spending_at_the_first_look_answers_more_under_a_seed_budget():
    """A true 1.6x difference, seeds spread 30%, and a budget that stops the seeds at the first
    look in most studies (as the default study's automatic budget does): spending half the
    error at the first look answers more comparisons than equal looks, never the wrong way."""
    def answered(level):
        outcomes = []
        for study in range(600):
            max_seeds = 10 if study % 4 == 0 else 3  # the budget lets one in four extend
            rng = np.random.default_rng(study)
            out, _ = _sequential(rng, math.log(1.6), 0.3, max_seeds, level, 1)
            outcomes += out
        assert "a" not in outcomes
        return outcomes.count("b") / len(outcomes)

    spent = answered(LookLevels.of(3, 10))
    equal = answered(look_level(len(seed_schedule(3, 10))))
    assert spent > equal + 0.1


def test_an_answer_at_an_earlier_look_stands_when_seeds_added_for_another_comparison_blur_it():
    """Three seeds resolve "B better" at the first look (level 0.95); seven seeds added for
    another comparison that shares a cell leave the ten-seed interval open at the last look's
    stricter level: the verdict is the first look's, marked with its seed count. A float level
    (one look) reads every seed, as before."""
    levels = LookLevels.of(3, 10)
    first = [1.45, 1.5, 1.55]
    later = [0.6, 2.0, 0.7, 2.1, 0.65, 1.9, 0.8]
    a, b = _seeds(first + later), _seeds([1.0] * 10)
    on_ten = ratio_verdict(a, b, level=levels.final, margin=0.2)
    assert on_ten.outcome == "not_resolved" and on_ten.seeds == 10
    verdict = ratio_verdict(a, b, level=levels, margin=0.2)
    assert verdict.outcome == "b" and verdict.look == 3 and verdict.seeds == 3
    assert verdict.level == pytest.approx(levels.levels[0])
    assert verdict.to_json()["look"] == 3
    assert "look" not in ratio_verdict(a, b, level=0.9, margin=0.2).to_json()
    # a difference (accuracies) reads its looks alike
    accuracy = difference_verdict(_seeds([0.9, 0.9, 0.9, 0.7, 1.0]), _seeds([0.8] * 5),
                                  level=LookLevels.of(3, 5), margin=0.01, larger_is_better=True)
    assert accuracy.outcome == "a" and accuracy.look == 3


def test_a_later_seed_that_never_reached_forbids_an_earlier_look_saying_its_side_is_better():
    """A resolves "A better" on its first three seeds, but a fifth seed of A never reached the
    target: the earlier look may not say A is better (nor equivalent); where it is B that never
    reached, "A better" stands, and the verdict says it is censored."""
    levels = LookLevels.of(3, 10)
    a = _seeds([100, 102, 98, 101, math.inf])
    b = _seeds([200, 205, 195, 198, 202])
    verdict = ratio_verdict(a, b, level=levels, margin=0.2)
    assert verdict.outcome == "not_resolved" and verdict.look is None and verdict.censored
    # B never reached on its fifth seed: "A better" may stand, and says the seeds were censored
    slower = _seeds([200, 205, 195, 198, math.inf])
    against = ratio_verdict(_seeds([100, 102, 98, 101, 99]), slower, level=levels, margin=0.2)
    assert against.outcome == "a" and against.censored


def test_reading_every_look_keeps_wrong_verdicts_under_the_stated_share_when_equal():
    """Truth "equal" (ratio 1, seeds spread 20%), all ten seeds present (added for other
    comparisons) and the verdict taken at the first look that resolves: still at most 10% say
    A or B is better (each look's interval has its share of the error)."""
    rng = np.random.default_rng(3)
    levels, trials, wrong = LookLevels.of(3, 10), 2000, 0
    for _ in range(trials):
        a = _seeds(np.exp(rng.normal(0.0, 0.2, size=10)))
        wrong += ratio_verdict(a, _seeds([1.0] * 10), level=levels,
                               margin=0.1).outcome in ("a", "b")
    assert wrong / trials <= (1 - VERDICT_CONFIDENCE) + 0.02
