"""Every check that can fail runs before any training (kbackend.config), in-process.

Each case must fail fast: no engine runs (a spy on every registered engine proves it) and no
output file appears.
"""

from __future__ import annotations

import os
import re
import stat

import pytest

from kbackend import cli
from kbackend.config import Target, TrainConfig
from kbackend.errors import ConfigError
from kbackend.models import ModelOptions


def run_main(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    return code, capsys.readouterr().err.strip()


def bad_paths(tmp_path):
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(stat.S_IRUSR | stat.S_IXUSR)
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    folder = tmp_path / "x.keras"
    folder.mkdir()
    return {"read-only folder": read_only / "m.keras", "under a file": a_file / "m.keras",
            "a folder": folder}


@pytest.mark.parametrize("case", ["read-only folder", "under a file", "a folder"])
@pytest.mark.parametrize("flag", ["--save", "--history"])
def test_bad_output_path_is_refused_before_training(case, flag, tmp_path, capsys,
                                                    engines_never_run):
    if case == "read-only folder" and os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    path = bad_paths(tmp_path)[case]
    if flag == "--history" and case != "a folder":
        path = path.with_suffix(".json")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    code, err = run_main(capsys, "train", "--epochs", "1", "--quiet", flag, str(path))
    assert code == 2
    assert len(err.splitlines()) == 1 and f"Invalid {flag} path" in err, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
@pytest.mark.parametrize("argv", [
    ["train", "--epochs", "1", "--quiet", "--save", "/proc/kbackend-x.keras"],
    ["train", "--epochs", "1", "--quiet", "--history", "/proc/kbackend-x.json"],
])
def test_a_folder_that_refuses_new_files_is_found_before_training(argv, capsys, engines_never_run):
    """/proc takes no new files even from root, whose permission bits say yes: the check tries."""
    code, err = run_main(capsys, *argv)
    assert code == 2 and len(err.splitlines()) == 1 and "'/proc' is not writable" in err, err


def test_fused_steps_with_an_engine_that_cannot_fuse_is_refused(capsys, engines_never_run):
    code, err = run_main(capsys, "train", "--engine", "keras", "--fused-steps", "8", "--quiet")
    assert code == 2 and "Invalid --fused-steps 8" in err and "--engine native" in err, err
    code, err = run_main(capsys, "train", "--engine", "keras", "--fused-steps", "auto", "--quiet")
    assert code == 2 and "Invalid --fused-steps auto" in err, err


def test_fused_steps_longer_than_an_epoch_is_refused(capsys, engines_never_run):
    code, err = run_main(capsys, "train", "--engine", "native", "--fused-steps", "100000",
                         "--batch-size", "32", "--quiet")
    assert code == 2 and "Invalid fused_steps 100000" in err, err


def test_batch_size_larger_than_the_data_is_refused(capsys, engines_never_run):
    code, err = run_main(capsys, "train", "--batch-size", "100000", "--quiet")
    assert code == 2 and "larger than the training split" in err, err


def test_a_valid_run_reaches_the_engine(capsys, engines_never_run):
    """Positive control: with nothing wrong, the spy engine is called (the checks pass)."""
    with pytest.raises(AssertionError, match="training started"):
        cli.main(["train", "--epochs", "1", "--quiet"])


@pytest.mark.parametrize("argv", [
    ["study", "--out", "{file}/sub"],
    ["export", "{missing}.keras", "--out", "{file}"],
    ["predict", "--model", "{missing}.keras", "--input", "{missing}.npy", "--out", "{file}/y.npy"],
    ["predict", "--model", "{missing}.keras", "--input", "{missing}.npy", "--out", "{folder}"],
])
def test_bad_out_is_refused_before_any_work(argv, tmp_path, capsys):
    """--out under a file, or a file path that is a folder: one line, exit 2, nothing written."""
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    folder = tmp_path / "folder"
    folder.mkdir()
    argv = [a.format(file=a_file, folder=folder, missing=tmp_path / "missing") for a in argv]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    code, err = run_main(capsys, *argv)
    assert code == 2 and len(err.splitlines()) == 1 and "Invalid --out" in err, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("seed", [-1, 2**32, -9223372036854775808])
def test_a_seed_outside_numpys_range_is_a_one_line_error(cli, seed):
    result = cli("train", "--seed", str(seed), "--epochs", "1")
    assert result.returncode == 2 and "Invalid seed" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(("build", "message"), [
    (lambda: TrainConfig(optimizer="adam"), "TrainConfig.optimizer: expected OptimizerSpec"),
    (lambda: TrainConfig(model_options={}), "TrainConfig.model_options: expected ModelOptions"),
    (lambda: TrainConfig(target=0.5), "TrainConfig.target: expected Target or None"),
    (lambda: TrainConfig(early_stopping="a"), "TrainConfig.early_stopping: expected an integer"),
    (lambda: TrainConfig(early_stopping=None), "TrainConfig.early_stopping: expected an integer"),
    (lambda: TrainConfig(data_dir=3),
     "TrainConfig.data_dir: expected a string or PathLike or None"),
    (lambda: TrainConfig(batch_size=True), "TrainConfig.batch_size: expected an integer"),
    (lambda: TrainConfig(shuffle="no"), "TrainConfig.shuffle: expected True or False"),
    (lambda: ModelOptions(widths="8"), "ModelOptions.widths: expected a tuple of integers"),
    (lambda: ModelOptions(widths=(8.5,)), "ModelOptions.widths: expected a tuple of integers"),
    (lambda: ModelOptions(batch_norm="yes"), "ModelOptions.batch_norm: expected True or False"),
    (lambda: Target("val_loss", float("inf")),
     "Invalid target value inf: expected a finite number"),
], ids=["optimizer-str", "options-dict", "target-float", "patience-str", "patience-none",
        "data-dir-int", "batch-bool", "shuffle-str", "widths-str", "widths-float", "bn-str",
        "target-inf"])
def test_python_api_arguments_of_the_wrong_type_are_refused_where_given(build, message):
    """A wrong type from Python fails at construction with kbackend's one-line error, not as an
    AttributeError or TypeError deep inside train() (some only after training)."""
    with pytest.raises(ConfigError, match=re.escape(message)) as raised:
        build()
    assert "\n" not in str(raised.value)


def test_widths_with_an_empty_item_are_refused(capsys, engines_never_run):
    with pytest.raises(SystemExit) as raised:
        cli.main(["train", "--widths", "8,,8", "--quiet"])
    assert raised.value.code == 2
    assert "expected comma-separated integers, got '8,,8'" in capsys.readouterr().err
