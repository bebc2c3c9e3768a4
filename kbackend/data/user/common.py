"""What every data source shares: where an error points (``Where``), the memory limit, the
checks every split ends with, string labels as class indices, and the ``Splits`` each reader's
``read()`` returns, made a ``UserData`` by ``finish``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil

from kbackend.data import DatasetInfo
from kbackend.errors import DataError, error_text

KINDS = ("arrays", "csv", "images", "text", "tfds", "function")
SPLITS = ("train", "val", "test")
# Folder, TFDS and dict split names -> kbackend's.
SPLIT_NAMES = {"train": "train", "val": "val", "validation": "val", "valid": "val", "dev": "val",
               "test": "test"}
NPZ_PAIRS = (("train", "x_train", "y_train"), ("val", "x_val", "y_val"),
             ("test", "x_test", "y_test"))
_NPZ_NAMES = {"x", "y"} | {key for _, *keys in NPZ_PAIRS for key in keys}
TEXT_MAX_TOKENS = 20_000
TEXT_SEQUENCE_LENGTH = 200
MEMORY_FRACTION = 0.5
READ_BATCH = 256


@dataclass(frozen=True)
class UserData:
    """A user's data as NumPy arrays: ``splits["train"]`` always, ``"val"`` and ``"test"`` when
    the source has them, each ``(x, y)``. Labels are unchecked against any model."""

    name: str  # for histories and reports: "train.npz", "diabetes.csv", "tfds:mnist"
    source: str  # the source string as given
    splits: dict[str, tuple[np.ndarray, np.ndarray]]
    kind: str  # one of KINDS
    class_names: tuple[str, ...] | None = None  # class folders, string labels, TFDS class labels
    notes: tuple[str, ...] = ()  # lines to print (what was done to the data on the way)
    # The arrays were made here (read from a file), referenced by nothing else: the caller may
    # take its splits out of them in place (``kbackend.data.take_rows``) instead of copying.
    owned: bool = False
    # What the source says of the data beside its arrays (a built-in dataset's description:
    # its source, layout, data format and classes), else None.
    info: DatasetInfo | None = None


def default_max_bytes() -> int:
    """How much a source may hold in memory: half the memory available now."""
    return int(psutil.virtual_memory().available * MEMORY_FRACTION)


@dataclass(frozen=True)
class Where:
    """What an error names: ``data source 'train.npz'`` or ``data 'arrays'``."""

    what: str

    def error(self, reason: str) -> DataError:
        return DataError(" ".join(f"Invalid {self.what}: {reason}".split()))


def _check_limit(where: Where, nbytes: int, max_bytes: int, what: str) -> None:
    if nbytes > max_bytes:
        raise where.error(
            f"{what} would take {nbytes:,} bytes in memory, more than the {max_bytes:,} allowed "
            "(max_bytes; by default half the available memory). Use a smaller subset, or train "
            "from it in a script with your own input pipeline.")


@contextmanager
def reading(where: Where, what: str, errors: tuple[type[BaseException], ...]) -> Iterator[None]:
    """``errors`` raised inside as a one-line error, ``what (reason).``; a ``DataError`` (a
    check's own) passes as it is."""
    try:
        yield
    except DataError:
        raise
    except errors as error:
        raise where.error(f"{what} ({error_text(error)}).") from None


# --- the checks every source ends with ---------------------------------------------------

def _check_output_labels(where: Where, split: str, x: Any, y: dict) -> tuple[np.ndarray, dict]:
    """``(x, y)`` where ``y`` holds a multi-output model's labels, a dict keyed by output name:
    each checked as one output's labels (numbers; class names are for one output)."""
    if not y or not all(isinstance(key, str) for key in y):
        raise where.error(f"the labels of the {split} split are a dict: expected one array per "
                          f"model output, keyed by output name. Received keys: {list(y)}.")
    checked = {}
    for key, labels in y.items():
        x, checked[key] = _check_split(where, split, x, labels, f"y[{key!r}]")
        if checked[key].dtype.kind in "US":
            raise where.error(f"labels y[{key!r}] of the {split} split are strings: a "
                              "multi-output model's labels are numbers (class indices).")
    return x, checked


def _check_split(where: Where, split: str, x: Any, y: Any, y_name: str = "y"
                 ) -> tuple[np.ndarray, Any]:
    """``(x, y)`` as arrays (``y`` a dict of arrays for a multi-output model), or a one-line
    error saying what is wrong with them."""
    if isinstance(y, dict):
        return _check_output_labels(where, split, x, y)
    try:
        x, y = np.asarray(x), np.asarray(y)
    except (ValueError, TypeError) as error:
        raise where.error(f"the {split} split is not a pair of arrays "
                          f"({error_text(error)}).") from None
    for role, values in (("x", x), (y_name, y)):
        if values.ndim == 0:
            raise where.error(f"{role} of the {split} split is a single value (shape ()): "
                              "expected an array with one entry per sample.")
    if len(x) == 0 or len(y) == 0:
        raise where.error(f"the {split} split is empty: x has {len(x)} samples and y has "
                          f"{len(y)}; expected at least 1.")
    if len(x) != len(y):
        raise where.error(f"x and {y_name} of the {split} split differ in length: x has "
                          f"{len(x)} samples but {y_name} has {len(y)}.")
    if x.dtype.kind in "OS":  # strings (a tf.data string tensor reads as bytes objects)
        x = text_array(x, where.error, f"x of the {split} split")
    if x.dtype.kind not in "biufUO":  # "O": strings only, text_array checked them
        raise where.error(
            f"x of the {split} split holds {_dtype_words(x.dtype)}: expected numbers or "
            "strings (for a model whose string preprocessing layers come first).")
    if y.dtype.kind not in "biufUS":
        raise where.error(f"y of the {split} split holds {_dtype_words(y.dtype)}: expected "
                          "numbers or string class names.")
    if y.dtype.kind in "US" and y.ndim != 1:
        raise where.error(f"string labels of the {split} split must be 1-D (one class name per "
                          f"sample). Received: y.shape={y.shape}.")
    for role, values in (("inputs", x), ("labels", y)):
        if values.dtype.kind == "f":
            bad = ~np.isfinite(values.reshape(len(values), -1)).all(axis=1)
            if bad.any():
                index = int(np.argmax(bad))
                kind = "NaN" if np.isnan(values.reshape(len(values), -1)[index]).any() else "Inf"
                raise where.error(f"non-finite {role} ({kind}) in the {split} split, first at "
                                  f"index {index}: clean or drop those samples.")
    return x, y


def _dtype_words(dtype: np.dtype) -> str:
    if dtype.hasobject:
        return "Python objects (dtype object; strings as bytes objects count)"
    if dtype.kind in "US":
        return f"strings (dtype {dtype})"
    return f"values of dtype {dtype}"


@dataclass(frozen=True)
class Splits:
    """What every reader's ``read()`` returns: its splits as read (``(x, y)`` each, unchecked;
    ``y`` a dict by output for a multi-output model), with what ``UserData`` says of them."""

    name: str  # UserData.name
    kind: str  # one of KINDS
    splits: dict[str, tuple[Any, Any]]
    class_names: tuple[str, ...] | None = None
    notes: tuple[str, ...] = ()
    owned: bool = False  # the arrays were made by the reader: see UserData.owned


class Reader(ABC):
    """One kind of the user's data source, holding what it reads from; ``read()`` does the
    reading (the dataset made of what it read is keyed by its arrays: ``Dataset.digest``),
    ``check()`` what can be checked without a framework or the user's code."""

    where: Where

    @abstractmethod
    def read(self) -> Splits:
        """The source's splits as read (checked by ``finish``)."""

    def check(self) -> None:
        """What ``kbackend launch`` checks before any process starts (``check_source``): a
        file read with NumPy alone is read in full and checked (``finish``)."""
        finish(self.where, "", self)


def finish(where: Where, source: str, reader: Reader) -> UserData:
    """Every split ``reader`` reads checked, string labels mapped to class indices, as a
    ``UserData`` of ``source``."""
    read = reader.read()
    splits, class_names = read.splits, read.class_names
    if "train" not in splits:
        raise where.error(f"no training split. Received splits: {sorted(splits)}.")
    checked = {split: _check_split(where, split, *splits[split])
               for split in SPLITS if split in splits}
    x_shape, y_shape = checked["train"][0].shape[1:], _label_shape(checked["train"][1])
    for split, (x, y) in checked.items():
        if x.shape[1:] != x_shape or _label_shape(y) != y_shape:
            raise where.error(
                f"the {split} split's samples have shape x {x.shape[1:]}, y {_label_shape(y)}, "
                f"but the training split's have x {x_shape}, y {y_shape}.")
    string_labels = [split for split, (_, y) in checked.items()
                     if not isinstance(y, dict) and y.dtype.kind in "US"]
    if string_labels and len(string_labels) != len(checked):
        raise where.error(f"labels are class names in the {', '.join(string_labels)} split(s) "
                          "but numbers in the others: use one kind throughout.")
    if string_labels:
        checked, class_names = _encode_labels(where, checked)
    return UserData(name=read.name, source=source, splits=checked, kind=read.kind,
                    class_names=class_names, notes=tuple(read.notes), owned=read.owned)


def _label_shape(y: Any) -> Any:
    """A label's shape per sample; a multi-output model's labels: a dict of them by output."""
    return {key: value.shape[1:] for key, value in y.items()} if isinstance(y, dict) \
        else y.shape[1:]


def _label_text(values: np.ndarray) -> np.ndarray:
    return np.char.decode(values, "utf-8") if values.dtype.kind == "S" else values


def _encode_labels(where: Where, splits: dict[str, tuple[np.ndarray, np.ndarray]]
                   ) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], tuple[str, ...]]:
    """String labels -> int32 indices of the training split's sorted class names."""
    names = np.unique(_label_text(splits["train"][1]))
    if len(names) < 2:
        raise where.error(f"every label of the training split is {str(names[0])!r}: "
                          "classification needs at least two classes.")
    encoded = {}
    for split, (x, y) in splits.items():
        text = _label_text(y)
        unknown = np.setdiff1d(text, names)
        if unknown.size:
            raise where.error(f"label {str(unknown[0])!r} of the {split} split is not a class "
                              f"of the training split ({len(names)} classes).")
        encoded[split] = (x, np.searchsorted(names, text).astype(np.int32))
    return encoded, tuple(str(name) for name in names)


def text_array(x: Any, error: Callable[[str], Exception], what: str) -> np.ndarray:
    """``x`` as an array of ``str`` (bytes decoded as UTF-8; ``object`` dtype, so one long text
    does not widen every row), or ``error(reason)`` raised."""
    array = np.asarray(x)
    if array.dtype.kind == "U":
        return array
    flat = array.reshape(-1).tolist()
    if array.dtype.kind not in "OS" or not all(isinstance(i, str | bytes) for i in flat):
        raise error(f"{what} holds {_dtype_words(array.dtype)}: expected strings.")
    return np.array([i.decode("utf-8", "replace") if isinstance(i, bytes) else i
                     for i in flat], dtype=object).reshape(array.shape)


def _check_max_bytes(max_bytes: int | None) -> int:
    if max_bytes is None:
        return default_max_bytes()
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise DataError(f"Invalid max_bytes {max_bytes!r}: expected a positive integer.")
    return max_bytes
