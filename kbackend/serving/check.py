"""``python -m kbackend.serving.check``: check an exported artifact under this process's backend.

Prints one JSON line (a ``CheckResult``); exit status 0 when within tolerance, 1 when not.
``kbackend export`` runs it with ``KERAS_BACKEND`` set to the other backend.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kbackend.serving.check")
    parser.add_argument("--artifact", required=True)
    parser.add_argument("--format", required=True, choices=["keras", "savedmodel"])
    parser.add_argument("--sample", required=True, help="export_check.npz with arrays x and reference")
    parser.add_argument("--atol", type=float, default=1e-5)
    args = parser.parse_args(argv)

    from kbackend.backend import active_backend, use_backend
    from kbackend.errors import KBackendError
    from kbackend.serving.export import CheckResult, check_artifact

    use_backend()
    try:
        result = check_artifact(args.artifact, args.format, args.sample, args.atol)
    except KBackendError as error:
        result = CheckResult(active_backend(), float("inf"), 0, False, str(error))
    print(json.dumps(asdict(result)))
    sys.stdout.flush()
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
