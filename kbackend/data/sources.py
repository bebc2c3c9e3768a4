"""Where each dataset's raw arrays come from: embedded, generated, files, or a download."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kbackend.backend_choice import keras as import_keras
from kbackend.errors import DataError
from kbackend.io import atomic_write

DATA_DIR_ENV = "KBACKEND_DATA_DIR"
CACHE_DIR_ENV = "KBACKEND_CACHE_DIR"
OFFLINE_ENV = "KBACKEND_OFFLINE"
EMBEDDED = ("digits", "mnist1d", "synthetic")


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


def keras_cache_dir() -> Path:
    """The folder ``keras.datasets`` downloads into (``$KERAS_HOME`` or ``~/.keras``)/datasets."""
    return Path(os.environ.get("KERAS_HOME") or Path.home() / ".keras") / "datasets"


def search_dirs(data_dir: str | os.PathLike | None) -> list[tuple[str, Path]]:
    """The folders searched for data files, in order, each with a label for error messages."""
    places: list[tuple[str, Path]] = []
    if data_dir is not None:
        places.append(("--data-dir", Path(data_dir)))
    if os.environ.get(DATA_DIR_ENV):
        places.append((DATA_DIR_ENV, Path(os.environ[DATA_DIR_ENV])))
    places.append(("Keras cache", keras_cache_dir()))
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
    return RawData(x[train], y[train], x[test], y[test], "image", 10, "scikit-learn (embedded)", 16.0)


def load_mnist1d() -> RawData:
    """MNIST-1D generated with the mnist1d package (never its download path), cached on disk."""
    # deferred: mnist1d is needed only for this dataset
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    spec = json.dumps(dict(sorted(vars(args).items())) if hasattr(args, "__dict__") else str(args),
                      sort_keys=True, default=str)
    digest = hashlib.sha256(spec.encode()).hexdigest()[:16]
    path = cache_dir() / f"mnist1d-{digest}.npz"
    source = f"mnist1d make_dataset (cached at {path})"
    if path.exists():
        try:
            with np.load(path) as cached:
                arrays = {k: cached[k] for k in ("x", "y", "x_test", "y_test")}
        except (OSError, ValueError, KeyError):
            arrays = None
    else:
        arrays = None
    if arrays is None:
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
    """Gaussian inputs labelled by a fixed random linear teacher (learnable), for throughput work."""
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


def _read_idx(path: Path) -> np.ndarray:
    """Read a gzip-compressed IDX file (the MNIST / Fashion-MNIST format)."""
    with gzip.open(path, "rb") as handle:
        data = handle.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise DataError(f"Invalid IDX file {path}: expected unsigned-byte IDX data.")
    ndim = data[3]
    dims = np.frombuffer(data, dtype=">u4", count=ndim, offset=4).astype(int)
    array = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if array.size != int(np.prod(dims)):
        raise DataError(f"Truncated IDX file {path}: expected {np.prod(dims)} values, got {array.size}.")
    return array.reshape(tuple(dims))


_FASHION_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)


def _mnist_from(root: Path) -> RawData | None:
    path = root / "mnist.npz"
    if not path.is_file():
        return None
    with np.load(path) as npz:
        arrays = [npz[k] for k in ("x_train", "y_train", "x_test", "y_test")]
    return RawData(arrays[0][..., None], arrays[1].astype(np.int32), arrays[2][..., None],
                   arrays[3].astype(np.int32), "image", 10, str(path), 255.0)


def _fashion_from(root: Path) -> RawData | None:
    for folder in (root / "fashion-mnist", root):
        if all((folder / name).is_file() for name in _FASHION_FILES):
            x_train, y_train, x_test, y_test = (_read_idx(folder / n) for n in _FASHION_FILES)
            return RawData(x_train[..., None], y_train.astype(np.int32), x_test[..., None],
                           y_test.astype(np.int32), "image", 10, str(folder), 255.0)
    return None


def _download(name: str) -> RawData:
    keras = import_keras()

    module = {"mnist": keras.datasets.mnist, "fashion_mnist": keras.datasets.fashion_mnist}[name]
    (x_train, y_train), (x_test, y_test) = module.load_data()
    return RawData(x_train[..., None], y_train.astype(np.int32), x_test[..., None],
                   y_test.astype(np.int32), "image", 10, f"keras.datasets.{name} download", 255.0)


def _load_files(name: str, reader, data_dir: str | os.PathLike | None) -> RawData:
    places = search_dirs(data_dir)
    for _, folder in places:
        raw = reader(folder)
        if raw is not None:
            return raw
    tried = "; ".join(f"{label}: {folder}" for label, folder in places)
    if os.environ.get(OFFLINE_ENV, "") not in ("", "0"):
        reason = f"download disabled by {OFFLINE_ENV}"
    else:
        try:
            return _download(name)
        except Exception as error:  # any failure of the download is reported, not raised raw
            reason = f"download failed ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
    raise DataError(
        f"Dataset {name!r} not found. Looked in {tried}; {reason}. Put its files in one of these "
        f"folders (see ../shared/data/README.md), or use an embedded dataset: "
        f"{', '.join(EMBEDDED)}."
    )


def load_mnist(data_dir: str | os.PathLike | None = None) -> RawData:
    """MNIST from ``mnist.npz`` in the search folders, else a Keras download."""
    return _load_files("mnist", _mnist_from, data_dir)


def load_fashion_mnist(data_dir: str | os.PathLike | None = None) -> RawData:
    """Fashion-MNIST from the four IDX files in the search folders, else a Keras download."""
    return _load_files("fashion_mnist", _fashion_from, data_dir)
