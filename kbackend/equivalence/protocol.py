"""Framing of the messages between the harness and its workers: length-prefixed pickles.

Requests and replies are plain dicts of Python scalars, strings, lists and NumPy arrays. Both
ends are the same kbackend version on the same machine, so pickle is safe and fast for arrays.
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import time
from typing import IO, Any

_HEADER = struct.Struct("!Q")


class ChannelClosed(EOFError):
    """The other end closed the pipe (the worker died or exited)."""


class ChannelTimeout(TimeoutError):
    """No complete message arrived before the deadline."""


def send(stream: IO[bytes], message: Any) -> None:
    """Write one message (header + pickle) and flush."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(body)) + body)
    stream.flush()


def _read_exactly(fd: int, size: int, deadline: float | None) -> bytes:
    chunks, remaining = [], size
    while remaining:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise ChannelTimeout(f"no reply within the deadline ({remaining} bytes missing)")
        chunk = os.read(fd, min(remaining, 1 << 20))
        if not chunk:
            raise ChannelClosed("the pipe was closed")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def receive(fd: int, timeout: float | None = None) -> Any:
    """Read one message from file descriptor ``fd``; ``timeout`` in seconds (None: wait forever)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    (size,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size, deadline))
    return pickle.loads(_read_exactly(fd, size, deadline))
