"""Datasets: shapes, dtypes, classes, deterministic splits, bad data, missing files."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from kbackend import data
from kbackend.data import batching, sources
from kbackend.errors import DataError

EMBEDDED = {  # name -> (flat input shape, sequence shape, image shape or None)
    "digits": ((64,), (8, 8), (8, 8, 1)),
    "mnist1d": ((40,), (40, 1), None),
    "mnist1d_large": ((40,), (40, 1), None),
    "synthetic": ((784,), (784, 1), None),
}


@pytest.mark.parametrize("name", sorted(EMBEDDED))
def test_embedded_datasets_load_with_documented_shapes(name):
    flat, sequence, image = EMBEDDED[name]
    ds = data.load(name)
    assert ds.info.input_shape == flat and ds.x_train.shape[1:] == flat
    assert ds.info.num_classes == 10
    for split in ("train", "val", "test"):
        x, y = ds.split(split)
        assert x.dtype == np.float32 and y.dtype == np.int32
        assert len(x) == len(y) > 0
        assert y.min() >= 0 and y.max() < 10
    assert ds.info.num_train + ds.info.num_val == {"digits": 1438, "mnist1d": 4000,
                                                "mnist1d_large": 12000, "synthetic": 8192}[name]
    assert data.load(name, layout="sequence").x_train.shape[1:] == sequence
    if image is None:
        with pytest.raises(DataError, match="not images"):
            data.load(name, layout="image")
    else:
        assert data.load(name, layout="image").x_train.shape[1:] == image


def test_digits_is_scaled_to_unit_range():
    ds = data.load("digits")
    assert ds.x_train.min() >= 0.0 and ds.x_train.max() == pytest.approx(1.0)


def test_channels_first_is_a_transpose_of_channels_last():
    last = data.load("digits", layout="image", data_format="channels_last")
    first = data.load("digits", layout="image", data_format="channels_first")
    assert first.x_train.shape[1:] == (1, 8, 8) and first.info.data_format == "channels_first"
    np.testing.assert_array_equal(np.transpose(last.x_train, (0, 3, 1, 2)), first.x_train)


def test_validation_split_is_deterministic_for_a_seed():
    a, b, c = data.load("digits", seed=3), data.load("digits", seed=3), data.load("digits", seed=4)
    np.testing.assert_array_equal(a.x_val, b.x_val)
    np.testing.assert_array_equal(a.y_train, b.y_train)
    assert not np.array_equal(a.x_val, c.x_val)
    np.testing.assert_array_equal(a.x_test, c.x_test)  # test data never depends on the seed


def test_validation_is_held_out_of_train():
    ds = data.load("digits", validation_fraction=0.25)
    assert ds.info.num_val == round(1438 * 0.25)
    train_rows = {row.tobytes() for row in ds.x_train}
    overlap = sum(row.tobytes() in train_rows for row in ds.x_val)
    assert overlap <= 2  # digits holds a few exact duplicate images; no sample is in both splits


def test_mnist1d_is_cached_after_first_generation(tmp_path, monkeypatch):
    monkeypatch.setenv("KBACKEND_CACHE_DIR", str(tmp_path))
    first = data.load("mnist1d")
    cached = list(tmp_path.glob("mnist1d-*.npz"))
    assert len(cached) == 1
    assert "cached at" in first.info.source
    import mnist1d.data

    monkeypatch.setattr(mnist1d.data, "make_dataset", lambda *a, **k: pytest.fail("regenerated"))
    second = data.load("mnist1d")
    np.testing.assert_array_equal(first.x_train, second.x_train)


def test_mnist1d_is_generated_value_for_value_as_the_package_does():
    """kbackend generates MNIST-1D with a faster interpolation than the package's (the default
    study's data is generated on a fresh machine): the arrays must be the package's, bit for bit
    (the reproductions compare against upstream's data)."""
    from mnist1d.data import get_dataset_args, make_dataset

    from kbackend.data import sources

    args = get_dataset_args()
    args.num_samples = 300
    upstream = make_dataset(args)
    with sources._fast_mnist1d_interpolation():
        ours = make_dataset(args)
    for key in ("x", "y", "x_test", "y_test", "t"):
        np.testing.assert_array_equal(ours[key], upstream[key])
    transform = sys.modules["mnist1d.transform"]
    assert transform.interpolate is not sources.mnist1d_interpolate  # put back afterwards
    signal = np.random.default_rng(0).normal(size=37)
    np.testing.assert_array_equal(sources.mnist1d_interpolate(signal, 60),
                                  transform.interpolate(signal, 60))


def test_the_default_studys_data_resolves_accuracy_to_a_tenth_of_a_percent():
    """mnist1d_large: more sequences from the paper's generator, cached apart from mnist1d."""
    large, paper = data.load("mnist1d_large"), data.load("mnist1d")
    assert (large.info.num_train, large.info.num_val, large.info.num_test) == (10800, 1200, 3000)
    assert 1 / large.info.num_val < 0.001
    assert large.info.source != paper.info.source  # its own cache file
    # The same generator: every class present in proportion, sequences of the same scale.
    counts = np.bincount(large.y_val, minlength=10)
    assert counts.min() > 0.6 * counts.mean()
    assert abs(float(large.x_train.std()) - float(paper.x_train.std())) < 0.1


def test_synthetic_accepts_shape_and_classes():
    ds = data.load("synthetic", layout="image",
                   synthetic={"input_shape": (6, 5, 3), "num_classes": 4, "num_train": 100,
                              "num_test": 20})
    assert ds.x_train.shape[1:] == (6, 5, 3) and ds.info.num_classes == 4
    assert set(np.unique(ds.y_train)) <= {0, 1, 2, 3}


@pytest.mark.mnist
@pytest.mark.parametrize("name", ["mnist", "fashion_mnist"])
def test_real_datasets_load(name, data_dir):
    ds = data.load(name, data_dir=data_dir)
    assert ds.info.input_shape == (784,)
    assert ds.info.num_train + ds.info.num_val == 60000 and ds.info.num_test == 10000
    assert ds.x_train.dtype == np.float32 and ds.x_train.min() >= 0.0 and ds.x_train.max() <= 1.0
    img = data.load(name, data_dir=data_dir, layout="image", data_format="channels_first")
    assert img.x_test.shape == (10000, 1, 28, 28)
    if name == "mnist":
        raw = sources.load_mnist(data_dir)
        assert list(raw.y_train[:10]) == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]


def test_data_dir_env_is_searched(data_dir, monkeypatch):
    monkeypatch.setenv("KBACKEND_DATA_DIR", str(data_dir))
    assert data.load("mnist").info.source.endswith("mnist.npz")


def test_missing_mnist_names_places_tried_and_alternatives(tmp_path, monkeypatch):
    monkeypatch.delenv("KBACKEND_DATA_DIR", raising=False)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
    monkeypatch.setenv("KBACKEND_OFFLINE", "1")
    with pytest.raises(DataError) as error:
        data.load("mnist", data_dir=tmp_path / "empty")
    message = str(error.value)
    assert "\n" not in message
    assert "--data-dir" in message and str(tmp_path / "empty") in message
    assert "Keras cache" in message and "digits" in message and "mnist1d" in message


def test_unknown_dataset_lists_choices():
    with pytest.raises(DataError, match=r"Expected one of .*digits.*Received: 'cifar'"):
        data.load("cifar")


def _arrays(n=20, classes=3):
    rng = np.random.default_rng(0)
    return rng.random((n, 4), dtype=np.float32), rng.integers(0, classes, n)


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda x, y: (x, np.where(np.arange(len(y)) == 5, 3, y)), r"Invalid label 3 .*\[0, 3\)"),
    (lambda x, y: (x, np.where(np.arange(len(y)) == 5, -1, y)), r"Invalid label -1"),
    (lambda x, y: (np.where(np.arange(len(x))[:, None] == 7, np.nan, x), y), r"NaN.*index 7"),
    (lambda x, y: (np.where(np.arange(len(x))[:, None] == 2, np.inf, x), y), r"Inf.*index 2"),
    (lambda x, y: (x[:-1], y), r"Mismatched lengths .*19 .*20"),
    (lambda x, y: (x[:0], y[:0]), r"Empty train split"),
    (lambda x, y: (x, y + 0.5), r"integer class indices"),
])
def test_bad_data_raises_before_training(mutate, message):
    x, y = mutate(*_arrays())
    with pytest.raises(DataError, match=message):
        data.from_arrays("bad", x, y, *_arrays(), num_classes=3)


def test_batch_size_larger_than_train_split():
    with pytest.raises(DataError, match="larger than the training split"):
        data.check_batch_size(2000, 1294)
    with pytest.raises(DataError, match="positive integer"):
        data.check_batch_size(0, 10)


@pytest.mark.parametrize(("n", "chunk", "shape"), [
    (1200, 1024, (2, 600)), (1000, 1024, (1, 1000)), (6000, 1024, (6, 1000)),
    (1025, 1024, (2, 513)), (7, 3, (3, 3)), (1, 1024, (1, 1))])
def test_evaluation_chunks_are_even_and_keep_every_sample_once(n, chunk, shape):
    x = np.arange(n, dtype=np.float32)[:, None]
    y = np.arange(n, dtype=np.int32)
    xs, ys, mask = batching.pad_to_chunks(x, y, chunk)
    assert xs.shape[:2] == ys.shape == mask.shape == shape
    assert shape[1] <= chunk and mask.size - n < shape[0]  # fewer padded rows than chunks
    kept = mask.reshape(-1) == 1
    assert int(kept.sum()) == n
    np.testing.assert_array_equal(ys.reshape(-1)[kept], y)
    np.testing.assert_array_equal(xs.reshape(-1)[kept], x[:, 0])
