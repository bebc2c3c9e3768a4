"""``kbackend train``: --target / --target-metric, --max-steps and --eval-every (in-process)."""

from __future__ import annotations

import json

import pytest

from kbackend import cli
from tests.conftest import NO_JIT_FLAGS


def train_json(tmp_path, capsys, *flags: str) -> tuple[dict, str]:
    history = tmp_path / "h.json"
    # A K of 5 (it divides every evaluation interval here): `--fused-steps auto`'s probe, three
    # more compilations per new batch size, is tested in test_native_engine.
    fused = [] if "--fused-steps" in flags or "keras" in flags else ["--fused-steps", "5"]
    code = cli.main(["train", "--dataset", "digits", "--quiet", "--history", str(history),
                     *NO_JIT_FLAGS, *fused, *flags])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(history.read_text()), out


def test_target_stops_where_the_last_two_evaluations_reach_it(tmp_path, capsys):
    """The crossing that holds (docs/study.md): the first evaluation whose mean with the one
    before reaches the target."""
    history, out = train_json(tmp_path, capsys, "--engine", "native", "--batch-size", "32",
                              "--epochs", "20", "--eval-every", "10", "--target", "0.9")
    evals = history["evals"]
    values = [e["val_accuracy"] for e in evals]
    means = [sum(values[max(0, i - 1):i + 1]) / len(values[max(0, i - 1):i + 1])
             for i in range(len(values))]
    assert means[-1] >= 0.9 and all(m < 0.9 for m in means[:-1])
    assert history["record"]["target_reached"]["step"] == evals[-1]["step"]
    assert evals[-1]["step"] < 20 * (1294 // 32)  # stopped long before the epochs ran out
    assert f"reached at step {evals[-1]['step']}" in out


def test_target_on_val_loss_and_not_reached(tmp_path, capsys):
    history, out = train_json(tmp_path, capsys, "--engine", "native", "--epochs", "1",
                              "--target", "1e-6", "--target-metric", "val_loss")
    assert "target_reached" not in history["record"]
    assert "target val_loss <= 1e-06: not reached" in out


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["keras", "native"])
def test_max_steps_stops_there(tmp_path, capsys, engine):
    history, _ = train_json(tmp_path, capsys, "--engine", engine, "--epochs", "3",
                            "--max-steps", "7")
    assert history["step"][-1] == 7


def test_eval_every_sets_the_evaluation_points(tmp_path, capsys):
    history, _ = train_json(tmp_path, capsys, "--engine", "native", "--epochs", "1",
                            "--batch-size", "64", "--eval-every", "5")
    assert [e["step"] for e in history["evals"]] == [5, 10, 15, 20]  # 1294 // 64 = 20 steps


@pytest.mark.parametrize(("flags", "message"), [
    (["--target", "1.5"], "Invalid target val_accuracy=1.5"),
    (["--target", "0", "--target-metric", "val_loss"], "Invalid target val_loss=0.0"),
    (["--max-steps", "-1"], "Invalid max_steps -1"),
    (["--eval-every", "-3"], "Invalid eval_every -3"),
    (["--engine", "keras", "--eval-every", "7"], "Invalid --eval-every 7"),
])
def test_bad_run_flags_are_one_line_errors(flags, message, capsys):
    code = cli.main(["train", "--quiet", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
