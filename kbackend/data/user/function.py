"""``FILE.py:FUNCTION``: the user's module imported, the function called without arguments, its
result read as Python objects are."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from kbackend.data.user.common import Reader, Splits, Where
from kbackend.data.user.python import _splits_from_value
from kbackend.errors import DataError, InternalError, error_text, exit_call, path_errors


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

    def check(self) -> None:
        """The file parsed, not run: no user code runs before a job's processes start."""
        path = _python_file(self.where, self.file_text)
        try:
            ast.parse(path.read_bytes(), filename=str(path))
        except SyntaxError as error:
            raise self.where.error(f"syntax error at {path.name}:{error.lineno}: "
                                   f"{error.msg}.") from None


def _python_file(where: Where, file_text: str) -> Path:
    with path_errors(file_text, "data source", DataError):
        path = Path(file_text)
        found = path.is_file()
    if not found:
        raise where.error(f"Python file {file_text!r} not found (expected FILE.py:FUNCTION).")
    return path


def import_user_file(path: Path, prefix: str) -> ModuleType:
    """The module of the user's Python file ``path``, imported once per version of the file
    under a name made from ``prefix``, its path and its modification time (kept in
    ``sys.modules``: Keras's registered classes live there). While it runs, its folder is first
    on ``sys.path``, so it imports its neighbours as when run as a script. Whatever importing
    raises is raised as it is, the module forgotten (the caller words the one-line error)."""
    path = path.resolve()
    stat = path.stat()
    tag = hashlib.blake2b(f"{path}:{stat.st_mtime_ns}:{stat.st_size}".encode(),
                          digest_size=6).hexdigest()
    name = f"{prefix}_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}_{tag}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:  # every FILE.py has a source loader
        raise InternalError(f"{str(path)!r} has no Python module loader.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        if str(path.parent) in sys.path:
            sys.path.remove(str(path.parent))
    return module


def _load_function(where: Where, file_text: str, function: str, max_bytes: int) -> dict:
    path = _python_file(where, file_text)
    if not function.isidentifier():
        raise where.error(f"{function!r} is not a function name (expected FILE.py:FUNCTION).")
    try:
        module = import_user_file(path, "kbackend_user_data")
    except SyntaxError as error:
        raise where.error(f"syntax error at {path.name}:{error.lineno}: {error.msg}.") from None
    except Exception as error:
        raise where.error(f"importing {path.name} raised {error_text(error)}"
                          f"{_user_line(error, path)}.") from None
    except SystemExit as error:
        raise where.error(f"importing {path.name} called {exit_call(error)}"
                          f"{_user_line(error, path)}.") from None
    target = getattr(module, function, None)
    if not callable(target):
        defined = sorted(name for name, item in vars(module).items() if inspect.isfunction(item)
                         and item.__module__ == module.__name__ and not name.startswith("_"))
        what = "is not a function" if target is not None else "is not defined"
        raise where.error(f"{function!r} {what} in {path.name}. Functions there: {defined}.")
    _check_no_arguments(where, target, f"{path.name}:{function}")
    try:
        result = target()
    except Exception as error:
        raise where.error(f"{path.name}:{function}() raised {error_text(error)}"
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
