"""``kbackend equiv``: the table, the exit status, and one-line errors."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest

from kbackend.cli import build_parser
from kbackend.commands import equiv
from kbackend.equivalence.randomdata import random_inputs
from tests.conftest import ROOT

pytestmark = pytest.mark.equivalence

CNN = {"input": {"shape": [6, 6, 2]}, "outputs": 3, "layers": [
    {"type": "conv2d", "filters": 3, "kernel": 3, "padding": "same", "activation": "relu"},
    {"type": "batchnorm"}, {"type": "maxpool", "pool": 2}, {"type": "dropout", "rate": 0.5},
    {"type": "flatten"}]}
TOKENS = {"input": {"shape": [4], "dtype": "int32"}, "outputs": 2, "layers": [
    {"type": "embedding", "input_dim": 6, "output_dim": 3}, {"type": "gap"}]}


def _save(pool, arch, path):
    source = {"kind": "arch", "arch": arch}
    description = pool.call("jax", "describe", source=source)
    pool.call("tensorflow", "evaluate", source=source, weights=description["weights"],
              x=random_inputs(description, 2, 0), y=None, loss=None, optimizers=[],
              save_path=str(path))
    return description


def test_equiv_prints_the_table_and_exits_0_when_all_pass(pool, tmp_path, capsys):
    model = tmp_path / "cnn.keras"
    description = _save(pool, CNN, model)
    np.save(tmp_path / "x.npy", random_inputs(description, 5, 1)[0])
    args = build_parser().parse_args(["equiv", str(model), "--inputs", str(tmp_path / "x.npy"),
                                      "--json", str(tmp_path / "report.json")])
    assert equiv.run(args, pool=pool) == 0
    out = capsys.readouterr().out
    assert "max abs" in out and "max rel" in out
    for name in ("output head", "d loss / d l0_conv2d/kernel", "adam step 3: l0_conv2d/kernel",
                 "saved on jax, loaded on tensorflow", "saved on tensorflow, loaded on jax"):
        assert name in out
    assert "FAIL" not in out and "all pass" in out.splitlines()[-1]
    assert "l3_dropout.rate" in out  # Dropout was made inert for the training comparisons
    assert (tmp_path / "report.json").is_file()


def test_equiv_exits_1_and_names_the_divergence_when_a_row_fails(pool, tmp_path, capsys):
    model = tmp_path / "tokens.keras"
    _save(pool, TOKENS, model)
    np.save(tmp_path / "ids.npy", np.array([[0, 0, 1, 2], [3, 3, 3, 5]], np.int32))
    args = build_parser().parse_args(["equiv", str(model), "--inputs", str(tmp_path / "ids.npy")])
    assert equiv.run(args, pool=pool) == 1
    out = capsys.readouterr().out
    assert "FAIL  (known divergence: tf-sparse-adam-duplicate-ids)" in out
    assert "FAIL" in out.splitlines()[-1]


def test_equiv_end_to_end_with_its_own_workers(pool, cli, tmp_path):
    """The real command line: its own workers, random inputs of the model's input shape."""
    model = tmp_path / "cnn.keras"
    _save(pool, CNN, model)
    result = cli("equiv", str(model), "--steps", "2", "--failures-only")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1].endswith("all pass")


@pytest.mark.parametrize("argv, message", [
    (["equiv", "missing.keras"], "not found: expected a .keras file"),
    (["equiv", "__MODEL__", "--inputs", "nope.npy"], "Invalid --inputs 'nope.npy': file not found"),
    (["equiv", "__MODEL__", "--steps", "0"], "Invalid --steps 0"),
    (["equiv", "__MODEL__", "--seed", "-1"], "Invalid --seed -1"),
    (["equiv", "__MODEL__", "--inputs", "__EMPTY__"], "Received: 0 bytes without a NumPy header"),
    (["equiv", "__MODEL__", "--loss", "bogus"], "Invalid --loss"),
])
def test_equiv_bad_input_is_a_one_line_error(cli, tmp_path, argv, message):
    model = tmp_path / "m.keras"
    with zipfile.ZipFile(model, "w") as archive:  # passes the file check; never loaded
        archive.writestr("config.json", "{}")
    empty = tmp_path / "empty.npy"
    empty.write_bytes(b"")  # a zero-byte array file
    stand_ins = {"__MODEL__": str(model), "__EMPTY__": str(empty)}
    result = cli(*[stand_ins.get(a, a) for a in argv])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


@pytest.mark.parametrize(("model", "dataset"), [("seed_mlp", "digits"), ("mlp", "mnist1d")])
def test_equiv_passes_on_models_kbackend_trains_with_adam(pool, tmp_path, capsys, model, dataset):
    """The issue's failure: models `kbackend train` trains with Adam, compared across backends
    (Adam's first step judged on what the gradients' measured difference does not explain)."""
    from kbackend.training import TrainConfig, train

    path = tmp_path / f"{model}.keras"
    train(TrainConfig(model=model, dataset=dataset, epochs=1, engine="native", fused_steps=8),
          save=str(path))
    args = build_parser().parse_args(["equiv", str(path), "--batch-size", "32"])
    assert equiv.run(args, pool=pool) == 0, capsys.readouterr().out
    assert "all pass" in capsys.readouterr().out.splitlines()[-1]


BUILDER = '''
import keras


def build(input_shape, num_classes):
    model = keras.Sequential([keras.Input(input_shape), keras.layers.Dense(5, activation="tanh"),
                              keras.layers.Dense(num_classes)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
'''


def test_equiv_takes_a_builder_and_arrays_picked_by_key(pool, tmp_path, capsys):
    """A builder from a file, built for the shape of --inputs and the classes of --targets, both
    picked from one archive; its compiled loss is the one compared, and the report says so."""
    (tmp_path / "models.py").write_text(BUILDER)
    data = tmp_path / "data.npz"
    rng = np.random.default_rng(0)
    np.savez(data, x_test=rng.normal(size=(6, 4)).astype(np.float32),
             y_test=(np.arange(6) % 3).astype(np.int32), x_train=np.zeros((9, 4), np.float32))
    args = build_parser().parse_args(["equiv", f"{tmp_path / 'models.py'}:build", "--inputs",
                                      f"{data}:x_test", "--targets", f"{data}:y_test",
                                      "--steps", "2"])
    assert equiv.run(args, pool=pool) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert ("note: loss: SparseCategoricalCrossentropy (from_logits), the model's compiled loss"
            in out)
    assert "d loss / d " in out and "saved on tensorflow, loaded on jax" in out
    assert out.strip().splitlines()[-1].endswith("all pass")


def _python_example() -> str:
    text = (ROOT / "docs" / "equivalence.md").read_text()
    section = text[text.index("## Python API"):]
    return section[section.index("```python\n") + len("```python\n"):section.index("\n```\n")]


def test_the_python_example_of_the_docs_runs_on_a_classifier(pool, tmp_path, monkeypatch,
                                                             capsys):
    """docs/equivalence.md's Python API example (a classifier compiled with its own loss, no
    loss given to ``Case``) passes, with the session's workers standing in for its own."""
    import contextlib

    import kbackend.equivalence

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(kbackend.equivalence, "WorkerPool",
                        lambda *args, **kwargs: contextlib.nullcontext(pool))
    exec(compile(_python_example(), "docs/equivalence.md", "exec"), {})
    out = capsys.readouterr().out
    assert "loss: SparseCategoricalCrossentropy (from_logits), the model's compiled loss" in out
    assert out.strip().splitlines()[-1].endswith("all pass"), out
