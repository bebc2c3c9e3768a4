"""Content digests: a stored result is identified by what it was computed from, never by a name
or a path (a file edited in place keeps its name; a copy elsewhere keeps its content).

``arrays_digest`` covers arrays (names, shapes, dtypes and bytes), ``json_digest`` a JSON-able
description, ``code_digest`` the user's own Python source files behind some objects (modules
outside the standard library, site-packages and kbackend: an edited custom layer's ``call``
changes it, a reinstalled Keras does not; the package versions are keyed apart).
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

DIGEST_CHARS = 16


def json_digest(value: Any, chars: int = DIGEST_CHARS) -> str:
    """A hex digest of ``value`` as canonical JSON (sorted keys; other objects by ``str``), its
    first ``chars`` characters (64: the whole SHA-256)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:chars]


def arrays_digest(arrays: Mapping[str, Any]) -> str:
    """A hex digest of named arrays: each name, shape, dtype and the bytes in C order (arrays of
    strings: each string's UTF-8 bytes, so ``str`` and ``object`` arrays of the same text agree)."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = np.asarray(arrays[name])
        if array.dtype.kind in "OUS":  # strings: each one's UTF-8 bytes, never object pointers
            meta = f"{name}|{array.shape}|str|".encode()
            digest.update(len(meta).to_bytes(4, "little") + meta)
            for item in array.reshape(-1).tolist():
                data = item if isinstance(item, bytes) else str(item).encode("utf-8")
                digest.update(len(data).to_bytes(8, "little") + data)
            continue
        array = np.ascontiguousarray(array)
        meta = f"{name}|{array.shape}|{array.dtype.str}|".encode()
        digest.update(len(meta).to_bytes(4, "little") + meta)
        digest.update(array.reshape(-1).view(np.uint8).data)
    return digest.hexdigest()[:DIGEST_CHARS]


def _library_roots() -> tuple[Path, ...]:
    paths = sysconfig.get_paths()
    roots = {Path(paths[key]).resolve() for key in ("stdlib", "platstdlib", "purelib", "platlib")
             if key in paths}
    roots.add(Path(__file__).resolve().parent)  # kbackend itself: keyed by its version
    return tuple(sorted(roots))


def _module_of(value: Any) -> ModuleType | None:
    if isinstance(value, ModuleType):
        return value
    name = getattr(value, "__module__", None) or getattr(type(value), "__module__", None)
    return sys.modules.get(name) if isinstance(name, str) else None


def user_files(objects: Iterable[Any]) -> list[Path]:
    """The user's Python source files defining ``objects`` (or their classes), and those their
    modules name at top level (one step: a builder's module importing a custom layer's), sorted.
    Files of the standard library, of installed packages and of kbackend are not the user's."""
    roots = _library_roots()
    found: set[Path] = set()

    def user_file(module: ModuleType | None) -> Path | None:
        location = getattr(module, "__file__", None)
        if not location or not location.endswith(".py"):
            return None
        path = Path(location).resolve()
        if any(path.is_relative_to(root) for root in roots) or not path.is_file():
            return None
        return path

    for value in objects:
        module = _module_of(value)
        path = user_file(module)
        if path is None or path in found:
            continue
        found.add(path)
        for member in list(vars(module).values()):  # what the user's module imports
            inner = user_file(_module_of(member))
            if inner is not None:
                found.add(inner)
    return sorted(found)


def code_digest(objects: Iterable[Any]) -> str:
    """A hex digest of the contents of ``user_files(objects)`` (not their paths: a project
    moved elsewhere keeps its digest); the digest of nothing when there are none."""
    contents = sorted(hashlib.sha256(path.read_bytes()).hexdigest()
                      for path in user_files(objects))
    return json_digest(contents)
