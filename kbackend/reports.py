"""Reports: a JSON file for programs beside a markdown file for people, both written atomically.

kbackend's one report writer (``write_json_and_markdown``) and its table formatting: benchmarks
write ``<name>.json`` + ``<name>.md`` through ``write_report``; a study writes ``summary.json`` +
``report.md`` through ``write_json_and_markdown`` directly.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kbackend.io import atomic_write_json, atomic_write_text


def format_value(value: Any) -> str:
    """A compact table cell: 4 significant digits for floats, '-' for missing values."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3e}"
        return f"{value:.4g}"
    return str(value)


def markdown_rows(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A GitHub markdown table of already formatted cells, one sequence per row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A GitHub markdown table of ``rows`` restricted to ``columns`` (missing cells: '-')."""
    return markdown_rows(columns, ([format_value(row.get(c)) for c in columns] for row in rows))


def side_by_side(rows: Sequence[dict[str, Any]], keys: Sequence[str], values: Sequence[str],
                 backends: Sequence[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """Pivot per-backend rows into one row per case with ``<value> (<backend>)`` columns.

    Rows that carry a ``note`` (e.g. 'unsupported') show the note in place of their values.
    """
    merged: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        key = tuple(row.get(k) for k in keys)
        target = merged.setdefault(key, dict(zip(keys, key, strict=True)))
        for position, value in enumerate(values):
            cell = row.get(value)
            if row.get("note") and cell is None and position == 0:
                cell = row["note"]
            target[f"{value} ({row['backend']})"] = cell
    columns = list(keys) + [f"{v} ({b})" for v in values for b in backends]
    return list(merged.values()), columns


def write_json_and_markdown(json_path: str | os.PathLike, payload: Any,
                            markdown_path: str | os.PathLike, markdown: str) -> tuple[Path, Path]:
    """Write ``payload`` as JSON, then ``markdown``, each atomically; returns both paths.

    The JSON goes first, so a reader that finds the new markdown also finds its figures.
    """
    return atomic_write_json(json_path, payload), atomic_write_text(markdown_path, markdown)


def write_report(out_dir: str | os.PathLike, name: str, payload: dict[str, Any],
                 table: str) -> tuple[Path, Path]:
    """``<name>.json`` and ``<name>.md`` (headed ``# <name>``) under ``out_dir``; both paths."""
    out = Path(out_dir)
    return write_json_and_markdown(out / f"{name}.json", payload, out / f"{name}.md",
                                   f"# {name}\n\n{table}")
