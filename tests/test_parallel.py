"""Data parallelism, single-device parts: option checks, engine choice, bad input. The tests
that need several devices are in tests/test_parallel_devices.py (the `devices` nox session)."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from kbackend import distributed as parallel
from kbackend.config import check_batch_split
from kbackend.errors import ConfigError
from kbackend.optim import OptimizerSpec
from kbackend.training import TrainConfig, train
from tests.conftest import BACKEND


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize(("fields", "message"), [
    ({"dp_impl": "vmap"}, "Invalid dp_impl"),
    ({"devices": -1}, "Invalid devices"),
    ({"num_processes": 0}, "Invalid num_processes"),
    ({"num_processes": 2, "process_id": 2, "coordinator": "127.0.0.1:1234"},
     r"process_id 2.*\[0, 2\)"),
    ({"num_processes": 2, "process_id": 1}, "needs --coordinator HOST:PORT"),
    ({"num_processes": 2, "coordinator": "localhost"}, "Invalid coordinator 'localhost'"),
    ({"num_processes": 2, "coordinator": "127.0.0.1:70000"}, "port 70000"),
    ({"heartbeat_timeout": 0}, "Invalid heartbeat_timeout 0"),
])
def test_bad_parallel_options_are_rejected(fields, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**fields)


def test_batch_split_error_names_both_numbers():
    assert check_batch_split(64, 8) == 8
    with pytest.raises(ConfigError, match=r"batch size 30 does not divide evenly over 4 devices"
                                          r".*multiple of 4"):
        check_batch_split(30, 4)


@pytest.mark.parametrize(("fields", "engine"), [
    ({}, "native"),  # the default engine
    ({"devices": 2}, "data_parallel"),
    ({"engine": "keras"}, "keras"),
    ({"engine": "keras", "data_parallel": True}, "keras_data_parallel"),
    ({"engine": "keras", "devices": 2}, "keras_data_parallel"),
    ({"engine": "data_parallel"}, "data_parallel"),
    ({"engine": "keras", "num_processes": 2, "coordinator": "127.0.0.1:1234"},
     "keras_data_parallel"),
])
def test_engine_choice(fields, engine):
    assert parallel.engine_name(TrainConfig(**fields)) == engine


def test_more_devices_than_exist_is_a_clear_error():
    from kbackend.backends import impl

    have = impl().device_count()
    with pytest.raises(ConfigError, match=rf"Requested 64 devices, but only {have} "
                                          r".*--virtual-devices 64"):
        train(TrainConfig(devices=64, batch_size=64, epochs=1))


@pytest.mark.slow
def test_data_parallel_engine_on_one_device_trains_like_native():
    """On one device the data-parallel trainer (jax.shard_map / tf.distribute) is the native one."""
    from kbackend.models import ModelOptions

    def run(engine: str):
        return train(TrainConfig(model="mlp", engine=engine, devices=1, batch_size=32, epochs=1,
                                 fused_steps=4, optimizer=OptimizerSpec("adam", 0.01),
                                 model_options=ModelOptions(widths=(16,), l2=1e-3)))

    native, parallel = run("native"), run("data_parallel")
    assert parallel.history.record.engine == "data_parallel"
    np.testing.assert_allclose(parallel.history.loss, native.history.loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(native.model.get_weights(), parallel.model.get_weights(), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    # Both leave the trained optimizer state in the model (a saved one resumes from it).
    steps = native.history.steps_run
    for result in (native, parallel):
        variables = [np.asarray(v) for v in result.model.optimizer.variables]
        assert int(variables[0]) == steps and all(np.any(v) for v in variables[2:])
    for a, b in zip(native.model.optimizer.variables, parallel.model.optimizer.variables,
                    strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's Keras fit limitation")
def test_keras_fit_across_processes_on_tensorflow_points_to_the_native_engine(monkeypatch):
    from kbackend.backends.tensorflow import data_parallel, ops

    monkeypatch.setattr(ops, "process_count", lambda: 2)
    message = "Keras fit cannot train across processes on TensorFlow"
    with pytest.raises(ConfigError, match=message), data_parallel.data_parallel_scope(1):
        pass


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TF_CONFIG is TensorFlow's")
@pytest.mark.parametrize(("tf_config", "message"), [
    ("not json", "Invalid TF_CONFIG: expected JSON"),
    ('{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]}, '
     '"task": {"type": "worker", "index": 0}}', "2 workers .--num-processes.; it lists 3"),
    ('{"cluster": {"worker": ["127.0.0.1:5000", "127.0.0.1:2"]}, '
     '"task": {"type": "worker", "index": 0}}', "task.index 1 .--process-id.; it has 0"),
    ('{"cluster": {"worker": ["127.0.0.1:9", "127.0.0.1:2"]}, "task": {"type": "worker", '
     '"index": 1}}', "worker 0 at the coordinator 127.0.0.1:5000; it has 127.0.0.1:9"),
    ('{"cluster": {"chief": ["127.0.0.1:5000"], "worker": ["127.0.0.1:2"]}, '
     '"task": {"type": "worker", "index": 1}}', "only 'worker' tasks"),
])
def test_a_tf_config_that_does_not_match_the_job_is_one_line(monkeypatch, tf_config, message):
    from kbackend.backends.tensorflow.ops import cluster_config

    monkeypatch.setenv("TF_CONFIG", tf_config)
    with pytest.raises(ConfigError, match=message) as raised:
        cluster_config("127.0.0.1:5000", 2, 1)
    assert "\n" not in str(raised.value)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TF_CONFIG is TensorFlow's")
def test_without_tf_config_workers_sit_at_consecutive_ports(monkeypatch):
    from kbackend.backends.tensorflow.ops import cluster_config

    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert cluster_config("127.0.0.1:5000", 3, 2) == {
        "cluster": {"worker": ["127.0.0.1:5000", "127.0.0.1:5001", "127.0.0.1:5002"]},
        "task": {"type": "worker", "index": 2}}


@pytest.mark.skipif(BACKEND != "jax", reason="the native data-parallel step is JAX code")
def test_single_device_step_matches_keras_train_on_batch():
    """The reference the N-device runs are compared with is itself Keras's own training math."""
    import keras

    from kbackend.backends.jax.optimizers import to_optax
    from kbackend.backends.jax.step import initial_state, make_train_step, to_host

    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((6,))
        x = keras.layers.Dense(8, activation="relu",
                               kernel_regularizer=keras.regularizers.L2(0.01))(inputs)
        return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(x))

    rng = np.random.default_rng(0)
    xs = rng.normal(size=(3, 10, 6)).astype("float32")
    ys = rng.integers(0, 3, size=(3, 10)).astype("int32")
    spec = OptimizerSpec("momentum", 0.05)
    model = build()
    tx = to_optax(spec)
    state, metrics = make_train_step(model, tx)(initial_state(model, tx), (xs, ys))
    reference = build()
    reference.compile(optimizer=spec.to_keras(), loss="sparse_categorical_crossentropy")
    losses = [float(reference.train_on_batch(x, y)) for x, y in zip(xs, ys, strict=True)]
    for ours, theirs in zip(to_host(state).trainable, reference.trainable_weights, strict=True):
        np.testing.assert_allclose(ours, np.asarray(theirs), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(metrics.loss)[0], losses[0], rtol=1e-5)


def test_unreachable_coordinator_fails_after_the_timeout(cli_process):
    # A fresh process: jax.distributed start-up is once per process and cannot be undone.
    result = cli_process("train", "--epochs", "1", "--num-processes", "2", "--process-id", "1",
                 "--coordinator", f"127.0.0.1:{_free_port()}", "--coordinator-timeout", "2",
                 timeout=120)
    assert result.returncode == 3, result.stderr[-2000:]  # a job that did not form
    assert "could not reach the coordinator" in result.stderr and "within 2s" in result.stderr


def test_launch_refuses_flags_it_sets_itself(cli):
    result = cli("launch", "-N", "2", "--", "--epochs", "1", "--process-id", "1")
    assert result.returncode == 2 and "sets --num-processes" in result.stderr
