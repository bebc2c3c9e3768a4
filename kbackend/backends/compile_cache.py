"""Where compiled XLA programs are kept between processes.

On JAX the persistent compilation cache is on by default under ``<kbackend cache folder>/xla/jax``
(the cache folder is ``$KBACKEND_CACHE_DIR`` or ``~/.cache/kbackend``), created readable by the
user alone: an entry is machine code the next process executes, so nobody else may write it.
``KBACKEND_COMPILE_CACHE=0`` (or ``kbackend --no-compile-cache``) turns it off. JAX reads and
writes entries under a file lock (taken once a size bound is set), so concurrent processes share
one folder; an entry that fails to load is a warning and a recompilation.

TensorFlow's XLA cache (``TF_XLA_FLAGS=--tf_xla_persistent_cache_directory=DIR``) is on too,
under ``<kbackend cache folder>/xla/tensorflow``, but never handed to TensorFlow directly: TF
writes an entry in place (not atomically), and on TF 2.21 one truncated or corrupt entry fails
every call of that program in the process that reads it (``OutOfRangeError: Read less bytes than
requested``, ``DataLossError``; retrying in the process does not help), which a folder shared by
concurrent or killed processes must not risk. So each process gets a private folder
(``private_cache_folder``): at start, the shared folder's entries whose SHA-256 matches the digest
in their name are copied in (a mismatch is deleted and compiled again); at a normal exit, the
entries the process compiled are renamed into the shared folder under ``NAME.DIGEST``, whole or
not at all. A killed process publishes nothing; its private folder is removed by a later one.
Past ``COMPILE_CACHE_MAX_BYTES`` the least recently used entries are deleted, as JAX does. Users
who set the flag themselves keep their own setting.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import re
import shutil
import stat
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kbackend.data.sources import cache_dir
from kbackend.errors import StoredFileError
from kbackend.io import atomic_write_json, read_json

COMPILE_CACHE_ENV = "KBACKEND_COMPILE_CACHE"
_OFF = ("0", "false", "no", "off")
# JAX evicts least recently used entries past this size; kbackend does the same for TF's.
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


# A published entry: TensorFlow's file name, then the first 16 hex digits of its SHA-256.
_PUBLISHED = re.compile(r"^(?P<name>.+\.pb)\.(?P<digest>[0-9a-f]{16})$")
_PRIVATE_PREFIX = "process-"


def entry_digest(data: bytes) -> str:
    """The digest a published entry carries in its name."""
    return hashlib.sha256(data).hexdigest()[:16]


def private_cache_folder(shared: Path) -> Path:
    """A folder private to this process, holding the verified entries of ``shared`` (see the
    module docstring); what the process adds there is published to ``shared`` when it exits."""
    _remove_abandoned(shared)
    private = Path(tempfile.mkdtemp(prefix=f"{_PRIVATE_PREFIX}{os.getpid()}-", dir=shared))
    loaded: set[str] = set()
    for entry in shared.iterdir():
        match = _PUBLISHED.match(entry.name)
        if match is None or match["name"] in loaded:
            continue
        try:
            data = entry.read_bytes()
        except OSError:
            continue
        if entry_digest(data) != match["digest"]:
            with contextlib.suppress(OSError):
                entry.unlink()  # damaged: compiled again and republished
            continue
        (private / match["name"]).write_bytes(data)  # a copy: TF may rewrite its own files
        loaded.add(match["name"])
        with contextlib.suppress(OSError):
            os.utime(entry)  # used now: the size bound evicts the least recently used
    atexit.register(publish_entries, private, shared, frozenset(loaded))
    return private


def publish_entries(private: Path, shared: Path, loaded: frozenset[str] = frozenset()) -> None:
    """Rename the entries of ``private`` not in ``loaded`` into ``shared`` as ``NAME.DIGEST``
    (readers see a whole entry or none), then remove ``private``."""
    with contextlib.suppress(OSError):  # at exit: a folder removed meanwhile is no error
        published = {m["name"] for m in map(_PUBLISHED.match, os.listdir(shared)) if m}
        for entry in private.iterdir():
            if entry.name in loaded or entry.name in published or not entry.name.endswith(".pb"):
                continue
            with contextlib.suppress(OSError):
                os.replace(entry, shared / f"{entry.name}.{entry_digest(entry.read_bytes())}")
        _evict_beyond(shared, COMPILE_CACHE_MAX_BYTES)
    shutil.rmtree(private, ignore_errors=True)


def _evict_beyond(shared: Path, max_bytes: int) -> None:
    """Delete the least recently used published entries until they fit in ``max_bytes``."""
    entries = []
    for entry in shared.iterdir():
        if _PUBLISHED.match(entry.name):
            with contextlib.suppress(OSError):
                info = entry.stat()
                entries.append((info.st_mtime, info.st_size, entry))
    total = sum(size for _, size, _ in entries)
    for _, size, entry in sorted(entries, key=lambda e: e[0]):
        if total <= max_bytes:
            break
        with contextlib.suppress(OSError):
            entry.unlink()
        total -= size


def _remove_abandoned(shared: Path) -> None:
    """Remove the private folders of processes that no longer run (killed before publishing)."""
    for folder in shared.glob(f"{_PRIVATE_PREFIX}*"):
        pid = folder.name[len(_PRIVATE_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # someone else's process: alive
    return True


class MeasurementWarning(UserWarning):
    """A stored per-machine measurement was not used: damaged, from another machine or
    version, or not trusted; it is measured again."""


REPROBE_ENV = "KBACKEND_REPROBE"  # set by ``--reprobe``: stored measurements are taken again
_REPROBED: set[tuple[str, str]] = set()  # (file, key) measured again in this process already


def request_reprobe() -> None:
    """Make this process (and the processes it starts) measure again what it would read from
    the per-machine store (``--reprobe``), each entry once."""
    os.environ[REPROBE_ENV] = "1"


def reprobe_requested() -> bool:
    return os.environ.get(REPROBE_ENV, "0").strip().lower() not in ("", *_OFF)


def measurement_path(file_name: str) -> Path:
    return cache_dir() / file_name


def stored_measurements(file_name: str) -> dict[str, dict[str, Any]]:
    """The entries of ``<kbackend cache folder>/<file_name>`` (``machine_measurement``'s store).

    A file that is not a JSON object is moved aside to ``<file_name>.damaged-<time>`` (the
    backup) with a ``MeasurementWarning`` and read as empty; entries that are not objects are
    dropped with a warning, the others kept."""
    path = measurement_path(file_name)
    if not path.is_file():
        return {}
    try:
        loaded = read_json(path)
        if not isinstance(loaded, dict):
            raise StoredFileError("not a JSON object")
    except (OSError, ValueError) as error:
        backup = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
        with contextlib.suppress(OSError):
            os.replace(path, backup)
        warnings.warn(f"{path} is damaged ({error}): kept as {backup.name}, its measurements "
                      "taken again", MeasurementWarning, stacklevel=2)
        return {}
    damaged = [key for key, entry in loaded.items() if not isinstance(entry, dict)]
    if damaged:
        warnings.warn(f"{path}: {len(damaged)} damaged entries ignored (the other "
                      f"{len(loaded) - len(damaged)} kept)", MeasurementWarning, stacklevel=2)
    return {key: entry for key, entry in loaded.items() if isinstance(entry, dict)}


def machine_measurement(file_name: str, key: str, measure: Callable[[], dict[str, Any]], *,
                        stamp: str | None = None,
                        distrust: Callable[[dict[str, Any]], str | None] | None = None,
                        ) -> tuple[dict[str, Any], bool]:
    """``measure()``'s result for ``key``, measured once per machine and software and kept in
    ``<kbackend cache folder>/<file_name>`` (JSON, written atomically; a damaged file or entry:
    ``stored_measurements``); returns it and whether it was stored. With the caches off
    (``KBACKEND_COMPILE_CACHE=0``) it measures every time; with ``--reprobe``
    (``REPROBE_ENV``) each key is measured again once per process.

    ``stamp``: where and with what the measurement is taken (machine, versions, format): kept
    in the entry as ``measured_on``; an entry with another stamp is ignored with a
    ``MeasurementWarning`` and measured again. ``distrust(entry)``: a reason not to use a
    stored entry (None to use it): it is measured again, the reason a warning. Without a
    stamp, ``key`` must hold the machine and versions itself."""
    path = measurement_path(file_name) if compile_cache_enabled() else None
    entry = stored_measurements(file_name).get(key) if path is not None else None
    again = reprobe_requested() and (file_name, key) not in _REPROBED
    if entry is not None and not again:
        reason = ("it was measured on another machine or kbackend version"
                  if stamp is not None and entry.get("measured_on") != stamp
                  else distrust(entry) if distrust is not None else None)
        if reason is None:
            return entry, True
        warnings.warn(f"stored measurement in {file_name} not used ({reason}): measuring "
                      "again", MeasurementWarning, stacklevel=2)
    result = measure()
    if stamp is not None:
        result = {**result, "measured_on": stamp}
    _REPROBED.add((file_name, key))
    if path is not None:
        # Read again just before writing: entries other processes stored meanwhile are kept. An
        # unwritable cache folder costs a measurement next time, nothing else.
        with contextlib.suppress(OSError):
            atomic_write_json(path, {**stored_measurements(file_name), key: result})
    return result, False
