"""Study analysis on made-up cells, the learning-rate grid, and the SQLite results store."""

from __future__ import annotations

import json
import math
import sqlite3
import threading
from dataclasses import replace

import pytest

from kbackend.errors import ConfigError, DataError
from kbackend.study.analysis import analyze
from kbackend.study.config import StudyConfig, default_batch_sizes
from kbackend.study.scaling import crossover, fit_critical_batch, scaling_regions, throughput_curve
from kbackend.study.store import ResultStore, StoredRun, config_key
from kbackend.study.study_record import Cell, NoisePoint, NoiseScale, StepTimes, StudyRecord


def _cell(optimizer, batch, time_to_target):
    reached = time_to_target is not None
    return Cell(optimizer, batch, reached=reached, time_to_target=time_to_target,
                steps_to_target=10 if reached else None)


def test_knee_fit_recovers_a_known_critical_batch_size():
    s_min, b_crit = 40.0, 100.0
    points = [(b, s_min * (1 + b_crit / b)) for b in (8, 16, 32, 64, 128, 256, 512)]
    knee = fit_critical_batch(points)
    assert knee.s_min == pytest.approx(s_min, rel=1e-9)
    assert knee.b_crit == pytest.approx(b_crit, rel=1e-9)


def test_knee_fit_says_when_the_knee_is_outside_the_grid():
    perfect = [(b, 6400.0 / b) for b in (8, 16, 32)]  # steps halve every doubling
    assert fit_critical_batch(perfect).b_crit is None
    assert fit_critical_batch(perfect).beyond_grid == "above"
    assert fit_critical_batch([(8, 100.0), (16, 101.0), (32, 102.0)]).beyond_grid == "below"
    assert fit_critical_batch([(8, 100.0)]).b_crit is None


def test_scaling_regions_follow_the_exponent():
    points = [(8, 800.0), (16, 400.0), (32, 260.0), (64, 250.0)]
    regions = [s.region for s in scaling_regions(points)]
    assert regions == ["perfect scaling", "diminishing returns", "saturation"]


@pytest.mark.parametrize(("adam", "sgd", "expected", "note"), [
    ([5, 3, 2, 1], [4, 2, 3, 2], 32, "from batch size 32"),
    ([1, 1, 1, 1], [2, 2, 2, 2], None, "every batch size"),
    ([5, 5, 1, 5], [1, 1, 2, 1], None, "does not overtake"),
    ([5, 5, 1, 1], [1, None, None, None], 16, "from batch size 16"),  # SGD never reached there
])
def test_crossover_where_adam_overtakes_sgd(adam, sgd, expected, note):
    sizes = [8, 16, 32, 64]
    cells = [_cell("adam", b, t) for b, t in zip(sizes, adam, strict=True)]
    cells += [_cell("sgd", b, t) for b, t in zip(sizes, sgd, strict=True)]
    result = crossover(cells, "adam", "sgd")
    assert result is not None and result.batch_size == expected and note in result.note


def test_crossover_needs_both_optimizers():
    assert crossover([_cell("adam", 8, 1.0)], "adam", "sgd") is None


def test_throughput_curve_and_knee():
    """Medians of the finite figures per batch size; the knee is kbackend.hardware.knee's (its
    definition is tested from a table of curves in test_hardware_knee.py)."""
    runs = [StoredRun(f"r{i}", "run", "", "", {"batch_size": b}, {"samples_per_s": v})
            for i, (b, v) in enumerate([(8, 100.0), (8, 120.0), (32, 500.0), (128, 900.0),
                                        (512, 1000.0), (512, math.nan)])]
    curve = throughput_curve(runs)
    assert [p.samples_per_s for p in curve] == [110.0, 500.0, 900.0, 1000.0]
    analysis = analyze(StudyRecord(runs=runs))
    assert (analysis.throughput_knee, analysis.throughput_plateau_reached) == (128, True)
    empty = analyze(StudyRecord.from_json({"cells": [], "runs": [], "noise": None}))
    assert (empty.throughput_knee, empty.throughput_plateau_reached) == (None, None)


def _noise(points, small=8, big=512, draws=24):
    """A noise-scale record of made-up ``(step, |G|^2, tr(Sigma))`` points."""
    return NoiseScale("sgd", 32, 0.1, small, big, draws, tuple(
        NoisePoint(step, grad_sq, trace, 0.0, 0.0, small, big, draws, trace / grad_sq)
        for step, grad_sq, trace in points), points[-1][2] / points[-1][1])


def test_noise_scale_over_training_is_a_ratio_of_averages():
    from kbackend.study.scaling import training_noise_scale

    points = [(0, 1.0, 1000.0), (10, 2.0, 40.0), (20, 0.01, 20.0)]
    assert training_noise_scale(_noise(points)) == pytest.approx(60.0 / 2.01)
    assert training_noise_scale(_noise(points[:1])) == pytest.approx(1000.0)
    assert training_noise_scale(None) is None


def test_the_noise_record_round_trips_through_json_in_the_stores_key_order():
    noise = replace(_noise([(0, 1.0, 1000.0), (10, 2.0, 40.0)]),
                    first_try={"small_batch": 16, "big_batch": 64, "b_simple_final": -3.0})
    assert NoiseScale.from_json(noise.to_json()) == noise
    assert list(noise.to_json()) == ["optimizer", "batch_size", "learning_rate", "small_batch",
                                     "big_batch", "draws", "points", "b_simple_final",
                                     "first_try"]
    stored = json.loads(json.dumps(noise.to_json(), sort_keys=True))  # as the store returns it
    assert json.dumps(NoiseScale.from_json(stored).to_json()) == json.dumps(stored)


def test_default_batch_sizes_are_powers_of_two_that_fit():
    assert default_batch_sizes(1294) == (8, 16, 32, 64, 128, 256, 512)
    assert default_batch_sizes(20) == (8,)


def test_learning_rate_grid_is_log_spaced_around_a_scaled_centre():
    grid = StudyConfig(lr_grid_size=3, lr_factor=10.0).learning_rate_grid("sgd", 32)
    assert grid == (0.2, 0.02, 2.0)  # centre first: with pruning the likely winner runs first
    assert StudyConfig().learning_rate_grid("adam", 128)[0] == pytest.approx(4e-3)
    assert StudyConfig(learning_rates={"sgd": (0.5,)}).learning_rate_grid("sgd", 8) == (0.5,)
    assert len(StudyConfig(lr_grid_size=4).learning_rate_grid("adam", 8)) == 4


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"batch_sizes": ()}, "Empty batch-size list"),
    ({"optimizers": ("sgd", "lion")}, "Unknown optimizer"),
    ({"optimizers": ()}, "Empty optimizer list"),
    ({"batch_sizes": (8, 0)}, "Invalid batch size"),
    ({"learning_rates": {"adam": (0.0,)}}, "learning.rate"),
    ({"learning_rates": {"adamw": (0.1,)}}, "not in the study's optimizers"),
    ({"max_steps": 0}, "max_steps"),
    ({"noise_small_batch": 64, "noise_big_batch": 8}, "smaller than the big one"),
])
def test_bad_study_configs_are_rejected(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        StudyConfig(**kwargs)


def test_batch_sizes_larger_than_the_training_split_are_rejected():
    with pytest.raises(DataError, match=r"\[2048\] are larger than the training split \(1294"):
        StudyConfig(batch_sizes=(8, 2048)).resolved_batch_sizes(1294)


def test_config_key_ignores_key_order_and_sees_every_value():
    assert config_key({"a": 1, "b": [1, 2]}) == config_key({"b": [1, 2], "a": 1})
    assert config_key({"a": 1, "b": [1, 2]}) != config_key({"a": 1, "b": [2, 1]})


def test_store_keeps_the_first_result_and_survives_reopening(tmp_path):
    path = tmp_path / "study.db"
    with ResultStore(path) as store:
        assert store.put(StoredRun("k1", "run", "s", "jax", {"lr": 0.1},
                                   {"reached": True, "x": math.nan}, {"step": [1, 2]}))
        assert not store.put(StoredRun("k1", "run", "s", "jax", {"lr": 0.1}, {"reached": False}))
    with ResultStore(path) as store:
        record = store.get("k1")
        assert record.result["reached"] is True and math.isnan(record.result["x"])
        assert record.trajectory == {"step": [1, 2]} and store.get("missing") is None
        assert [r.key for r in store.records(study="s", backend="jax")] == ["k1"]
        assert store.records(backend="tensorflow") == []
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_store_concurrent_writers_store_each_key_once(tmp_path):
    path = tmp_path / "study.db"
    ResultStore(path).close()
    stored = []

    def writer(index):
        with ResultStore(path) as store:
            for key in range(20):
                if store.put(StoredRun(f"k{key}", "run", "s", "jax", {}, {"writer": index})):
                    stored.append(key)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(stored) == list(range(20))
    with ResultStore(path) as store:
        assert len(store.records()) == 20


def test_store_summaries_replace_per_backend_and_device(tmp_path):
    with ResultStore(tmp_path / "study.db") as store:
        store.put_summary("s", "jax", "cpu", {"v": 1})
        store.put_summary("s", "jax", "cpu", {"v": 2})
        store.put_summary("s", "tensorflow", "cpu", {"v": 3})
        assert [p["v"] for p in store.summaries("s")] == [2, 3]


# -- seeds, intervals and verdicts --------------------------------------------------------------

@pytest.mark.parametrize(("n", "coverage"), [(1, 0.0), (2, 0.5), (3, 0.75), (5, 0.9375),
                                             (10, 1 - 2 / 1024)])
def test_min_max_interval_covers_the_median_with_its_stated_probability(n, coverage):
    from kbackend.stats import median_coverage

    assert median_coverage(n) == pytest.approx(coverage)


def test_median_coverage_matches_simulation():
    import numpy as np

    from kbackend.stats import median_coverage

    rng = np.random.default_rng(0)
    draws = rng.exponential(size=(20000, 3))  # the median of Exp(1) is log 2
    covered = (draws.min(axis=1) <= math.log(2)) & (draws.max(axis=1) >= math.log(2))
    assert covered.mean() == pytest.approx(median_coverage(3), abs=0.015)


def test_median_interval_counts_never_reached_as_infinite():
    from kbackend.stats import median_interval

    interval = median_interval([300.0, math.inf, 100.0])
    assert (interval["low"], interval["median"], interval["high"]) == (100.0, 300.0, math.inf)
    assert interval["n"] == 3 and interval["coverage"] == pytest.approx(0.75)
    assert median_interval([4.0, 1.0, 2.0, 3.0])["median"] == 2.5
    assert median_interval([])["n"] == 0


def test_a_median_interval_at_a_level_narrows_with_more_values_and_keeps_its_coverage():
    """[min, max] only widens as values are added; the interval at a level takes the deepest
    symmetric order statistics whose coverage still reaches it (25 values at 93.75 %: the 8th
    smallest and largest, 95.7 %), and its coverage holds on simulated draws."""
    from kbackend.stats import median_coverage, median_interval

    level = median_coverage(5)
    assert median_interval(list(range(5)), level=level)["coverage"] == level  # [min, max]
    wide = median_interval(list(range(25)), level=level)
    assert (wide["low"], wide["high"]) == (7.0, 17.0)
    assert wide["coverage"] == pytest.approx(0.9567, abs=1e-4) and wide["coverage"] >= level
    assert median_coverage(25, 9) < level <= median_coverage(25, 8)
    import numpy as np

    draws = np.random.default_rng(0).exponential(size=(20000, 25))
    ordered = np.sort(draws, axis=1)
    covered = (ordered[:, 7] <= math.log(2)) & (ordered[:, 17] >= math.log(2))
    assert covered.mean() == pytest.approx(wide["coverage"], abs=0.01)
    assert median_interval([1.0, 2.0, 3.0], level=0.0)["low"] == 2.0  # the deepest, no hang


def _seeded_cell(optimizer, batch, steps, seconds_per_step=0.01, test=(0.9, 0.9, 0.9)):
    """A made-up cell: ``steps`` per seed (None: not reached), time = steps x seconds_per_step."""
    from kbackend.stats import median_interval

    values = [math.inf if s is None else float(s) for s in steps]
    interval = median_interval(values)
    reached = math.isfinite(interval["median"])
    times = median_interval([v * seconds_per_step for v in values])
    return Cell(optimizer, batch, reached=reached, learning_rate=0.1,
                steps_to_target=interval["median"] if reached else None,
                time_to_target=times["median"] if reached else None,
                seed_steps={str(i): v for i, v in enumerate(values)},
                seed_test={str(i): v for i, v in enumerate(test)},
                intervals={"steps_to_target": interval, "time_to_target": times,
                           "test_accuracy": median_interval(list(test))})


def _study(cells, seeds=3, noise=None):
    return StudyRecord(cells=cells, noise=noise, config={"seeds": seeds})


def test_verdicts_when_planted_intervals_separate():
    """SGD is faster at small batches, Adam at large ones; steps halve per doubling up to 64."""
    sizes = (8, 16, 32, 64, 128)
    sgd = {8: 400, 16: 200, 32: 100, 64: 80, 128: 78}
    adam = {8: 800, 16: 420, 32: 215, 64: 40, 128: 20}
    cells = []
    for size in sizes:
        cells.append(_seeded_cell("sgd", size, [sgd[size] * f for f in (0.95, 1.0, 1.05)],
                                  test=(0.95, 0.96, 0.97) if size == 8 else (0.90, 0.91, 0.92)))
        cells.append(_seeded_cell("adam", size, [adam[size] * f for f in (0.95, 1.0, 1.05)]))
    verdicts = analyze(_study(cells)).verdicts
    assert verdicts.fastest.resolved and verdicts.fastest.cell == ("adam", 128)
    assert verdicts.fastest.to_json()["cell"] == {"optimizer": "adam", "batch_size": 128}
    # the paired-seed interval of the verdicts, against the closest cell (adam at batch 64)
    assert verdicts.fastest.outcome == "a" and verdicts.fastest.seeds == 3
    assert ("faster than every other cell; vs the next: A/B 0.5x [0.5, 0.5]"
            in verdicts.fastest.text)
    (adam_vs_sgd,) = [x for x in verdicts.optimizers if x.incumbent == "sgd"]
    assert adam_vs_sgd.resolved and adam_vs_sgd.batch_size == 64
    assert "sgd faster at batch 8, 16, 32; adam faster at batch 64, 128" in adam_vs_sgd.text
    assert [p.outcome for p in adam_vs_sgd.per_batch] == ["b", "b", "b", "a", "a"]
    regions = verdicts.per_optimizer["sgd"].regions
    # every seed scaled alike in every cell: the paired ratios resolve each region
    assert [(r.region, r.region_resolved) for r in regions] == [
        ("perfect scaling", True), ("perfect scaling", True), ("diminishing returns", True),
        ("saturation", True)]
    # three-way on the steps: fewer at the larger batch, except 64 -> 128 (within 10%)
    assert [r.outcome for r in regions] == ["b", "b", "b", "equivalent"]
    assert all(r.verdict.seeds == 3 and r.resolved for r in regions)
    generalization = verdicts.per_optimizer["sgd"].generalization
    assert generalization.resolved and generalization.larger_batch == "lower"
    assert generalization.outcome == "a" and generalization.seeds == 3


def _verdict_records(tree):
    """Every record under ``tree`` that states a verdict (it has an ``outcome``)."""
    if isinstance(tree, dict):
        if "outcome" in tree:
            yield tree
        for value in tree.values():
            yield from _verdict_records(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from _verdict_records(value)


def test_every_verdict_record_carries_its_outcome_resolution_and_seeds():
    cells = []
    for size in (8, 32):
        cells.append(_seeded_cell("sgd", size, [100, 200, 300]))
        cells.append(_seeded_cell("adam", size, [150, 300, 450]))
        cells.append(_seeded_cell("momentum", size, [350, 150, 250]))
    verdicts = analyze(_study(cells)).verdicts
    records = list(_verdict_records(verdicts.to_json()))  # as the report writes them
    # fastest, 2 comparisons x 2 batch sizes (each record and its verdict), 3 regions, 3
    # generalizations (each with its verdict), the knee
    assert len(records) >= 1 + 2 * 2 * 2 + 3 * 2 + 3 * 2
    for record in records:
        assert {"outcome", "resolved", "seeds"} <= set(record), record
        assert record["resolved"] == (record["outcome"] != "not_resolved"), record
    per_batch = [p for x in verdicts.optimizers for p in x.per_batch]
    assert [(p.seeds, p.resolved) for p in per_batch] == [(3, True)] * 2 + [(3, False)] * 2


def test_verdicts_are_not_resolved_when_intervals_overlap():
    cells = []
    for size in (8, 32):  # the same medians order, but the paired seeds disagree on the sign
        cells.append(_seeded_cell("sgd", size, [100, 200, 300]))
        cells.append(_seeded_cell("adam", size, [350, 150, 250]))
    verdicts = analyze(_study(cells)).verdicts
    assert not verdicts.fastest.resolved
    assert verdicts.fastest.text.startswith("fastest: not resolved at 3 seeds")
    (adam_vs_sgd,) = verdicts.optimizers
    assert not adam_vs_sgd.resolved and "not resolved after 3 seeds" in adam_vs_sgd.text
    assert all(p.faster is None for p in adam_vs_sgd.per_batch)
    assert all(p.outcome == "not_resolved" for p in adam_vs_sgd.per_batch)
    # sgd's seeds take the same steps at 8 and 32: equal steps, saturation
    (segment,) = verdicts.per_optimizer["sgd"].regions
    assert segment.outcome == "equivalent" and segment.region == "saturation"
    # the same test accuracy at both batch sizes, seed by seed: equivalent within one point
    assert verdicts.per_optimizer["sgd"].generalization.outcome == "equivalent"


def test_paired_seeds_resolve_what_overlapping_intervals_cannot():
    """Each cell's seeds spread over a factor 3 (their [min, max] overlap), but seed by seed
    Adam takes 1.5x SGD's steps: the paired ratio resolves it."""
    cells = []
    for size in (8, 32):
        cells.append(_seeded_cell("sgd", size, [100, 200, 300]))
        cells.append(_seeded_cell("adam", size, [150, 300, 450]))
    (adam_vs_sgd,) = analyze(_study(cells)).verdicts.optimizers
    assert [p.outcome for p in adam_vs_sgd.per_batch] == ["b", "b"]
    verdict = adam_vs_sgd.per_batch[0].verdict
    assert verdict.estimate == pytest.approx(1.5) and verdict.low > 1


def test_one_seed_resolves_nothing():
    cells = [_seeded_cell("sgd", 8, [100]), _seeded_cell("adam", 8, [900])]
    verdicts = analyze(_study(cells, seeds=1)).verdicts
    assert not verdicts.fastest.resolved
    assert "one seed gives no interval" in verdicts.fastest.text


def test_critical_batch_over_seeds_and_its_agreement_with_the_noise_scale():
    from kbackend.study.cell_verdicts import critical_batch_over_seeds, noise_agreement

    sizes = (8, 16, 32, 64, 128, 256)
    cells = [_seeded_cell("sgd", b, [s_min * (1 + 64 / b) for s_min in (90, 100, 110)])
             for b in sizes]
    b_crit = critical_batch_over_seeds(cells)
    assert b_crit.median == pytest.approx(64) and b_crit.n == 3 and b_crit.span() == "64 [64, 64]"
    assert noise_agreement(b_crit, 50.0, 3).agree is True
    assert noise_agreement(b_crit, 500.0, 3).agree is False
    assert not noise_agreement(b_crit, None, 3).resolved


@pytest.mark.parametrize(("grad_sq", "trace", "reason"), [
    (-0.5, 10.0, "|G|^2 estimate is not positive"),
    (0.5, -10.0, "tr(Sigma) estimate is not positive"),
])
def test_a_negative_noise_scale_is_never_a_finding(grad_sq, trace, reason):
    from kbackend.study.scaling import noise_scale_note, training_noise_scale

    noise = _noise([(0, 1.0, 5.0), (10, grad_sq, trace)])
    assert training_noise_scale(noise) is None
    note = noise_scale_note(noise)
    assert note.startswith("not estimated: ") and reason in note and "8/512" in note
    analysis = analyze(StudyRecord.from_json({"cells": [], "runs": [], "noise": noise.to_json()}))
    assert analysis.b_simple is None and analysis.b_simple_note == note


def _step_times(per_batch, spread):
    """Made-up interleaved timings: samples/s per batch size, each timing off by +-spread, in a
    different round for each batch size (a load shared by a round's cells would cancel)."""
    cells = []
    for index, (size, samples_per_s) in enumerate(per_batch.items()):
        factors = [1 - spread, 1.0, 1 + spread]
        factors = factors[index % 3:] + factors[:index % 3]
        seconds = [size / samples_per_s * f for f in factors]
        cells.append({"optimizer": "sgd", "batch_size": size, "seconds": seconds})
    return StepTimes.from_json({"cells": cells})


def test_throughput_knee_is_stated_only_where_the_timings_separate():
    from kbackend.study.cell_verdicts import step_time_spread, throughput_knee_verdict

    curve = {8: 1000.0, 16: 2000.0, 32: 3000.0, 64: 3100.0, 128: 3150.0}
    tight = throughput_knee_verdict(_step_times(curve, 0.01))
    assert tight.resolved and tight.batch_size == 32 and "batch 32" in tight.text
    loose = throughput_knee_verdict(_step_times(curve, 0.2))
    assert not loose.resolved and "not resolved after 3 timings" in loose.text
    assert tight.outcome == "equivalent" and loose.outcome == "not_resolved"
    spread = step_time_spread(_step_times(curve, 0.2))
    assert spread is not None and spread.worst_ratio == pytest.approx(1.2 / 0.8)
    assert "sgd 32/64" in spread.unranked_neighbours
    assert "sgd 8/16" not in spread.unranked_neighbours


def test_the_written_verdict_records_keep_their_fields_and_order():
    """summary.json holds ``Analysis.to_json()``: each typed verdict's record with the keys, in
    the order, that summary.json has always had (stored summaries are read as these dicts;
    files written before and after the verdicts were typed are the same bytes)."""
    from kbackend.io import restore_non_finite, strict_json_text

    cells = []
    for size in (8, 32):
        cells.append(_seeded_cell("sgd", size, [100, 200, 300], test=(0.90, 0.91, 0.92)))
        cells.append(_seeded_cell("adam", size, [150, 300, 450]))
    study = replace(_study(cells), step_times=_step_times({8: 1000.0, 32: 3000.0}, 0.01))
    analysis = analyze(study)
    # JSON values only, as summary.json holds them
    record = restore_non_finite(json.loads(strict_json_text(analysis.to_json())))
    assert list(record) == ["verdicts", "per_optimizer", "throughput", "throughput_knee",
                            "throughput_plateau_reached", "best", "crossovers", "b_simple",
                            "b_simple_note"]
    verdicts = record["verdicts"]
    assert list(verdicts) == ["seeds", "coverage", "confidence", "level", "look_levels", "looks",
                              "margin", "accuracy_margin", "added_seeds", "fastest",
                              "optimizers", "per_optimizer", "throughput_knee",
                              "step_time_spread"]
    assert list(verdicts["fastest"]) == ["resolved", "outcome", "seeds", "cell", "ties", "text"]
    (comparison,) = verdicts["optimizers"]
    assert list(comparison) == ["challenger", "incumbent", "per_batch", "batch_size", "resolved",
                                "text"]
    entry = comparison["per_batch"][0]
    assert list(entry) == ["batch_size", "faster", "outcome", "resolved", "seeds", "verdict",
                           "adam", "sgd"]
    interval = ["kind", "seeds", "level", "margin", "censored", "estimate", "low", "high",
                "outcome", "resolved", "sd"]
    assert list(entry["verdict"]) == [*interval, "round_variance", "cells"]
    assert entry["verdict"]["cells"] == [["adam", 8], ["sgd", 8]]
    per = verdicts["per_optimizer"]["sgd"]
    assert list(per) == ["regions", "b_crit", "noise_agreement", "generalization"]
    assert list(per["regions"][0]) == ["from", "to", "exponent", "exponent_low", "exponent_high",
                                       "region", "region_resolved", "resolved", "outcome",
                                       "seeds", "verdict"]
    assert list(per["b_crit"]) == ["median", "low", "high", "n", "coverage", "seeds_without_knee"]
    assert list(per["noise_agreement"]) == ["resolved", "text"]
    assert list(per["generalization"]) == ["resolved", "outcome", "seeds", "larger_batch",
                                           "verdict", "text"]
    assert list(per["generalization"]["verdict"]) == [*interval, "cells", "source", "metric"]
    assert list(verdicts["throughput_knee"]) == ["resolved", "outcome", "batch_size",
                                                 "plateau_reached", "seeds", "timings", "gains",
                                                 "text"]
    assert list(verdicts["throughput_knee"]["gains"][0]) == ["from", "to", "timings", "gain",
                                                             "low", "high"]
    assert list(verdicts["step_time_spread"]) == ["median_ratio", "worst", "worst_ratio",
                                                  "unranked_neighbours"]
    # the typed values and their records agree
    assert verdicts["fastest"]["outcome"] == analysis.verdicts.fastest.outcome
    assert [p["outcome"] for p in comparison["per_batch"]] == [
        p.outcome for p in analysis.verdicts.optimizers[0].per_batch]
    # the analysis's figures: typed, written with summary.json's keys in its order
    figures = record["per_optimizer"]["sgd"]
    assert list(figures) == ["steps_to_target", "regions", "knee", "fastest", "not_reached"]
    assert list(figures["steps_to_target"][0]) == ["batch_size", "steps", "reached"]
    assert list(figures["regions"][0]) == ["from", "to", "exponent", "region"]
    assert list(figures["knee"]) in (["s_min", "b_crit", "note"],
                                     ["s_min", "b_crit", "beyond_grid", "note"])
    assert list(figures["fastest"]) == ["batch_size", "time_to_target"]
    assert list(record["throughput"][0]) == ["batch_size", "samples_per_s", "low", "high", "n",
                                             "coverage"]
    assert list(record["best"]) == ["optimizer", "batch_size", "learning_rate",
                                    "time_to_target", "steps_to_target"]
    (cross,) = record["crossovers"]
    assert list(cross) == ["challenger", "incumbent", "batch_size", "wins", "note"]
    assert figures["knee"]["b_crit"] == analysis.per_optimizer["sgd"].knee.b_crit
    assert record["best"]["optimizer"] == analysis.best.optimizer


def test_a_knee_beyond_the_grid_is_written_with_where_it_lies():
    assert list(fit_critical_batch([(8, 100.0), (16, 101.0)]).to_json()) == [
        "s_min", "b_crit", "beyond_grid", "note"]
    runs = throughput_curve([StoredRun("r", "run", "", "", {"batch_size": 8},
                                       {"samples_per_s": 10.0})])
    assert [p.to_json() for p in runs] == [{"batch_size": 8, "samples_per_s": 10.0, "runs": 1}]
