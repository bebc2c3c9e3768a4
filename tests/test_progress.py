"""Never silent: the live line on a terminal, evaluation lines in logs, K and compile time shown."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from kbackend import cli
from kbackend.engines import native
from kbackend.optim import OptimizerSpec
from kbackend.progress import EpochReporter
from kbackend.training import TrainConfig
from tests.test_native_engine import toy_dataset, toy_model


def reporter(terminal: bool) -> tuple[EpochReporter, io.StringIO]:
    out = io.StringIO()
    console = Console(file=out, force_terminal=terminal, highlight=False, width=100)
    live = EpochReporter(console)
    live.LIVE_INTERVAL_S = 0.0
    return live, out


def train_with(live):
    dataset = toy_dataset()
    config = TrainConfig(model="mlp", batch_size=8, epochs=2, engine="native", fused_steps=4,
                         eval_every=20)
    plan = native.plan_of(config, dataset, OptimizerSpec("sgd", 0.05))
    return native.train(toy_model(dataset), dataset, plan, config, live)


def test_a_terminal_gets_a_live_line_between_evaluations():
    live, out = reporter(terminal=True)
    history = train_with(live)
    text = out.getvalue()
    assert "samples/s" in text and "ETA" in text and f"/{history.steps_run}" in text
    assert "\r" in text  # redrawn in place, then replaced by the evaluation lines
    assert text.count("epoch ") == len(history.evals)


def test_a_log_gets_one_line_per_evaluation_and_no_live_line():
    live, out = reporter(terminal=False)
    history = train_with(live)
    lines = out.getvalue().splitlines()
    assert len(lines) == len(history.evals) and all(line.startswith("epoch ") for line in lines)
    assert "ETA" not in out.getvalue() and "\r" not in out.getvalue()


@pytest.mark.slow
def test_train_prints_k_and_compile_time_apart(capsys):
    assert cli.main(["train", "--quiet", "--epochs", "1"]) == 0
    out = capsys.readouterr().out
    assert "engine native" in out  # the default engine
    assert "fused steps K=" in out and "(auto: " in out
    assert "compiled in " in out and "s apart)" in out
