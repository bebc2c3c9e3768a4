"""When does a run count as having reached its target? Crossing rules compared on the same runs.

    python scripts/measure_crossing.py [--seeds 8] [--val-samples 40,144] [--target 0.9]
        [--dataset digits] [--model seed_mlp] [--batch-size 32] [--lr 3e-3] [--eval-every 8]
        [--steps 600] [--out runs/crossing]

Each seed trains once for a fixed budget with no target (the native engine, Adam, an evaluation
every ``--eval-every`` steps), once per validation split size (``--val-samples``: the split held
out of the training data, so a smaller split is the same problem judged on fewer samples). Each
crossing rule is then applied to the same recorded evaluations, so the rules differ only in how
they read them:

- ``first``: the first evaluation at or past the target (the rule before 2026-12-06);
- ``mean2``: the first evaluation where the mean of it and the one before reaches the target;
- ``hold2``: the first of two consecutive evaluations that both reach it.

Per rule and split: steps to target over seeds (median, [min, max], spread max/min), and how
many crossings did not hold (the next evaluation fell back below the target: a lucky
evaluation decided). Prints a markdown table and writes JSON with the environment.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from kbackend.config import CROSSING_RULES, Target
from kbackend.envinfo import environment
from kbackend.io import atomic_write_text
from kbackend.stats import median_interval


def _steps(evals: list[dict], target: Target, rule: str) -> tuple[float, bool]:
    """(steps to target under ``rule``, whether the next evaluation still met it)."""
    seen: list[dict] = []
    for index, record in enumerate(evals):
        seen.append(record)
        if replace_rule(target, rule).reached_in(seen):
            following = evals[index + 1] if index + 1 < len(evals) else None
            held = following is None or target.reached(following)
            return float(record["step"]), held
    return math.inf, True


def replace_rule(target: Target, rule: str) -> Target:
    return Target(target.metric, target.value, crossing=rule)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--val-samples", default="40,144")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--model", default="seed_mlp")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-every", type=int, default=8)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--out", default="runs/crossing")
    args = parser.parse_args()

    import kbackend
    from kbackend import data as data_module

    target = Target("val_accuracy", args.target)
    total = len(data_module.load(args.dataset, layout="flat").x_train) + \
        len(data_module.load(args.dataset, layout="flat").x_val)
    rows = []
    for samples in (int(v) for v in args.val_samples.split(",")):
        histories = []
        for seed in range(args.seeds):
            result = kbackend.train(
                args.model, data=args.dataset, optimizer="adam", learning_rate=args.lr,
                batch_size=args.batch_size, epochs=1000, max_steps=args.steps,
                eval_every=args.eval_every, seed=seed, progress=False,
                validation_fraction=samples / total)
            histories.append(result.history)
            print(f"val {samples}: seed {seed} trained ({result.history.steps_run} steps)",
                  file=sys.stderr)
        for rule in CROSSING_RULES:
            outcomes = [_steps(h.evals, target, rule) for h in histories]
            steps = [s for s, _ in outcomes]
            finite = [s for s in steps if math.isfinite(s)]
            interval = median_interval(steps)
            rows.append({"val_samples": samples, "rule": rule, "median": interval["median"],
                         "low": interval["low"], "high": interval["high"],
                         "spread": max(finite) / min(finite) if finite else math.nan,
                         "reached": len(finite), "seeds": len(steps),
                         "not_held": sum(1 for s, held in outcomes
                                         if math.isfinite(s) and not held)})
    lines = ["| val samples | rule | steps median [min, max] | spread max/min | reached | "
             "crossings not held |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['val_samples']} | {r['rule']} | {r['median']:g} [{r['low']:g}, "
                     f"{r['high']:g}] | {r['spread']:.2f} | {r['reached']}/{r['seeds']} | "
                     f"{r['not_held']} |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "crossing.json", json.dumps(
        {"args": vars(args), "rows": rows, "environment": environment()}, indent=2,
        default=str))
    atomic_write_text(out / "crossing.md", table + "\n")
    print(f"wrote {out / 'crossing.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
