"""``engines.native.Runs``: many runs on one set of compiled programs, each equal to a fresh run.

A study trains one model with many learning rates and seeds per cell; ``Runs`` resets the cell's
trainer instead of rebuilding and recompiling. These tests check that a reused run is the run
``kbackend.training.train`` would have made (same steps to target, losses and test metrics within
float tolerance), that nothing is compiled again, and that the reset really takes the new rate
and weights (negative controls: a different rate or seed changes the losses).
"""

from __future__ import annotations

import numpy as np
import pytest

from kbackend.engines import native
from kbackend.errors import ConfigError
from kbackend.models import ModelOptions, build_model
from kbackend.optim import OptimizerSpec
from kbackend.training import Target, TrainConfig, train
from tests.conftest import BACKEND, JIT_FOR_SMALL_RUNS
from tests.test_native_engine import toy_dataset

# Multi-threaded XLA on a CPU differs by ~1e-9 between identical calls; test metrics come from
# the trainer's evaluator here and from model.evaluate in train() (other batch sizes and sums).
LOSS_RTOL = 1e-5
TEST_RTOL = 1e-4


@pytest.fixture(scope="module")
def dataset():
    return toy_dataset()


def model_for(dataset, seed):
    return build_model("mlp", dataset.info, ModelOptions(widths=(32, 16), seed=seed))


def config_for(name, rate, seed, **overrides):
    fields = dict(model="mlp", optimizer=OptimizerSpec(name, rate), batch_size=32, epochs=4,
                  engine="native", fused_steps=5, eval_every=5, seed=seed,
                  target=Target("val_accuracy", 0.8), on_divergence="record",
                  jit_compile=JIT_FOR_SMALL_RUNS)
    return TrainConfig(**{**fields, **overrides})


def assert_same_run(reused, fresh):
    assert reused.steps_run == fresh.steps_run
    assert (reused.record.target_reached or {}).get("step") == \
        (fresh.record.target_reached or {}).get("step")
    np.testing.assert_allclose(reused.loss, fresh.loss, rtol=LOSS_RTOL)
    np.testing.assert_allclose([e["val_accuracy"] for e in reused.evals],
                               [e["val_accuracy"] for e in fresh.evals], rtol=LOSS_RTOL)
    for name in ("test_loss", "test_accuracy"):
        assert reused.test[name] == pytest.approx(fresh.test[name], rel=TEST_RTOL)


# Adam on XLA (the study's default), momentum as the other tests run (without XLA on TensorFlow).
@pytest.mark.slow
@pytest.mark.parametrize("optimizer, rates, jit", [("adam", (3e-3, 1e-2), True),
                                                   ("momentum", (0.02, 0.1), JIT_FOR_SMALL_RUNS)])
def test_reused_runs_equal_fresh_runs_and_compile_once(dataset, optimizer, rates, jit):
    runs = native.Runs(model_for(dataset, 0), dataset)
    plans = [(rates[0], 0), (rates[1], 1), (rates[0], 0)]  # the third repeats the first
    reused = [runs.train(config_for(optimizer, rate, seed, jit_compile=jit),
                         native.model_values(model_for(dataset, seed))) for rate, seed in plans]
    for (rate, seed), history in zip(plans[:2], reused[:2], strict=True):
        fresh = train(config_for(optimizer, rate, seed, jit_compile=jit), dataset=dataset,
                      model=model_for(dataset, seed)).history
        assert_same_run(history, fresh)
    assert_same_run(reused[2], reused[0])  # back to the first rate and seed: the first run again
    assert runs.trainers_built == 1
    assert reused[0].timing["compile_time"] > 0
    assert reused[1].timing["compile_time"] == 0.0 == reused[2].timing["compile_time"]
    assert sum(reused[-1].record.trace_counts.values()) == 1  # one program for three runs
    # Negative controls: the reset took the new rate and weights.
    first, other = np.asarray(reused[0].loss), np.asarray(reused[1].loss)
    length = min(first.size, other.size)
    assert not np.allclose(first[:length], other[:length], rtol=1e-3)


def test_a_new_rate_alone_changes_the_run(dataset):
    """Same seed, another rate: the losses differ from the first step's update on."""
    runs = native.Runs(model_for(dataset, 0), dataset)
    values = native.model_values(model_for(dataset, 0))
    slow, fast = (runs.train(config_for("sgd", rate, 0, target=None, epochs=1), values)
                  for rate in (1e-3, 0.3))
    assert slow.loss[0] == pytest.approx(fast.loss[0], rel=LOSS_RTOL)  # same weights, same batch
    assert abs(slow.loss[-1] - fast.loss[-1]) > 0.05


@pytest.mark.slow
def test_another_batch_size_or_optimizer_builds_another_trainer(dataset):
    runs = native.Runs(model_for(dataset, 0), dataset)
    values = native.model_values(model_for(dataset, 0))
    for optimizer, batch in (("sgd", 32), ("sgd", 32), ("adam", 32), ("adam", 64)):
        runs.train(config_for(optimizer, 0.01, 0, batch_size=batch, epochs=1, target=None), values)
    assert runs.trainers_built == 3


@pytest.mark.slow
def test_a_schedule_keys_the_trainer_by_its_rate(dataset):
    """A schedule is traced with its rate: two rates, two trainers, each run still correct."""
    runs = native.Runs(model_for(dataset, 0), dataset)
    for rate in (0.01, 0.03):
        spec = OptimizerSpec("sgd", rate, schedule="cosine", decay_steps=20)
        config = config_for("sgd", rate, 0, optimizer=spec, target=None, epochs=2)
        reused = runs.train(config, native.model_values(model_for(dataset, 0)))
        fresh = train(config, dataset=dataset, model=model_for(dataset, 0)).history
        assert_same_run(reused, fresh)
    assert runs.trainers_built == 2


def test_auto_fused_steps_is_refused(dataset):
    runs = native.Runs(model_for(dataset, 0), dataset)
    with pytest.raises(ConfigError, match="explicit fused_steps"):
        runs.train(config_for("sgd", 0.1, 0, fused_steps=0),
                   native.model_values(model_for(dataset, 0)))


def test_step_timer_runs_the_cells_program_without_compiling(dataset):
    runs = native.Runs(model_for(dataset, 0), dataset)
    values = native.model_values(model_for(dataset, 0))
    config = config_for("adam", 3e-3, 0, target=None, epochs=1)
    runs.train(config, values)
    trainer = runs.trainer(config)
    traces = dict(trainer.trace_counts)
    timer = runs.step_timer(config, values, steps=12)  # 3 calls of 5 steps
    before = native.model_values(runs.model)
    timer()
    trainer.finish()
    assert trainer.trace_counts == traces and runs.trainers_built == 1
    assert not np.allclose(native.model_values(runs.model)[0][0], before[0][0])  # it trained


def test_a_cells_first_run_reports_building_its_trainer(dataset):
    """Set-up (building a cell's trainer) is timed once per cell: the study counts it with the
    cell's start-up."""
    runs = native.Runs(model_for(dataset, 0), dataset)
    values = native.model_values(model_for(dataset, 0))
    first, again = (runs.train(config_for("sgd", rate, 0, batch_size=32, epochs=1, target=None),
                               values) for rate in (0.01, 0.02))
    assert first.timing["setup_time"] > 0 and again.timing["setup_time"] == 0.0


@pytest.mark.skipif(BACKEND != "jax", reason="the JAX trainer's optimizer init")
def test_one_compiled_optimizer_init_serves_every_rate_and_budget():
    import jax

    from kbackend.backends.jax import step
    from kbackend.backends.jax.optimizers import to_optax

    params = [jax.numpy.ones((3, 2)), jax.numpy.zeros(2)]
    step._compiled_init.cache_clear()  # other tests of this process filled it
    specs = [OptimizerSpec("adam", rate).with_total_steps(steps)
             for rate, steps in ((1e-3, 100), (3e-2, 700))]
    states = [step.fresh_opt_state(spec, params) for spec in specs]
    assert step._compiled_init.cache_info().currsize == 1
    for spec, state in zip(specs, states, strict=True):
        expected = jax.jit(to_optax(spec).init)(params)
        for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(expected), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
