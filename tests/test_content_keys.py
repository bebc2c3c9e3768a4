"""A stored run is reused only when what it trained is the same: content keys.

Each case re-runs a study on the same --out after changing one thing a user changes (a builder,
a custom layer's code, the labels of an .npz in place, another file with the same name, the
CSV label column): every run trains anew. A renamed copy of the same file is reused. Counts come
from a fake run executor (no training); one end-to-end study checks the same with real runs.
"""

from __future__ import annotations

import json
import shutil
import sqlite3

import numpy as np
import pytest

from kbackend.digests import arrays_digest, code_digest, json_digest
from kbackend.study.config import StudyConfig
from kbackend.study.executor import StudyRunner
from kbackend.study.pipeline import DB_NAME, report_dir, run_study
from kbackend.study.store import ResultStore
from kbackend.training import Target
from tests.conftest import JIT_FOR_SMALL_RUNS

BUILDER = ("import keras\n"
           "from custom_layers import Scale\n"
           "def build(input_shape, num_classes):\n"
           "    model = keras.Sequential([keras.Input(input_shape), keras.layers.Dense({units}, "
           "activation='relu'), Scale(), keras.layers.Dense(num_classes, "
           "activation='softmax')])\n"
           "    model.compile('sgd', 'sparse_categorical_crossentropy', metrics=['accuracy'])\n"
           "    return model\n")
LAYER = ("import keras\n"
         "class Scale(keras.layers.Layer):\n"
         "    def call(self, x):\n"
         "        return x * {factor}\n")


def _fake_history(plan):
    from kbackend.history import History

    history = History()
    steps = plan.max_steps
    history.record_steps(list(range(1, steps + 1)), [1.0] * steps,
                         [0.001 * s for s in range(1, steps + 1)])
    history.record_eval(step=steps, epoch=1, train_time=0.001 * steps, val_loss=0.5,
                        val_accuracy=0.5)
    history.timing.update(train_time=0.001 * steps, eval_time=0.0, wall_time=0.001 * steps)
    history.test = {"test_accuracy": 0.5, "test_loss": 0.5}
    return history


class CountingExecutor:
    """A run executor that trains nothing and counts the runs it was asked for."""

    def __init__(self) -> None:
        self.runs = 0

    def __call__(self, runner, plan):
        self.runs += 1
        return _fake_history(plan)


def _npz(path, seed=0, flip=False):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(200, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    if flip:
        y = 1 - y
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, x_train=x, y_train=y)
    return path


def _project(folder, units=16, factor=1.0):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "custom_layers.py").write_text(LAYER.format(factor=factor))
    (folder / "builder.py").write_text(BUILDER.format(units=units))
    return f"{folder / 'builder.py'}:build"


def _study(tmp_path, model, data, **kwargs):
    config = StudyConfig(model=model, dataset=str(data), optimizers=("sgd",), batch_sizes=(32,),
                         learning_rates={"sgd": (0.1,)}, seeds=2, lr_extend=0, max_steps=40,
                         noise_points=0, step_time_repeats=0, population="off",
                         target=Target("val_accuracy", 0.9), engine="keras",
                         jit_compile=JIT_FOR_SMALL_RUNS, **kwargs)
    executor = CountingExecutor()
    (tmp_path / "out").mkdir(exist_ok=True)
    with ResultStore(tmp_path / "out" / DB_NAME) as store:  # the runs alone: no report
        study = StudyRunner(config, store, run_executor=executor).run()
    return executor.runs, study


def test_digests_follow_content_not_names():
    a = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    assert arrays_digest(a) == arrays_digest({"x": a["x"].copy()})
    assert arrays_digest(a) != arrays_digest({"x": a["x"].reshape(3, 2)})  # shape
    assert arrays_digest(a) != arrays_digest({"x": a["x"].astype(np.float64)})  # dtype
    assert arrays_digest(a) != arrays_digest({"y": a["x"]})  # which array
    assert json_digest({"a": 1, "b": 2}) == json_digest({"b": 2, "a": 1})
    assert code_digest([np.ndarray, json_digest]) == code_digest([])  # libraries, kbackend


def test_edited_model_or_data_trains_anew_and_a_renamed_copy_is_reused(tmp_path):
    model = _project(tmp_path / "project")
    data = _npz(tmp_path / "data" / "cls.npz")
    first, result = _study(tmp_path, model, data)
    assert first == 2
    assert _study(tmp_path, model, data)[0] == 0  # the same content: every run reused
    # A renamed copy of the same file, in another folder: the same content, reused.
    renamed = tmp_path / "elsewhere" / "renamed.npz"
    renamed.parent.mkdir()
    shutil.copy(data, renamed)
    assert _study(tmp_path, model, renamed)[0] == 0
    # The builder edited (Dense(16) -> Dense(24)): a new model, every run trains.
    _project(tmp_path / "project", units=24)
    assert _study(tmp_path, model, data)[0] == 2
    # The custom layer's code edited (its call), the builder file unchanged.
    _project(tmp_path / "project", units=24, factor=2.0)
    assert _study(tmp_path, model, data)[0] == 2
    # The labels edited in place (same path, same size).
    _npz(data, flip=True)
    assert _study(tmp_path, model, data)[0] == 2
    # A different file with the same name: trains, and its report has a folder of its own.
    other = _npz(tmp_path / "other" / "cls.npz", seed=5)
    runs, other_study = _study(tmp_path, model, other)
    assert runs == 2
    before = _study(tmp_path, model, data)[1]
    out = tmp_path / "out"
    assert report_dir(out, other_study) != report_dir(out, before)
    assert report_dir(out, other_study).name.startswith("cls.npz-")
    assert report_dir(out, result) == report_dir(out, _study(tmp_path, model, renamed)[1]) or \
        result.digests["model"] != before.digests["model"]


def test_a_builder_file_defining_its_own_layer_keeps_its_digest_when_renamed(tmp_path):
    """A builder file imports under a module name made from its path and time; a layer class
    defined in the file carries that name in the model's config. A renamed, later copy of the
    file has the same content, so the same digest (its runs are reused); an edit to the layer
    changes it."""
    from kbackend.data import load
    from kbackend.model_sources import parse_model_source

    text = LAYER.format(factor=1.0) + BUILDER.format(units=8).replace(
        "from custom_layers import Scale\n", "")
    first = tmp_path / "a" / "builder.py"
    first.parent.mkdir()
    first.write_text(text)
    info = load("digits").info

    def digest(path):
        source = parse_model_source(f"{path}:build")
        return source.digest(source.build(info, seed=0))

    renamed = tmp_path / "b" / "renamed_builder.py"
    renamed.parent.mkdir()
    renamed.write_text(text)
    assert digest(first) == digest(renamed)
    edited = tmp_path / "c" / "builder.py"
    edited.parent.mkdir()
    edited.write_text(text.replace("x * 1.0", "x * 2.0"))
    assert digest(edited) != digest(first)


def test_the_csv_label_column_is_content(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 3))
    lines = ["a,b,c,y1,y2"] + [f"{r[0]:.4f},{r[1]:.4f},{r[2]:.4f},{int(r[0] > 0)},{int(r[1] > 0)}"
                               for r in x]
    csv = tmp_path / "table.csv"
    csv.write_text("\n".join(lines) + "\n")
    assert _study(tmp_path, "logistic", csv, label="y1")[0] == 2
    assert _study(tmp_path, "logistic", csv, label="y1")[0] == 0
    assert _study(tmp_path, "logistic", csv, label="y2")[0] == 2


def test_runs_stored_before_content_keys_are_kept_and_never_matched(tmp_path, capsys):
    model = _project(tmp_path / "project")
    data = _npz(tmp_path / "cls.npz")
    _study(tmp_path, model, data)
    db = tmp_path / "out" / DB_NAME
    with sqlite3.connect(db) as connection:  # as 4eb9dcc keyed them: no content_keys field
        rows = connection.execute("SELECT key, config FROM results WHERE kind = 'run'").fetchall()
        for key, config in rows:
            old_config = {k: v for k, v in json.loads(config).items() if k != "content_keys"}
            connection.execute("UPDATE results SET key = ?, config = ? WHERE key = ?",
                               ("old-" + key, json.dumps(old_config), key))
    config = StudyConfig(model=model, dataset=str(data), optimizers=("sgd",), batch_sizes=(32,),
                         learning_rates={"sgd": (0.1,)}, seeds=2, lr_extend=0, max_steps=40,
                         noise_points=0, step_time_repeats=0, engine="keras",
                         target=Target("val_accuracy", 0.9))
    with ResultStore(db) as store:
        runner = StudyRunner(config, store, run_executor=CountingExecutor())
        runner.prepare()
        assert runner.legacy_runs() == 2
    executor = CountingExecutor()
    run_study(config, tmp_path / "out", show_progress=True, print_results=False,
              run_executor=executor)
    assert executor.runs == 2  # retrained: the old keys are never matched
    assert "2 runs in" in capsys.readouterr().err.replace("\n", " ")
    with sqlite3.connect(db) as connection:  # and the old rows are still there
        assert connection.execute("SELECT count(*) FROM results WHERE key LIKE 'old-%'"
                                  ).fetchone()[0] == 2


@pytest.mark.slow
def test_an_end_to_end_study_reuses_a_renamed_copy(tmp_path):
    """Real training: the second study, on a renamed copy, trains nothing and reports the same
    steps."""
    data = _npz(tmp_path / "a" / "train.npz")
    config = dict(model="logistic", optimizers=("sgd",), batch_sizes=(32,),
                  learning_rates={"sgd": (0.5,)}, seeds=1, lr_extend=0, max_steps=30,
                  noise_points=0, step_time_repeats=0, population="off", engine="native",
                  target=Target("val_accuracy", 0.8), jit_compile=JIT_FOR_SMALL_RUNS)
    first = run_study(StudyConfig(dataset=str(data), **config), tmp_path / "out",
                      show_progress=False, print_results=False)
    copy = tmp_path / "b" / "copy.npz"
    copy.parent.mkdir()
    shutil.copy(data, copy)
    again = run_study(StudyConfig(dataset=str(copy), **config), tmp_path / "out",
                      show_progress=False, print_results=False)
    assert first.executed == 1 and again.executed == 0
    assert [r["result"]["steps_run"] for r in again.study.to_json()["runs"]] == \
        [r["result"]["steps_run"] for r in first.study.to_json()["runs"]]


@pytest.mark.parametrize("name", ["dense_7", "sequential_3"])
def test_auto_names_do_not_change_the_model_digest(name):
    """Keras numbers auto-generated layer names per session: the same model built after others
    has the same digest."""
    from kbackend.backend_choice import keras as import_keras
    from kbackend.model_sources import parse_model_source

    keras = import_keras()

    def build():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile("sgd", "mse")
        return model

    source = parse_model_source(build)
    first = source.digest(build())
    for _ in range(3):  # more layers and models numbered in between
        keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert source.digest(build()) == first
    wider = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5)])
    wider.compile("sgd", "mse")
    assert source.digest(wider) != first
    other_loss = build()
    other_loss.compile("sgd", "mae")
    assert source.digest(other_loss) != first
