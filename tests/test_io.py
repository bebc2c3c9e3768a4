"""``kbackend.io``: atomic writes leave no temp file, stale ones are removed, JSON is strict."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from kbackend.history import History
from kbackend.io import (
    STALE_TEMP_AGE_S,
    _host_tag,
    atomic_write,
    atomic_write_json,
    read_json,
    remove_stale_temp_files,
    strict_json_payload,
    temp_folder,
)
from tests.conftest import ROOT


def strict_loads(text: str):
    """``json.loads`` that refuses NaN, Infinity and -Infinity, as strict parsers do."""
    def refuse(name: str):
        raise AssertionError(f"non-standard JSON constant {name} in the file")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize(("payload", "written", "record"), [
    ({"loss": [0.5, math.nan]}, {"loss": [0.5, None]}, {"/loss/1": "NaN"}),
    ({"a": math.inf, "b": -math.inf}, {"a": None, "b": None},
     {"/a": "Infinity", "/b": "-Infinity"}),
    ({"x": np.float32("nan"), "y": np.float32(0.5), "n": np.int64(3)},
     {"x": None, "y": 0.5, "n": 3}, {"/x": "NaN"}),
    ({"evals": [{"val_loss": np.float64("inf"), "step": 2}], "t": (1.0, math.nan)},
     {"evals": [{"val_loss": None, "step": 2}], "t": [1.0, None]},
     {"/evals/0/val_loss": "Infinity", "/t/1": "NaN"}),
    ({"a/b": {"c~d": math.nan}}, {"a/b": {"c~d": None}}, {"/a~1b/c~0d": "NaN"}),
    ({"arr": np.array([1.0, np.nan])}, {"arr": [1.0, None]}, {"/arr/1": "NaN"}),
    ({"fine": [1, 2.5, None, "NaN"]}, {"fine": [1, 2.5, None, "NaN"]}, None),
])
def test_json_files_are_strict_with_a_record_of_non_finite_numbers(tmp_path, payload, written,
                                                                   record):
    path = atomic_write_json(tmp_path / "out.json", payload)
    on_disk = strict_loads(path.read_text(encoding="utf-8"))
    expected = dict(written) if record is None else {**written, "non_finite": record}
    assert on_disk == expected
    restored = read_json(path)
    assert "non_finite" not in restored
    # NaN stays NaN here
    as_python = json.loads(json.dumps(payload, default=lambda value: value.tolist()))
    assert json.dumps(restored, sort_keys=True) == json.dumps(as_python, sort_keys=True), \
        "read_json puts the non-finite numbers back"


def test_history_with_a_diverged_loss_round_trips_through_strict_json(tmp_path):
    history = History()
    history.record_steps([1, 2], [0.7, math.nan], [0.1, 0.2])
    history.record_eval(step=2, val_loss=math.inf, val_accuracy=0.1)
    history.save(tmp_path / "history.json")
    strict_loads((tmp_path / "history.json").read_text())
    loaded = History.load(tmp_path / "history.json")
    assert (loaded.loss[0] == 0.7 and math.isnan(loaded.loss[1])
            and loaded.evals[0]["val_loss"] == math.inf)


def test_non_finite_numbers_need_an_object_and_the_record_key_is_reserved(tmp_path):
    with pytest.raises(ValueError, match="need a top-level object"):
        strict_json_payload([1.0, math.nan])
    with pytest.raises(ValueError, match="'non_finite' key"):
        strict_json_payload({"non_finite": [], "x": 1})
    assert strict_json_payload([1.0, 2.0]) == [1.0, 2.0]
    assert not list(tmp_path.iterdir())


def _temp_name(target: str, host: str, pid: int) -> str:
    return f".{target}.{host}-{pid}-abcd1234.tmp.json"


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_failed_write_leaves_no_temp_file(tmp_path):
    def fail(tmp):
        tmp.write_text("partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(tmp_path / "model.keras", fail)
    assert list(tmp_path.iterdir()) == []


def test_stale_temp_files_of_killed_writers_are_removed_at_the_next_write(tmp_path):
    dead = tmp_path / _temp_name("history.json", _host_tag(), _dead_pid())
    live = tmp_path / _temp_name("history.json", _host_tag(), os.getppid())  # a running process
    # another host: age decides
    foreign_fresh = tmp_path / _temp_name("history.json", "0badf00d", 12345)
    foreign_old = tmp_path / _temp_name("report.json", "0badf00d", 12345)
    old_style = tmp_path / ".summary.json.x1y2z3w4.tmp.json"  # no pid: age decides
    unrelated = [tmp_path / "notes.tmp", tmp_path / ".hidden.json", tmp_path / "data.json"]
    for path in (dead, live, foreign_fresh, foreign_old, old_style, *unrelated):
        path.write_text("partial")
    hour_ago = time.time() - STALE_TEMP_AGE_S - 60
    for path in (foreign_old, old_style, *unrelated):
        os.utime(path, (hour_ago, hour_ago))

    atomic_write_json(tmp_path / "history.json", {"loss": [1.0]})

    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["history.json", live.name, foreign_fresh.name,
                           *(p.name for p in unrelated)])


def test_remove_stale_temp_files_reports_what_it_removed_and_tolerates_a_missing_folder(tmp_path):
    dead = tmp_path / _temp_name("m.keras", _host_tag(), _dead_pid())
    dead.write_text("partial")
    assert remove_stale_temp_files(tmp_path) == [dead]
    assert remove_stale_temp_files(tmp_path / "missing") == []


def test_a_write_killed_mid_way_leaves_a_temp_file_the_next_run_removes(tmp_path):
    # The child dies inside write() (os._exit: no cleanup runs, as with SIGKILL): its temp file
    # stays; the next write into the folder sees that the temp's pid is dead and removes it at once.
    script = (
        "import os, sys\n"
        "from kbackend.io import atomic_write\n"
        "def write(tmp):\n"
        "    tmp.write_text('half')\n"
        "    os._exit(9)\n"
        "atomic_write(sys.argv[1], write)\n"
    )
    target = tmp_path / "summary.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    assert subprocess.run([sys.executable, "-c", script, str(target)], env=env).returncode == 9
    (stale,) = tmp_path.iterdir()
    assert stale.name.startswith(".summary.json.") and ".tmp" in stale.name and not target.exists()
    atomic_write_json(target, {"ok": True})
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


@pytest.mark.parametrize("check", ["output path", "output folder"])
def test_the_output_checks_at_a_commands_start_remove_stale_temp_files(tmp_path, check):
    """Temp files of a killed run go at the next start (the output checks every command runs
    before any work), not only at the next write into that folder, which may never come."""
    from kbackend.io import check_output_folder, check_output_path

    dead_pid = _dead_pid()
    dead = tmp_path / _temp_name("model.keras", _host_tag(), dead_pid)
    # a killed SavedModel export
    staging = tmp_path / f".export.{_host_tag()}-{dead_pid}-abcd1234.tmp"
    live = tmp_path / _temp_name("model.keras", _host_tag(), os.getppid())
    keep = tmp_path / "model.keras"
    for path in (dead, live, keep):
        path.write_text("partial")
    staging.mkdir()
    (staging / "artifact").mkdir()
    (staging / "artifact" / "saved_model.pb").write_bytes(b"half")
    if check == "output path":
        check_output_path(tmp_path / "model.keras", "--save")
    else:
        check_output_folder(tmp_path, "--out")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, keep.name])


def test_a_staging_folder_is_named_like_a_temp_file_and_left_alone_while_its_writer_runs(tmp_path):
    staging = temp_folder(tmp_path / "export")
    assert staging.parent == tmp_path and staging.is_dir()
    assert remove_stale_temp_files(tmp_path) == []  # this process is alive
    (staging / "artifact").mkdir()
    os.rename(staging, tmp_path / staging.name.replace(f"-{os.getpid()}-", f"-{_dead_pid()}-"))
    (removed,) = remove_stale_temp_files(tmp_path)
    assert removed.name.startswith(".export.") and list(tmp_path.iterdir()) == []


def test_a_checked_output_in_a_missing_folder_changes_nothing(tmp_path):
    from kbackend.io import check_output_path

    check_output_path(tmp_path / "new" / "deeper" / "model.keras", "--save")
    assert list(tmp_path.iterdir()) == []
