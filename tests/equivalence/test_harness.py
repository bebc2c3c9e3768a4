"""The harness itself: it finds planted differences, survives dead and hung workers, and names
the real divergences it knows."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from kbackend.equivalence import Case, WorkerFailed, WorkerTimeout, compare_model
from kbackend.equivalence.randomdata import random_inputs, random_targets

pytestmark = pytest.mark.equivalence

MLP = {"input": {"shape": [4]}, "outputs": 3, "layers": [
    {"type": "dense", "units": 5, "activation": "tanh"},
    {"type": "dense", "units": 4, "activation": "relu"}]}
TOKENS = {"input": {"shape": [4], "dtype": "int32"}, "outputs": 2, "layers": [
    {"type": "embedding", "input_dim": 6, "output_dim": 3}, {"type": "gap"}]}


def _case(pool, arch, batch=4, seed=0, **kwargs):
    source = {"kind": "arch", "arch": arch}
    description = pool.call("jax", "describe", source=source)
    x = random_inputs(description, batch, seed)
    y = random_targets(description, batch, seed)
    return Case(source, x, y, weights=description["weights"], **kwargs), description


def test_identical_weights_pass(pool):
    case, _ = _case(pool, MLP)
    report = compare_model(pool, case)
    assert report.passed, report.table(only_failures=True)
    quantities = {r.quantity for r in report.rows}
    assert quantities == {"forward", "loss", "gradient", "step1", "stepK", "saved", "weights"}
    optimizers = {r.optimizer for r in report.rows if r.optimizer}
    assert optimizers == {"sgd", "momentum", "adam"}


def test_planted_difference_is_detected_and_named(pool):
    """Perturb one weight of one layer on the TF side only: the report fails and names it."""
    case, description = _case(pool, MLP)
    names = description["weight_names"]
    target = names.index("l1_dense/kernel")
    planted = [w.copy() for w in case.weights]
    planted[target][0, 0] += 1e-3 * (1 + abs(planted[target][0, 0]))
    report = compare_model(pool, case, planted_weights={"tensorflow": planted})
    failing = {r.name for r in report.failures}
    assert not report.passed
    assert "output head" in failing
    assert "loss" in failing
    assert "sgd step 1: l1_dense/kernel" in failing
    # The untouched first layer's weights pass after one step: the difference is localized.
    assert "sgd step 1: l0_dense/kernel" not in failing
    assert any("l1_dense" in r.name for r in report.failures if r.quantity == "gradient") or \
        any("head" in r.name for r in report.failures if r.quantity == "gradient")


def test_worker_killed_mid_run_is_restarted_and_comparison_completes(pool):
    case, _ = _case(pool, MLP, steps=12)
    worker = pool.workers["tensorflow"]
    restarts = pool.restarts
    killed = []

    def kill_when_busy():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if worker.busy_with == "evaluate" and worker.pid:
                time.sleep(0.05)
                killed.append(worker.pid)
                os.kill(worker.pid, signal.SIGKILL)
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_when_busy, daemon=True)
    killer.start()
    report = compare_model(pool, case)
    killer.join(5)
    assert killed, "the worker was never seen busy"
    assert pool.restarts > restarts
    assert worker.pid != killed[0]
    assert report.passed, report.table(only_failures=True)


def test_hung_worker_times_out_with_a_clear_error_and_is_replaced(pool):
    with pytest.raises(WorkerTimeout, match=r"jax worker did not answer 'sleep' within 2 s"):
        pool.call("jax", "sleep", seconds=120, timeout=2)
    assert pool.call("jax", "ping")["pid"] == pool.workers["jax"].pid


def test_error_inside_a_worker_is_reported_not_hidden(pool):
    with pytest.raises(WorkerFailed, match="unknown operation 'nope'"):
        pool.call("tensorflow", "nope")
    with pytest.raises(WorkerFailed, match="Unknown layer type"):
        pool.call("jax", "describe", source={"kind": "arch", "arch": {
            "input": {"shape": [2]}, "outputs": 1, "layers": [{"type": "capsule"}]}})


def test_tf_sparse_adam_divergence_is_named_and_precise(pool):
    """An Embedding's sparse TF gradient with a repeated id: Adam differs (known divergence);
    SGD and momentum agree; with unique ids everything agrees."""
    adam = ({"label": "adam", "name": "adam", "learning_rate": 0.1},
            {"label": "sgd", "name": "sgd", "learning_rate": 0.1})
    case, _ = _case(pool, TOKENS, batch=2, optimizers=adam, check_saved=False)
    repeated = Case(case.source, [np.array([[0, 0, 1, 2], [1, 1, 2, 5]], np.int32)], case.y,
                    weights=case.weights, optimizers=adam, check_saved=False)
    report = compare_model(pool, repeated)
    assert not report.passed
    assert report.known_divergences() == ["tf-sparse-adam-duplicate-ids"]
    assert not report.unexplained, report.table(only_failures=True)
    assert any(r.name == "adam step 1: l0_embedding/embeddings" for r in report.failures)
    assert all(r.passed for r in report.rows if r.optimizer == "sgd")
    unique = Case(case.source, [np.array([[0, 1, 2, 3], [4, 5, 4, 5]], np.int32)[:1]],
                  [case.y[0][:1]], weights=case.weights, optimizers=adam, check_saved=False)
    assert compare_model(pool, unique).passed


def test_a_model_that_fails_on_one_backend_is_a_failed_row_naming_the_error(pool):
    """Out-of-range Embedding ids: TF raises; the report says so instead of crashing."""
    case, _ = _case(pool, TOKENS, batch=1, check_saved=False)
    bad = Case(case.source, [np.array([[0, 1, 2, 9]], np.int32)], [case.y[0][:1]],
               weights=case.weights, check_saved=False)
    report = compare_model(pool, bad)
    assert not report.passed
    (row,) = report.rows
    assert row.name == "run on tensorflow" and "Embedding" in row.note


def test_keras_tf_bias_heuristic_divergence_is_named_and_precise(pool, channels_first_everywhere):
    """A channels_first Conv1D whose output length equals its filter count: Keras' TF add puts
    the bias on the wrong axis. The same layer with another output length agrees."""
    def conv_model(length):
        return {"input": {"shape": [1, length]}, "data_format": "channels_first", "outputs": 1,
                "layers": [{"type": "conv1d", "filters": 2, "kernel": 1, "padding": "same"},
                           {"type": "flatten"}]}

    case, description = _case(pool, conv_model(2), batch=2, check_saved=False)
    bias = description["weight_names"].index("l0_conv1d/bias")
    case.weights[bias] = np.array([1.0, -1.0], np.float32)  # a bias that cannot hide
    report = compare_model(pool, case)
    assert "output head" in {r.name for r in report.failures}
    assert report.known_divergences() == ["keras-tf-add-bias-heuristic"]
    assert any("(2, 2, 2) + (1, 2, 1)" in n for n in report.notes), report.notes
    ok_case, ok_description = _case(pool, conv_model(3), batch=2, check_saved=False)
    ok_case.weights[ok_description["weight_names"].index("l0_conv1d/bias")] = np.array(
        [1.0, -1.0], np.float32)
    assert compare_model(pool, ok_case).passed


def test_batchnorm_cancellation_divergence_is_named_and_precise(pool):
    """The example the property suite shrank to: sigmoid of inputs of size 1e-3 into
    BatchNormalization. Training-mode rows may differ (named); at input size 1 all pass."""
    from tests.equivalence.strategies import ModelCase, materialize

    arch = {"input": {"shape": [2, 1], "dtype": "float32"}, "data_format": "channels_last",
            "outputs": 1, "layers": [{"type": "activation", "activation": "sigmoid"},
                                     {"type": "batchnorm"}, {"type": "flatten"}]}
    reports = {}
    for scale in (1e-3, 1.0):
        case = ModelCase(arch, batch_size=1, loss="mse", weight_seed=0, weight_scale=10.0,
                         data_seed=0, input_scale=scale)
        description = pool.call("jax", "describe", source=case.source)
        weights, x, y = materialize(case, description)
        reports[scale] = compare_model(pool, Case(case.source, x, y, weights=weights,
                                                  check_saved=False))
    tiny = reports[1e-3]
    assert not tiny.unexplained, tiny.table(only_failures=True)
    assert set(tiny.known_divergences()) <= {"batchnorm-cancellation"}
    assert all(r.passed for r in tiny.rows if r.quantity == "forward")
    if tiny.failures:  # the size of the ulp differences depends on the kernels of this machine
        assert any("l1_batchnorm" in note for note in tiny.notes)
    assert reports[1.0].passed, reports[1.0].table(only_failures=True)


def test_unstable_training_divergence_is_named_and_precise(pool):
    """The example the property suite shrank to: inputs of size 1e3 make SGD at lr 0.01
    diverge; only stepK rows of exploding runs may differ (named), and at size 1 all pass."""
    from tests.equivalence.strategies import ModelCase, materialize

    arch = {"input": {"shape": [2, 5, 1], "dtype": "float32"}, "data_format": "channels_last",
            "outputs": 1, "layers": [{"type": "dropout", "rate": 0.5},
                                     {"type": "dense", "units": 1, "activation": None},
                                     {"type": "flatten"}]}
    reports = {}
    for scale in (1e3, 1.0):
        case = ModelCase(arch, batch_size=1, loss="mse", weight_seed=0, weight_scale=1.0,
                         data_seed=0, input_scale=scale)
        description = pool.call("jax", "describe", source=case.source)
        weights, x, y = materialize(case, description)
        reports[scale] = compare_model(pool, Case(case.source, x, y, weights=weights,
                                                  check_saved=False))
    large = reports[1e3]
    assert not large.unexplained, large.table(only_failures=True)
    assert set(large.known_divergences()) <= {"unstable-training"}
    assert all(r.passed for r in large.rows if r.quantity != "stepK")
    assert reports[1.0].passed, reports[1.0].table(only_failures=True)
