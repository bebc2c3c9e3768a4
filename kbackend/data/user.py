"""A user's own data: a source string (or Python objects) read into plain NumPy arrays.

``load_source(source)`` reads, by the source's form:

- ``PATH.npz``: arrays ``x_train``, ``y_train`` and optionally ``x_val``/``y_val``,
  ``x_test``/``y_test``; or ``x`` and ``y``. A multi-output model's labels: ``y_train_<output>``
  per output (``y_val_<output>``, ``y_test_<output>``), read as a dict by output. Each
  member's .npy header is read first: object arrays (which loading would unpickle) and archives
  declaring more than ``max_bytes`` are refused before any array is read, and so is a member
  whose zip entry and header disagree on its size.
  A ``.npy`` file is not a dataset (it has no labels).
- ``PATH.csv`` with ``label=COLUMN``: every other column a numeric feature (float32); the label
  column numbers (int when all are whole, else float) or strings (sorted class names -> indices).
- a folder of class subfolders (optionally under ``train/``, ``val/`` or ``validation/``, and
  ``test/``) holding images (``keras.utils.image_dataset_from_directory``; every image resized
  to the first image's size, grayscale when that one is, values 0-255 as float32, (N, H, W, C))
  or ``.txt`` files (``keras.utils.text_dataset_from_directory``, then a ``TextVectorization``
  adapted on the training split only turns them into int32 token ids (N, 200) on the host, in
  tf.data, which works under either Keras backend).
- ``tfds:NAME[:CONFIG]``: a prepared TensorFlow Datasets folder in ``$TFDS_DATA_DIR`` or
  ``~/tensorflow_datasets`` (the ``tfds`` extra), read with ``tfds.builder_from_directory``:
  nothing is ever downloaded, and a set prepared from the user's own builder code reads as well
  as a catalogue one. String inputs are vectorized as text folders are.
- ``FILE.py:FUNCTION``: the function, called without arguments, returns ``(x, y)``, a dict of
  splits (``{"train": (x, y), "val": ...}`` or the .npz key names), a ``tf.data.Dataset`` of
  ``(x, y)`` (batched or not) or a ``keras.utils.PyDataset``.

``from_python`` takes the same objects from Python. Datasets are read into memory up to
``max_bytes`` (default: half the memory available); an infinite one is refused.

What is checked here is what the source itself can say: at least one sample, x and y of equal
length, numeric inputs, no NaN or Inf in float inputs or labels (the split and first index
named), one sample shape across splits. Labels are not checked against any model: the caller
checks them against the model's loss. Every error is a one-line ``DataError``.
"""

from __future__ import annotations

import ast
import csv
import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import re
import sys
import textwrap
import traceback
import warnings
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import psutil

from kbackend.backend_choice import keras as import_keras
from kbackend.errors import DataError, exit_call, path_errors

KINDS = ("arrays", "csv", "images", "text", "tfds", "function")
SPLITS = ("train", "val", "test")
# Folder, TFDS and dict split names -> kbackend's.
SPLIT_NAMES = {"train": "train", "val": "val", "validation": "val", "valid": "val", "dev": "val",
               "test": "test"}
NPZ_PAIRS = (("train", "x_train", "y_train"), ("val", "x_val", "y_val"),
             ("test", "x_test", "y_test"))
_NPZ_NAMES = {"x", "y"} | {key for _, *keys in NPZ_PAIRS for key in keys}
TFDS_PREFIX = "tfds:"
TFDS_DATA_DIR_ENV = "TFDS_DATA_DIR"
TEXT_MAX_TOKENS = 20_000
TEXT_SEQUENCE_LENGTH = 200
IMAGE_EXTENSIONS = (".bmp", ".gif", ".jpeg", ".jpg", ".png")  # what Keras's image reader takes
TEXT_EXTENSIONS = (".txt",)
MEMORY_FRACTION = 0.5
READ_BATCH = 256
# An .npz member is read in chunks of this many bytes into its preallocated array.
NPZ_CHUNK_BYTES = 4 * 2**20
# Peak memory of loading arrays over what they hold, budgeted by the size check: the chunks
# and the validation rows copied out (10%), the finite check's mask (a quarter of float32).
NPZ_PEAK_FACTOR = 1.5
# The most pixels an image of a folder may have (a 4096x4096 image) unless ``image_size``
# (``--image-size HxW``) names the size to read every image at: a larger one costs seconds and
# hundreds of megabytes to decode, and its size would become every image's.
MAX_IMAGE_PIXELS = 4096 * 4096
# PIL modes (and, without PIL, PNG colour types / JPEG components) read as one channel.
_GRAY_MODES = ("1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "F")
_READ_ERRORS = (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, zlib.error)


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


def default_max_bytes() -> int:
    """How much a source may hold in memory: half the memory available now."""
    return int(psutil.virtual_memory().available * MEMORY_FRACTION)


def _builtin_names() -> tuple[str, ...]:
    # The package ``kbackend.data`` (always imported before its modules) imports this module, so
    # its registry is looked up when called: importing it here would be an import cycle.
    package = sys.modules.get(__package__ or "kbackend.data")
    return tuple(sorted(getattr(package, "DATASETS", {})))


def is_data_source(value: str) -> bool:
    """True for anything that is not a built-in dataset name (``kbackend.data.DATASETS``)."""
    return value not in _builtin_names()


def _reason(error: BaseException) -> str:
    """``error`` as a short phrase on one line, never cut mid-word."""
    text = textwrap.shorten(" ".join(str(error).split()), width=200, placeholder=" ...")
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class Where:
    """What an error names: ``data source 'train.npz'`` or ``data 'arrays'``."""

    def __init__(self, what: str) -> None:
        self.what = what

    def error(self, reason: str) -> DataError:
        return DataError(" ".join(f"Invalid {self.what}: {reason}".split()))


def _check_limit(where: Where, nbytes: int, max_bytes: int, what: str) -> None:
    if nbytes > max_bytes:
        raise where.error(
            f"{what} would take {nbytes:,} bytes in memory, more than the {max_bytes:,} allowed "
            "(max_bytes; by default half the available memory). Use a smaller subset, or train "
            "from it in a script with your own input pipeline.")


# --- the checks every source ends with ---------------------------------------------------


def _first_non_finite(values: np.ndarray) -> int | None:
    bad = ~np.isfinite(values.reshape(len(values), -1)).all(axis=1)
    return int(np.argmax(bad)) if bad.any() else None


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
                          f"({_reason(error)}).") from None
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
            index = _first_non_finite(values)
            if index is not None:
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


def _finish(where: Where, *, name: str, source: str, kind: str, splits: dict[str, Any],
            class_names: tuple[str, ...] | None = None, notes: tuple[str, ...] = (),
            owned: bool = False) -> UserData:
    """Every split checked, string labels mapped to class indices, as a ``UserData``."""
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
    return UserData(name=name, source=source, splits=checked, kind=kind,
                    class_names=class_names, notes=tuple(notes), owned=owned)


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


# --- .npz ----------------------------------------------------------------------------------


def npy_data_bytes(where: Where, handle: Any, stored: int, name: str) -> int:
    """The data bytes the ``.npy`` header at ``handle`` declares, read header-first (no data):
    a one-line error for an unreadable header, object arrays (loading would unpickle) or a
    declared size that disagrees with the ``stored`` bytes (a cut or altered file)."""
    shape, _, dtype = _npy_header_fields(where, handle, stored, name)
    return math.prod(shape) * dtype.itemsize


def _npy_header_fields(where: Where, handle: Any, stored: int, name: str
                       ) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, Fortran order, dtype) of the ``.npy`` header at ``handle``, checked as
    ``npy_data_bytes`` says; ``handle`` is left at the first data byte."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(handle)
        if version == (1, 0):
            shape, fortran, dtype = fmt.read_array_header_1_0(handle)
        elif version == (2, 0):
            shape, fortran, dtype = fmt.read_array_header_2_0(handle)
        else:
            raise DataError(f".npy format version {version[0]}.{version[1]} is not read here")
    except ValueError as error:
        raise where.error(f"{name} is not a readable .npy array ({_reason(error)}).") from None
    header_end = handle.tell()
    if dtype.hasobject:
        raise where.error(
            f"{name} holds Python objects (dtype {dtype}), which loading would unpickle, and "
            "pickles can run code: refused. Save numeric (or string) arrays instead.")
    nbytes = math.prod(shape) * dtype.itemsize
    if stored != header_end + nbytes:
        raise where.error(
            f"{name} declares shape {shape} of {dtype} ({nbytes:,} bytes) in its header, but "
            f"holds {stored - header_end:,} bytes of data: a cut or altered file.")
    return shape, fortran, dtype


def _npy_header(where: Where, archive: zipfile.ZipFile, info: zipfile.ZipInfo, key: str) -> int:
    """The size in bytes ``key``'s .npy header declares, checked against its zip entry."""
    shape, dtype = _npy_shape(where, archive, info, key)
    return math.prod(shape) * dtype.itemsize


def _npy_shape(where: Where, archive: zipfile.ZipFile, info: zipfile.ZipInfo, key: str
               ) -> tuple[tuple[int, ...], np.dtype]:
    """The (shape, dtype) ``key``'s .npy header declares, checked against its zip entry."""
    with archive.open(info) as handle:
        shape, _, dtype = _npy_header_fields(where, handle, info.file_size, f"array {key!r}")
    return shape, dtype


def _held_dtype(key: str, dtype: np.dtype) -> np.dtype:
    """The dtype ``key`` is held in: numeric inputs as float32 (what training takes, converted
    while reading), anything else as stored (labels, and inputs the checks will refuse)."""
    return np.dtype(np.float32) if key.startswith("x") and dtype.kind in "biuf" else dtype


def _read_member(where: Where, archive: zipfile.ZipFile, info: zipfile.ZipInfo, key: str,
                 split: str) -> np.ndarray:
    """The array ``key`` read chunk by chunk into one preallocated array of its held dtype:
    a float64 input never exists in memory at full size beside its float32 copy."""
    with archive.open(info) as handle:
        shape, fortran, dtype = _npy_header_fields(where, handle, info.file_size,
                                                   f"array {key!r}")
        held = _held_dtype(key, dtype)
        out = np.empty(math.prod(shape), dtype=held)
        per_chunk = max(1, NPZ_CHUNK_BYTES // max(1, dtype.itemsize))
        for start in range(0, out.size, per_chunk):
            count = min(per_chunk, out.size - start)
            data = handle.read(count * dtype.itemsize)
            if len(data) != count * dtype.itemsize:
                raise where.error(f"array {key!r} ends early: a cut or altered file.")
            values = np.frombuffer(data, dtype=dtype)
            if held != dtype and dtype.kind == "f" and dtype.itemsize > 4:
                _check_float32_range(where, values, split)
            out[start:start + count] = values
    return out.reshape(shape, order="F" if fortran else "C")


def _check_float32_range(where: Where, values: np.ndarray, split: str) -> None:
    """A one-line error for a finite value float32 cannot hold (it would become inf). Reduces
    without temporaries; a chunk with an inf or NaN is left to the non-finite check."""
    if not values.size:
        return
    high, low = np.fmax.reduce(values), np.fmin.reduce(values)  # NaN-ignoring, no copies
    largest = max(abs(float(high)), abs(float(low)))
    if math.isfinite(largest) and largest > float(np.finfo(np.float32).max):
        raise where.error(f"inputs beyond float32's range in the {split} split (largest "
                          f"magnitude {largest:.3g}): kbackend trains in float32; rescale them.")


def _npz_output_keys(where: Where, present: list[str]) -> list[tuple[str, str, Any]]:
    """A multi-output model's arrays: ``x_<split>`` and ``y_<split>_<output>`` for each output
    named by the ``y_train_<output>`` keys; (split, x key, {output: y key}) per split."""
    outputs = sorted(key[len("y_train_"):] for key in present if key.startswith("y_train_"))
    if "y_train" in present or "y" in present:
        raise where.error("labels both as y_train (one output) and as y_train_<output> (one per "
                          f"output): use one form. Received keys: {present}.")
    pairs = []
    for split, x_key, y_key in NPZ_PAIRS:
        ys = {name: f"{y_key}_{name}" for name in outputs}
        found = [key for key in ys.values() if key in present]
        if split != "train" and x_key not in present and not found:
            continue
        missing = [key for key in (x_key, *ys.values()) if key not in present]
        if missing:
            raise where.error(f"the {split} split misses {', '.join(missing)} (labels for every "
                              f"output of {outputs}, named by the y_train_<output> keys). "
                              f"Received keys: {present}.")
        pairs.append((split, x_key, ys))
    extra = [key for key in present if key.startswith("y_") and
             not any(key in ys.values() for *_, ys in pairs)]
    if extra:
        raise where.error(f"labels {extra[0]!r} name no output of the training split's "
                          f"y_train_<output> keys ({outputs}).")
    return pairs


def _npz_keys(where: Where, present: list[str]) -> list[tuple[str, str, Any]]:
    """The (split, x key, y key) triples to read, from the keys the archive has (the y key a
    dict of keys by output for a multi-output model's labels, ``y_train_<output>``)."""
    if any(key.startswith("y_train_") for key in present):
        return _npz_output_keys(where, present)
    if "x_train" in present or "y_train" in present:
        pairs = [pair for pair in NPZ_PAIRS if pair[1] in present or pair[2] in present]
    elif "x" in present or "y" in present:
        pairs = [("train", "x", "y")]
    else:
        pairs = []
    missing = [key for _, *keys in pairs for key in keys if key not in present]
    if not pairs or missing:
        detail = f" ({', '.join(missing)} missing)" if missing else ""
        raise where.error(
            "expected arrays x_train and y_train (optionally x_val and y_val, x_test and y_test), "
            f"or x and y{detail}. Received keys: {present}.")
    return pairs


def _key_list(y_key: Any) -> list[str]:
    return list(y_key.values()) if isinstance(y_key, dict) else [y_key]


def _load_npz(where: Where, path: Path, max_bytes: int) -> dict[str, tuple]:
    try:
        if not zipfile.is_zipfile(path):
            raise where.error(f"not a .npz archive ({path.stat().st_size:,} bytes that are not "
                              "a zip file): expected arrays saved with numpy.savez.")
        with zipfile.ZipFile(path) as archive:
            members = {info.filename.removesuffix(".npy"): info for info in archive.infolist()
                       if not info.is_dir()}
            pairs = _npz_keys(where, list(members))
            headers = {key: _npy_shape(where, archive, members[key], key)
                       for _, x_key, y_key in pairs for key in (x_key, *_key_list(y_key))}
            # What loading holds (inputs as float32), and what the split into train and
            # validation may add on top (``NPZ_PEAK_FACTOR``): refused before any array is read.
            held = sum(math.prod(shape) * _held_dtype(key, dtype).itemsize
                       for key, (shape, dtype) in headers.items())
            _check_limit(where, int(held * NPZ_PEAK_FACTOR), max_bytes,
                         "its arrays (inputs as float32, with room to split them)")
            def read(key: str, split: str) -> np.ndarray:
                return _read_member(where, archive, members[key], key, split)

            return {split: (read(x_key, split), {name: read(key, split) for name, key in
                                                 y_key.items()} if isinstance(y_key, dict)
                            else read(y_key, split))
                    for split, x_key, y_key in pairs}
    except _READ_ERRORS as error:
        if isinstance(error, DataError):
            raise
        raise where.error(f"not a readable .npz archive ({_reason(error)}).") from None


# --- .csv ----------------------------------------------------------------------------------


def _csv_dialect(sample: str) -> type[csv.Dialect] | csv.Dialect:
    try:
        return csv.Sniffer().sniff(sample.partition("\n")[0], delimiters=",;\t")
    except csv.Error:
        return csv.excel


# A label column keeps the id of each distinct text while it has at most this many (enough for
# any class names); past it, only numbers are kept (a regression target).
MAX_LABEL_TEXTS = 65_536


class _LabelColumn:
    """A CSV's label cells, parsed into preallocated arrays as they are read: each as a number
    and, while there are at most ``MAX_LABEL_TEXTS`` distinct texts, as the id of its text (so
    class names need no list of every cell)."""

    def __init__(self, rows: int) -> None:
        self.numbers = np.empty(rows, dtype=np.float64)
        self.ids: np.ndarray | None = np.empty(rows, dtype=np.int32)
        self.texts: dict[str, int] | None = {}
        self.numeric = True

    def add(self, row: int, cell: str) -> bool:
        """Store ``cell`` at ``row``; False if it cannot be kept (text past the id limit)."""
        try:
            self.numbers[row] = float(cell)
        except ValueError:
            self.numeric = False
        if self.texts is not None and self.ids is not None:
            self.ids[row] = self.texts.setdefault(cell, len(self.texts))
            if len(self.texts) > MAX_LABEL_TEXTS and self.numeric:
                self.texts = self.ids = None  # a numeric target: its numbers are enough
        return self.numeric or self.texts is not None

    def array(self, rows: int) -> np.ndarray:
        """The column as int (all whole numbers), float (other numbers) or str (class names)."""
        if not self.numeric:
            assert self.texts is not None and self.ids is not None
            return np.array(list(self.texts), dtype=str)[self.ids[:rows]]
        numbers = self.numbers[:rows]
        if np.isfinite(numbers).all() and np.array_equal(numbers, np.round(numbers)):
            small = np.abs(numbers).max() < 2**31
            return numbers.astype(np.int32 if small else np.int64)
        return numbers.astype(np.float32)


def _count_lines(path: Path) -> int:
    """An upper bound on a text file's rows: its newlines + 1 (read in 1 MiB blocks)."""
    count = 1
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(2**20), b""):
            count += block.count(b"\n")
    return count


def _csv_columns(where: Where, reader: Any, label: str | None) -> tuple[list[str], int, list[int]]:
    """(header, label column, feature columns) from the header row, checked."""
    header = [column.strip() for column in next(reader, [])]
    if not any(header):
        raise where.error("the file is empty: expected a header row of column names.")
    duplicates = sorted({column for column in header if header.count(column) > 1})
    if duplicates:
        raise where.error(f"column names repeat in the header: {duplicates}.")
    if label is None:
        raise where.error(f"a CSV source needs its label column named (label=COLUMN, "
                          f"--label COLUMN). Columns: {header}.")
    if label not in header:
        raise where.error(f"label column {label!r} is not among the columns: {header}.")
    label_index = header.index(label)
    features = [i for i in range(len(header)) if i != label_index]
    if not features:
        raise where.error(f"no feature columns besides the label column {label!r}.")
    return header, label_index, features


def _bad_feature(where: Where, header: list[str], row: list[str], features: list[int],
                 line: int) -> DataError:
    """The one-line error for the first feature cell of ``row`` that is not a number."""
    for i in features:
        try:
            float(row[i])
        except ValueError:
            cell = row[i].strip()
            if not cell:
                return where.error(f"missing value in feature column {header[i]!r} at line "
                                   f"{line}: fill or drop it.")
            return where.error(f"non-numeric feature column {header[i]!r} (value {cell[:40]!r} "
                               f"at line {line}): features must be numbers; encode it or drop "
                               "the column.")
    return where.error(f"line {line} could not be read as numbers.")


def _load_csv(where: Where, path: Path, label: str | None, max_bytes: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """Features as float32 (N, F) and the label column, parsed straight into arrays sized from
    the file's line count (checked against ``max_bytes`` before they are made)."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as handle:
            dialect = _csv_dialect(handle.read(64 * 1024))
            handle.seek(0)
            reader = csv.reader(handle, dialect)
            header, label_index, features = _csv_columns(where, reader, label)
            lines = _count_lines(path)
            # float32 features, the label as a float64 number and an int32 text id
            _check_limit(where, lines * (4 * len(features) + 12), max_bytes, "its values")
            x = np.empty((lines, len(features)), dtype=np.float32)
            labels = _LabelColumn(lines)
            rows = 0
            for row in reader:
                if not any(cell.strip() for cell in row):
                    continue  # a blank line
                line = reader.line_num
                if len(row) != len(header):
                    raise where.error(f"line {line} has {len(row)} values but the header has "
                                      f"{len(header)} columns.")
                try:
                    with np.errstate(over="ignore"):  # past float32: inf, refused as non-finite
                        x[rows] = [float(row[i]) for i in features]
                except ValueError:
                    raise _bad_feature(where, header, row, features, line) from None
                cell = row[label_index].strip()
                if not cell:
                    raise where.error(f"missing label in column {label!r} at line {line}.")
                if not labels.add(rows, cell):
                    raise where.error(f"label column {label!r} mixes numbers and text (value "
                                      f"{cell[:40]!r} at line {line}) among more than "
                                      f"{MAX_LABEL_TEXTS:,} distinct values: use numbers or "
                                      "class names throughout.")
                rows += 1
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise where.error(f"not a readable CSV file ({_reason(error)}).") from None
    if not rows:
        raise where.error("the file has a header but no data rows.")
    return x[:rows], labels.array(rows)


# --- TensorFlow: folders, TFDS, tf.data ------------------------------------------------------


def _tensorflow() -> Any:
    import_keras()  # the backend choice comes first: TensorFlow may import Keras
    try:
        import tensorflow as tf  # deferred: only folder, TFDS and tf.data sources need it
    except ImportError as error:
        raise DataError(f"This data source needs TensorFlow, which does not import here "
                        f"({_reason(error)}): pip install tensorflow-cpu.") from None
    return tf


def _is_tf_dataset(value: Any) -> bool:
    tf = sys.modules.get("tensorflow")  # none was made unless TensorFlow is imported
    return tf is not None and isinstance(value, tf.data.Dataset)


def _is_py_dataset(value: Any) -> bool:
    keras = sys.modules.get("keras")
    return keras is not None and isinstance(value, keras.utils.PyDataset)


def _is_batched(dataset: Any) -> bool:
    """Whether a dataset's elements are batches: from the transformations that made it where
    they say (batch, unbatch, from_tensor_slices, from_tensors), else from the shapes (a
    generator's batches have an unknown first dimension in x and y)."""
    node = dataset
    while node is not None:
        kind = type(node).__name__
        if "Unbatch" in kind or "TensorSlice" in kind:
            return False
        if "Batch" in kind or hasattr(node, "_batch_size") or kind == "_TensorDataset":
            return True
        if any(part in kind for part in ("FlatMap", "Interleave", "Window", "Generator", "Zip",
                                         "Scan", "GroupBy", "Choose", "Sample")):
            break  # these make new elements: the chain above says nothing about them
        node = getattr(node, "_input_dataset", None)
    x_spec, y_spec = dataset.element_spec
    return (x_spec.shape.rank is not None and y_spec.shape.rank is not None
            and x_spec.shape.rank >= 1 and y_spec.shape.rank >= 1
            and x_spec.shape[0] is None and y_spec.shape[0] is None)


def own_batch_size(value: Any) -> int | None:
    """The batch size a ``tf.data.Dataset`` was batched with (``.batch(64)``: 64), or None for
    anything else (arrays, an unbatched or generated dataset, a size TensorFlow cannot say)."""
    if not _is_tf_dataset(value):
        return None
    node = value
    while node is not None:
        kind = type(node).__name__
        if "Unbatch" in kind or "TensorSlice" in kind:
            return None
        size = getattr(node, "_batch_size", None)
        if size is not None:
            try:
                return int(size)
            except (TypeError, ValueError):
                return None
        node = getattr(node, "_input_dataset", None)
    return None


def _element_bytes(spec: Any) -> int | None:
    if spec.dtype.name == "string" or not spec.shape.is_fully_defined():
        return None
    return math.prod(spec.shape) * spec.dtype.size


class _Batches:
    """Batches of ``(x, y)`` gathered into one pair of arrays: written into arrays allocated at
    the first batch when the number of ``rows`` is known (no second copy at the end), else
    kept and concatenated."""

    def __init__(self, where: Where, split: str, rows: int | None) -> None:
        self.where, self.split, self.rows = where, split, rows
        self.xs: list[np.ndarray] = []
        self.ys: list[np.ndarray] = []
        self.filled = 0

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        if self.rows is None:
            self.xs.append(x)
            self.ys.append(y)
            return
        if not self.xs:
            self.xs = [np.empty((self.rows, *x.shape[1:]), dtype=x.dtype)]
            self.ys = [np.empty((self.rows, *y.shape[1:]), dtype=y.dtype)]
        end = self.filled + len(x)
        target_x, target_y = self.xs[0], self.ys[0]
        if end > self.rows or x.shape[1:] != target_x.shape[1:] \
                or y.shape[1:] != target_y.shape[1:]:  # not as announced: gather them instead
            self.xs, self.ys = [target_x[:self.filled]], [target_y[:self.filled]]
            self.rows = None
            self.add(x, y)
            return
        target_x[self.filled:end], target_y[self.filled:end] = x, y
        self.filled = end

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if self.rows is not None and self.xs:
            return self.xs[0][:self.filled], self.ys[0][:self.filled]
        return _concatenate(self.where, self.split, self.xs, self.ys)


def _read_tf_dataset(where: Where, dataset: Any, split: str, max_bytes: int,
                     batched: bool | None = None,
                     rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A finite ``tf.data.Dataset`` of ``(x, y)`` read into memory, at most ``max_bytes``;
    ``rows``: how many samples it holds, if known (else its cardinality when unbatched)."""
    tf = _tensorflow()
    spec = dataset.element_spec
    if not (isinstance(spec, tuple) and len(spec) == 2
            and all(isinstance(part, tf.TensorSpec) for part in spec)):
        extra = (" (x, y, sample_weight: sample weights are not read)"
                 if isinstance(spec, tuple) and len(spec) == 3 else "")
        raise where.error(f"the {split} dataset's elements are {_spec_words(spec)}{extra}: "
                          "expected (x, y) pairs of tensors.")
    cardinality = int(dataset.cardinality())
    if cardinality == tf.data.INFINITE_CARDINALITY:
        raise where.error(f"the {split} dataset is infinite (repeat() without a count?): "
                          "a finite one is read into memory.")
    if batched is None:
        batched = _is_batched(dataset)
    sizes = [_element_bytes(part) for part in spec]
    known = [size for size in sizes if size is not None]
    if cardinality > 0 and len(known) == len(sizes):
        _check_limit(where, cardinality * sum(known), max_bytes, f"the {split} dataset")
    if not batched:
        rows = rows if rows is not None else cardinality if cardinality > 0 else None
        dataset = dataset.batch(READ_BATCH)
    batches, total = _Batches(where, split, rows), 0
    try:
        for x, y in dataset.as_numpy_iterator():
            x, y = np.asarray(x), np.asarray(y)
            if x.ndim == 0 or y.ndim == 0:
                raise where.error(f"the {split} dataset looked batched but yields single "
                                  "values: batch it or give arrays.")
            total += x.nbytes + y.nbytes
            _check_limit(where, total, max_bytes, f"the {split} dataset (or it is infinite)")
            batches.add(x, y)
    except (tf.errors.OpError, ValueError, TypeError) as error:
        if isinstance(error, DataError):
            raise
        raise where.error(f"reading the {split} dataset failed ({_reason(error)}).") from None
    return batches.arrays()


def _concatenate(where: Where, split: str, xs: list, ys: list) -> tuple[np.ndarray, np.ndarray]:
    if not xs:
        raise where.error(f"the {split} split is empty: the dataset yields no samples.")
    try:
        return np.concatenate(xs), np.concatenate(ys)
    except ValueError as error:
        raise where.error(f"the {split} split's batches differ in sample shape "
                          f"({_reason(error)}).") from None


def _spec_words(spec: Any) -> str:
    if isinstance(spec, dict):
        return f"dicts with keys {sorted(spec)}"
    if isinstance(spec, tuple):
        return f"tuples of {len(spec)}"
    return type(spec).__name__


def _read_py_dataset(where: Where, dataset: Any, split: str, max_bytes: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """A finite ``keras.utils.PyDataset`` of ``(x, y)`` batches read into memory."""
    try:
        count = dataset.num_batches
    except NotImplementedError:
        count = None
    if count is None:
        raise where.error(f"the {split} PyDataset is infinite (num_batches is None): a finite "
                          "one is read into memory.")
    xs, ys, total = [], [], 0
    for index in range(int(count)):
        try:
            batch = dataset[index]
        except Exception as error:
            raise where.error(f"the {split} PyDataset raised on batch {index} "
                              f"({_reason(error)}).") from None
        if not isinstance(batch, tuple | list) or len(batch) != 2:
            extra = " (sample weights are not read)" if isinstance(batch, tuple | list) else ""
            raise where.error(f"batch {index} of the {split} PyDataset is not an (x, y) pair"
                              f"{extra}. Received: {type(batch).__name__}.")
        x, y = _check_split(where, split, *batch)
        total += x.nbytes + y.nbytes
        _check_limit(where, total, max_bytes, f"the {split} PyDataset")
        xs.append(x)
        ys.append(y)
    return _concatenate(where, split, xs, ys)


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


def vectorize_text(splits: dict[str, tuple[np.ndarray, np.ndarray]]
                   ) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], str]:
    """Splits of (text, label) -> (token ids, label), with kbackend's own ``TextVectorization``
    (``TEXT_MAX_TOKENS``, ``TEXT_SEQUENCE_LENGTH``) adapted on the training split only, run in
    tf.data on the host (it needs TensorFlow graphs, and its int ids feed an ``Embedding`` on
    every backend). For a model without string preprocessing layers of its own."""
    keras = import_keras()
    tf = _tensorflow()
    vectorizer = keras.layers.TextVectorization(max_tokens=TEXT_MAX_TOKENS,
                                                output_sequence_length=TEXT_SEQUENCE_LENGTH)

    def batches(x: np.ndarray) -> Any:
        return tf.data.Dataset.from_tensor_slices(x.reshape(len(x)).astype(str)).batch(
            READ_BATCH)

    vectorizer.adapt(batches(splits["train"][0]))
    vectorized = {split: (np.concatenate(list(batches(x).map(
        lambda text: tf.cast(vectorizer(text), tf.int32)).as_numpy_iterator())), y)
        for split, (x, y) in splits.items()}
    note = (f"text vectorized on the host by kbackend's TextVectorization (the model has no "
            f"string preprocessing layer): {vectorizer.vocabulary_size():,} tokens (at most "
            f"{TEXT_MAX_TOKENS:,}, adapted on the training split), length "
            f"{TEXT_SEQUENCE_LENGTH}")
    return vectorized, note


def _class_folders(folder: Path) -> list[Path]:
    return sorted(entry for entry in folder.iterdir()
                  if entry.is_dir() and not entry.name.startswith("."))


def _folder_splits(where: Where, folder: Path) -> dict[str, Path]:
    """``{"train": folder}``, or the split folders when ``folder`` holds ``train/`` (with
    ``val/`` or ``validation/``, and ``test/``), each of class subfolders."""
    subfolders = _class_folders(folder)
    names = {entry.name.lower(): entry for entry in subfolders}
    if "train" not in names or not set(names) <= set(SPLIT_NAMES) or not _class_folders(
            names["train"]):
        return {"train": folder}
    splits: dict[str, Path] = {}
    for name, entry in sorted(names.items()):
        if SPLIT_NAMES[name] in splits:
            raise where.error(f"two folders for the {SPLIT_NAMES[name]} split: "
                              f"{splits[SPLIT_NAMES[name]].name}/ and {entry.name}/.")
        splits[SPLIT_NAMES[name]] = entry
    return splits


def _scan_folder(where: Where, folder: Path) -> tuple[list[Path], list[Path], int]:
    """The image files and text files under ``folder``'s class subfolders, and the text bytes."""
    classes = _class_folders(folder)
    expected = ("expected a folder of class subfolders (one per class) holding images "
                f"({' '.join(IMAGE_EXTENSIONS)}) or text files (.txt)")
    if not classes:
        raise where.error(f"{expected}; {str(folder)!r} has no subfolders.")
    images, texts, text_bytes = [], [], 0
    for class_folder in classes:
        for root, _, files in os.walk(class_folder):
            for file in sorted(files):
                path = Path(root, file)
                suffix = path.suffix.lower()
                if suffix in IMAGE_EXTENSIONS:
                    images.append(path)
                elif suffix in TEXT_EXTENSIONS:
                    texts.append(path)
                    text_bytes += path.stat().st_size
    if not images and not texts:
        raise where.error(f"{expected}; the subfolders of {str(folder)!r} hold neither.")
    if images and texts:
        raise where.error(f"{str(folder)!r} mixes images ({len(images)}) and text files "
                          f"({len(texts)}): {expected}, one kind.")
    if len(classes) == 1:
        raise where.error(f"{str(folder)!r} has one class subfolder ({classes[0].name}/): "
                          "classification needs at least two classes.")
    return sorted(images), texts, text_bytes


def parse_image_size(text: str) -> tuple[int, int]:
    """``"HxW"`` (or ``"H,W"``, or one number for a square) as (height, width); ``DataError``
    otherwise."""
    parts = re.split(r"[x,X]", str(text).strip())
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or not all(part.strip().isdigit() and len(part.strip()) <= 6
                                  for part in parts):
        raise DataError(f"Invalid --image-size {str(text)[:40]!r}: expected HEIGHTxWIDTH in "
                        "pixels, e.g. 64x64.")
    height, width = (int(part) for part in parts)
    check_image_size((height, width))
    return height, width


def check_image_size(size: Any) -> None:
    """``DataError`` unless ``size`` is (height, width), each 1 .. 65535 pixels."""
    if not (isinstance(size, tuple | list) and len(size) == 2 and all(
            isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= 65535 for d in size)):
        raise DataError(f"Invalid image size {size!r}: expected (height, width), each from 1 to "
                        "65535 pixels.")


def _png_header(head: bytes) -> tuple[int, int, bool] | None:
    if head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR" or len(head) < 26:
        return None
    width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    return height, width, head[25] in (0, 4)  # colour types 0 and 4: gray (with alpha)


def _jpeg_header(handle: BinaryIO) -> tuple[int, int, bool] | None:
    """(height, width, gray) from a JPEG's start-of-frame segment, markers walked header-first."""
    handle.seek(2)
    while True:
        marker = handle.read(4)
        if len(marker) < 4 or marker[0] != 0xFF:
            return None
        kind, length = marker[1], int.from_bytes(marker[2:4], "big")
        if 0xC0 <= kind <= 0xCF and kind not in (0xC4, 0xC8, 0xCC):
            frame = handle.read(6)
            if len(frame) < 6:
                return None
            height, width = int.from_bytes(frame[1:3], "big"), int.from_bytes(frame[3:5], "big")
            return height, width, frame[5] == 1
        if length < 2:
            return None
        handle.seek(length - 2, os.SEEK_CUR)


def _header_without_pil(path: Path) -> tuple[int, int, bool] | None:
    """(height, width, gray) from a PNG, JPEG, GIF or BMP header, None if unrecognized."""
    with open(path, "rb") as handle:
        head = handle.read(32)
        if head[:2] == b"\xff\xd8":
            return _jpeg_header(handle)
    if head[:6] in (b"GIF87a", b"GIF89a") and len(head) >= 10:
        return int.from_bytes(head[8:10], "little"), int.from_bytes(head[6:8], "little"), False
    if head[:2] == b"BM" and len(head) >= 26:
        width = int.from_bytes(head[18:22], "little", signed=True)
        height = int.from_bytes(head[22:26], "little", signed=True)
        return abs(height), abs(width), False
    return _png_header(head)


def image_header(path: Path) -> tuple[int, int, bool] | None:
    """(height, width, grayscale) of the image at ``path``, read from its header without
    decoding it (PIL's lazy open when PIL is installed, else the PNG, JPEG, GIF or BMP header
    parsed here); None if the header cannot be read."""
    try:
        from PIL import Image  # deferred, optional: Pillow comes with matplotlib, not always
    except ImportError:
        return _header_without_pil(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # refused below
            with Image.open(path) as image:  # reads the header only; decoding waits for .load()
                width, height = image.size
                return height, width, image.mode in _GRAY_MODES
    except (OSError, ValueError, Image.DecompressionBombError):
        # PIL refuses to open a huge image at all: its header still says how huge
        return _header_without_pil(path)


def _image_geometry(where: Where, images: list[Path], count: int, max_bytes: int,
                    image_size: tuple[int, int] | None) -> tuple[int, int, int, str]:
    """(height, width, channels, colour mode) every image is read at, from the headers alone:
    each image's pixels within ``MAX_IMAGE_PIXELS`` unless ``image_size`` is given, and the
    ``count`` images at that size within ``max_bytes``, all checked before any image is
    decoded."""
    first = None
    for path in images:
        header = image_header(path)
        if header is None:
            raise where.error(f"image {str(path)!r} has no readable PNG, JPEG, GIF or BMP "
                              "header: remove it or convert it.")
        height, width = header[0], header[1]
        if image_size is None and height * width > MAX_IMAGE_PIXELS:
            raise where.error(
                f"image {str(path)!r} is {height}x{width} pixels, more than the "
                f"{MAX_IMAGE_PIXELS:,} read unless --image-size HxW (image_size) names the size "
                "to resize every image to, e.g. --image-size 224x224.")
        first = first or header
    assert first is not None  # a folder without images was refused by _scan_folder
    height, width = image_size or (first[0], first[1])
    channels, mode = (1, "grayscale") if first[2] else (3, "rgb")
    _check_limit(where, count * height * width * channels * 4, max_bytes,
                 f"{count:,} images of {height}x{width}x{channels} float32")
    return height, width, channels, mode


def _load_folder(where: Where, folder: Path, *, seed: int, max_bytes: int,
                 image_size: tuple[int, int] | None) -> tuple[str, dict, tuple, tuple]:
    """(kind, splits, class names, notes) of a folder of images or text files."""
    split_folders = _folder_splits(where, folder)
    scans = {split: _scan_folder(where, path) for split, path in split_folders.items()}
    kinds = {"images" if images else "text" for images, _, _ in scans.values()}
    if len(kinds) > 1:
        raise where.error("its split folders hold different kinds of files (images in some, "
                          "text in others).")
    if kinds == {"images"}:  # from the headers, before TensorFlow or any image is read
        # the training folder's first image sets the size; every header is checked
        images = scans["train"][0] + [p for split, (found, _, _) in scans.items()
                                      if split != "train" for p in found]
        height, width, _, mode = _image_geometry(where, images, len(images), max_bytes,
                                                 image_size)
    keras = import_keras()
    tf = _tensorflow()
    options = {"labels": "inferred", "label_mode": "int", "batch_size": READ_BATCH,
               "shuffle": True, "seed": seed, "verbose": False}
    notes: list[str] = []
    try:
        if kinds == {"images"}:
            datasets = {split: keras.utils.image_dataset_from_directory(
                path, color_mode=mode, image_size=(height, width), interpolation="bilinear",
                data_format="channels_last", **options) for split, path in split_folders.items()}
            how = "given" if image_size else "the first image's"
            notes.append(f"images read at {height}x{width} ({how} size), {mode}, values 0-255 "
                         "as float32")
        else:
            count = sum(len(texts) for _, texts, _ in scans.values())
            text_bytes = sum(size for _, _, size in scans.values())
            _check_limit(where, text_bytes + count * TEXT_SEQUENCE_LENGTH * 4, max_bytes,
                         f"{count:,} text files")
            datasets = {split: keras.utils.text_dataset_from_directory(path, **options)
                        for split, path in split_folders.items()}
    except (tf.errors.OpError, ValueError, OSError) as error:
        if isinstance(error, DataError):
            raise
        raise where.error(f"reading the folder failed ({_reason(error)}).") from None
    class_names = tuple(datasets["train"].class_names)
    for split, dataset in datasets.items():
        if tuple(dataset.class_names) != class_names:
            raise where.error(f"the {split} folder's classes {list(dataset.class_names)} differ "
                              f"from the training folder's {list(class_names)}.")
    kind = "images" if kinds == {"images"} else "text"
    # each split's file count: its arrays are allocated once, at that size
    splits = {split: _read_tf_dataset(where, dataset, split, max_bytes, batched=True,
                                      rows=len(scans[split][0]) if kind == "images" else None)
              for split, dataset in datasets.items()}
    return kind, splits, class_names, tuple(notes)


def tfds_data_dir() -> Path:
    """Where prepared TFDS sets are read: ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``."""
    return Path(os.environ.get(TFDS_DATA_DIR_ENV) or Path.home() / "tensorflow_datasets")


def _version_key(name: str) -> tuple[int, ...] | None:
    return tuple(int(part) for part in name.split(".")) if re.fullmatch(
        r"\d+\.\d+\.\d+", name) else None


def _prepared_versions(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    found = [entry for entry in folder.iterdir() if _version_key(entry.name) is not None
             and (entry / "dataset_info.json").is_file()]
    return sorted(found, key=lambda entry: _version_key(entry.name) or ())


def _tfds_folder(where: Where, name: str, config: str) -> Path:
    """The newest prepared version folder of ``name`` (and ``config``), or a one-line error."""
    root = tfds_data_dir()
    with path_errors(root, "TFDS data folder", DataError):
        base = root / name / config if config else root / name
        versions = _prepared_versions(base)
        if not versions and not config and base.is_dir():
            configs = [entry.name for entry in _class_folders(base) if _prepared_versions(entry)]
            if len(configs) == 1:
                versions = _prepared_versions(base / configs[0])
            elif configs:
                raise where.error(f"TFDS dataset {name!r} has several prepared configs "
                                  f"{configs}: name one, as tfds:{name}:CONFIG.")
    if not versions:
        raise where.error(
            f"TFDS dataset {name + (':' + config if config else '')!r} is not prepared in "
            f"{str(base)!r} (searched ${TFDS_DATA_DIR_ENV}, else ~/tensorflow_datasets; nothing "
            "is downloaded): prepare it there first, e.g. tfds.builder(NAME, data_dir=...)"
            ".download_and_prepare(), or set TFDS_DATA_DIR.")
    return versions[-1]


def _load_tfds(where: Where, spec: str, max_bytes: int) -> tuple[dict, tuple | None, tuple]:
    name, _, config = spec.partition(":")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or (config and not re.fullmatch(
            r"[A-Za-z0-9_.-]+", config)):
        raise where.error("expected tfds:NAME or tfds:NAME:CONFIG (e.g. tfds:mnist).")
    try:
        # An optional extra (`tfds`), heavy to import; an import statement here would be named
        # in tests/test_architecture.py's DEFERRABLE list.
        tfds = importlib.import_module("tensorflow_datasets")
    except ImportError:
        raise where.error("TFDS sources need TensorFlow Datasets, which is not installed: "
                          "pip install tensorflow-datasets (or kbackend[tfds]).") from None
    folder = _tfds_folder(where, name, config)
    tf = _tensorflow()
    try:
        builder = tfds.builder_from_directory(str(folder))
        info = builder.info
        keys = info.supervised_keys
        if not (isinstance(keys, tuple) and len(keys) == 2 and all(isinstance(k, str)
                                                                    for k in keys)):
            raise where.error(f"the TFDS dataset has no (input, label) supervised keys "
                              f"(supervised_keys={keys!r}; features: {sorted(info.features)}).")
        available = sorted(info.splits)
        chosen = {SPLIT_NAMES[split]: split for split in available if split in SPLIT_NAMES}
        if "train" not in chosen:
            raise where.error(f"the TFDS dataset has no train split. Splits: {available}.")
        datasets = {ours: builder.as_dataset(split=theirs, as_supervised=True,
                                             shuffle_files=False)
                    for ours, theirs in chosen.items()}
        label_feature = info.features[keys[1]]
        names = getattr(label_feature, "names", None)
        class_names = tuple(names) if names else None
        notes = [f"TFDS {info.full_name} from {folder}"]
        skipped = [split for split in available if split not in chosen.values()]
        if skipped:
            notes.append(f"TFDS splits not read: {', '.join(skipped)}")
        if datasets["train"].element_spec[0].dtype == tf.string:
            batched = {split: dataset.batch(READ_BATCH) for split, dataset in datasets.items()}
            splits = {split: _read_tf_dataset(where, dataset, split, max_bytes, batched=True)
                      for split, dataset in batched.items()}
        else:
            splits = {split: _read_tf_dataset(where, dataset, split, max_bytes, batched=False)
                      for split, dataset in datasets.items()}
    except (tf.errors.OpError, ValueError, OSError, KeyError) as error:
        if isinstance(error, DataError):
            raise
        raise where.error(f"reading the TFDS dataset in {str(folder)!r} failed "
                          f"({_reason(error)}).") from None
    return splits, class_names, tuple(notes)


# --- Python objects and FILE.py:FUNCTION ---------------------------------------------------


def _read_pair(where: Where, value: Any, split: str, max_bytes: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` arrays, or a dataset read into memory, for one split."""
    if _is_tf_dataset(value):
        return _read_tf_dataset(where, value, split, max_bytes)
    if _is_py_dataset(value):
        return _read_py_dataset(where, value, split, max_bytes)
    if isinstance(value, tuple | list) and len(value) == 2:
        return _check_split(where, split, *value)  # already in memory: no limit to apply
    raise where.error(
        f"the {split} split is {_type_words(value)}: expected (x, y) arrays, a tf.data.Dataset "
        "of (x, y) or a keras.utils.PyDataset.")


def _type_words(value: Any) -> str:
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"a {type(value).__module__}.{type(value).__qualname__}"


def _splits_from_value(where: Where, value: Any, max_bytes: int) -> dict[str, tuple]:
    """The splits in what a user's function returned or passed: ``(x, y)``, a dataset, or a dict
    of splits (``train``/``val``/``validation``/``test``, or the .npz key names)."""
    if not isinstance(value, dict):
        return {"train": _read_pair(where, value, "train", max_bytes)}
    keys = [str(key) for key in value]
    if all(key in SPLIT_NAMES for key in keys):
        splits: dict[str, tuple] = {}
        for key, item in value.items():
            if SPLIT_NAMES[key] in splits:
                raise where.error(f"two entries for the {SPLIT_NAMES[key]} split: {keys}.")
            splits[SPLIT_NAMES[key]] = _read_pair(where, item, SPLIT_NAMES[key], max_bytes)
        if "train" in splits:
            return splits
    elif set(keys) <= _NPZ_NAMES and all(isinstance(key, str) for key in value):
        return {split: _read_pair(where, (value[x_key], value[y_key]), split, max_bytes)
                for split, x_key, y_key in _npz_keys(where, keys)}
    raise where.error(
        "a dict of splits needs 'train' (and optionally 'val' or 'validation', and 'test'), each "
        "(x, y) or a dataset; or the keys x_train, y_train (x_val, y_val, x_test, y_test). "
        f"Received keys: {keys}.")


def _user_line(error: BaseException, path: Path) -> str:
    """`` (at FILE:LINE)`` for the deepest frame of ``error`` in the user's file, if any."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if Path(frame.filename).resolve() == path.resolve()]
    return f" (at {path.name}:{frames[-1].lineno})" if frames else ""


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


def _check_max_bytes(max_bytes: int | None) -> int:
    if max_bytes is None:
        return default_max_bytes()
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise DataError(f"Invalid max_bytes {max_bytes!r}: expected a positive integer.")
    return max_bytes


def load_source(source: str, *, label: str | None = None, seed: int = 0,
                max_bytes: int | None = None, image_size: tuple[int, int] | None = None,
                raw_text: bool = False) -> UserData:
    """Read the user's data at ``source`` (see the module doc for the forms) into arrays.

    ``label``: a CSV source's label column (any other source refuses it). ``seed``: the order
    the folder readers shuffle files into. ``max_bytes``: the most the data may take in memory
    (default: half the memory available). ``image_size``: (height, width) for image folders
    (default: the first image's size). ``raw_text``: a text folder's or TFDS set's texts kept
    as strings (for a model with its own string preprocessing layers; ``vectorize_text`` makes
    token ids of them otherwise, as happens here without it).
    """
    data = _load_source(source, label=label, seed=seed, max_bytes=max_bytes,
                        image_size=image_size)
    if raw_text or not any(x.dtype.kind in "OU" for x, _ in data.splits.values()):
        return data
    splits, note = vectorize_text(dict(data.splits))
    return replace(data, splits=splits, notes=(*data.notes, note))


def _load_source(source: str, *, label: str | None, seed: int, max_bytes: int | None,
                 image_size: tuple[int, int] | None) -> UserData:
    where = Where(f"data source {str(source)[:200]!r}")
    if not isinstance(source, str) or not source.strip():
        raise where.error("expected a .npz or .csv file, a folder, tfds:NAME or FILE.py:FUNCTION.")
    limit = _check_max_bytes(max_bytes)
    function = _function_parts(source)
    path: Path | None = None
    if not source.startswith(TFDS_PREFIX) and function is None:
        with path_errors(source, "data source", DataError):
            path = Path(source)
            is_csv = path.suffix.lower() == ".csv" and path.is_file()
        if label is not None and not is_csv:
            raise where.error(f"label={label!r} names a CSV source's label column; this source "
                              "is not a CSV file.")
    elif label is not None:
        raise where.error(f"label={label!r} names a CSV source's label column; this source is "
                          "not a CSV file.")
    if source.startswith(TFDS_PREFIX):
        splits, class_names, notes = _load_tfds(where, source[len(TFDS_PREFIX):], limit)
        return _finish(where, name=source, kind="tfds", splits=splits, class_names=class_names,
                       notes=notes, source=source, owned=True)
    if function is not None:
        file_text, function_name = function
        splits = _load_function(where, file_text, function_name, limit)
        return _finish(where, name=f"{Path(file_text).name}:{function_name}", kind="function",
                       splits=splits, source=source)
    assert path is not None
    with path_errors(source, "data source", DataError):
        is_dir, is_file = path.is_dir(), path.is_file()
    if is_dir:
        kind, splits, class_names, notes = _load_folder(where, path, seed=seed, max_bytes=limit,
                                                        image_size=image_size)
        return _finish(where, name=path.resolve().name, kind=kind, splits=splits,
                       class_names=class_names, notes=notes, source=source, owned=True)
    suffix = path.suffix.lower()
    if not is_file:
        builtin = "" if suffix or os.sep in source else (
            f" It is not a built-in dataset either ({', '.join(_builtin_names())}).")
        raise where.error(f"no such file or folder.{builtin}")
    if suffix == ".npz":
        return _finish(where, name=path.name, kind="arrays", splits=_load_npz(where, path, limit),
                       source=source, owned=True)
    if suffix == ".csv":
        x, y = _load_csv(where, path, label, limit)
        return _finish(where, name=path.name, kind="csv", splits={"train": (x, y)}, source=source,
                       owned=True)
    if suffix == ".npy":
        raise where.error("a .npy file holds one array, not a dataset: save inputs and labels "
                          "together, numpy.savez(PATH.npz, x_train=x, y_train=y).")
    if suffix == ".py":
        raise where.error("a Python source names its function: FILE.py:FUNCTION.")
    raise where.error("expected a .npz or .csv file, a folder of class subfolders, tfds:NAME or "
                      f"FILE.py:FUNCTION. Received a {suffix or 'suffix-less'} file.")


def from_python(x: Any, y: Any = None, *, validation_data: Any = None, name: str = "arrays",
                max_bytes: int | None = None) -> UserData:
    """The data a Python caller passes, as ``fit`` takes it: ``x`` and ``y`` arrays; or ``x``
    alone as a ``tf.data.Dataset`` of ``(x, y)`` (batched or not), a ``keras.utils.PyDataset``,
    an ``(x, y)`` tuple or a dict of splits. ``validation_data``: ``(x_val, y_val)`` or a
    dataset. Datasets are read into memory, at most ``max_bytes``."""
    where = Where(f"data {name!r}")
    limit = _check_max_bytes(max_bytes)
    if y is None:
        splits = _splits_from_value(where, x, limit)
    elif _is_tf_dataset(x) or _is_py_dataset(x) or isinstance(x, dict):
        raise where.error(f"x is {_type_words(x)}, which holds its own labels: pass y=None.")
    else:
        splits = {"train": _read_pair(where, (x, y), "train", limit)}
    if validation_data is not None:
        if "val" in splits:
            raise where.error("validation data given twice: in x's splits and validation_data.")
        splits["val"] = _read_pair(where, validation_data, "val", limit)
    return _finish(where, name=name, source=name, kind="arrays", splits=splits)


def check_source(source: str, *, label: str | None = None) -> None:
    """What can be checked of ``source`` without starting a framework or running the user's
    code (``kbackend launch``, before any of its processes starts): a ``.npz`` or ``.csv`` file
    is read in full (NumPy only), a folder's class subfolders and files are listed, a prepared
    TFDS folder is looked up, a ``FILE.py:FUNCTION`` file is parsed. A one-line ``DataError``."""
    where = Where(f"data source {str(source)[:200]!r}")
    function = _function_parts(source) if isinstance(source, str) else None
    with path_errors(source, "data source", DataError):
        path = Path(function[0] if function else source)
        is_dir = function is None and not source.startswith(TFDS_PREFIX) and path.is_dir()
    if label is not None and (function or is_dir or source.startswith(TFDS_PREFIX)):
        raise where.error(f"label={label!r} names a CSV source's label column; this source is "
                          "not a CSV file.")
    if source.startswith(TFDS_PREFIX):
        name, _, config = source[len(TFDS_PREFIX):].partition(":")
        _tfds_folder(where, name, config)
    elif function is not None:
        if not path.is_file():
            raise where.error(f"Python file {function[0]!r} not found (expected "
                              "FILE.py:FUNCTION).")
        try:
            ast.parse(path.read_bytes(), filename=str(path))
        except SyntaxError as error:
            raise where.error(f"syntax error at {path.name}:{error.lineno}: "
                              f"{error.msg}.") from None
    elif is_dir:
        for folder in _folder_splits(where, path).values():
            _scan_folder(where, folder)
    else:
        load_source(source, label=label)
