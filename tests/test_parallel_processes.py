"""Multi-process training on one machine: ``kbackend launch``, ``kbackend train --num-processes``.

Each test starts several Python processes (each imports Keras and a framework), so they are
few and small; the two heaviest are marked slow.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import BACKEND, ROOT, one_line_error, run_cli

TRAIN = ["--model", "mlp", "--widths", "16", "--batch-size", "64", "--optimizer", "sgd",
         "--lr", "0.1", "--quiet"]
# A peer that dies must stop the others within this many seconds (heartbeat 5 s + start-up slack).
DEAD_PEER_BOUND_S = 90


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _env() -> dict[str, str]:
    return {**os.environ, "KERAS_BACKEND": BACKEND, "KBACKEND_OFFLINE": "1"}


def _weights(path) -> list[np.ndarray]:
    import keras

    return keras.saving.load_model(path, compile=False).get_weights()


def _optimizer_state(path) -> list[np.ndarray]:
    import keras

    return [np.asarray(v) for v in keras.saving.load_model(path).optimizer.variables]


# Every optimizer of the parity table (kbackend.optim), one launch each, BatchNorm on every other
# one; rates large enough that a wrong optimizer state (an update count off, slots per replica, a
# decay applied twice) moves parameters by far more than the tolerance, and AdamW's decay large.
OPTIMIZER_CASES = {
    "sgd": ("--optimizer", "sgd", "--lr", "0.1"),
    "momentum-batchnorm": ("--optimizer", "momentum", "--lr", "0.05", "--batch-norm"),
    "nesterov": ("--optimizer", "nesterov", "--lr", "0.05"),
    "adam-batchnorm": ("--optimizer", "adam", "--lr", "0.01", "--batch-norm"),
    "adamw": ("--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.5"),
}
# Parameters of N processes vs one (float32 sums in another order). Adam can turn a round-off
# difference into an lr-sized step where a ReLU unit's pre-activation sits within round-off of 0
# (seen on the seed MLP: 1.0e-2, the same as between one process's XLA and graph runs); the
# 16-unit MLP here has few such units (docs/parallel.md, "Tolerance").
PROCESS_GAP_TOLERANCE = 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("options", list(OPTIMIZER_CASES.values()), ids=list(OPTIMIZER_CASES))
def test_two_processes_train_like_one(tmp_path, cli, options):
    # The launcher and the one-process run are in this process; the two workers are fresh ones
    # (jax.distributed / MultiWorkerMirroredStrategy, launched with TF_CONFIG on TensorFlow).
    # Two epochs of 20 steps, 5 fused calls each.
    engine = [*TRAIN, *options, "--epochs", "2", "--fused-steps", "4"]
    two = cli("launch", "-N", "2", "--", *engine, "--engine", "data_parallel",
              "--save", str(tmp_path / "two.keras"), "--history", str(tmp_path / "two.json"))
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    one = cli("train", *engine, "--engine", "native", "--save", str(tmp_path / "one.keras"))
    assert one.returncode == 0, one.stderr[-3000:]
    # Process 0's output once; the other's only on failure. Only process 0 writes.
    assert "[0] " in two.stdout and "[1] " not in two.stdout
    assert "[0] saved model" in two.stdout
    gaps = [float(np.max(np.abs(a - b))) for a, b in
            zip(_weights(tmp_path / "one.keras"), _weights(tmp_path / "two.keras"), strict=True)]
    print(f"largest parameter gap, 2 processes vs 1 ({BACKEND}, {options}): {max(gaps):.3g}")
    assert max(gaps) < PROCESS_GAP_TOLERANCE
    # The trained optimizer state is saved alike (iterations = steps, the slots), so either
    # file resumes training.
    one_state, two_state = (_optimizer_state(tmp_path / f"{n}.keras") for n in ("one", "two"))
    assert int(one_state[0]) == int(two_state[0]) == 40 and len(one_state) == len(two_state)
    for a, b in zip(one_state[1:], two_state[1:], strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=PROCESS_GAP_TOLERANCE)


USER_BUILDER = """
import keras


def build(input_shape, num_classes):
    inputs = keras.Input(input_shape)
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    hidden = keras.layers.BatchNormalization()(hidden)
    outputs = keras.layers.Dense(num_classes, activation="softmax")(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model
"""


def _user_sources(folder) -> list[str]:
    """A user's builder (BatchNorm) and .npz (three classes), as train flags."""
    (folder / "builder.py").write_text(USER_BUILDER)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(640, 8)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int64") + (x[:, 2] > 1)
    np.savez(folder / "data.npz", x=x, y=y)
    return ["--model", f"{folder / 'builder.py'}:build", "--data", str(folder / "data.npz")]


@pytest.mark.slow
def test_a_users_model_and_data_train_alike_on_two_processes_two_devices_and_one(tmp_path, cli):
    # The user's builder and .npz start the framework while the workload is prepared: the
    # job and the virtual devices must exist before that, on both ways of splitting a batch.
    flags = [*_user_sources(tmp_path), "--optimizer", "adam", "--lr", "0.01", "--epochs", "2",
             "--fused-steps", "4", "--quiet"]
    two = cli("launch", "-N", "2", "--", *flags, "--engine", "data_parallel",
              "--save", str(tmp_path / "two.keras"))
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    devices = run_cli("train", *flags, "--engine", "data_parallel", "--virtual-devices", "2",
                      "--save", str(tmp_path / "devices.keras"), env=_env())
    assert devices.returncode == 0, devices.stderr[-3000:]
    one = cli("train", *flags, "--engine", "native", "--save", str(tmp_path / "one.keras"))
    assert one.returncode == 0, one.stderr[-3000:]
    reference = _weights(tmp_path / "one.keras")
    for run in ("two", "devices"):
        gaps = [float(np.max(np.abs(a - b))) for a, b in
                zip(reference, _weights(tmp_path / f"{run}.keras"), strict=True)]
        print(f"largest parameter gap, {run} vs one process ({BACKEND}): {max(gaps):.3g}")
        assert max(gaps) < PROCESS_GAP_TOLERANCE, run
        state = _optimizer_state(tmp_path / f"{run}.keras")  # the same Adam state saved
        for a, b in zip(_optimizer_state(tmp_path / "one.keras"), state, strict=True):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=PROCESS_GAP_TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_lost_process_stops_the_others(tmp_path, how):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    common = [sys.executable, "-m", "kbackend", "train", *TRAIN[:-1], "--engine", "data_parallel",
              "--epochs", "1000", "--fused-steps", "1",
              "--num-processes", "2", "--coordinator", f"127.0.0.1:{port}",
              "--heartbeat-timeout", "5", "--coordinator-timeout", "60"]
    logs = [open(tmp_path / f"p{i}.log", "w+") for i in range(2)]  # noqa: SIM115
    processes = [subprocess.Popen([*common, "--process-id", str(i)], cwd=ROOT, env=_env(),
                                  stdout=logs[i], stderr=subprocess.STDOUT, text=True)
                 for i in range(2)]
    try:
        deadline = time.monotonic() + 300
        while "epoch 2/" not in (tmp_path / "p0.log").read_text():  # both are training
            assert processes[0].poll() is None, (tmp_path / "p0.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.5)
        processes[1].send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        lost_at = time.monotonic()
        code = processes[0].wait(timeout=DEAD_PEER_BOUND_S)
        waited = time.monotonic() - lost_at
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for log in logs:
            log.close()
    output = (tmp_path / "p0.log").read_text()
    print(f"{BACKEND}: surviving process exited with {code} {waited:.1f}s after its peer was {how}")
    assert code == 3, output[-3000:]
    assert "kbackend: error: process 0 of 2 stopped" in output, output[-3000:]
    assert waited < 5 + 10  # the heartbeat timeout, plus slack for a loaded machine


@pytest.mark.slow
def test_process_0_alone_gives_up_after_the_coordinator_timeout(cli_process):
    result = cli_process("train", "--engine", "data_parallel", "--fused-steps", "1",
                         "--num-processes", "2", "--process-id", "0",
                         "--coordinator", f"127.0.0.1:{_free_port()}", "--coordinator-timeout",
                         "2", timeout=120)
    assert result.returncode == 3, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("kbackend: error")]
    assert errors == [errors[0]] and "1 process(es) did not join" in errors[0]
    assert "within 2s (--coordinator-timeout)" in errors[0]


def test_launch_refuses_bad_train_arguments_before_starting_a_process(cli):
    result = cli("launch", "-N", "2", "--", "--epochs", "many")
    assert result.returncode == 2 and "invalid int value: 'many'" in result.stderr
    assert "processes, coordinator" not in result.stderr  # nothing was started


def test_launch_checks_the_data_once_before_starting_a_process(cli, tmp_path, monkeypatch):
    # MNIST is not there (offline, no files, no cached download): one line from the launcher,
    # exit 2, and no process started (issue 36: N processes each failed the same check).
    monkeypatch.setenv("KBACKEND_OFFLINE", "1")
    monkeypatch.delenv("KBACKEND_DATA_DIR", raising=False)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras-home"))
    result = cli("launch", "-N", "2", "--", "--dataset", "mnist", "--data-dir", str(tmp_path),
                 "--epochs", "1")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert one_line_error(result.stderr) and "mnist" in result.stderr.lower()
    assert "processes, coordinator" not in result.stderr  # nothing was started


@pytest.mark.parametrize("options", [
    ("--epochs", str(10**20)), ("--batch-size", "5000"), ("--batch-size", "63"),
], ids=["epochs-beyond-int32", "batch-beyond-the-data", "batch-not-split-evenly"])
def test_launch_refuses_what_every_process_would_refuse(cli, options):
    result = cli("launch", "-N", "2", "--", *options)
    assert result.returncode == 2, result.stderr[-2000:]
    assert [line for line in result.stderr.splitlines() if "error" in line] == \
        result.stderr.strip().splitlines()[-1:]  # one line
    assert "processes, coordinator" not in result.stderr


def test_launch_checks_a_user_model_on_builtin_data_as_a_builtin_one(cli, tmp_path):
    """The batch against the data and the processes is checked for every model the data's
    splits are known for (a built-in dataset), the user's builder as a built-in."""
    (tmp_path / "builder.py").write_text(
        "import keras\n"
        "def build(input_shape, num_classes):\n"
        "    inputs = keras.Input(input_shape)\n"
        "    return keras.Model(inputs, keras.layers.Dense(num_classes)(\n"
        "        keras.layers.Flatten()(inputs)))\n")
    result = cli("launch", "-N", "2", "--", "--model", f"{tmp_path / 'builder.py'}:build",
                 "--dataset", "digits", "--batch-size", "5000")
    assert result.returncode == 2 and one_line_error(result.stderr), result.stderr[-2000:]
    assert "5000" in result.stderr and "processes, coordinator" not in result.stderr


def test_launch_refuses_more_processes_than_cpus_unless_asked(cli, monkeypatch):
    from kbackend.commands import launch

    cpus = launch.usable_cpus()
    result = cli("launch", "-N", str(cpus + 1), "--", "--epochs", "1")
    assert result.returncode == 2 and one_line_error(result.stderr)
    assert f"Invalid --num-processes {cpus + 1}: this machine has {cpus} CPU(s)" in result.stderr
    assert "--oversubscribe" in result.stderr and "processes, coordinator" not in result.stderr
    # Asked for: the processes start (stand-ins that exit at once here).
    monkeypatch.setattr(launch, "worker_command",
                        lambda *args: [sys.executable, "-c", "pass"])
    result = cli("launch", "-N", str(cpus + 1), "--oversubscribe", "--", "--epochs", "1",
                 "--batch-size", str(8 * (cpus + 1)))
    assert result.returncode == 0, result.stderr
    assert f"{cpus + 1} processes, coordinator" in result.stderr


# Stand-in processes: process I sleeps its delay, then exits with its status or kills itself
# with its signal (negative); the launcher stops those still running after the first failure.
FAKE_WORKER = """
import os, signal, sys, time
plan = {PLAN}
delay, outcome = plan.get(int(sys.argv[1]), (60, 0))
print("started", flush=True)
time.sleep(delay)
if outcome < 0:
    os.kill(os.getpid(), -outcome)
sys.exit(outcome)
"""


@pytest.mark.parametrize(("plan", "status", "named"), [
    # A killed process; its peer notices and exits 3 (a lost peer) a moment later.
    ({1: (0.3, -signal.SIGKILL), 0: (0.5, 3)}, 3, "process 1 was killed by SIGKILL"),
    # The peer's exit 3 is seen first; the process that died is named all the same.
    ({0: (0.2, 3), 1: (0.5, -signal.SIGKILL)}, 3, "process 1 was killed by SIGKILL"),
    # A worker's bad input passes through as 2; a diverged run as 4.
    ({1: (0.2, 2)}, 2, "process 1 exited with status 2 (bad input)"),
    ({0: (0.2, 4), 1: (0.8, 4)}, 4, "process 0 exited with status 4 (training diverged)"),
    # Anything else is the job's failure: 3.
    ({0: (0.2, 1)}, 3, "process 0 exited with status 1"),
    ({0: (0.2, 3)}, 3, "process 0 exited with status 3 (lost a peer or could not join)"),
    ({0: (0.2, 0), 1: (0.3, 0)}, 0, None),
], ids=["killed-then-peer", "peer-then-killed", "bad-input", "diverged", "crashed",
        "lost-peer-only", "success"])
def test_launch_names_the_process_that_failed_and_exits_as_documented(cli, monkeypatch, plan,
                                                                         status, named):
    from kbackend.commands import launch

    script = FAKE_WORKER.replace("{PLAN}", repr(plan))
    monkeypatch.setattr(launch, "worker_command",
                        lambda args, n, index, coordinator: [sys.executable, "-c", script,
                                                             str(index)])
    started = time.monotonic()
    result = cli("launch", "-N", "2", "--", "--epochs", "1")
    assert result.returncode == status, result.stdout + result.stderr
    assert time.monotonic() - started < 30  # the other process was stopped, not waited for
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    if named is None:
        assert errors == []
    else:
        assert len(errors) == 1 and f"kbackend launch: error: {named}; stopped the other 1" \
            in errors[0], result.stderr


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")
def test_a_launcher_killed_with_sigkill_leaves_no_process_running(tmp_path):
    import psutil

    launcher = subprocess.Popen(
        [sys.executable, "-m", "kbackend", "launch", "-N", "2", "--", "--epochs", "1000",
         "--quiet"], cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        workers: list = []
        while len(workers) < 2:
            assert launcher.poll() is None and time.monotonic() < deadline
            workers = psutil.Process(launcher.pid).children()
            time.sleep(0.2)
        time.sleep(2)  # the workers are starting (importing, joining the job)
        launcher.kill()
        launcher.wait()
        _, alive = psutil.wait_procs(workers, timeout=15)
        assert alive == [], f"{len(alive)} worker(s) still running after the launcher died"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for worker in psutil.Process().children(recursive=True):
            worker.kill()


def test_launch_checks_a_users_data_before_starting_a_process(cli, tmp_path):
    # What needs no framework is checked once in the launcher: a .npz is read in full, a
    # folder listed, a data function's file parsed (nothing of the user's code runs there).
    (tmp_path / "data.npz").write_text("not an archive")
    (tmp_path / "one" / "cats").mkdir(parents=True)
    (tmp_path / "one" / "cats" / "a.png").write_bytes(b"")
    (tmp_path / "broken.py").write_text("def data(:\n")
    cases = {str(tmp_path / "data.npz"): "not a .npz archive",
             str(tmp_path / "one"): "one class subfolder (cats/): classification needs at "
                                    "least two classes",
             f"{tmp_path / 'broken.py'}:data": "syntax error at broken.py:1",
             f"{tmp_path / 'absent.py'}:data": "not found"}
    for source, message in cases.items():
        result = cli("launch", "-N", "2", "--", "--data", source, "--epochs", "1")
        assert result.returncode == 2 and one_line_error(result.stderr), result.stderr
        assert message in result.stderr, result.stderr
        assert "processes, coordinator" not in result.stderr  # nothing was started


@pytest.mark.slow
def test_launch_passes_a_workers_bad_input_on_as_2(cli, tmp_path):
    # A data function runs in each process only (the launcher does not run the user's code):
    # every process fails with one line, exit 2; the launcher exits 2 naming one of them. Its
    # sys.exit(3) is the user's, not a lost process's: bad input, 2.
    (tmp_path / "data.py").write_text("import sys\n\n\ndef data():\n    sys.exit(3)\n")
    result = cli("launch", "-N", "2", "--", "--data", f"{tmp_path / 'data.py'}:data",
                 "--epochs", "1")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "kbackend launch: error: process" in result.stderr
    assert "exited with status 2 (bad input)" in result.stderr
    # The blamed process's one-line data error is shown: live from process 0, or from the kept
    # output of process 1 when it failed first (the launcher then stops process 0, which under
    # load may not have reached its own error yet).
    assert re.search(r"^\[[01]\] kbackend: error: Invalid data source", result.stdout, re.M), \
        result.stdout[-2000:]
