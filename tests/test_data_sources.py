"""A user's own data sources (issue 34): .npz, .csv, folders of images or text, TFDS folders,
FILE.py:FUNCTION, and Python objects, read into NumPy arrays; every bad input a one-line
``DataError`` saying what was wrong (kbackend/data/user/).

Every file is generated under ``tmp_path``; nothing reaches the network. The TFDS tests build a
tiny prepared dataset with a builder defined here, and skip when TensorFlow Datasets (the ``tfds``
extra) is not installed.
"""

from __future__ import annotations

import io
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest

from kbackend.data.user import (
    TEXT_SEQUENCE_LENGTH,
    UserData,
    from_python,
    load_source,
)
from kbackend.errors import DataError

RNG = np.random.default_rng(0)
TFDS_NAME = "kbackend_tiny_set"


def tensorflow():
    import tensorflow as tf  # deferred: only the tests of TensorFlow sources need it

    return tf


# --- files the tests read ---------------------------------------------------------------------


def npz(tmp_path: Path, name: str = "data.npz", **arrays) -> str:
    path = tmp_path / name
    np.savez(path, **arrays)
    return str(path)


def valid_arrays(**changes) -> dict[str, np.ndarray]:
    arrays = {"x_train": RNG.random((12, 3)).astype(np.float32), "y_train": np.arange(12) % 3,
              "x_test": RNG.random((5, 3)).astype(np.float32), "y_test": np.arange(5) % 3}
    arrays.update(changes)
    return {key: value for key, value in arrays.items() if value is not None}


def forged_npz(tmp_path: Path) -> str:
    """An .npz whose x_train header declares far more data than its archive entry holds."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f8", "fortran_order": False, "shape": (10**6, 10**3)})
    path = tmp_path / "forged.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x_train.npy", header.getvalue() + b"\0" * 64)
        archive.writestr("y_train.npy", _npy_bytes(np.arange(3)))
    return str(path)


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def corrupt_npz(tmp_path: Path) -> str:
    """A compressed .npz whose zip directory and headers are intact but whose data is not."""
    path = tmp_path / "corrupt.npz"
    np.savez_compressed(path, x=np.zeros((400, 50)), y=np.zeros(400))
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo("x.npy")
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    for offset in range(start + 200, start + 260):
        raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))
    return str(path)


def npy(tmp_path: Path) -> str:
    np.save(tmp_path / "x.npy", np.ones(3))
    return str(tmp_path / "x.npy")


def folder_of(root: Path, *files: str) -> str:
    """``root`` with the small ``files`` (paths relative to it) added."""
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("1")
    return str(root)


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip())
    return str(path)


def image_folder(root: Path, classes=("cat", "dog"), per_class: int = 3, size=(8, 6),
                 channels: int = 3) -> Path:
    from kbackend.backend_choice import keras

    for name in classes:
        (root / name).mkdir(parents=True)
        for index in range(per_class):
            pixels = RNG.integers(0, 256, (*size, channels)).astype("uint8")
            keras().utils.save_img(root / name / f"{index}.png", pixels)
    return root


def text_folder(root: Path, texts: dict[str, list[str]]) -> Path:
    for name, documents in texts.items():
        (root / name).mkdir(parents=True)
        for index, document in enumerate(documents):
            (root / name / f"{index}.txt").write_text(document)
    return root


PY_SOURCES = {
    "ok.py": """
        import numpy as np

        def arrays():
            return np.ones((4, 2), "float32"), np.array([0, 1, 0, 1])

        def splits():
            return {"train": (np.ones((4, 2)), np.arange(4)),
                    "validation": (np.zeros((2, 2)), np.arange(2))}

        def npz_keys():
            return {"x_train": np.ones((4, 2)), "y_train": np.arange(4),
                    "x_test": np.ones((3, 2)), "y_test": np.arange(3)}

        def unbatched():
            import tensorflow as tf
            return tf.data.Dataset.from_tensor_slices(
                (np.arange(10, dtype="float32").reshape(5, 2), np.eye(5, 3))).prefetch(2)

        def batched():
            import tensorflow as tf
            return tf.data.Dataset.from_tensor_slices(
                (np.ones((7, 2), "float32"), np.arange(7))).batch(3).map(lambda x, y: (x * 2, y))

        def generated_batches():
            import tensorflow as tf
            def batches():
                for size in (3, 3, 1):
                    yield np.ones((size, 2), "float32"), np.zeros((size,), "int64")
            signature = (tf.TensorSpec((None, 2), tf.float32), tf.TensorSpec((None,), tf.int64))
            return tf.data.Dataset.from_generator(batches, output_signature=signature)

        def py_dataset():
            import keras

            class Batches(keras.utils.PyDataset):
                def __len__(self):
                    return 3

                def __getitem__(self, index):
                    return np.full((2, 2), index, "float32"), np.array([index, index])

            return Batches()
    """,
    "bad.py": """
        import numpy as np

        def raises():
            raise ValueError("broken\\nacross lines")

        def needs(n):
            return n

        def junk():
            return 5

        def bad_dict():
            return {"foo": (np.ones(2), np.ones(2))}

        def infinite():
            import tensorflow as tf
            return tf.data.Dataset.from_tensor_slices((np.ones((3, 2)), np.ones(3))).repeat()

        def endless():
            import tensorflow as tf
            def forever():
                while True:
                    yield np.ones(4, "float32"), 1
            signature = (tf.TensorSpec((4,), tf.float32), tf.TensorSpec((), tf.int32))
            return tf.data.Dataset.from_generator(forever, output_signature=signature)

        def endless_py_dataset():
            import keras

            class Forever(keras.utils.PyDataset):
                @property
                def num_batches(self):
                    return None

                def __getitem__(self, index):
                    return np.ones((2, 2)), np.ones(2)

            return Forever()

        def weighted():
            import tensorflow as tf
            return tf.data.Dataset.from_tensor_slices((np.ones((3, 2)), np.ones(3), np.ones(3)))

        not_a_function = 3
    """,
    "syntax.py": "x = 1\ndef load(:\n    pass\n",
    "import_raises.py": "import numpy as np\n\nraise RuntimeError('no data today')\n",
}


def py_file(tmp_path: Path, name: str) -> str:
    return write(tmp_path, name, PY_SOURCES[name])


# --- bad inputs: each a one-line error that names the problem ------------------------------

# (id, make(tmp_path) -> (source, keyword arguments), words the message must contain)
BAD_SOURCES = [
    ("npz pickled objects",
     lambda p: (npz(p, x_train=np.array([{}, 1], dtype=object), y_train=np.arange(2)), {}),
     ["'x_train' holds Python objects", "refused"]),
    ("npz keys missing",
     lambda p: (npz(p, a=np.ones(3), b=np.ones(3)), {}),
     ["expected arrays x_train and y_train", "Received keys: ['a', 'b']"]),
    ("npz half a pair",
     lambda p: (npz(p, **valid_arrays(x_val=np.ones((2, 3)))), {}),
     ["(y_val missing)", "Received keys: ['x_train', 'y_train', 'x_test', 'y_test', 'x_val']"]),
    ("npz over max_bytes",
     lambda p: (npz(p, **valid_arrays()), {"max_bytes": 100}),
     ["its arrays (inputs as float32, with room to split them) would take",
      "more than the 100 allowed"]),
    ("npz header and entry disagree",
     lambda p: (forged_npz(p), {}),
     ["'x_train' declares shape (1000000, 1000)", "cut or altered file"]),
    ("npz corrupt data",
     lambda p: (corrupt_npz(p), {}),
     ["not a readable .npz archive"]),
    ("npz not a zip",
     lambda p: (write(p, "fake.npz", "hello"), {}),
     ["not a .npz archive (5 bytes that are not a zip file)"]),
    ("npy file",
     lambda p: (npy(p), {}),
     ["a .npy file holds one array, not a dataset", "numpy.savez"]),
    ("npz lengths differ",
     lambda p: (npz(p, x=np.ones((5, 2)), y=np.ones(4)), {}),
     ["x and y of the train split differ in length: x has 5 samples but y has 4"]),
    ("npz empty",
     lambda p: (npz(p, x=np.ones((0, 2)), y=np.ones(0)), {}),
     ["the train split is empty"]),
    ("npz NaN in the validation inputs",
     lambda p: (npz(p, **valid_arrays(x_val=np.array([[0.0], [1], [np.nan], [np.nan]]),
                                      y_val=np.zeros(4), x_train=np.ones((3, 1)),
                                      y_train=np.zeros(3), x_test=None, y_test=None)), {}),
     ["non-finite inputs (NaN) in the val split, first at index 2"]),
    ("npz Inf in float labels",
     lambda p: (npz(p, x=np.ones((3, 1)), y=np.array([0.5, 1.0, -np.inf])), {}),
     ["non-finite labels (Inf) in the train split, first at index 2"]),
    ("npz complex inputs",
     lambda p: (npz(p, x=np.array([1 + 2j, 3j]), y=np.ones(2)), {}),
     ["x of the train split holds values of dtype complex128"]),
    ("npz scalar labels",
     lambda p: (npz(p, x=np.ones((2, 2)), y=np.float32(1)), {}),
     ["y of the train split is a single value"]),
    ("npz sample shapes differ across splits",
     lambda p: (npz(p, **valid_arrays(x_test=np.ones((5, 4)))), {}),
     ["the test split's samples have shape x (4,), y (), but the training split's have x (3,)"]),
    ("npz test class unknown to train",
     lambda p: (npz(p, **valid_arrays(y_train=np.array(["a", "b"] * 6),
                                      y_test=np.array(["a", "b", "c", "a", "b"]))), {}),
     ["label 'c' of the test split is not a class of the training split (2 classes)"]),
    ("csv without label",
     lambda p: (write(p, "d.csv", "a,b,c\n1,2,3\n"), {}),
     ["needs its label column named", "Columns: ['a', 'b', 'c']"]),
    ("csv label not a column",
     lambda p: (write(p, "d.csv", "a,b,c\n1,2,3\n"), {"label": "z"}),
     ["label column 'z' is not among the columns: ['a', 'b', 'c']"]),
    ("csv text feature",
     lambda p: (write(p, "d.csv", "a,color,y\n1,2,0\n3,red,1\n"), {"label": "y"}),
     ["non-numeric feature column 'color' (value 'red' at line 3)"]),
    ("csv missing value",
     lambda p: (write(p, "d.csv", "a,b,y\n1,2,0\n,4,1\n"), {"label": "y"}),
     ["missing value in feature column 'a' at line 3"]),
    ("csv missing label",
     lambda p: (write(p, "d.csv", "a,b,y\n1,2,0\n3,4,\n"), {"label": "y"}),
     ["missing label in column 'y' at line 3"]),
    ("csv ragged row",
     lambda p: (write(p, "d.csv", "a,b,y\n1,2,0\n3,4\n"), {"label": "y"}),
     ["line 3 has 2 values but the header has 3 columns"]),
    ("csv header only",
     lambda p: (write(p, "d.csv", "a,b,y\n"), {"label": "y"}),
     ["a header but no data rows"]),
    ("csv empty file",
     lambda p: (write(p, "d.csv", ""), {"label": "y"}),
     ["the file is empty"]),
    ("csv only the label column",
     lambda p: (write(p, "d.csv", "y\n1\n"), {"label": "y"}),
     ["no feature columns besides the label column 'y'"]),
    ("csv NaN feature",
     lambda p: (write(p, "d.csv", "a,y\n1,0\nnan,1\n"), {"label": "y"}),
     ["non-finite inputs (NaN) in the train split, first at index 1"]),
    ("csv Inf label",
     lambda p: (write(p, "d.csv", "a,y\n1,0.5\n2,inf\n"), {"label": "y"}),
     ["non-finite labels (Inf) in the train split, first at index 1"]),
    ("label for a non-CSV source",
     lambda p: (npz(p, **valid_arrays()), {"label": "y"}),
     ["label='y' names a CSV source's label column"]),
    ("folder without subfolders",
     lambda p: (str(p), {}),
     ["expected a folder of class subfolders", "has no subfolders"]),
    ("folder of other files",
     lambda p: (folder_of(p, "a/x.dat"), {}),
     ["expected a folder of class subfolders", "hold neither"]),
    ("folder mixing images and text",
     lambda p: (folder_of(image_folder(p / "d"), "cat/note.txt"), {}),
     ["mixes images (6) and text files (1)"]),
    ("missing path",
     lambda p: (str(p / "nothing.npz"), {}),
     ["no such file or folder"]),
    ("misspelt dataset name",
     lambda p: ("mnsit", {}),
     ["no such file or folder", "not a built-in dataset either", "mnist"]),
    ("unknown suffix",
     lambda p: (write(p, "d.json", "{}"), {}),
     ["Received a .json file"]),
    ("empty source",
     lambda p: ("", {}),
     ["expected a .npz or .csv file, a folder, tfds:NAME or FILE.py:FUNCTION"]),
    ("python file without function",
     lambda p: (py_file(p, "ok.py"), {}),
     ["a Python source names its function: FILE.py:FUNCTION"]),
    ("python file missing",
     lambda p: (f"{p}/absent.py:load", {}),
     ["Python file", "absent.py", "not found"]),
    ("python syntax error",
     lambda p: (py_file(p, "syntax.py") + ":load", {}),
     ["syntax error at syntax.py:2"]),
    ("python import raises",
     lambda p: (py_file(p, "import_raises.py") + ":load", {}),
     ["importing import_raises.py raised RuntimeError: no data today (at import_raises.py:3)"]),
    ("python function missing",
     lambda p: (py_file(p, "bad.py") + ":nope", {}),
     ["'nope' is not defined in bad.py. Functions there: ['bad_dict', 'endless',"]),
    ("python name not a function",
     lambda p: (py_file(p, "bad.py") + ":not_a_function", {}),
     ["'not_a_function' is not a function in bad.py"]),
    ("python function raises",
     lambda p: (py_file(p, "bad.py") + ":raises", {}),
     ["bad.py:raises() raised ValueError: broken across lines (at bad.py:4)"]),
    ("python function needs arguments",
     lambda p: (py_file(p, "bad.py") + ":needs", {}),
     ["bad.py:needs needs arguments ['n']"]),
    ("python function returns junk",
     lambda p: (py_file(p, "bad.py") + ":junk", {}),
     ["the train split is a builtins.int: expected (x, y) arrays, a tf.data.Dataset"]),
    ("python function returns unknown splits",
     lambda p: (py_file(p, "bad.py") + ":bad_dict", {}),
     ["a dict of splits needs 'train'", "Received keys: ['foo']"]),
    ("infinite tf.data",
     lambda p: (py_file(p, "bad.py") + ":infinite", {}),
     ["the train dataset is infinite"]),
    ("endless generator",
     lambda p: (py_file(p, "bad.py") + ":endless", {"max_bytes": 10_000}),
     ["the train dataset (or it is infinite) would take", "more than the 10,000 allowed"]),
    ("infinite PyDataset",
     lambda p: (py_file(p, "bad.py") + ":endless_py_dataset", {}),
     ["the train PyDataset is infinite (num_batches is None)"]),
    ("sample weights",
     lambda p: (py_file(p, "bad.py") + ":weighted", {}),
     ["elements are tuples of 3 (x, y, sample_weight", "expected (x, y) pairs"]),
    ("tfds without a name",
     lambda p: ("tfds:", {}),
     ["expected tfds:NAME or tfds:NAME:CONFIG"]),
]


@pytest.mark.parametrize(("make", "expected"), [case[1:] for case in BAD_SOURCES],
                         ids=[case[0] for case in BAD_SOURCES])
def test_a_bad_source_is_one_line_naming_the_problem(tmp_path, make, expected):
    source, options = make(tmp_path)
    with pytest.raises(DataError) as raised:
        load_source(source, **options)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("Invalid data source ")
    for words in expected:
        assert words in message


def test_an_oversized_npz_is_refused_from_its_headers_alone(tmp_path, monkeypatch):
    """The size check reads only the .npy headers: no array is loaded before the refusal."""
    source = npz(tmp_path, x=np.ones((1000, 100)), y=np.ones(1000))

    def no_loading(*args, **kwargs):
        raise AssertionError("an array was read before the size check")

    monkeypatch.setattr(np, "load", no_loading)
    monkeypatch.setattr("kbackend.data.user.npz._read_member", no_loading)
    # held: x as float32 (400,000 bytes) and y (8,000), x 1.5 for the split: 612,000 bytes
    with pytest.raises(DataError, match=r"612,000 bytes in memory, more than the 611,999"):
        load_source(source, max_bytes=611_999)


# --- each kind of source on generated data ---------------------------------------------------


def test_npz_with_all_three_splits(tmp_path):
    arrays = valid_arrays(x_val=np.ones((4, 3), np.uint8), y_val=np.eye(4, 3))
    arrays["y_train"], arrays["y_test"] = np.eye(12, 3), np.eye(5, 3)  # one-hot labels kept
    data = load_source(npz(tmp_path, "train.npz", **arrays))
    assert isinstance(data, UserData)
    assert (data.name, data.kind, data.class_names) == ("train.npz", "arrays", None)
    assert data.source == str(tmp_path / "train.npz")
    assert list(data.splits) == ["train", "val", "test"]
    for split, key in (("train", "train"), ("val", "val"), ("test", "test")):
        np.testing.assert_array_equal(data.splits[split][0], arrays[f"x_{key}"])
        np.testing.assert_array_equal(data.splits[split][1], arrays[f"y_{key}"])
    # numeric inputs are read as float32, what training takes (converted while reading);
    # labels keep their dtype
    assert data.splits["val"][0].dtype == np.float32
    assert data.splits["val"][1].dtype == arrays["y_val"].dtype


def test_npz_with_x_and_y_and_string_labels(tmp_path):
    y = np.array(["dog", "cat", "dog", "bird"])
    data = load_source(npz(tmp_path, x=np.ones((4, 2, 2)), y=y))
    assert list(data.splits) == ["train"]
    assert data.class_names == ("bird", "cat", "dog")
    np.testing.assert_array_equal(data.splits["train"][1], [2, 1, 2, 0])


@pytest.mark.parametrize(("labels", "dtype", "class_names"), [
    (["0", "1", "2.0"], np.int32, None),
    (["0.5", "1", "2"], np.float32, None),
    (["setosa", "virginica", "setosa"], np.int32, ("setosa", "virginica")),
])
def test_csv_features_and_labels(tmp_path, labels, dtype, class_names):
    rows = "".join(f"{i};{i * 0.5};{label}\n" for i, label in enumerate(labels))
    source = write(tmp_path, "diabetes.csv", "age;bmi;target\n" + rows + "\n")
    data = load_source(source, label="target")
    x, y = data.splits["train"]
    assert (data.name, data.kind, data.class_names) == ("diabetes.csv", "csv", class_names)
    assert x.dtype == np.float32 and x.shape == (3, 2)
    np.testing.assert_allclose(x[:, 1], [0.0, 0.5, 1.0])
    assert y.dtype == dtype
    if class_names:
        np.testing.assert_array_equal(y, [0, 1, 0])
    else:
        np.testing.assert_allclose(y, [float(label) for label in labels])


def test_image_folder(tmp_path):
    folder = image_folder(tmp_path / "pets", classes=("cat", "dog"), per_class=3, size=(8, 6))
    data = load_source(str(folder), seed=1)
    x, y = data.splits["train"]
    assert (data.name, data.kind, data.class_names) == ("pets", "images", ("cat", "dog"))
    assert x.shape == (6, 8, 6, 3) and x.dtype == np.float32
    assert x.min() >= 0 and x.max() <= 255 and x.max() > 1
    assert sorted(y.tolist()) == [0, 0, 0, 1, 1, 1]
    assert any("8x6" in note for note in data.notes)


def test_image_folder_with_split_folders_grayscale_and_a_given_size(tmp_path):
    root = tmp_path / "digits"
    image_folder(root / "train", classes=("0", "1"), per_class=2, size=(5, 5), channels=1)
    image_folder(root / "test", classes=("0", "1"), per_class=1, size=(7, 7), channels=1)
    data = load_source(str(root), image_size=(4, 3))
    assert list(data.splits) == ["train", "test"]
    assert data.splits["train"][0].shape == (4, 4, 3, 1)
    assert data.splits["test"][0].shape == (2, 4, 3, 1)
    assert data.class_names == ("0", "1")


def test_split_folders_must_share_classes(tmp_path):
    root = tmp_path / "pets"
    image_folder(root / "train", classes=("cat", "dog"), per_class=1)
    image_folder(root / "val", classes=("cat", "cow"), per_class=1)
    with pytest.raises(DataError, match=r"the val folder's classes \['cat', 'cow'\] differ"):
        load_source(str(root))


def test_text_folder_is_vectorized_on_the_training_split(tmp_path):
    root = tmp_path / "reviews"
    text_folder(root / "train", {"neg": ["bad awful movie", "awful plot"],
                                 "pos": ["great movie", "great fun, great cast"]})
    text_folder(root / "validation", {"neg": ["unseenword awful"], "pos": ["great"]})
    data = load_source(str(root))
    assert (data.kind, data.class_names) == ("text", ("neg", "pos"))
    assert list(data.splits) == ["train", "val"]
    x, y = data.splits["train"]
    assert x.dtype == np.int32 and x.shape == (4, TEXT_SEQUENCE_LENGTH)
    assert sorted(y.tolist()) == [0, 0, 1, 1]
    x_val, y_val = data.splits["val"]
    unseen = x_val[list(y_val).index(0)]
    assert unseen[0] == 1 and unseen[1] > 1  # a word only in validation is out of vocabulary
    assert any(note.startswith("text vectorized on the host") for note in data.notes)


@pytest.mark.parametrize(("function", "shapes"), [
    ("arrays", {"train": ((4, 2), (4,))}),
    ("splits", {"train": ((4, 2), (4,)), "val": ((2, 2), (2,))}),
    ("npz_keys", {"train": ((4, 2), (4,)), "test": ((3, 2), (3,))}),
    ("unbatched", {"train": ((5, 2), (5, 3))}),
    ("batched", {"train": ((7, 2), (7,))}),
    ("generated_batches", {"train": ((7, 2), (7,))}),
    ("py_dataset", {"train": ((6, 2), (6,))}),
])
def test_python_function_sources(tmp_path, function, shapes):
    data = load_source(py_file(tmp_path, "ok.py") + f":{function}")
    assert (data.name, data.kind) == (f"ok.py:{function}", "function")
    assert {split: (x.shape, y.shape) for split, (x, y) in data.splits.items()} == shapes


def test_python_function_values_are_read_in_order(tmp_path):
    data = load_source(py_file(tmp_path, "ok.py") + ":unbatched")
    x, y = data.splits["train"]
    np.testing.assert_array_equal(x, np.arange(10, dtype=np.float32).reshape(5, 2))
    np.testing.assert_array_equal(y, np.eye(5, 3))
    batched = load_source(py_file(tmp_path, "ok.py") + ":batched").splits["train"]
    np.testing.assert_array_equal(batched[0], np.full((7, 2), 2.0))
    np.testing.assert_array_equal(batched[1], np.arange(7))


# --- from_python -----------------------------------------------------------------------------


def test_from_python_arrays_with_validation_data():
    x, y = RNG.random((10, 3)), np.arange(10) % 2
    data = from_python(x, y, validation_data=(x[:3], y[:3]), name="mine")
    assert (data.name, data.kind, list(data.splits)) == ("mine", "arrays", ["train", "val"])
    assert data.splits["train"][0] is not None and data.splits["val"][0].shape == (3, 3)


def test_from_python_tf_data_batched_and_not():
    tf = tensorflow()
    x, y = np.arange(12, dtype=np.float32).reshape(6, 2), np.arange(6)
    slices = tf.data.Dataset.from_tensor_slices((x, y))
    for dataset in (slices, slices.batch(4), slices.batch(2).unbatch()):
        train = from_python(dataset, validation_data=slices.batch(5)).splits
        np.testing.assert_array_equal(train["train"][0], x)
        np.testing.assert_array_equal(train["val"][1], y)


@pytest.mark.parametrize(("args", "kwargs", "expected"), [
    (((np.ones((3, 2)), np.ones(2)),), {}, "x and y of the train split differ in length"),
    ((np.ones((3, 2)), np.ones(3)), {"validation_data": np.ones(3)},
     "the val split is a numpy.ndarray"),
    (({"train": (np.ones((2, 1)), np.ones(2))}, np.ones(2)), {},
     "holds its own labels: pass y=None"),
    ((np.array([[1.0], [np.nan]]), np.ones(2)), {}, "non-finite inputs (NaN) in the train split"),
])
def test_from_python_bad_inputs(args, kwargs, expected):
    with pytest.raises(DataError) as raised:
        from_python(*args, **kwargs)
    assert expected in str(raised.value) and str(raised.value).startswith("Invalid data 'arrays'")


# --- TFDS ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    """A data folder holding a tiny prepared TFDS set, built offline from a builder here."""
    tfds = pytest.importorskip("tensorflow_datasets")

    class KbackendTinySet(tfds.core.GeneratorBasedBuilder):
        # A one-part module name: TFDS looks for the code of a builder in a package with
        # importlib_resources, which it does not declare.
        __module__ = "kbackend_tiny_set_builder"
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            features = tfds.features.FeaturesDict({
                "features": tfds.features.Tensor(shape=(4,), dtype=np.float32),
                "label": tfds.features.ClassLabel(names=["low", "mid", "high"])})
            return tfds.core.DatasetInfo(builder=self, features=features,
                                         supervised_keys=("features", "label"))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(9), "test": self._generate_examples(4)}

        def _generate_examples(self, count):
            for index in range(count):
                yield index, {"features": np.full(4, index, np.float32), "label": index % 3}

    class KbackendTinyText(tfds.core.GeneratorBasedBuilder):
        __module__ = "kbackend_tiny_text_builder"
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            features = tfds.features.FeaturesDict({
                "text": tfds.features.Text(), "label": tfds.features.ClassLabel(num_classes=2)})
            return tfds.core.DatasetInfo(builder=self, features=features,
                                         supervised_keys=("text", "label"))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(["good film", "bad film", "good"]),
                    "validation": self._generate_examples(["unseen film"]),
                    "extra": self._generate_examples(["more"])}

        def _generate_examples(self, texts):
            for index, text in enumerate(texts):
                yield index, {"text": text, "label": int(text.startswith("good"))}

    root = tmp_path_factory.mktemp("tfds")
    config = tfds.download.DownloadConfig(try_download_gcs=False)
    for builder in (KbackendTinySet, KbackendTinyText):
        builder(data_dir=str(root)).download_and_prepare(download_config=config)
    return root


def test_strings_load_raw_for_a_string_front_and_are_vectorized_otherwise(tmp_path):
    """Texts in an .npz: kept as strings with ``raw_text`` (the model's own string front takes
    them), else token ids from kbackend's built-in TextVectorization, said in a note."""
    path = tmp_path / "texts.npz"
    np.savez(path, x=np.array(["good film", "bad film", "good cast"]), y=np.array([1, 0, 1]))
    raw = load_source(str(path), raw_text=True)
    assert raw.splits["train"][0].tolist() == ["good film", "bad film", "good cast"]
    ids = load_source(str(path))
    assert ids.splits["train"][0].shape == (3, TEXT_SEQUENCE_LENGTH)
    assert any("kbackend's TextVectorization" in note for note in ids.notes)


def test_tfds_prepared_folder(tfds_dir, monkeypatch):
    monkeypatch.setenv("TFDS_DATA_DIR", str(tfds_dir))
    data = load_source(f"tfds:{TFDS_NAME}")
    assert (data.name, data.kind, data.class_names) == (f"tfds:{TFDS_NAME}", "tfds",
                                                        ("low", "mid", "high"))
    assert list(data.splits) == ["train", "test"]
    x, y = data.splits["train"]
    assert x.shape == (9, 4) and x.dtype == np.float32
    np.testing.assert_array_equal(np.sort(x[:, 0]), np.arange(9))
    np.testing.assert_array_equal(y, x[:, 0].astype(int) % 3)


def test_tfds_text_is_vectorized_and_other_splits_are_noted(tfds_dir, monkeypatch):
    monkeypatch.setenv("TFDS_DATA_DIR", str(tfds_dir))
    data = load_source("tfds:kbackend_tiny_text")
    assert list(data.splits) == ["train", "val"]
    x, y = data.splits["train"]
    assert x.dtype == np.int32 and x.shape == (3, TEXT_SEQUENCE_LENGTH)
    assert sorted(y.tolist()) == [0, 1, 1]
    assert data.splits["val"][0][0, 0] == 1  # "unseen": out of the training vocabulary
    assert "TFDS splits not read: extra" in data.notes
    assert any(note.startswith("text vectorized on the host") for note in data.notes)


def test_tfds_set_not_prepared_names_the_folder(tmp_path, monkeypatch):
    pytest.importorskip("tensorflow_datasets")
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path))
    with pytest.raises(DataError) as raised:
        load_source("tfds:mnist:3")
    message = str(raised.value)
    assert "TFDS dataset 'mnist:3' is not prepared in" in message
    assert str(tmp_path / "mnist" / "3") in message and "nothing is downloaded" in message


def test_tfds_not_installed_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # import fails
    with pytest.raises(DataError, match=r"pip install tensorflow-datasets"):
        load_source("tfds:mnist")


def test_the_held_out_splits_and_a_folders_order_do_not_follow_the_run_seed(tmp_path):
    # `kbackend train --seed S` must train on what the study's seed S trained on: the study
    # reads the data once, so the draws of held-out splits cannot depend on the seed.
    from kbackend.workload import prepare_workload

    rows = "\n".join(f"{i % 7},{(i * 3) % 11},{i % 3}" for i in range(120))
    table = write(tmp_path, "t.csv", "a,b,y\n" + rows + "\n")
    folder = str(image_folder(tmp_path / "pets", per_class=12, size=(4, 4)))
    for source, label in ((table, "y"), (folder, None)):
        first, other = (prepare_workload("seed_mlp", source, label=label, seed=seed).dataset
                        for seed in (0, 3))
        for split in ("train", "val", "test"):
            for a, b in zip(first.split(split), other.split(split), strict=True):
                np.testing.assert_array_equal(a, b, err_msg=f"{source} {split}")


@pytest.mark.parametrize("announced", [None, 10, 7, 13])
def test_shuffled_reading_gives_the_fixed_order_whatever_rows_were_announced(announced):
    # images are written straight to their shuffled places; a count not as announced (or none)
    # falls back to gathering, and must end in the same order
    from kbackend.data.user.common import Where
    from kbackend.data.user.datasets import _Batches, fixed_order

    x, y = np.arange(20.0).reshape(10, 2), np.arange(10)
    batches = _Batches(Where("data 't'"), "train", announced, shuffle_seed=5)
    for start in range(0, 10, 3):
        batches.add(x[start:start + 3], y[start:start + 3])
    got_x, got_y = batches.arrays()
    order = fixed_order(10, 5)
    np.testing.assert_array_equal(got_x, x[order])
    np.testing.assert_array_equal(got_y, y[order])
