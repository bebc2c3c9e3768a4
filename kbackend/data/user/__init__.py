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

One module per kind of source, each a class holding what it reads from whose ``read()``
returns ``Splits`` (``common``): ``npz.NpzFile``, ``csv_table.CsvFile``, ``folder.Folder``,
``tfds.TfdsSet``, ``function.FunctionSource`` and ``python.PythonObjects`` (which reads
``tf.data`` and ``PyDataset`` splits with ``datasets``); ``load_source`` and ``from_python``
pick one and check what it read with ``common.finish``. This package re-exports the names its
callers import.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from kbackend.data import DATASETS, Dataset, load
from kbackend.data.user.common import (
    TEXT_SEQUENCE_LENGTH,
    Reader,
    Splits,
    UserData,
    Where,
    _check_max_bytes,
    finish,
    text_array,
)
from kbackend.data.user.csv_table import CsvFile
from kbackend.data.user.datasets import _tensorflow, own_batch_size, vectorize_text
from kbackend.data.user.folder import (
    MAX_IMAGE_PIXELS,
    Folder,
    check_image_size,
    image_header,
    parse_image_size,
)
from kbackend.data.user.function import FunctionSource
from kbackend.data.user.npz import NpzFile, _npy_header, npy_data_bytes
from kbackend.data.user.python import PythonObjects
from kbackend.data.user.tfds import TFDS_PREFIX, TfdsSet
from kbackend.errors import DataError, path_errors

# What callers import from here (the private names: equivalence's header-first checks, the
# data-memory benchmark and tests); the readers live in their own modules.
__all__ = [
    "MAX_IMAGE_PIXELS", "TEXT_SEQUENCE_LENGTH", "CsvFile", "Folder", "FunctionSource", "NpzFile",
    "PythonObjects", "Reader", "Splits", "TfdsSet", "UserData", "Where", "_npy_header",
    "_tensorflow", "check_image_size", "check_source", "finish", "from_python", "image_header",
    "load_source", "npy_data_bytes", "own_batch_size", "parse_image_size", "text_array",
    "vectorize_text",
]


def _function_parts(source: str) -> tuple[str, str] | None:
    head, separator, tail = source.rpartition(":")
    return (head, tail) if separator and head.lower().endswith(".py") else None


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
    reader = _reader_of(source, label=label, seed=seed, max_bytes=max_bytes,
                        image_size=image_size)
    data = finish(reader.where, source, reader)
    if raw_text or not any(x.dtype.kind in "OU" for x, _ in data.splits.values()):
        return data
    splits, note = vectorize_text(dict(data.splits))
    return replace(data, splits=splits, notes=(*data.notes, note))


def _reader_of(source: str, *, label: str | None, seed: int, max_bytes: int | None,
               image_size: tuple[int, int] | None) -> Reader:
    """The reader of ``source``'s kind, after the checks every kind shares."""
    where = Where(f"data source {str(source)[:200]!r}")
    if not isinstance(source, str) or not source.strip():
        raise where.error("expected a .npz or .csv file, a folder, tfds:NAME or FILE.py:FUNCTION.")
    limit = _check_max_bytes(max_bytes)
    function = _function_parts(source)
    path = is_dir = is_file = None
    if not source.startswith(TFDS_PREFIX) and function is None:
        with path_errors(source, "data source", DataError):
            path = Path(source)
            is_dir, is_file = path.is_dir(), path.is_file()
    suffix = path.suffix.lower() if path is not None else ""
    if label is not None and not (suffix == ".csv" and is_file):
        raise where.error(f"label={label!r} names a CSV source's label column; this source is "
                          "not a CSV file.")
    if source.startswith(TFDS_PREFIX):
        return TfdsSet(where, source, limit)
    if function is not None:
        return FunctionSource(where, *function, limit)
    assert path is not None
    if is_dir:
        return Folder(where, path, seed, limit, image_size)
    if not is_file:
        builtin = "" if suffix or os.sep in source else (
            f" It is not a built-in dataset either ({', '.join(sorted(DATASETS))}).")
        raise where.error(f"no such file or folder.{builtin}")
    if suffix == ".npz":
        return NpzFile(where, path, limit)
    if suffix == ".csv":
        return CsvFile(where, path, label, limit)
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
    return finish(where, name, PythonObjects(where, name, x, y, validation_data, limit))


def check_source(source: str, *, label: str | None = None, layout: str = "spatial",
                 data_format: str = "channels_last", validation_fraction: float = 0.1,
                 seed: int = 0, data_dir: str | None = None) -> Dataset | None:
    """What can be checked of ``source`` without starting a framework or running the user's
    code (``kbackend launch``, before any of its processes starts): a built-in dataset is
    loaded (in ``layout``, split by ``validation_fraction`` and ``seed``) and returned, as
    every process will read it; a ``.npz`` or ``.csv`` file is read in full (NumPy only), a
    folder's class subfolders and files are listed, a prepared TFDS folder is looked up, a
    ``FILE.py:FUNCTION`` file is parsed (None: the splits are settled once a process prepares
    them). A one-line ``DataError``."""
    if source in DATASETS:
        return load(source, layout=layout, data_format=data_format,
                    validation_fraction=validation_fraction, seed=seed, data_dir=data_dir)
    _reader_of(source, label=label, seed=seed, max_bytes=None, image_size=None).check()
    return None
