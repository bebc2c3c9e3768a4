"""The one dispatch point for backend-specific code.

``impl()`` returns the module implementing kbackend's backend-specific operations for the
active Keras backend (``jax_backend`` or ``tf_backend``). Both modules expose the same
functions; code elsewhere calls ``impl().name(...)`` and never branches on the backend name.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from kbackend.backend import active_backend

_MODULES = {"jax": "kbackend.backends.jax_backend", "tensorflow": "kbackend.backends.tf_backend"}


def impl() -> ModuleType:
    """The backend-specific implementation module for the active backend."""
    return importlib.import_module(_MODULES[active_backend()])
