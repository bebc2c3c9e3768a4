"""Engine properties over random models and batch sizes.

- fused K steps == K single steps (same engine, same backend);
- the native engine follows the Keras ``fit`` trajectory (per-step losses and final weights).
Both run in each backend's worker.
"""

from __future__ import annotations

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from kbackend.equivalence.compare import compare_arrays
from kbackend.equivalence.randomdata import random_inputs, random_targets, random_weights
from tests.equivalence.strategies import architectures

pytestmark = pytest.mark.equivalence
TRAIN_FAMILIES = ("dense", "conv1d", "conv2d", "sequence")


@st.composite
def training_cases(draw):
    """A softmax classifier without Dropout, a batch size, K, a seed and an optimizer."""
    arch = draw(architectures(TRAIN_FAMILIES, max_layers=3, output_activation="softmax",
                              dropout=False))
    arch["outputs"] = max(arch["outputs"], 2)
    return {"arch": arch, "batch_size": draw(st.integers(1, 8)), "fused": draw(st.integers(2, 4)),
            "seed": draw(st.integers(0, 2**16)),
            "optimizer": draw(st.sampled_from([{"name": "sgd", "learning_rate": 0.05},
                                               {"name": "momentum", "learning_rate": 0.05},
                                               {"name": "adam", "learning_rate": 0.01}]))}


def _data(pool, backend, case, rows):
    source = {"kind": "arch", "arch": case["arch"]}
    description = pool.call(backend, "describe", source=source)
    weights = random_weights(description["weight_names"],
                             [w.shape for w in description["weights"]], case["seed"])
    x = random_inputs(description, rows, case["seed"])[0]
    y = random_targets(description, rows, case["seed"], sparse_classes=True)[0]
    return source, weights, x, y


def _assert_same_run(first, second, what):
    rows = [compare_arrays("engine", f"{what}: loss per step", first["loss"], second["loss"])]
    rows += [compare_arrays("stepK", f"{what}: final weight {i}", a, b)
             for i, (a, b) in enumerate(zip(first["weights"], second["weights"], strict=True))]
    failures = [r for r in rows if not r.passed]
    assert not failures, "\n".join(f"{r.name}: abs {r.max_abs:.3g} rel {r.max_rel:.3g}"
                                   for r in failures)


@given(case=training_cases())
def test_fused_k_steps_equal_k_single_steps(pool, case):
    note(f"case: {case}")
    k, batch = case["fused"], case["batch_size"]
    for backend in pool.backends:
        source, weights, x, y = _data(pool, backend, case, batch * k * 2)
        runs = {}
        for fused in (1, k):
            config = {"batch_size": batch, "epochs": 1, "fused_steps": fused,
                      "max_steps": 2 * k, "seed": case["seed"]}
            runs[fused] = pool.call(backend, "engine_run", source=source, weights=weights, x=x,
                                    y=y, engine="native", spec=case["optimizer"], config=config)
        assert len(runs[k]["loss"]) == 2 * k
        _assert_same_run(runs[1], runs[k], f"{backend}: fused {k} vs single")


@given(case=training_cases())
def test_native_engine_follows_the_keras_fit_trajectory(pool, case):
    """Full-batch training (one batch per epoch), so both engines see the same batches
    whatever order each shuffles in."""
    note(f"case: {case}")
    batch, steps = case["batch_size"], case["fused"]
    for backend in pool.backends:
        source, weights, x, y = _data(pool, backend, case, batch)
        config = {"batch_size": batch, "epochs": steps, "max_steps": steps, "seed": case["seed"]}
        runs = {engine: pool.call(backend, "engine_run", source=source, weights=weights, x=x, y=y,
                                  engine=engine, spec=case["optimizer"], config=config)
                for engine in ("keras", "native")}
        assert len(runs["native"]["loss"]) == len(runs["keras"]["loss"]) == steps
        _assert_same_run(runs["keras"], runs["native"], f"{backend}: native vs keras fit")


def test_keras_fit_trajectory_is_the_same_on_both_backends(pool):
    """The engine runner on the Keras engine: full-batch fit, same per-step losses and final
    weights on JAX and TF (and the harness half of the engine properties works today)."""
    arch = {"input": {"shape": [5]}, "outputs": 3, "output_activation": "softmax", "layers": [
        {"type": "dense", "units": 6, "activation": "tanh"}, {"type": "batchnorm"}]}
    case = {"arch": arch, "seed": 3}
    source, weights, x, y = _data(pool, "jax", case, 16)
    config = {"batch_size": 16, "epochs": 4, "max_steps": 4, "seed": 3}
    runs = pool.call_each({b: {"source": source, "weights": weights, "x": x, "y": y,
                               "engine": "keras", "spec": {"name": "adam", "learning_rate": 0.01},
                               "config": config} for b in pool.backends}, "engine_run")
    assert runs["jax"]["step"] == [1, 2, 3, 4]
    _assert_same_run(runs["jax"], runs["tensorflow"], "keras fit, jax vs tensorflow")
