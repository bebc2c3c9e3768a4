"""A worker process's entry point: ``python -m kbackend.equivalence.worker`` with KERAS_BACKEND set.

Keras picks its backend once per process, so the harness runs one long-lived worker per backend
and feeds it requests over stdin; replies go over a private copy of the original stdout. The
worker points file descriptor 1 at stderr first, so whatever TensorFlow, XLA or Keras print can
never corrupt the protocol.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from typing import Any

from kbackend.backend_choice import active_backend, use_backend
from kbackend.backends import impl
from kbackend.equivalence import operations
from kbackend.equivalence.operations import channels_first_probe
from kbackend.equivalence.protocol import ChannelClosed, receive, send
from kbackend.errors import InternalError
from kbackend.runtime.child import reply_error, reply_ok


def _ping(probe: bool = False) -> dict[str, Any]:
    """The worker's pid, the backend's declared channels_first support and, with ``probe``,
    whether channels_first convolution and pooling actually run here (None) or the error."""
    reply: dict[str, Any] = {"pid": os.getpid(),
                             "supports_channels_first": impl().supports_channels_first_conv()}
    if probe:
        reply["channels_first_error"] = channels_first_probe()
    return reply


def _sleep(seconds: float) -> dict[str, Any]:
    """Stay busy for ``seconds`` (lets tests exercise timeouts and killed workers)."""
    time.sleep(seconds)
    return {"slept": seconds}


def _die_with_parent() -> None:
    """On Linux, have the kernel kill this worker when the harness process dies, so a crashed or
    killed caller never leaves workers behind (elsewhere they exit at their next request)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main() -> int:
    _die_with_parent()
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    use_backend()
    backend = active_backend()
    handlers: dict[str, Any] = {
        "ping": _ping, "sleep": _sleep, "describe": operations.describe,
        "evaluate": operations.evaluate, "predict_saved": operations.predict_saved,
        "engine_run": operations.engine_run}
    send(replies, {"ready": True, "backend": backend, "pid": os.getpid()})
    requests = sys.stdin.fileno()
    while True:
        try:
            request = receive(requests)
        except ChannelClosed:
            return 0
        op = request.get("op")
        if op == "exit":
            send(replies, {"ok": True, "result": None})
            return 0
        try:
            if op not in handlers:
                raise InternalError(f"unknown operation {op!r}; expected one of {sorted(handlers)}")
            reply = reply_ok(handlers[op](**request.get("args", {})))
        except Exception as error:
            reply = reply_error(error)
        send(replies, reply)


if __name__ == "__main__":
    raise SystemExit(main())
