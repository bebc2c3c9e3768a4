"""kbackend.runtime.child: the one way to run a function under a backend in a child process.

Children here run stdlib functions or the helpers below (this module is importable in the child:
the child's PYTHONPATH starts with the package root). No timing thresholds."""

from __future__ import annotations

import os
import sys
import time

import pytest

from kbackend.backend_choice import BACKENDS
from kbackend.errors import BackendError, KBackendError
from kbackend.runtime.child import (
    PACKAGE_ROOT,
    ChildFailed,
    ChildTimeout,
    child_environment,
    run_in_child,
)
from tests.conftest import BACKEND


def sleep_for(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def die_after_a_word(status: int) -> None:
    print("about to die", flush=True)
    sys.stderr.write("the last words\n")
    sys.stderr.flush()
    os._exit(status)


def log_like_a_framework() -> None:
    sys.stderr.write("I0000 00:00:1796317739.399876   11897 port.cc:153] oneDNN custom "
                     "operations are on.\n")
    sys.stderr.write("epoch 1/2: val_accuracy 0.5\n")
    sys.stderr.flush()


def test_an_echoing_child_passes_its_lines_on_but_not_the_frameworks_logs(capsys, monkeypatch):
    monkeypatch.delenv("KBACKEND_VERBOSE", raising=False)
    run_in_child("tests.test_runtime_child:log_like_a_framework", BACKEND, echo=True)
    echoed = capsys.readouterr().err
    assert "epoch 1/2: val_accuracy 0.5" in echoed and "port.cc" not in echoed
    monkeypatch.setenv("KBACKEND_VERBOSE", "1")  # --verbose: everything
    run_in_child("tests.test_runtime_child:log_like_a_framework", BACKEND, echo=True)
    assert "port.cc:153] oneDNN" in capsys.readouterr().err


def test_child_environment_names_the_backend_and_this_kbackend():
    env = child_environment("tf", virtual_devices=4, extra={"XLA_FLAGS": "--xla_dump_to=/tmp/x"})
    assert env["KERAS_BACKEND"] == "tensorflow"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == PACKAGE_ROOT
    assert env["KBACKEND_VIRTUAL_DEVICES"] == "4" and env["JAX_NUM_CPU_DEVICES"] == "4"
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"
    with pytest.raises(BackendError):
        child_environment("torch")


def test_a_child_returns_the_functions_result():
    assert run_in_child("json:dumps", BACKEND, {"obj": [1, {"a": 2.5}]}) == '[1, {"a": 2.5}]'


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_child_runs_on_the_requested_backend(backend):
    assert run_in_child("os:getenv", backend, {"key": "KERAS_BACKEND"}) == backend


def test_an_exception_in_the_child_is_one_kbackend_error_line():
    with pytest.raises(ChildFailed) as info:
        run_in_child("json:loads", BACKEND, {"s": "{not json"})
    message = str(info.value)
    assert isinstance(info.value, KBackendError)
    assert "\n" not in message
    assert "json:loads" in message and BACKEND in message
    assert "JSONDecodeError: Expecting property name" in message


def test_a_crash_without_a_result_names_the_status_and_the_last_output_line():
    with pytest.raises(ChildFailed) as info:
        run_in_child("tests.test_runtime_child:die_after_a_word", BACKEND, {"status": 3})
    message = str(info.value)
    assert "status 3" in message and "the last words" in message and "\n" not in message


def test_a_child_past_its_time_limit_is_killed_and_reported():
    with pytest.raises(ChildTimeout) as info:
        run_in_child("tests.test_runtime_child:sleep_for", BACKEND, {"seconds": 120}, timeout_s=3)
    assert "did not finish within 3 s" in str(info.value)


def test_a_result_that_is_not_json_is_a_one_line_error():
    with pytest.raises(ChildFailed,
                       match="TypeError: Object of type object is not JSON serializable"):
        run_in_child("builtins:object", BACKEND)


def test_a_bad_target_is_a_one_line_error():
    with pytest.raises(ChildFailed, match=r"Invalid child target\. Expected 'module:function'"):
        run_in_child("json", BACKEND)


def raw_request_and_value(x: float) -> dict:
    """The child's own request file as written (and ``x`` as the child received it)."""
    from pathlib import Path

    return {"x": x, "request": Path(sys.argv[1]).read_text(encoding="utf-8")}


def test_the_request_file_is_strict_json_and_non_finite_arguments_arrive():
    import json
    import math

    reply = run_in_child("tests.test_runtime_child:raw_request_and_value", BACKEND,
                         {"x": float("nan")})
    assert math.isnan(reply["x"])

    def refuse(constant):
        raise AssertionError(f"bare {constant} in the request file")

    request = json.loads(reply["request"], parse_constant=refuse)
    assert request["kwargs"]["x"] is None and request["non_finite"] == {"/kwargs/x": "NaN"}
