"""Property suite: JAX and TensorFlow compute the same thing for random models.

Every example is a model drawn from tests.equivalence.strategies with random weights and data
(tiny, unit and large magnitudes), run in both workers of the session pool.
"""

from __future__ import annotations

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from kbackend.equivalence import Case, compare_model
from kbackend.equivalence.compare import compare_results
from tests.equivalence.conftest import assert_no_unexplained_failures
from tests.equivalence.strategies import (
    FAMILIES,
    IMAGE_FAMILIES,
    ModelCase,
    cases,
    materialize,
    with_data_format,
)

pytestmark = pytest.mark.equivalence


def _prepare(pool, case: ModelCase):
    note(f"model case: {case.to_json()}")
    description = pool.call(pool.backends[0], "describe", source=case.source)
    return materialize(case, description)


@pytest.mark.parametrize("family", FAMILIES)
@given(data=st.data())
def test_backends_agree_forward_loss_gradients_and_steps(pool, family, data):
    """Forward (inference), training loss, gradients, params after 1 and K steps of sgd /
    momentum / adam: JAX == TF within TOLERANCES, except rows a known divergence explains.
    One run per input family, so every family gets its examples in the ``ci`` profile."""
    case = data.draw(cases(families=(family,)), label="case")
    weights, x, y = _prepare(pool, case)
    report = compare_model(pool, Case(case.source, x, y, loss=case.keras_loss(), weights=weights,
                                      check_saved=False))
    assert_no_unexplained_failures(report, pool, case, weights, x, y)


@given(case=cases(max_layers=3))
def test_model_saved_on_one_backend_predicts_the_same_on_the_other(pool, case):
    """Saved on JAX, loaded on TF and the reverse: bit-identical weights, same predictions."""
    weights, x, y = _prepare(pool, case)
    report = compare_model(pool, Case(case.source, x, None, weights=weights, check_saved=True))
    saved_rows = [r for r in report.rows if r.quantity in ("saved", "weights")]
    assert {r.name.split(":")[0] for r in saved_rows if r.quantity == "saved"} == {
        "saved on jax, loaded on tensorflow", "saved on tensorflow, loaded on jax"}
    assert_no_unexplained_failures(report, pool, case, weights, x, y)


@given(case=cases(families=IMAGE_FAMILIES, data_format="channels_first", max_layers=3))
def test_channels_first_equals_channels_last_on_transposed_inputs(pool, case):
    """On JAX (both layouts supported): the channels_first model on x equals the channels_last
    model with the same weights on x moved to channels-last, for outputs, loss, gradients, steps."""
    backend = "jax"
    assert pool.call(backend, "ping")["supports_channels_first"]
    weights, x_first, y = _prepare(pool, case)
    last = with_data_format(case.arch, "channels_last")
    x_last = [xi.transpose(0, *range(2, xi.ndim), 1) for xi in x_first]
    common = {"weights": weights, "y": y, "loss": case.keras_loss(),
              "optimizers": [{"label": "adam", "name": "adam", "learning_rate": 1e-3}]}
    first_result = pool.call(backend, "evaluate", source=case.source, x=x_first, **common)
    last_result = pool.call(backend, "evaluate", source={"kind": "arch", "arch": last}, x=x_last,
                            **common)
    rows = compare_results(last_result, first_result, ["head"])
    failures = [r for r in rows if not r.passed]
    assert not failures, "\n".join(f"{r.name}: abs {r.max_abs:.3g} rel {r.max_rel:.3g}"
                                   for r in failures) + f"\nmodel case: {case.to_json()}"


@given(case=cases(families=IMAGE_FAMILIES, data_format="channels_first", max_layers=3))
def test_backends_agree_on_channels_first_models(pool, case, channels_first_everywhere):
    """channels_first conv / pooling models: JAX == TF (where TF runs them; see the
    tf-cpu-channels-first entry of KNOWN_DIVERGENCES)."""
    weights, x, y = _prepare(pool, case)
    report = compare_model(pool, Case(case.source, x, y, loss=case.keras_loss(), weights=weights,
                                      check_saved=False))
    assert_no_unexplained_failures(report, pool, case, weights, x, y)
