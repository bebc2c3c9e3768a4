"""The study's cells as Ray tasks: ``kbackend study --executor ray[:ADDRESS]`` (docs/cluster.md).

The driver (this process) plans and stores; Ray tasks train. Each cell whose runs are not all
stored becomes one task asking for ``cell_cpus`` CPUs and ``cell_gpus`` GPUs. The task gets the
driver's stored records of that cell (never the store), runs the cell with the same
``StudyRunner`` the local executor uses, and sends back the records it made. The driver alone
writes them to the store, as each cell finishes, and then reads the cell back from the store
exactly as a resumed local study would (``StudyRunner.stored_view``, whose run executor trains
nothing): the cells, the report and resumption are the local executor's. A task whose worker
dies is retried by Ray (``CELL_RETRIES``); what the lost attempt made never reached the store,
and a record already stored is never stored again (``ResultStore.put``). The step-time
measurement and the noise scale run as one task each after the cells, on the same kind of
worker.

Workers get the driver's backend and kbackend settings (``worker_env``: ``KERAS_BACKEND``,
``KBACKEND_*``, JAX / XLA flags) through Ray's ``runtime_env``, since the backend is chosen
before Keras is imported. Without an address a local Ray instance is started, bound to
127.0.0.1, and shut down at the end; a running cluster is joined and left running.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from kbackend.backends import impl
from kbackend.envinfo import environment_identity
from kbackend.errors import ConfigError, InternalError, KBackendError
from kbackend.study.auto_cells import run_auto_cell
from kbackend.study.config import LOCAL_EXECUTOR, RAY_EXTRA, StudyConfig
from kbackend.study.runner_protocol import NotStored, StudyEvent, ignore_events
from kbackend.study.store import MemoryStore, StoredRun, config_key
from kbackend.study.study_record import Cell, NoiseScale, StepTimes

CELL_RETRIES = 3  # attempts after the first when a task's worker (or its node) is lost
# Environment variables a worker takes from the driver: the backend and kbackend's settings.
FORWARDED_PREFIXES = ("KBACKEND_", "KERAS_", "JAX_", "XLA_")
FORWARDED_NAMES = ("PYTHONHASHSEED", "TF_CPP_MIN_LOG_LEVEL", "TF_XLA_FLAGS",
                   "TF_ENABLE_ONEDNN_OPTS")
# A test's injected fault: the first task that finds this file absent creates it and kills its
# own worker process right after the cell's first run is finished (not forwarded as such: the
# driver passes it to each task).
CRASH_ENV = "KBACKEND_STUDY_RAY_CRASH"
GPU_MEMORY_SHARE = 0.9  # of a GPU's memory, split between the cells packed on it


def require_ray() -> Any:
    """The ``ray`` module, or a one-line ``ConfigError`` naming the extra that installs it."""
    try:
        import ray  # deferred: Ray is an optional extra (kbackend[ray])
    except ImportError:
        raise ConfigError(f"--executor ray needs Ray, which is not installed: pip install "
                          f"'{RAY_EXTRA}' (or use --executor local).") from None
    return ray


def worker_env(backend: str) -> dict[str, str]:
    """The environment variables every worker gets: the driver's backend and kbackend,
    Keras, JAX and XLA settings (``CRASH_ENV`` excepted: it is a per-task argument)."""
    env = {name: value for name, value in os.environ.items()
           if (name.startswith(FORWARDED_PREFIXES) or name in FORWARDED_NAMES)
           and name != CRASH_ENV}
    env["KERAS_BACKEND"] = backend
    return env


def start_ray(config: StudyConfig, backend: str) -> bool:
    """Connect to ``config``'s Ray cluster, or start a local instance on 127.0.0.1 (``workers``
    CPUs; 0: one per core); True if this call started or joined it (and should shut it down).
    A Ray already initialized in this process is used as it is."""
    ray = require_ray()
    if ray.is_initialized():
        return False
    options: dict[str, Any] = {
        "runtime_env": {"env_vars": worker_env(backend)},
        "logging_level": logging.WARNING,
        "log_to_driver": False,  # workers' framework log lines; task errors still come back
    }
    with warnings.catch_warnings():
        # Ray starts its processes with fork + exec (subprocess), which JAX's warning about
        # fork in a multithreaded process does not concern.
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called",
                                category=RuntimeWarning)
        if config.ray_address is None:
            ray.init(num_cpus=config.workers or os.cpu_count(), include_dashboard=False,
                     _node_ip_address="127.0.0.1", **options)
        else:
            ray.init(address=config.ray_address, **options)
    return True


def cell_resources(config: StudyConfig, ray: Any, backend: str) -> dict[str, Any]:
    """What each task asks Ray for: ``num_cpus``, ``num_gpus`` (``cell_gpus``; None: one GPU
    where the cluster has GPUs, else none) and, for a fraction of a GPU, the environment that
    makes the framework take only its share of the GPU's memory."""
    gpus = config.cell_gpus
    if gpus is None:
        gpus = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
    env = worker_env(backend)
    if 0 < gpus < 1:
        # JAX takes 75% of a GPU's memory when it starts and TensorFlow all of it.
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{GPU_MEMORY_SHARE * gpus:.3f}")
        env.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    return {"num_cpus": config.cell_cpus, "num_gpus": gpus, "max_retries": CELL_RETRIES,
            "retry_exceptions": False, "runtime_env": {"env_vars": env}}


# -- the task side: no store, the driver's records in memory (``store.MemoryStore``) -------------

_WORKER_RUNNERS: dict[str, Any] = {}  # one prepared runner per worker process


def _worker_runner(runner_class: type, config: StudyConfig) -> Any:
    # A worker's later tasks of the same study reuse its data and compiled programs, as the
    # local executor's one runner does.
    key = config_key(config.to_dict())
    if key not in _WORKER_RUNNERS:
        _WORKER_RUNNERS.clear()
        runner = runner_class(config, None)
        runner.prepare()
        _WORKER_RUNNERS[key] = runner
    return _WORKER_RUNNERS[key]


@dataclass(frozen=True)
class WorkerIdentity:
    """What a worker's runs are keyed by (``environment_identity``) and its platform."""

    env: dict[str, Any]
    platform: str


def worker_identity() -> WorkerIdentity:
    """This worker's ``WorkerIdentity``."""
    return WorkerIdentity(environment_identity(), impl().platform())


@dataclass(frozen=True)
class TaskOutput:
    """What a task sends back: the phase's result (a cell with its runs' keys, the step
    times, the noise scale) and the records it made."""

    result: Any
    records: list[StoredRun]


@dataclass(frozen=True)
class CrashAfterFirstRun:
    """The injected fault of a test (``CRASH_ENV``): the first task that finds ``marker``
    absent creates it and kills its own worker once a run has finished."""

    marker: str

    def __call__(self, event: StudyEvent) -> None:
        if event.phase == "finished" and event.what == "run" and not os.path.exists(self.marker):
            Path(self.marker).touch()
            os._exit(1)  # the injected fault: this worker dies mid-cell


def run_phase(runner_class: type, config: StudyConfig, phase: str, cell: tuple[str, int] | None,
              cells: list[Cell] | None, records: list[StoredRun],
              crash: str | None = None) -> TaskOutput:
    """One task: a cell (``phase="cell"``), an optimizer's auto cell (``"auto"``, ``cell``'s
    batch size unused), the step times or the noise scale of ``cells``,
    run on this worker by a ``runner_class`` (the driver's ``StudyRunner``) against ``records``
    in memory (``MemoryStore``)."""
    runner = _worker_runner(runner_class, config)
    store = MemoryStore(records)
    runner.store, runner.executed = store, 0
    runner.on_event = CrashAfterFirstRun(crash) if crash else ignore_events
    if phase in ("cell", "auto"):
        assert cell is not None
        found, runs = (runner.run_cell(*cell) if phase == "cell"
                       else run_auto_cell(runner, cell[0]))
        result: Any = (found, [r.key for r in runs])
    elif phase == "steptime":
        result = runner.measure_step_times(cells or [])
    elif phase == "noise":
        result = runner.run_noise(cells or [])
    else:
        raise InternalError(f"Unknown phase {phase!r}.")
    return TaskOutput(result, store.added)


# -- the driver side ------------------------------------------------------------------------------

class RayStudy:
    """Runs a prepared ``StudyRunner``'s study on Ray; see the module docstring."""

    def __init__(self, runner: Any, ray: Any) -> None:
        self.runner, self.ray = runner, ray
        self.config = replace(runner.config, executor=LOCAL_EXECUTOR, workers=0)  # the tasks'
        self.resources = cell_resources(runner.config, ray, runner.env["backend"])
        # Resources in the decorator, not .options(): a GPU task then gets a fresh worker
        # process (Ray's max_calls=1), so a framework started on one task's GPU never runs
        # another task given another GPU.
        self.task = ray.remote(**self.resources)(run_phase)
        self.crash = os.environ.get(CRASH_ENV)
        identity = ray.get(ray.remote(**self.resources)(worker_identity).remote())
        # Runs are keyed by the device that trains them: the workers', not this process's.
        runner.env = identity.env
        self.stored = runner.stored_view(identity.platform)
        self.runner_class = type(runner)

    def attempt(self, action: Callable[[], Any],
                fresh: frozenset[str] | set[str] = frozenset()) -> tuple[bool, Any]:
        """(True, ``action()``'s result) when the store holds all it needs, its progress
        events passed on (the ``fresh`` records' as finished); else (False, None), silently."""
        events: list[StudyEvent] = []

        def buffer(event: StudyEvent) -> None:
            record = event.record
            if event.phase == "skipped" and record is not None and record.key in fresh:
                event = replace(event, phase="finished")
            events.append(event)

        self.stored.on_event = buffer
        try:
            result = action()
        except NotStored:
            return False, None
        for event in events:
            self.runner.on_event(event)
        return True, result

    def commit(self, output: TaskOutput) -> set[str]:
        """Store a task's records (the ones not stored yet, as finished now: the driver's
        clock); return their keys."""
        fresh = set()
        for run in output.records:
            if self.runner.store.put(replace(run, finished_at=time.time())):
                fresh.add(run.key)
                self.runner.executed += int(run.kind == "run")
        return fresh

    def cell_records(self, optimizer: str, batch_size: int | str) -> list[StoredRun]:
        """The stored runs and population probe of one cell (an auto cell's batch size is its
        label, ``auto:MIN:MAX``): what its task may skip."""
        def of_cell(run: StoredRun) -> bool:
            name = run.config.get("optimizer")
            name = name.get("name") if isinstance(name, dict) else name
            return name == optimizer and run.config.get("batch_size") == batch_size

        # Any study's (a run's key is its configuration, whichever study stored it).
        store = self.runner.store
        return [r for kind in ("run", "population_probe") for r in store.records(kind=kind)
                if of_cell(r)]

    def get(self, ref: Any, what: str) -> TaskOutput:
        exceptions = self.ray.exceptions
        try:
            return self.ray.get(ref)
        except exceptions.RayTaskError as error:
            if isinstance(error.cause, KBackendError):
                raise error.cause from None
            raise
        except exceptions.RayError as error:
            raise KBackendError(
                f"Ray lost {what} {CELL_RETRIES + 1} times ({type(error).__name__}); the cells "
                "finished so far are stored: run the study again to resume.") from None

    def run_cell_tasks(self, phase: str, keys: list[tuple[str, Any]],
                       from_store: Callable[[tuple[str, Any]], Any]
                       ) -> list[tuple[Cell, list[StoredRun]]]:
        """Each cell of ``keys`` (optimizer, batch size or auto label), in their order, from the
        store (``from_store``), else as one ``phase`` task given the cell's stored records;
        stored here as each task finishes."""
        cells: dict[tuple[str, Any], tuple[Cell, list[StoredRun]]] = {}
        pending: dict[Any, tuple[str, Any]] = {}
        for key in keys:
            done, cell = self.attempt(partial(from_store, key))
            if done:
                cells[key] = cell  # every run stored: not submitted
            else:
                pending[self.task.remote(self.runner_class, self.config, phase, key, None,
                                         self.cell_records(*key), self.crash)] = key
        try:
            while pending:
                [ref], _ = self.ray.wait(list(pending), num_returns=1)
                key = pending.pop(ref)
                output = self.get(ref, f"cell {key[0]} B={key[1]}")
                fresh = self.commit(output)
                done, cell = self.attempt(partial(from_store, key), fresh)
                if not done:  # a worker keyed differently (another device): its own cell
                    found, run_keys = output.result
                    cell = found, [_stored(self.runner.store, k) for k in run_keys]
                cells[key] = cell
        finally:
            for ref in pending:
                self.ray.cancel(ref, force=True)
        return [cells[key] for key in keys]

    def run_auto_cells(self) -> list[tuple[Cell, list[StoredRun]]]:
        """Each optimizer's auto cell (``--batch-sizes ...,auto``) as one task, as the fixed
        cells are; none without one."""
        config = self.runner.config
        bounds = config.auto_bounds
        if bounds is None:
            return []
        keys = [(o, str(bounds)) for o in config.optimizers]  # "auto:MIN:MAX", as runs are keyed
        return self.run_cell_tasks("auto", keys, lambda key: run_auto_cell(self.stored, key[0]))

    def measure(self, phase: str, action: Callable[[], Any], cells: list[Cell]) -> Any:
        """The step times or the noise scale: from the store, else one task, stored here."""
        done, result = self.attempt(action)
        if done:
            return result
        ref = self.task.remote(self.runner_class, self.config, phase, None, cells, [], None)
        output = self.get(ref, phase)
        done, result = self.attempt(action, self.commit(output))
        return result if done else output.result

    def run(self) -> RayResults:
        keys = [(o, b) for o in self.runner.config.optimizers for b in self.runner.batch_sizes]
        searched = self.run_cell_tasks("cell", keys, lambda key: self.stored.run_cell(*key))
        cells = [cell for cell, _ in searched]
        runs = [run for _, cell_runs in searched for run in cell_runs]
        step_times = self.measure("steptime", lambda: self.stored.measure_step_times(cells), cells)
        noise = self.measure("noise", lambda: self.stored.run_noise(cells), cells)
        return RayResults(cells, runs, step_times, noise, self.run_auto_cells())


def _stored(store: Any, key: str) -> StoredRun:
    """The run a worker's output just committed under ``key`` (missing: a broken invariant)."""
    run = store.get(key)
    if run is None:
        raise InternalError(f"run {key} was committed by a Ray worker but is not in the store")
    return run


class RayResults(NamedTuple):
    """What the Ray tasks made: the fixed cells and their runs, the step times, the noise scale,
    and the auto cells (each with its runs, which ``finish_auto_cells`` completes on the
    driver once the time model is known)."""

    cells: list[Cell]
    runs: list[StoredRun]
    step_times: StepTimes | None
    noise: NoiseScale | None
    auto_cells: list[tuple[Cell, list[StoredRun]]]


def run_on_ray(runner: Any) -> RayResults:
    """The prepared ``runner``'s cells, runs, step times, noise scale and auto cells, trained on
    Ray and stored in ``runner.store`` (the local executor's results and store, made
    elsewhere)."""
    ray = require_ray()
    started = start_ray(runner.config, runner.env["backend"])
    try:
        return RayStudy(runner, ray).run()
    finally:
        if started:
            ray.shutdown()
