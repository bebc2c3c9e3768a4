"""Export round trips: a model saved as .keras or SavedModel predicts the same in both backends."""

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


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["keras", "savedmodel"])
def test_export_round_trip_under_both_backends(model_file, tmp_path, fmt, backend):
    manifest = export_model(model_file, fmt, tmp_path / "out", rows=32)
    assert manifest["ok"] and manifest["source_backend"] == backend
    checks = {c["backend"]: c for c in manifest["checks"]}
    assert set(checks) == set(BACKENDS), (
        "the artifact is checked in this backend and in the other one")
    for check in checks.values():
        assert check["rows"] == 32 and check["error"] is None
        assert 0.0 <= check["max_abs_diff"] <= DEFAULT_ATOL
    on_disk = json.loads((tmp_path / "out" / "export.json").read_text())
    assert on_disk["checks"] == manifest["checks"]
    # The stored reference really is the source model's output (so the check compares something).
    from kbackend.model_sources import load_model

    served = load_model(model_file, serving=True)
    with np.load(tmp_path / "out" / SAMPLE_FILE) as data:
        np.testing.assert_array_equal(data["reference"], served.predict_on_batch(data["x"]))


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


def test_export_takes_a_keras_file_checked_header_first_by_model_sources(tmp_path, monkeypatch):
    """``export`` exports a trained ``.keras`` file (not a model to build): its check is
    ``model_sources.check_model_file``, which reads the zip directory and refuses a member Keras
    does not write before Keras opens the file; a builder is refused as not a .keras file."""
    import zipfile

    import keras

    from kbackend import model_sources
    from kbackend.serving import model as serving_model

    assert serving_model.check_model_file is model_sources.check_model_file

    def no_keras_load(*args, **kwargs):
        raise AssertionError("Keras opened a file the header check should have refused")

    monkeypatch.setattr(keras.saving, "load_model", no_keras_load)
    foreign = tmp_path / "foreign.keras"
    with zipfile.ZipFile(foreign, "w") as archive:
        archive.writestr("config.json", "{}")
        archive.writestr("payload.py", "print('hi')")
    with pytest.raises(ModelError, match=r"unexpected member 'payload\.py'"):
        export_model(foreign, "keras", tmp_path / "out")
    with pytest.raises(ModelError, match=r"expected a \.keras file"):
        export_model("models.py:build", "keras", tmp_path / "out")
    assert not (tmp_path / "out").exists()
