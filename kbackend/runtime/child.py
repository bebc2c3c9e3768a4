"""The one way kbackend runs code under another Keras backend: a child process.

Keras picks its backend once per process, so anything that needs the other backend (a benchmark
per backend, an export check, the equivalence workers) starts a child. This module owns:

- the child's environment (``child_environment``): ``KERAS_BACKEND``, ``PYTHONPATH`` so the child
  imports this very kbackend, quiet TensorFlow logging, virtual CPU devices when asked;
- the reply shape both ends agree on (``reply_ok`` / ``reply_error``):
  ``{"ok": True, "result": ...}`` or ``{"ok": False, "error": "Type: message", "traceback": ...}``,
  used by one-shot children here and by the long-lived equivalence workers;
- one-shot calls (``run_in_child``): ``python -m kbackend.runtime.child REQUEST`` imports the target
  ``"module:function"``, calls it with JSON keyword arguments and writes the reply as JSON,
  atomically, to a result file (the only result channel: whatever the child prints is just log);
  a failure, a crash or a timeout is one ``ChildFailed`` line with the child's last error line.
"""

from __future__ import annotations

import collections
import importlib
import os
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kbackend import logs
from kbackend.backend_choice import use_backend, validate_backend
from kbackend.backends.capabilities import VIRTUAL_DEVICES_ENV
from kbackend.errors import KBackendError
from kbackend.io import atomic_write_json, read_json

PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])

_TAIL_LINES = 20


class ChildFailed(KBackendError):
    """A child process raised, crashed or returned no result."""


class ChildTimeout(ChildFailed):
    """A child process ran past its time limit and was killed."""


def child_environment(backend: str, *, virtual_devices: int | None = None,
                      extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child process that runs Keras on ``backend``.

    It inherits this process's environment, imports the same kbackend whatever its working
    directory, and keeps TensorFlow's C++ logging quiet unless the caller chose a level.
    ``virtual_devices`` splits the host CPU into that many devices (JAX reads it at start-up).
    ``extra`` is applied last (e.g. ``XLA_FLAGS``).
    """
    env = dict(os.environ)
    env["KERAS_BACKEND"] = validate_backend(backend)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"  # the child's log lines arrive as they are written
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if virtual_devices is not None:
        env[VIRTUAL_DEVICES_ENV] = str(virtual_devices)
        env["JAX_NUM_CPU_DEVICES"] = str(virtual_devices)
    env.update(extra or {})
    return env


def reply_ok(result: Any) -> dict[str, Any]:
    """The reply of a call that returned ``result``."""
    return {"ok": True, "result": result}


def reply_error(error: BaseException) -> dict[str, Any]:
    """The reply of a call that raised ``error`` (call inside the ``except`` block)."""
    return {"ok": False, "error": f"{type(error).__name__}: {error}",
            "traceback": traceback.format_exc()}


def last_error_line(lines: list[str]) -> str:
    """The most telling line of a child's output: its last non-empty line, or 'no output'."""
    useful = [line.strip() for line in lines if line.strip()]
    return useful[-1] if useful else "no output"


def run_in_child(target: str, backend: str, kwargs: Mapping[str, Any] | None = None, *,
                 timeout_s: float | None = None, virtual_devices: int | None = None,
                 extra_env: Mapping[str, str] | None = None, echo: bool = False) -> Any:
    """Call ``target`` (``"module:function"``) with ``kwargs`` in a child process on ``backend``
    and return its result.

    ``kwargs`` and the result must be JSON-able. ``echo`` copies the child's output to this
    process's stderr as it arrives (progress lines); otherwise it is kept only for the error.
    Raises ``ChildFailed`` (or ``ChildTimeout`` after ``timeout_s`` seconds) with one line.
    """
    backend = validate_backend(backend)
    label = f"{target} on {backend}"
    env = child_environment(backend, virtual_devices=virtual_devices, extra=extra_env)
    with tempfile.TemporaryDirectory(prefix="kbackend-child-") as folder:
        request, result = Path(folder) / "request.json", Path(folder) / "result.json"
        atomic_write_json(request, {"target": target, "kwargs": dict(kwargs or {}),
                                    "result": str(result)})  # strict JSON, as every file
        process = subprocess.Popen(
            [sys.executable, "-m", "kbackend.runtime.child", str(request)], env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, errors="replace")
        tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        reader = threading.Thread(target=_drain, args=(process.stdout, tail, echo), daemon=True)
        reader.start()
        try:
            status = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            reader.join(timeout=5)  # a grandchild may still hold the pipe open
            raise ChildTimeout(f"Child process {label} did not finish within {timeout_s:g} s; "
                               f"killed it. Last output: {last_error_line(list(tail))}") from None
        reader.join()
        if not result.exists():
            raise ChildFailed(f"Child process {label} exited with status {status} and no result. "
                              f"Last output: {last_error_line(list(tail))}")
        reply = read_json(result)
    if not reply["ok"]:
        first_line = last_error_line(reply["error"].splitlines()[:1])
        raise ChildFailed(f"Child process {label} failed: {first_line}")
    return reply["result"]


def _drain(stream: Any, tail: collections.deque[str], echo: bool) -> None:
    verbose = logs.verbose_requested()
    for line in stream:
        tail.append(line)
        # Echoed lines are this process's own writes, which the fd filter never sees.
        if echo and (verbose or not logs.is_framework_log(line.encode(errors="replace"))):
            sys.stderr.write(line)
            sys.stderr.flush()
    stream.close()


def resolve(target: str) -> Any:
    """The function named by ``"module:function"`` (``function`` may be dotted)."""
    module_name, _, name = target.partition(":")
    if not module_name or not name:
        raise ChildFailed(
            f"Invalid child target. Expected 'module:function'. Received: {target!r}.")
    value: Any = importlib.import_module(module_name)
    for part in name.split("."):
        value = getattr(value, part)
    return value


def main(argv: list[str] | None = None) -> int:
    """Child side: read the request file, call the target, write the reply; 0 on success."""
    (request_path,) = sys.argv[1:] if argv is None else argv
    request = read_json(request_path)
    try:
        use_backend()
        reply = reply_ok(resolve(request["target"])(**request["kwargs"]))
    except Exception as error:
        reply = reply_error(error)
        sys.stderr.write(reply["traceback"])
    try:
        atomic_write_json(request["result"], reply)
    except (TypeError, ValueError) as error:  # the result is not JSON-able
        reply = reply_error(error)
        atomic_write_json(request["result"], reply)
    return 0 if reply["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
