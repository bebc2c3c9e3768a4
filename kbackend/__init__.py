"""kbackend: hardware-aware training with Keras 3 on JAX or TensorFlow, measured.

Importing this package does not import Keras: the backend is chosen first
(``kbackend.backend_choice.use_backend``), because Keras reads ``KERAS_BACKEND`` once, at import.
"""

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["study", "train"]


def __getattr__(name: str) -> Any:
    """``kbackend.train`` and ``kbackend.study`` (``kbackend.api``), imported on first use: the
    command line and every submodule import this package, and need none of the study's code.
    (Once ``kbackend.study`` is imported, the callable package answers: ``study/__init__.py``.)"""
    if name in __all__:
        return getattr(importlib.import_module("kbackend.api"), name)
    raise AttributeError(f"module 'kbackend' has no attribute {name!r}")
