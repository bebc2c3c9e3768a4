"""The adaptive trainer (``backends.adaptive().AdaptiveTrainer``): micro-batched fused steps train
exactly as the plain native trainer does, a change of batch size carries the weights and the
optimizer state over, and each (batch size, call length) compiles once."""

from __future__ import annotations

import numpy as np
import pytest

from kbackend.adaptive import NoiseScale
from kbackend.engines.loop import EpochRunner
from kbackend.optim import OptimizerSpec
from tests.conftest import BACKEND, JIT_FOR_SMALL_RUNS
from tests.test_native_engine import toy_dataset, toy_model

# float32 gradients summed per micro-batch, then averaged, against one full-batch sum, over
# 2 epochs of steps (multi-threaded XLA adds ~1e-9 per call).
LOSS_RTOL = 1e-4


@pytest.fixture(scope="module")
def dataset():
    return toy_dataset()


def _trainers(dataset, spec, jit=JIT_FOR_SMALL_RUNS):
    from kbackend.backends import adaptive, impl

    plain_model, adaptive_model = toy_model(dataset, seed=5), toy_model(dataset, seed=5)
    adaptive_model.set_weights(plain_model.get_weights())  # TF and JAX seed differently
    plain = impl().native_trainer(plain_model, spec, dataset, jit_compile=jit)
    grown = adaptive().AdaptiveTrainer(adaptive_model, spec, dataset, jit_compile=jit)
    return plain, grown


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_micro_batched_steps_train_like_the_plain_step(dataset, optimizer):
    spec = OptimizerSpec(optimizer, 0.05 if optimizer == "sgd" else 3e-3)
    plain, grown = _trainers(dataset, spec)
    n = len(dataset.x_train)
    plain_run, grown_run = EpochRunner(plain, n, 32, 4), EpochRunner(grown, n, 32, 4)
    plain_losses = np.concatenate([plain_run() for _ in range(2)])
    grown_losses = np.concatenate([grown_run() for _ in range(2)])
    np.testing.assert_allclose(grown_losses, plain_losses, rtol=LOSS_RTOL)
    plain.finish()
    grown.finish()
    for a, b in zip(plain.model.get_weights(), grown.model.get_weights(), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-5)
    # The losses moved over the run (the comparison above is not of constants).
    assert not np.allclose(plain_losses[-5:], grown_losses[:5], rtol=LOSS_RTOL)


@pytest.mark.slow
def test_growing_carries_the_state_over_and_compiles_each_size_once(dataset):
    """XLA on both backends (the programs whose traces are counted)."""
    spec = OptimizerSpec("adam", 3e-3)
    _, grown = _trainers(dataset, spec, jit=True)
    n = len(dataset.x_train)
    losses = {}
    for batch, rate in ((8, 3e-3), (32, 6e-3), (8, 3e-3), (32, 6e-3)):
        grown.set_learning_rate(rate)
        losses.setdefault(batch, []).append(EpochRunner(grown, n, batch, 5)())
    steps = 2 * (n // 8) + 2 * (n // 32)
    # Every (size, length) compiled once although each size ran twice; on TF from one trace.
    assert grown.trace_counts_by_size and set(grown.trace_counts_by_size.values()) == {1}
    assert {size for size, _ in grown.trace_counts_by_size} == {8, 32}
    if BACKEND == "tensorflow":
        assert grown.traces == 1 and grown.relaxed
    # The optimizer kept counting across the changes (its state carried over, not reset).
    if BACKEND == "jax":
        count = int(np.asarray(grown.state.opt_state.count))
    else:
        count = int(grown.optimizer.iterations.numpy())
    assert count == steps
    # Training went on from where it was: the second epoch at 32 starts below the first.
    assert losses[32][1][:5].mean() < losses[32][0][:5].mean()
    # One row of noise norms per fetched call, its last step's: (1, M) and (1,), M = 2
    # micro-batches; measured on every calls_between(K)-th call (16 / 5 -> 3), NaN otherwise.
    norms = grown.take_noise_norms()
    calls = sum(-(-(n // batch) // 5) for batch in (8, 32, 8, 32))
    assert len(norms) == calls and grown.calls_between(5) == 3
    assert all(micro.shape == (1, 2) and big.shape == (1,) for _, micro, big in norms)
    assert grown.take_noise_norms() == []
    noise = NoiseScale()
    for batch, micro, big in norms:
        noise = noise.update_steps(micro, big, batch // 2, batch)
    measured = [bool(np.isfinite(big).all()) for _, _, big in norms]
    assert noise.steps == sum(measured) and noise.trace_sigma > 0
    assert measured[:7] == [True, False, False, True, False, False, True]


@pytest.mark.slow
def test_every_step_measured_is_the_reference_estimator(dataset):
    """``measure_every=1``: every step of every call measured, (K, M) norms, all finite."""
    from kbackend.backends import adaptive

    spec = OptimizerSpec("adam", 3e-3)
    model = toy_model(dataset, seed=5)
    trainer = adaptive().AdaptiveTrainer(model, spec, dataset, jit_compile=True,
                                         measure_every=1)
    n = len(dataset.x_train)
    EpochRunner(trainer, n, 16, 6)()  # 20 steps: 6, 6, 6 and a 2-step call (on TF: the 6's)
    norms = trainer.take_noise_norms()
    assert sum(len(big) for _, _, big in norms) == n // 16
    assert all(np.isfinite(big).all() and micro.shape == (len(big), 2)
               for _, micro, big in norms)


def test_set_learning_rate_changes_the_update(dataset):
    spec = OptimizerSpec("sgd", 0.05)
    _, fast = _trainers(dataset, spec)
    _, still = _trainers(dataset, spec)
    still.set_learning_rate(0.0)
    n = len(dataset.x_train)
    for trainer in (fast, still):
        EpochRunner(trainer, n, 16, 5)()
        trainer.finish()
    initial = toy_model(dataset, seed=5).get_weights()  # the same seed, the same backend
    moved = [np.max(np.abs(a - b)) for a, b in zip(fast.model.get_weights(), initial,
                                                   strict=True)]
    assert max(moved) > 1e-3
    for a, b in zip(still.model.get_weights(), initial, strict=True):
        np.testing.assert_array_equal(a, b)  # a zero rate: not one weight moved


@pytest.mark.slow
def test_a_size_compiled_ahead_in_the_background_trains_like_one_compiled_on_demand(dataset):
    spec = OptimizerSpec("adam", 3e-3)
    _, ahead = _trainers(dataset, spec, jit=True)
    _, demand = _trainers(dataset, spec, jit=True)
    n = len(dataset.x_train)
    ahead.compile_ahead(32, 5, n // 32)
    ahead.compile_ahead(32, 5, n // 32)  # asked twice: compiled once
    losses = [EpochRunner(trainer, n, 32, 5)() for trainer in (ahead, demand)]
    np.testing.assert_allclose(losses[0], losses[1], rtol=LOSS_RTOL)
    assert ahead.ahead_record["sizes"] == 1 and ahead.trace_counts_by_size[32, 5] == 1
    assert ahead.ahead_record["waited_s"] >= 0.0 and ahead.ahead_record["hidden_s"] >= 0.0
    # The program compiled ahead is the one trained with: nothing compiled on demand.
    assert demand.ahead_record["sizes"] == 0 and demand.trace_counts_by_size[32, 5] == 1


@pytest.mark.slow
def test_compiling_ahead_while_a_size_trains_changes_no_weight(dataset):
    # The next size compiles in the background during the current size's calls (the call that
    # compiles reads the variables and writes none): the run's weights equal a run without it.
    spec = OptimizerSpec("sgd", 0.05)
    _, ahead = _trainers(dataset, spec, jit=True)
    _, plain = _trainers(dataset, spec, jit=True)
    n = len(dataset.x_train)
    ahead.compile_ahead(32, 5, n // 32)
    for trainer in (ahead, plain):
        EpochRunner(trainer, n, 16, 5)()  # trains at 16 while 32 compiles
        EpochRunner(trainer, n, 32, 5)()
        trainer.finish()
    assert ahead.ahead_record["sizes"] == 1
    for a, b in zip(ahead.model.get_weights(), plain.model.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=LOSS_RTOL, atol=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(BACKEND != "tensorflow", reason="TF traces a call once for every batch "
                    "size (JAX traces each shape)")
def test_one_trace_serves_every_batch_size_and_a_shorter_call_runs_the_longer_program(dataset):
    """A new batch size compiles the traced graph at its shapes, with no new trace (0.7 s each
    on the seed MLP); an epoch's last, shorter call runs its size's longer program with fewer
    steps and trains as a program of its own length does."""
    from kbackend.backends.tensorflow.adaptive import AdaptiveTrainer
    from kbackend.backends.tensorflow.ops import compilation_counter

    spec = OptimizerSpec("adam", 3e-3)
    n = len(dataset.x_train)  # 320: 40, 20 and 10 steps at 8, 16 and 32
    _, grown = _trainers(dataset, spec, jit=True)
    with compilation_counter() as compiled:
        for batch in (8, 16, 32):
            EpochRunner(grown, n, batch, 4)()
    assert grown.traces == 1
    assert compiled["programs"] == 3
    assert grown.trace_counts_by_size == {(8, 4): 1, (16, 4): 1, (32, 4): 1}  # no (32, 2)
    # Rows of another shape at a compiled size: XLA compiles again (no trace), and it counts.
    with compilation_counter() as again:
        grown.fetch(grown.run(grown.put_epoch(np.zeros((5, 8), np.int32)), 0, 4))
    assert again["programs"] == 1 and grown.trace_counts_by_size[8, 4] == 2
    assert grown.traces == 1
    # A shorter call first (the rest of an epoch after a growth) while the size's K-step call
    # is compiled ahead: it waits for that program instead of compiling its own.
    _, ahead = _trainers(dataset, spec, jit=True)
    ahead.compile_ahead(32, 4, n // 32)
    ahead.compile(2, ahead.put_epoch(np.zeros((n // 32, 32), np.int32)))
    assert ahead.trace_counts_by_size == {(32, 4): 1} and ahead.ahead_record["sizes"] == 1
    # measure_every 2: every call measures its last step, the shared 2-step call's included.
    shared, own = (AdaptiveTrainer(toy_model(dataset, seed=5), spec, dataset, jit_compile=True,
                                   measure_every=2) for _ in range(2))
    own.model.set_weights(shared.model.get_weights())
    losses = [EpochRunner(shared, n, 32, 4)(), EpochRunner(own, n, 32, 2)()]
    assert shared.trace_counts_by_size == {(32, 4): 1} and own.trace_counts_by_size == {(32, 2): 1}
    assert [len(x) for x in losses] == [10, 10]  # the shared call's 2 steps, not its 4 rows
    np.testing.assert_allclose(losses[0], losses[1], rtol=LOSS_RTOL)
    # Both measured step 10 last (the shared program's last step is the call's, not its 4th).
    (_, *last_shared), (_, *last_own) = shared.take_noise_norms()[-1], own.take_noise_norms()[-1]
    assert np.isfinite(last_own[1]).all()
    for a, b in zip(last_shared, last_own, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-3)
    shared.finish()
    own.finish()
    for a, b in zip(shared.model.get_weights(), own.model.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(BACKEND != "tensorflow", reason="TF's trace for every batch size")
def test_a_model_that_needs_a_static_batch_size_is_traced_per_size(dataset):
    """A layer that reads ``x.shape[0]`` cannot be traced with an unknown batch size: the
    trainer traces such a model per size instead, and it trains as the plain trainer does."""
    import keras

    class Flatten(keras.layers.Layer):  # reshapes to the static batch, as some user code does
        def call(self, x):
            return keras.ops.reshape(x, (x.shape[0], -1))

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.flat, self.hidden = Flatten(), keras.layers.Dense(16, activation="relu")
            self.head = keras.layers.Dense(4, activation="softmax")

        def call(self, x):
            return self.head(self.hidden(self.flat(x)))

    from kbackend.backends import impl
    from kbackend.backends.tensorflow.adaptive import AdaptiveTrainer

    spec = OptimizerSpec("sgd", 0.05)
    plain_model, static_model = Net(), Net()
    for model in (plain_model, static_model):
        model(dataset.x_train[:8])
    static_model.set_weights(plain_model.get_weights())
    plain = impl().native_trainer(plain_model, spec, dataset, jit_compile=True)
    static = AdaptiveTrainer(static_model, spec, dataset, jit_compile=True)
    n = len(dataset.x_train)
    plain_losses = [EpochRunner(plain, n, batch, 4)() for batch in (8, 16)]
    static_losses = [EpochRunner(static, n, batch, 4)() for batch in (8, 16)]
    assert not static.relaxed and static.traces == 3  # the relaxed attempt, then one a size
    for a, b in zip(plain_losses, static_losses, strict=True):
        np.testing.assert_allclose(b, a, rtol=LOSS_RTOL)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="a TF trace with an unknown batch size")
def test_a_per_sample_value_of_several_axes_needs_no_static_batch():
    """``Task``'s per-sample mean over the trailing axes traces with an unknown batch size (a
    reshape to ``(x.shape[0], -1)`` did not)."""
    import tensorflow as tf

    from kbackend.task import _per_sample

    mean = tf.function(_per_sample, input_signature=[tf.TensorSpec([None, 3, 2], tf.float32)])
    values = np.arange(24, dtype=np.float32).reshape(4, 3, 2)
    np.testing.assert_allclose(mean(values).numpy(), values.reshape(4, -1).mean(axis=1))
