"""Engines: how training steps run. Every engine takes the same inputs and returns a ``History``.

An engine's ``train(model, dataset, plan, config, reporter) -> History`` trains ``model`` in
place (the trained values end up in the Keras model's variables) as its ``TrainPlan`` says
(``Engine.plan``: built once, after the checks; the optimizer spec with its schedule length is
the plan's). All engines are registered in ``ENGINES``, the one table; the native ones share
``kbackend.engines.loop``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kbackend.config import TrainConfig, check_run
from kbackend.data import batching
from kbackend.engines import data_parallel, keras_data_parallel, keras_fit, native
from kbackend.engines.plan import TrainPlan
from kbackend.errors import ConfigError
from kbackend.history import History
from kbackend.optim import OptimizerSpec


@dataclass(frozen=True)
class Engine:
    """One engine: its train function and the facts the run's checks need."""

    train: Callable[..., History]
    # Runs floor(n / batch) steps per epoch (a fused loop or an even device split needs one batch
    # shape); otherwise ceil(n / batch), the last batch partial, as Keras fit does.
    drops_last_batch: bool
    # Runs K fused steps per device call (``fused_steps``); the others take only K = 1.
    fuses_steps: bool

    def __call__(self, *args: Any, **kwargs: Any) -> History:
        """Train: ``train(model, dataset, plan, config, reporter)``."""
        return self.train(*args, **kwargs)

    def plan(self, config: TrainConfig, n_train: int, devices: int = 1, *,
             optimizer: OptimizerSpec | None = None) -> TrainPlan:
        """The plan of ``config`` on ``n_train`` samples over ``devices`` devices with this
        engine, after every check that needs the data and the engine (``config.check_run``).
        ``optimizer`` replaces ``config.optimizer``."""
        check_run(config, n_train, self, devices)
        return TrainPlan.of(config, n_train, drops_last_batch=self.drops_last_batch,
                            devices=devices, optimizer=optimizer)

    def steps_per_epoch(self, n_train: int, batch_size: int) -> int:
        """The optimizer steps one epoch of ``n_train`` samples takes with this engine."""
        if self.drops_last_batch:
            return batching.steps_per_epoch_dropping_last(n_train, batch_size)
        return batching.steps_per_epoch_keeping_last(n_train, batch_size)


ENGINES: dict[str, Engine] = {
    "keras": Engine(keras_fit.train, drops_last_batch=False, fuses_steps=False),
    "native": Engine(native.train, drops_last_batch=True, fuses_steps=True),
    "data_parallel": Engine(data_parallel.train, drops_last_batch=True, fuses_steps=True),
    "keras_data_parallel": Engine(keras_data_parallel.train, drops_last_batch=True,
                                  fuses_steps=False),
}


def engine_names() -> list[str]:
    """The engines ``--engine`` accepts."""
    return list(ENGINES)


def get_engine(name: str) -> Engine:
    """The engine registered as ``name``."""
    if name not in ENGINES:
        raise ConfigError(f"Unknown engine. Expected one of {engine_names()}. Received: {name!r}.")
    return ENGINES[name]


