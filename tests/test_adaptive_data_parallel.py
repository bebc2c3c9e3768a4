"""``--batch-size auto`` on the data-parallel engine: the per-device shards are the micro-batches.

Each device's gradient of its shard and their all-reduced mean are the two batch sizes of the
noise-scale estimator (McCandlish et al. 2018, appendix A), so the data-parallel step measures
every step at no extra gradient. Checked on both backends (``shard_map`` and ``pmap`` on JAX,
``MirroredStrategy`` on TensorFlow) on 4 of the `devices` session's 8 virtual CPU devices
(``nox -s "devices(jax)"``, ``"devices(tensorflow)"``, which set KBACKEND_VIRTUAL_DEVICES=8): the
norms are those of the single-device micro-batch estimator with the same split, the update is the
plain data-parallel step's, a run grows its global batch in multiples of the devices, and what
cannot run is a one-line error before any work.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from kbackend.errors import ConfigError
from kbackend.optim import OptimizerSpec
from kbackend.training import Target, TrainConfig, train
from tests.conftest import BACKEND, JIT_FOR_SMALL_RUNS

DEVICES = int(os.environ.get("KBACKEND_VIRTUAL_DEVICES") or 0)
pytestmark = [pytest.mark.devices, pytest.mark.skipif(
    DEVICES != 8, reason="needs KBACKEND_VIRTUAL_DEVICES=8 set before the runtime starts "
    "(the `devices` nox session sets it)")]
jax_only = pytest.mark.skipif(BACKEND != "jax", reason="pmap is JAX's")
# the data-parallel implementations of this backend (TensorFlow has one, tf.distribute's)
DP_IMPLS = ("shard_map", "pmap") if BACKEND == "jax" else ("shard_map",)
# float32 norms: the same per-device / per-micro-batch gradients computed by two programs
# (shard_map, pmap or MirroredStrategy against one device's); measured agreement ~4e-7 relative.
RTOL = 1e-5


def dp_config(**overrides) -> TrainConfig:
    """``test_adaptive_training.auto_config`` on 4 devices (digits, seed MLP, from 8 to 128)."""
    fields = dict(model="seed_mlp", dataset="digits", engine="data_parallel", devices=4,
                  batch_size="auto:8:128", optimizer=OptimizerSpec("adam", 3e-3), epochs=6,
                  fused_steps=8, eval_every=40, seed=0, jit_compile=JIT_FOR_SMALL_RUNS,
                  target=Target("val_accuracy", 0.93))
    return TrainConfig(**{**fields, **overrides})


def _digits_and_model(batch_norm: bool = False):
    from kbackend.models import ModelOptions, build_model
    from kbackend.training import workload_of

    config = TrainConfig(model="mlp", dataset="digits",
                         model_options=ModelOptions(widths=(32,), batch_norm=batch_norm))
    dataset = workload_of(config).dataset
    return dataset, build_model("mlp", dataset.info, config.model_options)


# -- (a) the estimator ---------------------------------------------------------------------------
@pytest.mark.parametrize("dp_impl", DP_IMPLS)
@pytest.mark.parametrize("batch", [8, 32])
def test_device_norms_are_the_micro_batch_estimator(dp_impl, batch):
    """Device d's shard is rows d*b .. (d+1)*b of the global batch, as micro-batch d is on one
    device: the same squared norms, the same unbiased |G|^2 and tr(Sigma)."""
    from kbackend.adaptive import step_estimates
    from kbackend.backends import adaptive as adaptive_backend

    adaptive = adaptive_backend()

    dataset, model = _digits_and_model()
    x, y = dataset.x_train[:batch], dataset.y_train[:batch]
    _, _, micro, big = adaptive.micro_batched_gradients(model, x, y, micro_batches=4)
    trainer = adaptive.DataParallelAdaptiveTrainer(model, OptimizerSpec("sgd", 0.1), dataset,
                                                   devices=4, batch_size=batch, dp_impl=dp_impl)
    rows = trainer.put_epoch(np.arange(batch, dtype=np.int32)[None])
    trainer.compile(1, rows)
    trainer.fetch(trainer.run(rows, 0, 1))
    [(size, device_micro, device_big)] = trainer.take_noise_norms()
    assert size == batch and device_micro.shape == (1, 4) and device_big.shape == (1,)
    np.testing.assert_allclose(device_micro[0], micro, rtol=RTOL)
    np.testing.assert_allclose(device_big[0], big, rtol=RTOL)
    one = step_estimates(float(np.mean(micro)), big, batch // 4, batch)
    four = step_estimates(float(np.mean(device_micro)), float(device_big[0]), batch // 4, batch)
    np.testing.assert_allclose(four, one, rtol=1e-4)  # differences of near-equal norms


def test_a_wrong_split_would_show():
    """Negative control of the tolerance: 2 micro-batches are not the 4 shards' norms."""
    from kbackend.backends import adaptive as adaptive_backend

    adaptive = adaptive_backend()
    dataset, model = _digits_and_model()
    x, y = dataset.x_train[:32], dataset.y_train[:32]
    _, _, four, _ = adaptive.micro_batched_gradients(model, x, y, micro_batches=4)
    _, _, two, _ = adaptive.micro_batched_gradients(model, x, y, micro_batches=2)
    assert abs(np.mean(four) - np.mean(two)) > 100 * RTOL * np.mean(four)


# -- (c) the update is the plain data-parallel step's ------------------------------------------
@pytest.mark.parametrize("dp_impl", DP_IMPLS)
def test_the_adaptive_step_updates_as_the_plain_step(dp_impl):
    """Two 3-step calls and one 2-step call of a BatchNorm MLP under Adam: the same losses and
    values (weights, BatchNorm statistics) as the plain data-parallel trainer; norms come
    besides. (On TensorFlow the adaptive step all-reduces the gradients itself and its
    optimizer must not sum them again: a second sum would scale every update by 4.)"""
    from kbackend.backends import adaptive as adaptive_backend
    from kbackend.backends import impl
    from kbackend.data import batching

    adaptive = adaptive_backend()
    dataset, model = _digits_and_model(batch_norm=True)
    spec = OptimizerSpec("adam", 1e-2)
    kwargs = dict(devices=4, batch_size=32, dp_impl=dp_impl)
    plain = impl().data_parallel_trainer(model, spec, dataset, **kwargs)
    measured = adaptive.DataParallelAdaptiveTrainer(model, spec, dataset, **kwargs)
    epoch = batching.epoch_batches(len(dataset.x_train), 32, 0, 0)
    losses = {}
    for name, trainer in (("plain", plain), ("measured", measured)):
        rows, out, start = trainer.put_epoch(epoch), [], 0
        for length in (3, 3, 2):
            trainer.compile(length, rows)
            out.append(trainer.fetch(trainer.run(rows, start, length)))
            start += length
        losses[name] = np.concatenate(out)
    np.testing.assert_allclose(losses["measured"], losses["plain"], rtol=1e-5, atol=1e-6)
    for a, b in zip(plain.snapshot(), measured.snapshot(), strict=True):
        for left, right in zip(a, b, strict=True):
            np.testing.assert_allclose(right, left, rtol=1e-5, atol=1e-6)
    norms = measured.take_noise_norms()
    assert [n[1].shape for n in norms] == [(3, 4), (3, 4), (2, 4)]
    assert all(np.isfinite(n[1]).all() and np.isfinite(n[2]).all() for n in norms)


# -- (b) a run ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dp_run():
    return train(dp_config())


def test_a_data_parallel_auto_run_grows_and_trains(dp_run):
    history = dp_run.history
    record = history.record.adaptive_batch
    sizes = [r["batch_size"] for r in record["ranges"]]
    # Grows in global size, never shrinks; every size a multiple of the 4 devices with a
    # power-of-two per-device batch, within [MIN, MAX].
    assert sizes[0] == 8 and len(set(sizes)) >= 2, sizes
    assert sizes == sorted(sizes) and all(8 <= s <= 128 and s % 4 == 0 for s in sizes)
    assert all((s // 4) & (s // 4 - 1) == 0 for s in sizes)
    assert history.record.engine == "data_parallel" and history.record.devices == 4
    assert history.record.per_device_batch == 2
    for change in record["ranges"][1:]:  # sqrt scaling from 3e-3 at 8
        assert change["learning_rate"] == pytest.approx(3e-3 * math.sqrt(change["batch_size"]
                                                                        / 8))
        assert change["b_simple"] is not None and change["b_simple"] > 0
    # The target (0.93 validation accuracy on digits) is reached; the test split agrees.
    assert history.record.target_reached is not None
    assert history.test["test_accuracy"] >= 0.88
    # Each (global size, call length) compiled once; the sizes compiled are the sizes used.
    traces = record["trace_counts_by_size"]
    assert traces and set(traces.values()) == {1}
    assert {int(key.split("x")[0]) for key in traces} == set(sizes)
    changes = [r["step"] for r in record["ranges"][1:]]
    assert set(changes) <= {e["step"] for e in history.evals}


@jax_only
def test_pmap_grows_as_shard_map(dp_run):
    """``--dp-impl pmap`` runs the same step: the same ranges and, to float tolerance, losses."""
    history = train(dp_config(dp_impl="pmap")).history
    assert history.record.dp_impl == "pmap"
    ranges = history.record.adaptive_batch["ranges"]
    expected = dp_run.history.record.adaptive_batch["ranges"]
    assert [(r["step"], r["batch_size"]) for r in ranges] == [
        (r["step"], r["batch_size"]) for r in expected]
    np.testing.assert_allclose(history.loss, dp_run.history.loss, rtol=1e-4, atol=1e-5)


def test_default_bounds_on_devices_probe_the_data_parallel_knee():
    """``auto`` alone on 4 devices: MIN max(8, 4) = 8, MAX the knee of the data-parallel calls
    (a power of two, so a multiple of the devices), measured once and recorded."""
    result = train(dp_config(batch_size="auto", max_steps=16, target=None, eval_every=8))
    record = result.history.record.adaptive_batch
    probe = record["knee_probe"]
    assert record["min"] == 8 and probe is not None
    assert record["max"] % 4 == 0 and record["max"] & (record["max"] - 1) == 0
    assert all(size % 4 == 0 for size in probe["sizes"])


# -- (d) what cannot run -----------------------------------------------------------------------
@pytest.mark.parametrize(("overrides", "message"), [
    ({"devices": 3, "batch_size": "auto:8:64"}, "power-of-two count: use --devices 2"),
    ({"batch_size": "auto:2:64"}, "MIN 2 is below the 4 devices"),
    ({"batch_size": "auto::2"}, "MAX 2 is below the 4 devices"),
    ({"engine": "keras", "data_parallel": True}, "runs on the native engine"),
])
def test_bad_combinations_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message) as error:
        train(dp_config(**overrides))
    assert "\n" not in str(error.value)


def test_auto_max_below_the_default_min_lowers_min():
    """``auto::4`` on 4 devices: MIN is 4 (one sample per device), not a MIN-above-MAX error."""
    result = train(dp_config(batch_size="auto::4", max_steps=8, target=None))
    assert result.history.record.adaptive_batch["min"] == 4
    assert result.history.record.adaptive_batch["max"] == 4


def test_bench_overhead_on_4_devices(tmp_path):
    """``bench_adaptive --part overhead --devices 4``: a worker with 4 virtual devices times the
    plain and the adaptive data-parallel trainers (finite figures; no timing thresholds)."""
    import json

    from kbackend.bench.registry import BENCHMARKS
    from kbackend.bench.runner import run

    out = tmp_path / "out"
    options = ["--quick", "--backends", BACKEND, "--part", "overhead", "--devices", "4",
               "--out", str(out)]
    assert run(BENCHMARKS["bench_adaptive"], options) == 0
    rows = json.loads((out / "bench_adaptive.json").read_text())["rows"]
    assert [(r["batch_size"], r["devices"]) for r in rows] == [(8, 4), (32, 4)]
    assert all(math.isfinite(r["ratio"]) and r["ratio"] > 0 for r in rows)
