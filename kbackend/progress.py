"""Progress output for long-running commands: per-epoch lines and progress bars (rich)."""

from __future__ import annotations

import math
import time
from typing import Any

from rich.console import Console

from kbackend.escaping import console_text


class EpochReporter:
    """Prints one line per epoch (or evaluation) with the metrics recorded so far and, on a
    terminal, a live line between them (steps, loss, samples/s, ETA) that the next line replaces.
    """

    LIVE_INTERVAL_S = 0.25  # the live line is redrawn at most this often

    def __init__(self, console: Console | None = None, prefix: str = "") -> None:
        self.console = console or Console(stderr=True, highlight=False, soft_wrap=True)
        self.prefix = prefix
        self._live_at = -math.inf
        self._live_shown = False

    def steps_done(self, step: int, total: int, loss: float, train_time: float,
                   batch_size: int) -> None:
        """Training has reached ``step`` of ``total`` after ``train_time`` seconds: redraw the
        live line (terminals only; logs get the evaluation lines alone)."""
        if not self.console.is_terminal or step <= 0 or train_time <= 0:
            return
        now = time.monotonic()
        if now - self._live_at < self.LIVE_INTERVAL_S:
            return
        self._live_at = now
        per_step = train_time / step
        eta = per_step * max(total - step, 0)
        line = (f"{self.prefix}step {step}/{total}  loss {loss:.4f}  "
                f"{batch_size / per_step:,.0f} samples/s  ETA {eta:.0f}s")
        self.console.file.write(f"\r{line}\x1b[K")
        self.console.file.flush()
        self._live_shown = True

    def _clear_live(self) -> None:
        if self._live_shown:
            self.console.file.write("\r\x1b[K")
            self._live_shown = False

    def epoch_end(self, epoch: int, epochs: int, record: dict[str, Any]) -> None:
        self._clear_live()
        parts = [f"{self.prefix}epoch {epoch}/{epochs}", f"step {record.get('step', '?')}"]
        # train_ figures first, then val_: the loss, then the task's metric (accuracy, mae, ...)
        for prefix in ("train_", "val_"):
            for key, value in record.items():
                if key.startswith(prefix) and key != "train_time" and isinstance(value, float):
                    parts.append(f"{key} {value:.4f}")
        if "train_time" in record:
            parts.append(f"train {record['train_time']:.2f}s")
        self.console.print(console_text("  ".join(parts)))  # metric names are the model's
