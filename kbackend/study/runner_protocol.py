"""What the study's collaborators use of the runner that composes them (``executor.StudyRunner``),
as small protocols (they take the runner without importing it, and each takes only what it
uses), and the study's progress events with the sink they go to.

- ``MeasureRunner``: planning, the run keys and the stored measurements (``frontier``,
  ``step_times``, ``noise_runs``);
- ``CellRunner``: that and single runs from the store or trained (``search``, ``populations``,
  ``auto_cells``, the added seeds' rounds in ``sequential``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from kbackend.data import Dataset
from kbackend.engines.native import Runs
from kbackend.history import History
from kbackend.io import JsonObject
from kbackend.study.config import StudyConfig
from kbackend.study.store import RunStore, StoredRun
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


# What a study stores besides runs (``stored_or_measured``): the measurements' event names
Measured = Literal["noise", "timing", "probe", "confirm", "frontier"]


@dataclass(frozen=True)
class StudyEvent:
    """One step of a study's progress. ``phase``: a run or measurement of kind ``what`` is
    started, finished (trained or measured now) or skipped (reused from the store; ``record``
    is the stored one); ``"extend"``: ``runs`` more runs than planned (a grid extension, a
    re-run, an added seed); ``"pruned"``: ``runs`` planned runs no longer needed."""

    phase: Literal["start", "finished", "skipped", "extend", "pruned"]
    what: Literal["run", "population"] | Measured = "run"
    plan: RunPlan | None = None
    record: StoredRun | None = None
    runs: int = 0


class EventSink(Protocol):
    """Where a study's progress events go: the progress bar (``pipeline._ProgressEvents``), a
    Ray task's fault injection, a test's recorder."""

    def __call__(self, event: StudyEvent, /) -> None: ...


def ignore_events(event: StudyEvent) -> None:
    """The sink of a runner nobody watches."""


class MeasureRunner(Protocol):
    """A prepared study's plans, run keys, models and stored measurements."""

    config: StudyConfig
    dataset: Dataset | None
    task: Task  # the loss the runs train (the noise scale's gradients take it)
    env: dict[str, Any]
    batch_sizes: tuple[int, ...]
    noise_batches: tuple[int, int]
    time_spent: TimeSpent

    @property
    def num_train(self) -> int: ...

    def plan(self, optimizer: str, batch_size: int, learning_rate: float,
             budget: int | None = None, seed: int | None = None) -> RunPlan: ...

    def run_key_config(self, plan: RunPlan) -> JsonObject: ...

    def content_identity(self) -> JsonObject: ...

    def train_config(self, plan: RunPlan, *, max_steps: int | None = None,
                     target: Target | bool | None = True,
                     seed: int | None = None) -> TrainConfig: ...

    def build_model(self, seed: int | None = None) -> Any: ...

    def initial_values(self, seed: int) -> Any: ...

    def native_runs(self) -> Runs: ...

    def stored_or_measured(self, kind: str, what: Measured, key_config: JsonObject,
                           plan: RunPlan | None,
                           measure: Callable[[], JsonObject]) -> JsonObject: ...


class CellRunner(MeasureRunner, Protocol):
    """A prepared study's single runs: reused from its store or trained, with their events."""

    store: RunStore | None
    study_id: str
    on_event: EventSink

    @property
    def larger_is_better(self) -> bool: ...

    def platform(self) -> str: ...

    def full_budget(self, batch_size: int) -> int: ...

    def run_one(self, plan: RunPlan) -> StoredRun: ...

    def stored_run(self, plan: RunPlan) -> StoredRun | None: ...

    def stored_record(self, key: str) -> StoredRun | None: ...

    def store_run(self, plan: RunPlan, history: History) -> StoredRun: ...
