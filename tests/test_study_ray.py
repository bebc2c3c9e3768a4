"""The study on Ray (``--executor ray``): the same results and store as the local executor, a
killed worker's cell retried and recorded once, and a one-line error where Ray is absent.

Tests marked ``ray`` need the ``kbackend[ray]`` extra and run in the ``ray`` nox session, on one
local Ray instance (127.0.0.1) shared by the module; the others run in every session, Ray-free.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import pytest

from kbackend.errors import ConfigError
from kbackend.study.config import StudyConfig
from kbackend.study.pipeline import run_study
from kbackend.study.store import ResultStore, config_key
from tests.conftest import BACKEND, one_line_error
from tests.test_study_executor import RESUMED, RESUMED_ARGS, TINY, TINY_RUNS

RAY_WORKERS = 2  # cells at once on the local instance (this machine has 2 cores)


def _stored_runs(out_dir) -> list[dict]:
    """The stored runs as the study's report reads them."""
    with ResultStore(out_dir / "study.db") as store:
        return [run.to_dict() for run in store.records(kind="run")]


def _same_cells(local: dict, other: dict) -> None:
    """Per cell: the same learning rate, reach and steps to target; figures within tolerance
    (XLA on a multi-threaded CPU can differ by ~1e-9 between identical calls); timing aside."""
    ours = {(c["optimizer"], c["batch_size"]): c for c in local["cells"]}
    theirs = {(c["optimizer"], c["batch_size"]): c for c in other["cells"]}
    assert list(ours) == list(theirs)
    for key, cell in ours.items():
        twin = theirs[key]
        for name in ("learning_rate", "reached", "seeds_reached", "steps_to_target",
                     "samples_to_target", "steps_run", "seed_steps", "run_keys", "lr_tried"):
            assert twin[name] == cell[name], (key, name)
        for name in ("best_metric", "test_accuracy"):
            assert twin[name] == pytest.approx(cell[name], rel=1e-6, abs=1e-9), (key, name)


# -- without Ray (every session) ----------------------------------------------------------------

def test_ray_absent_is_a_one_line_error_naming_the_extra(cli, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    result = cli(*RESUMED_ARGS, "--executor", "ray", "--out", tmp_path / "out")
    assert result.returncode == 2 and one_line_error(result.stderr)
    assert "kbackend[ray]" in result.stderr
    assert not (tmp_path / "out" / "study.db").exists()  # refused before the store is made


def test_the_executor_is_not_part_of_the_study(cli, tmp_path):
    same = {config_key(dataclasses.replace(TINY, **options).identity())
            for options in ({}, {"executor": "ray"}, {"executor": "ray", "workers": 2},
                            {"executor": "ray:10.0.0.1:6379", "cell_cpus": 2.0, "cell_gpus": 0.5})}
    assert same == {config_key(TINY.identity())}
    for options in ({"executor": "slurm"}, {"executor": "ray:"}, {"executor": "local:x"},
                    {"executor": "ray:h:1", "workers": 2}, {"workers": 2}, {"workers": -1},
                    {"cell_cpus": 0.0}, {"cell_gpus": -1.0}, {"cell_gpus": 1.5}):
        with pytest.raises(ConfigError):
            dataclasses.replace(TINY, **options)
    assert StudyConfig(executor="ray:10.0.0.1:6379").ray_address == "10.0.0.1:6379"
    assert StudyConfig(executor="ray").ray_address is None
    result = cli(*RESUMED_ARGS, "--executor", "slurm", "--out", tmp_path / "out")
    assert result.returncode == 2 and one_line_error(result.stderr)


# -- on a local Ray instance (the `ray` session) ------------------------------------------------

@pytest.fixture(scope="module")
def ray_instance():
    """One local Ray instance (127.0.0.1, ``RAY_WORKERS`` CPUs) for the module's tests."""
    ray = pytest.importorskip("ray")
    from kbackend.study.ray_executor import start_ray

    assert start_ray(StudyConfig(executor="ray", workers=RAY_WORKERS), BACKEND)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def local_study(tmp_path_factory):
    """The tiny study (noise scale and time model included) on the local executor."""
    out = tmp_path_factory.mktemp("local")
    return out, run_study(TINY, out, show_progress=False, print_results=False)


@pytest.mark.ray
def test_ray_results_equal_the_local_executors(ray_instance, local_study, tmp_path):
    out_local, local = local_study
    result = run_study(dataclasses.replace(TINY, executor="ray"), tmp_path,
                       show_progress=False, print_results=False)
    assert result.executed == TINY_RUNS and result.skipped == 0
    study, reference = result.study.to_json(), local.study.to_json()
    assert study["study"] == reference["study"] and study["env"] == reference["env"]
    _same_cells(reference, study)
    # The same runs under the same keys, with the same outcomes.
    ours = {r["key"]: r["result"] for r in _stored_runs(out_local)}
    theirs = {r["key"]: r["result"] for r in _stored_runs(tmp_path)}
    assert sorted(ours) == sorted(theirs) and len(theirs) == TINY_RUNS
    for key, figures in ours.items():
        assert theirs[key]["steps_to_target"] == figures["steps_to_target"]
        assert theirs[key]["best_val_accuracy"] == pytest.approx(figures["best_val_accuracy"])
    # The noise scale and the time model ran (as tasks) and were stored here.
    assert len(study["noise"]["points"]) == len(reference["noise"]["points"]) == 2
    for point, twin in zip(study["noise"]["points"], reference["noise"]["points"], strict=True):
        assert point["step"] == twin["step"]
        assert point["trace_sigma"] == pytest.approx(twin["trace_sigma"], rel=1e-4)
    assert [c["optimizer"] for c in study["step_times"]["cells"]] == \
        [c["optimizer"] for c in reference["step_times"]["cells"]]
    assert all(math.isfinite(c["time_to_target"]) for c in study["cells"] if c["reached"])
    assert result.paths["report"].is_file()

    # One study: Ray resumes itself and the local executor resumes Ray's (nothing re-run).
    again = run_study(dataclasses.replace(TINY, executor="ray"), tmp_path,
                      show_progress=False, print_results=False)
    assert again.executed == 0 and again.skipped == TINY_RUNS + 2  # + noise, step times
    local_again = run_study(TINY, tmp_path, show_progress=False, print_results=False)
    assert local_again.executed == 0 and local_again.skipped == TINY_RUNS + 2
    _same_cells(reference, local_again.study.to_json())


@pytest.mark.ray
def test_a_killed_workers_cell_is_retried_and_recorded_once(ray_instance, local_study, tmp_path,
                                                            monkeypatch):
    from kbackend.study.ray_executor import CRASH_ENV

    marker = tmp_path / "crashed"
    monkeypatch.setenv(CRASH_ENV, str(marker))  # the first task to finish a run kills its worker
    out = tmp_path / "out"
    result = run_study(dataclasses.replace(RESUMED, executor="ray"), out,
                       show_progress=False, print_results=False)
    assert marker.exists(), "no worker was killed: the test checks nothing"
    assert result.executed == TINY_RUNS
    runs = _stored_runs(out)
    assert len(runs) == len({r["key"] for r in runs}) == TINY_RUNS  # each run stored once
    local = {r["key"]: r["result"]["steps_to_target"] for r in _stored_runs(local_study[0])}
    assert {r["key"]: r["result"]["steps_to_target"] for r in runs} == local
    _same_cells(local_study[1].study.to_json(), result.study.to_json())


@pytest.mark.ray
def test_a_resumed_ray_study_submits_only_unfinished_cells(ray_instance, local_study, tmp_path,
                                                           monkeypatch):
    from kbackend.study import ray_executor

    out = tmp_path / "out"
    # Half the grid done locally (the sgd cells), then resumed on Ray.
    run_study(dataclasses.replace(RESUMED, optimizers=("sgd",), learning_rates={"sgd": (1e-4,)}),
              out, show_progress=False, print_results=False)
    submitted = []
    original = ray_executor.RayStudy.cell_records

    def recording(self, optimizer, batch_size):
        submitted.append((optimizer, batch_size))
        return original(self, optimizer, batch_size)

    monkeypatch.setattr(ray_executor.RayStudy, "cell_records", recording)
    result = run_study(dataclasses.replace(RESUMED, executor="ray"), out,
                       show_progress=False, print_results=False)
    assert sorted(submitted) == [("adam", 64), ("adam", 256)]
    assert result.executed == TINY_RUNS // 2 and result.skipped == TINY_RUNS // 2
    _same_cells(local_study[1].study.to_json(), result.study.to_json())


@pytest.mark.ray
def test_auto_cells_run_as_ray_tasks_and_resume_locally(ray_instance, tmp_path):
    """``--batch-sizes ...,auto`` on Ray: each optimizer's auto cell is one task, its runs stored
    here under the local executor's keys, its verdict made on the driver; the local executor
    then resumes the study with nothing trained and the same auto cells."""
    from tests.test_study_adaptive import AUTO_STUDY

    config = dataclasses.replace(AUTO_STUDY, optimizers=("sgd",),
                                 learning_rates={"sgd": (0.1,)})
    runs = 2 * 2 + 2  # (16, 128) x 2 seeds + the auto cell's 2 seeds
    result = run_study(dataclasses.replace(config, executor="ray"), tmp_path,
                       show_progress=False, print_results=False)
    study = result.study.to_json()
    assert result.executed == runs
    [cell] = study["auto_cells"]
    assert cell["batch_size"] == "auto" and cell["auto"]["min"] == 16
    [verdict] = result.analysis.verdicts.adaptive
    assert verdict.optimizer == "sgd" and verdict.best_fixed in (16, 128)
    assert all(r["config"]["batch_size"] == "auto:16:128" for r in study["auto_runs"])
    assert {r["key"] for r in study["auto_runs"]} <= {r["key"] for r in _stored_runs(tmp_path)}
    # each seed that reached has its time from the fixed cells' step times (the auto cell's
    # runs read a crossing of two evaluations now: a seed may stop at the budget instead)
    reached = [s for s, steps in cell["seed_steps"].items() if math.isfinite(steps)]
    assert reached and all(math.isfinite(cell["seed_times"][s]) for s in reached)

    local = run_study(config, tmp_path, show_progress=False, print_results=False)
    assert local.executed == 0
    [twin] = local.study.to_json()["auto_cells"]
    for name in ("learning_rate", "seed_steps", "run_keys", "seed_samples", "ranges"):
        assert twin[name] == cell[name], name
