"""A model that starts with string preprocessing (issue 46, item 1): the front split off, adapted
on the training split only, run on the host once per split; the rest trained by every engine as
plain Keras ``fit`` trains it; the whole model saved, answering raw strings in predict, serve and
export; the models it cannot split refused in one line before any work."""

from __future__ import annotations

import json
import os
import threading
import urllib.request

import numpy as np
import pytest

import kbackend
from kbackend import data as data_module
from kbackend.backend_choice import keras as import_keras
from kbackend.config import TrainConfig
from kbackend.errors import DataError, KBackendError
from kbackend.host_front import HostFront
from kbackend.model_sources import load_model
from kbackend.optim import OptimizerSpec
from kbackend.serving.model import BatchPredictor, validate_inputs
from kbackend.training import train
from kbackend.workload import TEST_SPLIT_SEED, _held_out, prepare_workload, unwrap
from tests.conftest import JIT_FOR_SMALL_RUNS

keras = import_keras()
POSITIVE = ("good", "great", "fine", "nice", "superb", "lovely")
NEGATIVE = ("bad", "awful", "poor", "dull", "weak", "boring")
FILLER = ("the", "movie", "plot", "cast", "was", "a", "very", "and", "film", "it")


def reviews(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` short reviews (filler words and two of the label's words) and their 0/1 labels."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n)
    texts = []
    for label in labels:
        words = [*rng.choice(FILLER, 5), *rng.choice(POSITIVE if label else NEGATIVE, 2)]
        rng.shuffle(words)
        texts.append(" ".join(words))
    return np.array(texts), labels


X, Y = reviews(400)


def text_classifier(vocabulary: list[str] | None = None) -> object:
    """keras.io's text classification, small: raw strings in, TextVectorization first."""
    vectorizer = keras.layers.TextVectorization(max_tokens=40, output_sequence_length=8,
                                                vocabulary=vocabulary)
    inputs = keras.Input(shape=(1,), dtype="string")
    hidden = keras.layers.Embedding(40, 8)(vectorizer(inputs))
    hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    model = keras.Model(inputs, keras.layers.Dense(2)(hidden), name="reviews")
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def _raw_train_split(n: int, validation_fraction: float = 0.1, seed: int = 0) -> np.ndarray:
    """The rows of ``X`` the workload trains on (its held-out test and validation draws)."""
    keep, _ = _held_out(n, validation_fraction, TEST_SPLIT_SEED)
    train_rows, _ = data_module.validation_indices(len(keep), validation_fraction, seed)
    return keep[train_rows]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["native", "keras"])
def test_the_rest_trains_as_keras_fit_on_the_same_split(engine, tmp_path):
    """Same initial weights, same split, same batch order: after 20 SGD steps the trained
    model's predictions equal plain Keras ``fit``'s within 1e-4; the front was adapted on the
    training split only and gives what Keras's own layer gives; the saved file answers raw
    strings."""
    workload = prepare_workload(text_classifier(), x=X, y=Y, seed=0)
    rest = workload.first_model()
    user = unwrap(rest)
    reference = keras.models.clone_model(user)
    reference.set_weights(user.get_weights())
    train_rows = _raw_train_split(len(X))
    vectorizer = reference.layers[1]
    vectorizer.adapt(X[train_rows])  # Keras's own adapt, on the training split alone
    assert vectorizer.get_vocabulary() == user.layers[1].get_vocabulary()
    ids = keras.ops.convert_to_numpy(vectorizer(X[train_rows]))
    np.testing.assert_array_equal(ids, workload.dataset.x_train)
    config = TrainConfig(model=workload.model_name, dataset=workload.dataset.info.name,
                         optimizer=OptimizerSpec("sgd", 0.5), batch_size=16, epochs=1,
                         max_steps=20, engine=engine, fused_steps=1, seed=0, task=workload.task,
                         jit_compile=JIT_FOR_SMALL_RUNS)
    result = train(config, workload=workload, save=tmp_path / "reviews.keras")
    assert result.history.steps_run == 20
    order = data_module.batching.epoch_order(len(ids), 0, 0)[:20 * 16]
    reference_rest = keras.Model(reference.layers[2].input, reference.outputs[0])
    reference_rest.compile(keras.optimizers.SGD(0.5), loss=keras.losses.
                           SparseCategoricalCrossentropy(from_logits=True))
    probe = X[:25]
    probe_ids = keras.ops.convert_to_numpy(vectorizer(probe))
    before = reference_rest.predict(probe_ids, verbose=0)
    reference_rest.fit(ids[order], Y[train_rows][order], batch_size=16, epochs=1,
                       shuffle=False, verbose=0)
    want = reference_rest.predict(probe_ids, verbose=0)
    assert np.abs(want - before).max() > 1e-2  # 20 steps moved the predictions
    served = BatchPredictor(load_model(tmp_path / "reviews.keras", serving=True))
    got = served(validate_inputs(probe, served.input_shape, strings=True))
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert result.model is user  # the whole model: what was saved


def test_kbackend_train_saves_a_model_that_takes_raw_strings(tmp_path):
    """``kbackend.train`` on raw strings, the saved ``.keras`` reloaded: its vocabulary is the
    trained one and it predicts from strings as the trained model did."""
    result = kbackend.train(text_classifier(), X, Y, epochs=4, learning_rate=0.05,
                            fused_steps=1, progress=False, save=tmp_path / "m.keras")
    assert result.history.best("val_accuracy") >= 0.9
    saved = keras.saving.load_model(tmp_path / "m.keras")
    assert type(saved.layers[1]).__name__ == "TextVectorization"
    assert saved.layers[1].get_vocabulary() == result.model.layers[1].get_vocabulary()
    predictor = BatchPredictor(saved)
    texts = np.array(["a great and lovely film", "an awful boring plot"])
    scores = predictor(validate_inputs(texts, predictor.input_shape, strings=True))
    assert list(np.argmax(scores, axis=1)) == [1, 0]


def test_a_given_vocabulary_is_kept_and_the_host_pass_is_cached(tmp_path, monkeypatch):
    """A layer that holds a vocabulary is not adapted again; the host pass is read back from
    the cache the second time (keyed by the front's and the split's digests)."""
    monkeypatch.setenv("KBACKEND_CACHE_DIR", str(tmp_path))
    words = [*POSITIVE, *NEGATIVE, "the"]
    first = prepare_workload(text_classifier(words), x=X, y=Y, seed=0)
    assert not any(note.startswith("adapted on") for note in first.notes)
    assert unwrap(first.first_model()).layers[1].get_vocabulary()[2:] == words
    cached = sorted(tmp_path.glob("front-*.npy"))
    assert len(cached) == 3  # train, val, test
    calls = []
    monkeypatch.setattr(HostFront, "_run", lambda self, x, layers: calls.append(1))
    second = prepare_workload(text_classifier(words), x=X, y=Y, seed=0)
    assert calls == []
    np.testing.assert_array_equal(second.dataset.x_train, first.dataset.x_train)


def test_every_seed_gets_the_first_models_vocabulary():
    """A builder returning an unadapted front: the vocabulary adapted once, copied to each
    seed's model (fresh weights), so every saved model reads the data as it was prepared."""
    workload = prepare_workload(text_classifier, x=X, y=Y, seed=0)
    first = unwrap(workload.first_model())
    other = unwrap(workload.build(1))
    assert other is not first
    assert other.layers[1].get_vocabulary() == first.layers[1].get_vocabulary()
    assert not np.allclose(other.layers[2].get_weights()[0], first.layers[2].get_weights()[0])


def test_string_lookup_and_hashing_fronts_and_sequential_models():
    """A Sequential model whose first layers are StringLookup (adapted here) and an
    IntegerLookup-free Hashing chain: both train; Normalization stays in the model."""
    colours = np.array(["red", "green", "blue", "red", "blue"] * 40)
    y = (colours == "red").astype(np.int32)
    lookup = keras.Sequential([keras.Input((1,), dtype="string"), keras.layers.StringLookup(),
                               keras.layers.Embedding(5, 4), keras.layers.Flatten(),
                               keras.layers.Dense(2)])
    lookup.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                   metrics=["accuracy"])
    result = kbackend.train(lookup, colours, y, epochs=4, learning_rate=0.1, progress=False,
                            fused_steps=1)
    assert result.history.best("val_accuracy") == 1.0
    hashed = keras.Sequential([keras.Input((1,), dtype="string"), keras.layers.Hashing(16),
                               keras.layers.Normalization(), keras.layers.Dense(2)])
    workload = prepare_workload(hashed, x=colours, y=y)
    assert [type(layer).__name__ for layer in workload.front.layers] == ["Hashing"]
    assert workload.dataset.x_train.max() < 16


class Subclassed(keras.Model):
    def __init__(self) -> None:
        super().__init__()
        self.vectorizer = keras.layers.TextVectorization(max_tokens=20,
                                                         output_sequence_length=4)
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(keras.ops.cast(self.vectorizer(x), "float32"))


def _front_after_a_dense_layer() -> object:
    inputs = keras.Input((1,), dtype="string")
    vectorized = keras.layers.TextVectorization(max_tokens=20, output_sequence_length=4)(inputs)
    hidden = keras.layers.Dense(4)(keras.ops.cast(vectorized, "float32"))
    ids = keras.layers.IntegerLookup(vocabulary=[0, 1])(keras.ops.cast(hidden, "int64"))
    return keras.Model(inputs, keras.layers.Dense(2)(keras.ops.cast(ids, "float32")))


@pytest.mark.parametrize(("make", "message"), [
    (lambda: (lambda: Subclassed()), "is subclassed"),
    (_front_after_a_dense_layer, "that is not at its input"),
])
def test_a_front_that_cannot_be_split_is_one_line(make, message, engines_never_run):
    with pytest.raises(KBackendError, match=message) as raised:
        kbackend.train(make(), X, Y, epochs=1, progress=False)
    assert "\n" not in str(raised.value)


def test_numbers_for_a_string_model_and_strings_for_serving_are_one_line():
    with pytest.raises(DataError, match="takes strings") as raised:
        validate_inputs(np.zeros((2, 1)), (1,), "inputs", strings=True)
    assert "\n" not in str(raised.value)
    with pytest.raises(DataError, match=r"expected strings of shape \(N, 1\)"):
        validate_inputs(np.array([["a", "b"]]), (1,), "inputs", strings=True)
    with pytest.raises(KBackendError, match="the model takes strings") as raised:
        prepare_workload(text_classifier(), x=np.zeros((40, 1), np.float32), y=Y[:40])
    assert "\n" not in str(raised.value)


@pytest.fixture(scope="module")
def saved_text_model(tmp_path_factory):
    """A text model trained on raw strings and saved (its front adapted)."""
    path = tmp_path_factory.mktemp("text-model") / "m.keras"
    kbackend.train(text_classifier(), X, Y, epochs=3, learning_rate=0.05, fused_steps=1,
                   progress=False, save=path)
    return path


def test_export_and_predict_take_raw_strings(saved_text_model, tmp_path, cli):
    """``export --format keras`` checks the artifact on a sample of texts drawn from the
    vocabulary; ``predict`` reads a .npy of strings; ``--cache`` is refused in one line."""
    from kbackend.backend_choice import active_backend
    from kbackend.serving.export import export_model

    manifest = export_model(saved_text_model, "keras", tmp_path / "export", rows=8,
                            check_backends=(active_backend(),))
    assert manifest["ok"] and manifest["sample_rows"] == 8
    texts = tmp_path / "texts.npy"
    np.save(texts, np.array(["a superb and lovely film", "an awful boring plot"]))
    result = cli("predict", "--model", saved_text_model, "--input", texts, "--out",
                 tmp_path / "p.npy")
    assert result.returncode == 0, result.stderr
    assert list(np.argmax(np.load(tmp_path / "p.npy"), axis=1)) == [1, 0]
    result = cli("predict", "--model", saved_text_model, "--input", texts, "--out",
                 tmp_path / "q.npy", "--cache", tmp_path / "cache.sqlite")
    assert result.returncode == 2 and "Cannot cache a model that takes strings" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "cache.sqlite").exists()


def test_the_saved_model_serves_raw_strings(saved_text_model):
    """``kbackend serve``'s server on the saved text model: a JSON list of strings in,
    predictions out; numbers refused with 422."""
    from kbackend.serving.server import PredictionServer

    predictor = BatchPredictor(load_model(saved_text_model, serving=True))
    server = PredictionServer("127.0.0.1", 0, predict=predictor,
                              row_shape=predictor.input_shape, info={},
                              strings=predictor.takes_strings)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        def post(inputs: object) -> tuple[int, dict]:
            request = urllib.request.Request(
                f"{server.url}/predict", data=json.dumps({"inputs": inputs}).encode(),
                headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    return response.status, json.loads(response.read())
            except urllib.error.HTTPError as error:
                return error.code, json.loads(error.read())

        status, body = post(["a great and lovely film", "an awful, boring plot"])
        assert status == 200 and np.asarray(body["predictions"]).shape == (2, 2)
        assert status == 200 and list(np.argmax(body["predictions"], axis=1)) == [1, 0]
        status, _ = post([[1.0], [2.0]])
        assert status == 422
    finally:
        server.shutdown()
        server.server_close()


def _text_folder(root, texts: np.ndarray, labels: np.ndarray):
    for index, (text, label) in enumerate(zip(texts, labels, strict=True)):
        folder = root / ("pos" if label else "neg")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{index}.txt").write_text(str(text))
    return root


def embedding_classifier(input_shape):
    """A model without string preprocessing, for token ids."""
    model = keras.Sequential([keras.Input(input_shape), keras.layers.Embedding(20_000, 4),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def test_a_text_folder_uses_the_models_own_layer_else_the_built_in_one(tmp_path):
    """The model's own TextVectorization (length 8, adapted on the folder's training split);
    kbackend's built-in one (length 200) only for a model without one, said in one line."""
    folder = _text_folder(tmp_path / "reviews", X[:200], Y[:200])
    own = prepare_workload(text_classifier, str(folder))
    assert own.dataset.x_train.shape[1:] == (8,)
    assert any("string preprocessing (TextVectorization) run on the host" in note
               for note in own.notes)
    assert not any("kbackend's TextVectorization" in note for note in own.notes)
    built_in = prepare_workload(embedding_classifier, str(folder))
    assert built_in.dataset.x_train.shape[1:] == (200,)
    assert built_in.front is None
    assert sum("kbackend's TextVectorization" in note for note in built_in.notes) == 1


@pytest.mark.slow  # a study in this process: ~20-40 s
def test_a_study_of_a_live_text_model_on_raw_strings(tmp_path):
    """``kbackend.study`` on a live text model and raw strings: its runs adapt and run the
    front themselves (the raw texts stored under ``out``), and the best cell is typed."""
    result = kbackend.study(text_classifier(), X, Y, optimizers=("adam",), batch_sizes=(16, 64),
                            target=0.9, seeds=1, lr_grid_size=1, max_steps=200,
                            noise_points=0, step_time_repeats=0, out=tmp_path, progress=False,
                            confirm_seeds=0)
    assert result.best is not None and result.best.optimizer == "adam"
    assert list((tmp_path / "data").glob("texts-*.npz"))


@pytest.mark.devices
@pytest.mark.skipif(int(os.environ.get("KBACKEND_VIRTUAL_DEVICES") or 0) != 8,
                    reason="needs KBACKEND_VIRTUAL_DEVICES=8 set before the runtime starts")
@pytest.mark.parametrize("engine", ["data_parallel", "keras_data_parallel"])
def test_the_data_parallel_engines_train_a_text_model(engine, tmp_path):
    """The data-parallel engines share the path: the front's output split over 8 devices."""
    result = kbackend.train(text_classifier(), X, Y, epochs=3, learning_rate=0.05,
                            engine=engine, fused_steps=1, batch_size=32, progress=False,
                            save=tmp_path / "m.keras")
    assert result.history.best("val_accuracy") >= 0.9
    assert keras.saving.load_model(tmp_path / "m.keras").layers[1].vocabulary_size() > 2
