"""Training with Keras fit: accuracy reached, reproducibility, history format, bad options."""

from __future__ import annotations

import numpy as np
import pytest

from kbackend.errors import ConfigError, DataError
from kbackend.optim import OptimizerSpec, schedule_value
from kbackend.training import TrainConfig, train
from tests.conftest import JIT_FOR_SMALL_RUNS

# XLA stays on (the default) in the first test only: the others test the history, stopping and
# schedules, not compilation, and TensorFlow's XLA compile was most of each of their runs.


@pytest.mark.slow
def test_seed_mlp_reaches_90_percent_on_digits():
    result = train(TrainConfig(engine="keras", epochs=8, batch_size=32, seed=0))
    assert result.history.best("val_accuracy") >= 0.90
    assert result.history.test["test_accuracy"] >= 0.88


def test_history_records_every_step_and_excludes_eval_time():
    result = train(TrainConfig(epochs=2, batch_size=100, optimizer=OptimizerSpec("sgd", 0.1),
                               engine="keras", jit_compile=JIT_FOR_SMALL_RUNS))
    history = result.history
    steps_per_epoch = -(-result.dataset.info.num_train // 100)
    assert history.step == list(range(1, 2 * steps_per_epoch + 1))
    assert all(np.diff(history.time) > 0)
    assert len(history.evals) == 2 and history.evals[-1]["step"] == 2 * steps_per_epoch
    # The per-step losses, weighted by batch size, average to Keras's reported epoch loss.
    sizes = np.full(steps_per_epoch, 100.0)
    sizes[-1] = result.dataset.info.num_train - 100 * (steps_per_epoch - 1)
    epoch_mean = np.average(history.loss[:steps_per_epoch], weights=sizes)
    assert epoch_mean == pytest.approx(history.evals[0]["train_loss"], rel=1e-4)
    assert history.timing["train_time"] + history.timing["eval_time"] <= history.timing["wall_time"]
    assert history.timing["eval_time"] > 0


@pytest.mark.slow
def test_training_is_reproducible_for_a_seed():
    config = TrainConfig(epochs=1, batch_size=64, seed=5, optimizer=OptimizerSpec("momentum", 0.05),
                         engine="keras", jit_compile=JIT_FOR_SMALL_RUNS)
    a, b = train(config).history, train(config).history
    # XLA on a multi-threaded CPU may differ by ~1e-9 between identical calls (design notes).
    np.testing.assert_allclose(a.loss, b.loss, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_early_stopping_stops_and_restores_best():
    config = TrainConfig(epochs=40, batch_size=16, early_stopping=2, monitor="val_loss",
                         engine="keras", jit_compile=JIT_FOR_SMALL_RUNS,
                         optimizer=OptimizerSpec("adam", 0.01))
    history = train(config).history
    assert history.stopped_early and history.record.epochs_run < 40


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["cosine", "exponential"])
def test_schedules_train(schedule):
    spec = OptimizerSpec("sgd", 0.1, schedule=schedule, warmup_steps=5)
    config = TrainConfig(engine="keras", epochs=3, optimizer=spec, jit_compile=JIT_FOR_SMALL_RUNS)
    assert train(config).history.best("val_accuracy") > 0.8


def test_schedule_values():
    import keras

    spec = OptimizerSpec("sgd", 0.1, schedule="cosine", decay_steps=100, warmup_steps=10)
    values = [float(schedule_value(spec, s, keras.ops)) for s in (0, 9, 10, 60, 110, 500)]
    assert values[0] == pytest.approx(0.01) and values[1] == pytest.approx(0.1)
    assert values[2] == pytest.approx(0.1) and values[3] == pytest.approx(0.05, rel=1e-5)
    assert values[4] == pytest.approx(0.0, abs=1e-8) and values[5] == pytest.approx(0.0, abs=1e-8)
    expo = OptimizerSpec("sgd", 0.1, schedule="exponential", decay_steps=10, decay_rate=0.5)
    assert float(schedule_value(expo, 20, keras.ops)) == pytest.approx(0.025, rel=1e-6)


@pytest.mark.slow
@pytest.mark.mnist
def test_seed_mlp_one_epoch_on_mnist(data_dir):
    config = TrainConfig(dataset="mnist", data_dir=str(data_dir), epochs=1, batch_size=128,
                         engine="keras", jit_compile=JIT_FOR_SMALL_RUNS)
    history = train(config).history
    assert history.test["test_accuracy"] >= 0.95


@pytest.mark.parametrize(("make", "error", "message"), [
    (lambda: OptimizerSpec("rmsprop"), ConfigError, "Unknown optimizer"),
    (lambda: OptimizerSpec("sgd", 0.0), ConfigError, "learning.rate"),
    (lambda: OptimizerSpec("sgd", -1.0), ConfigError, "learning.rate"),
    (lambda: TrainConfig(epochs=0), ConfigError, "epochs"),
    (lambda: train(TrainConfig(batch_size=5000)), DataError, "larger than the training split"),
    (lambda: train(TrainConfig(engine="warp")), ConfigError,
     "Invalid engine 'warp': expected one of"),
])
def test_bad_options_fail_before_training(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_target_stops_training_and_records_when_reached():
    from kbackend.training import Target

    config = TrainConfig(epochs=30, batch_size=32, target=Target("val_accuracy", 0.85),
                         engine="keras", jit_compile=JIT_FOR_SMALL_RUNS)
    history = train(config).history
    reached = history.record.target_reached
    assert reached["epoch"] < 30 and history.evals[-1]["val_accuracy"] >= 0.85
    assert reached["train_time"] <= history.timing["train_time"] + 1e-9




def test_unreachable_target_is_rejected():
    from kbackend.training import Target

    with pytest.raises(ConfigError, match="accuracy can only reach"):
        Target("val_accuracy", 1.2)


def test_max_steps_stops_mid_epoch_and_the_evaluation_names_the_last_step():
    history = train(TrainConfig(engine="keras", epochs=5, batch_size=32, max_steps=10,
                                jit_compile=JIT_FOR_SMALL_RUNS)).history  # 41 steps an epoch
    assert history.steps_run == 10 and history.step[-1] == 10
    assert history.evals[-1]["step"] == 10
