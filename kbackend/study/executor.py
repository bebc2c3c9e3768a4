"""Run a study: every (optimizer, batch size) cell, a learning-rate search per cell (every rate
with every seed, the grid extended while its best rate sits on an end), the cells' steady step
times measured apart (the time model), a noise-scale measurement; each finished run committed
to the results store.

Re-running the same study skips every run already stored, so an interrupted study resumes where
it stopped. A run's key is its content (``content_identity``): digests of the built model (config,
compiled loss and metrics, the user's source files, the weights it starts from when given) and of
the split arrays, with every option that changes training (optimizer, batch size, rate, seed,
budget, evaluation schedule, target, engine, backend, package versions, device). Names and paths
are not in it: an edited file trains anew, a renamed copy is reused. Runs stored before content
keys (``CONTENT_KEYS`` absent) stay in the store and are never matched.

``StudyRunner`` plans, validates and trains single runs; it composes the collaborators that
take it as one of ``runner_protocol``'s small protocols: ``search.RateSearch`` (a cell's
learning-rate search, with ``populations.Populations``), ``step_times.StepTimeModel`` (the time
model) and ``noise_runs.NoiseMeasurement`` (the noise scale). What it is given: the study's
configuration, a record store (``store.RunStore``: ``ResultStore`` in SQLite, ``MemoryStore``),
an event sink (``runner_protocol.EventSink``) and a run executor (``RunExecutor``: this process
by default, ``stored_only``, Ray's, a test's fake). A cell's figures are ``summaries``'.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from kbackend.adaptive import AutoBatchSize
from kbackend.backends import impl
from kbackend.config import check_metrics
from kbackend.data import Dataset
from kbackend.data.batching import epochs_for_steps, steps_per_epoch
from kbackend.engine_facts import EngineFacts, engine_facts
from kbackend.engines.native import Runs, model_values
from kbackend.envinfo import environment_identity
from kbackend.errors import ConfigError, DataError, InternalError
from kbackend.history import History
from kbackend.io import JsonObject
from kbackend.models import ModelOptions
from kbackend.optim import OptimizerSpec
from kbackend.study.auto_cells import auto_cell_runs, finish_auto_cells, run_auto_cell
from kbackend.study.config import LOCAL_EXECUTOR, StudyConfig
from kbackend.study.noise_runs import NoiseMeasurement
from kbackend.study.ray_executor import require_ray, run_on_ray
from kbackend.study.runner_protocol import (
    EventSink,
    Measured,
    NotStored,
    StudyEvent,
    ignore_events,
    stored_only,
)
from kbackend.study.search import RateSearch
from kbackend.study.sequential import extend_seeds
from kbackend.study.step_times import StepTimeModel
from kbackend.study.store import RunStore, StoredRun, config_key
from kbackend.study.study_record import Cell, NoiseScale, StepTimes, StudyRecord
from kbackend.study.summaries import (
    RunPlan,
    history_from_trajectory,
    plan_from_key_config,
    summarize_run,
)
from kbackend.study.timing import TimeSpent, apply_time_model
from kbackend.study.trust import MIN_VALIDATION_SAMPLES
from kbackend.task import CLASSIFICATION, Task
from kbackend.training import Target, TrainConfig, train, workload_of
from kbackend.workload import Workload

# The version of the run keys' content identity (keys without it predate content keys).
CONTENT_KEYS = 1


# Trains one planned run of a prepared runner and returns its history.
RunExecutor = Callable[["StudyRunner", RunPlan], History]


class StudyRunner:
    """Plans, validates and runs a study against a results store."""

    def __init__(self, config: StudyConfig, store: RunStore | None = None,
                 events: EventSink | None = None, *,
                 run_executor: RunExecutor | None = None) -> None:
        self.config = config
        # Trains one planned run (``execute``'s default: this process, the study's engine);
        # tests pass a fake that returns histories without training.
        self.run_executor = run_executor
        # Where finished runs go and stored ones come from (None: plan and validate only)
        self.store = store
        self.on_event: EventSink = events or ignore_events
        self.dataset: Dataset | None = None
        self.env = environment_identity()
        self.study_id = config_key(config.identity())[:12]  # with content digests: prepare()
        # Digests of the built model and the split arrays (``content_identity``): prepare()
        self.digests: dict[str, str] = {}
        self.executed = 0
        self.time_spent = TimeSpent()
        self.batch_sizes: tuple[int, ...] = ()  # set by prepare()
        self.noise_batches: tuple[int, int] = (0, 0)
        self._native_runs: Runs | None = None
        self._initial_values: dict[int, Any] = {}
        # A user model or dataset (``kbackend.workload``) and the task every run trains.
        self.workload: Workload | None = None
        self.task: Task = CLASSIFICATION
        self._platform: str | None = None  # a stored view's: its Ray workers'

    # -- validation and planning (everything here runs before any training) ------------------

    @property
    def facts(self) -> EngineFacts:
        """The facts of the study's engine (``kbackend.engine_facts``)."""
        return engine_facts(self.config.engine)

    def prepare(self) -> None:
        """Load the data and check every option; raise a ``KBackendError`` on bad input."""
        config = self.config
        engine_facts(config.engine)  # an unknown engine: a one-line error
        config.resolved_target  # noqa: B018 - validated on construction, resolved here
        source = TrainConfig(model=config.model, dataset=config.dataset, data_dir=config.data_dir,
                             validation_fraction=config.validation_fraction, seed=config.seed,
                             label=config.label, image_size=config.image_size,
                             target=config.resolved_target,
                             unsafe_deserialization=config.unsafe_deserialization)
        # Built-in names and the user's sources alike: the task (loss, metric) trains every cell.
        self.workload = workload_of(source)
        self.dataset, self.task = self.workload.dataset, self.workload.task
        check_metrics(replace(source, task=self.task))  # a target the model cannot report
        if len(self.dataset.x_val) < MIN_VALIDATION_SAMPLES:
            raise DataError(f"The validation split has {len(self.dataset.x_val)} samples: a "
                            f"study needs at least {MIN_VALIDATION_SAMPLES} to tell a target "
                            "reached from noise (more data, or a larger validation fraction).")
        # The digests of what every run trains: the model, built once for the study's seed
        # (``ModelSource.digest``), and the data (``Dataset.digest``).
        start = time.perf_counter()
        self.digests = {"model": self.workload.source.digest(self.workload.first_model()),
                        "data": self.dataset.digest()}
        self.time_spent.setup += time.perf_counter() - start
        self.study_id = config_key({**config.identity(), **self.digests})[:12]
        self.batch_sizes = config.resolved_batch_sizes(self.num_train)
        config.check_frontier_steps(self.num_train, self.batch_sizes)
        if config.population == "on" and (not self.facts.compiled_cells
                                           or not impl().supports_populations()):
            raise ConfigError("--population on needs the native engine on JAX (vmap); this "
                              f"study runs the {config.engine} engine on {self.env['backend']}: "
                              "use --population auto or off.")
        self.noise_batches = self._noise_batches() if config.noise_points else (0, 0)
        if config.executor != LOCAL_EXECUTOR:
            require_ray()  # Ray is an optional extra: a one-line error naming it, before training

    def content_identity(self) -> JsonObject:
        """What every stored result of this study is computed from, by content: the model and
        data digests and the split sizes (part of every key: runs, step times, probes)."""
        assert self.dataset is not None and self.digests
        info = self.dataset.info
        return {"content_keys": CONTENT_KEYS, "model": self.digests["model"],
                "data": {"digest": self.digests["data"], "num_train": info.num_train,
                         "num_val": info.num_val, "num_test": info.num_test}}

    def legacy_runs(self) -> int:
        """Runs in the store keyed before content keys: kept, never matched by this code."""
        return sum(1 for record in self.results().records(kind="run")
                   if not isinstance(record.config.get("content_keys"), int))

    def results(self) -> RunStore:
        """The results store (a runner built without one can plan and validate, not run)."""
        if self.store is None:
            raise InternalError("This StudyRunner has no results store to run against.")
        return self.store

    def platform(self) -> str:
        """The platform the cells train on (``"cpu"``, ``"gpu"``, ...): this process's."""
        return self._platform or impl().platform()

    def stored_view(self, platform: str) -> StudyRunner:
        """This prepared runner (its store, data and plans shared) reading only the store:
        ``stored_only`` trains and measures nothing (``NotStored``), for ``platform``'s cells."""
        view = copy.copy(self)
        view.run_executor, view._platform = stored_only, platform
        return view

    @property
    def num_train(self) -> int:
        assert self.dataset is not None
        return len(self.dataset.x_train)

    def _noise_batches(self) -> tuple[int, int]:
        config, sizes = self.config, self.batch_sizes
        small = config.noise_small_batch or min(sizes)
        big = config.noise_big_batch or max(sizes)
        if big <= small:
            big = min(self.num_train, small * 8)
        if big > self.num_train:
            raise ConfigError(
                f"Invalid --noise-batches: the big batch ({big}) is larger than the training split "
                f"({self.num_train} samples). Expected a batch of at most {self.num_train}.")
        if big <= small:
            raise ConfigError(
                f"Cannot measure the noise scale: need a big batch larger than the small one "
                f"({small}) within the training split ({self.num_train} samples)."
            )
        return small, big

    def eval_every(self, batch_size: int) -> int:
        """Steps between evaluations: about ``evals_per_epoch`` per epoch, preferably a divisor of
        the epoch so that every fused call has the same length (one compilation per run)."""
        per_epoch = self.facts.steps_per_epoch(self.num_train, batch_size)
        if self.facts.evaluates_per_epoch:
            return per_epoch
        wanted = max(1, round(per_epoch / self.config.evals_per_epoch))
        divisors = [d for d in range(1, per_epoch + 1) if per_epoch % d == 0]
        nearest = min(divisors, key=lambda d: (abs(math.log(d / wanted)), d))
        return nearest if wanted / 2 <= nearest <= wanted * 2 else wanted

    def full_budget(self, batch_size: int) -> int:
        """The step budget of a run at ``batch_size`` that no pruning has cut."""
        return self.config.step_budget(steps_per_epoch(self.num_train, batch_size))

    def plan(self, optimizer: str, batch_size: int, learning_rate: float,
             budget: int | None = None, seed: int | None = None) -> RunPlan:
        every = self.eval_every(batch_size)
        steps = budget if budget is not None else self.full_budget(batch_size)
        steps = -(-steps // every) * every  # whole evaluation intervals
        fused = (min(self.config.fused_steps or every, steps_per_epoch(self.num_train, batch_size))
                 if self.facts.fuses_steps else 1)
        return RunPlan(optimizer, batch_size, learning_rate, steps, every, fused,
                       self.config.seed if seed is None else seed)

    def run_key_config(self, plan: RunPlan) -> JsonObject:
        """Everything that determines a run's outcome: its store key is a hash of this."""
        config = self.config
        return {
            "kind": "run",
            **self.content_identity(),
            "model_options": ModelOptions(seed=plan.seed).key(),
            "validation_fraction": config.validation_fraction,
            "label": config.label,
            "optimizer": OptimizerSpec(plan.optimizer, plan.learning_rate).to_dict(),
            # an auto cell's run: "auto:MIN:MAX" and its rate scaling (a key of its own)
            "batch_size": plan.batch_label if plan.auto_max else plan.batch_size,
            **({"lr_scaling": plan.lr_scaling} if plan.auto_max else {}),
            "learning_rate": plan.learning_rate,
            "seed": plan.seed,
            "max_steps": plan.max_steps,
            "eval_every": plan.eval_every,
            "fused_steps": plan.fused_steps,
            "target": asdict(config.resolved_target),
            "engine": config.engine,
            # Only when off: the keys of runs stored before the option existed stay valid.
            **({} if config.jit_compile else {"jit_compile": False}),
            **self.env,
        }

    def total_runs(self) -> int:
        """Runs the grid holds before any extension (pruned runs included: they still run, on a
        smaller budget; a pruned rate may skip its last seeds)."""
        return self.config.seeds * sum(len(self.config.learning_rate_grid(o, b))
                                       for o in self.config.optimizers for b in self.batch_sizes) \
            + auto_cell_runs(self)

    # -- running -------------------------------------------------------------------------------

    def run(self) -> StudyRecord:
        """Run (or resume) the whole study; return its cells, runs and noise-scale estimate."""
        if self.dataset is None:
            self.prepare()
        assert self.dataset is not None
        if self.config.executor != LOCAL_EXECUTOR:
            return self._run_on_ray()
        cells: list[Cell] = []
        runs: list[StoredRun] = []  # the added seeds append theirs
        for optimizer in self.config.optimizers:
            for batch_size in self.batch_sizes:
                cell, cell_runs = self.run_cell(optimizer, batch_size)
                runs.extend(cell_runs)
                cells.append(cell)
        elapsed = self.time_spent.clock()
        step_times = self.measure_step_times(cells)
        self.time_spent.step_times += elapsed()
        added = extend_seeds(self, cells, runs, step_times)
        cells = apply_time_model(cells, step_times)
        # The auto cells after the fixed grid (their time model reads its step times)
        auto_cells = [run_auto_cell(self, optimizer)
                      for optimizer in (self.config.optimizers if self.config.adaptive else ())]
        elapsed = self.time_spent.clock()
        noise = self.run_noise(cells)
        self.time_spent.noise += elapsed()
        return self._study(cells, runs, step_times, noise, added, auto_cells)

    def _run_on_ray(self) -> StudyRecord:
        """The same study, its cells run as Ray tasks and their results stored here."""
        results = run_on_ray(self)
        cells, runs, step_times = list(results.cells), list(results.runs), results.step_times
        added = extend_seeds(self, cells, runs, step_times)  # the added seeds here, in the driver
        cells = apply_time_model(cells, step_times)
        return self._study(cells, runs, step_times, results.noise, added, results.auto_cells)

    def _study(self, cells: list[Cell], runs: list[StoredRun],
               step_times: StepTimes | None, noise: NoiseScale | None, added: Any,
               auto_cells: list[tuple[Cell, list[StoredRun]]]) -> StudyRecord:
        """The study's record, its auto cells (none without one) finished against the fixed
        cells' time model."""
        assert self.dataset is not None
        return StudyRecord(
            study_id=self.study_id, config=self.config.to_dict(), env=self.env,
            dataset=self.dataset.info.to_dict(), batch_sizes=tuple(self.batch_sizes),
            cells=cells, runs=runs, digests=self.digests, step_times=step_times, noise=noise,
            added_seeds=added,
            auto_cells=finish_auto_cells(self, [cell for cell, _ in auto_cells], cells),
            auto_runs=[run for _, cell_runs in auto_cells for run in cell_runs])

    @property
    def larger_is_better(self) -> bool:
        """Whether the target metric improves upwards (accuracies) rather than down (losses)."""
        return self.config.resolved_target.direction == "max"

    # -- the collaborators (built on use: a view of this runner gets its own) ------------------

    def run_cell(self, optimizer: str, batch_size: int) -> tuple[Cell, list[StoredRun]]:
        """One cell's learning-rate search and figures, and its runs
        (``search.RateSearch.run_cell``)."""
        return RateSearch(self).run_cell(optimizer, batch_size)

    def measure_step_times(self, cells: list[Cell]) -> StepTimes | None:
        """The time model's seconds per step of ``cells`` (``step_times.StepTimeModel``)."""
        return StepTimeModel(self).measure(cells)

    def run_noise(self, cells: list[Cell]) -> NoiseScale | None:
        """The noise scale along the reference cell (``noise_runs.NoiseMeasurement``)."""
        return NoiseMeasurement(self).run(cells)

    def stored_run(self, plan: RunPlan) -> StoredRun | None:
        """The stored run of ``plan`` (its figures re-derived by this code), or None."""
        stored = self.results().get(config_key(self.run_key_config(plan)))
        if stored is not None:
            stored = self._rederived(stored, plan)
            self.on_event(StudyEvent("skipped", plan=plan, record=stored))
        return stored

    def stored_record(self, key: str) -> StoredRun | None:
        """The stored run under ``key`` with its figures re-derived by this code (as
        ``stored_run``), or None."""
        stored = self.results().get(key)
        return None if stored is None else self._rederived(stored)

    def _rederived(self, stored: StoredRun, plan: RunPlan | None = None) -> StoredRun:
        """``stored`` with the figures this code derives from its trajectory (so stored runs
        follow this code); ``plan``: its plan, else read back from its key's configuration."""
        if not stored.trajectory:
            return stored
        plan = plan or plan_from_key_config(stored.config)
        history = history_from_trajectory(stored.trajectory, stored.result)
        return replace(stored, result={**stored.result, **summarize_run(
            history, plan, self.config.resolved_target, self.num_train).to_json()})

    def run_one(self, plan: RunPlan) -> StoredRun:
        """Run ``plan`` unless the store already has it; return the stored run."""
        stored = self.stored_run(plan)
        if stored is not None:
            return stored
        self.on_event(StudyEvent("start", plan=plan))
        elapsed = self.time_spent.clock()
        history = self.execute(plan)
        self.time_spent.add([history], elapsed())
        return self.store_run(plan, history)

    def store_run(self, plan: RunPlan, history: History) -> StoredRun:
        """Commit one finished run's figures and trajectory; return the stored run."""
        key_config = self.run_key_config(plan)
        result = summarize_run(history, plan, self.config.resolved_target,
                               self.num_train).to_json()
        # ``record``: the RunRecord's set fields (trajectories stored before it hold ``extra``;
        # ``summaries.trajectory_record`` reads either)
        trajectory = {"step": history.step, "loss": history.loss, "time": history.time,
                      "evals": history.evals, "timing": history.timing,
                      "record": history.record.to_dict()}
        store = self.results()
        run = StoredRun.keyed(key_config, "run", self.study_id, self.env["backend"], result,
                              trajectory)
        store.put(run)
        self.executed += 1
        record = store.get(run.key)
        assert record is not None  # just stored (or stored before by another writer)
        self.on_event(StudyEvent("finished", plan=plan, record=record))
        return record

    def train_config(self, plan: RunPlan, *, max_steps: int | None = None,
                     target: Target | bool | None = True, seed: int | None = None) -> TrainConfig:
        config = self.config
        max_steps = plan.max_steps if max_steps is None else max_steps
        # Enough epochs for the budget even when the engine drops each epoch's partial batch.
        per_epoch = steps_per_epoch(self.num_train, plan.batch_size)
        return TrainConfig(
            model=config.model, dataset=config.dataset, data_dir=config.data_dir,
            validation_fraction=config.validation_fraction,
            optimizer=OptimizerSpec(plan.optimizer, plan.learning_rate),
            batch_size=plan.batch_size, epochs=epochs_for_steps(max_steps, per_epoch),
            engine=config.engine, jit_compile=config.jit_compile, max_steps=max_steps,
            eval_every=0 if self.facts.evaluates_per_epoch else plan.eval_every,
            fused_steps=plan.fused_steps,
            target=config.resolved_target if target is True else (target or None),
            seed=plan.seed if seed is None else seed,
            model_options=ModelOptions(seed=plan.seed),
            # A diverged run is a result of the grid (recorded as diverged), not a failed study.
            on_divergence="record", task=self.task, label=config.label,
            image_size=config.image_size,
            unsafe_deserialization=config.unsafe_deserialization,
            # an auto cell's run: the adaptive batch size from MIN (its epochs: MIN's)
            adaptive_batch=AutoBatchSize(plan.batch_size, plan.auto_max) if plan.auto_max
            else None, lr_scaling=plan.lr_scaling or "sqrt",
        )

    def build_model(self, seed: int | None = None) -> Any:
        """A fresh model; the same seed gives the same initial weights on one backend."""
        assert self.workload is not None  # prepared
        return self.workload.build(self.config.seed if seed is None else seed)

    def initial_values(self, seed: int) -> Any:
        """The model values seed ``seed`` initializes (built once per seed: every cell of the
        study starts its runs of that seed from the same weights)."""
        if seed not in self._initial_values:
            start = time.perf_counter()
            self._initial_values[seed] = model_values(self.build_model(seed))
            self.time_spent.setup += time.perf_counter() - start
        return self._initial_values[seed]

    def native_runs(self) -> Runs:
        """The native engine's runs of this study, on one model (built on first use)."""
        if self.run_executor is stored_only:
            raise NotStored
        if self._native_runs is None:
            start = time.perf_counter()
            self._native_runs = Runs(self.build_model(), self.dataset)
            self.time_spent.setup += time.perf_counter() - start
        return self._native_runs

    def execute(self, plan: RunPlan) -> History:
        """Train one run from fresh initial weights (its seed's) and return its history.

        With the native engine every run of a cell reuses the cell's compiled programs
        (``engines.native.Runs``: the rate and the initial weights are runtime arguments), so a
        cell pays its start-up once; other engines build and compile per run (``train``).
        """
        return self.train_here(plan) if self.run_executor is None else self.run_executor(self, plan)

    def train_here(self, plan: RunPlan) -> History:
        """``execute``'s default: train ``plan`` in this process on the study's engine (a run
        executor that wraps it, a test's failing one, calls this)."""
        if self.facts.compiled_cells:
            return self.native_runs().train(self.train_config(plan), self.initial_values(plan.seed))
        return train(self.train_config(plan), dataset=self.dataset,
                     model=self.build_model(plan.seed)).history

    def stored_or_measured(self, kind: str, what: Measured, key_config: JsonObject,
                           plan: RunPlan | None,
                           measure: Callable[[], JsonObject]) -> JsonObject:
        """The stored result of ``key_config``, or ``measure()`` committed to the store as a
        ``kind`` row (with ``what``'s start, finished and skipped progress events)."""
        key = config_key(key_config)
        store = self.results()
        stored = store.get(key)
        if stored is not None:
            self.on_event(StudyEvent("skipped", what, record=stored))
            return stored.result
        if self.run_executor is stored_only:
            raise NotStored
        self.on_event(StudyEvent("start", what, plan=plan))
        result = measure()
        run = StoredRun.keyed(key_config, kind, self.study_id, self.env["backend"], result)
        store.put(run)
        self.on_event(StudyEvent("finished", what, record=store.get(key)))
        return result

