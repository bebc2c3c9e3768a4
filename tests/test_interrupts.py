"""Ctrl-C ends every command with status 130, also when it arrives inside a garbage-collection
callback (JAX registers one), where Python's own handler's exception is printed as "Exception
ignored" and dropped (kbackend.cli.install_interrupt_handler)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import BACKEND, ROOT

# SIGINT back to Python's handler first: a test run started in the background inherits it
# ignored, and an ignored SIGINT stays ignored (Python and kbackend leave it so). Across an exec,
# SIG_DFL: the new Python installs its own handler then.
PYTHON_SIGINT = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
DEFAULT_SIGINT = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "

# SIGINT received while a garbage-collection callback, a weakref callback or a __del__ runs
# (where an exception is "ignored"); then the main code goes on.
INTERRUPT_INSIDE = """
import gc, os, signal, sys, time, weakref
if sys.argv[1] == "kbackend":
    from kbackend.cli import install_interrupt_handler
    install_interrupt_handler()
def interrupt():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # the Python handler runs here, inside the callback
class Thing:
    def __del__(self):
        interrupt()
def callback(phase, info):
    if phase == "start" and not getattr(callback, "done", False):
        callback.done = True
        interrupt()
try:
    if sys.argv[2] == "gc":
        gc.callbacks.append(callback)
        gc.collect()
    elif sys.argv[2] == "weakref":
        thing = type("Plain", (), {})()
        ref = weakref.ref(thing, lambda _: interrupt())
        del thing
    else:
        thing = Thing()
        del thing
    time.sleep(1)  # the interrupt, raised again 0.05 s after the callback, lands here
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted")
    sys.exit(130)
"""
PLACES = ("gc", "weakref", "del")


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PYTHON_SIGINT + code, *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)


@pytest.mark.parametrize("place", PLACES)
def test_python_drops_an_interrupt_raised_in_a_callback(place):
    # The negative control: Python's own handler (what ate 2 of 8 early Ctrl-Cs, in JAX's GC
    # callback).
    result = _python(INTERRUPT_INSIDE, "python", place)
    assert result.stdout.strip() == "not interrupted" and result.returncode == 0
    assert "Exception ignored" in result.stderr and "KeyboardInterrupt" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("place", PLACES)
def test_kbackend_raises_it_once_the_callback_returned(place):
    for _ in range(3):
        result = _python(INTERRUPT_INSIDE, "kbackend", place)
        assert result.stdout.split() == ["interrupted"], result.stderr
        assert result.returncode == 130 and "Exception ignored" not in result.stderr


def test_ctrl_c_in_the_first_seconds_of_a_command_exits_130():
    # Commands that would train for minutes, each sent SIGINT at another moment of its start-up
    # (imports, JAX's or TensorFlow's start, data, compilation), all at once to keep it short.
    # The delays count from each interpreter's first line of Python: a signal inside CPython's
    # own start-up (its site import, before any code runs) is a fatal error kbackend cannot
    # reach, and on a loaded machine 0.5 s after the spawn can still be there. The command runs
    # as ``python -m kbackend`` does (runpy), in the same interpreter, with the SIGINT handler
    # a fresh interpreter has (KeyboardInterrupt; the test process may have SIGINT ignored).
    delays = (0.5, 1.0, 1.5, 2.5, 4.0)
    command = [sys.executable, "-c",
               "import runpy, signal, sys; signal.signal(signal.SIGINT, "
               "signal.default_int_handler); sys.stderr.write('started\\n'); "
               "sys.stderr.flush(); sys.argv = ['kbackend', *sys.argv[1:]]; "
               "runpy.run_module('kbackend', run_name='__main__', alter_sys=True)",
               "train", "--epochs", "1000", "--quiet", "--no-compile-cache"]
    env = {**os.environ, "KERAS_BACKEND": BACKEND, "KBACKEND_OFFLINE": "1"}
    processes = [subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in delays]
    for process in processes:
        assert process.stderr is not None and process.stderr.readline() == "started\n"
    started = time.monotonic()
    try:
        for delay, process in zip(delays, processes, strict=True):
            time.sleep(max(0.0, started + delay - time.monotonic()))
            process.send_signal(signal.SIGINT)
        results = [(process.wait(timeout=120), *process.communicate()) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    for delay, (code, _, stderr) in zip(delays, results, strict=True):
        assert code == 130, f"SIGINT at {delay}s: exit {code}\n{stderr[-2000:]}"
        assert stderr.strip().splitlines()[-1] == "kbackend: interrupted", stderr[-2000:]
        assert "Exception ignored" not in stderr and "Traceback" not in stderr, stderr[-2000:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="checks /proc")
def test_an_ignored_sigint_stays_ignored():
    # A process started with SIGINT ignored (nohup, a background job) is not made
    # interruptible by kbackend's handler.
    code = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            "from kbackend.cli import install_interrupt_handler; "
            "print(install_interrupt_handler(), signal.getsignal(signal.SIGINT) is signal.SIG_IGN)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, timeout=60)
    assert result.stdout.split() == ["None", "True"], result.stderr


def test_an_interrupt_inside_a_c_extensions_initialisation_is_raised_after_it():
    # A C extension module's initialisation may clear the exception (3 of 48 early Ctrl-Cs were
    # lost in JAX's MLIR and NumPy's random modules): the handler waits until it has returned.
    import importlib.machinery

    from kbackend.cli import _swallows_exceptions

    class Loader(importlib.machinery.ExtensionFileLoader):
        def exec_module(self, module):
            return sys._getframe()

    loader = Loader("fake", "/nonexistent/fake.so")
    assert _swallows_exceptions(loader.exec_module(None))
    assert not _swallows_exceptions(sys._getframe())
