"""How many of a study's verdicts are answered: A better, B better or equivalent, against "not
resolved"; overall and for the per-batch optimizer comparisons (the sources' headline question).

    python scripts/verdict_shares.py REPORT_DIR_OR_SUMMARY_JSON [--margins 0.2,0.1]

Each verdict of the report's analysis counts once (a record with an ``outcome``). The same
stored study is re-read at each ``--margins`` value (``kbackend.study.analysis.analyze`` with
that margin), so the share at another margin is on the same runs; seeds the sequential rule
would have added under that margin are not (say so when quoting it).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from kbackend.io import read_json
from kbackend.study.analysis import Analysis, analyze
from kbackend.study.study_record import StudyRecord

ANSWERED = ("a", "b", "equivalent")


def verdicts(node: Any) -> list[dict[str, Any]]:
    """Every verdict record under ``node`` (a dict with an ``outcome``; not descended into)."""
    if isinstance(node, dict):
        if "outcome" in node:
            return [node]
        return [v for value in node.values() for v in verdicts(value)]
    if isinstance(node, list):
        return [v for value in node for v in verdicts(value)]
    return []


def shares(analysis: Analysis) -> dict[str, int]:
    """Answered counts: all verdicts (the records of the written analysis) and the per-batch
    optimizer comparisons."""
    found = verdicts(analysis.verdicts.to_json())
    per_batch = [entry for comparison in analysis.verdicts.optimizers
                 for entry in comparison.per_batch]
    return {"answered": sum(v["outcome"] in ANSWERED for v in found), "verdicts": len(found),
            "per_batch_answered": sum(e.outcome in ANSWERED for e in per_batch),
            "per_batch": len(per_batch),
            "equivalent": sum(v["outcome"] == "equivalent" for v in found)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report")
    parser.add_argument("--margins", default="0.2,0.1")
    args = parser.parse_args()
    path = Path(args.report)
    summary = read_json(path / "summary.json" if path.is_dir() else path)  # non-finite restored
    print("| margin | verdicts answered | per-batch optimizer comparisons answered | "
          "equivalent |")
    print("| --- | --- | --- | --- |")
    for margin in (float(m) for m in args.margins.split(",")):
        study = copy.deepcopy(summary)
        study["config"]["margin"] = margin
        counts = shares(analyze(StudyRecord.from_json(study)))
        print(f"| {margin:g} ({1 + margin:g}x) | {counts['answered']} of {counts['verdicts']} "
              f"({counts['answered'] / max(1, counts['verdicts']):.0%}) | "
              f"{counts['per_batch_answered']} of {counts['per_batch']} | "
              f"{counts['equivalent']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
