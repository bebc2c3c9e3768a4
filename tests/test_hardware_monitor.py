"""The step monitor's input-wait vs compute split, its verdict, the Keras adaptor, and prefetch."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kbackend.errors import ConfigError
from kbackend.hardware.monitor import INPUT_BOUND_SHARE, StepMonitor, format_summary
from kbackend.hardware.prefetch import Prefetcher
from tests.conftest import JIT_FOR_SMALL_RUNS

DELAY_S = 0.03      # injected input delay per batch
COMPUTE_S = 0.01    # simulated compute per step
# The measured wait share may differ from the injected one by scheduling jitter on a shared
# 2-core machine: sleeps overshoot by up to a few ms.
SHARE_MARGIN = 0.10


def slow_batches(n: int, delay: float):
    for i in range(n):
        time.sleep(delay)
        yield np.full((4, 3), i, np.float32), np.zeros(4, np.int32)


def test_injected_input_delay_gives_input_bound_verdict_and_share():
    monitor = StepMonitor(utilization_interval=0.05).start()
    for x, _ in monitor.timed(slow_batches(12, DELAY_S)):
        time.sleep(COMPUTE_S)  # the "step"
        monitor.step_end(samples=len(x))
    summary = monitor.stop()
    expected = DELAY_S / (DELAY_S + COMPUTE_S)
    assert summary["verdict"] == "input-bound"
    assert abs(summary["input_wait_share"] - expected) < SHARE_MARGIN
    assert summary["steps"] == 11 and summary["skipped_calls"] == 1
    # samples/s is the median step's (the two figures agree); the mean over the run beside it.
    assert summary["samples_per_s"] == pytest.approx(4 / summary["median_step_s"], rel=1e-6)
    assert summary["mean_samples_per_s"] == pytest.approx(4 / (summary["total_s"] / 11), rel=1e-6)
    assert any("prefetch" in item for item in summary["try"])
    assert summary["utilization"]["source"] in ("psutil:process-cpu", "nvml:gpu0")
    assert "input-bound" in format_summary(summary)


def test_fast_input_is_compute_bound():
    monitor = StepMonitor().start()
    for x, _ in monitor.timed(slow_batches(8, 0.0)):
        time.sleep(COMPUTE_S)
        monitor.step_end(samples=len(x))
    summary = monitor.stop()
    assert summary["verdict"] == "compute-bound"
    assert summary["input_wait_share"] < INPUT_BOUND_SHARE


def test_step_end_waits_for_the_result_it_is_given():
    waited = []
    monitor = StepMonitor(synchronize=waited.append).start()
    monitor.step_end(samples=1, result="arrays")
    assert waited == ["arrays"]


def test_prefetch_hides_the_input_delay_behind_compute():
    monitor = StepMonitor().start()
    with Prefetcher(slow_batches(12, DELAY_S / 3), depth=2, monitor=monitor) as batches:
        for x, _ in batches:
            time.sleep(COMPUTE_S * 3)  # compute is longer than producing a batch
            monitor.step_end(samples=len(x))
    summary = monitor.stop()
    assert summary["verdict"] == "compute-bound"
    assert summary["input_wait_measured"] == "on the training thread"


def test_prefetch_keeps_order_and_moves_to_device():
    from kbackend.backends import impl

    items = list(Prefetcher(slow_batches(5, 0.0), depth=3, to_device=True))
    assert [int(impl().to_numpy(x)[0, 0]) for x, _ in items] == [0, 1, 2, 3, 4]
    assert not isinstance(items[0][0], np.ndarray)  # a backend array, already on the device


def test_prefetch_reraises_source_errors_and_rejects_bad_depth():
    def failing():
        yield 1
        raise RuntimeError("broken source")

    with pytest.raises(RuntimeError, match="broken source"):
        list(Prefetcher(failing()))
    with pytest.raises(ConfigError, match="depth"):
        Prefetcher([], depth=0)


def test_monitor_with_an_unmonitored_engine_is_a_clear_error():
    from kbackend.engine_facts import engines_where
    from kbackend.engines import ENGINES
    from kbackend.training import TrainConfig

    others = [name for name in ENGINES if name not in engines_where("monitored")]
    if not others:
        pytest.skip("only the keras engine is registered")
    with pytest.raises(ConfigError, match=r"hardware monitor.*Received: engine="):
        TrainConfig(engine=others[0], hardware_monitor=True)


def test_native_engine_with_monitor_counts_every_step():
    from kbackend.training import TrainConfig, train

    history = train(TrainConfig(engine="native", fused_steps=4, epochs=2, batch_size=64,
                                hardware_monitor=True, jit_compile=JIT_FOR_SMALL_RUNS)).history
    summary = history.record.monitor
    assert summary["steps"] == history.steps_run == 2 * 20  # 1294 // 64 full batches per epoch
    assert summary["verdict"] == "compute-bound"  # the data lives on the device
    assert history.best("val_accuracy") > 0.8


def test_mixed_float16_needs_the_keras_engine():
    from kbackend.training import TrainConfig

    with pytest.raises(ConfigError, match="loss scaling"):
        TrainConfig(engine="native", precision="mixed_float16")


@pytest.mark.slow
def test_keras_fit_with_hardware_monitor_stores_summary(tmp_path):
    from kbackend.history import History
    from kbackend.training import TrainConfig, train

    result = train(TrainConfig(engine="keras", epochs=2, batch_size=64, hardware_monitor=True,
                               jit_compile=JIT_FOR_SMALL_RUNS),
                   history_path=tmp_path / "h.json")
    summary = History.load(tmp_path / "h.json").record.monitor
    assert summary["verdict"] in ("input-bound", "compute-bound")
    assert summary["steps"] == 2 * 21 - 1  # 1294 samples / 64 per batch = 21 steps per epoch
    assert 0.0 <= summary["input_wait_share"] <= 1.0
    assert result.history.best("val_accuracy") > 0.8  # monitored training still trains


# a whole CLI training run; test_keras_fit_with_hardware_monitor_stores_summary covers the engine
@pytest.mark.slow
def test_train_cli_hardware_monitor_prints_verdict(cli, tmp_path):
    completed = cli("train", "--epochs", "1", "--batch-size", "128", "--fused-steps", "5",
                    "--monitor", "--quiet", "--history", str(tmp_path / "h.json"))
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "monitor: " in completed.stdout and "-bound" in completed.stdout
    assert "monitor" in (tmp_path / "h.json").read_text()
