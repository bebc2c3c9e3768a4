"""The training half of the hardware probe: a kbackend engine's step time, measured via ``train()``.

It lives above ``kbackend.training`` (``kbackend.hardware`` measures the layers below it: Keras
``fit`` steps, memory, the matmul peak, in ``hardware.probe``), so that training may use the
hardware monitor without a cycle between the packages.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from kbackend import data as data_module
from kbackend.hardware.probe import Workload, make_model
from kbackend.optim import OptimizerSpec
from kbackend.training import TrainConfig, train


def engine_throughput(work: Workload, batch_size: int, engine: str, *, steps: int = 20,
                      fused_steps: int = 1, repeats: int = 3,
                      optimizer: OptimizerSpec | None = None) -> dict[str, Any]:
    """Median train-step time of a registered kbackend engine (e.g. ``native``) via ``train()``.

    The training split is exactly ``steps`` batches (rounded up to whole fused calls), and the
    run lasts ``1 + repeats`` epochs: the first compiles; each later epoch is one timed repeat,
    read from the evaluation records' training time at epoch ends (evaluation excluded). Engines
    may wait for results only at epoch ends (the native engine does), so per-epoch times are
    the honest unit.
    """
    steps = max(fused_steps, -(-steps // fused_steps) * fused_steps)
    index = np.arange(steps * batch_size) % len(work.x)
    # small validation / test splits: evaluation is not timed
    held = np.arange(min(len(work.x), 256))
    info = replace(work.info, num_train=len(index), num_val=len(held), num_test=len(held))
    dataset = data_module.Dataset(work.x[index], work.y[index], work.x[held], work.y[held],
                                  work.x[held], work.y[held], info)
    config = TrainConfig(model=work.model, dataset=work.info.name, batch_size=batch_size,
                         epochs=1 + repeats, engine=engine, fused_steps=fused_steps,
                         optimizer=optimizer or OptimizerSpec("sgd", 0.01),
                         model_options=work.options, task=work.task,
                         monitor=f"val_{work.task.metric}")
    history = train(config, dataset=dataset, model=make_model(work)).history
    ends = [0.0] + [e["train_time"] for e in history.evals]
    epochs = np.diff(ends)
    step_s = float(np.median(epochs[1:])) / steps
    compile_s = history.timing.get("compile_time", max(0.0, float(epochs[0]) - steps * step_s))
    return {"batch_size": batch_size, "engine": engine, "fused_steps": fused_steps,
            "step_ms": 1e3 * step_s, "samples_per_s": batch_size / step_s,
            "compile_s": float(compile_s), "steps": int(steps * repeats), "rounds": repeats}
