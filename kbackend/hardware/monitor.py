"""A step monitor: how much of each training step waits for input and how much computes.

``StepMonitor`` is engine-agnostic. An engine (or a Keras callback) tells it when input waiting
begins and ends and when a step ends; the step's remaining time is compute. Compute is real
because the step end is only recorded after the step's results are ready (the caller passes them
to ``step_end(result=...)``, which waits with the backend's ``block_until_ready``).

    monitor = StepMonitor().start()
    for batch in monitor.timed(batches):             # time in next() counts as input wait
        state, metrics = train_step(state, batch)
        monitor.step_end(samples=len(batch[0]), result=metrics)
    summary = monitor.stop()                          # dict, stored in history.record.monitor

Utilization (NVML on a GPU, psutil CPU otherwise) is sampled in a background thread and device
memory is read through ``kbackend.backends.impl().device_memory_in_use()`` every few steps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from kbackend.backend_choice import keras as import_keras
from kbackend.backends import impl
from kbackend.hardware.device import UtilizationSampler

# A run whose steps spend more than this share of their time waiting for input is input-bound:
# the device is then busy less than 80 % of the time, below the usual 80-100 % goal.
INPUT_BOUND_SHARE = 0.20
INPUT_BOUND_ADVICE = (
    "prefetch the next batches on a host thread (kbackend.data.prefetch)",
    "move preprocessing into the model (Rescaling / Normalization layers run on the device)",
    "use a bigger batch (fewer, larger transfers per sample)",
    "fuse several steps per device call (native engine fused_steps, Keras steps_per_execution)",
)
COMPUTE_BOUND_ADVICE = (
    "the device is the bottleneck: try mixed precision, a bigger batch up to the throughput knee "
    "(kbackend advise), or faster hardware",
)


class StepMonitor:
    """Per-step input-wait vs compute split, samples/s, utilization and device memory.

    ``skip_first`` steps (the compiling ones) are recorded but left out of the summary.
    """

    def __init__(self, *, skip_first: int = 1, utilization_interval: float = 0.2,
                 memory_every: int = 10, synchronize: Callable[[Any], Any] | None = None) -> None:
        self.skip_first = skip_first
        self.memory_every = memory_every
        self.utilization_interval = utilization_interval
        self._synchronize = synchronize
        self.steps: list[dict[str, float]] = []
        self.memory: list[int] = []
        self._lock = threading.Lock()
        self._pending_wait = 0.0
        self._foreign_wait = False
        self._last_end: float | None = None
        self._sampler: UtilizationSampler | None = None
        self._train_thread: int | None = None

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> StepMonitor:
        """Start the utilization sampler and the step clock."""
        self._train_thread = threading.get_ident()
        if self.memory_every:
            _device_memory()  # imports the backend now, not during the first step
        self._sampler = UtilizationSampler(self.utilization_interval).start()
        self.reset_clock()
        return self

    def reset_clock(self) -> None:
        """Start timing the next step from now (call after evaluation or other pauses)."""
        with self._lock:
            self._last_end = time.perf_counter()
            self._pending_wait = 0.0

    def stop(self) -> dict[str, Any]:
        """Stop sampling and return the summary."""
        utilization = self._sampler.stop() if self._sampler is not None else None
        self._sampler = None
        return self.summary(utilization)

    # --- input wait ------------------------------------------------------------------------
    @contextmanager
    def input_wait(self) -> Iterator[None]:
        """Time spent inside this block counts as waiting for input."""
        thread, start = threading.get_ident(), time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            with self._lock:
                self._pending_wait += elapsed
                if self._train_thread is not None and thread != self._train_thread:
                    self._foreign_wait = True

    def timed(self, source: Iterable[Any]) -> Iterator[Any]:
        """Iterate ``source``, counting the time each ``next()`` takes as input wait."""
        iterator = iter(source)
        while True:
            with self.input_wait():
                try:
                    item = next(iterator)
                except StopIteration:
                    return
            yield item

    # --- steps -----------------------------------------------------------------------------
    def step_end(self, samples: int, steps: int = 1, result: Any = None) -> None:
        """Close ``steps`` train steps (one device call) that processed ``samples`` samples.

        ``result`` (the step's outputs) is waited for first, so the step's time is its real time.
        """
        if result is not None:
            (self._synchronize or impl().block_until_ready)(result)
        now = time.perf_counter()
        with self._lock:
            last = self._last_end if self._last_end is not None else now
            step_s = now - last
            wait_s = min(self._pending_wait, step_s)
            self._pending_wait = 0.0
            self._last_end = now
        self.steps.append({"step_s": step_s, "input_wait_s": wait_s, "compute_s": step_s - wait_s,
                           "samples": int(samples), "steps": int(steps)})
        if self.memory_every and len(self.steps) % self.memory_every == 1:
            read_start = time.perf_counter()
            used = _device_memory()
            if used is not None:
                self.memory.append(used)
            with self._lock:  # the read is the monitor's own cost: keep it out of the next step
                self._last_end += time.perf_counter() - read_start

    # --- summary ---------------------------------------------------------------------------
    def summary(self, utilization: dict[str, Any] | None = None) -> dict[str, Any]:
        """Totals, shares, samples/s, utilization, memory and the verdict with what to try."""
        kept = self.steps[self.skip_first:] or self.steps
        total = sum(s["step_s"] for s in kept)
        wait = sum(s["input_wait_s"] for s in kept)
        samples = sum(s["samples"] for s in kept)
        share = wait / total if total > 0 else 0.0
        input_bound = share > INPUT_BOUND_SHARE
        per_step = np.asarray([s["step_s"] / s["steps"] for s in kept]) if kept else np.zeros(1)
        return {
            "calls": len(kept),
            "steps": int(sum(s["steps"] for s in kept)),
            "skipped_calls": len(self.steps) - len(kept),
            "total_s": total,
            "input_wait_s": wait,
            "compute_s": total - wait,
            "input_wait_share": share,
            "median_step_s": float(np.median(per_step)),
            # At the median step, so the two figures agree; the mean over all calls beside it.
            "samples_per_s": (samples / max(sum(s["steps"] for s in kept), 1)
                              / float(np.median(per_step)) if total > 0 else 0.0),
            "mean_samples_per_s": samples / total if total > 0 else 0.0,
            "input_wait_measured": ("on a producer thread (an upper bound: it may overlap compute)"
                                    if self._foreign_wait else "on the training thread"),
            "utilization": utilization,
            "device_memory_bytes": max(self.memory) if self.memory else None,
            "verdict": "input-bound" if input_bound else "compute-bound",
            "threshold_share": INPUT_BOUND_SHARE,
            "try": list(INPUT_BOUND_ADVICE if input_bound else COMPUTE_BOUND_ADVICE),
        }


def format_summary(summary: dict[str, Any]) -> str:
    """A few human-readable lines describing a monitor summary."""
    util = summary.get("utilization") or {}
    memory = summary.get("device_memory_bytes")
    lines = [
        f"monitor: {summary['verdict']}: input wait {100 * summary['input_wait_share']:.1f}% of "
        f"{summary['total_s']:.2f}s over {summary['steps']} steps "
        f"(threshold {100 * summary['threshold_share']:.0f}%), median step "
        f"{1e3 * summary['median_step_s']:.2f} ms = {summary['samples_per_s']:.0f} samples/s "
        f"(mean over the run {summary.get('mean_samples_per_s', summary['samples_per_s']):.0f})",
        f"monitor: utilization {util.get('mean_percent', float('nan')):.0f}% mean / "
        f"{util.get('max_percent', float('nan')):.0f}% max ({util.get('source', '?')}), "
        "device memory "
        + (f"{memory / 2**20:.1f} MiB" if memory is not None
           else "not reported by this backend/device"),
    ]
    lines += [f"monitor: try: {item}" for item in summary["try"]]
    return "\n".join(lines)


def _device_memory() -> int | None:
    return impl().device_memory_in_use()


def keras_callback(monitor: StepMonitor, batch_size: int, steps_per_execution: int = 1) -> Any:
    """A Keras callback feeding ``monitor`` from ``model.fit``.

    Step ends are recorded at ``on_train_batch_end`` after the logs are read (which waits for the
    step). Input wait comes from the input source: pass ``fit`` a ``monitored_batches`` dataset.
    Evaluation pauses are excluded by restarting the step clock after each validation.
    """
    # Any: mypy cannot see the classes of a module imported at run time (the bases below)
    keras: Any = import_keras()

    class MonitorCallback(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            monitor.start()

        def on_epoch_begin(self, epoch, logs=None):
            monitor.reset_clock()

        def on_train_batch_end(self, batch, logs=None):
            # Reading a value waits for the step's results on every backend.
            float((logs or {}).get("loss", 0.0))
            monitor.step_end(samples=batch_size * steps_per_execution, steps=steps_per_execution)

        def on_test_end(self, logs=None):
            monitor.reset_clock()

    return MonitorCallback()
