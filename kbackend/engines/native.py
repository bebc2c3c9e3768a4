"""The native engine: K train steps per compiled device call, on JAX (optax) or TF (Keras).

The compiled loops live behind the backend boundary (``impl().native_trainer``:
``backends/jax/native.py``, ``backends/tensorflow/native.py``); the epoch loop is
``kbackend.engines.loop``'s. The training split is copied to the device once and each step
gathers its batch there.

``fused_steps=0`` (``--fused-steps auto``) picks K by measurement: ``probe_fused_steps`` times one
short epoch per candidate on the model (its weights put back after each) and keeps the fastest
(its figures go to ``history.record.fused_steps_probe``; the probe runs before the clock
starts). The answer is kept per machine, model and batch size (``cached_probe_fused_steps``), so
it is measured once.
Where the backend writes the K steps out (conv models on a CPU, ``capabilities.unrolls_its_loop``)
compile time grows with K, so the candidates stop at ``capabilities.MAX_UNROLLED_STEPS``, and
so does an explicit K (``loop.steps_per_call``; ``history.record.fused_steps_asked`` keeps it).

``Runs`` trains many runs of one model on one set of compiled programs (the study's cells): the
learning rate and the initial values are runtime arguments of the compiled step, so a cell
compiles once however many rates and seeds it tries.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from kbackend.backend_choice import keras as import_keras
from kbackend.backends import adaptive as adaptive_backend
from kbackend.backends import capabilities, impl
from kbackend.config import TrainConfig
from kbackend.data import batching, check_batch_size
from kbackend.engines import adaptive, loop
from kbackend.engines.keras_fit import build_optimizer, compile_model
from kbackend.engines.plan import TrainPlan
from kbackend.errors import ConfigError
from kbackend.hardware.measure import FUSED_STEPS, remembered, time_interleaved
from kbackend.history import History
from kbackend.task import CLASSIFICATION, Task

PROBE_CANDIDATES = (1, 8, 32)


def train(model: Any, dataset: Any, plan: TrainPlan, config: TrainConfig,
          reporter: Any = None) -> History:
    """Train ``model`` in place with fused native steps as ``plan`` says; the history in
    kbackend's format."""
    spec, probe = plan.optimizer, None
    if plan.fused_steps == 0:  # auto: measure a few K, weights put back after (once per machine)
        fused_steps, probe = cached_probe_fused_steps(model, dataset, spec, plan.batch_size,
                                                      config.seed, config.jit_compile,
                                                      config.task)
        if config.eval_every:  # calls end on the evaluation points the user asked for
            fused_steps = max(d for d in range(1, min(fused_steps, config.eval_every) + 1)
                              if config.eval_every % d == 0)
        plan = plan.with_fused_steps(fused_steps)
    # Compiled for evaluate/predict/save afterwards; the TF loop trains with this optimizer.
    compile_model(model, spec, config)
    build_optimizer(model)
    with impl().compilation_counter() as compiled:
        trainer = impl().native_trainer(model, spec, dataset, jit_compile=config.jit_compile,
                                        task=config.task)
        history = loop.run(trainer, plan, config, reporter,
                           history=loop.native_history(spec, fused_steps_probe=probe))
        # The test split on the trainer's compiled evaluator: Keras's evaluate would trace and
        # compile a program of its own (on TensorFlow an XLA compile of several seconds).
        history.test = dict(zip(("test_loss", f"test_{config.task.metric}"),
                                trainer.evaluate_test(), strict=True))
    history.record.xla_programs = compiled  # the run's compilations, evaluation included
    return history


def plan_of(config: TrainConfig, dataset: Any, optimizer: Any = None) -> TrainPlan:
    """The native engine's plan of ``config`` on ``dataset`` (``optimizer``: instead of
    ``config.optimizer``), for callers that skip ``training.train``'s checks (``Runs``,
    tests)."""
    return TrainPlan.of(config, len(dataset.x_train), drops_last_batch=True, optimizer=optimizer)


class Runs:
    """Many native runs of one model architecture on one dataset, each program compiled once.

    A study trains one model with many learning rates and seeds per (optimizer, batch size).
    ``train(config, values)`` resets the trainer of that cell (``ReusableTrainer.reset``: the
    initial values and the learning rate are runtime arguments of the compiled step) instead of
    building a model, a trainer and their programs for every run. A run here equals the same
    ``kbackend.training.train`` run of the native engine (same batches, steps, stopping and test
    evaluation; tests/test_native_runs.py); only the Keras model is not compiled. The cells'
    trainers are kept (they share one device copy of the data), so the study's step-time model
    times the very programs the runs trained with (``step_timer``).
    """

    def __init__(self, model: Any, dataset: Any) -> None:
        self.model, self.dataset = model, dataset
        self._trainers: dict[tuple, Any] = {}

    @property
    def trainers_built(self) -> int:
        return len(self._trainers)

    def trainer(self, config: TrainConfig, plan: TrainPlan | None = None) -> Any:
        """The trainer (and its compiled programs) that runs of ``config``'s cell share
        (``plan``: ``config``'s, if already made)."""
        if config.fused_steps < 1:
            raise ConfigError("Runs need an explicit fused_steps (>= 1), not 'auto'.")
        check_batch_size(config.batch_size, len(self.dataset.x_train))
        spec = (plan or self.plan(config)).optimizer
        # A schedule's rate is traced into the program (and a step count into its horizon), so
        # only a constant rate is shared between runs of different rates and budgets.
        constant = spec.schedule == "constant" and spec.warmup_steps == 0
        shared = replace(spec, learning_rate=1.0, decay_steps=None) if constant else spec
        key = (shared, config.batch_size, config.fused_steps, config.jit_compile, config.task)
        if key not in self._trainers:
            self._trainers[key] = impl().native_trainer(self.model, spec, self.dataset,
                                                        jit_compile=config.jit_compile,
                                                        task=config.task)
        return self._trainers[key]

    def plan(self, config: TrainConfig) -> TrainPlan:
        """The plan of a run of ``config`` on this dataset (the native engine's)."""
        return plan_of(config, self.dataset)

    def adaptive_trainer(self, config: TrainConfig, plan: TrainPlan) -> Any:
        """The ``AdaptiveTrainer`` that the ``--batch-size auto`` runs of ``config``'s optimizer
        share: each batch size's programs compiled once for all of them (the rate and the
        initial values are runtime state, as in ``trainer``)."""
        adaptive.check_adaptive_options(config)  # a constant rate: only then is it shared
        spec = plan.optimizer
        key = ("adaptive", replace(spec, learning_rate=1.0, decay_steps=None),
               config.jit_compile, config.task)
        if key not in self._trainers:
            self._trainers[key] = adaptive_backend().AdaptiveTrainer(
                self.model, spec, self.dataset, jit_compile=config.jit_compile, task=config.task,
                measure_every=adaptive.MEASURE_EVERY)
        return self._trainers[key]

    def train(self, config: TrainConfig, values: Any, reporter: Any = None) -> History:
        """One run of ``config`` (native engine, explicit ``fused_steps``; a growing batch with
        ``config.adaptive_batch``) from the model values ``values`` (``(trainable,
        non_trainable)`` arrays, see ``model_values``); its history, test metrics included. A
        non-finite test loss is recorded as ``record.diverged``."""
        start, built_before = time.perf_counter(), self.trainers_built
        plan = self.plan(config)
        auto = config.adaptive_batch is not None
        trainer = self.adaptive_trainer(config, plan) if auto else self.trainer(config, plan)
        setup = time.perf_counter() - start if self.trainers_built > built_before else 0.0
        trainer.reset(values, plan.optimizer.learning_rate)
        if auto:
            trainer.take_noise_norms()  # none of an earlier run's
            history = adaptive.train(self.model, self.dataset, plan, config, reporter,
                                     trainer=trainer)
        else:
            history = loop.run(trainer, plan, config, reporter,
                               history=loop.native_history(plan.optimizer))
            test_loss, test_metric = trainer.evaluate_test()
            history.test = {"test_loss": test_loss, f"test_{config.task.metric}": test_metric}
        history.timing["setup_time"] = setup  # building this cell's trainer (its first run only)
        history.record.trainers_built = self.trainers_built
        history.timing["wall_time"] = time.perf_counter() - start
        loop.note_test_divergence(history)
        return history

    # -- populations: a cell's runs as one vmapped program ------------------------------------

    def population_trainer(self, configs: list[TrainConfig],
                           plan: TrainPlan | None = None) -> Any:
        """The population trainer (compiled once) for ``configs``: runs of one cell that differ
        only in learning rate and seed (checked), on a constant learning rate (``plan``: the
        first run's, if already made)."""
        first = configs[0]
        cell = self._cell_of(first)
        for config in configs[1:]:
            if self._cell_of(config) != cell:
                raise ConfigError("A population's runs must share everything but the learning "
                                  "rate and the seed.")
        spec = (plan or self.plan(first)).optimizer
        if spec.schedule != "constant" or spec.warmup_steps:
            raise ConfigError("A population needs a constant learning rate (a schedule's rate "
                              "is traced into the program).")
        check_batch_size(first.batch_size, len(self.dataset.x_train))
        key = ("population", replace(spec, learning_rate=1.0, decay_steps=None),
               first.batch_size, first.fused_steps, len(configs), first.task)
        if key not in self._trainers:
            self._trainers[key] = impl().population_trainer(self.model, spec, self.dataset,
                                                            len(configs), task=first.task)
        return self._trainers[key]

    @staticmethod
    def _cell_of(config: TrainConfig) -> TrainConfig:
        return replace(config, optimizer=replace(config.optimizer, learning_rate=1.0), seed=0,
                       model_options=replace(config.model_options, seed=0))

    def train_population(self, configs: list[TrainConfig], values: list[Any],
                         censor: Any = None) -> list[History]:
        """Runs ``configs`` (one cell, see ``population_trainer``) from ``values`` (one
        ``(trainable, non_trainable)`` per run) as one vmapped population: one history per run,
        equal to ``train(config, values)``'s up to float rounding (``loop.run_population``).
        Each history's ``record.population`` names its size and index; the timing is the
        population's (one clock: count a population's training time once). ``censor``: see
        ``loop.run_population``."""
        start, built_before = time.perf_counter(), self.trainers_built
        plan = self.plan(configs[0])
        trainer = self.population_trainer(configs, plan)
        setup = time.perf_counter() - start if self.trainers_built > built_before else 0.0
        trainer.reset(values, [c.optimizer.learning_rate for c in configs])
        histories = loop.run_population(trainer, plan, configs, censor)
        for index, history in enumerate(histories):
            record = history.record
            record.engine, record.decay_steps = "native", plan.optimizer.decay_steps
            record.trainers_built = self.trainers_built
            record.population = {"members": len(configs), "index": index}
            history.timing["wall_time"] = time.perf_counter() - start
            history.timing["setup_time"] = setup
            loop.note_test_divergence(history)
        return histories

    def probe_population(self, configs: list[TrainConfig], values: list[Any], steps: int,
                         repeats: int = 3, min_speedup: float = 1.0) -> dict[str, Any]:
        """Whether ``configs`` train faster as one population than one after another, measured.

        Both programs are compiled and warmed up, then timed on ``steps`` steps (whole calls of
        K) in ``repeats`` interleaved rounds (``measure.time_interleaved``): the population
        (every member at once) against one member alone, whose time x the number of members is
        the sequential path's (members of a cell have identical shapes, so each costs the
        same). ``path`` is ``"population"`` when the sequential median is at least
        ``min_speedup`` times the population's. Where the backend has no population trainer the
        answer is ``"sequential"`` with the reason.
        """
        if not impl().supports_populations():
            return {"path": "sequential", "members": len(configs),
                    "reason": "this backend has no population trainer (JAX's vmap)"}
        population = self.population_trainer(configs)
        population.reset(values, [c.optimizer.learning_rate for c in configs])
        n_train, first = len(self.dataset.x_train), configs[0]
        run_population, timed_steps = self._timed_calls(population, first, np.stack([
            batching.epoch_batches(n_train, first.batch_size, c.seed, 0) for c in configs]), steps)
        timings = time_interleaved({"population": run_population,
                                    "one_member": self.step_timer(first, values[0], steps)},
                                   repeats, wait=lambda value: value)  # first calls allocate
        members, together, one = len(configs), timings["population"], timings["one_member"]
        speedup = members * one.median_s / together.median_s
        return {"path": "population" if speedup >= min_speedup else "sequential",
                "min_speedup": min_speedup, "members": members, "steps": timed_steps,
                "repeats": repeats, "population_s": list(together.times),
                "sequential_s": [members * t for t in one.times], "speedup": speedup,
                "cv": {name: timing.cv for name, timing in timings.items()}}

    def step_timer(self, config: TrainConfig, values: Any, steps: int) -> Callable[[], None]:
        """A callable that trains ``steps`` steps (whole calls of ``config.fused_steps``) of
        ``config``'s cell on its compiled program, from ``values`` at ``config``'s rate, and
        waits for them: the steady cost of that cell's steps, nothing compiled."""
        trainer = self.trainer(config)
        trainer.reset(values, config.optimizer.learning_rate)
        rows = batching.epoch_batches(len(self.dataset.x_train), config.batch_size, config.seed, 0)
        return self._timed_calls(trainer, config, rows, steps)[0]

    def _timed_calls(self, trainer: Any, config: TrainConfig, epoch_rows: np.ndarray,
                     steps: int) -> tuple[Callable[[], None], int]:
        """A callable that runs whole calls of ``config.fused_steps`` (``steps`` or a few more)
        of ``trainer`` on ``epoch_rows``, compiled first, and waits for them; the steps it runs."""
        fused = loop.steps_per_call(trainer, config.fused_steps)
        rows = trainer.put_epoch(epoch_rows)
        per_epoch = batching.steps_per_epoch(len(self.dataset.x_train), config.batch_size)
        trainer.compile(fused, rows)
        # Consecutive calls through the epoch, wrapping before a call would run past its end.
        starts = [(index * fused) % (per_epoch - fused + 1) for index in range(-(-steps // fused))]

        def run() -> None:
            for handle in [trainer.run(rows, first, fused) for first in starts]:
                trainer.fetch(handle)

        return run, len(starts) * fused


def model_values(model: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Host copies of ``model``'s (trainable, non-trainable) values, as ``Runs.train`` takes."""
    keras = import_keras()
    return ([keras.ops.convert_to_numpy(v.value) for v in model.trainable_variables],
            [keras.ops.convert_to_numpy(v.value) for v in model.non_trainable_variables])


def set_model_values(model: Any, values: tuple[list[Any], list[Any]]) -> None:
    """Write ``(trainable, non_trainable)`` values (as ``model_values`` gives) into ``model``."""
    trainable, non_trainable = values
    for variable, value in zip([*model.trainable_variables, *model.non_trainable_variables],
                               [*trainable, *non_trainable], strict=True):
        variable.assign(value)


def epoch_runner(model: Any, dataset: Any, spec: Any, batch_size: int, fused_steps: int,
                 seed: int = 0, jit_compile: bool = True,
                 task: Task = CLASSIFICATION) -> loop.EpochRunner:
    """Whole native epochs of ``model`` on ``dataset`` without bookkeeping (benchmarks, probe)."""
    trainer = impl().native_trainer(model, spec, dataset, jit_compile=jit_compile, task=task)
    return loop.EpochRunner(trainer, len(dataset.x_train), batch_size, fused_steps, seed)


def probe_candidates(model: Any, jit_compile: bool = True) -> tuple[int, ...]:
    """The K that ``--fused-steps auto`` tries for ``model`` on this backend's device:
    ``PROBE_CANDIDATES``, capped at ``capabilities.MAX_UNROLLED_STEPS`` where the K steps are
    written out (each step is one more copy to compile: measured on the Fashion-MNIST CNN at
    batch 128 on a CPU, K = 32 compiled in 32-51 s on TF and 22 s on JAX, K = 8 in 12-18 s and
    16 s, for little gain per step; docs/hardware.md)."""
    backend = impl()
    if not capabilities.unrolls_its_loop(model, backend.platform(),
                                         xla=backend.native_loop_uses_xla(jit_compile)):
        return PROBE_CANDIDATES
    return tuple(sorted({min(k, capabilities.MAX_UNROLLED_STEPS) for k in PROBE_CANDIDATES}))


PROBE_ROUNDS = 3  # interleaved rounds of the candidates' timed calls


def cached_probe_fused_steps(model: Any, dataset: Any, spec: Any, batch_size: int,
                             seed: int = 0, jit_compile: bool = True,
                             task: Task = CLASSIFICATION) -> tuple[int, dict[str, Any]]:
    """``probe_fused_steps``'s K, measured once per machine and workload (the harness's
    ``measure.remembered``: the model, the data, the optimizer, the batch size, the candidates,
    XLA and the task). ``KBACKEND_COMPILE_CACHE=0`` (``--no-compile-cache``) measures every
    time. Returns K and the probe's record (``"cached"``: whether it was stored)."""
    def measure() -> dict[str, Any]:
        best, timings, cv = probe_fused_steps(model, dataset, spec, batch_size, seed,
                                              jit_compile=jit_compile, task=task)
        return {"fused_steps": best, "us_per_step": {str(k): v for k, v in timings.items()},
                "cv": {str(k): v for k, v in cv.items()}}

    options = {"optimizer": spec.name, "batch_size": batch_size, "xla": jit_compile,
               "candidates": list(probe_candidates(model, jit_compile)),
               "task": [task.loss, task.metric_fn, *task.metric_args]}
    entry = remembered(FUSED_STEPS, model, dataset, options, measure, distrust=lambda e: (
        None if isinstance(e.get("fused_steps"), int) else "a damaged entry"))
    return entry["fused_steps"], entry


def probe_fused_steps(model: Any, dataset: Any, spec: Any, batch_size: int, seed: int = 0,
                      candidates: tuple[int, ...] | None = None, jit_compile: bool = True,
                      task: Task = CLASSIFICATION) -> tuple[int, dict, dict]:
    """The fastest K among ``candidates`` (capped at one epoch; by default
    ``probe_candidates(model)``), measured, with the median us/step of each and its
    coefficient of variation.

    Each candidate trains ``model`` from its weights on a probe epoch of ``max(candidates)``
    batches: once to compile and warm up, then in ``PROBE_ROUNDS`` interleaved rounds
    (``measure.time_interleaved``); the weights are put back after (not a
    ``keras.models.clone_model`` copy: cloning serializes the layers' configs, and Keras's
    serializer imports TensorFlow to check for a ``TensorShape``, seconds of start-up in a JAX
    process). Where per-call overhead dominates (small batches) large K wins; where the step's
    arithmetic dominates, K barely matters and the probe keeps whichever program XLA made
    fastest.
    """
    if candidates is None:
        candidates = probe_candidates(model, jit_compile)
    steps = batching.steps_per_epoch(len(dataset.x_train), batch_size)
    ks = sorted({min(k, steps) for k in candidates})
    probe_steps = max(ks)
    subset = replace(dataset, x_train=dataset.x_train[: probe_steps * batch_size],
                     y_train=dataset.y_train[: probe_steps * batch_size])
    weights = model.get_weights()
    try:
        timings = time_interleaved(
            {k: epoch_runner(model, subset, spec, batch_size, k, seed, jit_compile, task)
             for k in ks}, PROBE_ROUNDS, wait=lambda losses: losses)
    finally:
        model.set_weights(weights)
    us = {k: t.median_s / probe_steps * 1e6 for k, t in timings.items()}
    return min(us, key=us.__getitem__), us, {k: t.cv for k, t in timings.items()}
