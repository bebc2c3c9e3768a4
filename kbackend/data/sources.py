"""Where each dataset's raw arrays come from: embedded, generated, files, or a download."""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import json
import math
import os
import sys
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from kbackend.backend_choice import keras as import_keras
from kbackend.errors import DataError, error_text, path_errors
from kbackend.io import atomic_write

DATA_DIR_ENV = "KBACKEND_DATA_DIR"
CACHE_DIR_ENV = "KBACKEND_CACHE_DIR"
OFFLINE_ENV = "KBACKEND_OFFLINE"
EMBEDDED = ("digits", "mnist1d", "mnist1d_large", "synthetic")
IDX_UNSIGNED_BYTE = 0x08
NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")
MNIST_FILE = "mnist.npz"
FASHION_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)
FASHION_FOLDER = "fashion-mnist"
DATA_DOC = "docs/data.md"
# What reading a damaged file raises: numpy, zipfile, gzip and zlib each have their own errors.
READ_ERRORS = (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, zlib.error)


@dataclass
class RawData:
    """Unsplit, unscaled arrays as a source provides them.

    ``x`` arrays are (N, H, W, C) for images or (N, T, F) for sequences; ``kind`` says which.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    kind: str
    num_classes: int
    source: str
    scale: float = 1.0


def cache_dir() -> Path:
    """Where generated data is cached: ``$KBACKEND_CACHE_DIR`` or ``~/.cache/kbackend``."""
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "kbackend")


def search_dirs(data_dir: str | os.PathLike | None) -> list[tuple[str, Path]]:
    """The folders searched for data files, in order, each with a label for error messages."""
    places: list[tuple[str, Path]] = []
    if data_dir is not None:
        places.append(("--data-dir", Path(data_dir)))
    if os.environ.get(DATA_DIR_ENV):
        places.append((DATA_DIR_ENV, Path(os.environ[DATA_DIR_ENV])))
    keras_home = Path(os.environ.get("KERAS_HOME") or Path.home() / ".keras")
    places.append(("Keras cache", keras_home / "datasets"))  # where keras.datasets downloads
    return places


def load_digits() -> RawData:
    """scikit-learn's 1,797 8x8 digits (embedded); a fixed 20% test split."""
    # deferred: scikit-learn is slow to import and only this dataset needs it
    from sklearn.datasets import load_digits as sk_load_digits

    bunch = sk_load_digits()
    x = bunch.images.astype(np.float32)[..., None]
    y = bunch.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    n_test = len(x) // 5
    test, train = order[:n_test], np.sort(order[n_test:])
    return RawData(x[train], y[train], x[test], y[test], "image", 10, "scikit-learn (embedded)",
                   16.0)


MNIST1D_LARGE_SAMPLES = 15_000


@functools.cache
def _unit_grid(points: int) -> np.ndarray:
    grid = np.linspace(0, 1, points)
    grid.flags.writeable = False
    return grid


def mnist1d_interpolate(x: np.ndarray, points: int) -> np.ndarray:
    """``mnist1d.transform.interpolate`` for its 1-D float64 signals, value for value: there
    ``scipy.interpolate.interp1d(kind="linear")`` hands the call to ``np.interp`` with the same
    grids, after building an interpolator object per call; the grids here are built once."""
    return np.interp(_unit_grid(points), _unit_grid(len(x)), x)


@contextlib.contextmanager
def _fast_mnist1d_interpolation() -> Iterator[None]:
    """Generate MNIST-1D with ``mnist1d_interpolate``: the same arrays (tests/test_data.py), in
    a third of the time (mnist1d_large: 6.7 s -> 2.2 s here, most of it interp1d's set-up)."""
    # the package's ``transform`` name is a function; its module's attributes are not typed
    module: Any = sys.modules["mnist1d.transform"]
    original = module.interpolate
    module.interpolate = mnist1d_interpolate
    try:
        yield
    finally:
        module.interpolate = original


def load_mnist1d(num_samples: int | None = None) -> RawData:
    """MNIST-1D generated with the mnist1d package (never its download path), cached on disk.

    ``num_samples=None`` is the paper's data set (the package's defaults: 5,000 sequences,
    4,000 train / 1,000 test); a larger ``num_samples`` draws more sequences from the same
    generator (same templates, noise and seed), split 80 / 20 alike.
    """
    # The cache is keyed by the package's version (which fixes its generator's defaults) and
    # the size, so a cached set is read without importing mnist1d (scipy, pyplot: ~0.6 s).
    spec = json.dumps({"mnist1d": version("mnist1d"), "num_samples": num_samples})
    digest = hashlib.sha256(spec.encode()).hexdigest()[:16]
    path = cache_dir() / f"mnist1d-{digest}.npz"
    source = f"mnist1d make_dataset (cached at {path})"
    arrays: dict[str, Any] | None = None
    if path.exists():
        try:
            with np.load(path) as cached:
                arrays = {k: cached[k] for k in ("x", "y", "x_test", "y_test")}
        except READ_ERRORS:
            pass  # a damaged cache file is regenerated, not fatal
    if arrays is None:
        from mnist1d.data import get_dataset_args, make_dataset  # deferred: generation only

        args = get_dataset_args()
        if num_samples is not None:
            args.num_samples = num_samples
        with _fast_mnist1d_interpolation():
            generated = make_dataset(args)
        arrays = {k: np.asarray(generated[k]) for k in ("x", "y", "x_test", "y_test")}

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as handle:
                np.savez(handle, **arrays)

        try:
            atomic_write(path, write)
        except OSError:
            source = "mnist1d make_dataset (not cached: cache folder not writable)"
    return RawData(
        arrays["x"].astype(np.float32)[..., None],
        arrays["y"].astype(np.int32),
        arrays["x_test"].astype(np.float32)[..., None],
        arrays["y_test"].astype(np.int32),
        "sequence",
        10,
        source,
    )


def load_synthetic(
    input_shape: tuple[int, ...] = (784,),
    num_classes: int = 10,
    num_train: int = 8192,
    num_test: int = 1024,
    seed: int = 0,
) -> RawData:
    """Gaussian inputs labelled by a fixed random linear teacher (learnable), for throughput
    work."""
    shape = tuple(int(d) for d in input_shape)
    if not shape or any(d < 1 for d in shape) or num_classes < 2 or num_train < 1 or num_test < 1:
        raise DataError(
            "Invalid synthetic data spec: expected positive dimensions, num_classes >= 2 and "
            f"positive sizes. Received: input_shape={shape}, num_classes={num_classes}, "
            f"num_train={num_train}, num_test={num_test}."
        )
    rng = np.random.default_rng(seed)
    total = num_train + num_test
    x = rng.standard_normal((total, *shape), dtype=np.float32)
    teacher = rng.standard_normal((int(np.prod(shape)), num_classes)).astype(np.float32)
    y = np.argmax(x.reshape(total, -1) @ teacher, axis=1).astype(np.int32)
    if len(shape) == 3:
        kind = "image"
    else:
        x = x.reshape(total, shape[0], -1) if len(shape) == 2 else x.reshape(total, -1, 1)
        kind = "sequence" if len(shape) == 2 else "flat"
    return RawData(x[:num_train], y[:num_train], x[num_train:], y[num_train:], kind, num_classes,
                   f"synthetic (seed {seed})")


def _read_idx(path: Path, ndim: int) -> np.ndarray:
    """Read a gzip-compressed IDX file of unsigned bytes with ``ndim`` dimensions (MNIST's
    format)."""
    expected = f"a gzip-compressed IDX file of unsigned bytes with {ndim} dimension(s)"
    try:
        with gzip.open(path, "rb") as handle:
            data = handle.read()
    except READ_ERRORS as error:
        raise DataError(
            f"Unreadable data file {path}: expected {expected}. Received: {error_text(error, 160)}."
        ) from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise DataError(
            f"Invalid IDX file {path}: expected {expected}, whose first bytes are 00 00 08 "
            f"{ndim:02x}. Received: {data[:4].hex(' ') or 'no data'}."
        )
    if data[2] != IDX_UNSIGNED_BYTE or data[3] != ndim:
        raise DataError(
            f"Invalid IDX file {path}: expected {expected} (type byte 08, {ndim} dimension(s)). "
            f"Received: type byte {data[2]:02x}, {data[3]} dimension(s)."
        )
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataError(
            f"Truncated IDX file {path}: expected a {header}-byte header. "
            f"Received: {len(data)} bytes."
        )
    dims = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    values = len(data) - header
    if values != math.prod(dims):
        raise DataError(
            f"Invalid IDX file {path}: its header says shape {dims}, so expected "
            f"{math.prod(dims)} values. Received: {values}."
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def check_raw(raw: RawData, where: str, num_classes: int = 10) -> RawData:
    """Raise ``DataError`` naming ``where`` unless ``raw`` holds 28x28-style images and labels.

    Checked here, before any reshaping or scaling, so that a bad file is reported by name (and an
    empty split never reaches a reshape): inputs (N, H, W, 1) of unsigned bytes, the scale 255
    assumes; labels a 1-D integer array with one label per input, in [0, num_classes).
    """
    for split, x, y in (("train", raw.x_train, raw.y_train), ("test", raw.x_test, raw.y_test)):
        if x.ndim != 4 or x.shape[-1] != 1:
            raise DataError(
                f"Invalid x_{split} in {where}: expected images of shape (N, height, width). "
                f"Received: shape {x.shape[:-1]}."
            )
        if x.dtype != np.uint8:
            raise DataError(
                f"Invalid x_{split} in {where}: expected uint8 pixels (0-255). "
                f"Received: dtype {x.dtype}."
            )
        if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
            raise DataError(
                f"Invalid y_{split} in {where}: expected a 1-D array of integer class labels. "
                f"Received: shape {y.shape}, dtype {y.dtype}."
            )
        if len(x) == 0:
            raise DataError(
                f"Empty {split} split in {where}: expected at least 1 sample. Received: 0."
            )
        if len(x) != len(y):
            raise DataError(
                f"Mismatched {split} split in {where}: expected one label per image. "
                f"Received: {len(x)} images and {len(y)} labels."
            )
        low, high = int(y.min()), int(y.max())
        if low < 0 or high >= num_classes:
            raise DataError(
                f"Invalid y_{split} in {where}: expected labels in [0, {num_classes}). "
                f"Received: labels in [{low}, {high}]."
            )
    if raw.x_train.shape[1:] != raw.x_test.shape[1:]:
        raise DataError(
            f"Mismatched image sizes in {where}: expected train and test images of one size. "
            f"Received: {raw.x_train.shape[1:3]} and {raw.x_test.shape[1:3]}."
        )
    return raw


def _mnist_from(root: Path) -> RawData | None:
    path = root / MNIST_FILE
    if not path.is_file():
        return None
    expected = f"a NumPy .npz archive with arrays {', '.join(NPZ_KEYS)}"
    # np.load would read a non-zip file as a pickle and say "pickled data"; a zero-byte one,
    # EOFError.
    try:
        is_zip = zipfile.is_zipfile(path)
    except OSError as error:
        raise DataError(f"Unreadable data file {path}: {error_text(error, 160)}.") from None
    if not is_zip:
        raise DataError(
            f"Invalid data file {path}: expected {expected}. Received: {path.stat().st_size} bytes "
            "that are not a zip archive (truncated or not an .npz)."
        )
    try:
        with np.load(path, allow_pickle=False) as npz:
            missing = [key for key in NPZ_KEYS if key not in npz.files]
            if missing:
                raise DataError(
                    f"Invalid data file {path}: expected {expected}. Received: arrays "
                    f"{sorted(npz.files)} (missing {', '.join(missing)})."
                )
            arrays = {key: npz[key] for key in NPZ_KEYS}
    except READ_ERRORS as error:
        if isinstance(error, DataError):
            raise
        raise DataError(
            f"Unreadable data file {path}: expected {expected}. Received: {error_text(error, 160)}."
        ) from None
    return check_raw(RawData(arrays["x_train"][..., None], arrays["y_train"],
                             arrays["x_test"][..., None], arrays["y_test"], "image", 10, str(path),
                             255.0), str(path))


def _fashion_from(root: Path) -> RawData | None:
    for folder in (root / FASHION_FOLDER, root):
        present = [name for name in FASHION_FILES if (folder / name).is_file()]
        if present and len(present) < len(FASHION_FILES):
            missing = [name for name in FASHION_FILES if name not in present]
            raise DataError(
                f"Incomplete Fashion-MNIST in {folder}: expected all of "
                f"{', '.join(FASHION_FILES)}. "
                f"Received: {', '.join(present)} (missing {', '.join(missing)})."
            )
        if present:
            x_train, y_train, x_test, y_test = (
                _read_idx(folder / name, 3 if "images" in name else 1) for name in FASHION_FILES
            )
            where = f"{folder} ({', '.join(FASHION_FILES)})"
            return check_raw(RawData(x_train[..., None], y_train, x_test[..., None], y_test,
                                     "image", 10, str(folder), 255.0), where)
    return None


def _download(name: str) -> RawData:
    keras = import_keras()

    module = {"mnist": keras.datasets.mnist, "fashion_mnist": keras.datasets.fashion_mnist}[name]
    (x_train, y_train), (x_test, y_test) = module.load_data()
    return RawData(np.asarray(x_train)[..., None], np.asarray(y_train),
                   np.asarray(x_test)[..., None], np.asarray(y_test), "image", 10,
                   f"keras.datasets.{name} download", 255.0)


# name -> (reader of one folder, the files it expects there)
_FILES = {
    "mnist": (_mnist_from, MNIST_FILE),
    "fashion_mnist": (_fashion_from,
                      f"{', '.join(FASHION_FILES)} (in {FASHION_FOLDER}/ or the folder itself)"),
}


def _load_files(name: str, data_dir: str | os.PathLike | None) -> RawData:
    reader, files = _FILES[name]
    places = search_dirs(data_dir)
    for label, folder in places:
        with path_errors(folder, label, DataError):  # a name too long, a NUL byte: one line
            folder.is_dir()
        raw = reader(folder)
        if raw is not None:
            return raw
    tried = "; ".join(f"{label}: {folder}" for label, folder in places)
    if os.environ.get(OFFLINE_ENV, "") not in ("", "0"):
        reason = f"the Keras download is disabled by {OFFLINE_ENV}"
    else:
        try:
            raw = _download(name)
        except Exception as error:  # any failure of the download is reported, not raised raw
            reason = f"the Keras download failed ({error_text(error, 160)})"
        else:
            return check_raw(raw, raw.source)
    raise DataError(
        f"Dataset {name!r} not found: expected {files} in a folder given by --data-dir or "
        f"{DATA_DIR_ENV}, or in the Keras cache. Looked in {tried}; {reason}. See {DATA_DOC} "
        f"(where the files come from), or use a dataset that needs no files: {', '.join(EMBEDDED)}."
    )


def load_mnist(data_dir: str | os.PathLike | None = None) -> RawData:
    """MNIST from ``mnist.npz`` in the search folders, else a Keras download."""
    return _load_files("mnist", data_dir)


def load_fashion_mnist(data_dir: str | os.PathLike | None = None) -> RawData:
    """Fashion-MNIST from the four IDX files in the search folders, else a Keras download."""
    return _load_files("fashion_mnist", data_dir)
