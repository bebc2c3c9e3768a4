"""The recommendation a user acts on: the printed command carries what decides the steps, the
fastest cell is recommended with its tie stated, a rate at the grid's bound says "edge", and the
study confirms the command on held-out seeds through the command line's own ``main``."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import replace

import pytest

from kbackend.history import History
from kbackend.study.recommend import (
    HELD_OUT_SEED,
    confirm,
    confirm_cell,
    recommendation,
    recommendation_lines,
    train_arguments,
)
from kbackend.study.store import StoredRun
from kbackend.study.study_record import Cell, Frontier, HeldOutRuns, StudyRecord
from tests.conftest import NO_JIT_FLAGS


def _cell(optimizer, batch, time, low, high, steps, seeds=3, bound=False,
          spread=(0.95, 1.0, 1.05)):
    """A reached cell; ``spread``: its seeds' steps over the median, seed by seed (the paired
    verdict the tie rule reads pairs them with another cell's)."""
    return Cell(optimizer, batch, learning_rate=0.1, reached=True, time_to_target=time,
                steps_to_target=steps, samples_to_target=steps * batch, seeds=seeds,
                lr_at_bound=bound, lr_at_grid_edge=bound,
                seed_steps={str(i): steps * f for i, f in enumerate(spread[:seeds])},
                intervals={"time_to_target": {"low": low, "high": high}, "steps_to_target": {}})


def _run(optimizer, batch, every, fused, budget, lr=0.1):
    return StoredRun("", "run", "", "", {"optimizer": {"name": optimizer}, "batch_size": batch,
                                          "learning_rate": lr, "eval_every": every,
                                          "fused_steps": fused, "max_steps": budget}, {})


def _study(cells, engine="native", runs=()):
    return StudyRecord(
        cells=cells, runs=list(runs),
        config={"model": "m.py:build", "dataset": "d.npz", "engine": engine, "seed": 0,
                "seeds": 3, "max_seeds": 3, "target": {"metric": "val_accuracy", "value": 0.9}})


def test_the_printed_command_carries_everything_that_decides_the_steps():
    cell = _cell("sgd", 64, 1.0, 0.9, 1.1, 100)
    study = _study([cell], runs=[_run("sgd", 64, 12, 6, 480), _run("sgd", 64, 12, 6, 240),
                                 _run("adam", 64, 12, 6, 999)])
    args = train_arguments(study, cell)
    flags = dict(zip(args[::2], args[1::2], strict=False))
    assert flags["--engine"] == "native" and flags["--eval-every"] == "12"
    assert flags["--fused-steps"] == "6" and flags["--max-steps"] == "480"  # the full budget
    assert flags["--data"] == "d.npz" and flags["--batch-size"] == "64"
    assert flags["--lr"] == "0.1" and flags["--target"] == "0.9"
    # Keras fit validates once an epoch: no --eval-every, no fused steps
    keras = train_arguments(_study([cell], "keras", [_run("sgd", 64, 12, 1, 480)]), cell)
    assert "--eval-every" not in keras and "--fused-steps" not in keras
    assert keras[keras.index("--engine") + 1] == "keras"
    best = recommendation(study)
    assert shlex.split(best.command)[2:-2] == args
    assert "eval_every=12" in best.python and "engine='native'" in best.python


def test_the_printed_budget_is_the_cells_full_one_not_a_pruned_rates():
    """The search cuts later rates' budgets to the best so far: the recommended rate's own runs
    may have had 30 steps; the command gets the full budget (in whole evaluation intervals)."""
    cell = _cell("adam", 32, 1.0, 0.9, 1.1, 30)
    study = _study([cell], runs=[_run("adam", 32, 10, 10, 30)])
    study = replace(study, dataset={"num_train": 1000})
    study.config.update(max_steps=3000, max_epochs=40)
    flags = train_arguments(study, cell)
    assert flags[flags.index("--max-steps") + 1] == "1240"  # 40 epochs x 31 steps, in 10s
    study.config["max_epochs"] = 0
    flags = train_arguments(study, cell)
    assert flags[flags.index("--max-steps") + 1] == "3000"


@pytest.mark.parametrize(("cells", "pick", "tied", "resolved"), [
    ([_cell("sgd", 16, 1.0, 0.9, 1.1, 100), _cell("adam", 64, 2.0, 1.8, 2.2, 10)],
     ("sgd", 16), [], True),
    # tied: the fastest median (what the user asked), the tie stated; seeds that disagree
    # (A's slowest seed is B's fastest) leave the paired time ratio unresolved
    ([_cell("adam", 16, 1.0, 0.5, 2.0, 1000, spread=(0.5, 1.0, 2.0)),
      _cell("sgd", 256, 3.0, 1.5, 6.0, 200, spread=(2.0, 1.0, 0.5)),
      _cell("sgd", 64, 1.2, 0.8, 1.9, 240, spread=(1.6, 1.0, 0.6)),
      _cell("momentum", 64, 2.4, 2.2, 2.6, 240, spread=(0.5, 1.0, 2.0))],
     ("adam", 16), [("sgd", 256), ("sgd", 64)], False),
])
def test_the_fastest_median_is_recommended_and_a_tie_is_stated(cells, pick, tied, resolved):
    best = recommendation(_study(cells))
    assert (best.optimizer, best.batch_size) == pick
    assert sorted(best.tied_with) == sorted(tied) and best.resolved == resolved
    line = recommendation_lines(best)[0]
    assert line.startswith(f"Recommended: {pick[0]} at batch {pick[1]}")
    assert ("tied with" in line) == bool(tied)


def test_a_rate_at_the_bound_of_the_extended_grid_says_edge():
    best = recommendation(_study([_cell("momentum", 64, 1.0, 0.9, 1.1, 6, bound=True)]))
    assert best.edge
    assert "(edge)" in recommendation_lines(best)[0]
    assert "edge" not in recommendation_lines(
        recommendation(_study([_cell("sgd", 64, 1.0, 0.9, 1.1, 6)])))[0]


class FakeCommandLine:
    """``kbackend.cli.main`` for ``train``: writes the --history a run reaching the target at
    ``steps[seed]`` would (None: never), and records each argv."""

    def __init__(self, steps):
        self.steps, self.calls = steps, []

    def __call__(self, argv):
        self.calls.append(list(argv))
        seed = int(argv[argv.index("--seed") + 1])
        history = History()
        reached = self.steps.get(seed)
        history.record_steps([1, 2], [1.0, 0.5], [0.1, 0.2])
        history.timing.update(train_time=2.0, compile_time=0.5)
        if reached is not None:
            history.record.target_reached = {"step": reached, "epoch": 1, "train_time": 1.5}
        history.save(argv[argv.index("--history") + 1])
        return 0


def test_the_confirmation_runs_the_printed_command_on_held_out_seeds():
    cell = _cell("sgd", 64, 1.0, 0.9, 1.1, 100)
    study = _study([cell], runs=[_run("sgd", 64, 12, 6, 480)])
    seeds = [HELD_OUT_SEED + s for s in range(3)]
    fake = FakeCommandLine({seeds[0]: 96, seeds[1]: 120, seeds[2]: None})
    result = confirm_cell(study, cell, fake, seeds=3)
    assert [int(c[c.index("--seed") + 1]) for c in fake.calls] == seeds  # not the study's
    assert all(c[0] == "train" and c[1:1 + len(result.arguments)] == list(result.arguments)
               for c in fake.calls)
    assert result.reached == 2 and result.confirmed
    assert result.steps_to_target["median"] == 120 and result.steps_to_target["low"] == 96
    assert result.steps_to_target["high"] == float("inf")
    # stored (a resumed study reuses it) and read back as it was
    assert HeldOutRuns.from_json(json.loads(json.dumps(result.to_json()))) == result
    study = replace(study, confirmation=(result,))
    lines = recommendation_lines(recommendation(study))
    assert "train reaches the target in 120 [96, never] steps" in lines[1]
    assert "reached on 2 of 3" in lines[1]


def test_a_second_cell_is_confirmed_only_when_the_first_fails_on_most_seeds():
    fast, slow = _cell("sgd", 64, 1.0, 0.9, 1.1, 100), _cell("adam", 32, 3.0, 2.9, 3.1, 50)
    study = _study([slow, fast], runs=[_run("sgd", 64, 12, 6, 480), _run("adam", 32, 24, 8, 900)])
    asked = []

    def confirm_one(cell):
        asked.append(cell.optimizer)
        seeds = 3
        reached = 1 if cell is fast else 3
        return HeldOutRuns(
            optimizer=cell.optimizer, batch_size=cell.batch_size,
            learning_rate=cell.learning_rate, seeds=seeds,
            held_out_seeds=tuple(range(HELD_OUT_SEED, HELD_OUT_SEED + seeds)),
            reached=reached, failed=0, confirmed=reached * 2 > seeds,
            steps_to_target={"median": 60, "low": 50, "high": 70},
            time_to_target={"median": 3.0, "low": 2.8, "high": 3.3},
            wall_to_target={"median": 4.0, "low": 3.8, "high": 4.3},
            study_steps_to_target=cell.steps_to_target,
            study_time_to_target=cell.time_to_target, arguments=())

    study = replace(study, confirmation=tuple(confirm(study, confirm_one)))
    assert asked == ["sgd", "adam"]
    best = recommendation(study)
    assert (best.optimizer, best.batch_size) == ("adam", 32)
    lines = recommendation_lines(best)
    assert "sgd at batch 64 was faster in the study but train reached the target on only 1 of 3" \
        in lines[1]
    asked.clear()
    assert len(confirm(_study([fast, slow]),
                       lambda c: replace(confirm_one(slow), optimizer=c.optimizer,
                                         batch_size=c.batch_size))) == 1


@pytest.mark.slow
def test_a_study_confirms_its_command_and_the_command_reproduces_its_runs(tmp_path, cli):
    """End to end, as a user acts on it: the study's Recommended line carries train's figures
    on held-out seeds, and the printed command with the study's own seed reaches the target at
    the same step as the study's run of that seed."""
    out = tmp_path / "out"
    result = cli("study", "--model", "seed_mlp", "--dataset", "digits", "--optimizers", "adam",
                 "--batch-sizes", "64", "--lrs", "adam=0.003", "--seeds", "1", "--max-seeds",
                 "1", "--noise-points", "0", "--step-time-repeats", "0", "--target", "0.9",
                 "--frontier-epochs", "0", "--confirm-seeds", "2", "--population", "off",
                 "--no-progress", "--out", str(out), *NO_JIT_FLAGS)
    assert result.returncode == 0, result.stderr
    confirmation = next(line for line in result.stdout.splitlines() if "Confirmed" in line)
    assert "on 2 held-out seeds" in confirmation and "reached on 2 of 2" in confirmation
    command = next(line.strip() for line in result.stdout.splitlines()
                   if line.strip().startswith("kbackend train"))
    history_path = tmp_path / "h.json"
    rerun = cli(*shlex.split(command)[1:-2], "--seed", "0", "--quiet", "--history",
                str(history_path))
    assert rerun.returncode == 0, rerun.stderr
    reached = json.loads(history_path.read_text())["record"]["target_reached"]
    summary = json.loads(next(out.glob("*/summary.json")).read_text())
    study_steps = summary["cells"][0]["steps_to_target"]
    assert reached["step"] == study_steps
    # the stored summary (what `study compare` and a resumed Python call read) prints the same
    assert recommendation(StudyRecord.from_json(summary)).command == command
    # one training time per run on train's output: the target line's, in the study's words
    line = next(x for x in rerun.stdout.splitlines() if x.startswith("target "))
    assert re.search(r"time to target [0-9.]+s \(wall to target [0-9.]+s", line)
    assert "train_time" not in rerun.stdout


def test_the_validation_split_size_is_judged_before_training():
    from kbackend.study import trust

    # the image-folder case: 40 samples at 0.9 cannot resolve the target
    warning = trust.before_training("val_accuracy", 0.9, 40)
    assert "40 samples" in warning and "0.025" in warning and "0.0474" in warning
    assert f"about {trust.samples_to_resolve(0.9)} validation samples" in warning
    assert trust.samples_to_resolve(0.9) == 225
    # the default study (1,200 at 0.65) and digits (144 at 0.95) resolve theirs
    assert trust.before_training("val_accuracy", 0.65, 1200) is None
    assert trust.before_training("val_accuracy", 0.95, 144) is None
    assert trust.before_training("val_mae", 0.5, 40) is None  # no binomial error for an error


def test_a_plateau_within_two_standard_errors_of_the_target_is_warned():
    from kbackend.study import trust

    def cell(time, plateau):
        return Cell("sgd", 32, reached=True, time_to_target=time,
                    frontier=Frontier(best_metric={"median": plateau}))

    study = StudyRecord(cells=[cell(1.0, 0.91), cell(2.0, 0.915)])
    warning = trust.after_training(study, "val_accuracy", 0.9, 400)  # 2 SE = 0.03
    assert "plateau at val_accuracy 0.915" in warning
    assert trust.after_training(StudyRecord(cells=[cell(1.0, 0.97)]), "val_accuracy", 0.9,
                                400) is None
    # without frontier runs the plateau is unknown: said in one line, not silently skipped
    unchecked = trust.after_training(
        StudyRecord(cells=[Cell("sgd", 32, reached=True, time_to_target=1.0, best_metric=0.901)]),
        "val_accuracy", 0.9, 400, no_frontier="the keras engine runs none")
    assert unchecked.startswith("note: the plateau was not checked") and "\n" not in unchecked
    assert "(the keras engine runs none)" in unchecked and "--frontier-epochs 0" not in unchecked
    # a frontier that ends before the crossing is no plateau (a 3-epoch frontier, 90 steps,
    # read 0.37 where the runs crossed 0.8 at step 345): said, not warned
    short = Cell("sgd", 16, reached=True, time_to_target=1.0, steps_to_target=345.0,
                 seed_steps={"0": 345.0, "1": 390.0, "2": 300.0},
                 frontier=Frontier(epochs=3, steps=90, best_metric={"median": 0.37}))
    note = trust.after_training(StudyRecord(cells=[short]), "val_accuracy", 0.8, 54)
    assert note.startswith("note: the plateau was not checked") and "\n" not in note
    # the slowest seed's crossing, not the median's, is what a frontier must pass
    assert "end at step 90, 3 epochs, before sgd at batch 16 reaches the target at step 390: " \
        "--frontier-epochs 13 or more would pass it)" in note  # 30 steps an epoch
    median_only = replace(short, frontier=replace(short.frontier, steps=350))
    assert trust.after_training(StudyRecord(cells=[median_only]), "val_accuracy", 0.8,
                                54).startswith("note: the plateau was not checked")
    long = replace(short, frontier=replace(short.frontier, steps=400))
    below = trust.after_training(StudyRecord(cells=[long]), "val_accuracy", 0.8, 54)
    assert below.startswith("warning: the best cells plateau at val_accuracy 0.37, below the "
                            "target 0.8")
    assert trust.after_training(StudyRecord(cells=[Cell("sgd", 32, reached=False)]),
                                "val_accuracy", 0.9, 400) is None  # no cell reached: no plateau
    assert trust.after_training(StudyRecord(cells=[cell(1.0, 0.91)]), "val_mae", 0.9,
                                400) is None


def test_a_validation_split_under_ten_samples_is_refused_before_any_run(tmp_path, cli,
                                                                        engines_never_run):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    np.savez(tmp_path / "tiny.npz", x_train=x[:30], y_train=(x[:30, 0] > 0).astype(np.int64),
             x_val=x[30:38], y_val=(x[30:38, 0] > 0).astype(np.int64))
    result = cli("study", "--model", "logistic", "--data", str(tmp_path / "tiny.npz"),
                 "--target", "0.8", "--out", str(tmp_path / "out"), "--no-progress")
    assert result.returncode == 2
    assert "8 samples" in result.stderr and "at least 10" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out" / "study.db").exists()


def test_user_data_without_a_target_is_told_the_metric_and_a_probe_value(tmp_path, cli,
                                                                          monkeypatch):
    import numpy as np

    from kbackend.study.executor import StudyRunner

    def forbidden(*args, **kwargs):
        raise AssertionError("a study run started without a target")

    monkeypatch.setattr(StudyRunner, "run", forbidden)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 4)).astype(np.float32)
    np.savez(tmp_path / "u.npz", x_train=x, y_train=(x[:, 0] > 0).astype(np.int64))
    result = cli("study", "--model", "logistic", "--data", str(tmp_path / "u.npz"),
                 "--out", str(tmp_path / "out"), "--no-progress")
    assert result.returncode == 2
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and "needs --target" in err and "val_accuracy" in err
    assert re.search(r"Adam probe .* reached 0\.\d+", err)
    assert "0.65" not in err  # never MNIST-1D's default
