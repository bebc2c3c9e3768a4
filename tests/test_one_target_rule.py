"""One rule for a study's target and one source for the flags that name its data (issue 44 item
3, issue 43 item 4): the data source (``kbackend.data.named``) knows its default target and its
command-line flags; the CLI, ``kbackend.study``, ``StudyConfig`` and ``advise`` ask it. The
user's data without a target is one line naming the metric and a short probe's best value; a
built-in dataset gets its own default; printed flags parse back to the same source."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import numpy as np
import pytest

from kbackend.config import Target
from kbackend.data import DATASETS
from kbackend.data.named import BUILTIN_TARGETS, BuiltinData, OwnData, data_source
from kbackend.errors import ConfigError
from kbackend.study.config import StudyConfig
from kbackend.study.targets import default_target, study_target


def _user_npz(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 4)).astype(np.float32)
    np.savez(tmp_path / "u.npz", x_train=x, y_train=(x[:, 0] > 0).astype(np.int64))
    return tmp_path / "u.npz"


def test_every_built_in_dataset_has_its_own_default_and_user_data_none():
    assert set(BUILTIN_TARGETS) == set(DATASETS)
    for name in DATASETS:
        assert isinstance(data_source(name), BuiltinData)
        assert default_target(name) == Target(*BUILTIN_TARGETS[name])
    for source in ("u.npz", "t.csv", "tfds:mnist", "f.py:load", "digits/"):
        assert isinstance(data_source(source), OwnData)
        assert default_target(source) is None


def test_a_built_in_dataset_gets_its_default_at_every_front_door():
    from kbackend.cli import build_parser
    from kbackend.commands.study import config_from_args

    assert study_target("seed_mlp", "digits", None, None) == Target("val_accuracy", 0.95)
    assert StudyConfig(dataset="mnist1d_large").resolved_target == Target("val_accuracy", 0.65)
    args = build_parser("study").parse_args(["study", "--dataset", "digits"])
    assert config_from_args(args).target == Target("val_accuracy", 0.95)
    # another metric without a value is not the dataset's default on that metric
    with pytest.raises(ConfigError, match="--target-metric val_loss needs an explicit --target"):
        study_target("seed_mlp", "digits", None, "val_loss")
    with pytest.raises(ConfigError, match="target_metric=val_loss needs an explicit target="):
        study_target("seed_mlp", "digits", None, "val_loss", python=True)
    assert study_target("seed_mlp", "u.npz", 0.7, None) == Target("val_accuracy", 0.7)


def test_user_data_without_a_target_is_one_line_on_the_cli_and_in_python(tmp_path):
    """The CLI's flags, ``kbackend.study`` and a ``StudyConfig`` given to ``run_study`` all
    refuse the user's data without a target, with the metric and the probe's best value;
    never another dataset's default (val_accuracy 0.9 was the old fallback)."""
    import kbackend
    from kbackend.cli import build_parser
    from kbackend.commands.study import config_from_args

    data = str(_user_npz(tmp_path))
    args = build_parser("study").parse_args(["study", "--model", "logistic", "--data", data])
    with pytest.raises(ConfigError) as cli_error:
        config_from_args(args)
    with pytest.raises(ConfigError) as python_error:
        kbackend.study("logistic", data=data, out=tmp_path / "out", progress=False)
    with pytest.raises(ConfigError) as config_error:
        StudyConfig(model="logistic", dataset=data).resolved_target  # noqa: B018
    for error, flag in ((cli_error, "--target"), (python_error, "target="),
                        (config_error, "target=")):
        message = str(error.value)
        assert "\n" not in message and f"needs {flag}:" in message
        assert "val_accuracy" in message and "probe" in message and "reached" in message
        # the example in the caller's words: flags on the command line, keywords in Python
        assert ("e.g. --target VALUE --target-metric val_accuracy." in message) == \
            (flag == "--target")
        assert ("e.g. target=VALUE, target_metric='val_accuracy'." in message) == \
            (flag == "target=")
    assert not (tmp_path / "out" / "study.db").exists()


@pytest.mark.parametrize("name,label", [("digits", None), ("mnist1d_large", None),
                                        ("my data/train set.csv", "the label"),
                                        ("tfds:mnist:3.0.1", None), ("files/u.npz", None)])
def test_advise_and_the_recommendation_print_flags_that_parse_back(name, label):
    """The flags ``advise`` prints and the recommendation's ``train`` arguments name the same
    data source once parsed by the commands that run them."""
    from kbackend.advise.advisor import _source_flags
    from kbackend.cli import build_parser
    from kbackend.study.recommend import train_arguments
    from kbackend.study.study_record import Cell, StudyRecord

    source = data_source(name, label)
    printed = shlex.split(_source_flags("m.py:build", source, unsafe=True))
    cell = Cell("sgd", 32, learning_rate=0.1, reached=True)
    study = StudyRecord(cells=[cell], config={"model": "m.py:build", "dataset": name,
                                              "label": label, "engine": "native",
                                              "target": {"metric": "val_accuracy",
                                                         "value": 0.9}})
    for command, flags in (("study", printed), ("train", printed),
                           ("train", train_arguments(study, cell))):
        args = build_parser(command).parse_args([command, *flags])
        assert data_source(args.data or args.dataset, args.label) == source
        assert args.model == "m.py:build"
    assert "--unsafe-deserialization" in printed


def test_no_front_door_tells_built_in_from_user_data_itself():
    """The house rule: outside the sources' dispatch no file tests a name against the
    registries or a source's class (``scripts/house_goals.py``), with planted breaches."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    try:
        import house_goals
    finally:
        sys.path.pop(0)
    assert house_goals.builtin_forks() == []
    for planted in ('if dataset in DATASETS:', 'if name not in MODELS:',
                    'if isinstance(source, BuiltinModel):', 'model_kind(m) is BuiltinModel',
                    'if source.kind == "builtin":', 'isinstance(data, OwnData)'):
        assert house_goals.BUILTIN_FORK.search(planted), planted
    for allowed in ("DATASETS[name]", "sorted(DATASETS)", "data_source(name).to_flags()"):
        assert not house_goals.BUILTIN_FORK.search(allowed), allowed
