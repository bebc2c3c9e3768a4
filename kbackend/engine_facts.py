"""What each engine is, as the facts its callers branch on: the one table, backend-free.

``kbackend.engines.ENGINES`` pairs each row with its train function; the configuration's
checks, the front doors (CLI, ``kbackend.train`` / ``kbackend.study``) and the study read the
rows here, low in the layers, and never compare an engine's name (tests/test_architecture.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from kbackend.data import batching
from kbackend.errors import ConfigError


@dataclass(frozen=True)
class EngineFacts:
    """One engine's facts."""

    # floor(n / batch) steps per epoch (a fused loop or an even device split needs one batch
    # shape); otherwise ceil(n / batch), the last batch partial, as Keras fit does.
    drops_last_batch: bool
    # Runs K fused steps per device call (``fused_steps``); the others take only K = 1.
    fuses_steps: bool
    # K when none is asked: 0 measures it (``--fused-steps auto``), 1 runs one step per call.
    default_fused_steps: int = 1
    # Validates once per epoch whatever ``eval_every`` asks (Keras fit).
    evaluates_per_epoch: bool = False
    # The utilization monitor can time it (kbackend.hardware.monitor).
    monitored: bool = False
    # The engine that runs it data parallel (``kbackend.distributed.engine_name``); None: none.
    parallel_twin: str | None = None
    # Is itself a data-parallel engine (asking for it asks for a parallel run).
    parallel: bool = False
    # Grows the batch with ``--batch-size auto`` (engines.adaptive; one process).
    auto_batch: bool = False
    # Applies loss scaling (LossScaleOptimizer), which mixed_float16 needs.
    loss_scaling: bool = False
    # A study trains its cells through ``engines.native.Runs``: a cell's programs compiled once
    # (rate and initial weights are runtime arguments), so the study can also train a grid as
    # one population, measure the frontier, time steps and the noise scale on them.
    compiled_cells: bool = False

    def steps_per_epoch(self, n_train: int, batch_size: int) -> int:
        """The optimizer steps one epoch of ``n_train`` samples takes with this engine."""
        return batching.steps_per_epoch(n_train, batch_size, drops_last=self.drops_last_batch)


FACTS: dict[str, EngineFacts] = {
    "keras": EngineFacts(drops_last_batch=False, fuses_steps=False, evaluates_per_epoch=True,
                         monitored=True, parallel_twin="keras_data_parallel",
                         loss_scaling=True),
    "native": EngineFacts(drops_last_batch=True, fuses_steps=True, default_fused_steps=0,
                          monitored=True, parallel_twin="data_parallel", auto_batch=True,
                          compiled_cells=True),
    "data_parallel": EngineFacts(drops_last_batch=True, fuses_steps=True,
                                 parallel_twin="data_parallel", parallel=True, auto_batch=True),
    "keras_data_parallel": EngineFacts(drops_last_batch=True, fuses_steps=False,
                                       parallel_twin="keras_data_parallel", parallel=True),
}
# Every front door's engine (the CLI's ``--engine``, ``TrainConfig``, ``StudyConfig``,
# ``kbackend.train`` and ``kbackend.study``): K fused steps per call, the fastest measured.
DEFAULT_ENGINE = "native"


def engine_facts(name: str) -> EngineFacts:
    """The facts of the engine registered as ``name`` (a one-line error for an unknown one)."""
    if name not in FACTS:
        raise ConfigError(f"Unknown engine. Expected one of {list(FACTS)}. Received: {name!r}.")
    return FACTS[name]


def engines_where(fact: str) -> list[str]:
    """The engines whose ``fact`` holds (for messages that list them)."""
    return [name for name, facts in FACTS.items() if getattr(facts, fact)]
