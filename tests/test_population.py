"""Populations: a cell's runs (learning rates x seeds) as one vmapped program on JAX.

Each member must be the run it would be alone (``Runs.train``): same steps, stopping point and
target step; losses, validation and test metrics within float tolerance (XLA's batched matmul
rounds differently from the plain one: measured ~1e-7 relative on these runs, asserted 1e-5).
A diverged member stops alone; TensorFlow has no population trainer and says so.
"""

from __future__ import annotations

import numpy as np
import pytest

from kbackend.backend_choice import active_backend
from kbackend.backends import impl
from kbackend.engines import native
from kbackend.errors import BackendError, ConfigError
from tests.test_native_engine import toy_dataset
from tests.test_native_runs import config_for, model_for

LOSS_RTOL = 1e-5
needs_jax = pytest.mark.skipif(active_backend() != "jax", reason="populations are JAX's vmap")


@pytest.fixture(scope="module")
def dataset():
    return toy_dataset()


@pytest.fixture(scope="module")
def runs(dataset):
    return native.Runs(model_for(dataset, 0), dataset)


def members(dataset, plans, optimizer="adam", **overrides):
    configs = [config_for(optimizer, rate, seed, **overrides) for rate, seed in plans]
    values = [native.model_values(model_for(dataset, seed)) for _, seed in plans]
    return configs, values


def assert_same_run(member, alone):
    assert member.steps_run == alone.steps_run
    def target_step(history):
        return (history.record.target_reached or {}).get("step")

    assert target_step(member) == target_step(alone)
    np.testing.assert_allclose(member.loss, alone.loss, rtol=LOSS_RTOL)
    assert [e["step"] for e in member.evals] == [e["step"] for e in alone.evals]
    np.testing.assert_allclose([e["val_loss"] for e in member.evals],
                               [e["val_loss"] for e in alone.evals], rtol=LOSS_RTOL)
    np.testing.assert_allclose([e["val_accuracy"] for e in member.evals],
                               [e["val_accuracy"] for e in alone.evals], rtol=LOSS_RTOL)
    for name in ("test_loss", "test_accuracy"):
        assert member.test[name] == pytest.approx(alone.test[name], rel=LOSS_RTOL)


@pytest.mark.slow
@needs_jax
def test_each_member_equals_its_run_alone(dataset, runs):
    plans = [(3e-3, 0), (1e-2, 0), (3e-3, 1), (1e-2, 1)]  # two rates x two seeds
    configs, values = members(dataset, plans)
    population = runs.train_population(configs, values)
    alone = [runs.train(c, v) for c, v in zip(configs, values, strict=True)]
    for member, single in zip(population, alone, strict=True):
        assert_same_run(member, single)
    # Members stop at their own targets: the runs do not all stop at one step.
    assert len({h.steps_run for h in population}) > 1
    assert any(h.record.target_reached is not None for h in population)
    assert [h.record.population for h in population] == [
        {"members": 4, "index": i} for i in range(4)]
    # One program for the population: its call length compiled once.
    assert sum(population[0].record.trace_counts.values()) == 1


@needs_jax
def test_a_diverged_member_stops_alone(dataset, runs):
    plans = [(0.1, 0), (1e30, 0)]
    configs, values = members(dataset, plans, "sgd")
    healthy, diverged = runs.train_population(configs, values)
    alone = runs.train(configs[1], values[1])
    assert diverged.record.diverged["step"] == alone.record.diverged["step"] == 2
    assert healthy.record.diverged is None
    assert diverged.steps_run == 5 < healthy.steps_run  # stopped at the end of its first call
    assert np.isfinite(healthy.test["test_loss"]) and np.isfinite(healthy.loss).all()


@needs_jax
def test_members_of_different_cells_are_refused(dataset, runs):
    configs, values = members(dataset, [(1e-2, 0), (1e-2, 1)])
    other = config_for("adam", 1e-2, 1, batch_size=16)
    with pytest.raises(ConfigError, match="share everything but the learning rate"):
        runs.train_population([configs[0], other], values)


@needs_jax
def test_probe_times_both_paths_and_picks_one(dataset, runs):
    configs, values = members(dataset, [(1e-2, 0), (3e-3, 1)])
    probe = runs.probe_population(configs, values, steps=10, repeats=2)
    assert probe["path"] in ("population", "sequential")
    assert len(probe["population_s"]) == 2 == len(probe["sequential_s"])
    assert probe["speedup"] > 0 and probe["members"] == 2


@pytest.mark.skipif(active_backend() != "tensorflow", reason="the TensorFlow answer")
def test_tensorflow_says_it_has_no_population_trainer(dataset, runs):
    assert impl().supports_populations() is False
    configs, values = members(dataset, [(1e-2, 0), (3e-3, 1)])
    assert runs.probe_population(configs, values, steps=10)["path"] == "sequential"
    with pytest.raises(BackendError, match="no population trainer"):
        runs.train_population(configs, values)
