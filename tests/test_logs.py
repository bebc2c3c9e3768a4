"""The frameworks' own log lines are hidden by default and shown with ``--verbose`` (kbackend.logs).

The file-descriptor filter changes a whole process, so it is checked in fresh processes: a tiny
one that writes log-shaped lines itself (no framework: fast), and one real ``train`` per backend.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap

import pytest

from kbackend import logs
from tests.conftest import BACKEND, ROOT

ONEDNN = b"I0000 00:00:1796278001.509693   28238 port.cc:153] oneDNN custom operations are on."
ABSL_PRE_INIT = (b"WARNING: All log messages before absl::InitializeLog() is called "
                 b"are written to STDERR")
# A C++ log line of any of the frameworks, as it reaches a console.
FRAMEWORK_LINE = re.compile(
    r"^(?:[IWE]\d{4} \d\d:\d\d:|WARNING: All log messages before absl|\[Gloo\])", re.MULTILINE)


@pytest.mark.parametrize(("line", "dropped"), [
    (ONEDNN, True),
    (ABSL_PRE_INIT, True),
    (b"E0000 00:00:1796278001.5 28238 coordination_service_agent.cc:410] StartAbort", True),
    (b"W1203 06:37:00.123456  123 cpu_allocator_impl.cc:83] Allocation exceeds 10%", True),
    (b"I1203 06:37:00.123456  123 cpu_feature_guard.cc:210] "
     b"This TensorFlow binary is optimized", True),
    (b"To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow "
     b"with the appropriate compiler flags.", True),
    (b"[Gloo] Rank 0 is connected to 1 peer ranks. "
     b"Expected number of connected peer ranks is : 1", True),
    (b"F0000 00:00:1796278001.5 28238 check.cc:1] Check failed: x", False),  # a crash's reason
    (b"kbackend: error: Batch size 100000 is larger than the training split", False),
    (b"Traceback (most recent call last):", False),
    (b"epoch 1/1  step 40  train_loss 1.0536", False),
    (b"I1 think this is fine", False),
    (b"", False),
])
def test_which_lines_are_framework_logs(line, dropped):
    assert logs.is_framework_log(line) is dropped


FILTERED_CHILD = textwrap.dedent("""
    import os, subprocess, sys
    from kbackend import logs
    assert logs.install_filter() and not logs.install_filter()
    os.write(2, ONEDNN + b"\\n" + ABSL_PRE_INIT + b"\\n")
    os.write(2, b"from C: kept\\n")
    os.write(1, b"[Gloo] Rank 0 is connected to 1 peer ranks\\nresult 42\\n")
    subprocess.run([sys.executable, "-c",
                    "import os; os.write(2, ONEDNN + b'\\\\nchild kept\\\\n')"], check=True)
    print("stdout from python", flush=True)
    sys.stderr.write("kbackend: error: one whole line")  # no newline, then straight to exit
    sys.exit(STATUS)
""")


def run_filtered(status: int, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    header = f"ONEDNN = {ONEDNN!r}\nABSL_PRE_INIT = {ABSL_PRE_INIT!r}\nSTATUS = {status}\n"
    script = FILTERED_CHILD.replace("ONEDNN + b'", f"{ONEDNN!r} + b'")
    return subprocess.run([sys.executable, "-c", header + script], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(extra_env or {})},
                          timeout=60, cwd=ROOT)


def test_filter_drops_log_lines_and_keeps_everything_else():
    result = run_filtered(status=2)
    assert result.returncode == 2, result.stderr
    # Python's own writes skip the filter, so they may overtake the C-level ones: no order; and
    # the last one, without a newline, may run into a C-level line the filter forwards after it.
    error_line = "kbackend: error: one whole line"
    assert result.stderr.count(error_line) == 1, result.stderr
    rest = result.stderr.replace(error_line, "\n")
    assert sorted(line for line in rest.splitlines() if line) == ["child kept", "from C: kept"]
    assert sorted(result.stdout.splitlines()) == ["result 42", "stdout from python"]


def test_without_the_filter_the_same_lines_show():  # negative control: the lines are really there
    script = f"import os\nos.write(2, {ONEDNN!r} + b'\\n')\nos.write(1, b'[Gloo] Rank 0\\n')\n"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60)
    assert FRAMEWORK_LINE.search(result.stderr) and FRAMEWORK_LINE.search(result.stdout)


def test_filter_keeps_tracebacks_and_exit_status():
    script = "from kbackend import logs\nlogs.install_filter()\nraise ValueError('boom')\n"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and result.stderr.rstrip().endswith("ValueError: boom")


@pytest.mark.parametrize("verbose", [False, True])
def test_python_framework_warnings_follow_verbose(cli, verbose, monkeypatch):
    monkeypatch.delenv(logs.VERBOSE_ENV, raising=False)
    before = {name: logging.getLogger(name).level for name in logs.FRAMEWORK_LOGGERS}
    flags = ["--verbose"] if verbose else []
    try:
        # refused before training
        result = cli("train", "--batch-size", "100000", "--quiet", *flags)
        assert result.returncode == 2
        for name in logs.FRAMEWORK_LOGGERS:
            # a retracing warning is logging.getLogger("tensorflow").warning(...)
            assert logging.getLogger(name).isEnabledFor(logging.WARNING) is verbose
            assert logging.getLogger(name).isEnabledFor(logging.ERROR)
    finally:
        for name, level in before.items():  # setLevel, not an attribute: it clears logging's cache
            logging.getLogger(name).setLevel(level)


def train_in_fresh_process(*flags: str) -> subprocess.CompletedProcess:
    """``kbackend train`` on digits as the console script runs it; prints whether TensorFlow was
    imported, last, on stdout."""
    argv = ["train", "--dataset", "digits", "--epochs", "1", "--max-steps", "3", *flags]
    script = ("import sys\nfrom kbackend.cli import main\n"
              f"code = main({argv!r}, own_process=True)\n"
              "print('tensorflow imported:', 'tensorflow' in sys.modules)\nsys.exit(code)\n")
    env = {**os.environ, "KERAS_BACKEND": BACKEND, "PYTHONPATH": str(ROOT)}
    env.pop(logs.VERBOSE_ENV, None)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)


@pytest.mark.slow  # two fresh processes that import the framework (TensorFlow: ~20 s each here)
def test_train_shows_framework_logs_only_with_verbose():
    # JAX: --fused-steps auto, whose probe once imported TensorFlow (keras.models.clone_model)
    quiet = train_in_fresh_process(*(() if BACKEND == "jax" else ("--fused-steps", "1")))
    assert quiet.returncode == 0, quiet.stderr
    assert not FRAMEWORK_LINE.search(quiet.stderr + quiet.stdout), quiet.stderr
    assert "epoch 1/1" in quiet.stderr  # kbackend's own progress line still shows
    imported = quiet.stdout.splitlines()[-1]
    if BACKEND == "jax":
        assert imported == "tensorflow imported: False"  # nothing pulls TensorFlow in under JAX
        return
    assert imported == "tensorflow imported: True"
    # Negative control: TensorFlow logs its lines as it loads, so no probe is needed (K = 1, one
    # compilation fewer than auto's).
    verbose = train_in_fresh_process("--verbose", "--fused-steps", "1")
    assert verbose.returncode == 0, verbose.stderr
    assert FRAMEWORK_LINE.search(verbose.stderr), verbose.stderr


def test_exit_does_not_wait_for_a_child_that_holds_the_pipes():
    # The filter would read until every writer is gone; a lingering child must not hold the exit.
    script = ("import subprocess, sys\nfrom kbackend import logs\nlogs.install_filter()\n"
              "print(subprocess.Popen(['sleep', '60']).pid, flush=True)\n"
              "sys.stderr.write('kbackend: error: last words')\nsys.exit(3)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=30, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    os.kill(int(result.stdout.split()[0]), 9)  # the sleeper this test started
    assert result.returncode == 3 and result.stderr == "kbackend: error: last words"


def test_the_python_api_hides_tfs_retracing_warning_about_kbackends_functions_only(caplog):
    """A study builds one evaluator per model, so TensorFlow counts "retracing" across them;
    once the TensorFlow backend is loaded, that warning about kbackend's own functions is dropped
    (no CLI needed), and the same warning about a user's function still shows."""
    logger = logging.getLogger("tensorflow")
    own = ("5 out of the last 16 calls to <bound method Evaluator._evaluate_fn of "
           "<kbackend.backends.tensorflow.native.Evaluator object at 0x7f> triggered "
           "tf.function retracing. Tracing is expensive")
    theirs = "5 out of the last 6 calls to <function step at 0x7f> triggered tf.function retracing"
    if BACKEND == "tensorflow":
        from kbackend.backends import impl
        impl()  # the backend installs the filter when it loads
        assert logs._OWN_RETRACING in logger.filters
    logs.hide_own_retracing_warnings()
    logs.hide_own_retracing_warnings()  # once: a second call adds no second filter
    assert sum(isinstance(f, logs._OwnRetracing) for f in logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger="tensorflow"):
        logger.warning(own)
        logger.warning(theirs)
    assert [r.getMessage() for r in caplog.records] == [theirs]
