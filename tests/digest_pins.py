"""The run keys' content digests of every kind of model and data source, as a study computes them
(``StudyRunner.prepare``: ``ModelSource.digest`` of the first model, ``Dataset.digest``), on
inputs made here from fixed seeds. ``tests/data/digest_pins.json`` holds the digests recorded on
9819043 (before each source kind had its own ``digest``), per backend; run keys must never change
by a refactor, so ``tests/test_digest_pins.py`` holds them equal. One deliberate change since: the
image folder's data digest, re-recorded when a folder's file order became a NumPy draw (it had
followed TensorFlow's global seed, so each backend, and each run seed, read another order); both
backends now read the same order and pin the same digest.

Record (on the commit whose digests are the reference; both backends):
``KERAS_BACKEND=jax python -m tests.digest_pins record`` (then ``tensorflow``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

PINS = Path(__file__).parent / "data" / "digest_pins.json"

# The sources below (code and data, made from fixed seeds) are part of the pinned digests: never
# edit them; add a case (and record it on the reference commit) instead.

BUILDER = ("import keras\n"
           "def build(input_shape, num_classes):\n"
           "    inputs = keras.Input(input_shape)\n"
           "    x = keras.layers.Flatten()(inputs)\n"
           "    x = keras.layers.Dense(8, activation='relu')(x)\n"
           "    outputs = keras.layers.Dense(num_classes)(x)\n"
           "    model = keras.Model(inputs, outputs)\n"
           "    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),\n"
           "                  metrics=['accuracy'])\n"
           "    return model\n")
FUNCTION = ("import numpy as np\n"
            "def splits():\n"
            "    rng = np.random.default_rng(3)\n"
            "    x = rng.normal(size=(120, 5)).astype(np.float32)\n"
            "    return {'train': (x[:100], (x[:100, 0] > 0).astype(np.int64)),\n"
            "            'test': (x[100:], (x[100:, 0] > 0).astype(np.int64))}\n")


def _arrays(seed: int = 0, n: int = 200, features: int = 6) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype(np.float32)
    return x, (x[:, 0] + x[:, 1] > 0).astype(np.int64)


def _inputs(root: Path) -> dict[str, str]:
    """The source files the cases read, written under ``root`` (the same bytes every time)."""
    from kbackend.backend_choice import keras as import_keras

    keras = import_keras()
    paths = {"builder": root / "builder.py", "npz": root / "cls.npz", "csv": root / "table.csv",
             "csv_strings": root / "strings.csv",
             "folder": root / "images", "function": root / "source.py",
             "keras": root / "saved.keras"}
    paths["builder"].write_text(BUILDER)
    paths["function"].write_text(FUNCTION)
    x, y = _arrays()
    np.savez(paths["npz"], x_train=x, y_train=y)
    rows = [f"{a:.4f},{b:.4f},{c:.4f},{int(a > 0)}" for a, b, c in x[:, :3]]
    paths["csv"].write_text("a,b,c,y1\n" + "\n".join(rows) + "\n")
    rows = [f"{a:.4f},{b:.4f},{['no', 'yes'][int(c > 0)]}" for a, b, c in x[:, :3]]
    paths["csv_strings"].write_text("a,b,kind\n" + "\n".join(rows) + "\n")
    rng = np.random.default_rng(7)
    for name in ("cat", "dog"):
        (paths["folder"] / name).mkdir(parents=True)
        for index in range(60):
            keras.utils.save_img(paths["folder"] / name / f"{index}.png",
                                 rng.integers(0, 256, (8, 6, 3)).astype("uint8"))
    keras.utils.set_random_seed(11)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, activation="relu"),
                              keras.layers.Dense(2, activation="softmax")])
    model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.save(paths["keras"])
    return {key: str(path) for key, path in paths.items()}


# name -> (model, data, StudyConfig options), the sources as strings (a study's run keys).
def _study_cases(p: dict[str, str]) -> dict[str, tuple[str, str, dict[str, Any]]]:
    return {
        "builtin model, builtin data": ("seed_mlp", "digits", {}),
        "builtin cnn, builtin data": ("cnn", "mnist1d", {}),
        "builder file, builtin data": (f"{p['builder']}:build", "digits", {}),
        "builder file, npz": (f"{p['builder']}:build", p["npz"], {}),
        "builtin model, npz": ("logistic", p["npz"], {}),
        "builder file, csv label": (f"{p['builder']}:build", p["csv"], {"label": "y1"}),
        "builder file, csv string label": (f"{p['builder']}:build", p["csv_strings"],
                                           {"label": "kind"}),
        "builder file, image folder": (f"{p['builder']}:build", p["folder"], {}),
        "builder file, function source": (f"{p['builder']}:build",
                                          f"{p['function']}:splits", {}),
        "keras file, npz": (p["keras"], p["npz"], {}),
        "module builder, npz": ("tests.digest_pin_builder:module_builder", p["npz"], {}),
    }


def _study_digests(model: str, data: str, options: dict[str, Any]) -> dict[str, str]:
    from kbackend.config import Target
    from kbackend.study.config import StudyConfig
    from kbackend.study.executor import StudyRunner

    config = StudyConfig(model=model, dataset=data, optimizers=("sgd",), batch_sizes=(8,),
                         seeds=1, noise_points=0, step_time_repeats=0, population="off",
                         target=Target("val_accuracy", 0.9), **options)
    runner = StudyRunner(config, None)
    runner.prepare()
    return dict(runner.digests)


def _python_cases(p: dict[str, str]) -> dict[str, Callable[[], dict[str, str]]]:
    """The sources a Python caller passes (``kbackend.study`` keys them as a study keys its
    workload: ``ModelSource.digest`` of the model it saves, ``Dataset.digest`` of the arrays)."""
    from kbackend.backend_choice import keras as import_keras
    from kbackend.model_sources import parse_model_source
    from kbackend.workload import prepare_workload
    from tests.digest_pin_builder import module_builder

    keras = import_keras()

    def instance() -> Any:
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3, activation="relu"),
                                  keras.layers.Dense(2, activation="softmax")], name="given")
        model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    def workload_digests(model: Any, data: Any = None, **kwargs: Any) -> dict[str, str]:
        workload = prepare_workload(model, data, **kwargs)
        return {"model": workload.source.digest(workload.first_model()),
                "data": workload.dataset.digest()}

    x, y = _arrays(1)
    xv, yv = _arrays(2, n=40)
    return {
        "keras.Model instance, arrays": lambda: workload_digests(instance(), x=x, y=y),
        "keras.Model from weights, arrays": lambda: workload_digests(
            instance(), x=x, y=y, from_weights=True),
        "keras.Model instance as saved by study": lambda: {
            "model": parse_model_source(m := instance()).digest(m)},
        "callable builder, arrays with validation": lambda: workload_digests(
            module_builder, x=x, y=y, validation_data=(xv, yv)),
        "builder file, tf.data": lambda: workload_digests(
            f"{p['builder']}:build", x=_tf_dataset(x, y)),
        "keras file from weights, npz": lambda: workload_digests(
            p["keras"], data=p["npz"], from_weights=True),
    }


def _tf_dataset(x: np.ndarray, y: np.ndarray) -> Any:
    import tensorflow as tf  # deferred: only this case reads a tf.data set

    return tf.data.Dataset.from_tensor_slices((x, y)).batch(16)


# The names of ``_python_cases`` (known without importing Keras: test collection).
PYTHON_CASES = ("keras.Model instance, arrays", "keras.Model from weights, arrays",
                "keras.Model instance as saved by study",
                "callable builder, arrays with validation", "builder file, tf.data",
                "keras file from weights, npz")


def case_names() -> list[str]:
    """Every case's name (the keys of the pins)."""
    paths = dict.fromkeys(("builder", "npz", "csv", "csv_strings", "folder", "function",
                           "keras"), "")
    return [*_study_cases(paths), *PYTHON_CASES]


def case_digests(name: str, paths: dict[str, str]) -> dict[str, str]:
    """The digests of case ``name`` on this backend, its sources at ``paths`` (``_inputs``)."""
    study = _study_cases(paths)
    if name in study:
        return _study_digests(*study[name])
    cases = _python_cases(paths)
    assert tuple(cases) == PYTHON_CASES
    return cases[name]()


def write_inputs(root: Path) -> dict[str, str]:
    """The cases' source files written under ``root``; their paths by name."""
    return _inputs(root)


def digests() -> dict[str, dict[str, str]]:
    """Every case's digests on this backend (sources written to a fresh temporary folder)."""
    with tempfile.TemporaryDirectory() as folder:
        paths = _inputs(Path(folder))
        return {name: case_digests(name, paths) for name in case_names()}


def record() -> None:
    backend = os.environ["KERAS_BACKEND"]
    pins = json.loads(PINS.read_text()) if PINS.exists() else {}
    pins[backend] = digests()
    PINS.parent.mkdir(exist_ok=True)
    PINS.write_text(json.dumps(pins, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__" and sys.argv[1:] == ["record"]:
    record()
