"""Export round trips: a model saved as .keras or SavedModel predicts the same under both backends."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kbackend.backend_choice import BACKENDS
from kbackend.serving.export import (
    DEFAULT_ATOL,
    SAMPLE_FILE,
    ExportError,
    check_artifact,
    export_model,
)
from kbackend.serving.model import ModelError


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    from tests.test_cache import tiny_model

    path = tmp_path_factory.mktemp("model") / "tiny.keras"
    tiny_model(seed=3).save(path)
    return path


@pytest.mark.parametrize("fmt", ["keras", "savedmodel"])
def test_export_round_trip_under_both_backends(model_file, tmp_path, fmt, backend):
    manifest = export_model(model_file, fmt, tmp_path / "out", rows=32)
    assert manifest["ok"] and manifest["source_backend"] == backend
    checks = {c["backend"]: c for c in manifest["checks"]}
    assert set(checks) == set(BACKENDS), "the artifact is checked in this backend and in the other one"
    for check in checks.values():
        assert check["rows"] == 32 and check["error"] is None
        assert 0.0 <= check["max_abs_diff"] <= DEFAULT_ATOL
    on_disk = json.loads((tmp_path / "out" / "export.json").read_text())
    assert on_disk["checks"] == manifest["checks"]
    # The stored reference really is the source model's output (so the check compares something).
    from kbackend.serving.model import load_model

    with np.load(tmp_path / "out" / SAMPLE_FILE) as data:
        np.testing.assert_array_equal(data["reference"], load_model(model_file).predict_on_batch(data["x"]))


def test_check_detects_an_artifact_that_differs(model_file, tmp_path):
    export_model(model_file, "keras", tmp_path / "out", rows=8, check_backends=())
    sample = tmp_path / "out" / SAMPLE_FILE
    with np.load(sample) as data:
        x, reference = data["x"], data["reference"]
    np.savez(sample, x=x, reference=reference + np.float32(1e-3))
    result = check_artifact(tmp_path / "out" / "model.keras", "keras", sample)
    assert not result.ok and result.max_abs_diff == pytest.approx(1e-3, rel=1e-2)


def test_export_refuses_bad_model_and_format(tmp_path):
    broken = tmp_path / "broken.keras"
    broken.write_text("not a model")
    with pytest.raises(ModelError, match=r"is not a \.keras archive"):
        export_model(broken, "keras", tmp_path / "out")
    from kbackend.errors import ConfigError

    with pytest.raises(ConfigError, match="Invalid export format"):
        export_model(broken, "onnx", tmp_path / "out")
    assert ExportError.__mro__[1].__name__ == "KBackendError"
