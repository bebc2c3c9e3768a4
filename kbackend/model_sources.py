"""Where a model comes from: a built-in builder, a ``.keras`` file, a builder function in a Python
file or module, or (from Python) a ``keras.Model`` or a callable.

``parse_model_source(value)`` names the source and does every cheap check before anything is
built or trained: a file exists, a ``.keras`` archive's zip directory holds only what Keras writes
and is not too large (read header-first, never extracted), it has no ``Lambda`` layer unless
``unsafe_deserialization``; a builder file parses and defines its function. The source is one
class per kind (``BuiltinModel``, ``KerasFile``, ``Builder``, ``GivenModel``), whose ``build``
then makes one model per seed and whose ``digest`` keys what a model it built trains:

=============================  ==========================================================
``seed_mlp``, ``mlp``, ...     ``kbackend.models.build_model`` (the options apply)
``PATH.keras``                 a clone with fresh weights from the model's own initializers
                               and its compile settings; ``from_weights``: the saved weights
``FILE.py:FUNCTION``           the function called with no arguments, or with
``package.module:FUNCTION``    ``input_shape=`` / ``num_classes=`` where it names them
a ``keras.Model``              a clone (Sequential or functional models) with fresh weights,
                               or with its current weights (``from_weights``)
a callable                     as a builder function
=============================  ==========================================================

Fresh weights come from ``kbackend.backends.impl().set_random_seed(seed)`` before the model is
made: the same seed gives the same weights (an initializer with a seed of its own keeps it).
Every model is checked against the data (``check_model_matches``): one input (or named
inputs given as a dict), the input shape the data's, one output unless it is functional.
Errors are one-line ``ModelError``s (a ``ConfigError``: exit status 2).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import os
import re
import struct
import sys
import tempfile
import zipfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any, BinaryIO, ClassVar

from kbackend.backend_choice import keras as import_keras
from kbackend.backend_choice import tensorflow_kept_out
from kbackend.backends import impl
from kbackend.data import DatasetInfo
from kbackend.data.user.function import import_user_file
from kbackend.digests import arrays_digest, code_digest, json_digest
from kbackend.errors import ConfigError, InternalError, error_text, exit_call, path_errors
from kbackend.models import (
    BYTES_PER_TRAINING_PARAM,
    MODELS,
    ModelOptions,
    available_memory,
    build_model,
    check_model_fits,
    model_layout,
)
from kbackend.task import CLASSIFICATION, Task, task_of_model

UNSAFE_FLAG = "--unsafe-deserialization"
# What a .keras archive may hold (Keras's saving_lib), and the header-first limits on it.
KERAS_MEMBERS = ("config.json", "metadata.json", "model.weights.h5", "model.weights.npz")
ASSETS_FOLDER = "assets/"
MAX_MEMBERS = 1000
MAX_UNCOMPRESSED_BYTES = 4 * 2**30
MAX_CONFIG_BYTES = 64 * 2**20
# A central-directory entry is 46 bytes plus its name, extra field and comment.
_MAX_DIRECTORY_BYTES_PER_MEMBER = 4096
MAX_BUILDER_SOURCE_BYTES = 16 * 2**20
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_LAMBDA_CLASSES = ("Lambda", "__lambda__")
# ``--import MODULE`` (repeatable): the modules that register a model file's own classes
# (``@keras.saving.register_keras_serializable``). The command line imports them and records them
# here, so that every process it starts (launch workers, Ray tasks, equivalence workers, child
# runners) imports them before it loads a model: a JSON list of {"file": PATH} or
# {"module": NAME, "path": FOLDER} (the folder it was found from, first on sys.path).
IMPORT_FLAG = "--import"
IMPORT_ENV = "KBACKEND_IMPORT"
# Packages whose classes Keras itself finds by module and name (no registration needed).
_KERAS_PACKAGES = ("keras", "keras_hub", "keras_cv", "keras_nlp", "builtins")
_imported: set[str] = set()  # the IMPORT_ENV entries this process has imported


class ModelError(ConfigError):
    """A model file or model source is missing, does not load, or is not a model kbackend can
    train or serve."""


def shape_text(shape: tuple[int | None, ...]) -> str:
    """A batch of samples of ``shape`` for messages: ``(N, 28, ?)`` (``?``: any size)."""
    return "(N, " + ", ".join("?" if d is None else str(d) for d in shape) + ")"


# --- .keras archives, header first ---------------------------------------------------------------


def _directory_size(file: BinaryIO, size: int) -> tuple[int, int]:
    """(members, bytes) of a zip's central directory, from its end record (and the zip64 end
    record where the plain one overflows), read before anything else of the archive."""
    tail_length = min(size, 22 + 65535)
    file.seek(size - tail_length)
    tail = file.read(tail_length)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < 22:
        raise zipfile.BadZipFile("no end of central directory record")
    members, directory_bytes = struct.unpack("<HI", tail[at + 10:at + 16])
    if members == 0xFFFF or directory_bytes == 0xFFFFFFFF:
        locator_at = size - tail_length + at - 20
        if locator_at < 0:
            raise zipfile.BadZipFile("no zip64 end of central directory locator")
        file.seek(locator_at)
        signature, _, record_at, _ = struct.unpack("<4sIQI", file.read(20))
        if signature != b"PK\x06\x07" or record_at > size - 56:
            raise zipfile.BadZipFile("bad zip64 end of central directory locator")
        file.seek(record_at)
        record = file.read(56)
        if record[:4] != b"PK\x06\x06":
            raise zipfile.BadZipFile("bad zip64 end of central directory record")
        members, directory_bytes = struct.unpack("<QQ", record[32:48])
    return members, directory_bytes


def _expected_member(name: str) -> bool:
    if name in KERAS_MEMBERS:
        return True
    parts = name.split("/")
    return (name.startswith(ASSETS_FOLDER) and "\\" not in name and "\x00" not in name
            and ".." not in parts)


def check_model_file(path: str | os.PathLike, *, max_members: int = MAX_MEMBERS,
                     max_bytes: int = MAX_UNCOMPRESSED_BYTES,
                     max_config_bytes: int = MAX_CONFIG_BYTES) -> Path:
    """``path`` if it is a ``.keras`` archive Keras may open, else a one-line ``ModelError``.

    Cheap, and header-first (commands call it before they open a cache or import Keras): the
    zip's end record and central directory are read, nothing is extracted. Refused: a missing,
    empty or non-zip file, a folder; more than ``max_members`` members; a member other than
    ``config.json``, ``metadata.json``, ``model.weights.h5`` (or ``.npz``) and ``assets/...``;
    no ``config.json``; members that unpack to more than ``max_bytes`` bytes in all, or a
    ``config.json`` over ``max_config_bytes``.
    """
    path, size = _check_archive_file(path)
    _check_directory(path, size, max_members, max_bytes, max_config_bytes)
    return path


def _not_zip(shown: str, size: int) -> ModelError:
    return ModelError(f"Model file {shown} is not a .keras archive ({size} bytes, no zip "
                      "directory): the file is truncated or not a Keras model.")


def _check_archive_file(path: str | os.PathLike) -> tuple[Path, int]:
    """The path and size of a non-empty zip file named ``.keras``, else a ``ModelError``."""
    with path_errors(path, "model path", ModelError):
        path = Path(path)
        exists = path.exists()
        is_dir = exists and path.is_dir()
        size = path.stat().st_size if exists else 0
        is_zip = exists and not is_dir and size > 0 and zipfile.is_zipfile(path)
    shown = repr(str(path))
    if not exists:
        raise ModelError(f"Model file {shown} not found: expected a .keras file (saved by "
                         "kbackend train --save or keras.Model.save).")
    if is_dir or path.suffix != ".keras":
        raise ModelError(
            f"Invalid model {shown}: expected a .keras file (a SavedModel folder is an export "
            "format for TF Serving, not an input of this command)."
        )
    # Keras reports an empty or truncated archive as "File not found": say what it is.
    if size == 0:
        raise ModelError(f"Model file {shown} is empty (0 bytes): expected a .keras archive "
                         "saved by kbackend train --save or keras.Model.save.")
    if not is_zip:
        raise _not_zip(shown, size)
    return path, size


def _check_directory(path: Path, size: int, max_members: int, max_bytes: int,
                     max_config_bytes: int) -> None:
    """The archive's zip directory, its size checked from the end record first (a zip bomb's
    directory is never parsed): only a ``.keras`` archive's members, each once, ``config.json``
    among them, and their unpacked sizes within the bounds."""
    shown = repr(str(path))
    refused = f"Model file {shown} is refused before loading:"
    try:
        with open(path, "rb") as file:
            members, directory_bytes = _directory_size(file, size)
    except (OSError, zipfile.BadZipFile, struct.error, ValueError):
        raise _not_zip(shown, size) from None
    if members > max_members:
        raise ModelError(f"{refused} its zip directory lists {members} members, expected at "
                         f"most {max_members} (a .keras archive holds config.json, "
                         "metadata.json, model.weights.h5 and assets/).")
    if directory_bytes > max(members, 1) * _MAX_DIRECTORY_BYTES_PER_MEMBER:
        raise ModelError(f"{refused} its zip directory is {directory_bytes} bytes for "
                         f"{members} members.")
    try:  # the central directory only, its size now known to be small
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
    except (OSError, zipfile.BadZipFile, ValueError, EOFError):
        raise _not_zip(shown, size) from None
    if len(infos) > max_members:
        raise ModelError(f"{refused} it holds {len(infos)} members, expected at most "
                         f"{max_members}.")
    names = [info.filename for info in infos]
    for info in infos:
        if not _expected_member(info.filename):
            raise ModelError(
                f"Model file {shown} does not load as a Keras model: unexpected member "
                f"{info.filename[:80]!r} (a .keras archive holds only config.json, "
                "metadata.json, model.weights.h5 and assets/).")
    if len(set(names)) != len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise ModelError(f"{refused} member {twice[:80]!r} appears more than once.")
    if "config.json" not in names:
        raise ModelError(f"Model file {shown} does not load as a Keras model: no config.json "
                         "in the archive.")
    total = sum(info.file_size for info in infos)
    if total > max_bytes:
        raise ModelError(f"{refused} its members unpack to {total} bytes, expected at most "
                         f"{max_bytes}.")
    config_bytes = next(info.file_size for info in infos if info.filename == "config.json")
    if config_bytes > max_config_bytes:
        raise ModelError(f"{refused} its config.json is {config_bytes} bytes, expected at most "
                         f"{max_config_bytes}.")


def _read_config(path: Path) -> Any:
    """The parsed ``config.json`` of an archive ``check_model_file`` passed (its size capped)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return json.loads(archive.read("config.json"))
    except (OSError, zipfile.BadZipFile, ValueError, RecursionError) as error:
        raise ModelError(f"Model file {str(path)!r} does not load as a Keras model: its "
                         f"config.json does not read as JSON ({error_text(error, 120)}).") from None


def _dicts(config: Any) -> Iterator[dict[str, Any]]:
    """Every dict nested in the JSON value ``config``, depth first."""
    stack = [config]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _has_lambda(config: Any) -> bool:
    """Whether a Keras config holds a ``Lambda`` layer or a serialized Python lambda."""
    return any(item.get("class_name") in _LAMBDA_CLASSES for item in _dicts(config))


def _lambda_error(path: Path | str, unsafe_flag: bool = True) -> ModelError:
    remedy = (f"Pass {UNSAFE_FLAG} (unsafe_deserialization=True) only for a file you trust."
              if unsafe_flag else "This command loads only models without Lambda layers.")
    return ModelError(f"Model file {str(path)!r} has a Lambda layer, whose Python code runs "
                      f"when it loads: refused in safe mode. {remedy}")


def load_model(model: Any, *, info: DatasetInfo | None = None, compile: bool = False,
               unsafe_deserialization: bool = False, serving: bool = False) -> Any:
    """The one loader: the Keras model ``model`` names, after the ``--import`` modules this
    process inherited are imported (so a file's own classes resolve). ``model``: a ``.keras``
    file (checked header-first by ``check_model_file``; with its weights, in Keras's safe mode
    unless ``unsafe_deserialization``), a model config as JSON (``model.to_json()``), or, with
    ``info``, a builder (``FILE.py:FUNCTION``, ``package.module:FUNCTION``) built for that data
    with seed 0 (its code runs anyway, so safe mode guards nothing). ``serving``: the file is
    for inference (a Lambda is refused without naming a flag serving does not offer, and the
    model must have one input and one output). A class no module registered, and any other
    failure, is a one-line ``ModelError``."""
    is_file = info is None and not (isinstance(model, str) and model.startswith("{"))
    path = check_model_file(model) if is_file else None
    import_inherited()
    keras = import_keras()
    if info is not None:
        return parse_model_source(model).build(info, seed=0)
    if path is None:
        return keras.models.model_from_json(model)
    safe_mode = not unsafe_deserialization
    try:
        loaded = keras.saving.load_model(path, compile=compile, safe_mode=safe_mode)
    except Exception as error:  # Keras raises many types for a bad file; all mean "does not load"
        if "safe_mode" in str(error) and safe_mode:
            raise _lambda_error(path, unsafe_flag=not serving) from None
        missing = _unregistered(_read_config(path), keras)
        if missing:
            raise _unregistered_error(path, *missing) from None
        raise ModelError(f"Model file {str(path)!r} does not load as a Keras model: "
                         f"{error_text(error)}") from None
    if serving:
        check_servable(loaded, str(model))
    return loaded


def check_servable(model: Any, name: str = "model") -> None:
    """Raise ``ModelError`` unless ``model`` has one input and one output tensor."""
    if not hasattr(model, "inputs") or not hasattr(model, "outputs"):
        raise ModelError(f"Invalid {name}: expected a Keras model. Received: "
                         f"{type(model).__name__}.")
    if len(model.inputs or []) != 1 or len(model.outputs or []) != 1:
        raise ModelError(
            f"Invalid {name}: expected a model with one input and one output, received "
            f"{len(model.inputs or [])} inputs and {len(model.outputs or [])} outputs."
        )


def _unregistered(config: Any, keras: Any) -> tuple[str, str, str] | None:
    """(class, module, registered name) of the first object of ``config`` that Keras finds only
    by registration and that no imported module registered; None if there is none."""
    for item in _dicts(config):
        if not (isinstance(item.get("class_name"), str) and "module" in item):
            continue  # not a serialized Keras object
        module = str(item.get("module") or "")
        if item["class_name"] == "function":  # a function: {"config": "package>name"}
            name = item.get("config")
            if isinstance(name, str) and ">" in name and \
                    keras.saving.get_registered_object(name) is None:
                return name.rpartition(">")[2], module, name
            continue
        if module.split(".")[0] in _KERAS_PACKAGES:
            continue
        registered = item.get("registered_name") or item["class_name"]
        if keras.saving.get_registered_object(str(registered)) is None:
            return item["class_name"], module, str(registered)
    return None


def _unregistered_error(path: Path, name: str, module: str, registered: str) -> ModelError:
    where = f"module {module!r}, " if module else ""
    hint = module if module and module != "__main__" else "MODULE"
    return ModelError(
        f"Model file {str(path)!r} uses the class {name!r} ({where}registered as "
        f"{registered!r}), which no imported module registers: pass {IMPORT_FLAG} {hint} (a "
        "module name or FILE.py that defines it with @keras.saving.register_keras_serializable).")


def _load_keras(path: Path, unsafe_deserialization: bool) -> tuple[Any, dict[str, Any]]:
    """(the model in ``path``, uncompiled, without optimizer state; its compile settings as
    saved in config.json, empty if it was not compiled)."""
    model = load_model(path, unsafe_deserialization=unsafe_deserialization)
    config = _read_config(path)
    compile_config = config.get("compile_config") if isinstance(config, dict) else None
    return model, compile_config if isinstance(compile_config, dict) else {}


def _compile(model: Any, compile_config: dict[str, Any], name: str) -> None:
    """Compile ``model`` with the serialized ``compile_config`` (its loss and metrics define the
    task; kbackend's engines replace the optimizer), if there is one."""
    if not compile_config:
        return
    try:
        model.compile_from_config(compile_config)
    except Exception as error:  # a loss or metric Keras cannot rebuild
        raise ModelError(f"Model {name!r}: its compile settings (loss, metrics) do not load: "
                         f"{error_text(error)}") from None


# --- builder functions ---------------------------------------------------------------------------


def _top_level_names(tree: ast.Module) -> tuple[set[str], list[str], bool]:
    """(names a module binds at its top level, the functions and classes it defines there,
    whether it has a ``from ... import *``), looking into ``if`` / ``try`` / ``with`` blocks."""
    names: set[str] = set()
    callables: list[str] = []
    star = False
    statements = list(tree.body)
    while statements:
        node = statements.pop(0)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
            callables.append(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                star = star or alias.name == "*"
                names.add(alias.asname or alias.name.split(".")[0])
        for block in ("body", "orelse", "finalbody", "handlers"):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                statements.extend(getattr(node, block, []))
    return names, callables, star


def _check_builder_source(path: Path, function: str) -> None:
    """A one-line ``ModelError`` unless the Python file ``path`` parses and binds ``function``
    at its top level (read, not run: nothing of the user's code runs before the build)."""
    with path_errors(path, "builder file", ModelError):
        exists = path.is_file()
        size = path.stat().st_size if exists else 0
    if not exists:
        raise ModelError(f"Builder file {str(path)!r} not found: expected FILE.py:FUNCTION, a "
                         "Python file defining a function that returns a keras.Model.")
    if size > MAX_BUILDER_SOURCE_BYTES:
        raise ModelError(f"Builder file {str(path)!r} is {size} bytes, expected at most "
                         f"{MAX_BUILDER_SOURCE_BYTES}.")
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError as error:
        raise ModelError(f"Builder file {path}:{error.lineno or 0}: syntax error: "
                         f"{error.msg}.") from None
    except (OSError, ValueError) as error:
        raise ModelError(f"Builder file {str(path)!r} does not read as Python: "
                         f"{error_text(error)}.") from None
    names, callables, star = _top_level_names(tree)
    if function not in names and not star:
        raise ModelError(f"Builder file {str(path)!r} defines no {function!r}: its functions and "
                         f"classes are {', '.join(callables) or 'none'}.")


def _import_file(path: Path, what: str = "Builder file") -> ModuleType:
    """The module of the Python file ``path`` (``import_user_file``: once per version)."""
    try:
        return import_user_file(path, "kbackend_builder")
    except Exception as error:
        raise ModelError(f"{what} {str(path.resolve())!r} failed to import: "
                         f"{error_text(error)}") from error
    except SystemExit as error:
        raise ModelError(f"Builder file {str(path.resolve())!r} called {exit_call(error)} while "
                         "it was imported: a builder file defines a function returning a "
                         "keras.Model.") from None


# --- --import: modules that register the classes of a model file ----------------------------


def _import_entry(spec: str) -> dict[str, str]:
    """The ``IMPORT_ENV`` entry of one ``--import`` value, checked (nothing is imported)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ModelError(f"Invalid {IMPORT_FLAG} {spec!r}: expected a module name or FILE.py.")
    if spec.endswith(".py"):
        with path_errors(spec, IMPORT_FLAG, ModelError):
            path = Path(spec).resolve()
            found = path.is_file()
        if not found:
            raise ModelError(f"Invalid {IMPORT_FLAG} {spec!r}: file not found (expected a "
                             "module name or FILE.py).")
        return {"file": str(path)}
    if not _MODULE_NAME.fullmatch(spec):
        raise ModelError(f"Invalid {IMPORT_FLAG} {spec[:80]!r}: expected a module name "
                         "(package.module) or FILE.py.")
    return {"module": spec, "path": os.getcwd()}


def _import_one(entry: dict[str, str]) -> None:
    """Import one ``IMPORT_ENV`` entry (once per process), one-line ``ModelError`` if it fails."""
    key = json.dumps(entry, sort_keys=True)
    if key in _imported:
        return
    import_keras()  # the backend is chosen before the user's module imports Keras
    if "file" in entry:
        _import_file(Path(entry["file"]), f"{IMPORT_FLAG} file")
    else:
        folder = entry.get("path") or os.getcwd()
        sys.path.insert(0, folder)  # as `python -m` finds a module of the working folder
        try:
            importlib.import_module(entry["module"])
        except (Exception, SystemExit) as error:  # a module calling sys.exit() is an error too
            raise ModelError(f"{IMPORT_FLAG} {entry['module']!r} failed to import: "
                             f"{error_text(error)}") from None
        finally:
            if folder in sys.path:
                sys.path.remove(folder)
    _imported.add(key)


def _inherited_entries() -> list[dict[str, str]]:
    text = os.environ.get(IMPORT_ENV, "")
    try:
        entries = json.loads(text) if text else []
    except ValueError:
        entries = None
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and all(isinstance(v, str) for v in e.values())
            and ("file" in e or "module" in e) for e in entries):
        raise ModelError(f"Invalid ${IMPORT_ENV} {text[:80]!r}: expected what {IMPORT_FLAG} "
                         "records (a JSON list of modules); unset it.")
    return entries


def register_imports(specs: Sequence[str], *, import_now: bool = True) -> None:
    """``--import``: check each module name or ``FILE.py``, record them for every process this
    one starts (``IMPORT_ENV``), and import them here now (``import_now``; a command that runs
    no Keras itself, such as ``equiv``, leaves that to its workers)."""
    entries = _inherited_entries()
    added: list[dict[str, str]] = []
    for spec in specs:
        entry = _import_entry(spec)
        if entry not in entries and entry not in added:
            added.append(entry)
    if import_now:  # imported before they are recorded: a module that fails is never handed on
        for entry in added:
            _import_one(entry)
    os.environ[IMPORT_ENV] = json.dumps(entries + added)
    if import_now:
        import_inherited()


def import_inherited() -> None:
    """Import the ``--import`` modules recorded in ``IMPORT_ENV`` (by this process or the one
    that started it) that this process has not imported yet."""
    for entry in _inherited_entries():
        _import_one(entry)


def _import_module(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except Exception as error:
        raise ModelError(f"Builder module {name!r} failed to import: "
                         f"{error_text(error)}") from error
    except SystemExit as error:
        raise ModelError(f"Builder module {name!r} called {exit_call(error)} while it was "
                         "imported.") from None


def _call_builder(builder: Callable[..., Any], info: DatasetInfo, name: str) -> Any:
    """What ``builder`` returns, called with the arguments its signature names of
    ``input_shape`` and ``num_classes``."""
    keras = import_keras()
    try:
        signature: inspect.Signature | None = inspect.signature(builder)
    except (TypeError, ValueError):  # some callables written in C have none: call them bare
        signature = None
    values = {"input_shape": tuple(info.input_shape), "num_classes": info.num_classes}
    arguments = {key: value for key, value in values.items()
                 if signature is not None and key in signature.parameters}
    if signature is not None:
        try:
            signature.bind(**arguments)
        except TypeError:
            raise ModelError(f"Builder {name!r} must be callable with no arguments, or with "
                             f"input_shape= and/or num_classes=; its signature is "
                             f"{str(signature)[:120]}.") from None
    try:
        model = builder(**arguments)
    except Exception as error:
        raise ModelError(f"Builder {name!r} raised {error_text(error)}") from error
    except SystemExit as error:
        raise ModelError(f"Builder {name!r} called {exit_call(error)} instead of returning a "
                         "keras.Model.") from None
    if not isinstance(model, keras.Model):
        kind = type(model)
        raise ModelError(f"Builder {name!r} returned {kind.__module__}.{kind.__qualname__}, "
                         "expected a keras.Model.")
    return model


# --- models: graph or subclassed, checks, copies -------------------------------------------------


def is_graph_model(model: Any) -> bool:
    """Whether ``model`` is a Sequential or functional model (``clone_model`` rebuilds those)."""
    keras = import_keras()
    from keras.src.models.functional import Functional  # deferred: Keras after the backend choice

    return isinstance(model, keras.Sequential | Functional)


def layer_state(layer: Any) -> tuple[dict[str, Any], dict[str, bytes]]:
    """(``layer``'s own variables, its asset files' bytes): what Keras saves of it beyond its
    config (a lookup layer's vocabulary file, its IDF weights)."""
    store: dict[str, Any] = {}
    if hasattr(layer, "save_own_variables"):  # a Hashing layer has neither: nothing to keep
        layer.save_own_variables(store)
    if not hasattr(layer, "save_assets"):
        return store, {}
    with tempfile.TemporaryDirectory() as folder:
        layer.save_assets(folder)
        assets = {path.name: path.read_bytes() for path in sorted(Path(folder).iterdir())}
    return store, assets


def copy_layer_state(source: Any, target: Any) -> None:
    """``source``'s saved state (``layer_state``) loaded into ``target``, as Keras's saving
    does (``load_assets``, ``load_own_variables``)."""
    store, assets = layer_state(source)
    with tempfile.TemporaryDirectory() as folder:
        for name, data in assets.items():
            (Path(folder) / name).write_bytes(data)
        target.load_assets(folder)
    if store:
        target.load_own_variables(store)


def holds_vocabulary(layer: Any) -> bool:
    """Whether ``layer`` is a lookup layer (``TextVectorization``, ``StringLookup``, ...) whose
    table holds more than a layer made anew from its config without a vocabulary: adapted, or
    given one."""
    if not hasattr(layer, "vocabulary_size"):
        return False
    config = {**layer.get_config(), "vocabulary": None}
    if "idf_weights" in config:
        config["idf_weights"] = None
    return int(layer.vocabulary_size()) > int(type(layer).from_config(config).vocabulary_size())


def _copy_vocabularies(model: Any, clone: Any) -> None:
    """Each lookup layer's vocabulary (``TextVectorization``, ``StringLookup``, ...) copied
    from ``model`` into ``clone``: ``clone_model`` rebuilds layers from their configs, which
    hold a vocabulary given as an argument but not one ``adapt`` made. A vocabulary is data
    preparation, not a weight: the user's adapted layer stays adapted in every seed's copy."""
    pairs = zip(model._flatten_layers(include_self=False),
                clone._flatten_layers(include_self=False), strict=False)
    for source, target in pairs:
        if type(source) is type(target) and holds_vocabulary(source):
            copy_layer_state(source, target)


def _not_cloneable(model: Any, name: str) -> ModelError:
    return ModelError(f"Model {name!r} is a subclassed model ({type(model).__qualname__}), "
                      "which cannot be cloned with fresh weights: pass a builder instead "
                      "(FILE.py:FUNCTION, or a function returning the model).")


def _fresh_copy(model: Any, name: str, *, weights: bool = False, safe_mode: bool = True,
                compile_config: dict[str, Any] | None = None) -> Any:
    """A clone of the graph model ``model`` (new layers, fresh weights from their initializers
    under the current seed; ``weights``: its weights copied), compiled with ``compile_config``
    (default: as ``model`` is). ``safe_mode=False`` lets the clone rebuild ``Lambda`` layers
    (their code is loaded already)."""
    keras = import_keras()
    from keras.src.saving.serialization_lib import (  # deferred: Keras after the backend choice
        SafeModeScope,
    )

    if not is_graph_model(model):
        raise _not_cloneable(model, name)
    with SafeModeScope(safe_mode), tensorflow_kept_out():
        clone = keras.models.clone_model(model)
        _copy_vocabularies(model, clone)
        if weights:
            clone.set_weights(model.get_weights())
        if compile_config is None and getattr(model, "compiled", False):
            compile_config = model.get_compile_config()
        _compile(clone, compile_config or {}, name)
    return clone


# Layers that take strings or hold a lookup table: a model's string front (kbackend.host_front).
STRING_FRONT_LAYERS = ("TextVectorization", "StringLookup", "IntegerLookup", "Hashing")


def _check_no_string_front(model: Any, name: str) -> None:
    """A one-line ``ModelError`` for a subclassed model holding string preprocessing layers:
    kbackend runs such a front on the host, split off a graph it cannot read from ``call``."""
    keras = import_keras()
    kinds = tuple(getattr(keras.layers, kind) for kind in STRING_FRONT_LAYERS)
    found = next((layer for layer in model._flatten_layers(include_self=False)
                  if isinstance(layer, kinds)), None)
    if found is not None:
        raise ModelError(
            f"Model {name!r} is subclassed ({type(model).__qualname__}) and holds a "
            f"{type(found).__name__} layer ({found.name}): kbackend splits string preprocessing "
            "off only a Sequential or functional model (keras.Input(shape=(1,), "
            "dtype='string') first), or give token ids made in the input pipeline.")


def check_model_matches(model: Any, info: DatasetInfo, name: str = "model") -> None:
    """A one-line ``ModelError`` unless ``model`` takes one input of the data's shape
    (``info.input_shape``; a dimension the model leaves open matches any). A functional model
    may give several outputs (a multi-output task, ``kbackend.task``); a subclassed one gives
    one.

    An unbuilt Sequential model is built for the data's shape; a subclassed model is called on a
    symbolic batch of it. Output units against classes are the task's check, not this one.
    """
    keras = import_keras()
    if isinstance(info.input_shape, dict):  # named inputs (kbackend.workload.InputPacking)
        _check_named_inputs(model, info.input_shape, name)
        return
    shape = tuple(info.input_shape)
    shown = shape_text(shape)
    data = f"the data ({info.name}) has {shown}"
    if isinstance(model, keras.Sequential) and not model.built:
        try:
            model.build((None, *shape))
        except Exception as error:
            raise ModelError(f"Model {name!r} does not build for inputs of shape {shown} "
                             f"({info.name}): {error_text(error, 200)}") from None
    if is_graph_model(model):
        inputs = len(model.inputs)
        if inputs != 1:  # several outputs are a multi-output task (kbackend.task)
            raise ModelError(f"Model {name!r} has {inputs} inputs: kbackend trains a model with "
                             "several inputs on data given as a dict keyed by input name.")
        got = tuple(model.inputs[0].shape[1:])
        if not takes_shape(got, shape):
            raise ModelError(f"Model {name!r} takes inputs of shape {shape_text(got)}, {data}: "
                             "expected a model whose input matches the data (a Reshape layer "
                             "adapts one).")
        return
    _check_no_string_front(model, name)
    try:
        output = model(keras.KerasTensor((None, *shape)))
    except Exception as error:
        raise ModelError(f"Model {name!r} does not take inputs of shape {shown} "
                         f"({info.name}): {error_text(error, 200)}") from None
    outputs = len(keras.tree.flatten(output))
    if outputs != 1:
        raise ModelError(f"Model {name!r} is subclassed and has {outputs} outputs: kbackend "
                         "names a multi-output model's outputs by its output layers; build it "
                         "as a functional model.")


def _check_named_inputs(model: Any, shapes: dict[str, tuple[int, ...]], name: str) -> None:
    """A multi-input model against data given as a dict (``shapes``: the data's shape per
    input name): the same input names, each input's shape the data's."""
    wanted = {key: tuple(shape) for key, shape in shapes.items()}
    if not is_graph_model(model):
        raise ModelError(f"Model {name!r} is subclassed: dict inputs need a functional model "
                         "whose keras.Input layers are named as the data's keys.")
    got = {tensor.name: tuple(tensor.shape[1:]) for tensor in model.inputs}
    if set(got) != set(wanted):
        raise ModelError(f"Model {name!r} takes inputs named {sorted(got)}; the data's dict has "
                         f"{sorted(wanted)}: name the keras.Input layers as the data's keys.")
    for key, shape in wanted.items():
        if not takes_shape(got[key], shape):
            raise ModelError(f"Model {name!r} takes input {key!r} of shape {shape_text(got[key])}, "
                             f"the data's {key!r} has {shape_text(shape)}.")


def takes_shape(got: tuple[int | None, ...], shape: tuple[int | None, ...]) -> bool:
    """Whether a model input of sample shape ``got`` takes data of ``shape`` (an open
    dimension matches any)."""
    return len(got) == len(shape) and all(g is None or g == w
                                          for g, w in zip(got, shape, strict=True))


def _check_fits(model: Any, name: str) -> None:
    """``models.check_model_fits`` for a model that exists: its training state must fit."""
    params = int(model.count_params())
    needed = params * BYTES_PER_TRAINING_PARAM
    available = available_memory()
    if needed > available:
        raise ModelError(f"Model {name!r} is too large to train here: {params:.3g} parameters "
                         f"need {needed / 2**30:.3g} GiB of training state, "
                         f"{available / 2**30:.3g} GiB is available.")


# --- the source ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSource(ABC):
    """Where a run's model comes from; ``build`` makes one model per seed, ``digest`` says what
    a model it built trains. One subclass per kind (``kind``): ``BuiltinModel``,
    ``KerasFile``, ``Builder``, ``GivenModel``. ``name`` is what histories and reports call the
    model (``seed_mlp``, ``my.keras``, ``models.py:build``, ``pkg.models:build``, a model's name).
    """

    kind: ClassVar[str]
    # Whether only its content says what it is (a file's or builder's name does not): a
    # study's report folder carries its digest.
    by_content: ClassVar[bool] = True
    # Whether its models train their own compiled task (a user's), which only a prepared
    # workload reads (``task``), rather than kbackend's classification (a built-in's).
    own_task: ClassVar[bool] = True
    name: str
    # The .keras file or the builder's Python file.
    path: Path | None = None
    # The builder's module (``package.module:FUNCTION``) and function.
    module: str | None = None
    function: str | None = None
    from_weights: bool = False
    unsafe_deserialization: bool = False
    # The keras.Model (a ``GivenModel``) or the callable (a ``Builder`` from Python).
    obj: Any = field(default=None, compare=False, repr=False)

    @property
    def default_metric(self) -> str | None:
        """The metric a target or early stopping watches unless told: a built-in classifier's
        ``val_accuracy``; None for a user's model (its compiled metric is known once built)."""
        return None

    @property
    def layout(self) -> str:
        """The data layout the model takes: a built-in's own, else ``spatial`` (the data's
        own shape, which ``check_model_matches`` holds the model's input to)."""
        return "spatial"

    def data_format(self, options: ModelOptions) -> str:
        """The image layout a built-in dataset is read in for this model: a built-in's option,
        else the data's own (``channels_last``)."""
        return "channels_last"

    def input_shape(self) -> tuple[int | None, ...] | None:
        """The sample shape a saved or given graph model declares for its one input; None for
        a builder (its model follows the data), a built-in or a model of several inputs."""
        return None

    def task(self, model: Any, y: Any, prefer_metric: str | None) -> Task:
        """The task ``model`` (one this source built) trains on labels ``y``: its compiled
        loss and metrics, else one inferred from the labels (``task.task_of_model``)."""
        return task_of_model(model, y, prefer_metric=prefer_metric)

    def check_fits(self, info: DatasetInfo, options: ModelOptions) -> None:
        """The memory check that needs nothing built (``kbackend launch``, before any framework
        starts): a built-in's parameters are counted from its options; a user's model is
        checked when ``build`` makes it."""
        return None

    @abstractmethod
    def build(self, info: DatasetInfo, options: ModelOptions | None = None, *,
              seed: int | None = None) -> Any:
        """A new ``keras.Model`` for the data ``info`` describes, its weights made under
        ``seed`` (default: ``options.seed``, else 0). Built-ins are built with ``options``; the
        other kinds take only the seed from them."""

    def digest(self, model: Any) -> str:
        """A hex digest of what ``model`` (one this source built) trains: its class and config
        (layers, shapes, dtypes; auto-generated names made positional, so the same model built
        later in a session has the same digest), its compiled loss and metrics, its variables'
        shapes and dtypes and the user's source files behind it (custom layers' modules; a
        builder's file and the modules it imports). Names and paths are not content: a renamed
        or moved copy has the same digest. The run keys are built from it."""
        return json_digest(self._content(model))

    def _content(self, model: Any) -> dict[str, Any]:
        layers = list(model._flatten_layers(include_self=False))
        names = {name: f"<{index}>" for index, name in
                 enumerate([model.name, *(layer.name for layer in layers)])}
        return {
            "class": _positional_names(f"{type(model).__module__}.{type(model).__qualname__}",
                                       {}),
            "config": _positional_names(_model_config(model, layers), names),
            "compile": _positional_names(_task_settings(model), names),
            "variables": [[list(v.shape), str(v.dtype)] for v in model.weights],
            "code": code_digest([*self._code(), type(model), *(type(layer) for layer in layers)]),
        }

    def _code(self) -> list[Any]:
        """What the user's code behind a model is found from, beside its classes."""
        return []

    def to_json(self) -> dict[str, Any]:
        """This source as JSON, for another process to rebuild (``from_json``: equivalence's
        workers): its kind and what it reads, paths made absolute (a worker may have started
        in another folder). A model or function given from Python has no such form."""
        if self.obj is not None:
            raise InternalError(f"Model {self.name!r} was given from Python: it has no JSON "
                                "form (save it, or name its builder FILE.py:FUNCTION).")
        return {"kind": self.kind, "name": self.name,
                "path": None if self.path is None else str(self.path.resolve()),
                "module": self.module, "function": self.function,
                "from_weights": self.from_weights,
                "unsafe_deserialization": self.unsafe_deserialization}

    @staticmethod
    def from_json(value: dict[str, Any]) -> ModelSource:
        """The source ``value`` (``to_json``'s form; a missing name: the file's) describes."""
        kinds: dict[str, type[ModelSource]] = {
            kind.kind: kind for kind in (BuiltinModel, KerasFile, Builder)}
        if value.get("kind") not in kinds:
            raise InternalError(f"Unknown model source kind {value.get('kind')!r}: expected "
                                f"one of {sorted(kinds)}.")
        path = Path(value["path"]) if value.get("path") else None
        return kinds[value["kind"]](
            value.get("name") or (path.name if path else ""), path=path,
            module=value.get("module"), function=value.get("function"),
            from_weights=bool(value.get("from_weights")),
            unsafe_deserialization=bool(value.get("unsafe_deserialization")))


class BuiltinModel(ModelSource):
    """One of ``kbackend.models``' builders: ``models.build_model`` with the run's options."""

    kind = "builtin"
    by_content = False
    own_task = False

    @property
    def default_metric(self) -> str | None:
        return "val_accuracy"

    @property
    def layout(self) -> str:
        return model_layout(self.name)

    def data_format(self, options: ModelOptions) -> str:
        return options.data_format

    def task(self, model: Any, y: Any, prefer_metric: str | None) -> Task:
        return CLASSIFICATION  # kbackend's classifiers, uncompiled

    def check_fits(self, info: DatasetInfo, options: ModelOptions) -> None:
        check_model_fits(self.name, info, options)

    def build(self, info: DatasetInfo, options: ModelOptions | None = None, *,
              seed: int | None = None) -> Any:
        seed = seed if seed is not None else (options.seed if options is not None else 0)
        return build_model(self.name, info, replace(options or ModelOptions(), seed=seed))


class _UserModel(ModelSource):
    """A model of the user's: made by ``_make``, then checked against the data
    (``check_model_matches``) and the memory its training state takes."""

    def build(self, info: DatasetInfo, options: ModelOptions | None = None, *,
              seed: int | None = None) -> Any:
        seed = seed if seed is not None else (options.seed if options is not None else 0)
        impl().set_random_seed(seed)
        model = self._make(info, seed)
        check_model_matches(model, info, self.name)
        _check_fits(model, self.name)
        return model

    @abstractmethod
    def _make(self, info: DatasetInfo, seed: int) -> Any:
        """A new model of this source for the data ``info`` describes (the seed already set)."""


class _SavedWeights(_UserModel):
    """A source that holds weights (a file's, a given model's): with ``from_weights`` they are
    what the model starts from, so they are content."""

    def _content(self, model: Any) -> dict[str, Any]:
        content = super()._content(model)
        if self.from_weights:
            keras = import_keras()
            content["weights"] = arrays_digest({
                str(index): keras.ops.convert_to_numpy(variable)
                for index, variable in enumerate(model.weights)})
        return content

    def input_shape(self) -> tuple[int | None, ...] | None:
        model = self._model()
        inputs = getattr(model, "inputs", None) or []
        if not is_graph_model(model) or len(inputs) != 1:
            return None
        return tuple(inputs[0].shape[1:])

    @abstractmethod
    def _model(self) -> Any:
        """The saved or given model (for its declared input shape)."""


class KerasFile(_SavedWeights):
    """A ``.keras`` file: a clone with fresh weights from the model's own initializers and its
    compile settings; ``from_weights``: the saved weights."""

    kind = "keras_file"

    def _model(self) -> Any:
        assert self.path is not None
        return _load_keras(self.path, self.unsafe_deserialization)[0]

    def _make(self, info: DatasetInfo, seed: int) -> Any:
        assert self.path is not None
        model, compile_config = _load_keras(self.path, self.unsafe_deserialization)
        if self.from_weights:
            _compile(model, compile_config, self.name)
            return model
        impl().set_random_seed(seed)  # the clone's weights depend on the seed alone
        return _fresh_copy(model, self.name, safe_mode=not self.unsafe_deserialization,
                           compile_config=compile_config)


class GivenModel(_SavedWeights):
    """A ``keras.Model`` given from Python: a clone with fresh weights, or with its current
    weights (``from_weights``)."""

    kind = "instance"

    def _model(self) -> Any:
        return self.obj

    def _make(self, info: DatasetInfo, seed: int) -> Any:
        # the user's own objects: no code comes from a file
        return _fresh_copy(self.obj, self.name, weights=self.from_weights, safe_mode=False)


class Builder(_UserModel):
    """A function returning a ``keras.Model`` (``FILE.py:FUNCTION``, ``package.module:FUNCTION``
    or a callable), called with the ``input_shape`` / ``num_classes`` it names."""

    kind = "builder"

    def _make(self, info: DatasetInfo, seed: int) -> Any:
        return _call_builder(self._builder(), info, self.name)

    def _code(self) -> list[Any]:
        return [self._builder()]

    def _builder(self) -> Callable[..., Any]:
        if self.obj is not None:
            return self.obj
        import_keras()  # the backend is chosen before the user's module imports Keras
        if self.path is not None:
            module = _import_file(self.path)
        else:
            assert self.module is not None
            module = _import_module(self.module)
        builder = getattr(module, self.function or "", None)
        if builder is None or not callable(builder):
            own = sorted(key for key, value in vars(module).items() if callable(value)
                         and getattr(value, "__module__", None) == module.__name__)
            what = "defines no" if builder is None else "has a non-callable"
            raise ModelError(f"Builder {self.name!r}: the module {what} {self.function!r}; its "
                             f"functions and classes are {', '.join(own) or 'none'}.")
        return builder


def _model_config(model: Any, layers: list[Any]) -> Any:
    """``model``'s config, or (a subclassed model without one) each layer's class and config."""
    try:
        return model.get_config()
    except NotImplementedError:
        described = []
        for layer in layers:
            try:
                config = layer.get_config()
            except NotImplementedError:
                config = None
            described.append([f"{type(layer).__module__}.{type(layer).__qualname__}", config])
        return described


# What a model's compile settings say about the task (kbackend's engines bring their own
# optimizer, compilation and steps per call, so those settings are not content).
TASK_COMPILE_SETTINGS = ("loss", "loss_weights", "metrics", "weighted_metrics")


def _task_settings(model: Any) -> dict[str, Any] | None:
    """The loss and metric settings ``model`` was compiled with, None if it was not."""
    if not getattr(model, "compiled", False):
        return None
    config = model.get_compile_config() or {}
    return {key: config.get(key) for key in TASK_COMPILE_SETTINGS}


# The module name ``_import_file`` gives a builder file: made from its path and modification
# time, so it is not content (the file's bytes are, in the code digest).
_BUILDER_MODULE = re.compile(r"kbackend_builder_[0-9A-Za-z_]*?_[0-9a-f]{12}")


def _positional_names(value: Any, names: dict[str, str]) -> Any:
    """``value`` (JSON-like) with every string that is a layer's or the model's name replaced by
    its position (Keras numbers auto-generated names per session: ``dense_3``), and a builder
    file's module name (a class defined in the file) by one placeholder."""
    if isinstance(value, str):
        return names.get(value, _BUILDER_MODULE.sub("<builder file>", value))
    if isinstance(value, dict):
        return {key: _positional_names(item, names) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_positional_names(item, names) for item in value]
    return value


def _builder_source(text: str) -> ModelSource:
    location, _, function = text.rpartition(":")
    if not function.isidentifier():
        raise ModelError(f"Invalid model {text!r}: expected FILE.py:FUNCTION or "
                         "package.module:FUNCTION, with a function name after the colon.")
    if location.endswith(".py"):
        path = Path(location)
        _check_builder_source(path, function)
        return Builder(f"{path.name}:{function}", path=path, function=function)
    if not _MODULE_NAME.fullmatch(location):
        raise ModelError(f"Invalid model {text!r}: expected FILE.py:FUNCTION or "
                         "package.module:FUNCTION.")
    try:
        spec = importlib.util.find_spec(location)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ModelError(f"Builder module {location!r} not found: expected a module on the "
                         "Python path (PYTHONPATH), or FILE.py:FUNCTION.")
    if spec.origin and spec.origin.endswith(".py"):
        _check_builder_source(Path(spec.origin), function)
    return Builder(text, module=location, function=function)


def model_kind(value: str | os.PathLike) -> type[ModelSource] | None:
    """The kind of model source ``value`` names, by its form alone (nothing is read or
    imported): a built-in name, a ``.keras`` file or a builder; None where it names none."""
    text = str(os.fspath(value))
    if isinstance(value, str) and value in MODELS:
        return BuiltinModel
    if text.endswith(".keras"):
        return KerasFile
    return Builder if ":" in text else None


def parse_model_source(value: Any, *, unsafe_deserialization: bool = False,
                       from_weights: bool = False) -> ModelSource:
    """The ``ModelSource`` ``value`` names, after every check that needs nothing built.

    ``value``: a built-in model name, a ``.keras`` path, ``FILE.py:FUNCTION``,
    ``package.module:FUNCTION``, a ``keras.Model`` or a callable returning one (or a
    ``ModelSource``, returned as it is). ``from_weights``: build with the weights of the file
    or model instead of fresh ones. ``unsafe_deserialization``: allow a ``.keras`` file's
    ``Lambda`` layers (their code runs when it loads).
    """
    if isinstance(value, ModelSource):
        return value
    if isinstance(value, str | os.PathLike):
        text = str(os.fspath(value))
        kind = model_kind(value)
        if kind is BuiltinModel:
            source: ModelSource = BuiltinModel(text)
        elif kind is KerasFile:
            path = check_model_file(text)
            if not unsafe_deserialization and _has_lambda(_read_config(path)):
                raise _lambda_error(path)
            source = KerasFile(path.name, path=path, from_weights=from_weights,
                               unsafe_deserialization=unsafe_deserialization)
        elif kind is Builder:
            source = _builder_source(text)
        elif text.endswith(".py"):
            raise ModelError(f"Invalid model {text!r}: name the builder function, as "
                             "FILE.py:FUNCTION.")
        else:
            raise ModelError(f"Unknown model. Expected one of {sorted(MODELS)}, a .keras file, "
                             f"FILE.py:FUNCTION or package.module:FUNCTION. Received: {text!r}.")
    else:
        keras = import_keras()
        if isinstance(value, keras.Model):
            if not is_graph_model(value):
                raise _not_cloneable(value, value.name)
            source = GivenModel(value.name, from_weights=from_weights, obj=value)
        elif callable(value):
            module = getattr(value, "__module__", None) or "?"
            function = getattr(value, "__qualname__", None) or type(value).__qualname__
            source = Builder(f"{module}:{function}", obj=value)
        else:
            raise ModelError("Invalid model: expected a model name, a .keras path, "
                             "FILE.py:FUNCTION, a keras.Model or a builder function. Received: "
                             f"{type(value).__qualname__}.")
    if from_weights and not isinstance(source, _SavedWeights):
        raise ModelError(f"Invalid from_weights for model {source.name!r}: weights come from a "
                         f".keras file or a keras.Model, and a {source.kind} model has none.")
    return source
