"""What a run's data is called by, one class per kind: a built-in dataset (``BuiltinData``) or
the user's own source (``OwnData``: a path, ``tfds:NAME``, ``FILE.py:FUNCTION``, with a CSV's
label column). ``data_source`` is the one place a name is told apart from a source; what
differs by kind is a member of the class: the study's default target, the command-line flags
that name it, whether a report names it by its content too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from kbackend.data import DATASETS


class DefaultTarget(NamedTuple):
    """A study's default target: ``metric`` (a validation metric) and the ``value`` every cell
    races to (``kbackend.config.Target`` takes both)."""

    metric: str
    value: float


# A target per built-in dataset that seed_mlp reaches with a tuned learning rate within the
# default budget at every default batch size, yet late enough that the optimizers differ.
BUILTIN_TARGETS: dict[str, DefaultTarget] = {
    "digits": DefaultTarget("val_accuracy", 0.95),
    "mnist": DefaultTarget("val_accuracy", 0.97),
    "fashion_mnist": DefaultTarget("val_accuracy", 0.85),
    "mnist1d": DefaultTarget("val_accuracy", 0.6),
    # Near the MNIST-1D paper's MLP figure (68%): what every default cell reaches within its
    # budget (batch 8: 2,475-3,600 steps; measured in docs/study.md), late enough that runs
    # are long against their fixed costs and the seeds of a cell spread over several
    # evaluation intervals, and steps to it halve with the batch up to ~100-200.
    "mnist1d_large": DefaultTarget("val_accuracy", 0.65),
    "synthetic": DefaultTarget("val_accuracy", 0.9),
}


@dataclass(frozen=True)
class DataSource:
    """The data a run names: ``name`` as the user wrote it (``label``: a CSV's label column)."""

    name: str
    label: str | None = None
    # Whether only its content says what it is (a file's name does not): a study's report
    # folder carries its digest.
    by_content: ClassVar[bool] = True

    def default_target(self) -> DefaultTarget | None:
        """The target a study races to unless told: a built-in dataset's own; None for the
        user's data, which never gets another dataset's (``study.targets``)."""
        return None

    def to_flags(self) -> list[str]:
        """The ``kbackend train`` / ``study`` flags that name this data."""
        return ["--data", self.name, *(["--label", self.label] if self.label is not None
                                       else [])]


@dataclass(frozen=True)
class BuiltinData(DataSource):
    """One of ``kbackend.data.DATASETS``."""

    by_content: ClassVar[bool] = False

    def default_target(self) -> DefaultTarget | None:
        return BUILTIN_TARGETS[self.name]

    def to_flags(self) -> list[str]:
        return ["--dataset", self.name]


@dataclass(frozen=True)
class OwnData(DataSource):
    """The user's own data source (``kbackend.data.user.load_source`` reads it)."""


def data_source(name: Any, label: str | None = None) -> DataSource:
    """The source ``name`` (a built-in dataset's name, else the user's source) names."""
    if isinstance(name, str) and name in DATASETS:
        return BuiltinData(name, label)
    return OwnData(str(name), label)
