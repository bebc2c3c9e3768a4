"""A run whose loss becomes NaN or infinite stops, says "diverged at step N", exits 4 and writes
no model made of NaN: on every engine, through the CLI and the Python API (issue 14, must hold 2).

``--lr 1e30`` makes the second step's loss NaN on both backends. The loop's own timing of the
stop (at most one fused call late, the step exact) is checked with a scripted trainer.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from kbackend.config import TrainConfig
from kbackend.engines import loop
from kbackend.engines.plan import TrainPlan
from kbackend.errors import ConfigError, Diverged
from kbackend.history import History, RunRecord
from kbackend.optim import OptimizerSpec
from tests.conftest import BACKEND

ENGINE_FLAGS = {
    "keras": ["--engine", "keras"],
    "native": ["--engine", "native", "--fused-steps", "3"],
    "data_parallel": ["--engine", "data_parallel", "--fused-steps", "3", "--devices", "1"],
    "keras_data_parallel": ["--engine", "keras", "--data-parallel"],
}


def _strict_json(path):
    def refuse(constant):
        raise AssertionError(f"bare {constant} in {path}: not strict JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(ENGINE_FLAGS))
def test_diverging_train_exits_4_with_one_line_and_no_model(cli, tmp_path, engine):
    if engine == "data_parallel" and BACKEND != "jax":
        pytest.skip("the native data-parallel engine is JAX's")
    model_path, history_path = tmp_path / "model.keras", tmp_path / "history.json"
    result = cli("train", "--quiet", "--lr", "1e30", "--epochs", "1", "--max-steps", "9",
                 "--batch-size", "64", *ENGINE_FLAGS[engine],
                 "--save", model_path, "--history", history_path)
    assert result.returncode == 4, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "diverged at step" in lines[0].lower() and "No model was saved" in lines[0]
    assert not model_path.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["history.json"]  # no temp file left
    history = _strict_json(history_path)
    step = history["record"]["diverged"]["step"]
    assert f"step {step}:" in lines[0]
    # Where the NaN showed first: usually the train loss; with TensorFlow's distributed fit the
    # losses can stay finite near 1e30 while the test loss is NaN (seen with TF 2.21).
    seen_in = history["record"]["diverged"]["seen_in"]
    if seen_in == "train_loss":
        assert history["loss"][step - 1] is None and f"/loss/{step - 1}" in history["non_finite"]
    else:
        assert seen_in == "test_loss" and "/test/test_loss" in history["non_finite"]
        assert "the test loss became nan" in lines[0]
    # The run stopped at the end of the call after the one it happened in (K=3 at most late).
    assert history["step"][-1] <= step + 2 * 3


def test_python_api_raises_diverged_with_the_step(tmp_path):
    config = TrainConfig(engine="native", fused_steps=2, epochs=1, max_steps=8, batch_size=64,
                         optimizer=OptimizerSpec("sgd", 1e30))
    with pytest.raises(Diverged) as caught:
        from kbackend.training import train

        train(config, save=tmp_path / "m.keras")
    assert caught.value.step >= 1 and caught.value.exit_status == 4
    assert not (tmp_path / "m.keras").exists()


def test_record_mode_returns_the_history_and_saves_nothing(tmp_path):
    """What a study passes (on_divergence="record"): no exception, the divergence recorded."""
    from kbackend.training import train

    config = TrainConfig(engine="native", fused_steps=2, epochs=1, max_steps=8, batch_size=64,
                         optimizer=OptimizerSpec("sgd", 1e30), on_divergence="record")
    result = train(config, save=tmp_path / "m.keras")
    diverged = result.history.record.diverged
    assert not np.isfinite(result.history.loss[diverged["step"] - 1])
    assert not (tmp_path / "m.keras").exists()


def test_on_divergence_is_checked():
    with pytest.raises(ConfigError, match="on_divergence"):
        TrainConfig(on_divergence="ignore")


class ScriptedTrainer:
    """A ``Trainer`` whose step losses are 1.0 except NaN from ``nan_from`` on (1-based)."""

    def __init__(self, nan_from: int) -> None:
        self.nan_from, self.steps_run, self.evaluations = nan_from, 0, 0
        self.trace_counts: dict[int, int] = {}
        self.run_record = RunRecord()
        self.unroll = False

    def put_epoch(self, rows):
        return rows

    def compile(self, length, epoch_rows):
        return 0.0

    def run(self, epoch_rows, start, length):
        steps = np.arange(self.steps_run + 1, self.steps_run + length + 1)
        self.steps_run += length
        return np.where(steps >= self.nan_from, np.nan, 1.0)

    def fetch(self, losses):
        return losses

    def evaluate(self):
        self.evaluations += 1
        return 1.0, 0.5

    def snapshot(self):
        return None

    def restore(self, snapshot):
        pass

    def finish(self):
        pass


@pytest.mark.parametrize(("nan_from", "fused"), [(1, 1), (5, 1), (5, 4), (8, 4), (9, 4), (30, 7)])
def test_loop_stops_one_call_after_the_diverging_call_at_most(nan_from, fused):
    config = TrainConfig(engine="native", batch_size=4, epochs=3, fused_steps=fused, eval_every=6)
    plan = TrainPlan.of(config, n_train=80)  # 20 steps per epoch, 60 in all
    trainer = ScriptedTrainer(nan_from)
    history = loop.run(trainer, plan, config, history=History())
    assert history.record.diverged == {"step": nan_from, "loss": "nan", "seen_in": "train_loss"}
    diverging_call_end = -(-nan_from // fused) * fused
    assert nan_from <= trainer.steps_run <= diverging_call_end + fused
    assert all(e["step"] < nan_from for e in history.evals)  # nothing evaluated after it
    assert not history.stopped_early


def test_loop_without_divergence_records_none():
    config = TrainConfig(engine="native", batch_size=4, epochs=2, fused_steps=3)
    plan = TrainPlan.of(config, n_train=40)
    history = loop.run(ScriptedTrainer(nan_from=10**9), plan, config, history=History())
    assert history.record.diverged is None and history.steps_run == 20
