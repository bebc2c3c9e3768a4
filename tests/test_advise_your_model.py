"""``kbackend advise`` on the user's model and data (issue 34): a builder or a ``.keras`` file
with ``--data``, measured with the loss the model is compiled with, and the commands it prints
naming them; bad model sources refused in one line before any probe."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kbackend.advise.engine_probe import engine_throughput
from kbackend.commands import advise as advise_command
from kbackend.hardware import probe
from kbackend.training import TrainConfig, workload_of
from tests.conftest import one_line_error

BUILDERS = '''
import keras


def classifier(input_shape, num_classes):
    model = keras.Sequential([keras.Input(input_shape), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(num_classes)])
    model.compile("adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def regressor(input_shape):
    model = keras.Sequential([keras.Input(input_shape), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile("adam", loss=keras.losses.Huber(delta=0.5), metrics=["mae"])
    return model
'''


@pytest.fixture
def user_files(tmp_path):
    (tmp_path / "models.py").write_text(BUILDERS)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 6)).astype(np.float32)
    np.savez(tmp_path / "classes.npz", x=x, y=(np.arange(96) % 3).astype(np.int32))
    np.savez(tmp_path / "values.npz", x=x, y=x.sum(axis=1).astype(np.float32))
    return tmp_path


@pytest.mark.slow
def test_advise_on_a_builder_and_an_npz_prints_its_recommendation(cli, user_files):
    """The smallest probe the command allows (--quick, a one-second budget): it measures the
    builder's model on the archive's data with the model's compiled loss, and its commands
    train and study that model on that data."""
    model, data = f"{user_files / 'models.py'}:classifier", str(user_files / "classes.npz")
    result = cli("advise", "--model", model, "--data", data, "--quick", "--budget", "1",
                 "--json", user_files / "advice.json")
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert f"Recommended settings for {model} on {data}" in out
    assert "loss sparse_categorical_crossentropy (from_logits), metric accuracy" in out
    for setting in ("batch_size", "fused_steps", "precision", "device"):
        assert setting in out
    assert f"Train with:  kbackend train --model {model} --data {data} --batch-size" in out
    assert f"kbackend study --model {model} --data {data} --batch-sizes" in out
    assert "data format (a built-in model's option" in out  # not compared for yours
    advice = json.loads((user_files / "advice.json").read_text())
    assert advice["task"].startswith("loss sparse_categorical_crossentropy (from_logits)")
    measured = [row["batch_size"] for row in advice["measurements"]["batch_size"]]
    batch = next(r["value"] for r in advice["recommendations"] if r["setting"] == "batch_size")
    assert batch in measured


def test_the_probes_train_the_compiled_loss(user_files):
    """Keras fit's probe compiles the user's loss (Huber with its delta), and the native engine's
    measurement trains the same task on the float targets."""
    config = TrainConfig(model=f"{user_files / 'models.py'}:regressor",
                         dataset=str(user_files / "values.npz"))
    work = probe.user_workload(workload_of(config))
    assert work.task.loss_name == "huber" or "Huber" in work.task.loss
    fit = probe.FitProbe(work, 16, steps=2)
    assert fit.model.loss is work.task.loss_object() is work.task.loss_instance  # delta kept
    assert fit.result()["samples_per_s"] > 0
    native = engine_throughput(work, 16, "native", steps=2, repeats=1)
    assert native["samples_per_s"] > 0


@pytest.mark.parametrize(("model", "message"), [
    ("missing.keras", "not found: expected a .keras file"),
    ("nope", "Unknown model"),
    ("models.py:absent", "absent"),
])
def test_a_bad_model_is_refused_in_one_line_before_any_probe(cli, user_files, monkeypatch,
                                                             model, message):
    def no_probe(*args, **kwargs):
        raise AssertionError("the probe started although the model source was bad")

    monkeypatch.setattr(advise_command, "advise", no_probe)
    monkeypatch.chdir(user_files)
    result = cli("advise", "--model", model, "--data", "classes.npz", "--quick")
    assert result.returncode == 2, result.stderr
    assert one_line_error(result.stderr) and message in result.stderr, result.stderr


def test_the_follow_up_study_targets_the_models_own_metric(user_files):
    """A regression's follow-up study names its metric (val_mae) and a target of half the
    validation error of predicting the training mean; a classifier on the user's data (which has
    no default target: the study's one rule) names val_accuracy half way from predicting the
    most common training class to 1; a built-in dataset keeps its own default."""
    from kbackend.advise.advisor import BASELINE_FRACTION, study_target_flags

    work = workload_of(TrainConfig(model=f"{user_files / 'models.py'}:regressor",
                                   dataset=str(user_files / "values.npz")))
    data = work.dataset
    baseline = np.mean(np.abs(data.y_val.reshape(-1) - data.y_train.mean()))
    flags = study_target_flags(work.task, data).split()
    assert flags[:2] == ["--target-metric", "val_mae"] and flags[2] == "--target"
    assert float(flags[3]) == pytest.approx(BASELINE_FRACTION * baseline, rel=1e-2)
    classes = workload_of(TrainConfig(model=f"{user_files / 'models.py'}:classifier",
                                      dataset=str(user_files / "classes.npz")))
    data = classes.dataset
    majority = np.mean(data.y_val == np.bincount(data.y_train).argmax())
    flags = study_target_flags(classes.task, data).split()
    assert flags[:3] == ["--target-metric", "val_accuracy", "--target"]
    assert float(flags[3]) == pytest.approx(majority + BASELINE_FRACTION * (1 - majority),
                                            abs=5e-3)
    builtin = workload_of(TrainConfig(model="seed_mlp", dataset="digits"))
    assert study_target_flags(builtin.task, builtin.dataset) == ""


@pytest.mark.slow
def test_advise_prints_a_study_command_that_runs_for_a_regression(cli, user_files, tmp_path):
    import shlex

    import numpy as np

    # four times the fixture's rows (a study refuses a validation split under 10 samples)
    with np.load(user_files / "values.npz") as saved:
        arrays = {key: np.concatenate([saved[key]] * 4) for key in saved.files}
    np.savez(tmp_path / "values.npz", **arrays)
    model, data = f"{user_files / 'models.py'}:regressor", str(tmp_path / "values.npz")
    result = cli("advise", "--model", model, "--data", data, "--quick", "--budget", "1")
    assert result.returncode == 0, result.stderr[-2000:]
    command = next(line.strip() for line in result.stdout.splitlines()
                   if line.strip().startswith("kbackend study"))
    assert "--target-metric val_mae --target " in command
    study = cli(*shlex.split(command)[1:], "--optimizers", "adam", "--lr-grid-size", "1",
                "--seeds", "1", "--max-seeds", "1", "--max-steps", "40", "--noise-points", "0",
                "--step-time-repeats", "0", "--frontier-epochs", "0", "--no-progress",
                "--out", str(tmp_path / "study"))
    assert study.returncode == 0, study.stderr[-2000:]
