"""Engines: how training steps run. Every engine takes the same inputs and returns a ``History``.

An engine's ``train(model, dataset, plan, config, reporter) -> History`` trains ``model`` in
place (the trained values end up in the Keras model's variables) as its ``TrainPlan`` says
(``Engine.plan``: built once, after the checks; the optimizer spec with its schedule length is
the plan's). All engines are registered in ``ENGINES``, each with its row of
``kbackend.engine_facts.FACTS``; the native ones share ``kbackend.engines.loop``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kbackend import distributed
from kbackend.config import TrainConfig, check_run
from kbackend.engine_facts import FACTS, EngineFacts, engine_facts
from kbackend.engines import data_parallel, keras_data_parallel, keras_fit, native
from kbackend.engines.plan import TrainPlan
from kbackend.history import History
from kbackend.optim import OptimizerSpec


@dataclass(frozen=True)
class Engine:
    """One engine: its train function and its facts (``kbackend.engine_facts``)."""

    train: Callable[..., History]
    facts: EngineFacts

    def __call__(self, *args: Any, **kwargs: Any) -> History:
        """Train: ``train(model, dataset, plan, config, reporter)``; a data-parallel engine's
        under ``distributed.run_guarded`` (a lost peer ends a multi-process job clearly)."""
        if self.facts.parallel:
            return distributed.run_guarded(self.train, *args, **kwargs)
        return self.train(*args, **kwargs)

    def plan(self, config: TrainConfig, n_train: int, devices: int = 1, *,
             optimizer: OptimizerSpec | None = None) -> TrainPlan:
        """The plan of ``config`` on ``n_train`` samples over ``devices`` devices with this
        engine, after every check that needs the data and the engine (``config.check_run``).
        ``optimizer`` replaces ``config.optimizer``."""
        check_run(config, n_train, self.facts, devices)
        return TrainPlan.of(config, n_train, drops_last_batch=self.facts.drops_last_batch,
                            devices=devices, optimizer=optimizer)


ENGINES: dict[str, Engine] = {
    name: Engine(train, FACTS[name])
    for name, train in (("keras", keras_fit.train), ("native", native.train),
                        ("data_parallel", data_parallel.train),
                        ("keras_data_parallel", keras_data_parallel.train))
}


def get_engine(name: str) -> Engine:
    """The engine registered as ``name``."""
    engine_facts(name)  # an unknown name: a one-line error
    return ENGINES[name]


