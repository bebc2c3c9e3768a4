"""A folder of class subfolders holding images or text files (optionally split into ``train/``,
``val/``, ``test/``), sized from the image headers before any image is decoded."""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from kbackend.backend_choice import keras as import_keras
from kbackend.data.user.common import (
    READ_BATCH,
    SPLIT_NAMES,
    TEXT_SEQUENCE_LENGTH,
    Reader,
    Splits,
    Where,
    _check_limit,
    reading,
)
from kbackend.data.user.datasets import _read_tf_dataset, _tensorflow
from kbackend.errors import DataError

IMAGE_EXTENSIONS = (".bmp", ".gif", ".jpeg", ".jpg", ".png")  # what Keras's image reader takes
TEXT_EXTENSIONS = (".txt",)
# The most pixels an image of a folder may have (a 4096x4096 image) unless ``image_size``
# (``--image-size HxW``) names the size to read every image at: a larger one costs seconds and
# hundreds of megabytes to decode, and its size would become every image's.
MAX_IMAGE_PIXELS = 4096 * 4096
# PIL modes (and, without PIL, PNG colour types / JPEG components) read as one channel.
_GRAY_MODES = ("1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "F")


def _class_folders(folder: Path) -> list[Path]:
    return sorted(entry for entry in folder.iterdir()
                  if entry.is_dir() and not entry.name.startswith("."))


def _folder_splits(where: Where, folder: Path) -> dict[str, Path]:
    """``{"train": folder}``, or the split folders when ``folder`` holds ``train/`` (with
    ``val/`` or ``validation/``, and ``test/``), each of class subfolders."""
    subfolders = _class_folders(folder)
    names = {entry.name.lower(): entry for entry in subfolders}
    if "train" not in names or not set(names) <= set(SPLIT_NAMES) or not _class_folders(
            names["train"]):
        return {"train": folder}
    splits: dict[str, Path] = {}
    for name, entry in sorted(names.items()):
        if SPLIT_NAMES[name] in splits:
            raise where.error(f"two folders for the {SPLIT_NAMES[name]} split: "
                              f"{splits[SPLIT_NAMES[name]].name}/ and {entry.name}/.")
        splits[SPLIT_NAMES[name]] = entry
    return splits


def _scan_folder(where: Where, folder: Path) -> tuple[list[Path], list[Path], int]:
    """The image files and text files under ``folder``'s class subfolders, and the text bytes."""
    classes = _class_folders(folder)
    expected = ("expected a folder of class subfolders (one per class) holding images "
                f"({' '.join(IMAGE_EXTENSIONS)}) or text files (.txt)")
    if not classes:
        raise where.error(f"{expected}; {str(folder)!r} has no subfolders.")
    images, texts, text_bytes = [], [], 0
    for class_folder in classes:
        for root, _, files in os.walk(class_folder):
            for file in sorted(files):
                path = Path(root, file)
                suffix = path.suffix.lower()
                if suffix in IMAGE_EXTENSIONS:
                    images.append(path)
                elif suffix in TEXT_EXTENSIONS:
                    texts.append(path)
                    text_bytes += path.stat().st_size
    if not images and not texts:
        raise where.error(f"{expected}; the subfolders of {str(folder)!r} hold neither.")
    if images and texts:
        raise where.error(f"{str(folder)!r} mixes images ({len(images)}) and text files "
                          f"({len(texts)}): {expected}, one kind.")
    if len(classes) == 1:
        raise where.error(f"{str(folder)!r} has one class subfolder ({classes[0].name}/): "
                          "classification needs at least two classes.")
    return sorted(images), texts, text_bytes


def parse_image_size(text: str) -> tuple[int, int]:
    """``"HxW"`` (or ``"H,W"``, or one number for a square) as (height, width); ``DataError``
    otherwise."""
    parts = re.split(r"[x,X]", str(text).strip())
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or not all(part.strip().isdigit() and len(part.strip()) <= 6
                                  for part in parts):
        raise DataError(f"Invalid --image-size {str(text)[:40]!r}: expected HEIGHTxWIDTH in "
                        "pixels, e.g. 64x64.")
    height, width = (int(part) for part in parts)
    check_image_size((height, width))
    return height, width


def check_image_size(size: Any) -> None:
    """``DataError`` unless ``size`` is (height, width), each 1 .. 65535 pixels."""
    if not (isinstance(size, tuple | list) and len(size) == 2 and all(
            isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= 65535 for d in size)):
        raise DataError(f"Invalid image size {size!r}: expected (height, width), each from 1 to "
                        "65535 pixels.")


def _png_header(head: bytes) -> tuple[int, int, bool] | None:
    if head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR" or len(head) < 26:
        return None
    width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    return height, width, head[25] in (0, 4)  # colour types 0 and 4: gray (with alpha)


def _jpeg_header(handle: BinaryIO) -> tuple[int, int, bool] | None:
    """(height, width, gray) from a JPEG's start-of-frame segment, markers walked header-first."""
    handle.seek(2)
    while True:
        marker = handle.read(4)
        if len(marker) < 4 or marker[0] != 0xFF:
            return None
        kind, length = marker[1], int.from_bytes(marker[2:4], "big")
        if 0xC0 <= kind <= 0xCF and kind not in (0xC4, 0xC8, 0xCC):
            frame = handle.read(6)
            if len(frame) < 6:
                return None
            height, width = int.from_bytes(frame[1:3], "big"), int.from_bytes(frame[3:5], "big")
            return height, width, frame[5] == 1
        if length < 2:
            return None
        handle.seek(length - 2, os.SEEK_CUR)


def _header_without_pil(path: Path) -> tuple[int, int, bool] | None:
    """(height, width, gray) from a PNG, JPEG, GIF or BMP header, None if unrecognized."""
    with open(path, "rb") as handle:
        head = handle.read(32)
        if head[:2] == b"\xff\xd8":
            return _jpeg_header(handle)
    if head[:6] in (b"GIF87a", b"GIF89a") and len(head) >= 10:
        return int.from_bytes(head[8:10], "little"), int.from_bytes(head[6:8], "little"), False
    if head[:2] == b"BM" and len(head) >= 26:
        width = int.from_bytes(head[18:22], "little", signed=True)
        height = int.from_bytes(head[22:26], "little", signed=True)
        return abs(height), abs(width), False
    return _png_header(head)


def image_header(path: Path) -> tuple[int, int, bool] | None:
    """(height, width, grayscale) of the image at ``path``, read from its header without
    decoding it (PIL's lazy open when PIL is installed, else the PNG, JPEG, GIF or BMP header
    parsed here); None if the header cannot be read."""
    try:
        from PIL import Image  # deferred, optional: Pillow comes with matplotlib, not always
    except ImportError:
        return _header_without_pil(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # refused below
            with Image.open(path) as image:  # reads the header only; decoding waits for .load()
                width, height = image.size
                return height, width, image.mode in _GRAY_MODES
    except (OSError, ValueError, Image.DecompressionBombError):
        # PIL refuses to open a huge image at all: its header still says how huge
        return _header_without_pil(path)


def _image_geometry(where: Where, images: list[Path], max_bytes: int,
                    image_size: tuple[int, int] | None) -> tuple[int, int, str]:
    """(height, width, colour mode) every image is read at, from the headers alone: each
    image's pixels within ``MAX_IMAGE_PIXELS`` unless ``image_size`` is given, and all the
    images at that size within ``max_bytes``, checked before any image is decoded."""
    first = None
    for path in images:
        header = image_header(path)
        if header is None:
            raise where.error(f"image {str(path)!r} has no readable PNG, JPEG, GIF or BMP "
                              "header: remove it or convert it.")
        height, width = header[0], header[1]
        if image_size is None and height * width > MAX_IMAGE_PIXELS:
            raise where.error(
                f"image {str(path)!r} is {height}x{width} pixels, more than the "
                f"{MAX_IMAGE_PIXELS:,} read unless --image-size HxW (image_size) names the size "
                "to resize every image to, e.g. --image-size 224x224.")
        first = first or header
    assert first is not None  # a folder without images was refused by _scan_folder
    height, width = image_size or (first[0], first[1])
    channels, mode = (1, "grayscale") if first[2] else (3, "rgb")
    _check_limit(where, len(images) * height * width * channels * 4, max_bytes,
                 f"{len(images):,} images of {height}x{width}x{channels} float32")
    return height, width, mode


@dataclass(frozen=True)
class Folder(Reader):
    """A folder of class subfolders of images or text files; ``seed``: the order the files are
    shuffled into (``datasets.fixed_order``, after reading them in Keras's sorted order: a
    tf.data shuffle would follow TensorFlow's global seed, which each run's seed sets);
    ``image_size``: (height, width) to read every image at."""

    where: Where
    path: Path
    seed: int
    max_bytes: int
    image_size: tuple[int, int] | None

    def read(self) -> Splits:
        kind, splits, class_names, notes = _load_folder(
            self.where, self.path, seed=self.seed, max_bytes=self.max_bytes,
            image_size=self.image_size)
        return Splits(name=self.path.resolve().name, kind=kind, splits=splits,
                      class_names=class_names, notes=notes, owned=True)

    def check(self) -> None:
        """The class subfolders and their files listed (reading them takes Keras)."""
        for folder in _folder_splits(self.where, self.path).values():
            _scan_folder(self.where, folder)


def _load_folder(where: Where, folder: Path, *, seed: int, max_bytes: int,
                 image_size: tuple[int, int] | None) -> tuple[str, dict, tuple, tuple]:
    """(kind, splits, class names, notes) of a folder of images or text files."""
    split_folders = _folder_splits(where, folder)
    scans = {split: _scan_folder(where, path) for split, path in split_folders.items()}
    kinds = {"images" if images else "text" for images, _, _ in scans.values()}
    if len(kinds) > 1:
        raise where.error("its split folders hold different kinds of files (images in some, "
                          "text in others).")
    (kind,) = kinds
    if kind == "images":  # from the headers, before TensorFlow or any image is read
        # the training folder's first image sets the size; every header is checked
        images = scans["train"][0] + [p for split, (found, _, _) in scans.items()
                                      if split != "train" for p in found]
        height, width, mode = _image_geometry(where, images, max_bytes, image_size)
    keras = import_keras()
    tf = _tensorflow()
    options = {"labels": "inferred", "label_mode": "int", "batch_size": READ_BATCH,
               "shuffle": False, "verbose": False}
    notes: list[str] = []
    with reading(where, "reading the folder failed", (tf.errors.OpError, ValueError, OSError)):
        if kind == "images":
            datasets = {split: keras.utils.image_dataset_from_directory(
                path, color_mode=mode, image_size=(height, width), interpolation="bilinear",
                data_format="channels_last", **options) for split, path in split_folders.items()}
            how = "given" if image_size else "the first image's"
            notes.append(f"images read at {height}x{width} ({how} size), {mode}, values 0-255 "
                         "as float32")
        else:
            count = sum(len(texts) for _, texts, _ in scans.values())
            text_bytes = sum(size for _, _, size in scans.values())
            _check_limit(where, text_bytes + count * TEXT_SEQUENCE_LENGTH * 4, max_bytes,
                         f"{count:,} text files")
            datasets = {split: keras.utils.text_dataset_from_directory(path, **options)
                        for split, path in split_folders.items()}
    class_names = tuple(datasets["train"].class_names)
    for split, dataset in datasets.items():
        if tuple(dataset.class_names) != class_names:
            raise where.error(f"the {split} folder's classes {list(dataset.class_names)} differ "
                              f"from the training folder's {list(class_names)}.")
    # each split's file count: its arrays are allocated once, at that size
    splits = {split: _read_tf_dataset(where, dataset, split, max_bytes, batched=True,
                                      rows=len(scans[split][0]) if kind == "images" else None,
                                      shuffle_seed=seed)
              for split, dataset in datasets.items()}
    return kind, splits, class_names, tuple(notes)
