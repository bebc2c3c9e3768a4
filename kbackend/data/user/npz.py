"""``PATH.npz``: arrays read header-first, then member by member into their held dtype."""

from __future__ import annotations

import math
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kbackend.data.sources import READ_ERRORS
from kbackend.data.user.common import NPZ_PAIRS, Reader, Splits, Where, _check_limit, reading
from kbackend.errors import DataError, error_text

# An .npz member is read in chunks of this many bytes into its preallocated array.
NPZ_CHUNK_BYTES = 4 * 2**20
# Peak memory of loading arrays over what they hold, budgeted by the size check: the chunks
# and the validation rows copied out (10%), the finite check's mask (a quarter of float32).
NPZ_PEAK_FACTOR = 1.5


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
        raise where.error(f"{name} is not a readable .npy array ({error_text(error)}).") from None
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


@dataclass(frozen=True)
class NpzFile(Reader):
    """A ``.npz`` archive of ``x_train``/``y_train`` (or ``x``/``y``, ``y_<split>_<output>``)."""

    where: Where
    path: Path
    max_bytes: int

    def read(self) -> Splits:
        return Splits(name=self.path.name, kind="arrays", owned=True,
                      splits=_load_npz(self.where, self.path, self.max_bytes))


def _load_npz(where: Where, path: Path, max_bytes: int) -> dict[str, tuple]:
    with reading(where, "not a readable .npz archive", READ_ERRORS):
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
