"""The one place that reads and validates the backend choice (``KERAS_BACKEND``).

Keras picks its backend once, when it is first imported, so the choice must be made before
anything imports Keras. ``use_backend`` sets it and refuses to pretend when Keras was already
imported with another backend.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

from kbackend.errors import BackendError

BACKENDS: tuple[str, ...] = ("jax", "tensorflow")
DEFAULT_BACKEND = "jax"
ENV_VAR = "KERAS_BACKEND"

# Optional integrations that Keras and TensorFlow import as they are imported, whenever they are
# installed, and that kbackend's commands never use: scikit-learn (keras.wrappers) and
# matplotlib.pyplot (keras.visualization), ~2.5 s of Keras's ~3 s import here; and, on
# TensorFlow, JAX (for TFLite's JAX converter, ~1 s). A command's own process imports the
# frameworks without them (``skip_optional_imports``, docs/engines.md); a library user's process
# never does, since their code may use those APIs.
OPTIONAL_IMPORTS: dict[str, tuple[str, ...]] = {
    "jax": ("sklearn", "matplotlib"),
    "tensorflow": ("sklearn", "matplotlib", "jax"),
}
_skip_optional = False


def validate_backend(name: str) -> str:
    """Return ``name`` normalized if it is a supported backend, else raise ``BackendError``."""
    normalized = name.strip().lower()
    if normalized in ("torch", "pytorch"):
        raise BackendError(
            f"Invalid backend {name!r}: kbackend is PyTorch-free. "
            f"Expected one of {sorted(BACKENDS)}; set {ENV_VAR}=jax or {ENV_VAR}=tensorflow."
        )
    if normalized == "tf":
        normalized = "tensorflow"
    if normalized not in BACKENDS:
        raise BackendError(
            f"Invalid backend. Expected one of {sorted(BACKENDS)}. Received: backend={name!r}."
        )
    return normalized


def requested_backend(name: str | None = None) -> str:
    """The backend asked for: ``name`` if given, else ``$KERAS_BACKEND``, else the default."""
    if name is None:
        name = os.environ.get(ENV_VAR) or DEFAULT_BACKEND
    return validate_backend(name)


def use_backend(name: str | None = None) -> str:
    """Select the backend for this process and return its name.

    Must run before Keras is imported. If Keras is already imported with a different backend,
    raise ``BackendError`` instead of silently running on the wrong one.
    """
    backend = requested_backend(name)
    keras_module = sys.modules.get("keras")
    if keras_module is not None:
        active = keras_module.backend.backend()
        if active != backend:
            raise BackendError(
                f"Keras was already imported with backend {active!r}; it cannot switch to "
                f"{backend!r} in this process. Set {ENV_VAR}={backend} before starting Python."
            )
    os.environ[ENV_VAR] = backend
    # TensorFlow's C++ start-up logging drowns kbackend's output; users can still override it.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return backend


def skip_optional_imports() -> None:
    """Import the frameworks in this process without their unused integrations.

    Only for a process that runs kbackend's code alone (the command line's): there
    ``keras.wrappers``, ``keras.visualization`` and TFLite's JAX converter stop working, while
    scikit-learn, matplotlib and JAX themselves still import normally afterwards.
    """
    global _skip_optional
    _skip_optional = True


@contextmanager
def framework_import() -> Iterator[None]:
    """Wrap the first import of Keras or of a backend framework (TensorFlow imports Keras itself):
    after ``skip_optional_imports``, ``import`` fails for the backend's ``OPTIONAL_IMPORTS`` not
    imported yet, for the duration, so the frameworks skip them."""
    hidden = []
    if _skip_optional and "keras" not in sys.modules:
        optional = OPTIONAL_IMPORTS[requested_backend(os.environ.get(ENV_VAR))]
        hidden = [name for name in optional if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # to the import system: not found
    try:
        yield
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


def keras() -> ModuleType:
    """Import and return Keras on the selected backend (selecting the default if none was)."""
    use_backend(os.environ.get(ENV_VAR))
    with framework_import():
        import keras as keras_module  # deferred: the backend choice must precede it

    return keras_module


def selected_backend() -> str:
    """The backend Keras runs on, or will run on once imported, without importing it (what
    ``active_backend`` answers; ``kbackend info`` need not pay for Keras's import)."""
    if "keras" in sys.modules:
        return sys.modules["keras"].backend.backend()
    return use_backend(os.environ.get(ENV_VAR))


def active_backend() -> str:
    """The backend Keras runs on in this process (imports Keras if needed)."""
    return keras().backend.backend()
