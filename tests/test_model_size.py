"""Model sizes are checked before anything is built (issue 14, "nothing unbounded").

``count_params`` computes each builder's parameter count from its options alone; it must equal
Keras's ``model.count_params()`` on real small models of every kind (on the backend under test),
so the two cannot drift apart. A model whose training state would not fit in memory is refused
with one line, fast and without allocating it.
"""

from __future__ import annotations

import time
from dataclasses import replace

import psutil
import pytest

from kbackend.data import DatasetInfo
from kbackend.errors import ConfigError
from kbackend.models import (
    MODELS,
    PARAM_COUNTS,
    SIZE_OPTIONS,
    ModelOptions,
    build_model,
    check_model_fits,
    count_params,
)

FLAT = DatasetInfo("flat", (12,), 3, "generated", "flat", None, 10, 10, 10)
IMAGE = DatasetInfo("image", (9, 7, 2), 4, "generated", "image", None, 10, 10, 10)
IMAGE_NCHW = replace(IMAGE, input_shape=(2, 9, 7))
SEQUENCE = DatasetInfo("sequence", (10, 3), 5, "generated", "sequence", None, 10, 10, 10)
BN = ModelOptions(batch_norm=True, dropout=0.1, l2=1e-4)

# (model, dataset info, options): every model kind, with and without the options that change
# the parameter count (batch norm drops biases and adds 4 values per unit).
SMALL_MODELS = {
    "logistic": ("logistic", FLAT, ModelOptions()),
    "seed_mlp": ("seed_mlp", FLAT, ModelOptions()),
    "seed_mlp bn": ("seed_mlp", FLAT, BN),
    "mlp": ("mlp", FLAT, ModelOptions(widths=(5, 12, 7))),
    "mlp residual bn": ("mlp", FLAT, replace(BN, widths=(12, 12, 4), residual=True)),
    "cnn2d": ("cnn2d", IMAGE, ModelOptions(filters=(3, 4, 5))),
    "cnn2d bn": ("cnn2d", IMAGE, replace(BN, filters=(3, 1))),
    "cnn2d channels_first": ("cnn2d", IMAGE_NCHW,
                             ModelOptions(filters=(3, 4), data_format="channels_first")),
    "cnn image": ("cnn", IMAGE, ModelOptions(filters=(2,))),
    "cnn1d": ("cnn1d", SEQUENCE, ModelOptions(filters=(4, 5, 6))),
    "cnn1d bn channels_first": ("cnn1d", SEQUENCE,
                                replace(BN, filters=(4, 2), data_format="channels_first")),
    "cnn sequence": ("cnn", SEQUENCE, ModelOptions(filters=(3,))),
    "gru": ("gru", SEQUENCE, ModelOptions(units=5)),
    "gru bidirectional all": ("gru", SEQUENCE,
                              ModelOptions(units=4, bidirectional=True, readout="all")),
    "gru bn all": ("gru", SEQUENCE, replace(BN, units=3, readout="all")),
}


def test_every_model_has_a_count_and_every_kind_is_tested():
    assert set(PARAM_COUNTS) == set(MODELS)
    assert set(SIZE_OPTIONS) <= set(MODELS)
    assert {name for name, _, _ in SMALL_MODELS.values()} == set(MODELS)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SMALL_MODELS))
def test_count_equals_keras_count_params(case):
    name, info, options = SMALL_MODELS[case]
    try:
        model = MODELS[name][0](info, options)
    except ConfigError as error:  # an installation without channels_first convolutions
        pytest.skip(str(error))
    assert count_params(name, info, options) == model.count_params()
    assert check_model_fits(name, info, options) == model.count_params()


def test_count_refuses_a_wrong_layout_like_the_builder():
    with pytest.raises(ConfigError, match="needs flat inputs"):
        count_params("mlp", SEQUENCE, ModelOptions())
    with pytest.raises(ConfigError, match="needs sequence inputs"):
        count_params("gru", FLAT, ModelOptions())


def test_the_limit_is_the_training_state_and_can_refuse_a_small_model():
    """Negative control: the same small model passes with room for 4 float32 copies and is
    refused with one byte less."""
    params = count_params("mlp", FLAT, ModelOptions(widths=(5,)))
    assert check_model_fits("mlp", FLAT, ModelOptions(widths=(5,)), available=16 * params) == params
    with pytest.raises(ConfigError, match=r"Invalid --widths 5: .* Received: 83 parameters"):
        check_model_fits("mlp", FLAT, ModelOptions(widths=(5,)), available=16 * params - 1)
    with pytest.raises(ConfigError, match="Invalid --model logistic"):
        check_model_fits("logistic", FLAT, available=0)


HUGE = {  # model, info, options, the option the refusal names
    "gru units": ("gru", SEQUENCE, ModelOptions(units=10**9), "--units 1000000000"),
    "mlp widths": ("mlp", FLAT, ModelOptions(widths=(10**6, 10**6)), "--widths 1000000,1000000"),
    "cnn2d filters": ("cnn2d", IMAGE, ModelOptions(filters=(32, 10**9)), "--filters 32,1000000000"),
    "cnn1d filters": ("cnn1d", SEQUENCE, ModelOptions(filters=(10**12,)),
                      "--filters 1000000000000"),
    "mlp 10**40": ("mlp", FLAT, ModelOptions(widths=(10**40,)), "--widths 1" + "0" * 40),
}


@pytest.mark.parametrize("case", list(HUGE))
def test_huge_model_is_refused_fast_without_allocating(case):
    name, info, options, shown = HUGE[case]
    process = psutil.Process()
    rss = process.memory_info().rss
    start = time.perf_counter()
    with pytest.raises(ConfigError) as raised:
        build_model(name, info, options)
    elapsed = time.perf_counter() - start
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"Invalid {shown}: model {name!r}"), message
    assert "Expected" in message and "Received:" in message and "parameters" in message
    assert elapsed < 0.25, elapsed
    assert process.memory_info().rss - rss < 32 * 2**20  # nothing of the model was allocated


def test_a_long_widths_list_is_shortened_in_the_message():
    options = ModelOptions(widths=(10**9,) * 50)
    with pytest.raises(ConfigError, match=r"Invalid --widths [0-9,]{57}\.\.\.: ") as raised:
        check_model_fits("mlp", FLAT, options)
    assert len(str(raised.value)) < 400


def test_train_refuses_before_building(monkeypatch):
    """The Python API: ``train`` refuses the model after loading the data, before building it."""
    from kbackend import models, training
    from kbackend.training import TrainConfig

    def never(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setitem(models.MODELS, "gru", (never, models.MODELS["gru"][1]))
    config = TrainConfig(model="gru", dataset="digits", engine="keras",
                         model_options=ModelOptions(units=10**9))
    with pytest.raises(ConfigError, match=r"Invalid --units 1000000000: model 'gru' on digits"):
        training.train(config)
