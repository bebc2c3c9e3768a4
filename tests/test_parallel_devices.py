"""Data parallelism on several devices: N-device training computes what 1-device training does.

Needs 8 devices, which on a CPU must be created before the runtime starts, so these tests are
marked `devices` and run in their own nox session (``nox -s "devices(jax)"``,
``"devices(tensorflow)"``), which sets KBACKEND_VIRTUAL_DEVICES=8 in its environment. Anywhere
else they are skipped.

Tolerance: the N-device runs add the same numbers in a different order (per-shard sums, then a
cross-device mean), so parameters agree to float32 rounding, not bit for bit. After up to 3 steps
on these small models the measured gap is below 1e-6; the assertions allow 1e-5 (absolute and
relative), an order of magnitude above it and many orders below any semantic error (a missing
pmean or unsynchronized BatchNorm moves parameters by 1e-3 or more, see the negative controls).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kbackend.errors import ConfigError
from kbackend.history import RunRecord
from kbackend.optim import OptimizerSpec
from tests.conftest import BACKEND

DEVICES = int(os.environ.get("KBACKEND_VIRTUAL_DEVICES") or 0)
pytestmark = [pytest.mark.devices, pytest.mark.skipif(
    DEVICES != 8, reason="needs KBACKEND_VIRTUAL_DEVICES=8 set before the runtime starts "
    "(the `devices` nox session sets it)")]
jax_only = pytest.mark.skipif(BACKEND != "jax", reason="the native data-parallel step is JAX code")
tf_only = pytest.mark.skipif(BACKEND != "tensorflow", reason="the tf.distribute trainer")
ATOL = RTOL = 1e-5
LARGEST_GAP: list[float] = [0.0]


def test_virtual_devices_exist():
    from kbackend.backends import impl

    assert impl().device_count() == 8


def test_info_shows_virtual_devices(cli):
    import json

    result = cli("info", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    devices = json.loads(result.stdout)["devices"]
    assert len(devices) == 8 and {d["platform"] for d in devices} == {"cpu"}


def _build(widths: tuple[int, ...], batch_norm: bool, inputs: int = 6, classes: int = 3,
           seed: int = 0):
    import keras

    keras.utils.set_random_seed(seed)
    x = model_inputs = keras.Input((inputs,))
    for width in widths:
        x = keras.layers.Dense(width, use_bias=not batch_norm)(x)
        if batch_norm:
            x = keras.layers.BatchNormalization()(x)
        x = keras.layers.Activation("relu")(x)
    return keras.Model(model_inputs, keras.layers.Dense(classes, activation="softmax")(x))


def _largest_gap(a, b) -> float:
    import jax

    gaps = [float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)]
    return max(gaps)


def _run_both(model, spec, devices, xs, ys, impl="shard_map"):
    """(single-device state, N-device state, single losses, N losses) after K = len(xs) steps."""
    import jax

    from kbackend.backends.jax import step as jax_step
    from kbackend.backends.jax.optimizers import to_optax

    tx = to_optax(spec)
    start = jax_step.initial_state(model, tx)
    host_start = jax_step.to_host(start)
    single, single_metrics = jax_step.make_train_step(model, tx)(host_start, (xs, ys))
    mesh = jax_step.make_mesh(jax.devices()[:devices])
    step = jax_step.make_train_step(model, tx, mesh, impl)
    if impl == "pmap":
        state = jax_step.replicate_for_pmap(host_start, devices)
        multi, metrics = step(state, jax_step.split_for_pmap((xs, ys), devices))
        multi, metrics = jax.tree.map(lambda leaf: leaf[0], (multi, metrics))
    else:
        state = jax_step.replicate(host_start, mesh)
        multi, metrics = step(state, jax_step.shard_batch((xs, ys), mesh))
    return (jax_step.to_host(single), jax_step.to_host(multi),
            np.asarray(single_metrics.loss), np.asarray(jax_step.to_host(metrics.loss)))


@jax_only
@settings(max_examples=int(os.environ.get("KBACKEND_PARALLEL_EXAMPLES", "6")), deadline=None,
          derandomize=True, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.generate])  # no shrinking: each example compiles twice
@given(
    devices=st.sampled_from([2, 4, 8]),
    per_device=st.integers(1, 3),
    fused=st.integers(1, 3),
    widths=st.lists(st.integers(2, 12), min_size=1, max_size=2).map(tuple),
    batch_norm=st.booleans(),
    optimizer=st.sampled_from(["sgd", "adam"]),
    seed=st.integers(0, 2**16),
)
def test_n_devices_train_like_one_device(devices, per_device, fused, widths, batch_norm, optimizer,
                                         seed):
    model = _build(widths, batch_norm, seed=seed)
    rng = np.random.default_rng(seed)
    batch = devices * per_device
    if batch_norm and per_device == 1 and devices == 2:
        batch, per_device = 4, 2  # BatchNorm over 2 samples is degenerate (variance ~ 0)
    xs = rng.normal(size=(fused, batch, 6)).astype("float32")
    ys = rng.integers(0, 3, size=(fused, batch)).astype("int32")
    lr = 0.1 if optimizer == "sgd" else 0.01
    single, multi, single_loss, multi_loss = _run_both(model, OptimizerSpec(optimizer, lr), devices,
                                                       xs, ys)
    gap = _largest_gap(single, multi)
    LARGEST_GAP[0] = max(LARGEST_GAP[0], gap)
    print(f"devices={devices} batch={batch} K={fused} widths={widths} bn={batch_norm} "
          f"{optimizer}: largest parameter gap {gap:.3g} (largest so far {LARGEST_GAP[0]:.3g})")
    import jax

    for x, y in zip(jax.tree.leaves(single), jax.tree.leaves(multi), strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(multi_loss, single_loss, rtol=RTOL, atol=ATOL)


@jax_only
def test_pmap_impl_shares_the_step():
    model = _build((8,), True)
    rng = np.random.default_rng(1)
    xs = rng.normal(size=(2, 16, 6)).astype("float32")
    ys = rng.integers(0, 3, (2, 16)).astype("int32")
    single, multi, _, _ = _run_both(model, OptimizerSpec("adam", 0.01), 4, xs, ys, impl="pmap")
    assert _largest_gap(single, multi) < ATOL


@jax_only
def test_negative_control_without_synced_batch_norm(monkeypatch):
    """Per-shard BatchNorm statistics would make N devices differ: the sync hook is what matters."""
    from contextlib import nullcontext

    from kbackend.backends.jax import step as jax_step  # where the shared step looks the hook up

    model = _build((8,), True)
    rng = np.random.default_rng(2)
    xs = (rng.normal(size=(2, 16, 6)).astype("float32")
          * rng.uniform(0.5, 3, size=(1, 16, 1)).astype("float32"))
    ys = rng.integers(0, 3, (2, 16)).astype("int32")
    monkeypatch.setattr(jax_step, "synced_batch_norm", lambda model, axis: nullcontext())
    single, multi, _, _ = _run_both(model, OptimizerSpec("sgd", 0.1), 4, xs, ys)
    assert _largest_gap(single, multi) > 100 * ATOL


@pytest.mark.parametrize("dp_impl", [
    "shard_map", pytest.param("pmap", marks=jax_only)])
def test_engine_on_4_devices_matches_1_device(dp_impl):
    """The whole engine (data order, sharding, fused calls, write-back) against 1 device."""
    from kbackend.models import ModelOptions
    from kbackend.training import TrainConfig, train

    def run(devices):
        config = TrainConfig(model="mlp", engine="data_parallel", devices=devices, batch_size=64,
                             epochs=2, fused_steps=5, optimizer=OptimizerSpec("momentum", 0.05),
                             model_options=ModelOptions(widths=(32,), batch_norm=True),
                             dp_impl=dp_impl)
        return train(config)

    one, four = run(1), run(4)
    assert four.history.record.devices == 4 and four.history.record.per_device_batch == 16
    assert one.history.step == four.history.step
    np.testing.assert_allclose(four.history.loss, one.history.loss, rtol=1e-4, atol=1e-5)
    for a, b in zip(one.model.get_weights(), four.model.get_weights(), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
    assert (four.history.test["test_accuracy"]
            == pytest.approx(one.history.test["test_accuracy"], abs=0.01))


@pytest.mark.parametrize(("devices", "batch_norm"), [(2, False), (4, True)])
def test_keras_fit_data_parallel_matches_single_device(devices, batch_norm):
    from kbackend.engines.keras_data_parallel import whole_batches
    from kbackend.models import ModelOptions
    from kbackend.training import TrainConfig, train, workload_of

    def config(**fields):
        return TrainConfig(model="mlp", batch_size=64, epochs=1, engine="keras",
                           optimizer=OptimizerSpec("sgd", 0.1),
                           model_options=ModelOptions(widths=(32,), batch_norm=batch_norm),
                           **fields)

    single_config = config()
    single = train(single_config, dataset=whole_batches(workload_of(single_config).dataset, 64))
    multi = train(config(devices=devices, data_parallel=True))
    assert multi.history.record.devices == devices
    np.testing.assert_allclose(multi.history.loss, single.history.loss, rtol=1e-4, atol=1e-5)
    for a, b in zip(single.model.get_weights(), multi.model.get_weights(), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


def test_batch_not_divisible_by_devices_is_rejected():
    from kbackend.training import TrainConfig, train

    with pytest.raises(ConfigError, match="batch size 30 does not divide evenly over 4 devices"):
        train(TrainConfig(devices=4, batch_size=30, epochs=1))


def test_data_parallel_engine_runs_the_native_driver():
    """2 devices through the native driver: the single-device native engine's batches, losses,
    evaluation points, regularized val_loss and early stopping, and its history format."""
    from kbackend.models import ModelOptions
    from kbackend.training import TrainConfig, train

    def run(**fields):
        return train(TrainConfig(model="mlp", batch_size=64, epochs=3, fused_steps=4, eval_every=6,
                                 early_stopping=1, monitor="val_loss",
                                 optimizer=OptimizerSpec("adam", 0.05),
                                 model_options=ModelOptions(widths=(32,), batch_norm=True, l2=1e-2),
                                 **fields)).history

    single, multi = run(engine="native"), run(engine="data_parallel", devices=2)
    assert multi.record.engine == "data_parallel" and multi.record.devices == 2
    assert multi.step == single.step
    np.testing.assert_allclose(multi.loss, single.loss, rtol=1e-4, atol=1e-5)
    assert [e["step"] for e in multi.evals] == [e["step"] for e in single.evals]
    np.testing.assert_allclose([e["val_loss"] for e in multi.evals],
                               [e["val_loss"] for e in single.evals], rtol=1e-4, atol=1e-5)
    assert multi.stopped_early == single.stopped_early
    assert set(multi.record.trace_counts) == set(single.record.trace_counts)
    assert multi.timing["compile_time"] > 0


@jax_only
def test_a_conv_models_fused_steps_are_written_out_on_a_cpu():
    """XLA:CPU runs a convolution inside a while loop several times slower (the Fashion-MNIST
    CNN at batch 128 on 2 devices, K = 4: 52.6 s for 8 steps looped, 10.6 s written out), so
    the sharded step writes a conv model's K steps out, as the single-device engine does: no
    ``while`` in the compiled program, and the same losses and weights as K = 1 (rtol 1e-5)."""
    import jax

    from kbackend.backends.jax import step as jax_step
    from kbackend.backends.jax.optimizers import to_optax
    from kbackend.training import TrainConfig, train

    if jax.default_backend() != "cpu":
        pytest.skip("the loop is written out on a CPU only")

    def run(fused):
        return train(TrainConfig(model="cnn", engine="data_parallel", devices=2, batch_size=32,
                                 epochs=1, max_steps=4, eval_every=4, fused_steps=fused,
                                 optimizer=OptimizerSpec("momentum", 0.05)))

    fused, single = run(2), run(1)
    assert fused.history.record.unrolled_loop is True
    np.testing.assert_allclose(fused.history.loss, single.history.loss, rtol=1e-5)
    for a, b in zip(single.model.get_weights(), fused.model.get_weights(), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)

    tx = to_optax(OptimizerSpec("sgd", 0.1))
    mesh = jax_step.make_mesh(jax.devices()[:2])
    state = jax_step.replicate(jax_step.initial_state(fused.model, tx), mesh)
    xs = np.zeros((3, 32, *fused.model.input_shape[1:]), np.float32)
    batches = jax_step.shard_batch((xs, np.zeros((3, 32), np.int32)), mesh)

    def program(unroll):
        step = jax_step.make_train_step(fused.model, tx, mesh, unroll=unroll)
        return step.lower(state, batches).compile().as_text()

    assert "while" not in program(True) and "while" in program(False)


def test_data_parallel_rejects_fused_steps_auto():
    from kbackend.training import TrainConfig, train

    with pytest.raises(ConfigError, match="--fused-steps auto is single-device only"):
        train(TrainConfig(model="mlp", engine="data_parallel", devices=2, batch_size=64, epochs=1,
                          fused_steps=0))


def _tf_dataset(xs: np.ndarray, ys: np.ndarray):
    from kbackend.data import Dataset, DatasetInfo

    x, y = xs.reshape(-1, xs.shape[-1]), ys.reshape(-1)
    info = DatasetInfo(name="generated", input_shape=(x.shape[-1],), num_classes=3, source="test",
                       layout="flat", data_format=None, num_train=len(x), num_val=8, num_test=8)
    return Dataset(x, y, x[:8], y[:8], x[:8], y[:8], info)


def _tf_run_both(model, spec, devices, xs, ys):
    """(1-device values, N-device values, 1-device losses, N losses) after K = len(xs) steps of
    the TF native trainer and the tf.distribute trainer from the same start, on the same rows."""
    import keras

    from kbackend.backends.tensorflow.data_parallel import DataParallelTrainer
    from kbackend.backends.tensorflow.native import NativeTrainer

    dataset = _tf_dataset(xs, ys)
    rows = np.arange(xs.shape[0] * xs.shape[1]).reshape(xs.shape[:2])
    twin = keras.models.clone_model(model)
    twin.set_weights(model.get_weights())
    single = NativeTrainer(twin, spec, dataset)
    epoch = single.put_epoch(rows)
    single.compile(len(rows), epoch)
    single_loss = single.fetch(single.run(epoch, 0, len(rows)))
    multi = DataParallelTrainer(model, spec, dataset, devices=devices, batch_size=rows.shape[1],
                                dp_impl="shard_map")
    multi.compile(len(rows), rows)
    multi_loss = multi.fetch(multi.run(rows, 0, len(rows)))
    return single.snapshot(), multi.snapshot(), single_loss, multi_loss


@tf_only
@settings(max_examples=int(os.environ.get("KBACKEND_PARALLEL_EXAMPLES", "6")), deadline=None,
          derandomize=True, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.generate])  # no shrinking: each example traces twice
@given(
    devices=st.sampled_from([2, 4, 8]),
    per_device=st.integers(2, 3),
    fused=st.integers(1, 3),
    widths=st.lists(st.integers(2, 12), min_size=1, max_size=2).map(tuple),
    batch_norm=st.booleans(),
    optimizer=st.sampled_from(["sgd", "adam"]),
    seed=st.integers(0, 2**16),
)
def test_tf_distribute_trainer_on_n_devices_trains_like_one(devices, per_device, fused, widths,
                                                            batch_norm, optimizer, seed):
    """MirroredStrategy over N logical devices == the single-device native trainer."""
    model = _build(widths, batch_norm, seed=seed)
    rng = np.random.default_rng(seed)
    batch = devices * per_device
    xs = rng.normal(size=(fused, batch, 6)).astype("float32")
    ys = rng.integers(0, 3, size=(fused, batch)).astype("int32")
    lr = 0.1 if optimizer == "sgd" else 0.01
    single, multi, single_loss, multi_loss = _tf_run_both(model, OptimizerSpec(optimizer, lr),
                                                          devices, xs, ys)
    gap = max(float(np.max(np.abs(a - b))) for a, b in zip(single, multi, strict=True))
    LARGEST_GAP[0] = max(LARGEST_GAP[0], gap)
    print(f"TF devices={devices} batch={batch} K={fused} widths={widths} bn={batch_norm} "
          f"{optimizer}: largest parameter gap {gap:.3g} (largest so far {LARGEST_GAP[0]:.3g})")
    for a, b in zip(single, multi, strict=True):
        np.testing.assert_allclose(b, a, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(multi_loss, single_loss, rtol=RTOL, atol=ATOL)


@tf_only
def test_tf_negative_control_without_synchronized_batch_norm(monkeypatch):
    """Per-replica BatchNorm statistics would make N devices differ: synchronizing them is what
    makes the trainer equal to one device."""
    from kbackend.backends.tensorflow import data_parallel

    model = _build((8,), True)
    rng = np.random.default_rng(2)
    xs = (rng.normal(size=(2, 16, 6)).astype("float32")
          * rng.uniform(0.5, 3, size=(1, 16, 1)).astype("float32"))
    ys = rng.integers(0, 3, (2, 16)).astype("int32")
    monkeypatch.setattr(data_parallel, "data_parallel_clone_layer",
                        lambda layer: layer.__class__.from_config(layer.get_config()))
    single, multi, _, _ = _tf_run_both(model, OptimizerSpec("sgd", 0.1), 4, xs, ys)
    gap = max(float(np.max(np.abs(a - b))) for a, b in zip(single, multi, strict=True))
    assert gap > 100 * ATOL


@tf_only
def test_tf_replica_pass_is_xla_compiled_without_batch_norm():
    from kbackend.models import ModelOptions
    from kbackend.training import TrainConfig, train

    def record(batch_norm: bool) -> RunRecord:
        return train(TrainConfig(model="mlp", engine="data_parallel", devices=2, batch_size=32,
                                 epochs=1, fused_steps=4, max_steps=8,
                                 model_options=ModelOptions(widths=(8,), batch_norm=batch_norm))
                     ).history.record

    plain, normed = record(False), record(True)
    assert plain.replica_xla is True and normed.replica_xla is False
    assert plain.dp_impl == "MirroredStrategy" and plain.devices == 2


@pytest.mark.parametrize("loss", ["huber", "binary_logits"])
@pytest.mark.parametrize("engine", ["data_parallel", "keras"])
def test_a_user_models_loss_trains_the_same_on_4_devices(tmp_path, loss, engine):
    """A user builder compiled with its own loss (Huber regression, binary cross-entropy from
    logits, BatchNorm in both): the data-parallel engines train that loss as one device does."""
    from kbackend.training import TrainConfig, train

    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 6)).astype(np.float32)
    target = x @ rng.normal(size=6)
    y = (target > 0).astype(np.float32) if loss == "binary_logits" else target.astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=y)
    compiled = ("keras.losses.Huber(delta=0.5), metrics=['mae']" if loss == "huber" else
                "keras.losses.BinaryCrossentropy(from_logits=True), metrics=['accuracy']")
    (tmp_path / "build.py").write_text(
        "import keras\n"
        "def build(input_shape):\n"
        "    m = keras.Sequential([keras.Input(input_shape), keras.layers.Dense(16, "
        "activation='relu'), keras.layers.BatchNormalization(), keras.layers.Dense(1)])\n"
        f"    m.compile('sgd', loss={compiled})\n"
        "    return m\n")

    def run(devices):
        config = TrainConfig(model=f"{tmp_path / 'build.py'}:build",
                             dataset=str(tmp_path / "data.npz"), engine=engine,
                             devices=devices, data_parallel=devices > 1, batch_size=64,
                             epochs=2, fused_steps=4 if engine != "keras" else 1,
                             optimizer=OptimizerSpec("momentum", 0.05))
        if engine == "keras" and devices == 1:  # whole batches, as the data-parallel fit runs
            config = TrainConfig(**{**config.__dict__, "engine": "keras_data_parallel",
                                    "data_parallel": False})
        return train(config)

    one, four = run(1), run(4)
    assert four.history.record.devices == 4
    assert one.config.task == four.config.task and one.config.task.source == "compiled"
    np.testing.assert_allclose(four.history.loss, one.history.loss, rtol=1e-4, atol=1e-5)
    for a, b in zip(one.model.get_weights(), four.model.get_weights(), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
    if engine == "data_parallel":  # (Keras's cuts the validation split to whole device shares)
        metric = f"val_{one.config.task.metric}"
        assert four.history.evals[-1][metric] == pytest.approx(one.history.evals[-1][metric],
                                                               abs=1e-4)
