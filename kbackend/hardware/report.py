"""Benchmark output: JSON (figures + environment) and a markdown table a person can read."""

from __future__ import annotations

import math
from collections.abc import Sequence
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


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A GitHub markdown table of ``rows`` restricted to ``columns`` (missing cells: '-')."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(" --- " for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(format_value(row.get(c)) for c in columns) + " |")
    return "\n".join(lines) + "\n"


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


def write_report(out_dir: str | Path, name: str, payload: dict[str, Any], table: str) -> tuple[Path, Path]:
    """Write ``<name>.json`` and ``<name>.md`` (atomically) under ``out_dir``; returns both paths."""
    out = Path(out_dir)
    json_path = atomic_write_json(out / f"{name}.json", payload)
    md_path = atomic_write_text(out / f"{name}.md", f"# {name}\n\n{table}")
    return json_path, md_path
