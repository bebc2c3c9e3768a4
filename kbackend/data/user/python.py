"""Python objects as data: ``(x, y)`` arrays, a dataset, or a dict of splits (``from_python``,
and what a ``FILE.py:FUNCTION`` source returns)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kbackend.data.user.common import _NPZ_NAMES, SPLIT_NAMES, Reader, Splits, Where, _check_split
from kbackend.data.user.datasets import (
    _is_py_dataset,
    _is_tf_dataset,
    _read_py_dataset,
    _read_tf_dataset,
)
from kbackend.data.user.npz import _npz_keys


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


@dataclass(frozen=True)
class PythonObjects(Reader):
    """What a Python caller passes (``from_python``): ``x`` and ``y`` arrays, or ``x`` alone
    holding its labels (a dataset, an ``(x, y)`` tuple, a dict of splits), and optionally
    ``validation_data``."""

    where: Where
    name: str
    x: Any
    y: Any
    validation_data: Any
    max_bytes: int

    def read(self) -> Splits:
        where, limit = self.where, self.max_bytes
        if self.y is None:
            splits = _splits_from_value(where, self.x, limit)
        elif _is_tf_dataset(self.x) or _is_py_dataset(self.x) or isinstance(self.x, dict):
            raise where.error(f"x is {_type_words(self.x)}, which holds its own labels: pass "
                              "y=None.")
        else:
            splits = {"train": _read_pair(where, (self.x, self.y), "train", limit)}
        if self.validation_data is not None:
            if "val" in splits:
                raise where.error("validation data given twice: in x's splits and "
                                  "validation_data.")
            splits["val"] = _read_pair(where, self.validation_data, "val", limit)
        return Splits(name=self.name, kind="arrays", splits=splits)
