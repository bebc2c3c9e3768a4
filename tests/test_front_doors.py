"""The front doors (``kbackend train``/``study`` and ``kbackend.train``/``kbackend.study``) state
no default of their own: each is the config field's (``errors.field_default``); and a keyword
argument the Python API does not take is a one-line ``KBackendError`` naming it, a Keras habit
(``verbose=``) with kbackend's argument instead."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import kbackend
from kbackend import api
from kbackend.cli import build_parser
from kbackend.errors import ApiTypeError, InternalError, KBackendError, field_default
from kbackend.models import ModelOptions
from kbackend.optim import OptimizerSpec
from kbackend.study.config import StudyConfig
from kbackend.training import TrainConfig

# Flags whose parsed value is a request the command resolves (None: derived from other flags,
# the data or the engine), not a default of the field it fills.
DERIVED_TRAIN = {"optimizer", "lr_scaling", "fused_steps", "monitor", "target"}
DERIVED_STUDY = {"target", "frontier_epochs", "max_seeds"}


@pytest.mark.parametrize(("command", "owner", "derived"), [
    ("train", TrainConfig, DERIVED_TRAIN), ("study", StudyConfig, DERIVED_STUDY)])
def test_each_flag_default_is_the_config_field_default(command, owner, derived):
    args = vars(build_parser().parse_args([command]))
    checked = [item.name for item in dataclasses.fields(owner)
               if item.name in args and item.name not in derived]
    assert len(checked) > 15
    assert {name: args[name] for name in checked} == {
        name: field_default(owner, name) for name in checked}


def test_the_train_flags_describe_the_default_config():
    """The optimizer and model options too: ``kbackend train`` with no flags is
    ``TrainConfig()`` (the engine's K aside: the command asks it to be measured)."""
    from kbackend.commands.train import config_from_args

    config = config_from_args(build_parser().parse_args(["train"]))
    assert dataclasses.replace(config, fused_steps=TrainConfig().fused_steps) == TrainConfig()
    assert (config.optimizer, config.model_options) == (OptimizerSpec(), ModelOptions())


def test_the_python_api_defaults_are_the_config_fields():
    train = inspect.signature(api.train).parameters
    for name in ("epochs", "engine", "early_stopping", "seed", "validation_fraction"):
        assert train[name].default == field_default(TrainConfig, name), name
    assert (train["optimizer"].default, train["learning_rate"].default) == (
        OptimizerSpec().name, OptimizerSpec().learning_rate)
    study = inspect.signature(api.study).parameters
    for name in ("seeds", "optimizers"):  # the command line's --optimizers default too
        assert study[name].default == field_default(StudyConfig, name), name
    assert study["optimizers"].default == build_parser().parse_args(["study"]).optimizers
    assert str(study["out"].default) == build_parser().parse_args(["study"]).out


def test_kbackend_train_builds_with_the_model_options_it_is_given():
    """A ``TrainConfig`` field passed to ``kbackend.train`` is used, not only recorded:
    ``model_options`` shape the built-in model the run trains."""
    from kbackend.models import ModelOptions

    result = api.train("mlp", data="digits", epochs=1, progress=False,
                       model_options=ModelOptions(widths=(7,)))
    dense = [layer.units for layer in result.model.layers if hasattr(layer, "units")]
    assert dense[0] == 7 and result.config.model_options.widths == (7,)


def test_a_mistyped_keyword_is_never_pointed_at_the_catch_all_options():
    with pytest.raises(ApiTypeError) as error:
        api.train("mlp", data="digits", option=1)
    assert "did you mean options=" not in str(error.value)


def test_a_field_default_that_does_not_exist_is_a_clear_error():
    with pytest.raises(InternalError, match="TrainConfig has no field 'epoch'"):
        field_default(TrainConfig, "epoch")

    @dataclasses.dataclass
    class Required:
        name: str

    with pytest.raises(InternalError, match=r"Required\.name has no default"):
        field_default(Required, "name")


@pytest.mark.parametrize(("call", "kwargs", "words"), [
    (kbackend.train, {"verbose": 0}, ["'verbose'", "progress=True or False"]),
    (kbackend.train, {"validation_split": 0.2}, ["'validation_split'",
                                                 "validation_fraction="]),
    (kbackend.train, {"callbacks": []}, ["'callbacks'", "early_stopping="]),
    (kbackend.train, {"epoch": 3}, ["'epoch'", "did you mean epochs=?"]),
    (kbackend.train, {"monitor": "val_loss"}, ["'monitor'", "target_metric="]),
    (kbackend.train, {"no_such_option": 1}, ["'no_such_option'", "TrainConfig fields"]),
    (kbackend.study, {"verbose": 1}, ["kbackend.study()", "'verbose'", "progress="]),
    (kbackend.study, {"seed_count": 3}, ["'seed_count'", "did you mean"]),
])
def test_an_unknown_keyword_is_one_line_naming_it(call, kwargs, words, engines_never_run):
    with pytest.raises(ApiTypeError) as raised:
        call("seed_mlp", data="digits", target=0.5, **kwargs)
    message = str(raised.value)
    assert isinstance(raised.value, KBackendError) and isinstance(raised.value, TypeError)
    name = "study" if call is kbackend.study else "train"
    assert "\n" not in message and message.startswith(f"kbackend.{name}() got an unexpected "
                                                      "keyword argument")
    for word in words:
        assert word in message, message


def test_config_fields_still_pass_through(engines_never_run):
    """A ``TrainConfig`` field that ``train`` takes as a further option is no error (the run
    reaches the engine, which this test forbids)."""
    with pytest.raises(AssertionError, match="training started"):
        kbackend.train("seed_mlp", data="digits", epochs=1, shuffle=False, max_steps=5,
                       progress=False, engine="keras")
