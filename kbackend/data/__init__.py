"""Datasets: one registry, ``load(name, ...)`` -> train / validation / test splits plus metadata.

Every split is validated before it is returned (labels in range, finite inputs, matching
lengths, non-empty), so no training ever starts on bad data.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kbackend.data import sources
from kbackend.data.sources import RawData
from kbackend.data.validation import check_batch_size, validate_dataset, validate_split
from kbackend.digests import arrays_digest, json_digest
from kbackend.errors import DataError

# "spatial": the data's own shape (images as images, sequences as sequences), for models such as
# ``cnn`` that come in a 2-D and a 1-D form.
LAYOUTS = ("flat", "image", "sequence", "spatial")
DATA_FORMATS = ("channels_last", "channels_first")

# name -> (loader, whether it reads files and so takes data_dir)
DATASETS: dict[str, tuple[Callable[..., RawData], bool]] = {
    "digits": (lambda **_: sources.load_digits(), False),
    "mnist1d": (lambda **_: sources.load_mnist1d(), False),
    "mnist1d_large": (lambda **_: sources.load_mnist1d(sources.MNIST1D_LARGE_SAMPLES), False),
    "mnist": (lambda data_dir=None, **_: sources.load_mnist(data_dir), True),
    "fashion_mnist": (lambda data_dir=None, **_: sources.load_fashion_mnist(data_dir), True),
    "synthetic": (lambda synthetic=None, **_: sources.load_synthetic(**(synthetic or {})), False),
}

__all__ = ["DATASETS", "Dataset", "DatasetInfo", "check_batch_size",
           "from_arrays", "load", "take_rows", "validate_dataset", "validate_split"]


@dataclass(frozen=True)
class DatasetInfo:
    """What a model needs to know about a dataset."""

    name: str
    # A multi-input model's data (kbackend.workload.InputPacking): one shape per input name.
    input_shape: tuple[int, ...] | dict[str, tuple[int, ...]]
    num_classes: int
    source: str
    layout: str
    data_format: str | None
    num_train: int
    num_val: int
    num_test: int
    # Validation fraction 0: no split is held out and the validation figures are the test split's.
    val_is_test: bool = False
    # Labels are int32 class indices (num_classes of them); else float32 targets shaped as the
    # model's output (regression values, 0/1 labels, one-hot rows), num_classes their width.
    sparse_labels: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Dataset:
    """Train / validation / test splits: float32 inputs, int32 class labels (or float32 targets
    where ``info.sparse_labels`` is False)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    info: DatasetInfo

    def split(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """``(x, y)`` of the split called ``name`` (train, val or test)."""
        if name not in ("train", "val", "test"):
            raise DataError("Invalid split. Expected one of {'train', 'val', 'test'}. "
                            f"Received: {name!r}.")
        return getattr(self, f"x_{name}"), getattr(self, f"y_{name}")

    def digest(self) -> str:
        """The run keys' data digest: a hex digest of the six arrays (names, shapes, dtypes,
        bytes) and the label facts the model is built from. A label column, an edited file or
        another split all change it; the same arrays from another path, name or kind of source
        (built-in or the user's) do not: the arrays are what trains."""
        info = self.info
        return json_digest({
            "arrays": arrays_digest({f"{part}_{split}": array for split in ("train", "val", "test")
                                     for part, array in zip("xy", self.split(split), strict=True)}),
            "num_classes": info.num_classes, "sparse_labels": info.sparse_labels,
            "val_is_test": info.val_is_test})


def _arrange(x: np.ndarray, kind: str, layout: str, data_format: str, name: str) -> np.ndarray:
    """Reshape raw (N, H, W, C) images or (N, T, F) sequences into ``layout``."""
    if layout == "flat":
        return x.reshape(len(x), -1)
    if layout == "image":
        if kind != "image":
            raise DataError(
                f"Dataset {name!r} holds {kind} data, not images: a model that takes images cannot "
                "train on it (use one that takes flat or sequence inputs, e.g. cnn or cnn1d)."
            )
        return np.transpose(x, (0, 3, 1, 2)) if data_format == "channels_first" else x
    if kind == "image":  # rows as time steps: (N, H, W * C)
        return x.reshape(x.shape[0], x.shape[1], -1)
    if kind == "flat":
        return x.reshape(len(x), -1, 1)
    return x


# Rows moved per step by ``take_rows``: the only temporary it makes.
_TAKE_CHUNK_BYTES = 4 * 2**20


def take_rows(x: np.ndarray, rows: np.ndarray, *, in_place: bool) -> np.ndarray:
    """``x[rows]`` for sorted, distinct ``rows``. ``in_place``: moved to the front of ``x``
    itself (the caller's array is overwritten) and returned as a view, chunk by chunk, so a split
    costs no second copy of the data (``x[rows]`` would hold both until ``x`` is dropped).

    Safe because ``rows[i] >= i`` for sorted distinct rows: a row is read before any write
    reaches its position, and each chunk is copied out before it is written."""
    if not in_place or not x.flags.writeable or not x.flags.c_contiguous:
        return x[rows]
    step = max(1, _TAKE_CHUNK_BYTES // max(1, x[:1].nbytes))
    for start in range(0, len(rows), step):
        chunk = rows[start:start + step]
        x[start:start + len(chunk)] = x[chunk]
    return x[:len(rows)]


def validation_indices(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training rows, validation rows) of ``n`` samples, ``fraction`` held out, drawn by
    ``seed``: the one draw of a held-out validation split."""
    if not 0.0 < fraction < 1.0:
        raise DataError(f"Invalid validation fraction {fraction!r}: expected a value in [0, 1) "
                        "(0: no validation split, the test split stands in).")
    n_val = max(1, round(n * fraction))
    if n_val >= n:
        raise DataError(
            f"Validation fraction {fraction} leaves no training data out of {n} samples.")
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[n_val:]), np.sort(order[:n_val])


def from_arrays(
    name: str,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    *,
    num_classes: int,
    validation_fraction: float = 0.1,
    seed: int = 0,
    source: str = "arrays",
    layout: str = "flat",
    data_format: str | None = None,
    sparse_labels: bool = True,
    x_val: np.ndarray | None = None,
    y_val: np.ndarray | None = None,
    owned: bool = False,
) -> Dataset:
    """Build a validated ``Dataset`` from user arrays; the validation split is held out of train.

    ``validation_fraction=0`` holds nothing out: every sample trains and the test split stands in
    for validation (``info.val_is_test``), as papers that report test curves do. Nothing may then
    select on it (``TrainConfig`` refuses early stopping and targets). ``x_val``/``y_val``: the
    user's own validation split (then nothing is held out of train). ``sparse_labels`` False:
    float targets (``validate_split``), kept in their shape. ``owned``: ``x_train`` may be
    overwritten (read from a file): the validation split is taken out in place (``take_rows``).
    """
    if (x_val is None) != (y_val is None):
        raise DataError("x_val and y_val come together: pass both (the validation split) or "
                        "neither.")
    given = {"train": (x_train, y_train), "test": (x_test, y_test)}
    if x_val is not None and y_val is not None:
        given["validation"] = (x_val, y_val)
    for split, (x, y) in given.items():
        validate_split(np.asarray(x), np.asarray(y), num_classes, split, sparse_labels)
    label_dtype = np.int32 if sparse_labels else np.float32
    converted = np.asarray(x_train, dtype=np.float32)
    owned, x_train = owned or converted is not x_train, converted  # a converted copy is ours
    y_train = np.asarray(y_train).astype(label_dtype)
    x_test = np.asarray(x_test, dtype=np.float32)
    y_test = np.asarray(y_test).astype(label_dtype)
    val_is_test = validation_fraction == 0 and x_val is None
    if x_val is not None:
        x_val, y_val = np.asarray(x_val, dtype=np.float32), np.asarray(y_val).astype(label_dtype)
    elif val_is_test:
        x_val, y_val = x_test, y_test
    else:
        train_idx, val_idx = validation_indices(len(x_train), validation_fraction, seed)
        x_val, y_val = x_train[val_idx], y_train[val_idx]  # copied out first
        x_train = take_rows(x_train, train_idx, in_place=owned)
        y_train = y_train[train_idx]
    dataset = Dataset(
        x_train, y_train, x_val, y_val, x_test, y_test,
        DatasetInfo(name, tuple(int(d) for d in x_train.shape[1:]), int(num_classes), source,
                    layout, data_format, len(x_train), len(x_val), len(x_test), val_is_test,
                    sparse_labels),
    )
    validate_split(dataset.x_val, dataset.y_val, num_classes, "validation", sparse_labels)
    return dataset


def _scaled(x: np.ndarray, scale: float) -> np.ndarray:
    """``x.astype(np.float32) / scale`` in one allocation (bit for bit the same values)."""
    return np.divide(x, np.float32(scale), dtype=np.float32)


def load(
    name: str,
    *,
    layout: str = "flat",
    data_format: str = "channels_last",
    validation_fraction: float = 0.1,
    seed: int = 0,
    data_dir: str | os.PathLike | None = None,
    synthetic: dict[str, Any] | None = None,
) -> Dataset:
    """Load dataset ``name`` as validated float32 splits in ``layout``.

    ``layout``: ``flat`` (N, D) for MLPs, ``image`` (N, H, W, C) or (N, C, H, W) per
    ``data_format`` for CNNs, ``sequence`` (N, T, F) for recurrent and 1-D conv models (image
    rows as steps), ``spatial`` the data's own (image data as images, the rest as sequences).
    The validation split is drawn from the training data, deterministically for ``seed``.
    ``synthetic`` passes options to the synthetic generator (input_shape, num_classes, ...).
    """
    if name not in DATASETS:
        raise DataError(f"Unknown dataset. Expected one of {sorted(DATASETS)}. Received: {name!r}.")
    if layout not in LAYOUTS:
        raise DataError(f"Invalid layout. Expected one of {list(LAYOUTS)}. Received: {layout!r}.")
    if data_format not in DATA_FORMATS:
        raise DataError(
            f"Invalid data_format. Expected one of {list(DATA_FORMATS)}. Received: {data_format!r}."
        )
    loader, reads_files = DATASETS[name]
    if data_dir is not None and not reads_files:
        raise DataError(f"--data-dir does not apply to {name!r}: it is "
                        f"{'generated' if name != 'digits' else 'embedded in scikit-learn'}, "
                        "not read from files (only mnist and fashion_mnist are).")
    raw = loader(data_dir=data_dir, synthetic=synthetic)
    if layout == "spatial":  # the data's own: image data as images, the rest as sequences
        layout = "image" if raw.kind == "image" else "sequence"
    # One float32 pass (the same values as astype then divide): each fresh 188 MB array of
    # MNIST costs a start-up ~0.1-0.3 s of first-touch page faults.
    x_train = _arrange(_scaled(raw.x_train, raw.scale), raw.kind, layout, data_format, name)
    x_test = _arrange(_scaled(raw.x_test, raw.scale), raw.kind, layout, data_format, name)
    return from_arrays(
        name, x_train, raw.y_train, x_test, raw.y_test,
        num_classes=raw.num_classes, validation_fraction=validation_fraction, seed=seed,
        source=raw.source, layout=layout,
        data_format=data_format if layout == "image" else None,
    )
