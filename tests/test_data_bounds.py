"""Memory and size bounds of a user's data, checked before it is read (issue 45): image sizes
from the headers (PIL's lazy open, or the PNG / JPEG / GIF / BMP header parsed without PIL),
the pixel cap unless ``--image-size``, n x H x W x C against the memory cap, and an ``.npz``
whose declared arrays cannot fit in memory once loaded."""

from __future__ import annotations

import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from kbackend.data import user
from kbackend.data.user import image_header, load_source, parse_image_size
from kbackend.errors import DataError
from tests.conftest import one_line_error


def png_bytes(height: int, width: int, gray: bool = False, body: bytes | None = None) -> bytes:
    """A PNG whose header declares ``height`` x ``width``; its pixels real only when small."""
    color = 0 if gray else 2
    header = struct.pack(">IIBBBBB", width, height, 8, color, 0, 0, 0)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    if body is None:
        row = b"\x00" + b"\x80" * (width * (1 if gray else 3))
        body = zlib.compress(row * height) if height * width <= 10_000 else b"x\x9c"
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body)
            + chunk(b"IEND", b""))


def jpeg_header(height: int, width: int, components: int = 3) -> bytes:
    """The start of a JPEG: SOI, an APP0 segment, then a baseline start-of-frame."""
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 8 + 3 * components, 8, height, width, components)
    return b"\xff\xd8" + app0 + sof + b"\x01\x11\x00" * components + b"\xff\xd9"


def folder_with(root: Path, first: bytes, others: int = 3, size=(6, 5)) -> Path:
    """Class folders a/ and b/ of small PNGs, ``first`` as a/0.png (sorted first)."""
    for name in ("a", "b"):
        (root / name).mkdir(parents=True)
        for index in range(others):
            (root / name / f"{index + 1}.png").write_bytes(png_bytes(*size))
    (root / "a" / "0.png").write_bytes(first)
    return root


@pytest.fixture(params=["pil", "headers"])
def reader(request, monkeypatch):
    """Each test runs with PIL's lazy open and with the header parser used without PIL."""
    if request.param == "headers":
        monkeypatch.setitem(sys.modules, "PIL", None)  # import PIL raises ImportError
    return request.param


@pytest.mark.parametrize(("data", "expected"), [
    (png_bytes(6000, 6000), (6000, 6000, False)),
    (png_bytes(7, 3, gray=True), (7, 3, True)),
    (jpeg_header(4000, 5000), (4000, 5000, False)),
    (jpeg_header(30, 20, components=1), (30, 20, True)),
    (b"GIF89a" + struct.pack("<HH", 640, 480) + b"\x00" * 20, (480, 640, False)),
    (b"BM" + b"\x00" * 16 + struct.pack("<ii", 300, -200) + b"\x00" * 30, (200, 300, False)),
    (b"not an image at all" * 3, None),
])
def test_image_sizes_come_from_the_header(tmp_path, reader, data, expected):
    path = tmp_path / "image"
    path.write_bytes(data)
    found = image_header(path)
    if reader == "pil" and data.startswith((b"GIF", b"BM")):
        assert found is None or found[:2] == expected[:2]  # PIL wants the rest of these headers
    else:
        assert found == expected


def test_a_huge_first_image_is_refused_from_its_header_in_one_line(tmp_path, reader, cli,
                                                                   engines_never_run):
    folder = folder_with(tmp_path / "pets", png_bytes(6000, 6000))
    before = sorted((p, p.read_bytes()) for p in folder.rglob("*.png"))
    with pytest.raises(DataError, match=r"0\.png' is 6000x6000 pixels, more than the "
                                        r"16,777,216 read unless --image-size"):
        load_source(str(folder))
    result = cli("train", "--data", folder, "--model", "seed_mlp", "--epochs", "1")
    assert result.returncode == 2 and one_line_error(result.stderr)
    assert "--image-size" in result.stderr and "Traceback" not in result.stderr
    assert sorted((p, p.read_bytes()) for p in folder.rglob("*.png")) == before


def test_a_huge_later_image_is_refused_too(tmp_path, reader):
    folder = folder_with(tmp_path / "pets", png_bytes(6, 5))
    (folder / "b" / "9.png").write_bytes(png_bytes(5000, 5000))
    with pytest.raises(DataError, match=r"9\.png' is 5000x5000 pixels"):
        load_source(str(folder))


def test_images_over_the_memory_cap_are_refused_before_decoding(tmp_path, reader, monkeypatch):
    def no_decoding(*args, **kwargs):
        raise AssertionError("an image was decoded before the memory check")

    folder = folder_with(tmp_path / "pets", png_bytes(6, 5), others=4)
    monkeypatch.setattr(user.folder, "import_keras", no_decoding)
    # 9 images x 6 x 5 x 3 float32 = 3,240 bytes
    with pytest.raises(DataError, match=r"9 images of 6x5x3 float32 would take 3,240 bytes"):
        load_source(str(folder), max_bytes=3_239)
    with pytest.raises(DataError, match=r"9 images of 100x100x3 float32"):
        load_source(str(folder), max_bytes=100_000, image_size=(100, 100))


@pytest.mark.slow  # reads the folder with TensorFlow
def test_image_size_lifts_the_pixel_cap(tmp_path, monkeypatch):
    from PIL import Image

    monkeypatch.setattr(user.folder, "MAX_IMAGE_PIXELS", 99)  # a 10x10 image is over it
    folder = folder_with(tmp_path / "pets", png_bytes(6, 5))
    Image.new("RGB", (10, 10), (10, 20, 30)).save(folder / "a" / "0.png")
    with pytest.raises(DataError, match="is 10x10 pixels, more than the 99 read unless"):
        load_source(str(folder))
    data = load_source(str(folder), image_size=(6, 5))
    assert data.splits["train"][0].shape == (7, 6, 5, 3)
    assert any("6x5 (given size)" in note for note in data.notes)


def test_an_unreadable_image_header_is_one_line(tmp_path, reader):
    folder = folder_with(tmp_path / "pets", b"\x89PNG broken")
    with pytest.raises(DataError, match=r"0\.png' has no readable PNG, JPEG, GIF or BMP header"):
        load_source(str(folder))


@pytest.mark.parametrize(("text", "size"), [("64x48", (64, 48)), ("32", (32, 32)),
                                            ("10,20", (10, 20))])
def test_image_size_parses(text, size):
    assert parse_image_size(text) == size


@pytest.mark.parametrize("text", ["0x4", "axb", "1x2x3", "70000x2", "", "-3x4"])
def test_a_bad_image_size_is_one_line(text, cli):
    result = cli("train", "--image-size", text)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "--image-size" in result.stderr


# --- loading costs: refusals before reading, splits in place, the same arrays ----------------


def declared_npz(path: Path, declared: int) -> Path:
    """An .npz whose x declares ``declared`` bytes of float32 zeros (deflated: a small file)."""
    import zipfile

    header = np.lib.format.header_data_from_array_1_0(np.zeros((1, 1), np.float32))
    header["shape"] = (declared // 16, 4)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        with archive.open("x.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array_header_1_0(member, header)
            for _ in range(declared // 2**20):
                member.write(bytes(2**20))
        with archive.open("y.npy", "w") as member:
            np.lib.format.write_array(member, np.zeros(declared // 16, np.int8))
    return path


def test_an_npz_declaring_more_than_fits_is_refused_before_reading(tmp_path, monkeypatch,
                                                                    cli, engines_never_run):
    path = declared_npz(tmp_path / "big.npz", 8 * 2**20)
    assert path.stat().st_size < 100_000  # 8 MiB declared in a small file

    def no_reading(*args, **kwargs):
        raise AssertionError("an array was read before the size check")

    monkeypatch.setattr(user.npz, "_read_member", no_reading)
    with pytest.raises(DataError, match=r"its arrays \(inputs as float32, with room to split "
                                        r"them\) would take 13,369,344 bytes"):
        load_source(str(path), max_bytes=8 * 2**20)
    monkeypatch.setattr(user.common, "default_max_bytes", lambda: 2**20)  # "free memory": 1 MiB
    before = path.read_bytes()
    result = cli("train", "--data", path, "--model", "seed_mlp", "--epochs", "1")
    assert result.returncode == 2 and one_line_error(result.stderr)
    assert "13,369,344 bytes" in result.stderr and path.read_bytes() == before


def test_float64_npz_inputs_become_float32_while_read_and_beyond_range_is_refused(tmp_path):
    x = np.random.default_rng(0).standard_normal((300, 5))
    np.savez(tmp_path / "ok.npz", x=x, y=np.arange(300) % 3)
    data = load_source(str(tmp_path / "ok.npz"))
    assert data.owned and data.splits["train"][0].dtype == np.float32
    np.testing.assert_array_equal(data.splits["train"][0], x.astype(np.float32))
    x[123, 2] = -1e300
    np.savez(tmp_path / "bad.npz", x=x, y=np.arange(300) % 3)
    with pytest.raises(DataError, match=r"inputs beyond float32's range in the train split "
                                        r"\(largest magnitude 1e\+300\)"):
        load_source(str(tmp_path / "bad.npz"))


def test_a_csv_whose_values_cannot_fit_is_refused_before_parsing(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("a,b,label\n" + "1,2,0\n" * 1000)
    with pytest.raises(DataError, match=r"its values would take 20,040 bytes in memory, more "
                                        r"than the 20,000 allowed"):
        # 1,002 lines (newlines + 1) x (2 features x 4 + 12)
        load_source(str(path), label="label", max_bytes=20_000)


@pytest.mark.parametrize(("labels", "expected"), [
    (["0", "1", "2"], np.array([0, 1, 2], np.int32)),
    (["0.5", "1", "2"], np.array([0.5, 1, 2], np.float32)),
    (["cat", "1", "dog"], np.array(["cat", "1", "dog"])),
    (["1", "2", "x"], np.array(["1", "2", "x"]))])
def test_csv_labels_keep_their_kind(tmp_path, labels, expected):
    path = tmp_path / "data.csv"
    path.write_text("a,label\n" + "".join(f"{i},{v}\n" for i, v in enumerate(labels)))
    x, y = user.csv_table._load_csv(user.Where("t"), path, "label", 10**6)
    np.testing.assert_array_equal(x[:, 0], np.arange(len(labels), dtype=np.float32))
    assert y.dtype.kind == expected.dtype.kind
    np.testing.assert_array_equal(y, expected)


def test_take_rows_in_place_equals_fancy_indexing():
    from kbackend.data import take_rows

    rng = np.random.default_rng(1)
    x = rng.standard_normal((5000, 7, 3)).astype(np.float32)
    rows = np.sort(rng.choice(5000, 4000, replace=False))
    expected = x[rows]
    taken = take_rows(x, rows, in_place=True)
    assert np.shares_memory(taken, x)  # no second copy
    np.testing.assert_array_equal(taken, expected)
    user_array = rng.standard_normal((50, 2)).astype(np.float32)
    kept = user_array.copy()
    take_rows(user_array, np.array([3, 9]), in_place=False)
    np.testing.assert_array_equal(user_array, kept)  # not ours: untouched


def test_a_file_and_the_same_arrays_from_python_give_the_same_dataset(tmp_path):
    from kbackend.task import CLASSIFICATION
    from kbackend.workload import dataset_of

    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((400, 6)).astype(np.float32), rng.integers(0, 3, 400)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    loaded = load_source(str(tmp_path / "d.npz"))
    given = user.from_python(x, y)
    assert loaded.owned and not given.owned
    a = dataset_of("d", "arrays", dict(loaded.splits), CLASSIFICATION, 3, 0.1, [],
                   owned=loaded.owned)
    b = dataset_of("d", "arrays", dict(given.splits), CLASSIFICATION, 3, 0.1, [])
    for name in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    np.testing.assert_array_equal(given.splits["train"][0], x)  # the caller's arrays untouched


@pytest.mark.slow  # one child process per case
def test_the_data_memory_benchmark_quick_run(tmp_path):
    import json

    from kbackend.bench.registry import BENCHMARKS
    from kbackend.bench.runner import run
    from tests.conftest import BACKEND

    assert run(BENCHMARKS["bench_data_memory"],
               ["--quick", "--backends", BACKEND, "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "bench_data_memory.json").read_text())
    cases = {row["case"]: row for row in payload["rows"]}
    assert {"npz float32", "npz float64", "csv", "image folder"} <= set(cases)
    assert all(row["held_mb"] > 0 and row["rise_mb"] >= 0 for name, row in cases.items()
               if not row["refused"])
    refused = [row for row in payload["rows"] if row["refused"]]
    assert len(refused) == 1 and refused[0]["met"]
    assert "| npz float32 |" in (tmp_path / "bench_data_memory.md").read_text()


def test_an_image_pil_refuses_to_open_is_still_measured_from_its_header(tmp_path):
    path = tmp_path / "huge.png"
    path.write_bytes(png_bytes(20_000, 20_000))  # 400 M pixels: PIL's bomb check refuses it
    assert image_header(path) == (20_000, 20_000, False)
