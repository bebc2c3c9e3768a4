"""Export a model as ``.keras`` or TF SavedModel and check the artifact under every backend.

The check: the source model's predictions on a sample are stored beside the artifact
(``export_check.npz``); the artifact is then loaded and run on that sample in this process and,
in a child process, under the other backend (``kbackend.runtime.child``); the largest
absolute difference of each must be within ``atol``.

A ``.keras`` artifact is loaded by Keras on the checking backend (the real cross-backend test:
weights trained under JAX predicting under TensorFlow or the reverse). A SavedModel is a
TensorFlow graph: it is loaded with ``tf.saved_model.load`` whatever the Keras backend, so its
check shows it serves from a process of either backend (``model.export`` needs TensorFlow
installed on JAX too: it converts the JAX function with jax2tf).
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kbackend.backend_choice import BACKENDS, active_backend
from kbackend.errors import ConfigError, KBackendError
from kbackend.io import atomic_write, atomic_write_json, check_output_folder, temp_folder
from kbackend.model_sources import load_model
from kbackend.runtime.child import ChildFailed, ChildTimeout, run_in_child
from kbackend.serving.model import (
    BatchPredictor,
    input_shape,
    model_fingerprint,
    takes_strings,
    validate_inputs,
)

FORMATS = ("keras", "savedmodel")
DEFAULT_ATOL = 1e-5  # float32 predictions of the same weights on two XLA builds differ by ~1e-7
SAMPLE_FILE = "export_check.npz"
MANIFEST_FILE = "export.json"
# The random check sample: refused beyond these (one line) rather than a MemoryError when drawn.
MAX_CHECK_ROWS = 65_536
MAX_CHECK_ELEMENTS = 2**28  # 1 GiB of float32


class ExportError(KBackendError):
    """An export failed, or its artifact does not reproduce the source model's predictions."""


@dataclass(frozen=True)
class CheckResult:
    """The artifact's largest difference from the source model under one backend."""

    backend: str
    max_abs_diff: float
    rows: int
    ok: bool
    error: str | None = None


def artifact_path(out_dir: Path, fmt: str) -> Path:
    """Where the artifact of format ``fmt`` lives inside ``out_dir``."""
    return out_dir / ("model.keras" if fmt == "keras" else "saved_model")


def load_artifact(path: str | os.PathLike, fmt: str) -> Any:
    """A callable ``f(x: float32 array) -> predictions`` for an exported artifact."""
    if fmt == "keras":
        model = load_model(path, serving=True)
        if takes_strings(model):  # its string front on the host, as kbackend serves it
            return BatchPredictor(model)
        return lambda x: np.asarray(model.predict_on_batch(x))
    import tensorflow as tf  # deferred: heavy, and needed only for SavedModel artifacts

    loaded = tf.saved_model.load(str(path))
    return lambda x: np.asarray(loaded.serve(tf.constant(x)))


def check_artifact(path: str | os.PathLike, fmt: str, sample_file: str | os.PathLike,
                   atol: float = DEFAULT_ATOL) -> CheckResult:
    """Run the artifact on the stored sample in this process and compare with the reference."""
    with np.load(sample_file) as data:
        x, reference = data["x"], data["reference"]
    predict = load_artifact(path, fmt)
    got = predict(x).astype(np.float32)
    if got.shape != reference.shape:
        return CheckResult(active_backend(), float("inf"), len(x), False,
                           f"output shape {got.shape} differs from the source's {reference.shape}")
    diff = float(np.max(np.abs(got - reference)))
    return CheckResult(active_backend(), diff, len(x), diff <= atol)


def check_in_this_process(artifact: str, fmt: str, sample_file: str, atol: float) -> dict[str, Any]:
    """``check_artifact`` as a JSON-able dict, a kbackend error reported as a failed check
    (what ``check_under`` runs in its child process)."""
    try:
        result = check_artifact(artifact, fmt, sample_file, atol)
    except KBackendError as error:
        result = CheckResult(active_backend(), float("inf"), 0, False, str(error))
    return asdict(result)


def check_under(backend: str, path: Path, fmt: str, sample_file: Path, atol: float,
                timeout_s: float = 300) -> CheckResult:
    """``check_artifact`` in a child process whose Keras runs on ``backend``."""
    try:
        result = run_in_child("kbackend.serving.export:check_in_this_process", backend,
                              {"artifact": str(path), "fmt": fmt, "sample_file": str(sample_file),
                               "atol": atol}, timeout_s=timeout_s)
    except ChildTimeout:
        return CheckResult(backend, float("inf"), 0, False,
                           f"check timed out after {timeout_s:.0f}s")
    except ChildFailed as error:
        return CheckResult(backend, float("inf"), 0, False, str(error))
    return CheckResult(**result)


def _sample(row_shape: tuple[int | None, ...], rows: int, seed: int) -> np.ndarray:
    fixed = tuple(d for d in row_shape if d is not None)
    if len(fixed) < len(row_shape):
        raise ConfigError(f"Cannot draw a check sample for inputs of shape {row_shape}: "
                          "pass --sample x.npy.")
    if rows * math.prod(fixed) > MAX_CHECK_ELEMENTS:
        raise ConfigError(f"Invalid rows {rows}: {rows} random rows of shape {row_shape} would "
                          f"hold {rows * math.prod(fixed):.3g} numbers. Expected at most "
                          f"{MAX_CHECK_ELEMENTS:.3g}: pass fewer --rows or a --sample file.")
    return np.random.default_rng(seed).random((rows, *fixed), dtype=np.float32)


def _text_sample(predictor: BatchPredictor, rows: int, seed: int) -> np.ndarray:
    """``rows`` texts of 1-8 words drawn from the first front layer's vocabulary, in the shape
    the model takes (a model with a string front; ``--sample`` names other inputs)."""
    assert predictor.front is not None
    layer = predictor.front.layers[0]
    words = [str(w) for w in layer.get_vocabulary()] if hasattr(layer, "get_vocabulary") else []
    words = [w for w in words if w and w != "[UNK]"] or ["text"]
    rng = np.random.default_rng(seed)
    texts = [" ".join(rng.choice(words, int(rng.integers(1, 9)))) for _ in range(rows)]
    return validate_inputs(np.array(texts), predictor.input_shape, "sample", strings=True)


def _reference(model: Any, sample: np.ndarray | None, rows: int, seed: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """(the check sample, the model's predictions on it): ``sample`` checked, else drawn."""
    row_shape = input_shape(model)
    if takes_strings(model):
        predictor = BatchPredictor(model)
        x = (validate_inputs(sample, row_shape, "--sample", strings=True) if sample is not None
             else _text_sample(predictor, rows, seed))
        return x.astype(str), predictor(x)  # str, not object: np.load reads it without pickle
    x = validate_inputs(sample, row_shape, "--sample") if sample is not None else \
        _sample(row_shape, rows, seed)
    return x, np.asarray(model.predict_on_batch(x), dtype=np.float32)


def _write_savedmodel(model: Any, target: Path) -> None:
    """``model.export`` into a staging folder, then swap it in (no half-written artifact).

    The staging folder is named like a temp file (``io.temp_folder``): a killed export leaves
    it behind, and the next start removes it. The artifact it replaces moves into it, so the
    old one goes with it."""
    staging = temp_folder(target)
    try:
        model.export(str(staging / "artifact"), format="tf_saved_model", verbose=False)
        if target.exists():
            os.replace(target, staging / "replaced")
        os.replace(staging / "artifact", target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def check_export_options(rows: int, atol: float) -> None:
    """Raise ``ConfigError`` for a check sample of no rows or a negative / NaN tolerance."""
    if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= MAX_CHECK_ROWS:
        raise ConfigError(f"Invalid rows {rows!r}: expected a number of check rows from 1 to "
                          f"{MAX_CHECK_ROWS} (a sample to check, not a data set).")
    if not (isinstance(atol, (int, float)) and math.isfinite(atol) and atol >= 0):
        raise ConfigError(f"Invalid atol {atol!r}: expected a finite tolerance >= 0.")


def export_model(model_path: str | os.PathLike, fmt: str, out_dir: str | os.PathLike, *,
                 sample: np.ndarray | None = None, rows: int = 64, seed: int = 0,
                 atol: float = DEFAULT_ATOL,
                 check_backends: tuple[str, ...] = BACKENDS) -> dict[str, Any]:
    """Export ``model_path`` as ``fmt`` into ``out_dir`` and check it; return the manifest.

    Raises ``ExportError`` when a check fails (the artifact is kept for inspection).
    """
    check_export_options(rows, atol)
    if fmt not in FORMATS:
        raise ConfigError(
            f"Invalid export format. Expected one of {list(FORMATS)}. Received: {fmt!r}.")
    check_output_folder(out_dir, "--out")  # before the model loads (the API too, not only the CLI)
    model = load_model(model_path, serving=True)
    x, reference = _reference(model, sample, rows, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = artifact_path(out, fmt)
    try:
        if fmt == "keras":
            atomic_write(target, lambda tmp: model.save(tmp))
        else:
            _write_savedmodel(model, target)
    except KBackendError:
        raise
    except Exception as error:
        raise ExportError(f"Export of {str(model_path)!r} as {fmt} failed: "
                          f"{type(error).__name__}: {error}") from None
    sample_file = out / SAMPLE_FILE
    atomic_write(sample_file, lambda tmp: _save_npz(tmp, x, reference))
    here = active_backend()
    checks = [check_artifact(target, fmt, sample_file, atol) if backend == here
              else check_under(backend, target, fmt, sample_file, atol)
              for backend in check_backends]
    manifest = {
        "source": str(model_path), "format": fmt, "artifact": str(target), "source_backend": here,
        "fingerprint": model_fingerprint(model), "sample_rows": len(x), "atol": atol,
        "checks": [asdict(c) for c in checks], "ok": all(c.ok for c in checks),
    }
    atomic_write_json(out / MANIFEST_FILE, manifest)
    if not manifest["ok"]:
        failed = "; ".join(
            f"{c.backend}: max |diff| {c.max_abs_diff:.3g}" + (f" ({c.error})" if c.error else "")
            for c in checks if not c.ok
        )
        raise ExportError(f"Exported {target} does not reproduce the source predictions within "
                          f"atol {atol:g}: {failed}.")
    return manifest


def _save_npz(path: Path, x: np.ndarray, reference: np.ndarray) -> None:
    with open(path, "wb") as handle:  # a file object: np.savez would append .npz to the temp name
        np.savez(handle, x=x, reference=reference)
