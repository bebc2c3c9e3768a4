"""Progress output for long-running commands: per-epoch lines and progress bars (rich)."""

from __future__ import annotations

from typing import Any

from rich.console import Console


class EpochReporter:
    """Prints one line per epoch (or evaluation) with the metrics recorded so far."""

    def __init__(self, console: Console | None = None, prefix: str = "") -> None:
        self.console = console or Console(stderr=True, highlight=False, soft_wrap=True)
        self.prefix = prefix

    def epoch_end(self, epoch: int, epochs: int, record: dict[str, Any]) -> None:
        parts = [f"{self.prefix}epoch {epoch}/{epochs}", f"step {record.get('step', '?')}"]
        for key in ("train_loss", "train_accuracy", "val_loss", "val_accuracy"):
            if key in record:
                parts.append(f"{key} {record[key]:.4f}")
        if "train_time" in record:
            parts.append(f"train {record['train_time']:.2f}s")
        self.console.print("  ".join(parts))
