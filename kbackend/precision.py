"""Mixed precision: the dtype policies kbackend offers and a scope to build models under one.

Models keep their softmax in float32 (kbackend.models), and Keras keeps variables in float32
under ``mixed_*`` policies (only the compute dtype is reduced). ``mixed_float16`` needs loss
scaling: ``model.compile`` wraps the optimizer in ``keras.optimizers.LossScaleOptimizer`` for a
model built under that policy; ``loss_scaled`` does it explicitly for code that compiles itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kbackend.backend_choice import keras as import_keras
from kbackend.errors import ConfigError

PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")


def check_precision(name: str) -> str:
    """``name`` if it is a known precision policy, else a ConfigError."""
    if name not in PRECISIONS:
        raise ConfigError(
            f"Invalid precision. Expected one of {list(PRECISIONS)}. Received: {name!r}.")
    return name


@contextmanager
def precision_scope(name: str) -> Iterator[None]:
    """Layers built inside this block use dtype policy ``name``; the previous policy returns
    after."""
    keras = import_keras()
    check_precision(name)
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def loss_scaled(optimizer: Any, precision: str) -> Any:
    """``optimizer`` wrapped in a ``LossScaleOptimizer`` when ``precision`` is mixed_float16."""
    keras = import_keras()
    if check_precision(precision) == "mixed_float16" and not isinstance(
            optimizer, keras.optimizers.LossScaleOptimizer):
        return keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer
