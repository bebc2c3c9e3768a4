"""The native engine: K train steps per compiled device call, on JAX (optax) or TF (Keras).

The compiled loops live behind the backend boundary (``impl().native_trainer``:
``backends/jax/native.py``, ``backends/tensorflow/native.py``); the epoch loop is
``kbackend.engines.loop``'s. The training split is copied to the device once and each step
gathers its batch there.

``fused_steps=0`` (``--fused-steps auto``) picks K by measurement: ``probe_fused_steps`` times one
short epoch per candidate on a throwaway clone of the model and keeps the fastest (its figures go
to ``history.extra["fused_steps_probe"]``; the probe runs before the clock starts).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from kbackend.backend_choice import keras as import_keras
from kbackend.backends import impl
from kbackend.data import batching
from kbackend.engines import loop
from kbackend.engines.keras_fit import compile_model
from kbackend.history import History

PROBE_CANDIDATES = (1, 8, 32)


def train(model: Any, dataset: Any, spec: Any, config: Any, reporter: Any = None) -> History:
    """Train ``model`` in place with fused native steps; the history in kbackend's format."""
    fused_steps, probe = config.fused_steps, None
    if fused_steps == 0:  # auto: measure a few K on a throwaway copy of the model
        probe_start = time.perf_counter()
        fused_steps, timings = probe_fused_steps(model, dataset, spec, config.batch_size,
                                                 config.seed)
        probe = {"us_per_step": {str(k): v for k, v in timings.items()},
                 "seconds": time.perf_counter() - probe_start}
    plan = loop.Plan.of(config, len(dataset.x_train), fused_steps)
    spec = spec.with_total_steps(plan.steps_per_epoch * config.epochs)
    # Compiled for evaluate/predict/save afterwards; the TF loop trains with this optimizer.
    compile_model(model, spec, config)
    trainer = impl().native_trainer(model, spec, dataset)
    history = History()
    history.extra.update(engine="native", decay_steps=spec.decay_steps)
    if probe is not None:
        history.extra["fused_steps_probe"] = probe
    return loop.run(trainer, plan, config, reporter, history=history)


def epoch_runner(model: Any, dataset: Any, spec: Any, batch_size: int, fused_steps: int,
                 seed: int = 0) -> loop.EpochRunner:
    """Whole native epochs of ``model`` on ``dataset`` without bookkeeping (benchmarks, probe)."""
    trainer = impl().native_trainer(model, spec, dataset)
    return loop.EpochRunner(trainer, len(dataset.x_train), batch_size, fused_steps, seed)


def probe_fused_steps(model: Any, dataset: Any, spec: Any, batch_size: int, seed: int = 0,
                      candidates: tuple[int, ...] = PROBE_CANDIDATES) -> tuple[int, dict]:
    """The fastest K among ``candidates`` (capped at one epoch), measured, and us/step of each.

    Each candidate trains a clone of ``model`` (same weights; ``model`` is not touched) on a
    probe epoch of ``max(candidates)`` batches: once to compile and warm up, once timed. Where
    per-call overhead dominates (small batches) large K wins; where the step's arithmetic
    dominates, K barely matters and the probe keeps whichever program XLA made fastest.
    """
    keras = import_keras()
    steps = batching.steps_per_epoch_dropping_last(len(dataset.x_train), batch_size)
    ks = sorted({min(k, steps) for k in candidates})
    probe_steps = max(ks)
    subset = replace(dataset, x_train=dataset.x_train[: probe_steps * batch_size],
                     y_train=dataset.y_train[: probe_steps * batch_size])
    timings: dict[int, float] = {}
    for k in ks:
        clone = keras.models.clone_model(model)
        clone.set_weights(model.get_weights())
        runner = epoch_runner(clone, subset, spec, batch_size, k, seed)
        runner()  # compiles
        start = time.perf_counter()
        runner()
        timings[k] = (time.perf_counter() - start) / probe_steps * 1e6
    return min(timings, key=timings.get), timings
