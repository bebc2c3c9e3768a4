"""Checks that run before any training: JAX trains silently on out-of-range labels (loss 0.0)
and an empty split gives a bare ``StopIteration``, so bad data is caught here, by name."""

from __future__ import annotations

from typing import Any

import numpy as np

from kbackend.errors import DataError


def validate_split(x: np.ndarray, y: np.ndarray, num_classes: int, split: str,
                   sparse_labels: bool = True) -> None:
    """Raise ``DataError`` if ``(x, y)`` is not a valid ``split``: class indices in
    ``[0, num_classes)``, or with ``sparse_labels`` False finite float targets of any shape
    (regression values, 0/1 labels, one-hot rows: the loss checks their meaning)."""
    if len(x) == 0 or len(y) == 0:
        raise DataError(
            f"Empty {split} split: x has {len(x)} samples and y has {len(y)}; "
            "expected at least 1. Check the data source or the split fractions."
        )
    if len(x) != len(y):
        raise DataError(
            f"Mismatched lengths in the {split} split: x has {len(x)} samples but y has {len(y)}."
        )
    y = np.asarray(y)
    if not sparse_labels:
        _check_targets(y, split)
        _check_inputs(np.asarray(x), split)
        return
    if y.ndim != 1:
        raise DataError(
            f"Invalid labels in the {split} split: expected a 1-D array of class indices. "
            f"Received: y.shape={y.shape}."
        )
    if not np.issubdtype(y.dtype, np.integer):
        if not np.issubdtype(y.dtype, np.floating) or not np.all(np.isfinite(y)):
            raise DataError(f"Invalid labels in the {split} split: dtype {y.dtype} is not integer.")
        if not np.all(np.equal(np.mod(y, 1), 0)):
            raise DataError(
                f"Invalid labels in the {split} split: expected integer class indices. "
                f"Received non-integer values such as {y[np.mod(y, 1) != 0][0]!r}."
            )
    low, high = int(y.min()), int(y.max())
    if low < 0 or high >= num_classes:
        bad = low if low < 0 else high
        raise DataError(
            f"Invalid label {bad} in the {split} split: labels must lie in [0, {num_classes}) "
            f"for {num_classes} classes. Received labels in [{low}, {high}]."
        )
    _check_inputs(np.asarray(x), split)


def _check_targets(y: np.ndarray, split: str) -> None:
    if not (np.issubdtype(y.dtype, np.number) or np.issubdtype(y.dtype, np.bool_)):
        raise DataError(f"Invalid labels in the {split} split: dtype {y.dtype} is not numeric.")
    if np.issubdtype(y.dtype, np.floating) and not np.isfinite(y).all():
        index = int(np.nonzero(~np.isfinite(y.reshape(len(y), -1)))[0][0])
        raise DataError(f"Non-finite labels (NaN or Inf) in the {split} split, first at index "
                        f"{index}. Clean or drop them before training.")


def _check_inputs(x: np.ndarray, split: str) -> None:
    if np.issubdtype(x.dtype, np.floating):
        finite = np.isfinite(x)
        if not finite.all():
            bad_rows = np.unique(np.nonzero(~finite.reshape(len(x), -1))[0])
            kind = "NaN" if np.isnan(x).any() else "Inf"
            raise DataError(
                f"Non-finite inputs ({kind}) in the {split} split: {len(bad_rows)} sample(s), "
                f"first at index {int(bad_rows[0])}. Clean or drop them before training."
            )
    elif not np.issubdtype(x.dtype, np.integer) and not np.issubdtype(x.dtype, np.bool_):
        raise DataError(f"Invalid inputs in the {split} split: dtype {x.dtype} is not numeric.")
    # Finite float32 (or narrower) values always fit float32: only wider floats need the scan
    # (np.abs allocates a copy of the split: ~0.1 s of start-up on MNIST).
    if np.issubdtype(x.dtype, np.floating) and x.dtype.itemsize > 4 and x.size and \
            np.abs(x).max() > np.finfo(np.float32).max:
        raise DataError(f"Inputs beyond float32's range in the {split} split (largest magnitude "
                        f"{np.abs(x).max():.3g}): kbackend trains in float32; rescale them.")


def validate_dataset(dataset: Any) -> None:
    """Raise ``DataError`` unless every split of ``dataset`` (a ``kbackend.data.Dataset``) is valid.

    ``load`` and ``from_arrays`` validate what they build; this checks a ``Dataset`` built or
    changed by hand: each split as ``validate_split`` does, and one input shape, the
    ``info.input_shape``, across the splits (else the model is built for the wrong shape).
    """
    info = getattr(dataset, "info", None)
    num_classes = getattr(info, "num_classes", None)
    sparse = getattr(info, "sparse_labels", True)
    if not isinstance(num_classes, int | np.integer) or isinstance(num_classes, bool) or (
            num_classes < 1 and sparse):
        raise DataError(
            "Invalid dataset: expected a kbackend.data.Dataset whose info.num_classes is a "
            f"positive integer. Received: {type(dataset).__name__} with "
            f"num_classes={num_classes!r}."
        )
    input_shape = tuple(getattr(info, "input_shape", ()))
    for split, name in (("train", "train"), ("val", "validation"), ("test", "test")):
        x = np.asarray(getattr(dataset, f"x_{split}"))
        y = np.asarray(getattr(dataset, f"y_{split}"))
        validate_split(x, y, int(num_classes), name, sparse)
        if x.shape[1:] != input_shape:
            raise DataError(
                f"Invalid inputs in the {name} split: expected samples of shape {input_shape} "
                f"(the dataset's info.input_shape). Received: {x.shape[1:]}."
            )


def check_batch_size(batch_size: int, num_train: int) -> None:
    """Raise ``DataError`` unless ``1 <= batch_size <= num_train``."""
    if not isinstance(batch_size, int | np.integer) or batch_size < 1:
        raise DataError(f"Invalid batch size {batch_size!r}: expected a positive integer.")
    if batch_size > num_train:
        raise DataError(
            f"Batch size {batch_size} is larger than the training split ({num_train} samples): "
            f"use a batch size of at most {num_train}."
        )
