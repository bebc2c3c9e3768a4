"""``kbackend equiv``'s inputs, checked in the driver before any worker starts (issue 14): the
loss table against the installed Keras (this session's backend; the other session runs it on the
other), bad flags as one line with exit status 2, and what a worker does with a Sequential model.

The table test is what lets the driver check ``--loss`` without importing Keras: if a Keras
upgrade adds, removes or renames a loss, it fails here, on either backend.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import pytest

from kbackend.commands import equiv as equiv_command
from kbackend.equivalence.losses import (
    FROM_LOGITS,
    LOSS_CLASS,
    LOSS_NAMES,
    SHAPE_CHOSEN,
    check_loss,
)
from kbackend.errors import ConfigError
from kbackend.model_sources import ModelSource, parse_model_source
from tests.conftest import BACKEND, ROOT, one_line_error

# Resolvable by keras.losses.get, but not a loss one can compute with (abstract or needs a fn).
KERAS_BASES = {"Loss", "LossFunctionWrapper"}


def _keras_names() -> set[str]:
    # The dict keras.losses.get consults for a string (private, so read here only: if Keras moves
    # it, this test fails loudly rather than passing on an empty set).
    from keras.src.losses import ALL_OBJECTS_DICT

    return set(ALL_OBJECTS_DICT) - KERAS_BASES


def test_the_table_holds_exactly_the_names_keras_resolves():
    assert set(LOSS_CLASS) == _keras_names()


@pytest.mark.parametrize("cls", sorted(LOSS_NAMES))
def test_each_name_resolves_to_its_class_and_from_logits_is_where_keras_takes_it(cls):
    import keras

    loss_class = getattr(keras.losses, cls)
    assert isinstance(keras.losses.get(cls), loss_class)
    wrapped = getattr(loss_class(), "fn", None)  # the function a wrapper class computes
    for name in LOSS_NAMES[cls]:
        resolved = keras.losses.get(name)
        assert callable(resolved) and not isinstance(resolved, keras.losses.Loss), name
        if wrapped is not None:
            assert resolved is wrapped, (name, cls)
    takes_logits = "from_logits" in inspect.signature(loss_class.__init__).parameters
    assert takes_logits == (cls in FROM_LOGITS)
    if takes_logits:
        for name in (cls, *LOSS_NAMES[cls]):
            loss = keras.losses.get(check_loss(name, from_logits=True))
            assert isinstance(loss, loss_class) and loss.get_config()["from_logits"] is True


@pytest.mark.parametrize("name", [*SHAPE_CHOSEN, "CrossEntropy", "CE"])
def test_the_shape_chosen_cross_entropy_compiles(name):
    from keras.src.trainers.compile_utils import get_loss

    y_true, y_pred = np.array([[0.0, 1.0]], np.float32), np.array([[0.3, 0.7]], np.float32)
    assert get_loss(name, y_true, y_pred) is not None
    assert check_loss(name) == name


@pytest.mark.parametrize(("name", "from_logits", "message"), [
    ("bogus", False, "Expected a Keras loss name"),
    ("Loss", False, "Expected a Keras loss name"),
    ("LossFunctionWrapper", False, "Expected a Keras loss name"),
    ("", False, "Expected a Keras loss name"),
    ("Mse", False, "Expected a Keras loss name"),
    ("mse", True, "takes logits"),
    ("crossentropy", True, "takes logits"),
    ("SparseCategoricalCrossentropy ", False, "Expected a Keras loss name"),
])
def test_check_loss_refuses_with_one_line(name, from_logits, message):
    with pytest.raises(ConfigError, match=message) as raised:
        check_loss(name, from_logits=from_logits)
    assert "\n" not in str(raised.value) and repr(name) in str(raised.value)


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "m.keras"
    with zipfile.ZipFile(path, "w") as archive:  # passes the file check; never loaded here
        archive.writestr("config.json", "{}")
    return path


CASES = {
    "a key the archive lacks": (["--inputs", "{data}:nope"],
                                "has no array 'nope'; its arrays are x, y"),
    "a key of a .npy file": (["--inputs", "{npy}:x"], "file not found"),
    "object arrays": (["--targets", "{objects}"], "holds Python objects"),
    "a built-in model": (["__MODEL__=seed_mlp"], "a built-in model has no weights"),
    "a builder without inputs": (["__MODEL__={builder}:build"], "pass --inputs"),
    "a builder on several arrays": (["__MODEL__={builder}:build", "--inputs", "{data}"],
                                    "the archive holds 2 arrays (x, y)"),
    "unknown loss": (["--loss", "bogus"], "Invalid --loss"),
    "a base class": (["--loss", "Loss"], "Invalid --loss"),
    "logits of mse": (["--loss", "mse", "--from-logits"], "Invalid --loss with --from-logits"),
    "huge batch": (["--batch-size", "100000000"], "Invalid --batch-size 100000000"),
    "timeout overflow": (["--timeout", "1e300"], "Invalid --timeout"),
    "timeout nan": (["--timeout", "nan"], "Invalid --timeout"),
    "text as inputs": (["--inputs", "{text}"], "without a NumPy header"),
    "empty inputs": (["--inputs", "{empty}"], "Received: 0 bytes"),
    "empty archive": (["--targets", "{archive}"], "holds no arrays"),
    "name too long": (["--inputs", "x" * 300], "File name too long"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_equiv_input_is_one_line_before_any_worker(cli, monkeypatch, tmp_path, model_file,
                                                       case):
    def no_workers(*args, **kwargs):
        raise AssertionError("a worker pool started although the input was bad")

    monkeypatch.setattr(equiv_command, "WorkerPool", no_workers)
    (tmp_path / "x.txt").write_text("not an array\n")
    (tmp_path / "empty.npy").write_bytes(b"")
    zipfile.ZipFile(tmp_path / "none.npz", "w").close()
    np.savez(tmp_path / "data.npz", x=np.zeros((2, 3), np.float32), y=np.zeros(2, np.int32))
    np.save(tmp_path / "x.npy", np.zeros((2, 3), np.float32))
    np.savez(tmp_path / "objects.npz", y=np.array([{"a": 1}], dtype=object))
    (tmp_path / "builder.py").write_text("def build():\n    raise AssertionError('built')\n")
    places = {"text": tmp_path / "x.txt", "empty": tmp_path / "empty.npy",
              "archive": tmp_path / "none.npz", "data": tmp_path / "data.npz",
              "npy": tmp_path / "x.npy", "objects": tmp_path / "objects.npz",
              "builder": tmp_path / "builder.py"}
    flags, message = CASES[case]
    flags = [f.format(**{k: str(v) for k, v in places.items()}) for f in flags]
    model = next((f.removeprefix("__MODEL__=") for f in flags if f.startswith("__MODEL__=")),
                 model_file)
    before = sorted(p.name for p in tmp_path.iterdir())
    report = tmp_path / "report.json"
    result = cli("equiv", model, "--json", report,
                 *[f for f in flags if not f.startswith("__MODEL__=")])
    assert result.returncode == 2, result
    assert one_line_error(result.stderr) and message in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no report, no temp file


def test_a_bad_loss_is_refused_without_importing_keras_or_tensorflow(tmp_path, model_file):
    code = textwrap.dedent(f"""
        import sys
        from kbackend.cli import main
        status = main(["equiv", {str(model_file)!r}, "--loss", "bogus"])
        heavy = sorted(m for m in ("keras", "tensorflow", "jax") if m in sys.modules)
        print(status, heavy)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "KERAS_BACKEND": BACKEND}, timeout=120)
    assert result.stdout.strip() == "2 []", result.stdout + result.stderr
    assert one_line_error(result.stderr) and "Invalid --loss" in result.stderr


def test_a_sequential_model_is_described_with_its_last_layer_as_output(tmp_path):
    import keras

    from kbackend.equivalence import operations

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="last")])
    model.save(tmp_path / "seq.keras")
    description = operations.describe({"kind": "keras_file", "path": str(tmp_path / "seq.keras")})
    assert [o["name"] for o in description["outputs"]] == ["last"]
    assert description["outputs"][0]["shape"] == [None, 3]


# --- --inputs / --targets: arrays by key, headers first (issue 34) ---------------------------


@pytest.fixture
def arrays(tmp_path):
    """An archive with two named arrays, one with one positional array, and a .npy file."""
    np.savez(tmp_path / "data.npz", x_val=np.ones((4, 3), np.float32), y_val=np.arange(4))
    np.savez(tmp_path / "one.npz", np.full((2, 3), 2.0, np.float32))
    np.save(tmp_path / "x.npy", np.zeros((5, 3), np.float32))
    return tmp_path


@pytest.mark.parametrize(("name", "shapes", "keys"), [
    ("data.npz:x_val", [(4, 3)], ["x_val"]),
    ("data.npz:y_val", [(4,)], ["y_val"]),
    ("data.npz", [(4, 3), (4,)], ["x_val", "y_val"]),  # one per model input, in order
    ("one.npz", [(2, 3)], ["arr_0"]),
    ("x.npy", [(5, 3)], None),
])
def test_arrays_are_picked_by_key_or_taken_in_order(arrays, name, shapes, keys):
    read = equiv_command.read_arrays(str(arrays / name), "--inputs")
    assert [a.shape for a in read.arrays] == shapes and read.keys == keys


def test_arrays_over_the_cap_are_refused_from_their_headers(arrays, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the data was read although its header already exceeds the cap")

    monkeypatch.setattr(equiv_command.np, "load", no_load)
    for name in ("data.npz:x_val", "x.npy"):
        with pytest.raises(ValueError, match="more than the 40 compared at once"):
            equiv_command.read_arrays(str(arrays / name), "--inputs", max_bytes=40)


def test_a_cut_npy_file_is_refused_from_its_header(arrays):
    data = (arrays / "x.npy").read_bytes()
    (arrays / "cut.npy").write_bytes(data[:-8])
    with pytest.raises(ValueError, match="a cut or altered file") as raised:
        equiv_command.read_arrays(str(arrays / "cut.npy"), "--inputs")
    assert "\n" not in str(raised.value)


class _DescribingPool:
    """Answers ``describe`` with a fixed one-input description; anything more is not expected."""

    backends = ("jax", "tensorflow")
    work_dir = "."

    def __init__(self, loss=None):
        self.description = {"inputs": [{"shape": [None, 3], "dtype": "float32", "int_high": None}],
                            "outputs": [{"name": "head", "shape": [None, 2]}],
                            "weights": [], "loss": loss}

    def call(self, backend, op, **kwargs):
        assert op == "describe"
        return self.description


def _args(*argv):
    from kbackend.cli import build_parser

    return build_parser().parse_args(["equiv", *[str(a) for a in argv]])


def test_equiv_takes_the_named_array_and_refuses_an_ambiguous_archive(arrays, model_file,
                                                                       monkeypatch):
    cases = []
    monkeypatch.setattr(equiv_command, "compare_model", lambda pool, case: cases.append(case))
    pool = _DescribingPool()
    equiv_command.compare_file(_args(model_file, "--inputs", f"{arrays / 'data.npz'}:x_val",
                                     "--targets", f"{arrays / 'data.npz'}:y_val"), pool)
    (case,) = cases
    assert [a.shape for a in case.x] == [(4, 3)] and [a.shape for a in case.y] == [(4,)]
    assert case.loss is None  # the comparison takes the model's compiled loss itself
    with pytest.raises(ValueError, match=r"holds 2 arrays \(x_val, y_val\) and the model takes "
                                         r"one input: name one, e\.g\. .*data\.npz:x_val"):
        equiv_command.compare_file(_args(model_file, "--inputs", arrays / "data.npz"), pool)


def test_random_targets_follow_the_compiled_loss(model_file, monkeypatch):
    cases = []
    monkeypatch.setattr(equiv_command, "compare_model", lambda pool, case: cases.append(case))
    sparse = {"class_name": "SparseCategoricalCrossentropy", "config": {"from_logits": True}}
    equiv_command.compare_file(_args(model_file), _DescribingPool(loss=sparse))
    assert cases[-1].loss is None and cases[-1].y[0].dtype == np.int32  # class ids
    equiv_command.compare_file(_args(model_file, "--loss", "mse"), _DescribingPool(loss=sparse))
    assert cases[-1].loss == "mse" and cases[-1].y[0].dtype == np.float32


def test_a_builder_is_sent_to_the_workers_with_its_data_shape_and_classes(arrays, monkeypatch):
    (arrays / "builder.py").write_text("def build(input_shape, num_classes):\n    pass\n")
    cases = []
    monkeypatch.setattr(equiv_command, "compare_model", lambda pool, case: cases.append(case))
    equiv_command.compare_file(_args(f"{arrays / 'builder.py'}:build", "--inputs",
                                     f"{arrays / 'data.npz'}:x_val", "--targets",
                                     f"{arrays / 'data.npz'}:y_val"), _DescribingPool())
    source = cases[0].source  # the builder's ModelSource as JSON, with the data it is built for
    assert ModelSource.from_json(source) == parse_model_source(f"{arrays / 'builder.py'}:build")
    assert source["path"] == str(arrays / "builder.py") and source["function"] == "build"
    assert (source["input_shape"], source["num_classes"]) == ([3], 4)


def test_a_model_source_travels_as_json_with_its_paths_made_absolute(arrays, monkeypatch):
    """``ModelSource.to_json`` / ``from_json``: what a worker process rebuilds a source from
    (equivalence's workers); a relative path is made absolute (a worker may start elsewhere),
    and a model given from Python, which has no such form, is an ``InternalError``."""
    from kbackend.errors import InternalError

    (arrays / "builder.py").write_text("def build(input_shape, num_classes):\n    pass\n")
    monkeypatch.chdir(arrays)
    for text in ("builder.py:build", "seed_mlp", "tests.digest_pin_builder:module_builder"):
        source = parse_model_source(text)
        again = ModelSource.from_json(source.to_json())
        assert type(again) is type(source) and again.to_json() == source.to_json()
    assert parse_model_source("builder.py:build").to_json()["path"] == str(
        arrays / "builder.py")
    with pytest.raises(InternalError, match="given from Python"):
        parse_model_source(lambda input_shape, num_classes: None).to_json()
    with pytest.raises(InternalError, match="Unknown model source kind"):
        ModelSource.from_json({"kind": "arch"})


class _FailingPool(_DescribingPool):
    """Describes a compiled classifier, then fails ``evaluate`` on the backends named."""

    def __init__(self, failing, loss=None):
        super().__init__(loss)
        self.failing, self.evaluated = failing, []

    def call_each(self, args, op):
        from kbackend.equivalence import WorkerFailed

        assert op == "evaluate"
        self.evaluated.append(args)
        error = WorkerFailed("'evaluate' failed", self.failing[0], "ValueError: shapes\n differ",
                             "")
        error.failed_backends = tuple(self.failing)
        raise error


def test_the_python_api_takes_the_compiled_loss_and_blames_no_backend_for_bad_input():
    from kbackend.equivalence import Case, CaseError, compare_model

    sparse = {"class_name": "SparseCategoricalCrossentropy", "config": {"from_logits": True}}
    x, y = [np.zeros((2, 3), np.float32)], [np.zeros(2, np.int32)]
    assert Case({"kind": "keras_file", "path": "m.keras"}, x, y).loss is None
    pool = _FailingPool(["jax", "tensorflow"], loss=sparse)
    with pytest.raises(CaseError, match="runs on no backend") as raised:
        compare_model(pool, Case({"kind": "keras_file", "path": "m.keras"}, x, y))
    message = str(raised.value)
    assert "SparseCategoricalCrossentropy (from_logits)" in message and "\n" not in message
    assert all(a["loss"] == sparse for a in pool.evaluated[0].values())
    # An uncompiled model: mse, as before; a failure on one backend only is that backend's row.
    pool = _FailingPool(["tensorflow"])
    report = compare_model(pool, Case({"kind": "arch", "arch": {}}, x, y))
    assert [r.name for r in report.rows] == ["run on tensorflow"]
    assert report.notes and report.notes[0].startswith("loss: mse, the default")
    assert all(a["loss"] == "mse" for a in pool.evaluated[0].values())
