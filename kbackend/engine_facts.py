"""What each engine is, as the facts its callers branch on: the one table, backend-free.

``kbackend.engines.ENGINES`` pairs each row with its train function. The configuration's
checks, the front doors (CLI, ``kbackend.train``, ``kbackend.study``) and the study read a row;
none compares an engine's name (tests/test_architecture.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from kbackend.data import batching
from kbackend.errors import ConfigError


@dataclass(frozen=True)
class EngineFacts:
    """One engine's facts."""

    # The engine that runs it data parallel (``kbackend.distributed.engine_name``).
    parallel_twin: str
    # floor(n / batch) steps per epoch (a fused loop or an even device split needs one batch
    # shape); otherwise ceil(n / batch), the last batch partial, as Keras fit does.
    drops_last_batch: bool = True
    # Runs K fused steps per device call; the others take only K = 1.
    fuses_steps: bool = False
    default_fused_steps: int = 1  # K when none is asked: 0 measures it (``auto``)
    evaluates_per_epoch: bool = False  # whatever ``eval_every`` asks (Keras fit)
    monitored: bool = False  # kbackend.hardware.monitor can time it
    parallel: bool = False  # asking for it asks for a data-parallel run
    auto_batch: bool = False  # grows the batch (``--batch-size auto``, engines.adaptive)
    loss_scaling: bool = False  # LossScaleOptimizer: what mixed_float16 needs
    # A study trains its cells on ``engines.native.Runs`` (programs compiled once per cell),
    # and so can train a grid as a population, measure the frontier, steps and noise on them.
    compiled_cells: bool = False

    def steps_per_epoch(self, n_train: int, batch_size: int) -> int:
        """The optimizer steps one epoch of ``n_train`` samples takes with this engine."""
        return batching.steps_per_epoch(n_train, batch_size, drops_last=self.drops_last_batch)


FACTS: dict[str, EngineFacts] = {
    "keras": EngineFacts("keras_data_parallel", drops_last_batch=False,
                         evaluates_per_epoch=True, monitored=True, loss_scaling=True),
    "native": EngineFacts("data_parallel", fuses_steps=True, default_fused_steps=0,
                          monitored=True, auto_batch=True, compiled_cells=True),
    "data_parallel": EngineFacts("data_parallel", fuses_steps=True, parallel=True,
                                 auto_batch=True),
    "keras_data_parallel": EngineFacts("keras_data_parallel", parallel=True),
}
# Every front door's engine: the CLI's ``--engine``, ``TrainConfig``, ``StudyConfig``,
# ``kbackend.train`` and ``kbackend.study``.
DEFAULT_ENGINE = "native"


def engine_facts(name: str) -> EngineFacts:
    """The facts of the engine registered as ``name`` (a one-line error for an unknown one)."""
    if name not in FACTS:
        raise ConfigError(f"Unknown engine. Expected one of {list(FACTS)}. Received: {name!r}.")
    return FACTS[name]


def engines_where(fact: str) -> list[str]:
    """The engines whose ``fact`` holds (for messages that list them)."""
    return [name for name, facts in FACTS.items() if getattr(facts, fact)]
