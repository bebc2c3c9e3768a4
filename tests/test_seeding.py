"""Seeding: the backend's set_random_seed equals Keras's, and a JAX run never imports TensorFlow."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kbackend.backend_choice import keras as import_keras
from kbackend.backends import impl
from kbackend.data import DatasetInfo
from kbackend.models import MODELS, ModelOptions, build_model
from tests.conftest import BACKEND, ROOT

INFO = DatasetInfo("toy", (12,), 3, "generated", "flat", None, 10, 10, 10)


@pytest.mark.parametrize("seed", [0, 7])
def test_models_built_with_our_seeding_equal_keras_seeding(seed):
    ours = build_model("seed_mlp", INFO, ModelOptions(seed=seed))
    import_keras().utils.set_random_seed(seed)
    theirs = MODELS["seed_mlp"][0](INFO, ModelOptions(seed=seed))
    for a, b in zip(ours.get_weights(), theirs.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    other = build_model("seed_mlp", INFO, ModelOptions(seed=seed + 1))
    assert not np.array_equal(ours.get_weights()[0], other.get_weights()[0])


def test_python_and_numpy_generators_are_seeded():
    import random

    impl().set_random_seed(3)
    first = (random.random(), np.random.rand())
    impl().set_random_seed(3)
    assert (random.random(), np.random.rand()) == first


@pytest.mark.slow
@pytest.mark.skipif(BACKEND != "jax", reason="TensorFlow is the framework of the TF backend")
def test_a_jax_training_run_never_imports_tensorflow():
    # A fresh process is the point: this test process may have imported TensorFlow already.
    code = ("import sys; from kbackend.training import TrainConfig, train; "
            "train(TrainConfig(epochs=1, engine='keras', batch_size=128)); "
            "train(TrainConfig(epochs=1, engine='native', batch_size=128)); "
            "train(TrainConfig(epochs=1, engine='keras', data_parallel=True, devices=1, "
            "batch_size=128)); "
            "print('tensorflow' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "False"
