"""The one backend boundary: every JAX- or TensorFlow-specific operation kbackend uses.

``impl()`` returns the package implementing ``BackendOps`` for the active Keras backend
(``kbackend.backends.jax`` or ``kbackend.backends.tensorflow``, with the same module names
inside). It is resolved once per process. Code elsewhere calls ``impl().name(...)`` and never
branches on the backend name; a test checks that both packages expose every member below with
the same signature.
"""

from __future__ import annotations

import functools
import importlib
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np

from kbackend.backend_choice import framework_import, selected_backend
from kbackend.history import RunRecord

_PACKAGES = {"jax": "kbackend.backends.jax", "tensorflow": "kbackend.backends.tensorflow"}


class Trainer(Protocol):
    """Runs compiled calls of K fused train steps for the one epoch loop
    (``kbackend.engines.loop``).

    ``put_epoch`` takes the epoch's ``(steps, batch)`` sample-index matrix and returns it in
    whatever form ``run`` consumes (on the device, or this process's columns). ``compile``
    compiles the ``length``-step call if needed and returns the seconds it took (0.0 if cached);
    ``run`` dispatches it asynchronously and returns a handle to its per-step losses, which
    ``fetch`` waits for. ``evaluate`` returns (validation loss, validation accuracy);
    ``snapshot``/``restore`` copy the model's values (for early stopping); ``finish`` writes the
    trained values back into the Keras model. ``trace_counts`` counts compilations per call
    length; ``run_record`` holds what the trainer adds to the history's ``RunRecord``. ``unroll``:
    whether a call's K steps are written out one after another (conv models on a CPU,
    ``capabilities.unrolls_its_loop``), so that its program holds K copies of the step.
    """

    trace_counts: dict[int, int]
    run_record: RunRecord
    unroll: bool

    def put_epoch(self, rows: np.ndarray) -> Any: ...
    def compile(self, length: int, epoch_rows: Any) -> float: ...
    def run(self, epoch_rows: Any, start: int, length: int) -> Any: ...
    def fetch(self, losses: Any) -> np.ndarray: ...
    def evaluate(self) -> tuple[float, float]: ...
    def snapshot(self) -> Any: ...
    def restore(self, snapshot: Any) -> None: ...
    def finish(self) -> None: ...


class ReusableTrainer(Trainer, Protocol):
    """A ``Trainer`` that runs many runs on its compiled programs (the native trainers).

    ``reset`` starts a new run from the model's ``(trainable, non_trainable)`` values with a
    fresh optimizer state at base rate ``learning_rate``; the rate is a runtime value of the
    compiled step, so nothing is traced or compiled again. ``evaluate_test`` returns (test loss,
    test accuracy), computed like ``evaluate``.
    """

    def reset(self, values: Any, learning_rate: float) -> None: ...
    def evaluate_test(self) -> tuple[float, float]: ...


class BackendOps(Protocol):
    """What each backend package provides (module-level functions; see each package's modules)."""

    # ops: versions, devices, processes, memory, transfers
    def framework_versions(self) -> dict[str, str]: ...
    def start(self) -> None: ...
    def set_random_seed(self, seed: int) -> None: ...
    def devices(self) -> list[dict[str, Any]]: ...
    def block_until_ready(self, value: Any) -> Any: ...
    def compilation_counter(self) -> AbstractContextManager[dict[str, Any]]: ...
    def to_numpy(self, value: Any) -> np.ndarray: ...
    def setup_virtual_devices(self, count: int) -> None: ...
    def device_count(self) -> int: ...
    def local_device_count(self) -> int: ...
    def platform(self) -> str: ...
    def initialize_processes(self, coordinator: str, num_processes: int, process_id: int,
                             timeout_s: int, heartbeat_s: int,
                             check_coordinator: Callable[[], None] = ...) -> None: ...
    def process_index(self) -> int: ...
    def process_count(self) -> int: ...
    def device_memory_in_use(self) -> int | None: ...
    def to_device(self, batch: Any) -> Any: ...
    def device_scope(self, platform: str) -> Any: ...
    # native: the fused single-device trainer (``native_loop_uses_xla``: whether its loop is
    # one XLA program for a run's ``jit_compile``)
    native_trainer: Callable[..., ReusableTrainer]
    def native_loop_uses_xla(self, jit_compile: bool) -> bool: ...
    # population: a cell's runs as one vmapped program (``supports_populations`` says where)
    population_trainer: Callable[..., Any]
    # data_parallel: the native data-parallel trainer and Keras fit's distribution pieces
    data_parallel_trainer: Callable[..., Trainer]
    def data_parallel_scope(self, count: int) -> AbstractContextManager[Any]: ...
    def keras_fit_inputs(self, x: Any, y: Any, batch_size: int) -> tuple[Any, Any, int]: ...
    def data_parallel_jit_compile(self, requested: bool) -> bool: ...
    def data_parallel_clone_layer(self, layer: Any) -> Any: ...
    # gradients
    def gradients(self, model: Any, x: Any, y: Any, *, training: bool = True,
                  as_numpy: bool = True, task: Any = None) -> tuple[Any, list[Any]]: ...
    def bias_add_misroutes(self, model: Any, x: Any) -> list[str]: ...
    # probes: what this installation supports
    def supports_channels_first_conv(self) -> bool: ...
    def supports_populations(self) -> bool: ...
    def precision_support(self) -> dict[str, dict[str, bool]]: ...
    def matmul_flops(self, n: int = 1024, dtype: str = "float32", repeats: int = 10,
                     jit: bool = True) -> dict[str, Any]: ...
    def train_step_memory(self, model: Any, x: Any, y: Any) -> dict[str, Any]: ...
    # reference: the hand-written loop the engine benchmark measures the engines against
    def reference_train_loop(self, params: Any, x: Any, y: Any,
                             learning_rate: float) -> Callable[[], None]: ...
    # (the Conv1D + BatchNorm classifier of examples/models.py, for the user-model benchmark;
    # a call trains one epoch and returns its losses, ``.weights()`` the current values)
    def reference_conv1d_loop(self, params: Any, x: Any, y: Any, learning_rate: float, *,
                              steps_per_call: int = 0,
                              unroll: bool = False) -> Callable[[], np.ndarray]: ...


def backend_package(name: str) -> BackendOps:
    """The package implementing ``BackendOps`` for backend ``name`` (imports its framework)."""
    with framework_import():
        return importlib.import_module(_PACKAGES[name])


@functools.cache
def impl() -> BackendOps:
    """The backend package of the active Keras backend, resolved once per process.

    Keras cannot switch backends once imported (``kbackend.backend_choice``), so the first
    answer stays right for the life of the process. Keras itself is not imported here (the
    selected backend is fixed before it is), so commands that need no model skip its import.
    """
    package = backend_package(selected_backend())
    package.start()
    return package


def adaptive() -> Any:
    """The active backend's ``adaptive`` module (micro-batched gradients for ``--batch-size
    auto``: ``micro_batched_gradients`` and the adaptive train step), same names in both."""
    impl()  # started, as every backend entry point is
    return importlib.import_module(f"{_PACKAGES[selected_backend()]}.adaptive")


def kept_while_alive(memo: dict[Any, Any], key: Any, owners: tuple[Any, ...],
                     build: Callable[[], Any]) -> Any:
    """``memo[key]``, built by ``build()`` on first use; dropped when any of ``owners`` (the
    objects ``key`` names by ``id``) is garbage-collected."""
    if key not in memo:
        memo[key] = build()
        for owner in owners:
            weakref.finalize(owner, memo.pop, key, None)
    return memo[key]


_DEVICE_COPIES: dict[int, Any] = {}


def device_copy_once(array: np.ndarray, put: Callable[[np.ndarray], Any]) -> Any:
    """``put(array)`` (a copy on the device), made once per host array while it lives.

    Several trainers of one dataset (a study's cells) then share one device copy of it instead
    of one each.
    """
    return kept_while_alive(_DEVICE_COPIES, id(array), (array,), lambda: put(array))
