"""The adaptive batch size's MAX: a throughput knee that holds on a busy machine.

The probe times pairs of sizes interleaved, keeps the noise with the figure, re-measures a noisy
pair or a knee at MIN within its budget, and falls back to a bound from the data where the curve
stays unresolved. Its clock is injected: a virtual clock advanced by a cost model stands for the
machine, slowed on purpose to stand for a busy one. The per-machine store: a damaged file is
kept as a backup, an entry from another machine or version is measured again, ``--reprobe``
measures again, and ``kbackend info`` lists what is stored."""

from __future__ import annotations

import json
import random
import warnings

import pytest

from kbackend.backends import compile_cache
from kbackend.engines import adaptive as engine
from kbackend.hardware import measure
from kbackend.hardware.knee import measured_gain
from kbackend.hardware.measure import (
    KNEE,
    MeasurementWarning,
    machine_measurement,
    summarize,
    time_interleaved,
)


class VirtualClock:
    """Seconds that pass only when a (fake or real) trainer's call is charged to it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def step_seconds(size: int) -> float:
    """A device whose step costs 1 ms + 0.1 ms per sample: each doubling gains 10 / (10 + 2b),
    >= 10 % up to batch 32 -> 64 (13.5 %), 7 % from 64 to 128: the knee is 64."""
    return 1e-3 + 1e-4 * size


class CostTrainer:
    """A trainer whose calls charge ``step_seconds`` per step to ``clock``, times ``slow(size,
    call)`` (a busy machine); it records the sizes compiled and puts its state back."""

    def __init__(self, clock: VirtualClock, slow=lambda size, call: 1.0) -> None:
        self.clock, self.slow, self.calls, self.state = clock, slow, 0, "weights"
        self.compiled: list[tuple[int, int]] = []

    def state_copy(self):
        return self.state

    def restore_state(self, saved) -> None:
        self.state = saved

    def put_epoch(self, order):
        self.state = "changed by the probe"
        return order

    def compile(self, length, rows) -> None:
        self.compiled.append((rows.shape[1], length))

    def run(self, rows, start, length):
        size = rows.shape[1]
        self.clock.now += length * step_seconds(size) * self.slow(size, self.calls)
        self.calls += 1

    def fetch(self, pending) -> None:
        pass

    def take_noise_norms(self) -> None:
        pass


def probe(trainer: CostTrainer, n_train: int = 4096, **options):
    """The probe on ``trainer``'s virtual clock, one call per timed repeat unless ``repeat_s``
    is given (the cost models below count calls)."""
    return engine.probe_knee(trainer, n_train, 8, 8, clock=trainer.clock,
                             **{"repeat_s": 0.0, **options})


# -- the harness ----------------------------------------------------------------------------
def test_interleaved_timing_rotates_the_order_and_keeps_the_noise():
    clock, order = VirtualClock(), []

    def call(name, seconds):
        def fn():
            order.append(name)
            clock.now += seconds
        return fn

    timings = time_interleaved({"a": call("a", 1.0), "b": call("b", 2.0)}, 3,
                               wait=lambda v: v, clock=clock)
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b"]  # first calls, then rotated rounds
    assert timings["a"].times == (1.0, 1.0, 1.0) and timings["b"].median_s == 2.0
    assert timings["a"].cv == 0.0 and not timings["a"].noisy
    assert summarize(1.0, [1.0, 1.5, 0.7]).noisy  # cv ~ 0.37


def test_a_gain_interval_straddling_ten_percent_is_noisy():
    small = summarize(0.0, [1.0, 1.0, 1.0, 1.0, 1.0])
    steady = measured_gain(small, summarize(0.0, [1.5] * 5), 8, 16)  # 2 / 1.5 - 1 = 0.33
    assert steady.median == pytest.approx(1 / 3) and not steady.noisy
    mixed = measured_gain(small, summarize(0.0, [1.5, 1.9, 1.5, 1.9, 1.7]), 8, 16)
    assert mixed.low < 0.1 < mixed.high and mixed.noisy


# -- the probe ------------------------------------------------------------------------------
def test_a_quiet_machine_finds_the_knee_and_restores_the_state():
    trainer = CostTrainer(VirtualClock())
    record = probe(trainer)
    assert record["knee"] == 64 and record["resolved"] and record["plateau_reached"]
    assert record["sizes"] == [8, 16, 32, 64, 128]
    assert record["remeasured"] == 0 and not record["noisy"]
    assert [g["from"] for g in record["gains"]] == [8, 16, 32, 64]
    assert record["gains"][-1]["median"] == pytest.approx(10 / 138)
    assert trainer.state == "weights"


def test_a_busy_probe_that_ends_at_min_is_measured_again_and_grows():
    """The busy-machine case of issue 47: while the first pair is timed, every call above MIN
    runs 3x slower (8 -> 16 'loses' 40 %), which put the stored knee at MIN = 8. The knee at
    MIN is measured afresh before it is trusted; the load has passed, the knee is 64."""
    trainer = CostTrainer(VirtualClock(), slow=lambda size, call: 3.0 if call < 12 and size > 8
                          else 1.0)
    record = probe(trainer)
    assert record["knee"] == 64 and record["resolved"] and record["remeasured"] == 1


def test_a_model_whose_knee_is_at_min_keeps_it_after_measuring_twice():
    clock = VirtualClock()
    trainer = CostTrainer(clock)
    trainer.run = lambda rows, start, length: setattr(  # time per sample flat: no gain
        clock, "now", clock.now + length * 1e-4 * rows.shape[1])
    record = probe(trainer)
    assert record["knee"] == 8 and record["resolved"] and record["remeasured"] == 1
    maximum, source, note = engine.knee_bound(record, 4096, 8)
    assert (maximum, source) == (8, "knee at MIN") and "\n" not in note and "MIN" in note


def test_a_curve_that_stays_noisy_falls_back_to_the_data_bound_within_the_budget():
    noise = random.Random(0)
    trainer = CostTrainer(VirtualClock(), slow=lambda size, call: noise.choice([0.5, 1.0, 2.5]))
    record = probe(trainer, budget_s=5.0)
    assert not record["resolved"] and record["knee"] is None and record["noisy"]
    assert 1 <= record["remeasured"] <= engine.PROBE_MAX_REMEASURES
    maximum, source, note = engine.knee_bound(record, 4096, 8)
    assert (maximum, source) == (128, "data")  # 4096 / 32
    assert "unresolved" in note and "training split / 32" in note and "\n" not in note
    # The budget stops re-measuring: with none left, one measurement per pair only.
    assert probe(CostTrainer(VirtualClock(), slow=trainer.slow), budget_s=0.0)["remeasured"] == 0


@pytest.mark.parametrize(("n_train", "expected"), [(4096, 128), (1293, 32), (100, 8), (20, 8)])
def test_the_data_bound(n_train, expected):
    assert engine.data_bound(n_train, 8) == expected


# -- the per-machine store --------------------------------------------------------------------
@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("KBACKEND_CACHE_DIR", str(tmp_path))
    # set (to off) rather than deleted: monkeypatch then restores the variable's absence after
    # the test, whatever a test's --reprobe wrote
    monkeypatch.setenv(measure.REPROBE_ENV, "0")
    # the store is kept only with the compile cache on (an in-process --no-compile-cache, as the
    # command-line fuzz runs, leaves it off)
    monkeypatch.setenv(compile_cache.COMPILE_CACHE_ENV, "1")
    monkeypatch.setattr(measure, "_REPROBED", set())
    return tmp_path


def test_measured_once_then_stored(store):
    counts = []
    count = lambda: counts.append(1) or {"value": len(counts)}  # noqa: E731
    assert machine_measurement("m.json", "k", count, stamp="here") == (
        {"value": 1, "measured_on": "here"}, False)
    assert machine_measurement("m.json", "k", count, stamp="here")[1] is True
    assert len(counts) == 1


def test_a_damaged_file_is_backed_up_and_measured_again(store):
    (store / "m.json").write_text('{"k": {"value": 1}, "other": ')
    with pytest.warns(MeasurementWarning, match="damaged"):
        entry, cached = machine_measurement("m.json", "k", lambda: {"value": 2}, "here")
    assert entry == {"value": 2, "measured_on": "here"} and not cached
    backups = list(store.glob("m.json.damaged-*"))
    assert len(backups) == 1 and backups[0].read_text().startswith('{"k"')


def test_a_damaged_or_older_entry_is_dropped_and_the_others_kept(store):
    good = {"value": 1, "measured_on": "here"}
    older = {"value": 0}  # no stamp: written before the harness
    (store / "m.json").write_text(json.dumps({"bad": [1, 2], "older": older, "good": good}))
    with pytest.warns(MeasurementWarning, match="2 damaged or older entries ignored"):
        machine_measurement("m.json", "new", lambda: {"value": 3}, "here")
    stored = json.loads((store / "m.json").read_text())
    assert stored == {"good": good, "new": {"value": 3, "measured_on": "here"}}


def test_an_entry_from_another_machine_is_measured_again_with_a_warning(store):
    machine_measurement("m.json", "k", lambda: {"value": 1}, stamp="elsewhere")
    with pytest.warns(MeasurementWarning, match="another machine or kbackend version"):
        entry, cached = machine_measurement("m.json", "k", lambda: {"value": 2}, stamp="here")
    assert entry["value"] == 2 and not cached


def test_an_older_knee_or_one_unresolved_by_the_old_noise_rule_is_not_trusted():
    """An unresolved curve probed with repeats of 50 ms keeps its data bound (no probe on every
    run: --reprobe measures it again); one the per-call noise rule left unresolved is measured
    again once."""
    assert engine.distrust_knee({"knee": 8, "sizes": [8, 16]}) == "an older or damaged entry"
    old = {"format": engine.KNEE_PROBE_FORMAT, "resolved": False, "knee": None}
    assert "unresolved" in engine.distrust_knee(old)
    assert engine.distrust_knee({**old, "repeat_s": engine.PROBE_REPEAT_S}) is None
    assert engine.distrust_knee({**old, "resolved": True, "knee": 64}) is None
    assert engine.distrust_knee({**old, "resolved": True, "knee": None}) == "a damaged entry"


def test_reprobe_measures_again_once_per_process_and_needs_nothing_stored(store):
    measure.request_reprobe()
    counts = []
    count = lambda: counts.append(1) or {"value": len(counts)}  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing stored: no warning, no error
        assert machine_measurement("m.json", "k", count, "here") == (
            {"value": 1, "measured_on": "here"}, False)
    assert machine_measurement("m.json", "k", count, "here")[1] is True
    measure._REPROBED.clear()  # a new process with --reprobe
    assert machine_measurement("m.json", "k", count, "here") == (
        {"value": 2, "measured_on": "here"}, False)



# -- end to end: the busy-machine case on this backend ----------------------------------------
def small_device_step_seconds(size: int) -> float:
    """A device whose knee is 16: 8 -> 16 gains 3 / 19 = 16 %, 16 -> 32 3 / 35 = 9 %."""
    return 1e-3 + (1e-3 / 3) * size


@pytest.mark.slow  # three sizes compiled for the probe (about 10 s each on a loaded 2-core CPU)
def test_a_knee_stored_at_min_by_a_busy_probe_is_measured_again_and_the_batch_grows(
        store, monkeypatch):
    """Issue 47's busy-machine case: the landed probe stored knee 8 (= MIN) for this workload;
    the next ``--batch-size auto`` run ignores that older entry with a warning, measures the
    knee again on its own compiled calls (the clock a cost model whose knee is 16) and grows
    past 8."""
    from kbackend.backends import adaptive as adaptive_backend
    from kbackend.optim import OptimizerSpec
    from kbackend.training import TrainConfig, train
    from tests.conftest import JIT_FOR_SMALL_RUNS

    monkeypatch.setattr(measure, "measurement_key", lambda *args, **kwargs: "workload")
    (store / KNEE.file_name).write_text(json.dumps({"workload": {
        "sizes": [8, 16], "samples_per_s": [41000.0, 36000.0], "knee": 8,
        "plateau_reached": True, "out_of_memory_at": None}}))  # the landed format, busy
    clock = VirtualClock()
    monkeypatch.setattr(engine, "PROBE_CLOCK", clock)
    trainer_class = adaptive_backend().AdaptiveTrainer
    real_run = trainer_class.run

    def charged_run(self, rows, start, length):
        clock.now += length * small_device_step_seconds(int(rows.shape[-1]))
        return real_run(self, rows, start, length)

    monkeypatch.setattr(trainer_class, "run", charged_run)
    config = TrainConfig(model="seed_mlp", dataset="digits", engine="native", batch_size="auto",
                         optimizer=OptimizerSpec("adam", 3e-3), epochs=3, fused_steps=8,
                         eval_every=40, seed=0, jit_compile=JIT_FOR_SMALL_RUNS)
    with pytest.warns(MeasurementWarning, match="older entries ignored"):
        record = train(config).history.record.adaptive_batch
    probe = record["knee_probe"]
    assert probe["knee"] == 16 and probe["resolved"] and not probe["cached"]
    assert probe["bound"] == "knee" and record["max"] == 16
    assert probe["probe_seconds"] > 0 and "remeasured" in probe and "budget_s" in probe
    assert max(r["batch_size"] for r in record["ranges"]) > 8
    stored = json.loads((store / KNEE.file_name).read_text())["workload"]
    assert stored["knee"] == 16 and stored["format"] == engine.KNEE_PROBE_FORMAT


# -- the command line -------------------------------------------------------------------------
def test_info_lists_the_stored_probes(store, cli):
    (store / KNEE.file_name).write_text(json.dumps({
        "a" * 64: {"format": engine.KNEE_PROBE_FORMAT, "resolved": True, "knee": 64,
                   "sizes": [8, 16, 32, 64, 128], "noisy": False, "remeasured": 1,
                   "measured_on": "here"}}))
    (store / "fused_steps_probe.json").write_text(json.dumps({"b" * 64: {
        "fused_steps": 16, "measured_on": "here"}}))
    result = cli("info")
    assert result.returncode == 0
    assert "stored throughput knee:  1" in result.stdout
    assert "aaaaaaaaaaaa: knee 64, sizes 8-128, noisy no, re-measured 1" in result.stdout
    assert "bbbbbbbbbbbb: K=16" in result.stdout and "stored population:       0" in result.stdout
    listed = json.loads(cli("info", "--json").stdout)["stored_probes"]
    assert listed["fused steps"] == {"b" * 12: "K=16 (measured elsewhere)"}  # stamp "here"


@pytest.mark.parametrize("command", ["train", "study", "launch"])
def test_reprobe_is_a_flag_of_the_commands_that_train(cli, command):
    assert "--reprobe" in cli(command, "--help").stdout


def test_reprobe_on_the_command_line_asks_this_process_and_its_children(cli, monkeypatch):
    import os

    monkeypatch.setenv(measure.REPROBE_ENV, "0")  # restored after the test
    assert not measure.reprobe_requested()
    from kbackend.commands import train as train_command

    seen = []  # what the command saw while it ran (main undoes it on return, in-process)
    monkeypatch.setattr(train_command, "run", lambda args: seen.append(
        (os.environ[measure.REPROBE_ENV], measure.reprobe_requested())) or 0)
    assert cli("train", "--reprobe").returncode == 0
    assert seen == [("1", True)]


def jittery(seed: int):
    """A shared machine: every call takes 0.8, 1.0 or 1.25 times its cost, at random."""
    noise = random.Random(seed)
    return lambda size, call: noise.choice([0.8, 1.0, 1.25])


def test_repeats_long_enough_resolve_a_knee_that_single_calls_leave_noisy():
    """Per call the jitter is about 20 % (the repeats' robust cv 0.3): over 8 machines (seeds)
    single calls leave the curve unresolved on most. Each timed repeat running a size's call
    for 2 s (15 calls and more back to back) averages it out: the knee is found, at 64, on
    every one."""
    single = [probe(CostTrainer(VirtualClock(), slow=jittery(seed)), budget_s=1e4)
              for seed in range(8)]
    assert sum(not record["resolved"] for record in single) >= 6
    assert all(record["calls_per_repeat"] == [1] * len(record["sizes"]) for record in single)
    for seed in range(8):
        held = probe(CostTrainer(VirtualClock(), slow=jittery(seed)), budget_s=1e4,
                     repeat_s=2.0)
        assert held["resolved"] and held["knee"] == 64, (seed, held["gains"])
        assert held["repeat_s"] == 2.0 and min(held["calls_per_repeat"]) >= 15
        assert max(held["cv"]) <= measure.NOISY_CV


def test_a_steady_gain_near_ten_percent_is_decided_by_its_median():
    """Every other call at 128 takes 0.9 times its cost: each size's repeats are steady
    (robust cv 0 or 0.07), but the doubling 64 -> 128 gains 7.2 % or 19.1 % by turns, so its
    interval straddles 10 % however often it is re-measured. The budget spent, the median
    decides and the curve is resolved."""
    calls_at_128 = []

    def slow(size, call):
        if size != 128:
            return 1.0
        calls_at_128.append(call)
        return 0.9 if len(calls_at_128) % 2 else 1.0

    record = probe(CostTrainer(VirtualClock(), slow=slow))
    last = record["gains"][-1]
    assert last["from"] == 64 and last["noisy"] and last["steady"], record["gains"]
    assert last["low"] < 0.1 < last["high"] and last["rounds"] > engine.PROBE_ROUNDS
    assert record["resolved"] and record["knee"] == (64 if last["median"] < 0.1 else 128)


def test_the_probe_times_no_size_past_the_data_bound():
    """Where every doubling still gains (a call costs the same at any size), the probe stops at
    the data bound (4096 / 32 = 128: a larger batch leaves fewer than 32 steps an epoch) rather
    than timing sizes up to the training split, and MAX says where it came from; tiny data
    (bound = MIN) still times one doubling."""
    clock = VirtualClock()
    trainer = CostTrainer(clock)
    trainer.run = lambda rows, start, length: setattr(clock, "now", clock.now + length * 1e-3)
    record = probe(trainer)
    assert record["sizes"] == [8, 16, 32, 64, 128] and record["probe_limit"] == 128
    assert record["knee"] == 128 and record["resolved"] and not record["plateau_reached"]
    maximum, source, note = engine.knee_bound(record, 4096, 8)
    assert (maximum, source) == (128, "data") and "still gained" in note and "\n" not in note
    tiny = probe(trainer, n_train=100)
    assert tiny["sizes"] == [8, 16] and tiny["knee"] == 16 and tiny["probe_limit"] == 16
    assert engine.knee_bound(tiny, 100, 8)[:2] == (16, "knee")


def test_an_unsteady_but_clear_doubling_is_re_measured_once_then_decided():
    """Calls at 16 take 0.8, 1.0 or 1.25 times their cost by turns (robust cv 0.3: unsteady),
    yet 8 -> 16 gains +11 % to +73 % in every round: clear of 10 %. It gets one re-measurement
    (10 rounds), not more, and is decided by its median."""
    turns = [0.8, 1.0, 1.25]
    calls_at_16 = []

    def slow(size, call):
        if size != 16:
            return 1.0
        calls_at_16.append(call)
        return turns[len(calls_at_16) % 3]

    first = probe(CostTrainer(VirtualClock(), slow=slow))["gains"][0]
    assert first["from"] == 8 and not first["steady"] and not first["straddles"], first
    assert first["rounds"] == 2 * engine.PROBE_ROUNDS


def test_a_gain_interval_narrows_with_rounds_where_min_max_would_straddle():
    """Ten rounds gaining +30 % but for one +5 % and one +50 %: the interval at 93.75 % (the
    2nd smallest and largest) is [0.3, 0.3], clear of 10 %; [min, max] would straddle it."""
    small = summarize(0.0, [1.0] * 10)
    large = summarize(0.0, [2 / 1.3] * 8 + [2 / 1.05, 2 / 1.5])
    gain = measured_gain(small, large, 8, 16)
    assert gain.low == pytest.approx(0.3) and gain.high == pytest.approx(0.3)
    assert gain.steady and not gain.straddles and not gain.noisy
