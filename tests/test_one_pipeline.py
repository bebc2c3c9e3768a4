"""One pipeline for every model and dataset (issue 44): built-in names are sources like any
other. A built-in model on a built-in dataset is prepared as every workload is (a first model,
the checks, the dataset made of the checked splits) and comes out as the built-in loader reads
it; what differs by kind is a member of the source class; a dataset keeps no reference to what
it was read from; ``kbackend launch`` checks every model and data alike."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from kbackend import data as data_module
from kbackend.data import user as user_data
from kbackend.errors import ConfigError, DataError
from kbackend.model_sources import parse_model_source
from kbackend.models import ModelOptions
from kbackend.task import CLASSIFICATION
from kbackend.workload import SPLIT_SEED, prepare_workload

BUILDER = ("import keras\n"
           "def build(input_shape, num_classes):\n"
           "    inputs = keras.Input(input_shape)\n"
           "    x = keras.layers.Flatten()(inputs)\n"
           "    outputs = keras.layers.Dense(num_classes)(x)\n"
           "    model = keras.Model(inputs, outputs)\n"
           "    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),\n"
           "                  metrics=['accuracy'])\n"
           "    return model\n")


@pytest.mark.parametrize(("model", "layout"), [("seed_mlp", "flat"), ("cnn", "spatial")])
def test_a_builtin_model_on_builtin_data_is_prepared_as_any_workload(model, layout):
    workload = prepare_workload(model, "digits", seed=3)
    # the held-out validation split is a fixed draw, whatever the run's seed
    loaded = data_module.load("digits", layout=layout, seed=SPLIT_SEED)
    assert workload._first is not None  # a first model was built and checked, as for any
    assert workload.task is CLASSIFICATION and not workload.says_task and not workload.notes
    assert workload.dataset.info == loaded.info  # the loader's description, kept
    for split in ("train", "val", "test"):
        for ours, theirs in zip(workload.dataset.split(split), loaded.split(split), strict=True):
            np.testing.assert_array_equal(ours, theirs)
            assert ours.dtype == theirs.dtype
    assert workload.dataset.digest() == loaded.digest()
    first = workload.first_model()
    assert workload.build(workload.options.seed) is first  # built once, for the first run


@pytest.mark.parametrize("model", ["seed_mlp", "builder"])
def test_a_validation_fraction_of_zero_on_builtin_data_validates_on_the_test_split(model,
                                                                                   tmp_path):
    if model == "builder":
        (tmp_path / "builder.py").write_text(BUILDER)
        model = f"{tmp_path / 'builder.py'}:build"
    dataset = prepare_workload(model, "digits", validation_fraction=0).dataset
    assert dataset.info.val_is_test and dataset.info.num_val == dataset.info.num_test
    np.testing.assert_array_equal(dataset.x_val, dataset.x_test)


def test_the_user_model_on_builtin_data_says_its_task_and_keeps_the_data_description(tmp_path):
    (tmp_path / "builder.py").write_text(BUILDER)
    workload = prepare_workload(f"{tmp_path / 'builder.py'}:build", "digits")
    loaded = data_module.load("digits", layout="spatial")
    assert workload.says_task and workload.task.source == "compiled"
    assert workload.dataset.info == loaded.info
    assert workload.dataset.digest() == loaded.digest()


def test_a_dataset_passed_alone_builds_a_builtin_model_and_refuses_a_users(tmp_path):
    """``training.train(config, dataset=...)`` with neither model nor workload: a user's model
    would train ``config.task``, not its compiled loss, so it is refused in one line."""
    from kbackend.training import TrainConfig, train

    (tmp_path / "builder.py").write_text(BUILDER)
    digits = data_module.load("digits", layout="spatial")
    config = TrainConfig(model=f"{tmp_path / 'builder.py'}:build", dataset="digits", epochs=1)
    with pytest.raises(ConfigError, match="builds a built-in model only") as error:
        train(config, dataset=digits)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("model", ["builder", "seed_mlp"])
def test_a_workload_prepared_outside_the_runs_precision_trains_in_it(tmp_path, model):
    """The command line and ``kbackend.train`` prepare the workload (building its first model)
    before the run's ``--precision`` scope: the run's model is built again under its policy."""
    from kbackend.training import TrainConfig, train

    (tmp_path / "builder.py").write_text(BUILDER)
    name = f"{tmp_path / 'builder.py'}:build" if model == "builder" else model
    workload = prepare_workload(name, "digits")
    config = TrainConfig(model=name, dataset="digits", epochs=1, engine="native",
                         precision="mixed_bfloat16")
    trained = train(config, workload=workload).model
    assert {layer.dtype_policy.name for layer in trained.layers
            if layer.weights} == {"mixed_bfloat16"}


def test_a_dataset_keeps_no_reference_to_the_arrays_it_was_read_from():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    given = weakref.ref(x)
    workload = prepare_workload(lambda input_shape, num_classes: _dense(input_shape, num_classes),
                                x=x, y=y)
    digest = workload.dataset.digest()
    del x
    gc.collect()
    assert given() is None  # the user's array is not held by the dataset (copies are)
    assert workload.dataset.digest() == digest
    assert not hasattr(workload.dataset, "origin")


def _dense(input_shape: tuple[int, ...], num_classes: int):
    import keras

    inputs = keras.Input(input_shape)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(inputs))


def test_what_differs_by_kind_is_a_member_of_the_source():
    builtin, builder = parse_model_source("mlp"), parse_model_source(_dense)
    assert (builtin.default_metric, builder.default_metric) == ("val_accuracy", None)
    info = data_module.load("digits", layout="flat").info
    with pytest.raises(ConfigError, match="too large"):
        builtin.check_fits(info, ModelOptions(widths=(2**40,)))
    builder.check_fits(info, ModelOptions(widths=(2**40,)))  # checked when built, not before
    assert builtin.data_format(ModelOptions(data_format="channels_first")) == "channels_first"
    assert builder.data_format(ModelOptions(data_format="channels_first")) == "channels_last"


def test_check_source_loads_a_builtin_name_and_checks_a_users_source(tmp_path):
    dataset = user_data.check_source("digits", layout="flat", validation_fraction=0.2, seed=1)
    assert dataset is not None
    assert dataset.info == data_module.load("digits", validation_fraction=0.2, seed=1).info
    np.savez(tmp_path / "d.npz", x_train=np.zeros((4, 2), np.float32), y_train=np.arange(4))
    assert user_data.check_source(str(tmp_path / "d.npz")) is None
    with pytest.raises(DataError, match="no such file"):
        user_data.check_source(str(tmp_path / "missing.npz"))
