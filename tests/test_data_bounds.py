"""Memory and size bounds of a user's data, checked before it is read (issue 45): image sizes
from the headers (PIL's lazy open, or the PNG / JPEG / GIF / BMP header parsed without PIL),
the pixel cap unless ``--image-size``, n x H x W x C against the memory cap, and an ``.npz``
whose declared arrays cannot fit in memory once loaded."""

from __future__ import annotations

import struct
import sys
import zlib
from pathlib import Path

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
    monkeypatch.setattr(user, "import_keras", no_decoding)
    # 9 images x 6 x 5 x 3 float32 = 3,240 bytes
    with pytest.raises(DataError, match=r"9 images of 6x5x3 float32 would take 3,240 bytes"):
        load_source(str(folder), max_bytes=3_239)
    with pytest.raises(DataError, match=r"9 images of 100x100x3 float32"):
        load_source(str(folder), max_bytes=100_000, image_size=(100, 100))


@pytest.mark.slow  # reads the folder with TensorFlow
def test_image_size_lifts_the_pixel_cap(tmp_path, monkeypatch):
    from PIL import Image

    monkeypatch.setattr(user, "MAX_IMAGE_PIXELS", 99)  # a 10x10 image is over it
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
