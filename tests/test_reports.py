"""The one report writer: a JSON file and a markdown file, each written atomically, JSON first."""

from __future__ import annotations

import json

import pytest

from kbackend.reports import markdown_rows, markdown_table, write_json_and_markdown, write_report


def test_json_and_markdown_are_written_side_by_side(tmp_path):
    json_path, md_path = write_json_and_markdown(tmp_path / "out" / "summary.json", {"a": 1.5},
                                                 tmp_path / "out" / "report.md", "# title\n")
    assert json.loads(json_path.read_text()) == {"a": 1.5} and md_path.read_text() == "# title\n"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["report.md", "summary.json"]


def test_a_payload_that_cannot_be_written_leaves_no_files(tmp_path):
    with pytest.raises(TypeError):
        write_json_and_markdown(tmp_path / "r.json", {"a": object()}, tmp_path / "r.md", "text")
    assert list(tmp_path.iterdir()) == []  # no partial JSON, and no markdown without its figures


def test_named_report_and_tables(tmp_path):
    table = markdown_table([{"case": "a", "ms": 1.23456, "ok": True}, {"case": "b"}],
                           ["case", "ms", "ok"])
    assert table == "| case | ms | ok |\n| --- | --- | --- |\n| a | 1.235 | yes |\n| b | - | - |\n"
    assert markdown_rows(["x", "y"], [["1", "2"]]) == "| x | y |\n| --- | --- |\n| 1 | 2 |\n"
    json_path, md_path = write_report(tmp_path, "bench_x", {"rows": []}, table)
    assert (json_path.name, md_path.name) == ("bench_x.json", "bench_x.md")
    assert md_path.read_text() == f"# bench_x\n\n{table}"


def test_plotted_trajectories_are_thinned_to_a_bounded_number_of_points_keeping_the_ends():
    import numpy as np

    from kbackend.study.plots import PLOT_POINTS, _thin

    steps = np.arange(1, 10_001)
    thinned_steps, thinned_twice = _thin(steps, steps * 2)
    assert len(thinned_steps) <= PLOT_POINTS + 1
    assert thinned_steps[0] == 1 and thinned_steps[-1] == 10_000
    np.testing.assert_array_equal(thinned_twice, thinned_steps * 2)  # columns stay aligned
    short = np.arange(5)
    assert _thin(short)[0] is short  # short lines are drawn whole


def test_a_time_plot_with_no_cell_reached_draws_without_a_legend_warning(tmp_path):
    import warnings

    from kbackend.study.plots import _plot_time
    from kbackend.study.study_record import Cell, StudyRecord

    study = StudyRecord(cells=[Cell("sgd", 32, reached=False)], config={"optimizers": ["sgd"]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels found"
        path = _plot_time(study, tmp_path / "time_to_target.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
