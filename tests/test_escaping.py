"""User text made inert where kbackend shows it (issue 45): markdown reports, the rich console
and matplotlib titles, with hostile strings, at the helpers and at the report boundary."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from kbackend.escaping import console_text, markdown_text, one_line, plot_text
from kbackend.study.study_record import StudyRecord

HOSTILE = [
    "<script>alert(1)</script>",
    "gpu\n## Injected heading\n<img src=x onerror=alert(1)>",
    "a | b | c",
    "[click](javascript:alert(1)) ![img](x.png) **bold** `code` _em_ ~~del~~",
    "[bold red]red[/bold red] [link=file:///etc/passwd]x[/link]",
    "cost $\\frac{1}{0}$ and $x^{",
    "tab\there\rcarriage\x1b[31mansi\x00nul\u2028sep",
    "back\\slash & amp",
]


@pytest.mark.parametrize("text", HOSTILE)
def test_one_line_leaves_no_line_break_or_control_character(text):
    flat = one_line(text)
    assert not any(ord(c) < 32 or 0x7f <= ord(c) <= 0x9f or c in "\u2028\u2029" for c in flat)


@pytest.mark.parametrize("text", HOSTILE)
def test_markdown_text_renders_as_the_literal_text(text):
    escaped = markdown_text(text)
    assert "\n" not in escaped and "<" not in escaped and ">" not in escaped
    # every markdown punctuation character is escaped (preceded by an odd run of backslashes)
    for index, char in enumerate(escaped):
        if char in "`*[]|#":
            run = len(escaped[:index]) - len(escaped[:index].rstrip("\\"))
            assert run % 2 == 1, (escaped, index)


def test_markdown_text_in_a_table_keeps_the_columns():
    from kbackend.reports import markdown_rows

    table = markdown_rows(["device", "x"], [[markdown_text("a | b\nc"), "1"]])
    row = table.splitlines()[2]
    assert row.count("|") - row.count("\\|") == 3  # the row's own three separators


@pytest.mark.parametrize("text", HOSTILE)
def test_console_text_prints_literally(text):
    buffer = io.StringIO()
    Console(file=buffer, width=500, color_system=None).print(console_text(text), highlight=False)
    shown = buffer.getvalue().rstrip("\n")
    assert shown == one_line(text).rstrip()  # rich kept every bracket: no markup applied


@pytest.mark.parametrize("text", HOSTILE)
def test_plot_text_is_never_mathtext(text, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axis = plt.subplots()
    axis.set_title(plot_text(text))
    axis.set_ylabel(plot_text(text))
    figure.savefig(tmp_path / "plot.png")  # a malformed mathtext would raise here
    plt.close(figure)
    assert "$" not in plot_text(text).replace("\\$", "")


def test_a_hostile_device_profile_stays_text_in_the_report_and_on_the_console(tmp_path):
    from kbackend.study.device_profile import conclusion_lines, load_profile, report_section
    from kbackend.study.report_sections import conclusions  # noqa: F401 - imports the chain

    device = "GPU <b>bold</b>\n## Injected\n[red]x[/red] $\\frac{1$"
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"device": device, "step_time_s": {"32": 0.001, "64": 0.002}}))
    profile = load_profile(str(path))
    cell = {"optimizer": "sgd", "batch_size": 32, "steps_to_target": 100.0, "reached": True,
            "seconds_per_step_here": 0.001, "time_to_target_here": 0.1, "seconds_per_step": 0.001,
            "time_to_target": 0.1, "interval": {"median": 0.1, "low": 0.1, "high": 0.1}}
    study = StudyRecord.from_json({
        "cells": [{"optimizer": "sgd", "batch_size": 32, "reached": True, "time_to_target": 0.1}],
        "device_profile": {"profile": profile.to_dict(), "cells": [cell], "auto_cells": [],
                           "fastest": {"text": "sgd at batch 32 is fastest"}, "adaptive": []}})
    report = "\n".join(report_section(study))
    assert "<b>" not in report and "\n## Injected" not in report
    assert [line for line in report.splitlines() if line.startswith("#")] == [
        line for line in report.splitlines() if line.startswith("## Predicted on GPU")]
    buffer = io.StringIO()
    console = Console(file=buffer, width=1000, color_system=None)
    for line in conclusion_lines(study):
        console.print(console_text(line), highlight=False)
    assert "[red]x[/red]" in buffer.getvalue()


def test_the_study_tables_note_keeps_its_brackets_on_the_console(monkeypatch):
    from kbackend.study import report

    buffer = io.StringIO()
    console = Console(file=buffer, width=100, color_system=None)
    study = StudyRecord.from_json(
        {"config": {"model": "m[red]", "target": {"metric": "val_accuracy", "value": 0.9}},
         "dataset": {"name": "d"}, "env": {"backend": "jax"}})
    monkeypatch.setattr(report, "console_rows", lambda s: (list(report.CONSOLE_COLUMNS), [], []))
    monkeypatch.setattr(report, "conclusions",
                        lambda s, a, **kwargs: ["B_crit [lo, hi] from [link=x]"])
    report.print_table(study, {}, console=console)
    shown = buffer.getvalue()
    assert "m[red]" in shown and "B_crit [lo, hi] from [link=x]" in shown
