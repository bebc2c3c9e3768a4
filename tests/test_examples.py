"""The examples/ folder end to end (docs/your-model.md): its data script, its builders, and
`kbackend study` / `kbackend train` on them with a tiny grid, as a user would run them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def example_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("example-data")
    subprocess.run([sys.executable, str(EXAMPLES / "make_data.py"), str(out)], check=True,
                   capture_output=True)
    return out


@pytest.mark.slow
def test_a_study_of_the_regression_example_recommends_a_cell(example_data, tmp_path, cli):
    result = cli("study", "--model", f"{EXAMPLES / 'models.py'}:regressor", "--data",
                 str(example_data / "diabetes.csv"), "--label", "target", "--target-metric",
                 "val_mae", "--target", "0.7", "--optimizers", "sgd,adam", "--batch-sizes",
                 "16,64", "--seeds", "2", "--lr-grid-size", "1", "--max-steps", "400",
                 "--noise-points", "0", "--step-time-repeats", "0", "--out", str(tmp_path),
                 "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "Recommended:" in result.stdout and "--target-metric val_mae" in result.stdout
    summary = json.loads(next(tmp_path.glob("*/summary.json")).read_text())
    assert summary["config"]["target"]["metric"] == "val_mae"
    assert any(cell["reached"] for cell in summary["cells"])
    assert next(tmp_path.glob("diabetes.csv-*_models.py-regressor-*_*"))


@pytest.mark.slow
def test_the_binary_example_trains_to_its_target(example_data, cli):
    result = cli("train", "--model", f"{EXAMPLES / 'models.py'}:binary_classifier", "--data",
                 str(example_data / "breast_cancer.npz"), "--target", "0.93", "--epochs", "30",
                 "--lr", "0.01")
    assert result.returncode == 0, result.stderr
    assert "binary_crossentropy (from_logits)" in result.stdout
    assert "target val_accuracy >= 0.93: reached" in result.stdout


def test_the_conv1d_batchnorm_example_trains(example_data, cli):
    result = cli("train", "--model", f"{EXAMPLES / 'models.py'}:conv1d_classifier", "--data",
                 str(example_data / "sequences.npz"), "--max-steps", "40", "--batch-size", "64",
                 "--fused-steps", "1", "--lr", "0.01")
    assert result.returncode == 0, result.stderr
    assert "conv1d_classifier on sequences.npz" in result.stdout


@pytest.mark.slow
def test_the_two_head_example_trains_to_a_target_on_one_output(example_data, cli):
    result = cli("train", "--model", f"{EXAMPLES / 'models.py'}:two_heads", "--data",
                 str(example_data / "diabetes_heads.npz"), "--target-metric",
                 "val_risk_accuracy", "--target", "0.5", "--epochs", "40", "--lr", "0.01")
    assert result.returncode == 0, result.stderr
    assert "progression: mse x 0.5" in result.stdout
    assert "target val_risk_accuracy >= 0.5: reached" in result.stdout


@pytest.mark.slow  # a study and a training run in a fresh process: ~60-100 s here
def test_the_tensorboard_example_logs_a_study_and_a_training_run(tmp_path):
    """examples/tensorboard_study.py --quick: the study's run folders with the HParams
    experiment, runs.csv, and the best cell trained with its scalars logged."""
    pytest.importorskip("tensorboard")
    result = subprocess.run([sys.executable, str(EXAMPLES / "tensorboard_study.py"),
                             str(tmp_path), "--quick"], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "best: " in result.stdout and "val_accuracy per evaluation: [" in result.stdout
    board = tmp_path / "tensorboard"
    assert len(list(board.glob("*-seed*/events.out.tfevents.*"))) == 8  # 2 x 2 cells x 2 seeds
    assert list(board.glob("events.out.tfevents.*"))  # the HParams experiment
    assert list((board / "best-train").glob("events.out.tfevents.*"))
    assert next(tmp_path.glob("study/*/runs.csv")).read_text().count("\n") >= 5


@pytest.mark.slow  # a training run, its model saved and loaded for predict: ~15 s
def test_the_text_example_trains_from_its_folder_and_predicts_raw_strings(example_data,
                                                                         tmp_path, cli):
    """keras.io's text classifier (TextVectorization first) on the reviews/ folder: its own
    layer adapted and run on the host, the saved model predicting from raw strings."""
    saved = tmp_path / "reviews.keras"
    result = cli("train", "--model", f"{EXAMPLES / 'models.py'}:text_classifier", "--data",
                 str(example_data / "reviews"), "--epochs", "10", "--lr", "0.01",
                 "--fused-steps", "1", "--target", "0.85", "--save", str(saved))
    assert result.returncode == 0, result.stderr
    assert "string preprocessing (TextVectorization) run on the host" in result.stdout
    assert "kbackend's TextVectorization" not in result.stdout
    assert "target val_accuracy >= 0.85: reached" in result.stdout
    texts = tmp_path / "texts.npy"
    np.save(texts, np.array(["a lovely, clever and moving film", "dull, boring and awful"]))
    out = tmp_path / "predictions.npy"
    result = cli("predict", "--model", str(saved), "--input", str(texts), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert list(np.load(out)[:, 0] > 0.5) == [True, False]


@pytest.mark.slow  # a study of the text example: ~30-40 s
def test_a_study_of_the_text_example_recommends_a_cell(example_data, tmp_path, cli):
    result = cli("study", "--model", f"{EXAMPLES / 'models.py'}:text_classifier", "--data",
                 str(example_data / "reviews"), "--target", "0.85", "--optimizers", "sgd,adam",
                 "--batch-sizes", "16,64", "--seeds", "1", "--lr-grid-size", "1",
                 "--max-steps", "300", "--noise-points", "0", "--step-time-repeats", "0",
                 "--out", str(tmp_path), "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "Recommended:" in result.stdout and "adam" in result.stdout
