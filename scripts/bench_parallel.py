"""Data-parallel scaling: step time and samples/s against device count (1, 2, 4, 8).

Two series, each with its scaling efficiency:

- fixed per-device batch (weak scaling): the global batch grows with the devices;
  efficiency = samples/s(N) / (N * samples/s(1));
- fixed global batch (strong scaling): each device gets 1/N of the batch;
  efficiency = step time(1) / (N * step time(N)).

The step is kbackend's native data-parallel JAX step (``jax.shard_map``, gradients averaged with
``lax.pmean``, K steps fused in one ``lax.scan``). Each device count runs in its own subprocess,
because the number of (virtual) devices is fixed when JAX starts. On a CPU the devices are
virtual (``KBACKEND_VIRTUAL_DEVICES``): they share the same cores, so the figures measure the
overhead of splitting and all-reducing, NOT a speed-up. With several GPUs or a TPU slice the same
script measures real scaling (device counts beyond what exists are skipped).

    python scripts/bench_parallel.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def child(args: argparse.Namespace) -> None:
    """Time the step on ``args.devices`` devices for both series; print one JSON line."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import jax
    import numpy as np
    from kbackend.parallel import jax_step

    from kbackend.backend import use_backend
    from kbackend.data import DatasetInfo
    from kbackend.models import ModelOptions, build_model
    from kbackend.optim import OptimizerSpec

    use_backend("jax")
    if jax.device_count() < args.devices:
        print(json.dumps({"devices": args.devices, "skipped": f"only {jax.device_count()} devices"}))
        return
    info = DatasetInfo("synthetic", (784,), 10, "synthetic", "flat", None, 1, 1, 1)
    model = build_model("seed_mlp", info, ModelOptions(seed=0))
    tx = OptimizerSpec("sgd", 0.01).to_optax()
    mesh = jax_step.make_mesh(jax.devices()[:args.devices])
    step = jax_step.make_train_step(model, tx, mesh)
    rng = np.random.default_rng(0)
    results = {"devices": args.devices, "platform": jax.devices()[0].platform}
    for series, batch in (("per_device", args.per_device_batch * args.devices),
                          ("global", args.global_batch)):
        if batch % args.devices:
            results[series] = {"skipped": f"batch {batch} does not divide over {args.devices}"}
            continue
        xs = rng.normal(size=(args.fused, batch, 784)).astype("float32")
        ys = rng.integers(0, 10, size=(args.fused, batch)).astype("int32")
        batches = jax_step.shard_batch((xs, ys), mesh)
        state = jax_step.replicate(jax_step.initial_state(model, tx), mesh)
        state, metrics = step(state, batches)  # compile (excluded)
        jax.block_until_ready(metrics)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            state, metrics = step(state, batches)
            jax.block_until_ready((state, metrics))
            times.append((time.perf_counter() - start) / args.fused)
        step_time = statistics.median(times)
        results[series] = {"global_batch": batch, "per_device_batch": batch // args.devices,
                           "step_time_ms": step_time * 1e3, "samples_per_s": batch / step_time,
                           "repeats": args.repeats, "fused_steps": args.fused}
    print(json.dumps(results))


def efficiencies(rows: list[dict]) -> None:
    """Add scaling efficiency to each row, relative to the 1-device row."""
    base = next((r for r in rows if r["devices"] == 1 and "skipped" not in r), None)
    for row in rows:
        for series in ("per_device", "global"):
            cell = row.get(series)
            if base is None or not cell or "skipped" in cell or "skipped" in base.get(series, {}):
                continue
            n, ref = row["devices"], base[series]
            if series == "per_device":
                cell["efficiency"] = cell["samples_per_s"] / (n * ref["samples_per_s"])
            else:
                cell["efficiency"] = ref["step_time_ms"] / (n * cell["step_time_ms"])


def markdown(rows: list[dict], virtual: bool) -> str:
    lines = []
    if virtual:
        lines.append("CPU virtual devices share the same cores: these figures measure the overhead "
                     "of data parallelism (splitting, all-reduce), not a speed-up.\n")
    lines.append("| devices | series | global batch | per-device batch | step time (ms) | samples/s | scaling efficiency |")
    lines.append("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['devices']} | (skipped: {row['skipped']}) | | | | | |")
            continue
        for series, label in (("per_device", "fixed per-device batch"), ("global", "fixed global batch")):
            cell = row[series]
            if "skipped" in cell:
                continue
            lines.append(f"| {row['devices']} | {label} | {cell['global_batch']} | {cell['per_device_batch']} | "
                         f"{cell['step_time_ms']:.3f} | {cell['samples_per_s']:,.0f} | "
                         f"{cell.get('efficiency', float('nan')):.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and device counts (CI)")
    parser.add_argument("--out", default="bench_results", help="folder for JSON and markdown")
    parser.add_argument("--devices", default=None, help="comma-separated device counts (default 1,2,4,8)")
    parser.add_argument("--per-device-batch", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--fused", type=int, default=None, help="steps per compiled call")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.fused = args.fused or (5 if args.quick else 20)
    args.repeats = args.repeats or (3 if args.quick else 7)
    if args.child is not None:
        args.devices = args.child
        child(args)
        return 0
    counts = [int(c) for c in (args.devices or ("1,2,4" if args.quick else "1,2,4,8")).split(",")]
    rows = []
    for count in counts:
        # Only affects the CPU platform: on GPUs / TPUs the real devices are used.
        env = {**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "2",
               "KBACKEND_VIRTUAL_DEVICES": str(count), "JAX_NUM_CPU_DEVICES": str(count)}
        command = [sys.executable, __file__, "--child", str(count), "--fused", str(args.fused),
                   "--repeats", str(args.repeats), "--per-device-batch", str(args.per_device_batch),
                   "--global-batch", str(args.global_batch)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.stderr.write(done.stderr[-3000:])
            return done.returncode
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{count} device(s): done", file=sys.stderr)
    efficiencies(rows)
    os.environ["KERAS_BACKEND"] = "jax"
    from kbackend.envinfo import environment

    platform = next((r.get("platform") for r in rows if "platform" in r), "cpu")
    virtual = platform == "cpu"
    table = markdown(rows, virtual)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from kbackend.io import atomic_write_json, atomic_write_text

    payload = {"benchmark": "parallel", "model": "seed_mlp (784-786-256-160-10)", "optimizer": "sgd",
               "virtual_cpu_devices": virtual, "rows": rows, "environment": environment(),
               "note": ("CPU virtual devices: overhead, not speed-up" if virtual else "real devices")}
    atomic_write_json(out / "bench_parallel.json", payload)
    atomic_write_text(out / "bench_parallel.md", table)
    print(table)
    print(f"wrote {out / 'bench_parallel.json'} and {out / 'bench_parallel.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
