"""Data memory benchmark: what loading a user's data costs in memory over what it holds.

    python scripts/bench_data_memory.py [--quick] [--out DIR] [--backends jax]

Each case writes a data source (``.npz`` of float32 or float64 inputs, a compressed ``.npz``, a
CSV, a folder of PNG images) and loads it in a fresh child process, as ``kbackend train
--data`` does: ``load_source`` then the split into train, validation and test
(``workload.dataset_of``). Its figure is the rise of the process's resident memory at its peak
(Linux's ``VmHWM``, reset just before loading, after the libraries are imported) over the bytes
of the arrays kbackend holds afterwards (every distinct buffer, views counted once). Goals
(issue 45): ``.npz`` and image folders at most 1.5x, CSV at most 3x. One more case declares
more than the memory cap in its ``.npz`` headers: it must be refused before any array is read
(its rise: a few MB at most).
"""

from __future__ import annotations

import gc
import os
import resource
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from kbackend.backend_choice import active_backend
from kbackend.bench.spec import Benchmark, Rows, Settings, WorkerSpec
from kbackend.data import user
from kbackend.errors import DataError
from kbackend.reports import markdown_rows
from kbackend.runtime.child import run_in_child
from kbackend.task import CLASSIFICATION
from kbackend.workload import dataset_of

GOALS = {"npz": 1.5, "images": 1.5, "csv": 3.0}
CLASSES = 10
_MB = 2**20


def peak_rss() -> int:
    """The process's peak resident memory in bytes (``VmHWM``; ``ru_maxrss`` elsewhere)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak() -> bool:
    """Reset the peak to the current resident memory (Linux ``clear_refs`` 5); False if not."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def held_bytes(arrays: list[np.ndarray]) -> int:
    """The bytes of the distinct buffers behind ``arrays`` (a view counted as its base)."""
    seen: dict[int, int] = {}
    for array in arrays:
        base = array
        while isinstance(base.base, np.ndarray):
            base = base.base
        seen[id(base)] = base.nbytes
    return sum(seen.values())


def load_case(kind: str, path: str, label: str | None = None,
              max_bytes: int | None = None) -> dict[str, Any]:
    """Child side: load ``path`` as ``kbackend train --data`` does; the memory it cost."""
    if kind == "images":
        user._tensorflow()  # the framework's own memory is not the data's
    gc.collect()
    exact = reset_peak()
    base = peak_rss()
    start = time.perf_counter()
    try:
        loaded = user.load_source(path, label=label, max_bytes=max_bytes)
        dataset = dataset_of(loaded.name, loaded.kind, dict(loaded.splits), CLASSIFICATION,
                             CLASSES, 0.1, [], owned=loaded.owned)
    except DataError as error:
        return {"refused": str(error)[:160], "rise_mb": (peak_rss() - base) / _MB,
                "held_mb": 0.0, "seconds": time.perf_counter() - start, "exact_peak": exact}
    seconds = time.perf_counter() - start
    del loaded
    arrays = [dataset.x_train, dataset.y_train, dataset.x_val, dataset.y_val, dataset.x_test,
              dataset.y_test]
    return {"refused": None, "rise_mb": (peak_rss() - base) / _MB,
            "held_mb": held_bytes(arrays) / _MB, "seconds": seconds, "exact_peak": exact,
            "train_shape": list(dataset.x_train.shape)}


def _inputs(rows: int, features: int, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((rows, features)).astype(dtype), rng.integers(0, CLASSES, rows)


def _write_npz(folder: Path, name: str, rows: int, features: int, dtype: Any,
               compressed: bool = False) -> Path:
    x, y = _inputs(rows, features, dtype)
    path = folder / name
    (np.savez_compressed if compressed else np.savez)(path, x=x, y=y)
    return path


def _write_csv(folder: Path, rows: int, features: int) -> Path:
    x, y = _inputs(rows, features, np.float32)
    path = folder / "data.csv"
    with open(path, "w") as handle:
        handle.write(",".join([f"f{i}" for i in range(features)] + ["label"]) + "\n")
        for row, label in zip(x, y, strict=True):
            handle.write(",".join(f"{v:.5g}" for v in row) + f",{label}\n")
    return path


def _write_images(folder: Path, count: int, size: int) -> Path:
    from PIL import Image  # deferred: Pillow comes with matplotlib

    rng = np.random.default_rng(0)
    root = folder / "images"
    for index in range(count):
        cls = root / f"c{index % CLASSES}"
        cls.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(cls / f"{index}.png")
    return root


def _write_declared(folder: Path, declared: int) -> Path:
    """An ``.npz`` whose x member declares ``declared`` bytes of float32 (zeros, deflated: a
    file of about declared / 1000 bytes) and a small y."""
    path = folder / "declared.npz"
    header = np.lib.format.header_data_from_array_1_0(np.zeros((1, 1), np.float32))
    header["shape"] = (declared // 16, 4)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        with archive.open("x.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array_header_1_0(member, header)
            zeros = bytes(_MB)
            for _ in range(declared // _MB):
                member.write(zeros)
        with archive.open("y.npy", "w") as member:
            np.lib.format.write_array(member, np.zeros(declared // 16, np.int8))
    return path


def _cases(folder: Path, quick: bool) -> list[tuple[str, str, Path, dict[str, Any]]]:
    """(case, goal kind, path, load options) of each case, their files written."""
    rows = 20_000 if quick else 400_000
    csv_rows = 5_000 if quick else 200_000
    declared = 64 * _MB if quick else 1024 * _MB
    return [
        ("npz float32", "npz", _write_npz(folder, "f32.npz", rows, 64, np.float32), {}),
        ("npz float64", "npz", _write_npz(folder, "f64.npz", rows, 64, np.float64), {}),
        ("npz float32 compressed", "npz",
         _write_npz(folder, "zip.npz", rows, 64, np.float32, compressed=True), {}),
        ("csv", "csv", _write_csv(folder, csv_rows, 20), {"label": "label"}),
        ("image folder", "images", _write_images(folder, 300 if quick else 3000, 32), {}),
        (f"npz declaring {declared // _MB} MiB, cap {declared // 2 // _MB} MiB", "refused",
         _write_declared(folder, declared), {"max_bytes": declared // 2}),
    ]


def measure_data_memory(settings: Settings) -> Rows:
    """Every case in a fresh child process; one row each."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="kb-data-memory-") as temp:
        for name, kind, path, options in _cases(Path(temp), settings.quick):
            size = sum(f.stat().st_size for f in path.rglob("*")) if path.is_dir() \
                else path.stat().st_size
            result = run_in_child("kbackend.bench.data_memory:load_case", active_backend(),
                                  {"kind": kind, "path": str(path), **options}, timeout_s=900)
            ratio = result["rise_mb"] / result["held_mb"] if result["held_mb"] else None
            goal = GOALS.get(kind)
            met = (result["refused"] is not None and result["rise_mb"] < 16) \
                if kind == "refused" else ratio is not None and ratio <= (goal or 0)
            rows.append({"case": name, "file_mb": size / _MB, "held_mb": result["held_mb"],
                         "rise_mb": result["rise_mb"], "ratio": ratio, "goal": goal,
                         "met": met, "seconds": result["seconds"],
                         "refused": result["refused"], "exact_peak": result["exact_peak"]})
            print(f"{name:44s} held {result['held_mb']:8.1f} MB  rise {result['rise_mb']:8.1f} "
                  f"MB  {'' if ratio is None else f'{ratio:.2f}x'}", file=sys.stderr, flush=True)
    return rows, {"load_before": os.getloadavg()[0], "cases": len(rows),
                  "all_met": all(row["met"] for row in rows)}


def data_memory_table(payload: dict[str, Any]) -> str:
    """One line per case: held, peak rise, their ratio against the goal."""
    return markdown_rows(
        ["case", "file MB", "held MB", "peak rise MB", "rise / held", "goal", "met", "load s"],
        ([row["case"], f"{row['file_mb']:.1f}", f"{row['held_mb']:.1f}",
          f"{row['rise_mb']:.1f}", "refused" if row["refused"] else f"{row['ratio']:.2f}x",
          f"<= {row['goal']:g}x" if row["goal"] else "refused before reading",
          "yes" if row["met"] else "NO", f"{row['seconds']:.2f}"] for row in payload["rows"]))


def _one_worker(settings: Settings, backends: Any) -> list[WorkerSpec]:
    return [WorkerSpec("data", backends[0])]  # loading is backend-free; one worker is enough


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("bench_data_memory", "Data memory: peak resident memory of loading a user's data "
              "over the arrays kbackend holds (.npz, CSV, image folders; a declared size that "
              "cannot fit refused).", measure_data_memory, keys=("case",),
              values=("held_mb", "rise_mb", "ratio"), summary_fields=("cases", "all_met"),
              workers=_one_worker, table=data_memory_table,
              note="peak resident memory (VmHWM, reset before loading) minus the memory before, "
                   "over the distinct buffers the dataset holds; one fresh process per case"),
)
