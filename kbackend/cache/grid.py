"""The grid SPEC of ``kbackend cache warm``: a discrete set of input rows to precompute.

Syntax: axis clauses separated by ``;``, each ``FEATURES=VALUES``:

- FEATURES: a feature index ``3``, an inclusive range ``0-7``, or ``*`` (every feature no other
  clause names). Features are counted over the flattened input row.
- VALUES: a comma-separated list ``0,0.5,1``, or ``START:STOP:COUNT``: COUNT evenly spaced values
  from START to STOP inclusive (``0:1:11`` = 0, 0.1, ..., 1).

Every feature must get values; the grid is the Cartesian product of the features' value lists.
Example for 4 features: ``0=0:1:11; 1=0,0.5,1; *=0`` gives 11 x 3 = 33 rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kbackend.errors import ConfigError

_EXAMPLE = "e.g. '0=0:1:11; 1=0,0.5,1; *=0'"


@dataclass(frozen=True)
class GridSpec:
    """One array of candidate values per feature (of the flattened row)."""

    values: tuple[np.ndarray, ...]

    @property
    def size(self) -> int:
        return math.prod(len(v) for v in self.values)

    def chunks(self, chunk: int = 1024) -> Iterator[np.ndarray]:
        """The grid's rows, ``chunk`` at a time, as float32 arrays of shape (rows, features)."""
        shape = tuple(len(v) for v in self.values)
        for start in range(0, self.size, chunk):
            flat = np.arange(start, min(start + chunk, self.size))
            indices = np.unravel_index(flat, shape)
            columns = [v[i] for v, i in zip(self.values, indices, strict=True)]
            yield np.stack(columns, axis=1).astype(np.float32)


def _parse_values(text: str, clause: str) -> np.ndarray:
    try:
        if ":" in text:
            parts = text.split(":")
            if len(parts) != 3:
                raise ValueError
            start, stop, count = float(parts[0]), float(parts[1]), int(parts[2])
            if count < 1:
                raise ValueError
            values = np.linspace(start, stop, count)
        else:
            values = np.array([float(v) for v in text.split(",")])
    except ValueError:
        raise ConfigError(
            f"Invalid grid clause {clause!r}: expected values as 'a,b,c' or 'START:STOP:COUNT' "
            f"(COUNT >= 1), {_EXAMPLE}."
        ) from None
    if not np.isfinite(values).all():
        raise ConfigError(f"Invalid grid clause {clause!r}: values must be finite numbers.")
    return np.unique(values)


def _parse_features(text: str, clause: str) -> tuple[int, int] | None:
    """The inclusive feature range a clause names, or None for ``*`` (syntax only: the model's
    feature count is checked by ``GridText.resolve``)."""
    if text == "*":
        return None
    try:
        if "-" in text:
            low, high = (int(p) for p in text.split("-"))
        else:
            low = high = int(text)
    except ValueError:
        raise ConfigError(
            f"Invalid grid clause {clause!r}: expected features as an index '3', a range '0-7' "
            f"or '*', {_EXAMPLE}."
        ) from None
    if not 0 <= low <= high:
        raise ConfigError(
            f"Invalid grid clause {clause!r}: expected feature indices >= 0 and a range LOW-HIGH "
            f"with LOW <= HIGH, received {low}-{high}."
        )
    return low, high


@dataclass(frozen=True)
class GridText:
    """A grid SPEC whose syntax was checked, before the model's feature count is known.

    ``clauses`` holds, per clause, its text, its inclusive feature range (None for ``*``) and
    its values. ``resolve`` turns it into the ``GridSpec`` for rows of a given feature count.
    """

    spec: str
    clauses: tuple[tuple[str, tuple[int, int] | None, np.ndarray], ...]
    max_rows: int

    def resolve(self, features: int) -> GridSpec:
        """The grid over rows of ``features`` features; a one-line ``ConfigError`` when a clause
        names a feature the rows do not have, a feature has no values, or the grid is too large."""
        if isinstance(features, bool) or not isinstance(features, int) or features < 1:
            raise ConfigError(f"Invalid features {features!r}: expected a positive number of "
                              "features per row.")
        assigned: dict[int, np.ndarray] = {}
        rest: np.ndarray | None = None
        for clause, span, values in self.clauses:
            if span is None:
                rest = values
                continue
            low, high = span
            if high >= features:
                raise ConfigError(
                    f"Invalid grid clause {clause!r}: feature indices must lie in 0-{features - 1} "
                    f"(the model takes {features} features), received {low}-{high}."
                )
            assigned.update((index, values) for index in range(low, high + 1))
        missing = [i for i in range(features) if i not in assigned]
        if missing:
            if rest is None:
                more = "..." if len(missing) > 10 else ""
                raise ConfigError(
                    f"Invalid grid {self.spec!r}: features {missing[:10]}{more} have no values; "
                    "add a clause such as '*=0' for the features held constant."
                )
            assigned.update((index, rest) for index in missing)
        grid = GridSpec(tuple(assigned[i] for i in range(features)))
        if grid.size > self.max_rows:
            _too_many(self.spec, f"{grid.size:.3g}", self.max_rows)
        return grid


def _too_many(spec: str, rows: str, max_rows: int) -> None:
    raise ConfigError(
        f"Invalid grid {spec!r}: it has {rows} rows, more than the limit of {max_rows} "
        "(raise --max-rows, or use fewer values)."
    )


def parse_grid_text(spec: str, max_rows: int = 1_000_000) -> GridText:
    """Check ``spec``'s syntax without knowing the rows' feature count (so a command refuses a bad
    ``--grid`` before it loads a model): the clauses, their values and feature ranges, a feature
    or ``*`` named twice, and a grid whose named features alone exceed ``max_rows`` rows."""
    if not isinstance(spec, str):
        raise ConfigError(f"Invalid grid: expected a SPEC string, {_EXAMPLE}. Received: {spec!r}.")
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
        raise ConfigError(f"Invalid max_rows {max_rows!r}: expected a positive number of rows.")
    clauses = [c.strip() for c in spec.split(";") if c.strip()]
    if not clauses:
        raise ConfigError(f"Invalid grid {spec!r}: expected clauses FEATURES=VALUES separated "
                          f"by ';', {_EXAMPLE}.")
    parsed: list[tuple[str, tuple[int, int] | None, np.ndarray]] = []
    for clause in clauses:
        if clause.count("=") != 1:
            raise ConfigError(f"Invalid grid clause {clause!r}: expected FEATURES=VALUES, "
                              f"{_EXAMPLE}.")
        left, right = (part.strip() for part in clause.split("="))
        values = _parse_values(right, clause)
        span = _parse_features(left, clause)
        for _, other, _ in parsed:
            if span is None and other is None:
                raise ConfigError(f"Invalid grid {spec!r}: '*' appears in more than one clause.")
            if (span is not None and other is not None
                    and span[0] <= other[1] and other[0] <= span[1]):
                index = max(span[0], other[0])
                raise ConfigError(f"Invalid grid {spec!r}: feature {index} appears in more than "
                                  "one clause.")
        parsed.append((clause, span, values))
    # The named features alone give at least this many rows (in logs: a range may be huge).
    log_rows = sum((span[1] - span[0] + 1) * math.log(len(values))
                   for _, span, values in parsed if span is not None)
    if log_rows > math.log(max_rows) + 1e-9:
        _too_many(spec, f"at least 10^{log_rows / math.log(10):.0f}", max_rows)
    return GridText(spec, tuple(parsed), max_rows)


def parse_grid(spec: str, features: int, max_rows: int = 1_000_000) -> GridSpec:
    """Parse ``spec`` for rows of ``features`` features; refuse grids over ``max_rows`` rows."""
    return parse_grid_text(spec, max_rows).resolve(features)
