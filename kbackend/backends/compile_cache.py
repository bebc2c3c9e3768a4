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
from pathlib import Path

from kbackend.data.sources import cache_dir

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
