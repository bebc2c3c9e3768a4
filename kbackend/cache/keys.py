"""Cache keys: rounding request rows and hashing them.

A row's key is a hash of its rounded float32 bytes; its namespace is the model's fingerprint
(architecture and every weight: ``kbackend.serving.model.model_fingerprint``, which exports
record too), so a changed model reads and writes other entries and never serves a stale answer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kbackend.cache.store import CacheError
from kbackend.errors import ConfigError

KEY_BYTES = 16  # blake2b digest size: collisions are out of reach at any realistic cache size
EXACT_WORDS = ("exact", "none", "-")
# Decimals Rounding accepts. Rows are rounded in float64 as x * 10**d: beyond 15 the scale
# overflows (10**400 is inf, so every key became NaN) or underflows to 0, and float32 inputs carry
# no more than 9 significant digits anyway.
MAX_DECIMALS = 15


@dataclass(frozen=True)
class Rounding:
    """How request rows are rounded before lookup: exact, one number of decimals for every
    feature, or one per feature (``None`` for a feature left exact).

    Decimals may be negative (``-1`` rounds to tens), as in ``numpy.round``; each is within
    ``-MAX_DECIMALS..MAX_DECIMALS``.
    """

    decimals: int | tuple[int | None, ...] | None = None

    def __post_init__(self) -> None:
        values = self.decimals if isinstance(self.decimals, tuple) else (self.decimals,)
        for value in values:
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or abs(value) > MAX_DECIMALS):
                raise ConfigError(
                    f"Invalid decimals: expected integers between -{MAX_DECIMALS} and "
                    f"{MAX_DECIMALS} (or 'exact'); more decimals overflow the float rounding and "
                    f"give NaN keys. Received: {value!r}.")

    @classmethod
    def parse(cls, text: str | None) -> Rounding:
        """``None``/``'exact'`` -> exact; ``'2'`` -> 2 decimals; ``'2,2,exact,0'`` -> per
        feature."""
        if text is None or text.strip().lower() in EXACT_WORDS:
            return cls(None)
        parts = [part.strip().lower() for part in text.split(",")]
        try:
            values = [None if part in EXACT_WORDS else int(part) for part in parts]
        except ValueError:
            raise ConfigError(
                f"Invalid decimals {text!r}: expected an integer, 'exact', or a comma-separated "
                "list of those (one per feature), e.g. 2 or 2,2,exact,0."
            ) from None
        if len(values) == 1:
            return cls(values[0])
        return cls(tuple(values))

    def describe(self) -> str:
        if self.decimals is None:
            return "exact"
        if isinstance(self.decimals, int):
            return f"{self.decimals} decimals"
        return "per feature: " + ",".join("exact" if d is None else str(d) for d in self.decimals)

    def check(self, row_shape: tuple[int | None, ...]) -> None:
        """Raise ``ConfigError`` if per-feature decimals do not match the row's feature count."""
        if isinstance(self.decimals, tuple):
            features = int(np.prod([d or 0 for d in row_shape]))
            if len(self.decimals) != features:
                raise ConfigError(
                    f"Invalid decimals: expected one value per feature ({features} for rows of "
                    f"shape {row_shape}), received {len(self.decimals)}."
                )

    def apply(self, x: np.ndarray) -> np.ndarray:
        """``x`` (float32, batch first) rounded, as float32, with -0.0 turned into 0.0."""
        if self.decimals is None:
            return x + np.float32(0.0)  # only normalizes -0.0 (same answer, must be the same key)
        wide = x.astype(np.float64)  # round in float64, then store what the model will see
        if isinstance(self.decimals, int):
            rounded = np.round(wide, self.decimals)
        else:
            flat = wide.reshape(len(wide), -1)
            self.check(tuple(x.shape[1:]))
            rounded = flat.copy()
            for decimals in {d for d in self.decimals if d is not None}:
                columns = [i for i, d in enumerate(self.decimals) if d == decimals]
                rounded[:, columns] = np.round(flat[:, columns], decimals)
            rounded = rounded.reshape(wide.shape)
        return rounded.astype(np.float32) + np.float32(0.0)


def row_keys(x: np.ndarray) -> list[bytes]:
    """One key per row of the (rounded, float32, C-contiguous) batch ``x``."""
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(len(x), -1)
    return [hashlib.blake2b(row.tobytes(), digest_size=KEY_BYTES).digest() for row in rows]


def encode_value(row: np.ndarray) -> bytes:
    """A prediction row as stored (float32 bytes)."""
    return np.ascontiguousarray(row, dtype=np.float32).tobytes()


def decode_values(values: Sequence[bytes], row_shape: tuple[int, ...]) -> np.ndarray:
    """Stored values back to a float32 array of shape ``(len(values), *row_shape)``."""
    expected = 4 * int(np.prod(row_shape))
    for value in values:
        if len(value) != expected:
            raise CacheError(
                f"A cached prediction has {len(value)} bytes, expected {expected} for an output "
                f"row of shape {row_shape}; the cache is damaged: run kbackend cache clear."
            )
    joined = b"".join(values)
    return np.frombuffer(joined, dtype=np.float32).reshape(len(values), *row_shape).copy()
