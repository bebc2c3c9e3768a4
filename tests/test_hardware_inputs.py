"""The one batch order: the Keras engine's batch source (monitored or not) and the benchmark
iterator read each epoch in ``kbackend.data.batching``'s order, so ``--monitor`` changes nothing."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kbackend.backend_choice import keras as import_keras
from kbackend.data.batching import epoch_batches, epoch_batches_with_remainder, epoch_order
from kbackend.hardware.inputs import iterate_batches, monitored_batches
from tests.conftest import JIT_FOR_SMALL_RUNS

N, BATCH, SEED, EPOCHS = 103, 10, 3, 3  # 10 full batches and a short one of 3 per epoch


def _data() -> tuple[np.ndarray, np.ndarray]:
    """x holds each sample's own index, so a batch of x names the samples in it."""
    x = np.arange(N, dtype=np.float32)[:, None].repeat(2, axis=1)
    return x, np.arange(N) % 2


def _expected(epoch: int) -> list[np.ndarray]:
    return [rows.astype(np.float32) for rows in epoch_batches_with_remainder(N, BATCH, SEED, epoch)]


def test_each_epoch_is_the_batching_order_with_a_short_last_batch():
    for epoch in range(EPOCHS):
        batches = _expected(epoch)
        np.testing.assert_array_equal(np.concatenate(batches), epoch_order(N, SEED, epoch))
        np.testing.assert_array_equal(np.stack(batches[:-1]), epoch_batches(N, BATCH, SEED, epoch))
        assert len(batches[-1]) == N % BATCH
    assert not np.array_equal(epoch_order(N, SEED, 0), epoch_order(N, SEED, 1))


def test_monitored_and_plain_sources_yield_the_same_batches():
    x, y = _data()
    source = monitored_batches(x, y, BATCH, seed=SEED)
    plain = list(iterate_batches(x, y, BATCH, epochs=EPOCHS, seed=SEED))
    assert len(source) == len(plain) // EPOCHS == -(-N // BATCH)
    for epoch in range(EPOCHS):
        source.epoch = epoch
        for index, expected in enumerate(_expected(epoch)):
            batch_x, batch_y = source[index]
            np.testing.assert_array_equal(batch_x[:, 0], expected)
            np.testing.assert_array_equal(plain[epoch * len(source) + index][0], batch_x)
            np.testing.assert_array_equal(batch_y, expected.astype(int) % 2)


def test_fit_reads_every_epoch_in_the_batching_order():
    """What the model is fed, recorded by the host transform, on this backend's ``fit``."""
    keras = import_keras()
    x, y = _data()
    seen: list[np.ndarray] = []

    def record(batch: np.ndarray) -> np.ndarray:
        seen.append(batch[:, 0].copy())
        return batch

    source = monitored_batches(x, y, BATCH, seed=SEED, transform=record)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(source, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[source.epoch_callback()])
    expected = [b for epoch in range(EPOCHS) for b in _expected(epoch)]
    # Keras may read a batch or two before training (to build the model or its input spec).
    fed = seen[-len(expected):]
    assert len(fed) == len(expected)
    for got, want in zip(fed, expected, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_monitor_does_not_change_a_keras_engine_run():
    from kbackend.training import TrainConfig, train

    config = TrainConfig(epochs=2, batch_size=64, seed=1,
                         engine="keras", jit_compile=JIT_FOR_SMALL_RUNS)
    plain = train(config).history
    monitored = train(replace(config, hardware_monitor=True)).history
    assert monitored.record.monitor is not None and plain.record.monitor is None
    assert len(plain.loss) == len(monitored.loss) == 2 * 21  # 1294 samples: 21 batches per epoch
    np.testing.assert_allclose(monitored.loss, plain.loss, rtol=1e-6, atol=0)
