"""Loading a model for serving, identifying it, checking request inputs, and predicting in
shape buckets.

``model_fingerprint`` names a model by its architecture and every weight: the prediction cache
keys its entries under it and an export records it (so both import it from here).

``BatchPredictor`` pads every batch to the next power of two (at most ``max_batch`` rows per call)
before ``predict_on_batch``: a jit-compiled predict function compiles once per input shape, so
without buckets every new request size would pay a compile (~0.1 s measured here on both
backends) while serving.
"""

from __future__ import annotations

import hashlib
import json
import threading
from typing import Any

import numpy as np

from kbackend.backend_choice import keras as import_keras
from kbackend.data.user import text_array
from kbackend.errors import DataError
from kbackend.host_front import HostFront
from kbackend.model_sources import (  # shared
    ModelError,
    check_model_file,
    check_servable,
    shape_text,
    takes_shape,
)

__all__ = ["BatchPredictor", "ModelError", "bucket_size", "check_model_file", "check_servable",
           "input_shape", "model_fingerprint", "output_shape", "takes_strings",
           "validate_inputs"]


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def model_fingerprint(model: Any) -> str:
    """A hex SHA-256 of the model's class, config and every weight (name, shape, dtype, bytes).

    Independent of the backend: the same ``.keras`` file loaded under JAX or TensorFlow has the
    same fingerprint. Changing any weight by any amount changes it.
    """
    keras = import_keras()
    digest = hashlib.sha256()
    header = {"class": type(model).__name__, "config": _jsonable(model.get_config())}
    digest.update(json.dumps(header, sort_keys=True).encode())
    for variable in model.weights:
        value = np.ascontiguousarray(keras.ops.convert_to_numpy(variable))
        meta = f"{variable.path}|{value.shape}|{value.dtype.str}|".encode()
        digest.update(len(meta).to_bytes(4, "little") + meta)
        digest.update(value.tobytes())
    return digest.hexdigest()


def input_shape(model: Any) -> tuple[int | None, ...]:
    """The shape of one input row (without the batch axis)."""
    return tuple(model.inputs[0].shape[1:])


def output_shape(model: Any) -> tuple[int | None, ...]:
    """The shape of one output row (without the batch axis)."""
    return tuple(model.outputs[0].shape[1:])


def _has_rows_of(array: np.ndarray, row_shape: tuple[int | None, ...]) -> bool:
    """Whether ``array`` is a batch of rows of ``row_shape`` (a None dimension: any size)."""
    return array.ndim >= 1 and takes_shape(row_shape, array.shape[1:])


def host_front(model: Any) -> HostFront | None:
    """The string front of ``model`` (``kbackend.host_front``) that serving runs on the host;
    None if it has none, or one kbackend cannot split off (Keras runs such a model whole, as
    before: TensorFlow can, JAX cannot)."""
    try:
        return HostFront.of(model)
    except ModelError:
        return None


def takes_strings(model: Any) -> bool:
    """Whether ``model`` starts with string preprocessing (``kbackend.host_front``): its
    inputs are raw strings, run through that front on the host before the model."""
    front = host_front(model)
    return front is not None and front.takes_text


def _validate_strings(x: Any, row_shape: tuple[int | None, ...], name: str) -> np.ndarray:
    """``x`` as an array of strings of rows ``row_shape`` (a list of strings is a column
    for a model taking ``(N, 1)``); ``DataError`` naming what is wrong."""
    array = text_array(x, DataError, f"Invalid {name}: the model takes strings; the input")
    if array.ndim == 1 and tuple(row_shape) == (1,):
        array = array.reshape(len(array), 1)
    if not _has_rows_of(array, row_shape):
        raise DataError(f"Invalid {name}: expected strings of shape {shape_text(row_shape)}"
                        f", received {array.shape}.")
    if array.shape[0] == 0:
        raise DataError(f"Invalid {name}: expected at least one string, received 0 rows.")
    return array


def validate_inputs(x: Any, row_shape: tuple[int | None, ...], name: str = "inputs", *,
                    strings: bool = False) -> np.ndarray:
    """``x`` as a float32 batch of rows of ``row_shape`` (``strings``: as an array of strings,
    for a model with a string front); ``DataError`` naming what is wrong.

    Refused: non-numeric dtypes, a wrong number of axes or features, an empty batch, NaN or inf.
    """
    if strings:
        return _validate_strings(x, row_shape, name)
    array = np.asarray(x)
    if array.dtype.kind not in "iuf":
        raise DataError(
            f"Invalid {name}: expected numbers (int or float), received dtype {array.dtype}."
        )
    expected = shape_text(row_shape)
    if not _has_rows_of(array, row_shape):
        features = f" ({row_shape[0]} features per row)" if len(row_shape) == 1 else ""
        raise DataError(
            f"Invalid {name}: expected shape {expected}{features}, received {array.shape}.")
    if array.shape[0] == 0:
        raise DataError(f"Invalid {name}: expected at least one row of shape {expected}, "
                        "received 0 rows.")
    array = array.astype(np.float32, copy=False)
    finite = np.isfinite(array.reshape(len(array), -1)).all(axis=1)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        kind = "NaN" if np.isnan(array[bad[0]]).any() else "inf"
        raise DataError(
            f"Invalid {name}: expected finite numbers, received {kind} in {len(bad)} row(s) "
            f"(first: row {int(bad[0])})."
        )
    return array


def bucket_size(rows: int, max_batch: int) -> int:
    """The padded size of a call with ``rows`` rows: the next power of two, at most
    ``max_batch``."""
    return min(max_batch, 1 << max(0, int(rows - 1).bit_length()))


class BatchPredictor:
    """Predicts with a Keras model in power-of-two shape buckets (one compile per bucket).

    Thread-safe: calls into the model are serialized by a lock.
    """

    def __init__(self, model: Any, max_batch: int = 1024) -> None:
        if max_batch < 1 or max_batch & (max_batch - 1):
            raise DataError(f"Invalid max_batch {max_batch}: expected a power of two >= 1.")
        check_servable(model)
        # A string front (TextVectorization, StringLookup, ...) runs on the host, the rest of
        # the model in the compiled predict function (XLA has no strings).
        self.front = host_front(model)
        self.takes_strings = self.front is not None and self.front.takes_text
        self.model = self.front.rest(model) if self.front is not None else model
        self.max_batch = max_batch
        self.input_shape = input_shape(model)
        self.output_shape = output_shape(model)
        self._lock = threading.Lock()

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Predictions for the float32 batch ``x`` (already validated; strings for a model
        with a string front) as a float32 array."""
        if self.front is not None:
            x = self.front.apply(x, cache=False)
        outputs = []
        for start in range(0, len(x), self.max_batch):
            chunk = x[start:start + self.max_batch]
            size = bucket_size(len(chunk), self.max_batch)
            if size != len(chunk):
                pad = np.zeros((size - len(chunk), *chunk.shape[1:]), dtype=chunk.dtype)
                chunk = np.concatenate([chunk, pad])
            with self._lock:
                result = self.model.predict_on_batch(chunk)
            kept = min(self.max_batch, len(x) - start)
            outputs.append(np.asarray(result, dtype=np.float32)[:kept])
        return np.concatenate(outputs)

    def warm_up(self, sizes: tuple[int, ...] = (1,)) -> None:
        """Compile the buckets of ``sizes`` rows now, so no request pays for it."""
        fixed = tuple(d for d in self.input_shape if d is not None)
        if len(fixed) < len(self.input_shape):
            return
        for rows in sizes:
            self(np.full((rows, *fixed), "", dtype=object) if self.takes_strings
                 else np.zeros((rows, *fixed), dtype=np.float32))
