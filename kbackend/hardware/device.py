"""How busy the hardware is: utilization sampling (CPU features:
``kbackend.backends.capabilities``).

Utilization comes from NVML (``nvidia-ml-py``) when an NVIDIA GPU is present and from ``psutil``
(CPU) otherwise. Both imports are guarded: nothing here needs a GPU.
"""

from __future__ import annotations

import threading
from typing import Any

import psutil


def _nvml() -> Any:
    """The initialized ``pynvml`` module with at least one GPU, or None."""
    try:
        import pynvml  # deferred: optional, and useful only on NVIDIA GPUs
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() < 1:
            return None
    except Exception:  # NVML raises its own error types when no driver is loaded
        return None
    return pynvml


class UtilizationSampler:
    """Samples device utilization (%) in a background thread every ``interval`` seconds.

    Source: NVML GPU utilization of device 0 when available, else this process's CPU use from
    psutil, as a share of all cores (0-100: 100 is every core busy with this process; other
    processes on a shared machine do not count).
    """

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        nvml = _nvml()
        if nvml is not None:
            handle = nvml.nvmlDeviceGetHandleByIndex(0)
            self.source = "nvml:gpu0"
            self._read = lambda: float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        else:
            process, cores = psutil.Process(), psutil.cpu_count() or 1
            process.cpu_percent(None)  # the first call only starts the measuring interval
            self.source = "psutil:process-cpu"
            self._read = lambda: float(process.cpu_percent(None)) / cores

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append(self._read())

    def start(self) -> UtilizationSampler:
        self._thread = threading.Thread(target=self._loop, name="kbackend-utilization", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        """Stop sampling; returns the source, mean and max utilization and the sample count."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if not self.samples:
            self.samples.append(self._read())
        return {"source": self.source, "mean_percent": sum(self.samples) / len(self.samples),
                "max_percent": max(self.samples), "samples": len(self.samples)}

