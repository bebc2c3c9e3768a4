"""Declared validation: each config field's type, bounds and choices are declared beside it
(``errors.declared``) and checked by one helper (``errors.check_declared``); the command line
reads the same declarations; the rules between fields are named methods; and no module raises a
bare ``ValueError`` / ``RuntimeError`` / ``TypeError`` at its users (``KBackendError``s do)."""

import argparse
import dataclasses
import math
import re
from pathlib import Path

import pytest

from kbackend.cli import build_parser
from kbackend.config import TrainConfig
from kbackend.errors import ApiTypeError, ConfigError, check_declared, declared, declared_rule
from kbackend.study.config import StudyConfig


@dataclasses.dataclass
class Sample:
    count: int = dataclasses.field(default=1, metadata=declared(int, low=1, high=10))
    ratio: float = dataclasses.field(default=0.5, metadata=declared(
        (int, float), low=0, high=1, open_high=True, why="a share"))
    mode: str = dataclasses.field(default="a", metadata=declared(str, choices=("a", "b")))
    budget: float | None = dataclasses.field(default=None, metadata=declared(
        (int, float, type(None)), low=0, finite=True, shown="--budget"))
    free: str = "anything"  # undeclared: not checked

    def __post_init__(self) -> None:
        check_declared(self)


@pytest.mark.parametrize(("fields", "message"), [
    ({"count": "3"}, "Invalid Sample.count: expected an integer. Received: '3' (str)."),
    ({"count": True}, "Invalid Sample.count: expected an integer. Received: True (bool)."),
    ({"count": 0}, "Invalid count 0: expected an integer from 1 to 10."),
    ({"count": 11}, "Invalid count 11: expected an integer from 1 to 10."),
    ({"ratio": 1.0}, "Invalid ratio 1.0: expected a number in [0, 1) (a share)."),
    ({"ratio": math.nan}, "Invalid ratio nan: expected a number in [0, 1) (a share)."),
    ({"ratio": None}, "Invalid Sample.ratio: expected a number (a share). "
                      "Received: None (NoneType)."),
    ({"mode": "c"}, "Invalid mode 'c': expected one of ['a', 'b']."),
    ({"budget": math.inf}, "Invalid --budget inf: expected a finite number >= 0."),
    ({"budget": -1}, "Invalid --budget -1: expected a finite number >= 0."),
], ids=["type", "bool-is-not-int", "below", "above", "open-high", "nan", "none", "choice",
        "infinite", "shown-name"])
def test_the_helper_rejects_each_kind_in_one_line_naming_the_field(fields, message):
    with pytest.raises(ConfigError) as raised:
        Sample(**fields)
    assert str(raised.value) == message


def test_what_the_declarations_admit_passes():
    Sample(count=10, ratio=0, mode="b", budget=None, free=3)  # type: ignore[arg-type]
    Sample(count=1, ratio=0.999, budget=2.5)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: TrainConfig(epochs=0), "Invalid epochs 0: expected an integer from 1 to 1,000,000."),
    (lambda: TrainConfig(seed=-1), "Invalid seed -1: expected an integer from 0 to "
                                   "4,294,967,295 (NumPy's seed range)."),
    (lambda: TrainConfig(dp_impl="vmap"), "Invalid dp_impl 'vmap': expected one of "
                                          "['shard_map', 'pmap']."),
    (lambda: TrainConfig(fused_steps=True), "Invalid TrainConfig.fused_steps: expected an "
                                            "integer."),
    (lambda: TrainConfig(lr_scaling="cubic"), "Invalid --lr-scaling 'cubic'"),
    (lambda: StudyConfig(lr_factor=1.0), "Invalid lr_factor 1.0: expected a number > 1 "
                                         "(a ratio)."),
    (lambda: StudyConfig(cell_cpus=math.inf), "Invalid cell_cpus inf: expected a finite "
                                              "number > 0."),
    (lambda: StudyConfig(validation_fraction=0), "Invalid validation_fraction 0: expected a "
                                                 "number in (0, 1)"),
    (lambda: StudyConfig(engine="warp"), "Invalid engine 'warp': expected one of"),
    (lambda: StudyConfig(frontier_epochs=-1), "Invalid --frontier-epochs (frontier_epochs) -1"),
])
def test_the_configs_fields_are_checked_by_their_declarations(build, message):
    with pytest.raises(ConfigError) as raised:
        build()
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


def _option(command: str, flag: str) -> argparse.Action:
    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return next(a for a in sub.choices[command]._actions if flag in a.option_strings)


@pytest.mark.parametrize(("command", "flag", "owner", "name", "extra"), [
    ("train", "--engine", TrainConfig, "engine", ["auto"]),
    ("train", "--precision", TrainConfig, "precision", []),
    ("train", "--dp-impl", TrainConfig, "dp_impl", []),
    ("train", "--lr-scaling", TrainConfig, "lr_scaling", []),
    ("study", "--engine", StudyConfig, "engine", []),
    ("study", "--population", StudyConfig, "population", []),
    ("study", "--lr-scaling", StudyConfig, "lr_scaling", []),
])
def test_a_flags_choices_are_its_fields_declared_choices(command, flag, owner, name, extra):
    assert _option(command, flag).choices == [*declared_rule(owner, name).choices, *extra]


@pytest.mark.parametrize(("command", "flag", "words"), [
    ("train", "--epochs", "an integer from 1 to 1,000,000"),
    ("train", "--heartbeat-timeout", "an integer from 1 to 604,800; seconds, a week"),
    ("study", "--seeds", "an integer >= 1"),
    ("study", "--accuracy-margin", "a number in [0, 1)"),
])
def test_a_bounded_flags_help_states_its_declared_bounds(command, flag, words):
    assert words in _option(command, flag).help


@pytest.mark.parametrize(("build", "message"), [
    (lambda: TrainConfig(validation_fraction=0, early_stopping=2),
     "validation_fraction 0 validates on the test split"),
    (lambda: TrainConfig(num_processes=2, process_id=2, coordinator="127.0.0.1:1234"),
     r"Invalid process_id 2: expected an integer in \[0, 2\)"),
    (lambda: TrainConfig(batch_size="auto", engine="keras"), "--batch-size auto runs on the "
                                                             "native engine"),
    (lambda: TrainConfig(precision="mixed_float16"), "mixed_float16 needs loss scaling"),
    (lambda: TrainConfig(monitor="accuracy"), "Invalid monitor 'accuracy': expected a "
                                              "validation metric"),
    (lambda: StudyConfig(seeds=3, max_seeds=2), r"Invalid --max-seeds 2: expected at least "
                                                r"--seeds \(3\)"),
    (lambda: StudyConfig(noise_small_batch=64, noise_big_batch=32),
     r"the small batch \(64\) must be smaller than the big one \(32\)"),
    (lambda: StudyConfig(workers=2), "--workers sizes a Ray instance started here"),
    (lambda: StudyConfig(cell_gpus=1.5), "Invalid cell_gpus 1.5: expected a fraction"),
    (lambda: StudyConfig(optimizers=("sgd", "sgd")), "Duplicate optimizers"),
    (lambda: StudyConfig(learning_rates={"adamw": (0.1,)}), "not in the study's optimizers"),
], ids=["test-split", "process-id", "auto-engine", "loss-scaling", "monitor", "max-seeds",
        "noise-batches", "workers", "cell-gpus", "optimizers", "learning-rates"])
def test_cross_field_rules_are_one_line_errors(build, message):
    with pytest.raises(ConfigError, match=message) as raised:
        build()
    assert "\n" not in str(raised.value)


def test_an_api_type_error_is_both_kbackends_error_and_a_type_error():
    assert issubclass(ApiTypeError, ConfigError) and issubclass(ApiTypeError, TypeError)


# -- no bare errors raised at users --------------------------------------------------------
BARE = re.compile(r"raise (ValueError|RuntimeError|TypeError)\(")
PACKAGE = Path(__file__).resolve().parents[1] / "kbackend"


def bare_raises(root: Path) -> list[str]:
    """``path:line: text`` of each bare ValueError / RuntimeError / TypeError raised under
    ``root`` (``scripts/house_goals.py``'s "user errors" rule)."""
    return [f"{path.relative_to(root.parent)}:{number}: {line.strip()}"
            for path in sorted(root.rglob("*.py"))
            for number, line in enumerate(path.read_text().splitlines(), 1)
            if BARE.search(line)]


def test_kbackend_raises_no_bare_value_runtime_or_type_errors():
    """Users get one-line ``KBackendError`` subclasses (``errors.py``); a broken invariant is an
    ``InternalError``; an argparse type raises ``argparse.ArgumentTypeError``."""
    assert bare_raises(PACKAGE) == []


def test_the_bare_raise_rule_catches_a_planted_one(tmp_path):
    package = tmp_path / "kbackend"
    (package / "study").mkdir(parents=True)
    (package / "study" / "cells.py").write_text(
        "def f(x):\n    if x:\n        raise ValueError(f'bad {x}')\n")
    (package / "fine.py").write_text("from kbackend.errors import ConfigError\n"
                                     "raise ConfigError('one line')\n")
    assert bare_raises(package) == ["kbackend/study/cells.py:3: raise ValueError(f'bad {x}')"]
