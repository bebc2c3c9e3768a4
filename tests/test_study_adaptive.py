"""The study's auto cells (``--batch-sizes ...,auto``, issue 37 item 2): one adaptive
batch-size cell per optimizer between the grid's smallest and largest fixed size, its rate
searched like any cell's, stored (resumable), compared with the best fixed batch size."""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import pytest

from kbackend.cli import main
from kbackend.commands import study as study_command
from kbackend.errors import ConfigError
from kbackend.study.auto_verdicts import auto_verdict
from kbackend.study.cell_verdicts import verdict_settings
from kbackend.study.config import StudyConfig
from kbackend.study.executor import StudyRunner
from kbackend.study.pipeline import run_study
from kbackend.study.store import ResultStore
from kbackend.study.study_record import Cell, StudyRecord
from kbackend.study.summaries import adaptive_samples
from kbackend.study.verdicts import OUTCOMES
from kbackend.training import Target
from tests.conftest import BACKEND, JIT_FOR_SMALL_RUNS

# 2 optimizers x (16, 128, auto) x 2 seeds, one rate each: 12 runs of at most 300 steps on
# digits. SGD's auto runs grow from 16 (measured: to 32 at step 48 on JAX).
AUTO_STUDY = StudyConfig(
    model="seed_mlp", dataset="digits", optimizers=("sgd", "adam"),
    batch_sizes=(16, 128, "auto"), learning_rates={"sgd": (0.1,), "adam": (3e-3,)},
    max_steps=300, engine="native", target=Target("val_accuracy", 0.9), noise_points=0,
    seeds=2, step_time_repeats=1, population="off", jit_compile=JIT_FOR_SMALL_RUNS,
)
AUTO_RUNS = 4  # 2 optimizers x 1 rate x 2 seeds


@pytest.fixture(scope="module")
def auto_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("auto_study")
    return out, run_study(AUTO_STUDY, out, show_progress=False, print_results=False)


@pytest.mark.slow
def test_an_auto_cell_per_optimizer_with_its_ranges_and_samples(auto_study):
    _, outcome = auto_study
    study = outcome.study.to_json()  # the record as summary.json holds it
    assert outcome.executed == 8 + AUTO_RUNS
    assert [c["optimizer"] for c in study["auto_cells"]] == ["sgd", "adam"]
    assert len(study["auto_runs"]) == AUTO_RUNS
    assert all(r["config"]["batch_size"] == "auto:16:128" for r in study["auto_runs"])
    assert all(r["config"]["lr_scaling"] == "sqrt" for r in study["auto_runs"])
    # the fixed grid is untouched: its cells, runs and batch sizes hold no auto
    assert study["batch_sizes"] == [16, 128]
    assert {c["batch_size"] for c in study["cells"]} == {16, 128}
    for cell in study["auto_cells"]:
        assert cell["batch_size"] == "auto"
        assert cell["auto"] == {"min": 16, "max": 128, "lr_scaling": "sqrt"}
        assert cell["seeds"] == 2 and cell["population"]["path"] == "sequential"
        assert "adaptive" in cell["population"]["reason"]
        assert set(cell["ranges"]) == {"0", "1"}
        for seed, ranges in cell["ranges"].items():
            assert ranges[0]["step"] == 0 and ranges[0]["batch_size"] == 16
            assert all(16 <= r["batch_size"] <= 128 for r in ranges)
            steps = cell["seed_steps"][seed]
            if math.isfinite(steps):  # samples: each range's steps x its size
                assert cell["seed_samples"][seed] == adaptive_samples(ranges, int(steps))
                assert cell["seed_times"][seed] > 0
        assert cell["time_model"] in ("steps at each size x the fixed cells' step times",
                                      "run clocks")
    assert any(c["largest_batch"] > 16 for c in study["auto_cells"])  # some run grew


@pytest.mark.slow
def test_the_verdict_against_the_best_fixed_batch_size(auto_study):
    _, outcome = auto_study
    verdicts = outcome.analysis.verdicts.adaptive
    assert [v.optimizer for v in verdicts] == ["sgd", "adam"]
    for verdict in verdicts:
        assert verdict.best_fixed in (16, 128)
        assert verdict.outcome in OUTCOMES and isinstance(verdict.resolved, bool)
        assert verdict.seeds == 2
        for part in (verdict.steps, verdict.samples, verdict.time):
            assert part is not None and part.outcome in OUTCOMES and part.seeds == 2
            assert part.kind == "ratio"
        assert verdict.text.startswith(f"{verdict.optimizer}: auto 16-128 (sqrt) vs the "
                                       "best fixed batch size")


@pytest.mark.slow
def test_the_report_shows_the_auto_cells_and_states_the_verdict(auto_study):
    _, outcome = auto_study
    report = outcome.paths["report"].read_text()
    assert "| sgd | auto 16-128 (sqrt) |" in report and "| adam | auto 16-128 (sqrt) |" in report
    assert "## Adaptive batch size (auto)" in report
    assert "Adaptive batch size, adam: auto 16-128 (sqrt) vs the best fixed batch size" in report
    assert "from step 0: 16" in report


@pytest.mark.slow
def test_resuming_the_study_trains_nothing(auto_study):
    out, first = auto_study

    def forbidden(runner, plan):
        raise AssertionError("a stored run was trained again")

    again = run_study(AUTO_STUDY, out, show_progress=False, print_results=False,
                      run_executor=forbidden)
    assert again.executed == 0
    assert [c["seed_steps"] for c in again.study.to_json()["auto_cells"]] == \
        [c["seed_steps"] for c in first.study.to_json()["auto_cells"]]
    with ResultStore(out / "study.db") as store:
        keys = [r.config["batch_size"] for r in store.records(kind="run")]
    assert keys.count("auto:16:128") == AUTO_RUNS


def test_the_identity_of_a_study_without_auto_is_unchanged():
    assert "lr_scaling" not in StudyConfig().identity()
    with_auto = StudyConfig(batch_sizes=(8, 64, "auto"), engine="native")
    assert with_auto.identity()["lr_scaling"] == "sqrt"
    linear = StudyConfig(batch_sizes=(8, 64, "auto"), engine="native", lr_scaling="linear")
    assert linear.identity() != with_auto.identity()
    assert with_auto.resolved_batch_sizes(1000) == (8, 64)


def test_adaptive_samples_count_each_range_up_to_the_step():
    ranges = [{"step": 0, "batch_size": 16}, {"step": 48, "batch_size": 32},
              {"step": 100, "batch_size": 64}]
    assert adaptive_samples(ranges, 48) == 48 * 16
    assert adaptive_samples(ranges, 120) == 48 * 16 + 52 * 32 + 20 * 64
    assert adaptive_samples(ranges[:1], 10) == 160


def test_auto_verdict_reads_paired_seeds_and_handles_no_reached_fixed_cell():
    def fixed(size, steps, per_step):
        return Cell("adam", size, reached=True,
                    steps_to_target=float(sorted(steps)[len(steps) // 2]),
                    time_to_target=sorted(steps)[len(steps) // 2] * per_step,
                    seconds_per_step={"median": per_step}, eval_every=1,
                    seed_steps={str(i): float(s) for i, s in enumerate(steps)})

    cells = [fixed(16, [400, 410, 420, 405], 1e-3), fixed(128, [100, 104, 98, 101], 2e-3)]
    auto = Cell("adam", "auto", auto={"min": 16, "max": 128, "lr_scaling": "sqrt"},
                reached=True, steps_to_target=200.0, eval_every=1,
                seed_steps={str(i): 200.0 + i for i in range(4)},
                seed_samples={str(i): 6000.0 + i for i in range(4)},
                seed_times={str(i): 0.3 + i / 1000 for i in range(4)})
    settings = verdict_settings(StudyRecord(config={"seeds": 4, "margin": 0.1}))  # one look at 90%
    verdict = auto_verdict(auto, cells, settings)
    assert verdict.best_fixed == 128  # the least time to target: 0.2 s
    assert verdict.steps is not None and verdict.steps.outcome == "b"  # 128 in fewer steps
    # auto on fewer samples (6000 vs 12,800)
    assert verdict.samples is not None and verdict.samples.outcome == "a"
    assert verdict.time is not None and verdict.time.outcome == "b" and verdict.outcome == "b"
    assert verdict.to_json()["cells"] == [["adam", "auto"], ["adam", 128]]
    none = auto_verdict(auto, [dataclasses.replace(c, reached=False) for c in cells], settings)
    assert none.best_fixed is None and not none.resolved
    assert "cells" not in none.to_json() and none.to_json()["seeds"] == 0


@pytest.mark.parametrize(("options", "message"), [
    ({"batch_sizes": (32, "auto", "auto")}, "'auto' at most once"),
    ({"batch_sizes": ("auto",)}, "give at least two"),
    ({"batch_sizes": (32, "auto")}, "give at least two"),
    ({"batch_sizes": (24, 128, "auto")}, "must be powers of two"),
    ({"batch_sizes": (32, 128, "auto"), "engine": "keras"}, "needs the native engine"),
    ({"batch_sizes": (32, 128, "auto"), "lr_scaling": "cubic"}, "Invalid --lr-scaling"),
    ({"batch_sizes": (32, "big")}, "Invalid batch size 'big'"),
])
def test_bad_auto_input_is_a_config_error(options, message):
    with pytest.raises(ConfigError, match=message):
        StudyConfig(**{"engine": "native", **options})


@pytest.mark.parametrize(("flags", "message"), [
    (["--batch-sizes", "auto,auto,32"], "'auto' at most once"),
    (["--batch-sizes", "auto"], "give at least two"),
    (["--batch-sizes", "32,128,auto", "--engine", "keras"], "needs the native engine"),
    (["--batch-sizes", "32,128,bad"], "optionally 'auto'"),
])
def test_cli_bad_auto_input_is_a_one_line_error(tmp_path, monkeypatch, capsys, flags, message):
    def forbidden(*args, **kwargs):
        raise AssertionError("training started despite bad input")

    monkeypatch.setattr("kbackend.study.executor.train", forbidden)
    # the fake run executor through the study command's seam (run_study(run_executor=...))
    monkeypatch.setattr(study_command, "run_study",
                        partial(study_command.run_study, run_executor=forbidden))
    argv = ["study", "--dataset", "digits", "--model", "seed_mlp", "--out", str(tmp_path),
            "--no-progress", *flags]
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors (a value that is not a batch size)
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


@pytest.mark.slow
@pytest.mark.skipif(BACKEND != "jax", reason="populations are JAX's vmap")
def test_a_population_study_runs_its_auto_cell_one_run_at_a_time(tmp_path):
    config = dataclasses.replace(AUTO_STUDY, optimizers=("adam",), population="on",
                                 learning_rates={"adam": (3e-3,)},
                                 max_steps=120, step_time_repeats=0)
    with ResultStore(tmp_path / "study.db") as store:
        study = StudyRunner(config, store).run().to_json()
    assert {c["population"]["path"] for c in study["cells"]} == {"population"}
    (auto,) = study["auto_cells"]
    assert auto["population"]["path"] == "sequential" and len(study["auto_runs"]) == 2
    assert all(r["config"]["batch_size"] == "auto:16:128" for r in study["auto_runs"])
