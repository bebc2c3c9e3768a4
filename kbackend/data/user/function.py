"""``FILE.py:FUNCTION``: the user's module imported, the function called without arguments, its
result read as Python objects are."""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kbackend.data.user.common import Reader, Splits, Where, _reason
from kbackend.data.user.python import _splits_from_value
from kbackend.errors import DataError, exit_call, path_errors


def _user_line(error: BaseException, path: Path) -> str:
    """`` (at FILE:LINE)`` for the deepest frame of ``error`` in the user's file, if any."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if Path(frame.filename).resolve() == path.resolve()]
    return f" (at {path.name}:{frames[-1].lineno})" if frames else ""


@dataclass(frozen=True)
class FunctionSource(Reader):
    """``FILE.py:FUNCTION``: ``function`` in the Python file ``file_text``."""

    where: Where
    file_text: str
    function: str
    max_bytes: int

    def read(self) -> Splits:
        splits = _load_function(self.where, self.file_text, self.function, self.max_bytes)
        return Splits(name=f"{Path(self.file_text).name}:{self.function}", kind="function",
                      splits=splits)


def _load_function(where: Where, file_text: str, function: str, max_bytes: int) -> dict:
    with path_errors(file_text, "data source", DataError):
        path = Path(file_text)
        found = path.is_file()
    if not found:
        raise where.error(f"Python file {file_text!r} not found (expected FILE.py:FUNCTION).")
    if not function.isidentifier():
        raise where.error(f"{function!r} is not a function name (expected FILE.py:FUNCTION).")
    digest = hashlib.blake2b(str(path.resolve()).encode(), digest_size=6).hexdigest()
    module_name = f"kbackend_user_data_{path.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise where.error(f"{file_text!r} cannot be imported as a Python module.")
    module = importlib.util.module_from_spec(spec)
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)  # its own helper modules import, as when run as a script
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as error:
        sys.modules.pop(module_name, None)
        raise where.error(f"syntax error at {path.name}:{error.lineno}: {error.msg}.") from None
    except Exception as error:
        sys.modules.pop(module_name, None)
        raise where.error(f"importing {path.name} raised {_reason(error)}"
                          f"{_user_line(error, path)}.") from None
    except SystemExit as error:
        sys.modules.pop(module_name, None)
        raise where.error(f"importing {path.name} called {exit_call(error)}"
                          f"{_user_line(error, path)}.") from None
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    target = getattr(module, function, None)
    if not callable(target):
        defined = sorted(name for name, item in vars(module).items() if inspect.isfunction(item)
                         and item.__module__ == module_name and not name.startswith("_"))
        what = "is not a function" if target is not None else "is not defined"
        raise where.error(f"{function!r} {what} in {path.name}. Functions there: {defined}.")
    _check_no_arguments(where, target, f"{path.name}:{function}")
    try:
        result = target()
    except Exception as error:
        raise where.error(f"{path.name}:{function}() raised {_reason(error)}"
                          f"{_user_line(error, path)}.") from None
    except SystemExit as error:
        raise where.error(f"{path.name}:{function}() called {exit_call(error)}"
                          f"{_user_line(error, path)} instead of returning the data.") from None
    return _splits_from_value(where, result, max_bytes)


def _check_no_arguments(where: Where, function: Callable, label: str) -> None:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return
    required = [p.name for p in parameters if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if required:
        raise where.error(f"{label} needs arguments {required}: it is called with none.")


# --- the two entry points --------------------------------------------------------------------


def _function_parts(source: str) -> tuple[str, str] | None:
    head, separator, tail = source.rpartition(":")
    return (head, tail) if separator and head.lower().endswith(".py") else None
