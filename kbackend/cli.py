"""The ``kbackend`` command line: build the parser, ``main(argv) -> int``, ``entrypoint()``.

Each subcommand lives in ``kbackend/commands/<name>.py`` and exposes ``register(subparsers,
parents)``, which adds its parser and sets ``func`` to a ``run(args) -> int``. Bad flags and
``KBackendError``s are one-line errors with exit status 2, never tracebacks.

Exit statuses: 0 success; 1 a check that ran and failed (``equiv``: a row over its tolerance);
2 bad input (a flag, a file, an option: nothing was run); 3 a multi-process job lost a peer;
4 training diverged (a loss became NaN or infinite: no model was saved); 130 interrupted.

Ctrl-C: ``main`` installs its SIGINT handler first (``install_interrupt_handler``). Python's own
raises ``KeyboardInterrupt`` wherever the main thread is, and inside a garbage-collection
callback (JAX registers one) or a finalizer the exception is printed as "Exception ignored" and
dropped, and a C extension module being initialised (JAX's MLIR libraries, NumPy's random
modules, imported in the first seconds) may drop it silently: either way the command went on
and exited 0. kbackend's handler raises only outside such code;
inside, it tries again shortly after, so every Ctrl-C ends the command with status 130. An
interrupt Python drops anyway (a weakref callback) reaches ``sys.unraisablehook``, which tries
again the same way.

Integer flags take at most ``commands.MAX_INT_FLAG`` (the frameworks count steps and sizes in
int32): ``--epochs 10**20`` is a one-line error, not a run that never ends.
"""

from __future__ import annotations

import _thread
import argparse
import atexit
import contextlib
import ctypes
import gc
import importlib
import importlib.machinery
import io
import os
import pkgutil
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, cast

from kbackend import __version__, commands, logs
from kbackend.backend_choice import BACKENDS, skip_optional_imports, use_backend
from kbackend.backends.compile_cache import COMPILE_CACHE_ENV
from kbackend.commands import LAUNCHER_PID_ENV, OneLineErrorParser, bound_integer_flags
from kbackend.errors import KBackendError
from kbackend.hardware.measure import REPROBE_ENV, request_reprobe
from kbackend.model_sources import IMPORT_ENV, register_imports

PROG = "kbackend"
# How soon a Ctrl-C that arrived inside a GC callback or a finalizer is raised again.
INTERRUPT_RETRY_S = 0.05


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser: global options plus one subparser per module in ``kbackend.commands``
    (``kbackend/commands/<name>.py`` registers the command ``<name>``); ``command``: that one
    alone (a command line runs one command; importing them all costs each start-up ~0.2 s)."""
    common = OneLineErrorParser(add_help=False)
    common.add_argument(
        "--backend", default=None, metavar="NAME",
        help=f"Keras backend: one of {', '.join(BACKENDS)} (default: $KERAS_BACKEND, else the "
             "\"backend\" of $KERAS_HOME/keras.json or ~/.keras/keras.json, else jax)",
    )
    common.add_argument(
        "--no-compile-cache", action="store_true",
        help="do not keep compiled programs between runs (JAX's persistent compilation cache; "
             f"the same as {COMPILE_CACHE_ENV}=0)",
    )
    common.add_argument(
        "--verbose", action="store_true",
        help="also show the frameworks' own log lines (TensorFlow, XLA, absl, Gloo C++ logs, "
             "tf.function retracing warnings), hidden by default; the same as "
             f"{logs.VERBOSE_ENV}=1. "
             "On serve, --verbose also logs every request",
    )
    parser = OneLineErrorParser(
        prog=PROG, description="Hardware-aware training with Keras 3 on JAX or TensorFlow.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND",
                                       parser_class=OneLineErrorParser)
    subparsers.required = True
    for name in command_names():
        if command not in (None, name):
            continue
        module = importlib.import_module(f"{commands.__name__}.{name}")
        module.register(subparsers, [common])
    bound_integer_flags(parser)
    return parser


def command_names() -> list[str]:
    """The names of the commands, without importing them."""
    return sorted(m.name for m in pkgutil.iter_modules(commands.__path__)
                  if not m.name.startswith("_"))


def _swallows_exceptions(frame: Any) -> bool:
    """Whether an exception raised in ``frame`` may be dropped: ``frame`` or a caller is a
    garbage-collection callback or a ``__del__`` (printed as "Exception ignored"), or the
    initialisation of a C extension module (JAX's MLIR and NumPy's random modules lost 3 of 48
    early Ctrl-Cs there: the command trained on and exited 0)."""
    callbacks = {getattr(callback, "__code__", None) for callback in list(gc.callbacks)}
    while frame is not None:
        code = frame.f_code
        if code in callbacks or code.co_name == "__del__":
            return True
        if code.co_name in ("create_module", "exec_module") and isinstance(
                frame.f_locals.get("self"), importlib.machinery.ExtensionFileLoader):
            return True
        frame = frame.f_back
    return False


def _retry_interrupt() -> None:
    time.sleep(INTERRUPT_RETRY_S)
    _thread.interrupt_main(signal.SIGINT)  # the handler runs again, in the main thread


def _on_interrupt(signum: int, frame: Any) -> None:
    if _swallows_exceptions(frame):
        _thread.start_new_thread(_retry_interrupt, ())
        return
    raise KeyboardInterrupt


def _unraisable_hook(unraisable: Any) -> None:
    """An interrupt that Python dropped anyway (raised in a weakref callback or a finalizer the
    frame test does not know): raised again shortly, not printed as "Exception ignored"."""
    if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
        _thread.start_new_thread(_retry_interrupt, ())
        return
    _previous_unraisable_hook(unraisable)


_previous_unraisable_hook = sys.unraisablehook


def install_interrupt_handler() -> Any:
    """Make Ctrl-C a ``KeyboardInterrupt`` that nothing swallows (the module's docstring);
    returns the handler it replaced (None: nothing installed: not the main thread, or SIGINT
    ignored by whoever started this process, which then stays ignored)."""
    global _previous_unraisable_hook
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:
        return None
    signal.signal(signal.SIGINT, _on_interrupt)
    if sys.unraisablehook is not _unraisable_hook:
        _previous_unraisable_hook, sys.unraisablehook = sys.unraisablehook, _unraisable_hook
    return previous


def _die_with_launcher() -> None:
    """In a ``kbackend launch`` worker: end with the launcher. On Linux the kernel sends SIGKILL
    when the launcher dies (PR_SET_PDEATHSIG), even by ``kill -9``; elsewhere a thread watches
    the parent's id. A launcher already gone (before the signal was armed): exit at once."""
    value = os.environ.pop(LAUNCHER_PID_ENV, "")  # this worker's children are not its workers
    if not value.isdigit():
        return
    launcher = int(value)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    else:
        def watch() -> None:
            while os.getppid() == launcher:
                time.sleep(0.5)
            os._exit(3)

        threading.Thread(target=watch, name="launcher-watch", daemon=True).start()
    if os.getppid() != launcher:
        os._exit(3)


def main(argv: Sequence[str] | None = None, *, own_process: bool = False) -> int:
    """Run the command line with ``argv`` and return the exit status.

    ``own_process``: this process is the command's alone (``entrypoint``), so the frameworks'
    C++ log lines may be filtered out of its file descriptors 1 and 2 (``kbackend.logs``), and
    it ends with its launcher when ``kbackend launch`` started it. Ctrl-C is handled from the
    first line (``install_interrupt_handler``); in another caller's process the caller's
    handler is put back on return.
    """
    previous = install_interrupt_handler()
    # --import and --reprobe record themselves in the environment for the processes a command
    # starts; in another caller's process they are undone on return (not handed to its next call)
    recorded = {name: os.environ.get(name) for name in (IMPORT_ENV, REPROBE_ENV)}
    try:
        return _main(argv, own_process)
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted\n")
        return 130
    finally:
        if previous is not None and not own_process:
            signal.signal(signal.SIGINT, previous)
            sys.unraisablehook = _previous_unraisable_hook
        if not own_process:
            for name, value in recorded.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _main(argv: Sequence[str] | None, own_process: bool) -> int:
    if own_process:
        _die_with_launcher()
        # A console that cannot encode a path (PYTHONIOENCODING=ascii, a C locale) shows it
        # escaped instead of ending a finished command with UnicodeEncodeError.
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(AttributeError, ValueError):
                # TextIO declares no reconfigure; a stream without one is skipped (AttributeError)
                cast(io.TextIOWrapper, stream).reconfigure(errors="backslashreplace")
    argv = list(sys.argv[1:] if argv is None else argv)
    named = argv[0] if argv and argv[0] in command_names() else None
    parser = build_parser(named)  # no command named (--help, a typo): every command, listed
    args = parser.parse_args(argv)
    verbose = logs.verbose_requested(args.verbose)
    logs.quiet_python_logs(verbose)
    if own_process:  # before any framework is imported: their libraries log as they load
        skip_optional_imports()
        if verbose:
            os.environ[logs.VERBOSE_ENV] = "1"  # child processes (launch's) show theirs too
        else:
            logs.install_filter()
    try:
        if args.no_compile_cache:
            os.environ[COMPILE_CACHE_ENV] = "0"  # read when the backend starts
        if getattr(args, "reprobe", False):
            request_reprobe()  # an environment variable: launch's processes inherit it
        needs_backend = getattr(args, "needs_backend", True)
        if needs_backend:
            use_backend(args.backend)
        if getattr(args, "imports", None):  # --import: here, and in every process started
            register_imports(args.imports, import_now=needs_backend)
        return int(args.func(args) or 0)
    except KBackendError as error:
        sys.stderr.write(f"{PROG}: error: {error}\n")
        return error.exit_status


def entrypoint() -> None:
    """Console-script entry point."""
    _exit_now(main(own_process=True))


def _exit_now(code: int) -> None:
    """End the process with ``code`` once the exit handlers ran and the output is flushed,
    skipping the interpreter's teardown of the frameworks' modules (0.3-0.4 s after a JAX or
    TensorFlow run: ``scripts/profile_startup.py``).

    Files that must survive are written atomically before this point; threads that are not
    daemons are waited for, as a normal exit would. It also ends a Ctrl-C'd run with 130
    directly: CPython ends a process by SIGINT (status -2, not 130) at exit when a
    KeyboardInterrupt once left code a C extension ran through PyRun_* (a flag it never
    clears; seen in 2 of 40 Ctrl-Cs at JAX's import), even though main caught it.
    """
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
