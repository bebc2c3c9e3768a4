"""``kbackend export``: save a model as .keras or TF SavedModel and check it under every backend."""

from __future__ import annotations

import argparse

from kbackend.commands import add_import_flag
from kbackend.io import check_distinct_paths, check_output_folder, read_array, strict_json_text
from kbackend.serving.export import DEFAULT_ATOL, FORMATS, check_export_options, export_model


def register(subparsers: argparse._SubParsersAction, parents: list) -> None:
    parser = subparsers.add_parser(
        "export", parents=parents,
        help="export a model (.keras / SavedModel) and check it on both backends"
    )
    parser.add_argument("model", metavar="MODEL.keras", help="the model to export")
    parser.add_argument("--format", default="savedmodel", choices=list(FORMATS))
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="folder for the artifact and its check files")
    parser.add_argument("--sample", default=None, metavar="X.npy",
                        help="inputs for the check (default: --rows uniform random rows)")
    parser.add_argument("--rows", type=int, default=64, help="rows of the random check sample")
    parser.add_argument("--atol", type=float, default=DEFAULT_ATOL,
                        help=f"largest absolute difference allowed (default {DEFAULT_ATOL:g})")
    parser.add_argument("--json", action="store_true", help="print the manifest as JSON")
    add_import_flag(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_export_options(args.rows, args.atol)
    check_distinct_paths({"--out": args.out}, {"--model": args.model, "--sample": args.sample})
    check_output_folder(args.out, "--out")
    sample = read_array(args.sample, "--sample") if args.sample else None
    manifest = export_model(args.model, args.format, args.out, sample=sample, rows=args.rows,
                            atol=args.atol)
    if args.json:
        print(strict_json_text(manifest))
        return 0
    print(f"exported {args.model} ({manifest['source_backend']}) as {args.format} to "
          f"{manifest['artifact']}")
    for check in manifest["checks"]:
        print(f"  check under {check['backend']:<10} {check['rows']} rows  "
              f"max |diff| {check['max_abs_diff']:.3g}"
              f"  (atol {args.atol:g})  {'ok' if check['ok'] else 'FAILED'}")
    largest = max(c["max_abs_diff"] for c in manifest["checks"])
    print(f"largest difference {largest:.3g}; fingerprint {manifest['fingerprint'][:16]}")
    return 0
