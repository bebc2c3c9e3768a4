"""Bad data is refused before any work with one line naming what was wrong (issue 14).

Bad files are generated under ``tmp_path`` and passed as ``data_dir``, which is searched first, so
a bad file is found before the real data in ``$KBACKEND_DATA_DIR``. A ``Dataset`` built by hand
and passed to ``train`` is validated like a loaded one; bad model and optimizer numbers are
refused when the options are constructed.
"""

from __future__ import annotations

import gzip
import io
import math
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kbackend import cli, data
from kbackend.config import TrainConfig
from kbackend.data import sources
from kbackend.errors import ConfigError, DataError
from kbackend.models import ModelOptions
from kbackend.optim import OptimizerSpec
from kbackend.training import train

ROOT = Path(__file__).resolve().parent.parent
N_TRAIN, N_TEST = 30, 10


def mnist_arrays(**changes) -> dict[str, np.ndarray]:
    """Small valid MNIST-like arrays, with ``changes`` applied."""
    rng = np.random.default_rng(0)
    arrays = {
        "x_train": rng.integers(0, 256, (N_TRAIN, 28, 28), dtype=np.uint8),
        "y_train": np.arange(N_TRAIN, dtype=np.uint8) % 10,
        "x_test": rng.integers(0, 256, (N_TEST, 28, 28), dtype=np.uint8),
        "y_test": np.arange(N_TEST, dtype=np.uint8) % 10,
    }
    arrays.update(changes)
    return {key: value for key, value in arrays.items() if value is not None}


def npz_bytes(arrays: dict[str, np.ndarray], compressed: bool = False) -> bytes:
    buffer = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buffer, **arrays)
    return buffer.getvalue()


def corrupt_member(arrays: dict[str, np.ndarray]) -> bytes:
    """A compressed .npz whose zip directory is intact but whose first member's bytes are not."""
    raw = bytearray(npz_bytes(arrays, compressed=True))
    with zipfile.ZipFile(io.BytesIO(bytes(raw))) as archive:
        info = archive.infolist()[0]
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    for offset in range(start + 20, start + 60):
        raw[offset] ^= 0xFF
    return bytes(raw)


# case -> (the bytes of mnist.npz, a pattern the message must match)
NPZ_CASES = {
    "zero bytes": (b"", r"0 bytes that are not a zip archive"),
    "random bytes": (np.random.default_rng(1).bytes(5000), r"not a zip archive"),
    "truncated": (npz_bytes(mnist_arrays())[:4000], r"truncated or not an \.npz"),
    "an .npy, not an .npz": (b"\x93NUMPY" + bytes(200), r"not a zip archive"),
    "corrupt member": (corrupt_member(mnist_arrays()), r"Unreadable data file"),
    "wrong keys": (npz_bytes({"images": np.zeros((3, 28, 28), np.uint8)}),
                   r"missing x_train, y_train, x_test, y_test"),
    "one key missing": (npz_bytes(mnist_arrays(y_test=None)), r"missing y_test"),
    "object arrays": (npz_bytes(mnist_arrays(y_train=np.array([1, "a"] * 15, dtype=object))),
                      r"Unreadable data file.*(allow_pickle|Object arrays)"),
    "flat images": (npz_bytes(mnist_arrays(x_train=np.zeros((N_TRAIN, 784), np.uint8))),
                    r"Invalid x_train .*\(N, height, width\).*\(30, 784\)"),
    "float pixels": (npz_bytes(mnist_arrays(x_test=np.zeros((N_TEST, 28, 28), np.float32))),
                     r"Invalid x_test .*uint8.*float32"),
    "integral float labels": (
        npz_bytes(mnist_arrays(y_train=np.arange(N_TRAIN, dtype=np.float32) % 10)),
        r"Invalid y_train .*integer class labels.*float32"),
    "fractional float labels": (npz_bytes(mnist_arrays(y_test=np.full(N_TEST, 2.5))),
                                r"Invalid y_test .*integer class labels.*float64"),
    "2-D labels": (npz_bytes(mnist_arrays(y_train=np.zeros((N_TRAIN, 1), np.uint8))),
                   r"Invalid y_train .*1-D.*\(30, 1\)"),
    "label 10": (npz_bytes(mnist_arrays(y_test=np.full(N_TEST, 10, np.uint8))),
                 r"Invalid y_test .*\[0, 10\).*\[10, 10\]"),
    "negative label": (npz_bytes(mnist_arrays(y_train=np.full(N_TRAIN, -1, np.int8))),
                       r"Invalid y_train .*\[-1, -1\]"),
    "fewer labels than images": (npz_bytes(mnist_arrays(y_train=np.zeros(N_TRAIN - 1, np.uint8))),
                                 r"Mismatched train split .*30 images and 29 labels"),
    "empty train split": (npz_bytes(mnist_arrays(x_train=np.zeros((0, 28, 28), np.uint8),
                                                 y_train=np.zeros(0, np.uint8))),
                          r"Empty train split"),
    "empty test split": (npz_bytes(mnist_arrays(x_test=np.zeros((0, 28, 28), np.uint8),
                                                y_test=np.zeros(0, np.uint8))),
                         r"Empty test split"),
    "train and test of different sizes": (
        npz_bytes(mnist_arrays(x_test=np.zeros((N_TEST, 14, 14), np.uint8))),
        r"Mismatched image sizes"),
}


def assert_one_line_naming(message: str, name: str) -> None:
    assert "\n" not in message, message
    assert name in message, message


@pytest.mark.parametrize("case", sorted(NPZ_CASES))
def test_bad_mnist_npz_is_one_line_naming_the_file(case, tmp_path):
    content, pattern = NPZ_CASES[case]
    path = tmp_path / "mnist.npz"
    path.write_bytes(content)
    with pytest.raises(DataError, match=pattern) as error:
        data.load("mnist", data_dir=tmp_path)
    assert_one_line_naming(str(error.value), str(path))


def test_a_valid_small_mnist_npz_loads(tmp_path):
    """The negative control: the generator of the bad cases makes a good file when unchanged."""
    (tmp_path / "mnist.npz").write_bytes(npz_bytes(mnist_arrays(), compressed=True))
    dataset = data.load("mnist", data_dir=tmp_path, validation_fraction=0.2)
    assert dataset.info.source == str(tmp_path / "mnist.npz")
    assert (dataset.info.num_train, dataset.info.num_val, dataset.info.num_test) == (24, 6, 10)
    assert dataset.y_train.dtype == np.int32 and dataset.x_train.max() <= 1.0


def idx_bytes(array: np.ndarray, type_byte: int = 0x08, ndim: int | None = None) -> bytes:
    ndim = array.ndim if ndim is None else ndim
    header = bytes([0, 0, type_byte, ndim]) + np.asarray(array.shape, ">u4").tobytes()
    return header + array.astype(np.uint8).tobytes()


def fashion_files(**changes: bytes | None) -> dict[str, bytes]:
    """The four gzip-compressed IDX files of a small valid Fashion-MNIST, with ``changes``."""
    arrays = mnist_arrays()
    files = {
        "train-images-idx3-ubyte.gz": gzip.compress(idx_bytes(arrays["x_train"])),
        "train-labels-idx1-ubyte.gz": gzip.compress(idx_bytes(arrays["y_train"])),
        "t10k-images-idx3-ubyte.gz": gzip.compress(idx_bytes(arrays["x_test"])),
        "t10k-labels-idx1-ubyte.gz": gzip.compress(idx_bytes(arrays["y_test"])),
    }
    files.update({name.replace("_", "-") + ("-idx3" if "images" in name else "-idx1") + "-ubyte.gz":
                  content for name, content in changes.items()})
    return {name: content for name, content in files.items() if content is not None}


TRAIN_IMAGES = "train-images-idx3-ubyte.gz"
TEST_LABELS = "t10k-labels-idx1-ubyte.gz"
_labels = mnist_arrays()["y_test"]
_images = mnist_arrays()["x_train"]

# case -> (changed files, the file the message must name, a pattern it must match)
IDX_CASES = {
    "truncated gzip": ({"train_images": gzip.compress(idx_bytes(_images))[:500]}, TRAIN_IMAGES,
                       r"Unreadable data file .*EOFError"),
    "zero-byte gzip": ({"t10k_labels": b""}, TEST_LABELS, r"Invalid IDX file .*no data"),
    "not gzip": ({"train_images": idx_bytes(_images)}, TRAIN_IMAGES,
                 r"Unreadable data file .*(BadGzipFile|Not a gzipped file)"),
    "wrong magic": ({"t10k_labels": gzip.compress(b"\x1f\x8b" + idx_bytes(_labels)[2:])},
                    TEST_LABELS, r"first bytes are 00 00 08 01.*1f 8b"),
    "float IDX type": ({"t10k_labels": gzip.compress(idx_bytes(_labels, type_byte=0x0D))},
                       TEST_LABELS, r"type byte 0d"),
    "labels with 2 dimensions": ({"t10k_labels": gzip.compress(idx_bytes(_labels.reshape(5, 2)))},
                                 TEST_LABELS, r"1 dimension\(s\).*Received: type byte 08, 2"),
    "header cut short": ({"t10k_labels": gzip.compress(bytes([0, 0, 8, 1, 0]))}, TEST_LABELS,
                         r"Truncated IDX file .*8-byte header. Received: 5 bytes"),
    "fewer values than the header says": (
        {"train_images": gzip.compress(idx_bytes(_images)[:-100])}, TRAIN_IMAGES,
        r"header says shape \(30, 28, 28\).*23520 values. Received: 23420"),
    "label 12": ({"t10k_labels": gzip.compress(idx_bytes(np.full(N_TEST, 12)))}, TEST_LABELS,
                 r"Invalid y_test .*\[0, 10\)"),
    "fewer labels than images": ({"t10k_labels": gzip.compress(idx_bytes(_labels[:-1]))},
                                 TEST_LABELS, r"Mismatched test split .*10 images and 9 labels"),
    "empty train split": ({"train_images": gzip.compress(idx_bytes(np.zeros((0, 28, 28)))),
                           "train_labels": gzip.compress(idx_bytes(np.zeros(0)))},
                          TRAIN_IMAGES, r"Empty train split"),
    "a file missing": ({"t10k_labels": None}, TEST_LABELS, r"Incomplete Fashion-MNIST .*missing"),
}


@pytest.mark.parametrize("case", sorted(IDX_CASES))
@pytest.mark.parametrize("subfolder", ["fashion-mnist", "."])
def test_bad_fashion_mnist_is_one_line_naming_the_file(case, subfolder, tmp_path):
    changes, named, pattern = IDX_CASES[case]
    folder = (tmp_path / subfolder).resolve()
    folder.mkdir(exist_ok=True)
    for name, content in fashion_files(**changes).items():
        (folder / name).write_bytes(content)
    with pytest.raises(DataError, match=pattern) as error:
        data.load("fashion_mnist", data_dir=tmp_path)
    assert_one_line_naming(str(error.value), str(folder))
    assert named in str(error.value)


def test_a_valid_small_fashion_mnist_loads(tmp_path):
    (tmp_path / "fashion-mnist").mkdir()
    for name, content in fashion_files().items():
        (tmp_path / "fashion-mnist" / name).write_bytes(content)
    dataset = data.load("fashion_mnist", data_dir=tmp_path, layout="image", validation_fraction=0.2)
    assert dataset.x_train.shape[1:] == (28, 28, 1) and dataset.info.num_test == N_TEST


def test_bad_data_file_on_the_command_line_is_exit_2_and_one_line(tmp_path, capsys,
                                                                  engines_never_run):
    (tmp_path / "mnist.npz").write_bytes(b"")
    code = cli.main(["train", "--dataset", "mnist", "--data-dir", str(tmp_path), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and str(tmp_path / "mnist.npz") in err, err


def test_a_bad_keras_download_is_refused_by_name(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    monkeypatch.delenv("KBACKEND_DATA_DIR", raising=False)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
    monkeypatch.setenv("KBACKEND_OFFLINE", "0")
    bad = sources.RawData(np.zeros((3, 28, 28, 1), np.uint8), np.full(3, 0.5),
                          np.zeros((2, 28, 28, 1), np.uint8), np.zeros(2, np.uint8),
                          "image", 10, "keras.datasets.mnist download", 255.0)
    monkeypatch.setattr(sources, "_download", lambda name: bad)
    with pytest.raises(DataError, match=r"Invalid y_train in keras.datasets.mnist download"):
        data.load("mnist", data_dir=empty)


@pytest.mark.parametrize("name", ["mnist", "fashion_mnist"])
def test_missing_data_names_the_files_the_flags_and_the_doc(name, tmp_path, monkeypatch):
    monkeypatch.delenv("KBACKEND_DATA_DIR", raising=False)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
    monkeypatch.setenv("KBACKEND_OFFLINE", "1")
    with pytest.raises(DataError) as error:
        data.load(name, data_dir=tmp_path / "empty")
    message = str(error.value)
    expected_file = "mnist.npz" if name == "mnist" else "t10k-labels-idx1-ubyte.gz"
    for part in (expected_file, "--data-dir", "KBACKEND_DATA_DIR", "KBACKEND_OFFLINE",
                 str(tmp_path / "empty"), sources.DATA_DOC, "digits"):
        assert part in message, (part, message)
    assert "\n" not in message and "shared/data" not in message
    assert (ROOT / sources.DATA_DOC).is_file()
    assert "mnist.npz" in (ROOT / sources.DATA_DOC).read_text()


def test_a_failed_download_is_reported_without_cutting_a_word(tmp_path, monkeypatch):
    monkeypatch.delenv("KBACKEND_DATA_DIR", raising=False)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
    monkeypatch.setenv("KBACKEND_OFFLINE", "0")
    words = " ".join(f"word{i}" for i in range(200))

    def failing_download(name):
        raise OSError(f"URL fetch failure: {words}\nsecond line")

    monkeypatch.setattr(sources, "_download", failing_download)
    with pytest.raises(DataError) as error:
        data.load("mnist", data_dir=tmp_path / "empty")
    message = str(error.value)
    assert "\n" not in message and "second line" not in message
    assert "OSError: URL fetch failure: word0" in message and "word199" not in message
    shown = message.split("URL fetch failure: ")[1].split(" ...")[0].split()
    assert shown and all(w in words.split() for w in shown), shown  # no word cut in half
    assert sources.DATA_DOC in message  # the advice after the reason survives


def test_a_damaged_mnist1d_cache_is_regenerated(tmp_path, monkeypatch):
    monkeypatch.setenv("KBACKEND_CACHE_DIR", str(tmp_path))
    first = sources.load_mnist1d()
    cached = list(tmp_path.glob("mnist1d-*.npz"))
    assert len(cached) == 1
    cached[0].write_bytes(cached[0].read_bytes()[:1000])
    again = sources.load_mnist1d()
    np.testing.assert_array_equal(again.y_train, first.y_train)


# A Dataset built in Python and passed to train() is validated like a loaded one.

def hand_built(**changes) -> data.Dataset:
    rng = np.random.default_rng(0)
    splits = {}
    for split, n in (("train", 40), ("val", 10), ("test", 10)):
        splits[f"x_{split}"] = rng.random((n, 4), dtype=np.float32)
        splits[f"y_{split}"] = (np.arange(n) % 3).astype(np.int32)
    info = data.DatasetInfo("hand", (4,), 3, "arrays", "flat", None, 40, 10, 10)
    dataset = data.Dataset(**splits, info=info)
    for key, value in changes.items():
        setattr(dataset, key, value(getattr(dataset, key)) if callable(value) else value)
    return dataset


def _nan_at(index):
    def change(x):
        x = x.copy()
        x[index, 0] = np.nan
        return x
    return change


DATASET_CASES = {
    "label 7 of 3 classes": ({"y_train": lambda y: np.where(np.arange(len(y)) == 3, 7, y)},
                             r"Invalid label 7 in the train split.*\[0, 3\)"),
    "NaN inputs": ({"x_val": _nan_at(2)},
                   r"Non-finite inputs \(NaN\) in the validation split.*index 2"),
    "Inf inputs": ({"x_test": lambda x: x + np.inf},
                   r"Non-finite inputs \(Inf\) in the test split"),
    "mismatched lengths": ({"y_train": lambda y: y[:-1]}, r"Mismatched lengths in the train split"),
    "empty validation split": ({"x_val": lambda x: x[:0], "y_val": lambda y: y[:0]},
                               r"Empty validation split"),
    "fractional labels": ({"y_test": lambda y: y + 0.5}, r"integer class indices"),
    "shape unlike info": ({"x_test": lambda x: x[:, :3]},
                          r"test split: expected samples of shape \(4,\)"),
    "no class count": ({"info": lambda info: replace(info, num_classes=0)}, r"num_classes"),
}


@pytest.mark.parametrize("case", sorted(DATASET_CASES))
def test_a_bad_hand_built_dataset_is_refused_before_training(case, engines_never_run):
    changes, pattern = DATASET_CASES[case]
    config = TrainConfig(model="mlp", epochs=1, batch_size=8)
    with pytest.raises(DataError, match=pattern) as error:
        train(config, dataset=hand_built(**changes))
    assert "\n" not in str(error.value)


def test_a_good_hand_built_dataset_reaches_the_engine(engines_never_run):
    """The negative control: the same dataset unchanged passes every check and starts training."""
    data.validate_dataset(hand_built())
    with pytest.raises(AssertionError, match="training started"):
        train(TrainConfig(model="mlp", epochs=1, batch_size=8), dataset=hand_built())


# Numbers that pass a comparison but are not usable: NaN compares false, Inf diverges.

@pytest.mark.parametrize(("field", "value"), [
    ("l2", math.nan), ("l2", math.inf), ("l2", -0.1), ("l2", "0.1"),
    ("dropout", math.nan), ("dropout", 1.0), ("dropout", -0.1), ("dropout", math.inf),
    ("dropout", True),
])
def test_bad_model_numbers_are_refused_at_construction(field, value):
    with pytest.raises(ConfigError, match=rf"Invalid {field}: expected .*Received: ") as error:
        ModelOptions(**{field: value})
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(("field", "value"), [
    ("learning_rate", math.nan), ("learning_rate", math.inf), ("learning_rate", 0.0),
    ("learning_rate", -1e-3), ("learning_rate", "0.1"), ("epsilon", math.nan),
    ("weight_decay", math.inf), ("momentum", math.nan), ("beta2", math.nan),
    ("decay_rate", math.nan), ("warmup_steps", 1.5),
])
def test_bad_optimizer_numbers_are_refused_at_construction(field, value):
    with pytest.raises(ConfigError, match=rf"Invalid {field}: expected .*Received: ") as error:
        OptimizerSpec(**{field: value})
    assert "\n" not in str(error.value)


def test_good_numbers_are_accepted():
    ModelOptions(dropout=np.float32(0.5), l2=1e-4)
    OptimizerSpec(learning_rate=np.float64(0.1), warmup_steps=np.int64(3), epsilon=1e-8)


@pytest.mark.parametrize("argv", [["--l2", "nan"], ["--l2", "inf"], ["--dropout", "1"],
                                  ["--dropout", "nan"], ["--lr", "nan"], ["--lr", "inf"],
                                  ["--lr", "0"], ["--lr", "-1"]])
def test_bad_numbers_on_the_command_line_are_exit_2_before_training(argv, capsys,
                                                                     engines_never_run):
    code = cli.main(["train", "--quiet", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Invalid" in err and argv[1] in err, err
