"""The native engine (fused compiled train calls) on the session's backend.

Small synthetic data and a small MLP keep every test to a few seconds; each compares real
numbers: losses against Keras's own train step, fused against single steps, saved against live.
"""

from __future__ import annotations

import numpy as np
import pytest

from kbackend import data as data_module
from kbackend.engines import loop, native
from kbackend.engines.keras_fit import compile_model
from kbackend.errors import ConfigError
from kbackend.hardware.measure import FUSED_STEPS
from kbackend.models import ModelOptions, build_model
from kbackend.optim import OptimizerSpec
from kbackend.training import Target, TrainConfig
from tests.conftest import BACKEND, JIT_FOR_SMALL_RUNS

N_TRAIN = 320  # 20% of 400 goes to validation


def toy_dataset(seed: int = 0) -> data_module.Dataset:
    """A learnable 4-class problem: labels are the argmax of a fixed linear map."""
    rng = np.random.default_rng(seed)
    weights = rng.normal(size=(16, 4))
    x = rng.normal(size=(500, 16)).astype(np.float32)
    y = np.argmax(x @ weights, axis=1)
    return data_module.from_arrays("toy", x[:400], y[:400], x[400:], y[400:], num_classes=4,
                                   validation_fraction=0.2, seed=seed)


@pytest.fixture(scope="module")
def dataset() -> data_module.Dataset:
    return toy_dataset()


def toy_model(dataset, **options):
    return build_model("mlp", dataset.info, ModelOptions(widths=(32, 16), **options))


def run_native(model, dataset, spec, **config):
    """``native.train``; without XLA on TensorFlow unless the test asks (conftest's
    JIT_FOR_SMALL_RUNS: the XLA loop is compared with it in
    test_without_xla_the_loop_trains_the_same)."""
    config = TrainConfig(model="mlp", optimizer=spec,
                         **{"jit_compile": JIT_FOR_SMALL_RUNS, **config})
    return native.train(model, dataset, native.plan_of(config, dataset, spec), config)


def weights_of(model) -> list[np.ndarray]:
    return [np.asarray(w) for w in model.get_weights()]


@pytest.mark.slow
@pytest.mark.parametrize("spec", [
    OptimizerSpec("adam", 3e-3, epsilon=1e-3),
    OptimizerSpec("nesterov", 0.05, schedule="cosine", decay_steps=20, warmup_steps=3),
    OptimizerSpec("adamw", 1e-2, weight_decay=0.05, schedule="exponential", decay_steps=10),
], ids=["adam", "nesterov-cosine-warmup", "adamw-exponential"])
def test_native_matches_keras_train_steps(dataset, spec):
    """Same initial weights, batches (in order) and optimizer: the same 20-step loss curve."""
    keras_model = toy_model(dataset, l2=1e-3)  # l2: regularization must be in both losses
    native_model = toy_model(dataset, l2=1e-3)
    native_model.set_weights(keras_model.get_weights())
    batch = 16  # 20 steps = one epoch of 320 samples, no partial batch
    config = TrainConfig(model="mlp", optimizer=spec, batch_size=batch, epochs=1, fused_steps=5,
                         shuffle=False)
    compile_model(keras_model, spec, config)
    keras_losses = [
        float(keras_model.train_on_batch(dataset.x_train[i:i + batch], dataset.y_train[i:i + batch],
                                         return_dict=True)["loss"])
        for i in range(0, N_TRAIN, batch)
    ]
    history = native.train(native_model, dataset, native.plan_of(config, dataset, spec), config)
    assert history.step == list(range(1, 21))
    # Float32 through ~40 layers of XLA-fused arithmetic, compiled differently by the two
    # engines (fusion, FMA contraction): agreement to ~1e-5 relative, far below any real change.
    np.testing.assert_allclose(history.loss, keras_losses, rtol=2e-5, atol=1e-6)
    for got, want in zip(weights_of(native_model), weights_of(keras_model), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert np.mean(history.loss[-5:]) < np.mean(history.loss[:5])
    # The native run leaves Keras's own optimizer state in the model: iterations and slots
    # as train_on_batch left them (a saved model resumes training from it).
    got, want = ([np.asarray(v) for v in m.optimizer.variables] for m in (native_model,
                                                                      keras_model))
    assert int(got[0]) == int(want[0]) == 20 and len(got) == len(want)
    for native_slot, keras_slot in zip(got, want, strict=True):
        np.testing.assert_allclose(native_slot, keras_slot, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_fused_steps_equal_single_steps(dataset):
    spec = OptimizerSpec("momentum", 0.05)
    single, fused = toy_model(dataset), toy_model(dataset)
    fused.set_weights(single.get_weights())
    a = run_native(single, dataset, spec, batch_size=32, epochs=2, fused_steps=1, jit_compile=True)
    b = run_native(fused, dataset, spec, batch_size=32, epochs=2, fused_steps=4, jit_compile=True)
    assert a.step == b.step == list(range(1, 21))
    np.testing.assert_allclose(a.loss, b.loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(weights_of(fused), weights_of(single), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_one_compilation_per_call_length(dataset):
    # 320 / 32 = 10 steps per epoch, K = 4: calls of 4, 4, 2 every epoch -> two programs.
    history = run_native(toy_model(dataset), dataset, OptimizerSpec("sgd", 0.1),
                         batch_size=32, epochs=3, fused_steps=4, jit_compile=True)
    assert history.record.trace_counts == {"4": 1, "2": 1}
    assert history.steps_run == 30 and history.timing["compile_time"] > 0


@pytest.mark.slow
def test_batchnorm_and_dropout_train_and_save(dataset, tmp_path):
    import keras

    model = toy_model(dataset, batch_norm=True, dropout=0.3, seed=3)
    moving_before = [np.array(v.numpy()) for v in model.non_trainable_variables
                     if "moving" in v.path]
    assert moving_before, "the model should have BatchNormalization moving statistics"
    history = run_native(model, dataset, OptimizerSpec("adam", 1e-2), batch_size=32, epochs=6,
                         fused_steps=5, seed=3)
    moving_after = [np.array(v.numpy()) for v in model.non_trainable_variables
                    if "moving" in v.path]
    assert all(not np.allclose(a, b) for a, b in zip(moving_before, moving_after, strict=True))
    assert history.evals[-1]["val_accuracy"] >= 0.6  # chance is 0.25
    assert np.mean(history.loss[-10:]) < np.mean(history.loss[:10])
    # Reproducible from the seed: dropout masks come from the seeded generator state.
    again = toy_model(dataset, batch_norm=True, dropout=0.3, seed=3)
    history_again = run_native(again, dataset, OptimizerSpec("adam", 1e-2), batch_size=32,
                               epochs=6, fused_steps=5, seed=3)
    np.testing.assert_allclose(history_again.loss, history.loss, rtol=1e-5, atol=1e-6)
    # The trained values live in the Keras model: evaluate, predict and save/load work.
    predictions = model.predict(dataset.x_test, verbose=0)
    _, accuracy = model.evaluate(dataset.x_val, dataset.y_val, verbose=0)
    assert accuracy == pytest.approx(history.evals[-1]["val_accuracy"], abs=1e-6)
    path = tmp_path / "bn_dropout.keras"
    model.save(path)
    reloaded = keras.models.load_model(path)
    np.testing.assert_allclose(reloaded.predict(dataset.x_test, verbose=0), predictions,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_history_format_and_eval_schedule(dataset):
    class Reporter:
        def __init__(self):
            self.calls = []

        def epoch_end(self, epoch, epochs, record):
            self.calls.append((epoch, epochs, record["step"]))

    reporter = Reporter()
    spec = OptimizerSpec("sgd", 0.1)
    config = TrainConfig(model="mlp", optimizer=spec, batch_size=32, epochs=2, fused_steps=2,
                         eval_every=5)
    history = native.train(toy_model(dataset), dataset, native.plan_of(config, dataset, spec),
                           config, reporter)
    # Calls end at steps 2, 4, 6, ...: validation runs after the first call passing 5, 10, ...
    assert [e["step"] for e in history.evals] == [6, 10, 16, 20]
    assert [c[0] for c in reporter.calls] == [1, 1, 2, 2] and reporter.calls[0][1] == 2
    assert history.step == list(range(1, 21)) and all(np.diff(history.time) >= 0)
    assert set(history.evals[0]) >= {"step", "epoch", "train_time", "val_loss", "val_accuracy",
                                     "train_loss"}
    assert history.evals[0]["train_loss"] == pytest.approx(np.mean(history.loss[:6]), rel=1e-6)
    timing = history.timing
    assert timing["train_time"] >= timing["compile_time"] > 0 and timing["eval_time"] > 0


def test_target_and_max_steps_stop_the_run(dataset):
    history = run_native(toy_model(dataset), dataset, OptimizerSpec("adam", 1e-2),
                         batch_size=32, epochs=50, fused_steps=5,
                         target=Target("val_accuracy", 0.6))
    reached = history.record.target_reached
    assert reached["epoch"] < 50 and history.evals[-1]["val_accuracy"] >= 0.6
    assert reached["step"] == history.steps_run
    capped = run_native(toy_model(dataset), dataset, OptimizerSpec("sgd", 0.1), batch_size=32,
                        epochs=5, fused_steps=4, max_steps=13)
    assert capped.steps_run == 13 and capped.evals[-1]["step"] == 13
    # Epoch 1: calls of 4, 4, 2; epoch 2: 3 (cut short by max_steps).
    assert capped.record.trace_counts == {"4": 1, "2": 1, "3": 1}


def test_early_stopping_restores_best(dataset):
    # A learning rate far too large: validation loss gets worse, so patience runs out.
    model = toy_model(dataset)
    history = run_native(model, dataset, OptimizerSpec("sgd", 3.0), batch_size=32, epochs=30,
                         early_stopping=2, monitor="val_loss")
    assert history.stopped_early and history.record.epochs_run < 30
    best = min(e["val_loss"] for e in history.evals)
    loss, _ = model.evaluate(dataset.x_val, dataset.y_val, verbose=0)
    assert loss == pytest.approx(best, rel=1e-4)


@pytest.mark.parametrize(("make", "message"), [
    (lambda ds: run_native(toy_model(ds), ds, OptimizerSpec("sgd", 0.1), batch_size=32,
                           fused_steps=11), r"fused_steps 11.*only 10 full batches"),
    (lambda ds: OptimizerSpec("sgd", 0.0), "learning.rate"),
    (lambda ds: OptimizerSpec("sgd", -1e-3), "learning.rate"),
    (lambda ds: OptimizerSpec("lion"), "Unknown optimizer"),
    (lambda ds: TrainConfig(fused_steps=-1), "fused_steps"),
])
def test_bad_input_is_refused(dataset, make, message):
    with pytest.raises(ConfigError, match=message):
        make(dataset)


@pytest.mark.slow
def test_cli_trains_natively(cli, tmp_path):
    history_path = tmp_path / "history.json"
    ok = cli("train", "--engine", "native", "--fused-steps", "8", "--epochs", "2",
             "--optimizer", "sgd", "--lr", "0.1", "--history", str(history_path), "--quiet")
    assert ok.returncode == 0, ok.stderr
    assert "engine native" in ok.stdout and history_path.is_file()
    assert float(ok.stdout.split("val_accuracy ")[1].split()[0]) > 0.8


def test_fused_steps_auto_is_measured_once_per_machine(dataset, tmp_path, monkeypatch):
    monkeypatch.setenv("KBACKEND_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KBACKEND_COMPILE_CACHE", raising=False)
    spec = OptimizerSpec("sgd", 0.1)
    # The caching is under test, not the probe (test_fused_steps_auto_picks_a_measured_k): a
    # stand-in answers at once (four real probes were 12 compilations, minutes on TensorFlow).
    calls = []
    monkeypatch.setattr(native, "probe_fused_steps",
                        lambda *a, **kw: calls.append(a) or (8, {1: 3.0, 8: 1.0},
                                                             {1: 0.0, 8: 0.0}))
    k, first = native.cached_probe_fused_steps(toy_model(dataset), dataset, spec, 32)
    assert first["cached"] is False and (tmp_path / FUSED_STEPS.file_name).is_file()
    assert k == 8 and len(calls) == 1
    calls.clear()
    # Another model of the same architecture (other weights): the stored answer, no probe.
    again, second = native.cached_probe_fused_steps(toy_model(dataset), dataset, spec, 32)
    assert (again, second["cached"], calls) == (k, True, [])
    # Another batch size is another question.
    native.cached_probe_fused_steps(toy_model(dataset), dataset, spec, 16)
    assert len(calls) == 1

    def cached() -> bool:
        """Whether a probe at batch size 32 was answered from the stored file."""
        return native.cached_probe_fused_steps(toy_model(dataset), dataset, spec, 32)[1]["cached"]

    # A corrupt file is measured again and replaced; the cache switched off always measures.
    (tmp_path / FUSED_STEPS.file_name).write_text("{not json")
    assert cached() is False
    assert cached() is True
    monkeypatch.setenv("KBACKEND_COMPILE_CACHE", "0")
    assert cached() is False
    assert len(calls) == 3


def test_cli_refuses_a_too_large_k(cli):
    bad = cli("train", "--engine", "native", "--fused-steps", "1000", "--epochs", "1")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "Invalid fused_steps 1000" in bad.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_fused_steps_auto_picks_a_measured_k(dataset):
    model = toy_model(dataset)
    before = weights_of(model)
    best, timings, cv = native.probe_fused_steps(model, dataset, OptimizerSpec("sgd", 0.1), 32)
    assert set(timings) == {1, 8, 10} == set(cv) and best in timings  # 32: capped at 10
    assert all(v > 0 for v in timings.values())
    for got, want in zip(weights_of(model), before, strict=True):
        np.testing.assert_array_equal(got, want)  # the probe trains a clone
    history = run_native(model, dataset, OptimizerSpec("sgd", 0.1), batch_size=32, epochs=1,
                         fused_steps=0)
    probe = history.record.fused_steps_probe
    assert history.record.fused_steps == int(min(probe["us_per_step"],
                                                   key=probe["us_per_step"].get))
    assert history.steps_run == 10


class _Layers:
    """A stand-in model: only what ``capabilities.unrolls_its_loop`` reads (its layers' types)."""

    def __init__(self, *layer_types: type) -> None:
        self.layers = [kind() for kind in layer_types]

    def _flatten_layers(self):
        return self.layers


Conv2D = type("Conv2D", (), {})
Conv1D = type("Conv1D", (), {})
Dense = type("Dense", (), {})


@pytest.mark.parametrize(("layers", "platform", "unrolled"), [
    ((Conv2D, Dense), "cpu", True),
    ((Conv1D,), "cpu", True),
    ((Dense, Dense), "cpu", False),  # negative control: no convolution, the loop stays
    ((Conv2D, Dense), "gpu", False),
    ((Conv2D, Dense), "tpu", False),
])
def test_only_conv_models_on_a_cpu_unroll_their_loop(layers, platform, unrolled):
    from kbackend.backends import capabilities

    assert capabilities.unrolls_its_loop(_Layers(*layers), platform) is unrolled
    # A loop that is not an XLA program (TensorFlow's --no-jit graph) is never written out.
    assert capabilities.unrolls_its_loop(_Layers(*layers), platform, xla=False) is False


@pytest.mark.slow
def test_conv_models_unroll_their_steps_on_a_cpu_and_train_the_same(dataset, monkeypatch):
    """A convolution inside XLA:CPU's while loop (``lax.scan`` on JAX, ``tf.range`` on TF) ran
    ~25-45x slower, so conv models' K-step calls are written out step by step
    (``capabilities.unrolls_its_loop``), at most ``MAX_UNROLLED_STEPS`` per call (the program
    holds a copy of the step per step; set to 2 here to keep the test short: a K = 4 asked runs
    calls of 2); the steps themselves are unchanged: two calls of 2 end with the losses and
    weights of four calls of K = 1 (rtol 1e-5: the same ops, which XLA may fuse differently).
    On TF the unrolled program's first call trains and puts the values back: a run whose
    weights were disturbed by that call would not match."""
    from kbackend.backends import impl
    from kbackend.training import train

    if impl().platform() != "cpu":
        pytest.skip("the loop is unrolled on a CPU only")

    def run(k):
        config = TrainConfig(model="cnn", engine="native", fused_steps=k, epochs=1, max_steps=4,
                             eval_every=4, batch_size=32)
        return train(config)

    monkeypatch.setattr(loop, "MAX_UNROLLED_STEPS", 2)
    fused, single = run(4), run(1)
    assert fused.history.record.unrolled_loop is True
    assert single.history.record.unrolled_loop is True
    assert fused.history.record.fused_steps == 2 and fused.history.record.fused_steps_asked == 4
    assert set(fused.history.record.trace_counts) == {"2"}
    assert single.history.record.fused_steps_asked is None
    monkeypatch.undo()
    assert len(fused.history.loss) == 4
    np.testing.assert_allclose(fused.history.loss, single.history.loss, rtol=1e-5)
    for got, want in zip(weights_of(fused.model), weights_of(single.model), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    mlp = toy_model(dataset)  # no convolution: the loop stays a loop
    trainer = impl().native_trainer(mlp, OptimizerSpec("sgd", 0.1), dataset)
    assert trainer.run_record.unrolled_loop is False
    # ``--fused-steps auto`` tries no more than MAX_UNROLLED_STEPS copies of an unrolled step.
    assert native.probe_candidates(fused.model) == (1, 8)
    assert native.probe_candidates(mlp) == native.PROBE_CANDIDATES
    # Without XLA (TensorFlow's --no-jit) there is no XLA:CPU loop to avoid: nothing written out.
    assert impl().native_loop_uses_xla(False) is (BACKEND == "jax")
    unrolled_without_xla = (1, 8) if BACKEND == "jax" else native.PROBE_CANDIDATES
    assert native.probe_candidates(fused.model, jit_compile=False) == unrolled_without_xla


@pytest.mark.skipif(BACKEND != "tensorflow",
                    reason="TensorFlow's loop: JAX's one-step call trains as fast in its scan")
def test_a_one_step_call_has_no_loop_on_tensorflow(dataset):
    """K = 1 needs no loop, and TF's loop made the seed MLP's step ~40% slower on a CPU: a
    one-step call is the step written out (that it trains like K steps: the fused-vs-single
    tests above)."""
    import tensorflow as tf

    from kbackend.backends import impl

    trainer = impl().native_trainer(toy_model(dataset), OptimizerSpec("sgd", 0.1), dataset)
    rows = trainer.put_epoch(np.arange(64).reshape(2, 32))

    def op_types(length: int) -> set[str]:
        trainer.compile(length, rows)
        graph = trainer._compiled[length].get_concrete_function(
            trainer.x_train, trainer.y_train, rows, tf.constant(0), tf.constant(length)).graph
        return {op.type for op in graph.get_operations()}

    loops = {"While", "StatelessWhile"}
    assert not loops & op_types(1)
    assert loops & op_types(2)
    assert trainer.writes_out(1) and not trainer.writes_out(2)


def test_without_xla_the_loop_trains_the_same(dataset):
    """``--no-jit``: TensorFlow runs the native loop as a ``tf.function`` graph without XLA (no
    XLA program compiled); JAX's loop is one XLA program either way. The steps are the same:
    losses, validation metrics and weights within 1e-5 relative of the XLA run (XLA fuses the
    same float32 ops differently), BatchNormalization's moving statistics included."""
    spec = OptimizerSpec("adam", 1e-2)
    with_xla, without = toy_model(dataset, batch_norm=True), toy_model(dataset, batch_norm=True)
    without.set_weights(with_xla.get_weights())
    run = {"batch_size": 32, "epochs": 2, "fused_steps": 5}
    a = run_native(with_xla, dataset, spec, jit_compile=True, **run)
    b = run_native(without, dataset, spec, jit_compile=False, **run)
    assert a.record.xla is True and b.record.xla is (BACKEND == "jax")
    if BACKEND == "tensorflow":
        assert a.record.xla_programs["programs"] > 0 and b.record.xla_programs["programs"] == 0
    assert a.step == b.step == list(range(1, 21))
    np.testing.assert_allclose(b.loss, a.loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose([e["val_loss"] for e in b.evals], [e["val_loss"] for e in a.evals],
                               rtol=1e-5, atol=1e-6)
    for got, want in zip(weights_of(without), weights_of(with_xla), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_a_saved_native_run_holds_its_optimizer_state(tmp_path, optimizer):
    """The .keras file of a native run resumes: iterations = the steps run, each slot saved."""
    import keras

    from kbackend.training import train

    result = train(TrainConfig(model="mlp", engine="native", batch_size=64, epochs=1, fused_steps=4,
                               optimizer=OptimizerSpec(optimizer, 0.01),
                               model_options=ModelOptions(widths=(16,))),
                   save=tmp_path / "m.keras")
    saved = [np.asarray(v) for v in keras.saving.load_model(tmp_path / "m.keras")
             .optimizer.variables]
    trained = [np.asarray(v) for v in result.model.optimizer.variables]
    assert int(saved[0]) == result.history.steps_run == 20
    assert len(saved) == 2 + {"sgd": 0, "momentum": 1, "adam": 2}[optimizer] * 4
    assert all(np.any(slot) for slot in saved[2:])
    for a, b in zip(saved, trained, strict=True):
        np.testing.assert_array_equal(a, b)
