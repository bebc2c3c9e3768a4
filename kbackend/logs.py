"""Keeps the frameworks' own log lines off the console unless ``--verbose`` asks for them.

Why a file-descriptor filter and not environment variables: TensorFlow 2.21 prints absl's
"WARNING: All log messages before absl::InitializeLog() ..." and its oneDNN notice from static
initializers while its shared libraries load, twice (``libtensorflow_framework.so.2`` and
``python/profiler/internal/_pywrap_profiler_plugin.so`` each link a copy), before any setting is
read: ``TF_CPP_MIN_LOG_LEVEL=3``, ``GLOG_minloglevel=3`` and ``ABSL_MIN_LOG_LEVEL=3`` all leave
them (measured). XLA and absl write to file descriptor 2 from C++ as well, and Gloo (multi-process
JAX) prints "[Gloo] Rank 0 is connected ..." to fd 1, where no Python setting reaches. So, in a
``kbackend`` process (``install_filter``, called once at start, before JAX or TensorFlow is
imported), fds 1 and 2 become pipes that a thread each reads: lines in those formats are dropped,
every other line goes on to the real stream. ``sys.stdout`` and ``sys.stderr`` are pointed at the
real streams directly, so kbackend's own output, errors, tracebacks and progress lines never pass
through the filter (and a terminal stays a terminal for them). Fatal (``F``) lines always pass.
What a hard crash leaves in a pipe unread is lost: ``--verbose`` (``KBACKEND_VERBOSE=1``) turns
the filter off.

Python-side framework warnings (TensorFlow's "triggered tf.function retracing", absl's
``WARNING:absl:`` lines) are logger levels instead (``quiet_python_logs``).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import select
import sys
import threading
import time

VERBOSE_ENV = "KBACKEND_VERBOSE"
# Python loggers whose warnings are framework chatter, not kbackend's: shown with --verbose.
FRAMEWORK_LOGGERS = ("tensorflow", "absl")
_DROPPED = re.compile(
    # absl / glog: I0000 00:00:... port.cc:153]
    rb"^(?:[IWE]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [^\]\s]+:\d+\] "
    rb"|WARNING: All log messages before absl::InitializeLog\(\) is called"
    rb"|\[Gloo\] "  # jaxlib's CPU collectives: "[Gloo] Rank 0 is connected to 1 peer ranks..."
    rb"|This TensorFlow binary is optimized to use"
    rb"|To enable the following instructions: .* rebuild TensorFlow"
    rb")"
)
_JOIN_TIMEOUT_S = 2.0  # at exit, in all; only a child process still holding a pipe makes it wait
_PARTIAL_WAIT_S = 0.1
_installed: list[tuple[int, int, threading.Thread]] = []  # (fd, its real stream, its thread)


def verbose_requested(flag: bool = False) -> bool:
    """Whether the frameworks' logs are wanted: ``flag`` (``--verbose``) or
    ``$KBACKEND_VERBOSE``."""
    return flag or os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def is_framework_log(line: bytes) -> bool:
    """Whether ``line`` (one line of fd 2, newline or not) is a C++ framework log line to drop."""
    return _DROPPED.match(line) is not None


def quiet_python_logs(verbose: bool) -> None:
    """Show (``verbose``) or hide the frameworks' Python warnings (retracing, absl), errors kept."""
    for name in FRAMEWORK_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.ERROR)


class _OwnRetracing(logging.Filter):
    """Drops TensorFlow's "triggered tf.function retracing" warning about kbackend's own
    functions: a study builds one evaluator and trainer per model by design, so the count TF
    keeps across them is no sign of a mistake in the user's code (theirs still warn)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("triggered tf.function retracing" in message and "<kbackend." in message)


_OWN_RETRACING = _OwnRetracing()


def hide_own_retracing_warnings() -> None:
    """Installs ``_OwnRetracing`` on TensorFlow's logger (once; for the Python API, where
    ``quiet_python_logs`` does not run)."""
    logger = logging.getLogger("tensorflow")
    if _OWN_RETRACING not in logger.filters:
        logger.addFilter(_OWN_RETRACING)


def install_filter() -> bool:
    """Filter this process's fds 1 and 2 (see the module docstring); False if it already is.

    Call at process start, before JAX or TensorFlow is imported (their libraries log as they
    load). Child processes inherit the filtered descriptors. Not for a process that is not
    kbackend's own (the test runner, a notebook): it changes fds 1 and 2 for its whole life.
    """
    global _installed
    if _installed:
        return False
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = getattr(sys, name)
        stream.flush()
        real = os.dup(fd)  # not inheritable: children write through the filter too
        read_end, write_end = os.pipe()
        os.dup2(write_end, fd)
        os.close(write_end)
        # Python's own writes go straight to the real stream: never filtered, and a terminal
        # stays a terminal (rich's colours and live progress line).
        buffering = 1 if name == "stderr" or os.isatty(real) else -1
        direct = open(real, "w", buffering=buffering, encoding=stream.encoding,  # noqa: SIM115
                      errors=stream.errors, closefd=False)
        setattr(sys, name, direct)
        if getattr(sys, f"__{name}__") is stream:
            setattr(sys, f"__{name}__", direct)
        thread = threading.Thread(target=_forward, args=(read_end, real), daemon=True,
                                  name=f"kbackend-{name}-filter")  # daemon: joined in _finish
        thread.start()
        _installed.append((fd, real, thread))
    atexit.register(_finish)
    return True


def _forward(read_end: int, real: int) -> None:
    """Copy the pipe to the real stream line by line, dropping framework log lines.

    A line without its newline yet (a prompt, a progress bar) goes on after 0.1 s without
    more output, so nothing waits long for a newline that does not come.
    """
    pending = b""
    while True:
        if pending and not select.select([read_end], [], [], _PARTIAL_WAIT_S)[0]:
            if not is_framework_log(pending):
                _write_all(real, pending)
            pending = b""
            continue
        chunk = os.read(read_end, 65536)
        if not chunk:
            break
        *lines, pending = (pending + chunk).split(b"\n")
        _write_all(real, b"".join(line + b"\n" for line in lines if not is_framework_log(line)))
    if pending and not is_framework_log(pending):
        _write_all(real, pending)
    os.close(read_end)


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:
        pass  # the stream is gone (a closed terminal or pipe): nothing left to tell


def _finish() -> None:
    """At exit: give fds 1 and 2 back to the real streams (closing the pipes, unless a child
    still holds them), then let the threads write what is left."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a stream closed by the command
            stream.flush()
    for fd, real, _ in _installed:
        os.dup2(real, fd)
    deadline = time.monotonic() + _JOIN_TIMEOUT_S
    for _, _, thread in _installed:
        thread.join(max(deadline - time.monotonic(), 0.0))
