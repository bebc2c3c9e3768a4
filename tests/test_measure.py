"""The measurement harness (``kbackend.hardware.measure``): interleaved timing with the noise
kept, one key for every probe, the per-machine store and its listing. Timers are fake: a
virtual clock advanced by each call, slowed on purpose where a test needs a busy machine."""

from __future__ import annotations

import json
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest

from kbackend.backends import compile_cache
from kbackend.hardware import measure
from kbackend.hardware.measure import (
    FUSED_STEPS,
    KNEE,
    PROBES,
    Budget,
    MeasurementWarning,
    Probe,
    measurement_key,
    remembered,
    stored_probes,
    time_interleaved,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def timed(clock: Clock, log: list, name: str, seconds: Callable[[int], float]) -> Callable:
    """A call that logs ``name`` and lasts ``seconds(n)`` on ``clock`` (n: its call count)."""
    calls = []

    def call():
        log.append(name)
        clock.now += seconds(len(calls))
        calls.append(1)
    return call


def test_rounds_rotate_the_order_and_best_of_calls_run_back_to_back():
    clock, log = Clock(), []
    fns = {name: timed(clock, log, name, lambda n: 1.0) for name in "abc"}
    time_interleaved(fns, 3, wait=lambda v: v, clock=clock, best_of=2)
    rounds = ["abc", "bca", "cab"]
    assert log == list("abc") + [c for turn in rounds for c in turn for _ in range(2)]


def test_a_planted_slow_call_moves_neither_the_median_nor_a_best_of_round():
    clock, log = Clock(), []
    slow_third = lambda n: 10.0 if n == 3 else 1.0  # noqa: E731  (call 0 is the first call)
    timing = time_interleaved({"a": timed(clock, log, "a", slow_third)}, 5, wait=lambda v: v,
                              clock=clock)["a"]
    assert timing.times == (1.0, 1.0, 10.0, 1.0, 1.0) and timing.median_s == 1.0
    assert timing.cv > measure.NOISY_CV  # the noise is kept with the figure (std / mean) ...
    assert timing.robust_cv == 0.0 and not timing.noisy  # ... but one stalled call is not noise
    spread = measure.summarize(1.0, [1.0, 1.3, 0.8, 1.2, 0.9])
    assert spread.robust_cv == pytest.approx(1.4826 * 0.2 / 1.0) and spread.noisy
    best = time_interleaved({"a": timed(clock, log, "a", slow_third)}, 2, wait=lambda v: v,
                            clock=clock, best_of=3)["a"]
    assert best.times == (1.0, 1.0) and best.cv == 0.0 and not best.noisy


def test_short_calls_are_repeated_to_a_minimum_and_timed_per_call():
    """A 10 ms call timed for 50 ms at least runs 5 times per repeat (three more calls, after
    the first, say how many); the repeats keep seconds per call, and rounds added later keep
    the count."""
    clock, log = Clock(), []
    fns = {"short": timed(clock, log, "short", lambda n: 0.01),
           "long": timed(clock, log, "long", lambda n: 0.2)}
    timings = time_interleaved(fns, 2, wait=lambda v: v, clock=clock, min_seconds=0.05)
    assert timings["short"].calls == 5 and timings["long"].calls == 1
    assert timings["short"].times == pytest.approx((0.01, 0.01))
    assert log.count("short") == 1 + 3 + 2 * 5 and log.count("long") == 1 + 3 + 2
    more = time_interleaved(fns, 1, wait=lambda v: v, clock=clock, previous=timings)
    assert more["short"].calls == 5 and log.count("short") == 14 + 5


def test_previous_rounds_are_extended_and_their_first_call_kept():
    clock, log = Clock(), []
    fns = {"a": timed(clock, log, "a", lambda n: 2.0 if n == 0 else 1.0)}
    first = time_interleaved(fns, 2, wait=lambda v: v, clock=clock)
    more = time_interleaved(fns, 1, wait=lambda v: v, clock=clock, previous=first)
    assert more["a"].first_call_s == 2.0 and more["a"].times == (1.0, 1.0, 1.0)
    assert len(log) == 4  # one first call only


def test_a_budget_counts_re_measurements_and_seconds():
    clock = Clock()
    budget = Budget(seconds=5.0, most=2, clock=clock)
    assert budget.take() and budget.take() and not budget.take()  # at most 2
    late = Budget(seconds=5.0, most=9, clock=clock)
    clock.now += 5.0
    assert not late.take()
    assert late.record() == {"remeasured": 0, "probe_seconds": 5.0, "budget_s": 5.0}


# -- one key ------------------------------------------------------------------------------------
def model(units: int = 4):
    """A small network: every call gets fresh weights."""
    import keras

    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(units), keras.layers.Dense(2)])


def data(n: int = 32, width: int = 3):
    return SimpleNamespace(x_train=np.zeros((n, width), dtype="float32"))


def test_the_key_holds_the_model_the_data_and_the_options_not_the_weights():
    key = measurement_key(model(), data(), optimizer="sgd", batch_size=8)
    assert key == measurement_key(model(), data(), batch_size=8, optimizer="sgd")  # new weights
    assert key != measurement_key(model(units=5), data(), optimizer="sgd", batch_size=8)
    assert key != measurement_key(model(), data(n=64), optimizer="sgd", batch_size=8)
    assert key != measurement_key(model(), data(width=4), optimizer="sgd", batch_size=8)
    assert key != measurement_key(model(), data(), optimizer="adam", batch_size=8)


def test_the_machine_and_the_format_are_the_stamp(monkeypatch):
    here = measure.machine_stamp(1)
    assert here == measure.machine_stamp(1) != measure.machine_stamp(2)
    identity = measure.environment_identity()
    monkeypatch.setattr(measure, "environment_identity",
                        lambda: {**identity, "devices": "another processor"})
    assert measure.machine_stamp(1) != here


# -- the store and its listing --------------------------------------------------------------------
@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("KBACKEND_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(measure.REPROBE_ENV, "0")
    monkeypatch.setenv(compile_cache.COMPILE_CACHE_ENV, "1")
    monkeypatch.setattr(measure, "_REPROBED", set())
    return tmp_path


def test_remembered_once_per_machine_then_listed(store, monkeypatch):
    counts = []
    count = lambda: counts.append(1) or {"fused_steps": 8}  # noqa: E731
    net, options = model(), {"batch_size": 8}
    first = remembered(FUSED_STEPS, net, data(), options, count)
    assert first["fused_steps"] == 8 and first["cached"] is False and first["seconds"] >= 0
    again = remembered(FUSED_STEPS, model(), data(), options, count)
    assert again["cached"] is True and len(counts) == 1
    key = measurement_key(net, data(), **options)
    assert stored_probes()[FUSED_STEPS.name] == {key[:12]: "K=8"}
    assert set(stored_probes()) == {probe.name for probe in PROBES}
    # Another machine: found, not used, measured again with a warning.
    identity = measure.environment_identity()
    monkeypatch.setattr(measure, "environment_identity", lambda: {**identity, "devices": "x"})
    with pytest.warns(MeasurementWarning, match="another machine or kbackend version"):
        assert remembered(FUSED_STEPS, net, data(), options, count)["cached"] is False
    assert len(counts) == 2


def test_a_distrusted_entry_is_measured_again(store):
    never = Probe("never", "never.json", 1, str)
    remembered(never, model(), data(), {}, lambda: {"value": 1})
    with pytest.warns(MeasurementWarning, match="not used \\(stale\\)"):
        entry = remembered(never, model(), data(), {}, lambda: {"value": 2},
                           distrust=lambda e: "stale")
    assert entry["value"] == 2


def test_a_damaged_probe_file_is_kept_as_a_backup_and_listed_as_empty(store):
    (store / KNEE.file_name).write_text('{"k": {"knee": 8}')
    with pytest.warns(MeasurementWarning, match="damaged"):
        assert stored_probes()[KNEE.name] == {}
    assert len(list(store.glob(f"{KNEE.file_name}.damaged-*"))) == 1
    entry = remembered(KNEE, model(), data(), {}, lambda: {"resolved": True, "knee": 16})
    assert entry["knee"] == 16
    assert json.loads((store / KNEE.file_name).read_text()).popitem()[1]["knee"] == 16


# -- the probes on the harness ------------------------------------------------------------------
@pytest.mark.slow  # a study prepared (about 17 s on a loaded 2-core CPU)
def test_the_population_probe_is_kept_per_machine_across_studies(store, tmp_path, monkeypatch):
    """On an accelerator (planted) ``population auto`` probes a cell once per machine: a second
    study (another results store) of the same cell reads the harness's entry; ``--reprobe``
    measures it again."""
    import dataclasses

    from kbackend.engines.native import Runs
    from kbackend.hardware.measure import POPULATION
    from kbackend.study.executor import StudyRunner
    from kbackend.study.populations import Populations
    from kbackend.study.store import ResultStore
    from tests.test_study_executor import POPULATED

    probes = []
    monkeypatch.setattr(Runs, "probe_population", lambda self, configs, values, steps, **kw:
                        probes.append(steps) or {"path": "population", "members": len(configs),
                                                 "speedup": 2.0})
    monkeypatch.setattr(StudyRunner, "platform", lambda self: "gpu")

    runner = StudyRunner(dataclasses.replace(POPULATED, population="auto"), None)
    runner.prepare()

    def path(folder: str):  # a study of the cell with its own results store
        with ResultStore(tmp_path / f"{folder}.db") as runner.store:
            return Populations(runner).path("adam", 16, (1e-3, 3e-3))

    first = path("one")
    assert first["path"] == "population" and first["cached"] is False and len(probes) == 1
    assert path("two")["cached"] is True and len(probes) == 1
    assert list(stored_probes()[POPULATION.name].values()) == ["population (4 members)"]
    measure.request_reprobe()
    measure._REPROBED.clear()  # a new process with --reprobe
    assert path("three")["cached"] is False and len(probes) == 2


def test_a_knee_stored_before_the_harness_is_still_read(store):
    """Knee entries of format 2 (issue 47, before the harness) keep their key and stamp: the
    key and stamp below are that code's own formulas; the run reads the entry, probing nothing."""
    import hashlib

    from kbackend.adaptive import AutoBatchSize
    from kbackend.engines import adaptive
    from kbackend.optim import OptimizerSpec

    def digest(payload):
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()

    net, dataset = model(), data(n=4096)
    layers = [(type(layer).__name__, [list(w.shape) for w in layer.weights])
              for layer in net._flatten_layers(include_self=False)]
    old_key = digest({"layers": layers, "policy": str(net.dtype_policy.name), "input": [3],
                      "num_train": 4096, "optimizer": "sgd", "minimum": 8, "fused_steps": 8,
                      "xla": True, "devices": 1})
    old_stamp = digest({**measure.environment_identity(), "format": 2})
    (store / KNEE.file_name).write_text(json.dumps({old_key: {
        "format": 2, "resolved": True, "knee": 64, "measured_on": old_stamp}}))
    bounds, record = adaptive.resolve_bounds(AutoBatchSize(None, None), None, net, dataset,
                                             OptimizerSpec("sgd", 0.1), 8, True)
    assert record["cached"] is True and bounds.maximum == 64 and record["bound"] == "knee"
