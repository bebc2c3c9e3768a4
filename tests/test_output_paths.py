"""Nothing finished is destroyed (issue 36, items 4-5): an output path that is also an input or
another output of the same command, or lacks its format's suffix, is refused in one line before
any work, and the file that was there is unchanged; --data-dir is refused where nothing is read."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from kbackend.backend_choice import keras as import_keras
from tests.conftest import BACKEND, one_line_error


@pytest.fixture
def files(tmp_path):
    keras = import_keras()
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
    model.save(tmp_path / "model.keras")
    np.save(tmp_path / "x.npy", np.zeros((2, 64), np.float32))
    np.savez(tmp_path / "data.npz", x=np.zeros((20, 4), np.float32), y=np.arange(20) % 2)
    return tmp_path


CASES = {
    "save-is-history": (["train", "--save", "{d}/out.keras", "--history", "{d}/out.keras"],
                        "also --save"),
    "save-is-model": (["train", "--model", "{d}/model.keras", "--save", "{d}/model.keras"],
                      "also --model"),
    "history-is-data": (["train", "--data", "{d}/data.npz", "--history", "{d}/data.npz"],
                        "also --data"),
    "history-suffix": (["train", "--history", "{d}/history.txt"], "ending in .json"),
    "predict-out-is-model": (["predict", "--model", "{d}/model.keras", "--input", "{d}/x.npy",
                              "--out", "{d}/model.keras"], "also --model"),
    "predict-out-suffix": (["predict", "--model", "{d}/model.keras", "--input", "{d}/x.npy",
                            "--out", "{d}/y.txt"], "ending in .npy"),
    "cache-is-model": (["cache", "warm", "--model", "{d}/model.keras", "--cache",
                        "{d}/model.keras", "--grid", "*=0"], "also --model"),
    "export-out-is-model": (["export", "{d}/model.keras", "--out", "{d}/model.keras"],
                            "also --model"),
    "equiv-json-is-inputs": (["equiv", "{d}/model.keras", "--inputs", "{d}/x.npy", "--json",
                              "{d}/x.npy"], "also --inputs"),
    "equiv-json-suffix": (["equiv", "{d}/model.keras", "--json", "{d}/report.txt"],
                          "ending in .json"),
    "data-dir-for-generated": (["train", "--dataset", "mnist1d", "--data-dir", "{d}"],
                               "--data-dir does not apply to 'mnist1d'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_output_that_would_destroy_a_file_is_refused(case, files, cli, engines_never_run):
    args, message = CASES[case]
    before = {p.name: p.read_bytes() for p in files.iterdir()}
    result = cli(*(a.format(d=files) for a in args))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and one_line_error(result.stderr)
    assert {p.name: p.read_bytes() for p in files.iterdir()} == before


@pytest.mark.slow
def test_a_full_disk_at_save_is_one_line_and_keeps_the_history(tmp_path, monkeypatch):
    """ENOSPC while the model is written: an ``OutputError`` naming the path and the free space;
    the history (written first) is there, and no partial model or temp file is left."""
    import errno

    from kbackend.errors import OutputError
    from kbackend.training import TrainConfig, train

    keras = import_keras()

    def full_disk(self, path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(keras.Model, "save", full_disk)
    with pytest.raises(OutputError, match=r"No space left on device .* free there") as raised:
        train(TrainConfig(engine="keras", epochs=1, max_steps=2), save=tmp_path / "m.keras",
              history_path=tmp_path / "h.json")
    assert "\n" not in str(raised.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h.json"]


@pytest.mark.slow
def test_a_console_that_cannot_encode_a_path_does_not_crash_a_finished_command(tmp_path,
                                                                                cli_process):
    """PYTHONIOENCODING=ascii and an output path with a non-ASCII name (issue 36 item 12): the
    command finishes with status 0, the path shown escaped, the file written."""
    folder = tmp_path / "résultats"
    result = cli_process("train", "--epochs", "1", "--max-steps", "2", "--fused-steps", "1",
                         "--history", str(folder / "h.json"),
                         env={"PYTHONIOENCODING": "ascii"})
    assert result.returncode == 0, result.stderr
    assert "r\\xe9sultats" in result.stdout
    assert (folder / "h.json").exists()


def _study_out(kind: str, out):
    out.mkdir()
    if kind == "report-folder-is-a-file":
        (out / f"digits_seed_mlp_{BACKEND}_native").write_text("kept")
    elif kind == "store-is-garbage":
        (out / "study.db").write_text("kept")
    elif kind == "store-is-a-folder":
        (out / "study.db").mkdir()
    elif kind == "store-of-another-application":
        with sqlite3.connect(out / "study.db") as db:
            db.execute("create table kept(a)")
    elif kind == "out-is-a-file":
        out.rmdir()
        out.write_text("kept")


STUDY_CASES = {
    "report-folder-is-a-file": "is a file, not a folder",
    "store-is-garbage": "is not an SQLite database",
    "store-is-a-folder": "is not a file",
    "store-of-another-application": "of another application",
    "out-is-a-file": "is a file, not a folder",
}


@pytest.mark.parametrize("kind", list(STUDY_CASES))
def test_a_study_output_the_filesystem_or_store_refuses_is_one_line(kind, tmp_path, cli,
                                                                     engines_never_run):
    out = tmp_path / "out"
    _study_out(kind, out)
    before = sorted((p.relative_to(tmp_path), p.is_dir() or p.read_bytes())
                    for p in tmp_path.rglob("*"))
    result = cli("study", "--dataset", "digits", "--model", "seed_mlp", "--engine", "native",
                 "--optimizers", "sgd", "--batch-sizes", "64", "--seeds", "1",
                 "--noise-points", "0", "--out", str(out))
    assert result.returncode == 2, result.stderr
    assert STUDY_CASES[kind] in result.stderr and one_line_error(result.stderr)
    assert sorted((p.relative_to(tmp_path), p.is_dir() or p.read_bytes())
                  for p in tmp_path.rglob("*")) == before


def test_float64_inputs_beyond_float32_say_so():
    """Issue 36 item 12: a value float32 cannot hold is a one-line error, not a silent inf."""
    from kbackend.data import from_arrays
    from kbackend.errors import DataError

    x = np.ones((20, 3))
    x[4, 1] = 1e300
    with pytest.raises(DataError, match="beyond float32's range in the train split"):
        from_arrays("big", x, np.arange(20) % 2, np.ones((4, 3)), np.arange(4) % 2,
                    num_classes=2)
