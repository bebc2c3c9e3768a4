"""Errors kbackend raises for bad input. Each message is one line: what was wrong,
what was expected, what was received, and what to do."""

import math
import numbers
import os
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import MISSING, dataclass, fields
from typing import Any


def error_text(error: BaseException, limit: int = 200) -> str:
    """What a one-line error quotes of the exception ``error``: its type and message on one line,
    at most about ``limit`` characters, never cut mid-word."""
    text = textwrap.shorten(" ".join(str(error).split()), width=limit, placeholder=" ...")
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class KBackendError(ValueError):
    """Base class: a user-facing error the CLI prints as one line (exit status 2)."""

    # The command line's exit status for this error (``kbackend.cli``'s documented statuses).
    exit_status = 2


class BackendError(KBackendError):
    """The backend choice is invalid or conflicts with an already imported Keras."""


class DataError(KBackendError):
    """A dataset is missing, or its arrays are not valid for training."""


class ConfigError(KBackendError):
    """A training, model or optimizer option is invalid."""


class ApiTypeError(ConfigError, TypeError):
    """The Python API was given the wrong kind of argument (no data, a model it cannot use):
    a ``TypeError`` too, as Python's own calls raise for wrong arguments."""


class StoredFileError(KBackendError):
    """A file kbackend wrote earlier (a measurement store) is damaged or not what it wrote."""


class InternalError(RuntimeError):
    """A broken invariant inside kbackend (a bug or a caller's misuse of an internal function),
    not bad input: deliberately no ``KBackendError``, so the CLI shows its traceback."""


class OutputError(KBackendError):
    """A file could not be written (disk full, quota, read-only): one line naming the path and
    the free space there; whatever was at the path is unchanged."""


class JobError(KBackendError):
    """A multi-process job did not form (a process missing, a foreign program at the
    coordinator's address, a mismatched job) or lost a process. The CLI exits with status 3."""

    exit_status = 3


class Diverged(KBackendError):
    """Training diverged: a train loss (or the trained weights) became NaN or infinite.

    ``step`` is the first step whose loss was not finite. The CLI exits with status 4; nothing
    made of NaN (model, prediction cache entry) was written.
    """

    exit_status = 4

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


def exit_call(error: SystemExit) -> str:
    """How a user's function ended the program, for a one-line error: ``sys.exit(3)``. The
    call is refused, not obeyed: an exit from a builder or a data function would end a run
    with no output and the function's status (0: success; 3: kbackend's lost process)."""
    return "sys.exit()" if error.code is None else f"sys.exit({str(error.code)[:60]!r})" \
        if not isinstance(error.code, int) else f"sys.exit({error.code})"


_TYPE_NAMES = {type(None): "None", numbers.Integral: "an integer", numbers.Real: "a number",
               int: "an integer", float: "a number", str: "a string", bool: "True or False"}
_NUMBERS = (numbers.Integral, numbers.Real, int, float)


def _type_error(owner: Any, name: str, value: Any, kinds: Any,
                why: str = "") -> ConfigError | None:
    """The one-line error for ``value`` of ``owner.name`` unless it is an instance of ``kinds``
    (a bool is not a number here unless ``bool`` is listed); ``why`` follows what is expected."""
    allowed = kinds if isinstance(kinds, tuple) else (kinds,)
    numeric = any(kind in _NUMBERS for kind in allowed)
    if isinstance(value, allowed) and not (numeric and isinstance(value, bool)
                                           and bool not in allowed):
        return None
    kinds_named = [_TYPE_NAMES.get(kind, kind.__name__) for kind in allowed]
    if "a number" in kinds_named:  # an integer is a number too
        kinds_named = [n for n in kinds_named if n != "an integer"]
    why = f" ({why})" if why else ""
    return ConfigError(f"Invalid {type(owner).__name__}.{name}: expected "
                       f"{' or '.join(dict.fromkeys(kinds_named))}{why}. "
                       f"Received: {value!r} ({type(value).__name__}).")


def check_field_types(owner: Any, expected: dict[str, Any]) -> None:
    """A one-line ``ConfigError`` for the first field of the dataclass ``owner`` whose value is
    not an instance of its expected type(s) in ``expected`` (a bool is not a number here), so
    that a wrong type from the Python API fails where it is given, not deep inside training."""
    for name, kinds in expected.items():
        error = _type_error(owner, name, getattr(owner, name), kinds)
        if error is not None:
            raise error


@dataclass(frozen=True)
class Declared:
    """A dataclass field's declared rule (``declared``): its type(s) (``None`` among them: may
    be None, and then nothing else is checked), bounds (``low``/``high``, open with ``open_low``/
    ``open_high``; ``finite`` refuses infinities), ``choices``, the one-line ``why`` the message
    and the command line's help give, and ``shown``, what the message calls the field (default:
    its name). ``check_declared`` checks it; the commands read it for ``choices=`` and help
    (``kbackend.commands.declared_flag``)."""

    types: Any
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    finite: bool = False
    choices: tuple[Any, ...] = ()
    why: str = ""
    # What the message calls the field where users know it by its flag (default: its name).
    shown: str = ""

    def expected(self) -> str:
        """What a valid value is, in words: "an integer from 1 to 1,000,000", "one of [...]"."""
        if self.choices:
            return f"one of {list(self.choices)}"
        kinds = self.types if isinstance(self.types, tuple) else (self.types,)
        integral = all(kind in (int, numbers.Integral, type(None)) for kind in kinds)
        noun = "an integer" if integral else "a finite number" if self.finite else "a number"
        low, high = (None if b is None else f"{b:,}" if integral else f"{b:g}"
                     for b in (self.low, self.high))
        if low is not None and high is not None:
            if integral and not (self.open_low or self.open_high):
                return f"{noun} from {low} to {high}"
            return f"{noun} in {'(['[not self.open_low]}{low}, {high}{')]'[not self.open_high]}"
        if low is not None:
            return f"{noun} {'>' if self.open_low else '>='} {low}"
        return noun if high is None else f"{noun} {'<' if self.open_high else '<='} {high}"

    def admits(self, value: Any) -> bool:
        """Whether ``value`` (of a declared type) is within the bounds and choices."""
        if self.choices:
            return value in self.choices
        if self.finite and not math.isfinite(value):
            return False
        return not ((self.low is not None and not (value > self.low if self.open_low
                                                   else value >= self.low))
                    or (self.high is not None and not (value < self.high if self.open_high
                                                       else value <= self.high)))


def declared(types: Any, **rule: Any) -> dict[str, Declared]:
    """A dataclass field's ``metadata`` declaring its rule: ``field(default=..., metadata=
    declared(int, low=1, why="..."))`` (the keywords are ``Declared``'s)."""
    return {"declared": Declared(types, **rule)}


def declared_rule(owner: Any, name: str) -> Declared:
    """The rule the dataclass (or instance) ``owner`` declares for its field ``name``."""
    return next(item.metadata["declared"] for item in fields(owner) if item.name == name)


def field_default(owner: Any, name: str) -> Any:
    """The default the dataclass ``owner`` declares for its field ``name`` (a factory's value
    made anew): the one statement of a default that the command line and the Python API read."""
    item = next((item for item in fields(owner) if item.name == name), None)
    if item is None:  # a programming error in kbackend, said at import time
        raise InternalError(f"{owner.__name__} has no field {name!r}")
    if item.default is not MISSING:
        return item.default
    if item.default_factory is not MISSING:
        return item.default_factory()
    raise InternalError(f"{owner.__name__}.{name} has no default")


def check_declared(owner: Any) -> None:
    """The one check of every declared field of the dataclass ``owner``, in field order: a
    one-line ``ConfigError`` naming the field for a wrong type ("Invalid TrainConfig.seed:
    expected an integer. Received: ...") or a value outside its bounds or choices ("Invalid
    seed -1: expected an integer from 0 to 4,294,967,295 (NumPy's seed range).")."""
    for item in fields(owner):
        rule = item.metadata.get("declared")
        if rule is None:
            continue
        value = getattr(owner, item.name)
        error = _type_error(owner, item.name, value, rule.types, rule.why)
        if error is not None:
            raise error
        if value is not None and not rule.admits(value):
            why = f" ({rule.why})" if rule.why else ""
            raise ConfigError(f"Invalid {rule.shown or item.name} {value!r}: expected "
                              f"{rule.expected()}{why}.")


def check_int_sequence(owner: Any, name: str) -> None:
    """A one-line ``ConfigError`` unless ``owner.name`` is a tuple or list of integers."""
    value = getattr(owner, name)
    if not isinstance(value, (tuple, list)) or not all(
            isinstance(item, numbers.Integral) and not isinstance(item, bool) for item in value):
        raise ConfigError(f"Invalid {type(owner).__name__}.{name}: expected a tuple of integers. "
                          f"Received: {value!r}.")


@contextmanager
def path_errors(path: str | os.PathLike, what: str,
                error_type: type[KBackendError] = ConfigError) -> Iterator[None]:
    """Inside, a path the system cannot even look at (a name too long, a NUL byte, a loop of
    links, a folder it may not search; from Python, not a path at all, such as None) becomes a
    one-line ``error_type`` naming ``what`` (e.g. ``--model``), not an ``OSError`` or
    ``TypeError`` traceback. Wrap making the ``Path`` and looking at it (``exists``, ``stat``,
    ``is_file``), not the reading: a file that is there but does not load says so itself."""
    try:
        yield
    except KBackendError:
        raise
    except (OSError, ValueError, TypeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise error_type(f"Invalid {what} {str(path)[:80]!r}: {reason}.") from None


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is a device running out of memory (XLA's ``RESOURCE_EXHAUSTED``, TF's
    OOM), the batch-size probes' signal that a size does not fit."""
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "OOM" in text
