"""The one place that reads and validates the backend choice.

Keras picks its backend once, when it is first imported, so the choice must be made before
anything imports Keras. It follows Keras's own order (``keras/src/backend/config.py``):
``--backend`` (a command's flag), then ``KERAS_BACKEND``, then the ``"backend"`` of Keras's
configuration file (``$KERAS_HOME/keras.json``, else ``~/.keras/keras.json``), then kbackend's
default, jax; Keras imported before kbackend chose (a user's ``import keras``) decides in place
of the default. ``backend_decision`` says which one decided (``kbackend info`` prints it).

Keras writes its configuration file on its first import when there is none, with *its* default
backend (tensorflow), whatever ``KERAS_BACKEND`` says. So that kbackend's default does not turn
into tensorflow from the second run on, ``use_backend`` writes that file first, in Keras's format,
when kbackend's default decided and no file exists (never replacing one).

``use_backend`` sets the choice and refuses to pretend when Keras was already imported with
another backend.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from kbackend.errors import BackendError

BACKENDS: tuple[str, ...] = ("jax", "tensorflow")
DEFAULT_BACKEND = "jax"
ENV_VAR = "KERAS_BACKEND"
FLAG = "--backend"
DEFAULT_SOURCE = "default"
IMPORTED_SOURCE = "Keras, already imported"
# The file Keras writes on its first import when there is none (its defaults, this key order).
_KERAS_CONFIG_DEFAULTS = {"floatx": "float32", "epsilon": 1e-07, "backend": DEFAULT_BACKEND,
                          "image_data_format": "channels_last"}
# What this process chose, and why: (backend, source). Once chosen, KERAS_BACKEND holds it.
_chosen: tuple[str, str] | None = None

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


def validate_backend(name: str, source: str | None = None) -> str:
    """Return ``name`` normalized if it is a supported backend, else raise ``BackendError``
    (naming ``source``, where the name came from, when given)."""
    where = f" (from {source})" if source else ""
    if not isinstance(name, str):
        raise BackendError(f"Invalid backend {name!r}{where}: expected a string, one of "
                           f"{sorted(BACKENDS)}.")
    normalized = name.strip().lower()
    if normalized in ("torch", "pytorch"):
        raise BackendError(
            f"Invalid backend {name!r}{where}: kbackend is PyTorch-free. "
            f"Expected one of {sorted(BACKENDS)}; set {ENV_VAR}=jax or {ENV_VAR}=tensorflow."
        )
    if normalized == "tf":
        normalized = "tensorflow"
    if normalized not in BACKENDS:
        raise BackendError(
            f"Invalid backend{where}. Expected one of {sorted(BACKENDS)}. "
            f"Received: backend={name!r}."
        )
    return normalized


def keras_config_path() -> str:
    """The configuration file Keras reads at import: ``$KERAS_HOME/keras.json``, else
    ``~/.keras/keras.json`` (``/tmp/.keras/keras.json`` when the home folder is not writable)."""
    if "KERAS_HOME" in os.environ:
        folder = os.environ["KERAS_HOME"]
    else:
        home = os.path.expanduser("~")
        folder = os.path.join(home if os.access(home, os.W_OK) else "/tmp", ".keras")
    return os.path.expanduser(os.path.join(folder, "keras.json"))


def _shown(path: str) -> str:
    """``path`` with the home folder written ``~``."""
    home = os.path.expanduser("~")
    return "~" + path[len(home):] if home != "~" and path.startswith(home + os.sep) else path


def keras_config(path: str | None = None) -> dict[str, Any]:
    """Keras's configuration file (default ``keras_config_path()``) as a dict; empty where Keras
    would take nothing from it (no file, unreadable, not a JSON object: Keras ignores those)."""
    try:
        with open(keras_config_path() if path is None else path, encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def backend_decision(name: str | None = None) -> tuple[str, str]:
    """``(backend, source)``: the backend this process runs on or will, and what decided it:
    ``--backend`` (``name``), ``KERAS_BACKEND``, Keras's configuration file (its path, home as
    ``~``), Keras already imported, or kbackend's default. Torch or an unknown name from any of
    them is a ``BackendError`` naming the source."""
    if name is not None:
        return validate_backend(name, FLAG), FLAG
    value = os.environ.get(ENV_VAR)
    if value:
        if _chosen is not None and value == _chosen[0]:
            return _chosen  # the choice this process made (and wrote into KERAS_BACKEND)
        return validate_backend(value, ENV_VAR), ENV_VAR
    keras_module = sys.modules.get("keras")
    if keras_module is not None:  # Keras already decided (from its file or its default)
        return validate_backend(keras_module.backend.backend(), IMPORTED_SOURCE), IMPORTED_SOURCE
    path = keras_config_path()
    value = keras_config(path).get("backend")
    if value is not None:
        return validate_backend(value, _shown(path)), _shown(path)
    return DEFAULT_BACKEND, DEFAULT_SOURCE


def requested_backend(name: str | None = None) -> str:
    """The backend asked for: ``name`` if given, else ``$KERAS_BACKEND``, else Keras's
    configuration file's, else the default (``backend_decision``)."""
    return backend_decision(name)[0]


def _write_keras_config(backend: str) -> None:
    """Create Keras's configuration file with ``backend`` if there is none (never replace one;
    a folder that cannot be written is left alone, as Keras leaves it)."""
    path = keras_config_path()
    text = json.dumps({**_KERAS_CONFIG_DEFAULTS, "backend": backend}, indent=4)
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        file.write(text)


def use_backend(name: str | None = None) -> str:
    """Select the backend for this process and return its name.

    Must run before Keras is imported. If Keras is already imported with a different backend,
    raise ``BackendError`` instead of silently running on the wrong one.
    """
    global _chosen
    backend, source = backend_decision(name)
    keras_module = sys.modules.get("keras")
    if keras_module is not None:
        active = keras_module.backend.backend()
        if active != backend:
            raise BackendError(
                f"Keras was already imported with backend {active!r}; it cannot switch to "
                f"{backend!r} in this process. Set {ENV_VAR}={backend} before starting Python."
            )
    if source == DEFAULT_SOURCE and keras_module is None:
        _write_keras_config(backend)  # else Keras writes its own default (tensorflow) there
    _chosen = (backend, source)
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
        optional = OPTIONAL_IMPORTS[requested_backend()]
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
    use_backend()
    with framework_import():
        import keras as keras_module  # deferred: the backend choice must precede it

    return keras_module


def selected_backend() -> str:
    """The backend Keras runs on, or will run on once imported, without importing it (what
    ``active_backend`` answers; ``kbackend info`` need not pay for Keras's import)."""
    if "keras" in sys.modules:
        return sys.modules["keras"].backend.backend()
    return use_backend()


def backend_source() -> str:
    """What decided this process's backend (``backend_decision``), for ``kbackend info``."""
    return backend_decision()[1]


def active_backend() -> str:
    """The backend Keras runs on in this process (imports Keras if needed)."""
    return keras().backend.backend()


@contextmanager
def tensorflow_kept_out() -> Iterator[None]:
    """Inside, Keras's serialization (``clone_model``, ``get_compile_config``, ``save``,
    ``from_config``) does not import TensorFlow: it asks whether TensorFlow is available only to
    test objects against its types, and where it is not imported yet (JAX) no object is one.
    The import would cost seconds and TensorFlow's C++ log lines in a JAX process."""
    from keras.src.utils import module_utils  # deferred: Keras after the backend choice

    lazy = module_utils.tensorflow
    if "tensorflow" in sys.modules or vars(lazy).get("_available", True) is not None:
        yield  # imported already, known to be missing, or another Keras: nothing to do
        return
    lazy._available = False
    try:
        yield
    finally:
        lazy._available = None
