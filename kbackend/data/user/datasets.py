"""``tf.data.Dataset`` and ``keras.utils.PyDataset`` splits read into memory, and text turned
into token ids (``vectorize_text``)."""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from kbackend.backend_choice import keras as import_keras
from kbackend.data.user.common import (
    READ_BATCH,
    TEXT_MAX_TOKENS,
    TEXT_SEQUENCE_LENGTH,
    Where,
    _check_limit,
    _check_split,
    reading,
)
from kbackend.errors import DataError, error_text


def _tensorflow() -> Any:
    import_keras()  # the backend choice comes first: TensorFlow may import Keras
    try:
        import tensorflow as tf  # deferred: only folder, TFDS and tf.data sources need it
    except ImportError as error:
        raise DataError(f"This data source needs TensorFlow, which does not import here "
                        f"({error_text(error)}): pip install tensorflow-cpu.") from None
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
    kept and concatenated. ``shuffle_seed``: the rows come out in ``fixed_order``'s order for
    that seed (written straight to their places when ``rows`` is known)."""

    def __init__(self, where: Where, split: str, rows: int | None,
                 shuffle_seed: int | None = None) -> None:
        self.where, self.split, self.rows = where, split, rows
        self.shuffle_seed = shuffle_seed
        self.xs: list[np.ndarray] = []
        self.ys: list[np.ndarray] = []
        self.filled = 0
        # where the i-th sample read goes: the inverse of the final order
        self.places = (None if rows is None or shuffle_seed is None
                       else np.argsort(fixed_order(rows, shuffle_seed)))

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
            read = slice(0, self.filled) if self.places is None else self.places[:self.filled]
            self.xs, self.ys = [target_x[read]], [target_y[read]]  # back in reading order
            self.rows = self.places = None
            self.add(x, y)
            return
        place = slice(self.filled, end) if self.places is None else self.places[self.filled:end]
        target_x[place], target_y[place] = x, y
        self.filled = end

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if self.rows is not None and self.xs:
            if self.filled < self.rows and self.places is not None:  # fewer than announced
                # the samples read, in reading order, then shuffled: one gather
                assert self.shuffle_seed is not None  # places are made only with a seed
                rows = self.places[:self.filled][fixed_order(self.filled, self.shuffle_seed)]
                return self.xs[0][rows], self.ys[0][rows]
            return self.xs[0][:self.filled], self.ys[0][:self.filled]
        if not self.xs:
            raise self.where.error(f"the {self.split} split is empty: the dataset yields no "
                                   "samples.")
        try:
            x, y = np.concatenate(self.xs), np.concatenate(self.ys)
        except ValueError as error:
            raise self.where.error(f"the {self.split} split's batches differ in sample shape "
                                   f"({error_text(error)}).") from None
        self.xs, self.ys = [], []  # the batches go before the shuffled copy is made
        if self.shuffle_seed is None:
            return x, y
        order = fixed_order(len(x), self.shuffle_seed)
        return x[order], y[order]


def fixed_order(count: int, seed: int) -> np.ndarray:
    """The order ``count`` rows read in file order are shuffled into for ``seed`` (NumPy's
    generator: the same in every process and on every backend)."""
    return np.random.default_rng(seed).permutation(count)


def _read_tf_dataset(where: Where, dataset: Any, split: str, max_bytes: int,
                     batched: bool | None = None, rows: int | None = None,
                     shuffle_seed: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A finite ``tf.data.Dataset`` of ``(x, y)`` read into memory, at most ``max_bytes``;
    ``rows``: how many samples it holds, if known (else its cardinality when unbatched);
    ``shuffle_seed``: its samples shuffled into ``fixed_order`` (else kept in its order)."""
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
    batches, total = _Batches(where, split, rows, shuffle_seed), 0
    with reading(where, f"reading the {split} dataset failed",
                 (tf.errors.OpError, ValueError, TypeError)):
        for x, y in dataset.as_numpy_iterator():
            x, y = np.asarray(x), np.asarray(y)
            if x.ndim == 0 or y.ndim == 0:
                raise where.error(f"the {split} dataset looked batched but yields single "
                                  "values: batch it or give arrays.")
            total += x.nbytes + y.nbytes
            _check_limit(where, total, max_bytes, f"the {split} dataset (or it is infinite)")
            batches.add(x, y)
    return batches.arrays()


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
    batches, total = _Batches(where, split, None), 0
    for index in range(int(count)):
        try:
            batch = dataset[index]
        except Exception as error:
            raise where.error(f"the {split} PyDataset raised on batch {index} "
                              f"({error_text(error)}).") from None
        if not isinstance(batch, tuple | list) or len(batch) != 2:
            extra = " (sample weights are not read)" if isinstance(batch, tuple | list) else ""
            raise where.error(f"batch {index} of the {split} PyDataset is not an (x, y) pair"
                              f"{extra}. Received: {type(batch).__name__}.")
        x, y = _check_split(where, split, *batch)
        total += x.nbytes + y.nbytes
        _check_limit(where, total, max_bytes, f"the {split} PyDataset")
        batches.add(x, y)
    return batches.arrays()


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
