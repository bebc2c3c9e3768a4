"""One module per ``kbackend`` subcommand; ``kbackend.cli`` discovers them.

Also what the commands' parsers share, below ``kbackend.cli`` so that a command (``launch``
parses its train arguments itself) never imports the command line that imports it: the
one-line-error parser, the bound on integer flags, and the variable a launcher hands its workers.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kbackend.errors import declared_rule, field_default

MAX_INT_FLAG = 2**31 - 1
# Set by ``kbackend launch`` in each worker's environment: the launcher's process id. A worker
# dies with its launcher (``cli._die_with_launcher``), so a killed launcher leaves none training.
LAUNCHER_PID_ENV = "KBACKEND_LAUNCHER_PID"


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
        if not self._shows_default(action) or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr and exit status 2, and whose
    help shows every default."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        # A stray word where a command takes an optional action (`study --progress off`):
        # argparse blames the action's choices, which names neither the word nor the slip.
        stray = _STRAY_WORD.fullmatch(message)
        if stray:
            choices = re.findall(r"'([^']*)'", stray["choices"])
            close = difflib.get_close_matches(stray["word"].strip("'"), choices, n=1)
            hint = (f"did you mean {close[0]!r}?" if close else
                    "options start with -- (a value given to a flag that takes none?)")
            message = (f"unexpected argument {stray['word']}: the words it takes are "
                       f"{', '.join(map(repr, choices))}; {hint}")
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)


_STRAY_WORD = re.compile(r"argument \[[^\]]*\]: invalid choice: (?P<word>'[^']*') "
                         r"\(choose from (?P<choices>.+)\)")


def add_import_flag(parser: Any) -> None:
    """``--import MODULE`` (repeatable), on every command that loads a model: the modules (names
    or ``FILE.py``) that register a model file's own classes; ``kbackend.cli`` imports them and
    hands them to every process the command starts (``model_sources.register_imports``)."""
    parser.add_argument(
        "--import", dest="imports", action="append", default=[], metavar="MODULE",
        help="import MODULE (a module name, or FILE.py) before loading a model, here and in "
             "every process this command starts: the module that registers a .keras file's "
             "own layers, losses or metrics (@keras.saving.register_keras_serializable); "
             "repeatable")


def add_reprobe_flag(parser: argparse.ArgumentParser) -> None:
    """``--reprobe`` (train, study, launch; ``kbackend.cli`` acts on it): take again the
    measurements kept per machine that the run would reuse."""
    parser.add_argument(
        "--reprobe", action="store_true",
        help="measure again what is kept per machine and this run would reuse (--fused-steps "
             "auto's K, --batch-size auto's throughput knee, the study's population choice; "
             "`kbackend info` lists them); with nothing stored it simply measures")


def declared_flag(group: Any, flag: str, owner: type, *, field: str | None = None,
                  extra_choices: Sequence[str] = (), **kwargs: Any) -> argparse.Action:
    """Add ``flag`` for the dataclass field ``owner.<field>`` (default: the flag's name) from
    the field's declaration (``errors.Declared``): its ``choices=`` (plus ``extra_choices``,
    words the command resolves itself), or for a bounded field what it accepts at the end of
    its help, and its default unless ``default=`` says otherwise, so that the command line and
    the Python API cannot drift apart."""
    name = field or flag.lstrip("-").replace("-", "_")
    rule = declared_rule(owner, name)
    kwargs.setdefault("default", field_default(owner, name))
    if rule.choices:
        kwargs["choices"] = [*rule.choices, *extra_choices]
    elif rule.low is not None or rule.high is not None:
        accepts = rule.expected() + (f"; {rule.why}" if rule.why else "")
        kwargs["help"] = f"{kwargs['help']} ({accepts})" if kwargs.get("help") else accepts
    return group.add_argument(flag, **kwargs)


def field_flags(args: argparse.Namespace, owner: type) -> dict[str, Any]:
    """The parsed flags named as fields of the dataclass ``owner``, to pass through to it (a
    field without a flag on this command keeps its default)."""
    return {item.name: getattr(args, item.name) for item in dataclasses.fields(owner)
            if hasattr(args, item.name)}


def expected_form(expected: str, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type: ``parse(text)``, any ``ValueError`` of it the one-line message
    "expected EXPECTED, got 'TEXT'"."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    return convert


def int_at_least(minimum: int, *, auto: bool = False) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum`` (with ``auto``: also the word ``auto``, as 0,
    for the command to decide)."""
    def parse(text: str) -> int:
        if auto and text == "auto":
            return 0
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            words = "a positive integer" if minimum == 1 else f"a whole number >= {minimum}"
            words += " or 'auto'" if auto else ""
            raise argparse.ArgumentTypeError(f"expected {words}, got {text!r}")
        return value
    parse.__name__ = "int"
    return parse


def bounded_int(text: str) -> int:
    """``int(text)`` within +-``MAX_INT_FLAG``; argparse says "invalid int value" otherwise."""
    value = int(text)
    if abs(value) > MAX_INT_FLAG:
        raise argparse.ArgumentTypeError(
            f"invalid int value: {text[:40]!r} (expected at most {MAX_INT_FLAG:,})")
    return value


bounded_int.__name__ = "int"  # argparse names the type in its messages


def bound_integer_flags(parser: argparse.ArgumentParser) -> None:
    """Give every ``type=int`` option of ``parser`` and its subcommands the ``bounded_int`` type."""
    for action in parser._actions:
        # (--seed is checked against NumPy's own range, [0, 2**32), by TrainConfig)
        if action.type is int and action.dest != "seed":
            action.type = bounded_int
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                bound_integer_flags(subparser)
