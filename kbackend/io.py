"""Crash-safe file writes: temp file in the same folder, flush, fsync, rename; strict JSON;
reading a user's .npy / .npz arrays without unpickling.

Temporary files are named ``.{name}.{host}-{pid}-{random}.tmp{suffix}`` next to their target
(``host`` is a short hash of the host name); staging folders (``temp_folder``) alike. A failed
write removes its own; one left by a killed process is removed by the next write into the same
folder and by the output checks every command runs before it starts (``check_output_path``,
``check_output_folder``, below), through ``remove_stale_temp_files``. Those checks find a path
that cannot be written (or would overwrite one of the command's inputs) before any work, as a
one-line ``ConfigError``.

Every JSON file is strict JSON (RFC 8259 has no NaN or Infinity; many parsers refuse them): a
non-finite float is written as ``null``, and a top-level ``"non_finite"`` object records what each
such null was, keyed by its JSON Pointer:
``{"loss": [0.5, null], "non_finite": {"/loss/1": "NaN"}}``. ``read_json`` puts the values back.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import socket
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kbackend.errors import ConfigError, DataError, OutputError, path_errors

# A JSON boundary: a dict as it is written to or read from a JSON file or the study store, or
# hashed into a content key (``json.dumps``). Results travel between functions as frozen
# dataclasses; they become a ``JsonObject`` only in their ``to_json`` / ``from_json``.
JsonObject = dict[str, Any]

NON_FINITE_KEY = "non_finite"
NPY_MAGIC = b"\x93NUMPY"
_ARRAY_READ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error)
# A temp file whose writer cannot be checked (another host, an older kbackend's name) is stale once
# it is this old: no single write takes an hour, and removing it sooner could race a live writer.
STALE_TEMP_AGE_S = 3600.0
_TEMP_NAME = re.compile(
    r"\.(?P<name>.+)\.(?:(?P<host>[0-9a-f]{8})-(?P<pid>[0-9]+)-)?"
    r"[a-z0-9_]{8}\.tmp(?:\..*)?"
)
_NON_FINITE_NAMES = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _host_tag() -> str:
    return hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists but belongs to someone else (EPERM), or cannot tell
        return True
    return True


def remove_stale_temp_files(
    folder: str | os.PathLike[str], *, max_age_s: float = STALE_TEMP_AGE_S
) -> list[Path]:
    """Remove the temp files ``atomic_write`` (and staging folders ``temp_folder``) left in
    ``folder`` when their process was killed.

    A temp file is stale when it was made on this host by a process that no longer runs, or, when
    that cannot be checked (another host sharing the folder, a name without a pid), when it is
    older than ``max_age_s``. Files of running writers and anything not named like a temp file
    are left alone. Best effort: a file that cannot be removed is skipped. Returns those removed.
    """
    removed: list[Path] = []
    host, now = _host_tag(), time.time()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        match = _TEMP_NAME.fullmatch(entry.name)
        if match is None:
            continue
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
            if not is_dir and not entry.is_file(follow_symlinks=False):
                continue
            same_host = match["host"] == host and match["pid"] is not None
            if same_host and int(match["pid"]) == os.getpid():
                continue  # this process's own write in progress (another thread)
            if same_host and _pid_alive(int(match["pid"])):
                continue
            if not same_host and now - entry.stat(follow_symlinks=False).st_mtime < max_age_s:
                continue
            if is_dir:  # a staging folder (``temp_folder``)
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
            removed.append(Path(entry.path))
        except OSError:
            continue
    return removed


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_folder(target: str | os.PathLike) -> Path:
    """A new staging folder beside ``target``, named like ``atomic_write``'s temp files, for an
    artifact that is a folder (a SavedModel): build it inside, then rename it into place. The
    caller removes it when done; one left by a killed process is removed by the next
    ``remove_stale_temp_files`` of that folder (stale ones are removed now)."""
    target = Path(target)
    return Path(tempfile.mkdtemp(prefix=_temp_prefix(target), suffix=".tmp", dir=target.parent))


def _temp_prefix(target: Path) -> str:
    """How a temp name beside ``target`` starts (``_TEMP_NAME``), once its folder exists and
    the stale temp files in it are removed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(target.parent)
    return f".{target.name}.{_host_tag()}-{os.getpid()}-"


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp_path)`` then atomically rename ``tmp_path`` to ``path``.

    A crash at any point leaves either the old file or the complete new one, never a partial file.
    ``write`` gets a temporary path in the same directory (a rename across filesystems is not
    atomic) and must leave the finished file there. The temp file is removed if ``write`` fails;
    stale temp files of killed processes in that directory are removed first.
    """
    target = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=_temp_prefix(target), suffix=f".tmp{target.suffix}",
                                    dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    except BaseException as error:
        tmp.unlink(missing_ok=True)
        cause = _os_error_in(error)
        if cause is not None:
            raise OutputError(
                f"Could not write {str(target)!r}: {cause.strerror or cause} "
                f"({_free_space(target.parent)} free there); the file that was there, if any, "
                "is unchanged.") from None
        raise
    return target


def _os_error_in(error: BaseException) -> OSError | None:
    """The ``OSError`` behind ``error`` (libraries such as h5py wrap it), if any."""
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, OSError) and getattr(seen, "errno", None) is not None:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _free_space(folder: Path) -> str:
    try:
        free: float = shutil.disk_usage(folder).free
    except OSError:
        return "unknown space"
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if free < 1024 or unit == "TiB":
            return f"{free:.0f} {unit}" if unit == "bytes" else f"{free:.1f} {unit}"
        free /= 1024
    return f"{free:.1f} TiB"


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Atomically replace ``path`` with ``text`` (UTF-8)."""
    return atomic_write(path, lambda tmp: tmp.write_bytes(text.encode("utf-8")))


def atomic_write_npy(path: str | os.PathLike, array: np.ndarray) -> Path:
    """Atomically replace ``path`` with ``array`` as a ``.npy`` file (never pickled)."""
    def save(tmp: Path) -> None:
        with open(tmp, "wb") as handle:  # a handle: np.save would add .npy to the temp name
            np.save(handle, array, allow_pickle=False)

    return atomic_write(path, save)


def _pointer_token(key: Any) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def _finite_copy(value: Any, pointer: str, non_finite: dict[str, str]) -> Any:
    if isinstance(value, (float, np.floating)):
        number = float(value)
        if math.isfinite(number):
            return number if isinstance(value, np.floating) else value
        if math.isnan(number):
            non_finite[pointer] = "NaN"
        else:
            non_finite[pointer] = "Infinity" if number > 0 else "-Infinity"
        return None
    if isinstance(value, dict):
        return {key: _finite_copy(item, f"{pointer}/{_pointer_token(key)}", non_finite)
                for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_copy(item, f"{pointer}/{index}", non_finite)
                for index, item in enumerate(value)]
    if isinstance(value, np.ndarray):
        return _finite_copy(value.tolist(), pointer, non_finite)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


def strict_json_payload(payload: Any) -> Any:
    """``payload`` with every non-finite float as ``None`` and the ``"non_finite"`` record added.

    Numpy scalars and arrays become plain numbers and lists. A payload with non-finite numbers
    must be a dict (the record needs a place); one that already has a ``"non_finite"`` key is
    refused (``ValueError``): the record would overwrite it.
    """
    non_finite: dict[str, str] = {}
    converted = _finite_copy(payload, "", non_finite)
    if isinstance(payload, dict) and NON_FINITE_KEY in payload:
        raise OutputError("Cannot write strict JSON: the payload has its own "
                         f"{NON_FINITE_KEY!r} key, which the record of non-finite numbers "
                         "would overwrite.")
    if non_finite:
        if not isinstance(converted, dict):
            raise OutputError("Cannot write strict JSON: non-finite numbers at "
                             f"{sorted(non_finite)} need a top-level object for their record. "
                             f"Received: {type(payload).__name__}.")
        converted[NON_FINITE_KEY] = non_finite
    return converted


def strict_json_text(payload: Any, indent: int | None = 2) -> str:
    """``payload`` as strict JSON text (no bare NaN / Infinity: see ``strict_json_payload``), for
    files and for JSON printed to stdout alike."""
    return json.dumps(strict_json_payload(payload), indent=indent, sort_keys=False, allow_nan=False)


def atomic_write_json(path: str | os.PathLike, payload: Any) -> Path:
    """Atomically write ``payload`` as indented strict JSON (non-finite numbers: see the module
    doc)."""
    return atomic_write_text(path, strict_json_text(payload) + "\n")


def restore_non_finite(payload: Any) -> Any:
    """``payload`` read from a file ``atomic_write_json`` wrote, with its non-finite numbers
    back."""
    if not isinstance(payload, dict) or not isinstance(payload.get(NON_FINITE_KEY), dict):
        return payload
    for pointer, name in payload.pop(NON_FINITE_KEY).items():
        *parents, last = [token.replace("~1", "/").replace("~0", "~")
                          for token in pointer.split("/")[1:]]
        container = payload
        for token in parents:
            container = container[int(token) if isinstance(container, list) else token]
        container[int(last) if isinstance(container, list) else last] = _NON_FINITE_NAMES[name]
    return payload


def read_json(path: str | os.PathLike) -> Any:
    """The JSON value in ``path`` (UTF-8), non-finite numbers restored (``restore_non_finite``)."""
    with open(path, encoding="utf-8") as handle:
        return restore_non_finite(json.load(handle))


def read_arrays(path: str | os.PathLike, flag: str) -> list[np.ndarray]:
    """The array of a user's ``.npy`` file, as a list of one. Never unpickles. A missing, empty,
    cut or foreign file is a one-line ``DataError`` naming ``flag`` (NumPy itself would call a
    text file "pickled data" and a zero-byte one an ``EOFError``)."""
    with path_errors(path, flag, DataError):
        file = Path(path)
        found = file.is_file()
    if not found:
        raise DataError(f"Invalid {flag} {str(path)!r}: file not found (expected a .npy array).")
    try:
        with open(file, "rb") as handle:
            head = handle.read(len(NPY_MAGIC))
        if head == NPY_MAGIC:
            return [np.load(file, allow_pickle=False)]
        size = file.stat().st_size
    except _ARRAY_READ_ERRORS as error:
        reason = " ".join(str(error).split())[:200] or type(error).__name__
        raise DataError(
            f"Invalid {flag} {str(path)!r}: not a readable .npy file ({reason})."
        ) from None
    raise DataError(f"Invalid {flag} {str(path)!r}: expected a .npy array. Received: {size} bytes "
                    "without a NumPy header (empty, cut, or another format).")


def read_array(path: str | os.PathLike, flag: str) -> np.ndarray:
    """The one array of a user's ``.npy`` file (see ``read_arrays``)."""
    return read_arrays(path, flag)[0]


def _nearest_existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def check_output_folder(path: str | os.PathLike, flag: str) -> Path:
    """``path`` if it is (or can become) a writable folder, else a one-line ``ConfigError``;
    stale temp files in it are removed (as ``check_output_path`` does)."""
    with path_errors(path, f"{flag} path"):
        target = Path(path)
        existing = _nearest_existing(target)
        if not existing.is_dir():
            raise ConfigError(f"Invalid {flag} folder {str(path)!r}: {str(existing)!r} is a "
                              "file, not a folder.")
        if not _can_create_files_in(existing):
            raise ConfigError(
                f"Invalid {flag} folder {str(path)!r}: {str(existing)!r} is not writable.")
        if existing == target:
            remove_stale_temp_files(target)  # a killed run's temp files: gone at the next start
        return target


def _can_create_files_in(folder: Path) -> bool:
    """Whether a file can be created in ``folder``: tried (an unnamed temporary file, gone when
    closed), since permission bits say yes to root on read-only or virtual file systems."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def check_distinct_paths(outputs: dict[str, Any], inputs: dict[str, Any] | None = None) -> None:
    """A one-line ``ConfigError`` when an output path resolves to an input of the same command
    or to another of its outputs (``predict --out M.keras`` would replace the trained model,
    ``train --save S --history S`` the model by its history). ``outputs`` and ``inputs`` map a
    flag to its path (None: not given); a builder's ``FILE.py:FUNCTION`` counts as its file."""
    seen: dict[Path, str] = {}
    for flag, value in (inputs or {}).items():
        if value is not None:
            text = str(value)
            if ":" in text and not Path(text).exists():
                text = text.rsplit(":", 1)[0]
            with path_errors(text, f"{flag} path"):
                seen.setdefault(Path(text).resolve(), flag)
    for flag, value in outputs.items():
        if value is None:
            continue
        with path_errors(value, f"{flag} path"):
            resolved = Path(value).resolve()
        if resolved in seen:
            raise ConfigError(f"Invalid {flag} path {str(value)!r}: it is also {seen[resolved]}; "
                              "writing it would destroy that file. Choose another path.")
        seen[resolved] = flag


def check_output_path(path: str | os.PathLike, flag: str, suffix: str | None = None) -> Path:
    """``path`` if a file can be written there, else a one-line ``ConfigError`` naming ``flag``.

    Checked before any work: the folder exists (or can be created) and is writable, and the path
    itself is not a folder. ``suffix`` (e.g. ``.keras``) is required where the format needs it.
    Temp files a killed earlier run left in the folder are removed (``io.remove_stale_temp_files``:
    only those whose process is gone), so they disappear at the next start, not at the next write.
    """
    with path_errors(path, f"{flag} path"):
        target = Path(path)
        shown = str(path)
        if suffix is not None and target.suffix != suffix:
            raise ConfigError(
                f"Invalid {flag} path {shown!r}: expected a file name ending in {suffix}.")
        if target.is_dir():
            raise ConfigError(
                f"Invalid {flag} path {shown!r}: it is a folder; expected a file path.")
        existing = _nearest_existing(target.parent)
        if not existing.is_dir():
            raise ConfigError(
                f"Invalid {flag} path {shown!r}: {str(existing)!r} is a file, not a folder.")
        if not _can_create_files_in(existing) or (
                target.exists() and not os.access(target, os.W_OK)):
            raise ConfigError(
                f"Invalid {flag} path {shown!r}: {str(existing)!r} is not writable.")
        if existing == target.parent:
            remove_stale_temp_files(existing)  # a killed run's temp files: gone at the next start
        return target
