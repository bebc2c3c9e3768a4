"""Keras habits (issue 46): TensorBoard event files, runs.csv, results shaped like Keras's and a
study console that fits 80 columns.

Event files are read back with TensorBoard's own readers (``EventAccumulator``, the HParams
plugin's metadata), ``runs.csv`` with ``pandas.read_csv``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math

import numpy as np
import pytest

import kbackend
from kbackend.backend_choice import keras as import_keras
from kbackend.errors import ConfigError
from tests.conftest import JIT_FOR_SMALL_RUNS, NO_JIT_FLAGS

pandas = pytest.importorskip("pandas")
pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing import event_accumulator  # noqa: E402
from tensorboard.plugins.hparams import metadata as hparams_metadata  # noqa: E402

keras = import_keras()
RNG = np.random.default_rng(0)
X = RNG.normal(size=(400, 8)).astype(np.float32)
W = RNG.normal(size=(8, 3))
CLASSES = np.argmax(X @ W, axis=1)
VALUES = (X @ W[:, 0]).astype(np.float32)


def _classifier():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(3)])
    model.compile("adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def _regressor():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)], name="reg")
    model.compile("adam", loss="mse", metrics=["mae"])
    return model


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in ``folder``'s event files, read by TensorBoard's ``EventAccumulator``."""
    from tensorboard.util import tensor_util

    reader = event_accumulator.EventAccumulator(
        str(folder), size_guidance={event_accumulator.TENSORS: 0})
    reader.Reload()
    return {tag: [(e.step, float(tensor_util.make_ndarray(e.tensor_proto)))
                  for e in reader.Tensors(tag)]
            for tag in reader.Tags()["tensors"] if not tag.startswith("_hparams_")}


def _plugin_data(folder, plugin: str = hparams_metadata.PLUGIN_NAME) -> dict[str, bytes]:
    reader = event_accumulator.EventAccumulator(str(folder))
    reader.Reload()
    return reader.PluginTagToContent(plugin)


# -- train --tensorboard ------------------------------------------------------------------------

def test_train_writes_each_evaluations_scalars_equal_to_the_history(tmp_path):
    result = kbackend.train(_classifier(), X, CLASSES, epochs=3, batch_size=32,
                            learning_rate=0.01, progress=False, tensorboard=tmp_path / "tb",
                            fused_steps=4, jit_compile=JIT_FOR_SMALL_RUNS)
    history = result.history
    scalars = _scalars(tmp_path / "tb")
    steps = [e["step"] for e in history.evals]
    for name in ("val_loss", "val_accuracy", "train_loss"):
        assert [s for s, _ in scalars[name]] == steps
        np.testing.assert_allclose([v for _, v in scalars[name]],
                                   [e[name] for e in history.evals], rtol=1e-6)
    assert [v for _, v in scalars["learning_rate"]] == pytest.approx([0.01] * len(steps))
    # samples/s of each interval, from the history's own clock
    times = [0.0] + [e["train_time"] for e in history.evals]
    expected = [(b - a) * 32 / (t1 - t0) for a, b, t0, t1
                in zip([0, *steps], steps, times, times[1:], strict=False)]
    np.testing.assert_allclose([v for _, v in scalars["samples_per_s"]], expected, rtol=1e-5)
    assert "batch_size" not in scalars  # written for --batch-size auto runs only
    # History.history: Keras's per-evaluation lists
    assert history.history["val_accuracy"] == [e["val_accuracy"] for e in history.evals]
    assert history.history["loss"] == [e["train_loss"] for e in history.evals]
    assert set(history.history) == {"loss", "val_loss", "val_accuracy"}


def test_train_cli_tensorboard_and_bad_paths(cli, tmp_path):
    tb = tmp_path / "tb"
    out = cli("train", "--model", "seed_mlp", "--dataset", "digits", "--epochs", "1",
              "--quiet", "--fused-steps", "8", "--tensorboard", str(tb), *NO_JIT_FLAGS)
    assert out.returncode == 0, out.stderr
    assert {"val_loss", "val_accuracy", "learning_rate"} <= set(_scalars(tb))
    afile = tmp_path / "a.txt"
    afile.write_text("x")
    np.savez(tmp_path / "d.npz", x_train=X, y_train=CLASSES)
    for path, words in ((afile, "is a file"), (tmp_path / "d.npz", "is also --data")):
        bad = cli("train", "--model", "seed_mlp", "--data", str(tmp_path / "d.npz"),
                  "--tensorboard", str(path))
        assert bad.returncode == 2 and words in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1


# -- the study: runs.csv, run folders, the HParams experiment, typed results ---------------------

STUDY = dict(target=2.0, target_metric="val_mae", optimizers=("adam",), batch_sizes=(16, 32),
             seeds=2, lr_grid_size=1, noise_points=0, step_time_repeats=0, max_steps=300,
             frontier_epochs=0, max_seeds=2, progress=False)


@pytest.fixture(scope="module")
def studied(tmp_path_factory):
    """A two-cell study of a live keras.Model (regression), then the same call resumed."""
    root = tmp_path_factory.mktemp("study")
    kwargs = {**STUDY, "out": root / "out", "tensorboard": root / "tb"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        first = kbackend.study(_regressor(), X, VALUES, **kwargs)
    mtimes = {p: p.stat().st_mtime_ns for p in (root / "tb").rglob("*") if p.is_file()}
    again = kbackend.study(_regressor(), X, VALUES, **kwargs)
    return root, first, again, mtimes, printed.getvalue()


@pytest.mark.slow
def test_a_study_takes_a_live_model_and_returns_typed_results(studied):
    root, first, again, *_ = studied
    assert dataclasses.is_dataclass(first) and dataclasses.is_dataclass(first.best)
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.best.batch_size = 8  # type: ignore[misc]
    best = first.best
    assert best.optimizer == "adam" and best.batch_size in (16, 32)
    assert best.learning_rate > 0 and "--target-metric val_mae" in best.command
    assert best.python.startswith("kbackend.train(")
    assert best["batch_size"] == best.batch_size  # the dict it was still reads (documented)
    # the printed command confirmed on held-out seeds, typed
    assert best.confirmation is not None and best.confirmation.seeds == (10000, 10001, 10002)
    assert best.confirmation.reached <= 3 and best.edge in (True, False)
    assert (best.tie is None) == (not best.tied_with)
    assert [(r.optimizer, r.batch_size) for r in first.rows] == [("adam", 16), ("adam", 32)]
    assert all(r.reached and r.test_metric_name == "test_mae" for r in first.rows)
    assert first.rows[0]["seeds"] == 2  # the full record by key
    # the model was stored once, named by its content: the second call resumed every run
    assert len(list((root / "out" / "models").glob("reg-*.keras"))) == 1
    assert again.best.to_dict() == first.best.to_dict()
    frame = first.to_pandas()
    assert list(frame["batch_size"]) == [16, 32] and frame["reached"].all()
    assert first.to_dict()["best"]["batch_size"] == best.batch_size


@pytest.mark.slow
def test_progress_false_prints_nothing(studied):
    assert studied[4] == ""


@pytest.mark.slow
def test_runs_csv_has_a_row_per_run_and_says_which_were_reused(studied):
    _, first, again, *_ = studied
    assert first.runs_path == again.runs_path and first.runs_path.name == "runs.csv"
    table = pandas.read_csv(again.runs_path)
    runs = again.study.to_json()["runs"]
    assert len(table) == len(runs) == 4  # 2 batch sizes x 2 seeds
    assert sorted(zip(table["batch_size"], table["seed"], strict=True)) == \
        [(16, 0), (16, 1), (32, 0), (32, 1)]
    assert table["reused"].all()  # the second call trained nothing
    assert {"optimizer", "learning_rate", "steps_to_target", "time_to_target",
            "reached"} <= set(table.columns)
    by_key = {r["key"]: r["result"] for r in runs}
    for row in table.itertuples():
        assert row.steps_to_target == by_key[row.key]["steps_to_target"]
        assert bool(row.reached) == by_key[row.key]["reached"]


@pytest.mark.slow
def test_the_study_writes_one_run_folder_per_run_and_the_hparams_experiment(studied):
    root, _, again, mtimes, _ = studied
    tb = root / "tb"
    folders = sorted(p for p in tb.iterdir() if p.is_dir())
    assert len(folders) == 4
    # the resumed call wrote no run again (no duplicated points) and left them as they were
    assert all(p.stat().st_mtime_ns == mtimes[p] for p in tb.glob("*/*") if p in mtimes)
    assert len(list(tb.glob("*/events.out.tfevents.*"))) == 4
    assert len(list(tb.glob("events.out.tfevents.*"))) == 1
    experiment = hparams_metadata.parse_experiment_plugin_data(
        _plugin_data(tb)[hparams_metadata.EXPERIMENT_TAG])
    assert sorted(h.name for h in experiment.hparam_infos) == ["batch_size", "learning_rate",
                                                               "optimizer"]
    assert {m.name.tag for m in experiment.metric_infos} == {
        "steps_to_target", "time_to_target", "best_val_mae"}
    runs = {r["key"][:8]: r for r in again.study.to_json()["runs"]}
    for folder in folders:
        run = runs[folder.name.rsplit("-", 1)[1]]
        start = hparams_metadata.parse_session_start_info_plugin_data(
            _plugin_data(folder)[hparams_metadata.SESSION_START_INFO_TAG])
        assert start.hparams["optimizer"].string_value == "adam"
        assert start.hparams["batch_size"].number_value == run["config"]["batch_size"]
        scalars = _scalars(folder)
        evals = run["trajectory"]["evals"]
        assert [s for s, _ in scalars["val_mae"]] == [e["step"] for e in evals]
        np.testing.assert_allclose([v for _, v in scalars["val_mae"]],
                                   [e["val_mae"] for e in evals], rtol=1e-6)
        assert scalars["steps_to_target"] == [(0, run["result"]["steps_to_target"])]


def test_a_bad_tensorboard_folder_is_one_line_before_any_work(tmp_path):
    afile = tmp_path / "a.txt"
    afile.write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        kbackend.study(_regressor(), X, VALUES, **{**STUDY, "out": tmp_path / "o",
                                                    "tensorboard": afile})
    assert not (tmp_path / "o" / "study.db").exists()


def test_a_tf_data_sets_own_batch_size_is_used_or_the_override_said(capfd):
    tf = pytest.importorskip("tensorflow")
    data = tf.data.Dataset.from_tensor_slices((X, CLASSES)).batch(64)
    result = kbackend.train(_classifier(), data, epochs=1, progress=False, fused_steps=1,
                            jit_compile=JIT_FOR_SMALL_RUNS)
    assert result.config.batch_size == 64
    kbackend.train(_classifier(), data, epochs=1, batch_size=16, progress=True, fused_steps=1,
                   jit_compile=JIT_FOR_SMALL_RUNS)
    err = capfd.readouterr().err
    assert "batch_size=16 replaces the tf.data set's own batch of 64" in err


# -- the console at 80 columns ------------------------------------------------------------------

def _printed(study, width=80) -> list[str]:
    from rich.console import Console

    from kbackend.study.analysis import analyze
    from kbackend.study.report import print_table

    out = io.StringIO()
    print_table(study, analyze(study), Console(file=out, width=width, highlight=False))
    return out.getvalue().splitlines()


def _as_classifier(study):
    cells = [dataclasses.replace(c, test_metric_name="test_accuracy", test_metric=0.9375)
             for c in study.cells]
    return dataclasses.replace(study, cells=cells)


def _with_auto_cell(study):
    auto = dataclasses.replace(study.cells[0], batch_size="auto", learning_rate=0.00316227766,
                               auto={"min": 16, "max": 512, "lr_scaling": "sqrt"},
                               lr_at_grid_edge=True, seeds=10, seeds_reached=10)
    return dataclasses.replace(study, auto_cells=[auto])


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["regression", "classification", "auto"])
def test_the_console_table_fits_80_columns_with_every_cell_filled(studied, variant):
    study = studied[2].study
    study = {"regression": study, "classification": _as_classifier(study),
             "auto": _with_auto_cell(study)}[variant]
    lines = _printed(study)
    assert max(len(line) for line in lines) <= 80
    header = next(line for line in lines if line.lstrip().startswith("optimizer"))
    metric = "test acc" if variant == "classification" else "test mae"
    assert metric in header and ("test acc" in header) == (variant == "classification")
    rows = [line.split() for line in lines if line.lstrip().startswith("adam")]
    assert len(rows) == len(study.all_cells)
    assert "…" not in "\n".join(lines)
    for row in rows:  # optimizer, batch, lr, time, steps, reached, test: none blank
        assert row[1] not in ("", "-") and not any(math.isnan(float(v)) for v in row[-1:])
    assert not any("k=" in line for line in lines)  # the scaling exponents: the report's
    if variant == "auto":
        assert rows[-1][1:3] == ["auto", "16-512"] and rows[-1][3] == "0.00316*"


@pytest.mark.slow
def test_the_console_shows_the_stored_test_value_after_a_resume(studied):
    _, first, again, *_ = studied
    assert [r.test_metric for r in again.rows] == [r.test_metric for r in first.rows]
    assert all(r.test_metric is not None for r in again.rows)


@pytest.mark.slow
def test_a_narrow_console_drops_whole_columns_and_names_them(studied):
    from kbackend.study.report import console_rows, fitting_columns

    study = _with_auto_cell(studied[2].study)
    header, rows, _ = console_rows(study)
    full = sum(max(len(t) for t in [h, *(r[i] for r in rows)]) for i, h in enumerate(header))
    needed = full + 2 * (len(header) - 1)
    assert fitting_columns(header, rows, needed) == list(range(len(header)))
    assert fitting_columns(header, rows, needed - 1) == list(range(len(header) - 1))
    lines = _printed(study, width=needed - 1)
    assert max(len(line) for line in lines) <= needed - 1
    assert "…" not in "\n".join(lines)
    table = [line for line in lines if line.lstrip().startswith("adam")]
    assert all(len(line.split()) >= 6 for line in table)  # nothing blank
    assert "testmaeandeverycolumn:thereport" in "".join("".join(lines).split())


def test_study_cli_refuses_a_bad_tensorboard_folder_in_one_line(cli, tmp_path, monkeypatch):
    np.savez(tmp_path / "d.npz", x_train=X, y_train=CLASSES)
    afile = tmp_path / "a.txt"
    afile.write_text("x")
    flags = ("study", "--model", "seed_mlp", "--data", str(tmp_path / "d.npz"), "--target",
             "0.9", "--out", str(tmp_path / "out"), "--no-progress")
    for path, words in ((afile, "is a file"), (tmp_path / "d.npz", "is also --data")):
        bad = cli(*flags, "--tensorboard", str(path))
        assert bad.returncode == 2 and words in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1
    import kbackend.tensorboard_logs as logs

    monkeypatch.setattr(logs.importlib.util, "find_spec", lambda name: None)
    bad = cli(*flags, "--tensorboard", str(tmp_path / "tb"))
    assert bad.returncode == 2 and "pip install 'kbackend[tensorboard]'" in bad.stderr
    assert not (tmp_path / "out" / "study.db").exists()
