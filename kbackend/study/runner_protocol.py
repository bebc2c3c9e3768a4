"""What the study's collaborators (``search``, ``populations``, ``timing``, ``noise_runs``,
``sequential``, ``frontier``) use of the runner that composes them (``executor.StudyRunner``),
as a protocol: they take the runner without importing it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from kbackend.data import Dataset
from kbackend.engines.native import Runs
from kbackend.history import History
from kbackend.study.config import StudyConfig
from kbackend.study.store import RunStore
from kbackend.study.summaries import RunPlan
from kbackend.study.timing import TimeSpent
from kbackend.task import Task
from kbackend.training import Target, TrainConfig


class NotStored(Exception):
    """Raised where a runner that only reads the store (``stored_only``) would have to train or
    measure."""


def stored_only(runner: Any, plan: RunPlan) -> History:
    """The run executor of a runner that only reads the store (the Ray driver's view of the
    cells its workers train): it trains nothing."""
    raise NotStored


class StudyRunnerLike(Protocol):
    """A prepared study runner: its configuration, data, store, clocks and run plumbing."""

    config: StudyConfig
    store: RunStore | None
    dataset: Dataset | None
    task: Task  # the loss the runs train (the noise scale's gradients take it)
    env: dict[str, Any]
    study_id: str
    batch_sizes: tuple[int, ...]
    noise_batches: tuple[int, int]
    time_spent: TimeSpent
    on_event: Callable[..., None]

    @property
    def num_train(self) -> int: ...

    @property
    def larger_is_better(self) -> bool: ...

    def platform(self) -> str: ...

    def full_budget(self, batch_size: int) -> int: ...

    def plan(self, optimizer: str, batch_size: int, learning_rate: float,
             budget: int | None = None, seed: int | None = None) -> RunPlan: ...

    def run_key_config(self, plan: RunPlan) -> dict[str, Any]: ...

    def content_identity(self) -> dict[str, Any]: ...

    def train_config(self, plan: RunPlan, *, max_steps: int | None = None,
                     target: Target | bool | None = True,
                     seed: int | None = None) -> TrainConfig: ...

    def build_model(self, seed: int | None = None) -> Any: ...

    def initial_values(self, seed: int) -> Any: ...

    def native_runs(self) -> Runs: ...

    def run_one(self, plan: RunPlan) -> dict[str, Any]: ...

    def stored_run(self, plan: RunPlan) -> dict[str, Any] | None: ...

    def stored_record(self, key: str) -> dict[str, Any] | None: ...

    def store_run(self, plan: RunPlan, history: History) -> dict[str, Any]: ...

    def stored_or_measured(self, kind: str, event: str, key_config: dict[str, Any],
                           plan: RunPlan | None,
                           measure: Callable[[], dict[str, Any]]) -> dict[str, Any]: ...
