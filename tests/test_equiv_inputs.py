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
def test_bad_equiv_input_is_one_line_before_any_worker(cli, monkeypatch, tmp_path, model_file, case):
    def no_workers(*args, **kwargs):
        raise AssertionError("a worker pool started although the input was bad")

    monkeypatch.setattr(equiv_command, "WorkerPool", no_workers)
    (tmp_path / "x.txt").write_text("not an array\n")
    (tmp_path / "empty.npy").write_bytes(b"")
    zipfile.ZipFile(tmp_path / "none.npz", "w").close()
    places = {"text": tmp_path / "x.txt", "empty": tmp_path / "empty.npy",
              "archive": tmp_path / "none.npz"}
    flags, message = CASES[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    report = tmp_path / "report.json"
    result = cli("equiv", model_file, "--json", report,
                 *[f.format(**{k: str(v) for k, v in places.items()}) for f in flags])
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
