"""``--batch-size auto`` end to end on the native engine: a run on a built-in workload grows its
batch, reaches its target, records each step range, compiles each size once, and prints each
change; bad bounds and unsupported engines are one-line errors before any work."""

from __future__ import annotations

import math

import pytest

from kbackend.adaptive import AutoBatchSize
from kbackend.errors import ConfigError
from kbackend.optim import OptimizerSpec
from kbackend.training import Target, TrainConfig, train
from tests.conftest import JIT_FOR_SMALL_RUNS


def auto_config(**overrides) -> TrainConfig:
    """Digits with the seed MLP: 1,293 training samples, B_simple of a few hundred (the study
    measures ~166 at step 0 and ~377 later), so an auto run from 8 grows within 2 epochs."""
    fields = dict(model="seed_mlp", dataset="digits", engine="native", batch_size="auto:8:128",
                  optimizer=OptimizerSpec("adam", 3e-3), epochs=6, fused_steps=8,
                  eval_every=40, seed=0, jit_compile=JIT_FOR_SMALL_RUNS,
                  target=Target("val_accuracy", 0.93))
    return TrainConfig(**{**fields, **overrides})


@pytest.fixture(scope="module", autouse=True)
def measured_every_step():
    """These tests are of the growth mechanics on a short digits run, whose expectations
    (growth before the target at step ~80) need the estimate warm by step 40: every step is
    measured (the reference estimator); the default, one in 16, is measured against it by
    ``bench_adaptive --part estimator``."""
    from kbackend.engines import adaptive

    adaptive.MEASURE_EVERY = 1
    yield
    adaptive.MEASURE_EVERY = adaptive.DEFAULT_MEASURE_EVERY


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory, measured_every_step):
    """The auto run, its TensorBoard scalars written to ``result.tensorboard``."""
    folder = tmp_path_factory.mktemp("tensorboard")
    result = train(auto_config(), tensorboard=folder)
    result.tensorboard = folder
    return result


@pytest.mark.slow
def test_an_auto_run_grows_and_reaches_its_target(auto_run):
    history = auto_run.history
    record = history.record.adaptive_batch
    sizes = [r["batch_size"] for r in record["ranges"]]
    # Grows, never shrinks, powers of two within [MIN, MAX].
    assert sizes[0] == 8 and len(set(sizes)) >= 2, sizes
    assert sizes == sorted(sizes) and all(8 <= s <= 128 and s & (s - 1) == 0 for s in sizes)
    # The target (0.93 validation accuracy on digits) is reached, and the test split agrees to
    # within a few points (measured 0.94-0.97 on both backends).
    assert history.record.target_reached is not None
    assert history.test["test_accuracy"] >= 0.88
    # Each range records its rate (sqrt scaling from 3e-3 at 8) and the estimate behind it.
    for change in record["ranges"][1:]:
        assert change["learning_rate"] == pytest.approx(3e-3 * math.sqrt(change["batch_size"]
                                                                        / 8))
        assert change["b_simple"] is not None and change["b_simple"] > 0
    assert record["noise_steps"] > 0 and record["knee_probe"] is None  # MAX was given


@pytest.mark.slow
def test_a_growing_run_compiles_each_size_once(auto_run):
    traces = auto_run.history.record.adaptive_batch["trace_counts_by_size"]
    assert traces and set(traces.values()) == {1}
    sizes = {int(key.split("x")[0]) for key in traces}
    grown_to = {r["batch_size"] for r in auto_run.history.record.adaptive_batch["ranges"]}
    # The sizes it grew to, and (compiled ahead in the background, JAX) the next power of two
    # of each within MAX.
    assert grown_to <= sizes <= grown_to | {2 * s for s in grown_to if 2 * s <= 128}
    # At most log2(MAX / MIN) + 1 sizes, each with at most a few call lengths (K, an epoch's
    # rest, and a rest after a change inside an epoch).
    assert len(sizes) <= int(math.log2(128 / 8)) + 1
    assert all(count <= 3 for count in
               [sum(1 for k in traces if int(k.split("x")[0]) == s) for s in sizes])


@pytest.mark.slow
def test_changes_happen_at_evaluation_points_at_most_once_each(auto_run):
    history = auto_run.history
    eval_steps = {e["step"] for e in history.evals}
    ranges = history.record.adaptive_batch["ranges"]
    changes = [r["step"] for r in ranges[1:]]
    assert set(changes) <= eval_steps
    assert len(changes) == len(set(changes))


@pytest.mark.parametrize(("batch_size", "message"), [
    ("auto:64:8", "MIN is above MAX"),
    ("auto:12:64", "powers of two"),
    ("auto:0:64", "positive integer"),
    ("auto:x:64", "is not an integer"),
])
def test_bad_bounds_are_one_line_errors(batch_size, message):
    with pytest.raises(ConfigError, match=message) as error:
        auto_config(batch_size=batch_size)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"engine": "keras"}, "runs on the native engine"),
    ({"engine": "keras", "data_parallel": True}, "runs on the native engine"),
    ({"num_processes": 2, "coordinator": "127.0.0.1:12355"}, "in one process"),
    ({"optimizer": OptimizerSpec("adam", 1e-3, schedule="cosine")}, "--schedule constant"),
    ({"lr_scaling": "cubic"}, "Invalid --lr-scaling"),
])
def test_what_auto_cannot_do_is_refused_before_any_work(overrides, message):
    with pytest.raises(ConfigError, match=message):
        auto_config(**overrides)


def test_auto_forms_of_the_python_api():
    assert auto_config(batch_size="auto").adaptive_batch == AutoBatchSize()
    assert auto_config(batch_size="auto").batch_size == 8
    assert auto_config(batch_size=AutoBatchSize(16, 64)).batch_size == 16
    assert auto_config(batch_size=32).adaptive_batch is None


@pytest.mark.slow
def test_train_prints_each_change(cli, tmp_path):
    result = cli("train", "--engine", "native", "--model", "seed_mlp", "--dataset", "digits",
                 "--batch-size", "auto:8:64", "--lr", "0.003", "--epochs", "2",
                 "--eval-every", "40", "--fused-steps", "8")
    assert result.returncode == 0, result.stderr
    assert "batch size auto:8:64" in result.stdout
    assert "8 (step 0" in result.stdout


def test_bad_bounds_on_the_command_line_are_one_line_errors(cli):
    result = cli("train", "--engine", "native", "--batch-size", "auto:64:8")
    assert result.returncode == 2
    assert "MIN is above MAX" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


@pytest.mark.slow
def test_runs_share_one_adaptive_trainer_and_train_as_train_does():
    """``engines.native.Runs`` (the study's path): auto runs of one optimizer reuse one
    ``AdaptiveTrainer``, so a second run compiles no size again, and each run from the same
    initial values grows and trains as ``train()`` on a fresh model does."""
    import numpy as np

    from kbackend.engines.native import Runs, model_values
    from kbackend.models import ModelOptions, build_model
    from kbackend.training import workload_of

    config = auto_config()
    dataset = workload_of(config).dataset

    def fresh():
        return build_model("seed_mlp", dataset.info, ModelOptions(seed=0))

    expected = train(config, model=fresh(), dataset=dataset).history
    runs, values = Runs(fresh(), dataset), model_values(fresh())
    first, second = runs.train(config, values), runs.train(config, values)
    assert runs.trainers_built == 1
    ranges = [(r["step"], r["batch_size"]) for r in expected.record.adaptive_batch["ranges"]]
    assert len(ranges) >= 2, ranges
    for history in (first, second):
        assert [(r["step"], r["batch_size"])
                for r in history.record.adaptive_batch["ranges"]] == ranges
        np.testing.assert_allclose(history.loss, expected.loss, rtol=1e-4, atol=1e-5)
        assert history.test["test_accuracy"] == pytest.approx(
            expected.test["test_accuracy"], abs=1e-6)
    # every (size, call length) traced once over both runs: the second compiled nothing
    assert set(second.record.adaptive_batch["trace_counts_by_size"].values()) == {1}


@pytest.mark.slow
def test_tensorboard_logs_the_batch_size_and_rate_of_each_range(auto_run):
    """``--tensorboard`` on an auto run: at each evaluation the batch size and rate the steps
    since the previous one ran at (the range in force then), and samples/s at that size."""
    reader = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    from tensorboard.util import tensor_util

    events = reader.EventAccumulator(str(auto_run.tensorboard),
                                     size_guidance={reader.TENSORS: 0})
    events.Reload()

    def scalars(tag):
        return [(e.step, float(tensor_util.make_ndarray(e.tensor_proto)))
                for e in events.Tensors(tag)]

    ranges = auto_run.history.record.adaptive_batch["ranges"]
    evals = auto_run.history.evals
    previous = [0] + [e["step"] for e in evals[:-1]]
    in_force = [[r for r in ranges if r["step"] <= start][-1] for start in previous]
    assert [s for s, _ in scalars("batch_size")] == [e["step"] for e in evals]
    assert [v for _, v in scalars("batch_size")] == [r["batch_size"] for r in in_force]
    assert [v for _, v in scalars("learning_rate")] == pytest.approx(
        [r["learning_rate"] for r in in_force], rel=1e-6)
    assert len({v for _, v in scalars("batch_size")}) >= 2  # it grew
