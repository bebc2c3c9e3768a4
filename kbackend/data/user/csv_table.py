"""``PATH.csv`` with a label column: numeric features and the label parsed straight into arrays."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kbackend.data.user.common import Reader, Splits, Where, _check_limit, reading
from kbackend.errors import DataError


def _csv_dialect(sample: str) -> type[csv.Dialect] | csv.Dialect:
    try:
        return csv.Sniffer().sniff(sample.partition("\n")[0], delimiters=",;\t")
    except csv.Error:
        return csv.excel


# A label column keeps the id of each distinct text while it has at most this many (enough for
# any class names); past it, only numbers are kept (a regression target).
MAX_LABEL_TEXTS = 65_536


class _LabelColumn:
    """A CSV's label cells, parsed into preallocated arrays as they are read: each as a number
    and, while there are at most ``MAX_LABEL_TEXTS`` distinct texts, as the id of its text (so
    class names need no list of every cell)."""

    def __init__(self, rows: int) -> None:
        self.numbers = np.empty(rows, dtype=np.float64)
        self.ids: np.ndarray | None = np.empty(rows, dtype=np.int32)
        self.texts: dict[str, int] | None = {}
        self.numeric = True

    def add(self, row: int, cell: str) -> bool:
        """Store ``cell`` at ``row``; False if it cannot be kept (text past the id limit)."""
        try:
            self.numbers[row] = float(cell)
        except ValueError:
            self.numeric = False
        if self.texts is not None and self.ids is not None:
            self.ids[row] = self.texts.setdefault(cell, len(self.texts))
            if len(self.texts) > MAX_LABEL_TEXTS and self.numeric:
                self.texts = self.ids = None  # a numeric target: its numbers are enough
        return self.numeric or self.texts is not None

    def array(self, rows: int) -> np.ndarray:
        """The column as int (all whole numbers), float (other numbers) or str (class names)."""
        if not self.numeric:
            assert self.texts is not None and self.ids is not None
            return np.array(list(self.texts), dtype=str)[self.ids[:rows]]
        numbers = self.numbers[:rows]
        if np.isfinite(numbers).all() and np.array_equal(numbers, np.round(numbers)):
            small = np.abs(numbers).max() < 2**31
            return numbers.astype(np.int32 if small else np.int64)
        return numbers.astype(np.float32)


def _count_lines(path: Path) -> int:
    """An upper bound on a text file's rows: its newlines + 1 (read in 1 MiB blocks)."""
    count = 1
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(2**20), b""):
            count += block.count(b"\n")
    return count


def _csv_columns(where: Where, reader: Any, label: str | None) -> tuple[list[str], int, list[int]]:
    """(header, label column, feature columns) from the header row, checked."""
    header = [column.strip() for column in next(reader, [])]
    if not any(header):
        raise where.error("the file is empty: expected a header row of column names.")
    duplicates = sorted({column for column in header if header.count(column) > 1})
    if duplicates:
        raise where.error(f"column names repeat in the header: {duplicates}.")
    if label is None:
        raise where.error(f"a CSV source needs its label column named (label=COLUMN, "
                          f"--label COLUMN). Columns: {header}.")
    if label not in header:
        raise where.error(f"label column {label!r} is not among the columns: {header}.")
    label_index = header.index(label)
    features = [i for i in range(len(header)) if i != label_index]
    if not features:
        raise where.error(f"no feature columns besides the label column {label!r}.")
    return header, label_index, features


def _bad_feature(where: Where, header: list[str], row: list[str], features: list[int],
                 line: int) -> DataError:
    """The one-line error for the first feature cell of ``row`` that is not a number."""
    for i in features:
        try:
            float(row[i])
        except ValueError:
            cell = row[i].strip()
            if not cell:
                return where.error(f"missing value in feature column {header[i]!r} at line "
                                   f"{line}: fill or drop it.")
            return where.error(f"non-numeric feature column {header[i]!r} (value {cell[:40]!r} "
                               f"at line {line}): features must be numbers; encode it or drop "
                               "the column.")
    return where.error(f"line {line} could not be read as numbers.")


@dataclass(frozen=True)
class CsvFile(Reader):
    """A ``.csv`` file: every column but ``label`` a numeric feature."""

    where: Where
    path: Path
    label: str | None
    max_bytes: int

    def read(self) -> Splits:
        x, y = _load_csv(self.where, self.path, self.label, self.max_bytes)
        return Splits(name=self.path.name, kind="csv", splits={"train": (x, y)}, owned=True)


def _load_csv(where: Where, path: Path, label: str | None, max_bytes: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """Features as float32 (N, F) and the label column, parsed straight into arrays sized from
    the file's line count (checked against ``max_bytes`` before they are made)."""
    with (reading(where, "not a readable CSV file", (OSError, UnicodeDecodeError, csv.Error)),
          open(path, newline="", encoding="utf-8-sig") as handle):
        dialect = _csv_dialect(handle.read(64 * 1024))
        handle.seek(0)
        reader = csv.reader(handle, dialect)
        header, label_index, features = _csv_columns(where, reader, label)
        lines = _count_lines(path)
        # float32 features, the label as a float64 number and an int32 text id
        _check_limit(where, lines * (4 * len(features) + 12), max_bytes, "its values")
        x = np.empty((lines, len(features)), dtype=np.float32)
        labels = _LabelColumn(lines)
        rows = 0
        for row in reader:
            if not any(cell.strip() for cell in row):
                continue  # a blank line
            line = reader.line_num
            if len(row) != len(header):
                raise where.error(f"line {line} has {len(row)} values but the header has "
                                  f"{len(header)} columns.")
            try:
                with np.errstate(over="ignore"):  # past float32: inf, refused as non-finite
                    x[rows] = [float(row[i]) for i in features]
            except ValueError:
                raise _bad_feature(where, header, row, features, line) from None
            cell = row[label_index].strip()
            if not cell:
                raise where.error(f"missing label in column {label!r} at line {line}.")
            if not labels.add(rows, cell):
                raise where.error(f"label column {label!r} mixes numbers and text (value "
                                  f"{cell[:40]!r} at line {line}) among more than "
                                  f"{MAX_LABEL_TEXTS:,} distinct values: use numbers or "
                                  "class names throughout.")
            rows += 1
    if not rows:
        raise where.error("the file has a header but no data rows.")
    return x[:rows], labels.array(rows)
