"""Engines: how training steps run. Every engine takes the same inputs and returns a ``History``.

An engine is a callable ``(model, dataset, spec, config, reporter) -> History``; it trains
``model`` in place (the trained values end up in the Keras model's variables).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from kbackend.errors import ConfigError

# name -> module exposing ``train(model, dataset, spec, config, reporter) -> History``
_ENGINE_MODULES = {"keras": "kbackend.engines.keras_fit", "native": "kbackend.engines.native"}


def engine_names() -> list[str]:
    """The engines ``--engine`` accepts."""
    return list(_ENGINE_MODULES)


def get_engine(name: str) -> Callable[..., Any]:
    """The ``train`` function of engine ``name``."""
    if name not in _ENGINE_MODULES:
        raise ConfigError(f"Unknown engine. Expected one of {engine_names()}. Received: {name!r}.")
    return importlib.import_module(_ENGINE_MODULES[name]).train
