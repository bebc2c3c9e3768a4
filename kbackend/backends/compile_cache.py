"""Where compiled XLA programs are kept between processes.

On JAX the persistent compilation cache is on by default under ``<kbackend cache folder>/xla/jax``
(the cache folder is ``$KBACKEND_CACHE_DIR`` or ``~/.cache/kbackend``), created readable by the
user alone: an entry is machine code the next process executes, so nobody else may write it.
``KBACKEND_COMPILE_CACHE=0`` (or ``kbackend --no-compile-cache``) turns it off. JAX reads and
writes entries under a file lock (taken once a size bound is set), so concurrent processes share
one folder; an entry that fails to load is a warning and a recompilation.

TensorFlow's XLA cache (``TF_XLA_FLAGS=--tf_xla_persistent_cache_directory=DIR``) is not turned
on: on TF 2.21 one corrupt or half-written entry fails every later call of that program
(``DataLossError: Can't parse ... as binary proto``), which a cache shared by concurrent or killed
processes must not do. Users who accept that can set the flag themselves.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kbackend.data.sources import cache_dir
from kbackend.io import atomic_write_json, read_json

COMPILE_CACHE_ENV = "KBACKEND_COMPILE_CACHE"
_OFF = ("0", "false", "no", "off")
# JAX evicts least recently used entries past this size.
COMPILE_CACHE_MAX_BYTES = 2 * 1024**3


def compile_cache_enabled() -> bool:
    """Whether the persistent compilation caches are on (``KBACKEND_COMPILE_CACHE``)."""
    return os.environ.get(COMPILE_CACHE_ENV, "1").strip().lower() not in _OFF


def compile_cache_folder(backend: str) -> Path | None:
    """The private cache folder of ``backend``, created if needed; None when the cache is off,
    or when the folder cannot be made private to this user (then nothing is cached)."""
    if not compile_cache_enabled():
        return None
    folder = cache_dir() / "xla" / backend
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        for path in (folder.parent, folder):
            if path.stat().st_uid != os.getuid():
                return None  # someone else's folder: never execute what they wrote
            if stat.S_IMODE(path.stat().st_mode) & 0o077:
                path.chmod(0o700)
    except OSError:
        return None
    return folder


def machine_measurement(file_name: str, key: str,
                        measure: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], bool]:
    """``measure()``'s result for ``key``, measured once per machine and software and kept in
    ``<kbackend cache folder>/<file_name>`` (JSON, written atomically; an unreadable file is
    measured again and replaced); returns it and whether it was stored. With the caches off
    (``KBACKEND_COMPILE_CACHE=0``) it measures every time. For answers that depend only on the
    program, the machine and the versions (``key`` must hold all three), such as which K or
    which path runs fastest."""
    path = cache_dir() / file_name if compile_cache_enabled() else None
    entries: dict[str, Any] = {}
    if path is not None and path.is_file():
        try:
            loaded = read_json(path)
            entries = loaded if isinstance(loaded, dict) else {}
        except (OSError, ValueError):
            entries = {}
        if isinstance(entries.get(key), dict):
            return entries[key], True
    result = measure()
    if path is not None:
        # An unwritable cache folder costs a measurement next time, nothing else.
        with contextlib.suppress(OSError):
            atomic_write_json(path, {**entries, key: result})
    return result, False
