"""The ``kbackend`` command line: build the parser, ``main(argv) -> int``, ``entrypoint()``.

Each subcommand lives in ``kbackend/commands/<name>.py`` and exposes ``register(subparsers,
parents)``, which adds its parser and sets ``func`` to a ``run(args) -> int``. Bad flags and
``KBackendError``s are one-line errors with exit status 2, never tracebacks.

Exit statuses: 0 success; 1 a check that ran and failed (``equiv``: a row over its tolerance);
2 bad input (a flag, a file, an option: nothing was run); 3 a multi-process job lost a peer;
4 training diverged (a loss became NaN or infinite: no model was saved); 130 interrupted.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import os
import pkgutil
import sys
from collections.abc import Sequence
from typing import Any

from kbackend import __version__, commands, logs
from kbackend.backend_choice import BACKENDS, skip_optional_imports, use_backend
from kbackend.backends.compile_cache import COMPILE_CACHE_ENV
from kbackend.errors import KBackendError

PROG = "kbackend"


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help unless it has no default, is an on/off flag or
    already says it."""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and self._shows_default(action):
            action = copy.copy(action)  # argparse prints no help line for an option without help
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    @staticmethod
    def _shows_default(action: argparse.Action) -> bool:
        return bool(action.option_strings) and action.nargs != 0 and \
            action.default not in (None, argparse.SUPPRESS)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.nargs == 0 or "default" in text
                or action.default in (None, argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)"


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr and exit status 2, and whose
    help shows every default."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)


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
             f"tf.function retracing warnings), hidden by default; the same as {logs.VERBOSE_ENV}=1. "
             "On serve, --verbose also logs every request",
    )
    parser = OneLineErrorParser(prog=PROG, description="Hardware-aware training with Keras 3 on JAX or TensorFlow.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineErrorParser)
    subparsers.required = True
    for name in command_names():
        if command not in (None, name):
            continue
        module = importlib.import_module(f"{commands.__name__}.{name}")
        module.register(subparsers, [common])
    return parser


def command_names() -> list[str]:
    """The names of the commands, without importing them."""
    return sorted(m.name for m in pkgutil.iter_modules(commands.__path__) if not m.name.startswith("_"))


def main(argv: Sequence[str] | None = None, *, own_process: bool = False) -> int:
    """Run the command line with ``argv`` and return the exit status.

    ``own_process``: this process is the command's alone (``entrypoint``), so the frameworks'
    C++ log lines may be filtered out of its file descriptors 1 and 2 (``kbackend.logs``).
    """
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
        if getattr(args, "needs_backend", True):
            use_backend(args.backend)
        return int(args.func(args) or 0)
    except KBackendError as error:
        sys.stderr.write(f"{PROG}: error: {error}\n")
        return error.exit_status
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted\n")
        return 130


def entrypoint() -> None:
    """Console-script entry point."""
    raise SystemExit(main(own_process=True))
