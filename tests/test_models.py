"""Models build for the datasets they suit and run forward in both data formats where supported."""

from __future__ import annotations

import numpy as np
import pytest

from kbackend import data
from kbackend.backends import impl
from kbackend.errors import ConfigError
from kbackend.models import ModelOptions, build_model, model_layout

CASES = [  # (model, dataset)
    ("seed_mlp", "digits"), ("seed_mlp", "mnist1d"), ("mlp", "digits"), ("mlp", "synthetic"),
    ("cnn", "digits"), ("gru", "digits"), ("gru", "mnist1d"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dataset"), CASES)
@pytest.mark.parametrize("options", [ModelOptions(),
                                     ModelOptions(dropout=0.2, batch_norm=True, l2=1e-4)])
def test_model_builds_and_runs_forward(name, dataset, options):
    ds = data.load(dataset, layout=model_layout(name))
    model = build_model(name, ds.info, options)
    probs = np.asarray(model.predict(ds.x_test[:5], verbose=0))
    assert probs.shape == (5, 10)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-5)
    if options.l2:
        assert model.losses, "L2 regularization adds losses"


def test_seed_mlp_has_the_classic_widths():
    ds = data.load("digits")
    model = build_model("seed_mlp", ds.info)
    widths = [layer.units for layer in model.layers if hasattr(layer, "units")]
    assert widths == [786, 256, 160, 10]


def test_same_seed_same_weights_on_one_backend():
    ds = data.load("digits")
    a = build_model("seed_mlp", ds.info, ModelOptions(seed=1)).get_weights()
    b = build_model("seed_mlp", ds.info, ModelOptions(seed=1)).get_weights()
    for wa, wb in zip(a, b, strict=True):
        np.testing.assert_array_equal(wa, wb)


def test_cnn_channels_first_runs_or_is_refused_clearly():
    ds = data.load("digits", layout="image", data_format="channels_first")
    options = ModelOptions(data_format="channels_first")
    if not impl().supports_channels_first_conv():
        with pytest.raises(ConfigError, match="channels_first convolutions are not supported "
                                              "by this TensorFlow build"):
            build_model("cnn", ds.info, options)
        return
    first = build_model("cnn", ds.info, options)
    last_ds = data.load("digits", layout="image")
    last = build_model("cnn", last_ds.info, ModelOptions(data_format="channels_last"))
    last.set_weights(first.get_weights())
    np.testing.assert_allclose(
        np.asarray(first.predict(ds.x_test[:8], verbose=0)),
        np.asarray(last.predict(last_ds.x_test[:8], verbose=0)), atol=1e-5)


def test_model_rejects_wrong_layout():
    with pytest.raises(ConfigError, match="needs image inputs"):
        build_model("cnn", data.load("digits").info)
    with pytest.raises(ConfigError, match="Unknown model"):
        build_model("resnet", data.load("digits").info)


def test_bad_model_options():
    with pytest.raises(ConfigError, match="dropout"):
        ModelOptions(dropout=1.5)


def test_channels_first_refusal_is_a_clear_error(monkeypatch):
    """Where the probe finds no NCHW convolutions, building the CNN fails with a one-line error."""
    backend_impl = impl()
    monkeypatch.setattr(backend_impl, "supports_channels_first_conv", lambda: False)
    ds = data.load("digits", layout="image", data_format="channels_first")
    with pytest.raises(ConfigError, match="channels_first convolutions are not supported") as error:
        build_model("cnn", ds.info, ModelOptions(data_format="channels_first"))
    assert "\n" not in str(error.value)
