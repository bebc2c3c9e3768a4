"""``kbackend cache warm|stats|clear``: precompute a grid of inputs, inspect or empty a cache."""

from __future__ import annotations

import argparse
import math
from contextlib import closing

from rich.progress import Progress

from kbackend.cache import (
    CacheError,
    PredictionCache,
    Rounding,
    check_cacheable,
    check_store,
    open_store,
    parse_grid_text,
)
from kbackend.cache.sqlite_store import SQLiteStore
from kbackend.commands import add_import_flag
from kbackend.commands.predict import add_cache_arguments
from kbackend.errors import ConfigError
from kbackend.io import check_distinct_paths, read_array, strict_json_text
from kbackend.model_sources import load_model
from kbackend.serving.model import check_model_file, input_shape, validate_inputs


def register(subparsers: argparse._SubParsersAction, parents: list) -> None:
    parser = subparsers.add_parser("cache", help="warm, inspect or clear a prediction cache")
    actions = parser.add_subparsers(dest="cache_action", metavar="ACTION",
                                    parser_class=type(parser))
    actions.required = True

    warm = actions.add_parser("warm", parents=parents,
                              help="precompute predictions for a grid of inputs")
    warm.add_argument("--model", required=True, metavar="MODEL.keras")
    add_cache_arguments(warm, required=True)
    source = warm.add_mutually_exclusive_group(required=True)
    source.add_argument("--grid", metavar="SPEC",
                        help="FEATURES=VALUES clauses separated by ';': features '3', '0-7' or "
                             "'*'; values 'a,b,c' or 'START:STOP:COUNT', e.g. "
                             "'0=0:1:11; 1=0,0.5,1; *=0'")
    source.add_argument("--input", metavar="X.npy",
                        help="warm with the rows of a .npy array instead")
    warm.add_argument("--max-rows", type=int, default=1_000_000,
                      help="refuse larger grids (default 1e6)")
    warm.add_argument("--chunk", type=int, default=1024, help="rows per lookup")
    add_import_flag(warm)
    warm.set_defaults(func=run_warm)

    stats = actions.add_parser("stats", parents=parents, help="entries, hits and misses per model")
    stats.add_argument("--cache", required=True, metavar="PATH|URL")
    stats.add_argument("--json", action="store_true")
    stats.set_defaults(func=run_stats, needs_backend=False)

    clear = actions.add_parser("clear", parents=parents, help="delete cached predictions")
    clear.add_argument("--cache", required=True, metavar="PATH|URL")
    clear.add_argument("--fingerprint", default=None,
                       help="only this model's entries (a prefix is enough)")
    clear.set_defaults(func=run_clear, needs_backend=False)


def run_warm(args: argparse.Namespace) -> int:
    rounding = Rounding.parse(args.decimals)
    for flag, value in (("--chunk", args.chunk), ("--max-rows", args.max_rows)):
        if value < 1:
            raise ConfigError(f"Invalid {flag} {value}: expected a positive number of rows.")
    # Everything that needs no model is checked before it loads (the grid's syntax, the input
    # file, the cache); what needs it (the grid's features, the rows' shape) right after, and
    # the cache is created only then: a refused command leaves no new cache file.
    check_distinct_paths({"--cache": args.cache if "://" not in str(args.cache) else None},
                         {"--model": args.model, "--input": args.input})
    grid_text = (parse_grid_text(args.grid, max_rows=args.max_rows)
                 if args.grid is not None else None)
    rows = read_array(args.input, "--input") if args.input is not None else None
    check_model_file(args.model)
    check_store(args.cache)
    model = load_model(args.model, serving=True)
    row_shape = input_shape(model)
    if grid_text is not None:
        if any(d is None for d in row_shape):
            raise ConfigError(f"Invalid --grid for model {args.model!r}: a grid needs input rows "
                              f"of a fixed shape. Received: rows of shape {row_shape} "
                              "(warm with --input rows instead).")
        grid = grid_text.resolve(math.prod(d for d in row_shape if d is not None))
        total, chunks = grid.size, (c.reshape(len(c), *row_shape) for c in grid.chunks(args.chunk))
    else:
        rows = validate_inputs(rows, row_shape, f"--input {args.input}")
        total = len(rows)
        chunks = (rows[i:i + args.chunk] for i in range(0, len(rows), args.chunk))
    check_cacheable(model, rounding)
    with closing(open_store(args.cache)) as store:
        cache = PredictionCache(model, store, rounding)
        with Progress(transient=True) as progress:
            task = progress.add_task("warming", total=total)
            for chunk in chunks:
                cache.lookup(chunk)
                progress.advance(task, len(chunk))
        cache.flush_stats()
        stats = cache.stats()
    print(f"warmed {store.describe()} for model {cache.fingerprint[:16]} ({rounding.describe()}): "
          f"{stats.rows} rows, {stats.stored} new entries, {stats.hits} already cached")
    return 0


def run_stats(args: argparse.Namespace) -> int:
    with closing(open_store(args.cache, create=False)) as store:
        infos = store.namespaces()
        extra = {}
        if isinstance(store, SQLiteStore):
            extra = {"integrity_check": store.integrity_check(), "bytes": store.path.stat().st_size}
    if args.json:
        print(strict_json_text({"store": store.describe(), **extra,
                                "models": [info.__dict__ for info in infos]}))
        return 0
    print(f"cache {store.describe()}"
          + (f"  ({extra['bytes']} bytes, integrity {extra['integrity_check']})" if extra else ""))
    if not infos:
        print("  (empty)")
    for info in infos:
        lookups = info.hits + info.misses
        rate = f"{info.hits / lookups:.1%}" if lookups else "n/a"
        name = info.model.get("name", "?")
        print(f"  model {info.namespace[:16]} ({name}, in {info.model.get('input_shape')} out "
              f"{info.model.get('output_shape')}): {info.entries} entries, {info.hits} hits, "
              f"{info.misses} misses, hit rate {rate}")
    return 0


def run_clear(args: argparse.Namespace) -> int:
    with closing(open_store(args.cache, create=False)) as store:
        if args.fingerprint is None:
            deleted = store.clear()
        else:
            matches = [i.namespace for i in store.namespaces()
                       if i.namespace.startswith(args.fingerprint)]
            if len(matches) != 1:
                raise CacheError(
                    f"Invalid --fingerprint {args.fingerprint!r}: expected it to match one model, "
                    f"matched {len(matches)} (see kbackend cache stats)."
                )
            deleted = store.clear(matches[0])
    print(f"cleared {deleted} entries from {store.describe()}")
    return 0
