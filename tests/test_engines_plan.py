"""The typed plan every engine takes: the numbers from the batch size to the step, made once.

Backend-free: no model is built; ``Engine.plan`` runs the pre-run checks first.
"""

from __future__ import annotations

import dataclasses

import pytest

from kbackend.config import TrainConfig
from kbackend.engines import get_engine
from kbackend.engines.plan import TrainPlan
from kbackend.errors import ConfigError
from kbackend.optim import OptimizerSpec


def test_native_plan_drops_the_last_batch_and_cuts_at_max_steps():
    config = TrainConfig(engine="native", batch_size=32, epochs=3, fused_steps=4, max_steps=50,
                         eval_every=10, optimizer=OptimizerSpec("sgd", 0.1, schedule="cosine"))
    plan = get_engine("native").plan(config, 1000)
    assert plan.steps_per_epoch == 31 and plan.dropped_per_epoch == 1000 - 31 * 32
    assert plan.total_steps == 50 and plan.schedule_steps == 93
    # The schedule spans the epochs' steps (max_steps only stops early), set once here.
    assert plan.optimizer.decay_steps == 93
    assert plan.fused_steps == plan.fused_steps_asked == 4 and plan.eval_every == 10
    assert plan.call_lengths() == [4] * 7 + [3]


def test_keras_plan_keeps_the_last_batch_and_evaluates_each_epoch():
    config = TrainConfig(engine="keras", batch_size=32, epochs=2)
    plan = get_engine("keras").plan(config, 1000)
    assert plan.steps_per_epoch == 32 and plan.dropped_per_epoch == 0
    assert plan.total_steps == plan.schedule_steps == 64 and plan.eval_every == 32


def test_an_explicit_schedule_length_is_kept():
    spec = OptimizerSpec("sgd", 0.1, schedule="cosine", decay_steps=7)
    plan = TrainPlan.of(TrainConfig(batch_size=10, epochs=2, optimizer=spec), 100)
    assert plan.optimizer.decay_steps == 7 and plan.schedule_steps == 20


def test_devices_split_the_global_batch():
    config = TrainConfig(engine="native", batch_size=64, epochs=1, fused_steps=2)
    plan = get_engine("data_parallel").plan(config, 640, devices=4)
    assert (plan.devices, plan.per_device_batch, plan.batch_size) == (4, 16, 64)
    with pytest.raises(ConfigError, match="does not divide evenly over 3 devices"):
        get_engine("data_parallel").plan(config, 640, devices=3)


def test_fused_steps_are_checked_once_against_the_epoch():
    config = TrainConfig(engine="native", batch_size=32, epochs=1, fused_steps=40)
    with pytest.raises(ConfigError, match="holds only 31 full batches"):
        get_engine("native").plan(config, 1000)
    auto = get_engine("native").plan(dataclasses.replace(config, fused_steps=0), 1000)
    assert auto.fused_steps == auto.fused_steps_asked == 0  # measured later by the engine
    resolved = auto.with_fused_steps(8)
    assert (resolved.fused_steps, resolved.fused_steps_asked) == (8, 0)
    with pytest.raises(ConfigError):
        auto.with_fused_steps(32)


@pytest.mark.parametrize(("eval_every", "fused", "points"), [
    (0, 4, [10, 20, 30]),  # once per epoch of 10 steps (calls 4, 4, 2)
    (5, 2, [6, 10, 16, 20, 26, 30]),  # the first call reaching each multiple of 5
    (7, 10, [10, 20, 30]),
])
def test_evaluation_points(eval_every, fused, points):
    config = TrainConfig(engine="native", batch_size=10, epochs=3, fused_steps=fused,
                         eval_every=eval_every)
    plan = TrainPlan.of(config, 100)
    step, seen = 0, []
    for _ in range(plan.epochs):
        for length in plan.call_lengths():
            before, step = step, step + length
            if plan.crosses_evaluation(before, step):
                seen.append(step)
    assert seen == points


def test_the_plan_is_immutable():
    plan = TrainPlan.of(TrainConfig(batch_size=10, epochs=1), 100)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.batch_size = 20  # type: ignore[misc]


def test_the_facts_table_and_the_engines_agree():
    """Every engine has a row of facts; a data-parallel twin is a parallel engine whose own twin
    is itself; each engine's rounding is the plan's."""
    from kbackend.engine_facts import FACTS, engine_facts
    from kbackend.engines import ENGINES

    assert list(FACTS) == list(ENGINES)
    for name, engine in ENGINES.items():
        assert engine.facts is FACTS[name]
        twin = engine_facts(engine.facts.parallel_twin)
        assert twin.parallel and twin.parallel_twin == engine.facts.parallel_twin
        config = TrainConfig(engine=name, batch_size=32, epochs=1)
        assert get_engine(name).plan(config, 1000).steps_per_epoch == \
            engine.facts.steps_per_epoch(1000, 32) == (32 if name == "keras" else 31)
    with pytest.raises(ConfigError, match=r"Unknown engine.*'fit'"):
        engine_facts("fit")
    with pytest.raises(ConfigError, match=r"Invalid engine .fit.: expected one of"):
        TrainConfig(engine="fit")


def test_every_front_door_has_one_default_engine():
    """The CLI's train and study, TrainConfig, StudyConfig, kbackend.train and kbackend.study
    (which passes StudyConfig's) read one default."""
    import inspect

    from kbackend import api
    from kbackend.cli import build_parser
    from kbackend.engine_facts import DEFAULT_ENGINE
    from kbackend.study.config import StudyConfig

    parser = build_parser()
    assert {parser.parse_args(["train"]).engine, parser.parse_args(["study"]).engine,
            TrainConfig().engine, StudyConfig().engine,
            inspect.signature(api.train).parameters["engine"].default} == {DEFAULT_ENGINE}
    assert "engine" not in inspect.signature(api.study).parameters  # StudyConfig's own


def test_epochs_for_a_step_budget():
    from kbackend.data.batching import epochs_for_steps

    assert [epochs_for_steps(steps, 10) for steps in (1, 10, 11, 30)] == [1, 1, 2, 3]
