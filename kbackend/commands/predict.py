"""``kbackend predict``: predict a .npy batch with a model, optionally via the prediction cache."""

from __future__ import annotations

import argparse
from contextlib import closing

from kbackend.cache import PredictionCache, Rounding, check_cacheable, check_store, open_store
from kbackend.commands import add_import_flag
from kbackend.errors import DataError
from kbackend.io import atomic_write_npy, check_distinct_paths, check_output_path, read_array
from kbackend.model_sources import load_model
from kbackend.serving.model import (
    BatchPredictor,
    check_model_file,
    input_shape,
    validate_inputs,
)


def add_cache_arguments(parser: argparse.ArgumentParser, required: bool = False) -> None:
    """``--cache`` and ``--decimals``, shared by predict, serve and cache warm."""
    parser.add_argument("--cache", required=required, default=None, metavar="PATH|URL",
                        help="prediction cache: an SQLite file (created if missing) or redis://host:port/db")
    parser.add_argument("--decimals", default=None, metavar="D",
                        help="round each feature to D decimals before lookup: an integer, 'exact' "
                             "(default), or one value per feature, e.g. 2,2,exact,0")


def register(subparsers: argparse._SubParsersAction, parents: list) -> None:
    parser = subparsers.add_parser("predict", parents=parents,
                                   help="predict a .npy batch (optionally cached)")
    parser.add_argument("--model", required=True, metavar="MODEL.keras")
    parser.add_argument("--input", required=True, metavar="X.npy", help="inputs, batch first")
    parser.add_argument("--out", required=True, metavar="Y.npy",
                        help="where to write the predictions")
    add_cache_arguments(parser)
    add_import_flag(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    rounding = Rounding.parse(args.decimals)
    if args.decimals is not None and args.cache is None:
        raise DataError("--decimals only applies with --cache (rounding decides the cache key).")
    check_distinct_paths({"--out": args.out}, {"--model": args.model, "--input": args.input,
                                               "--cache": args.cache})
    check_output_path(args.out, "--out", suffix=".npy")
    x = read_array(args.input, "--input")
    check_model_file(args.model)
    if args.cache:
        check_store(args.cache)  # a bad cache fails before the model loads
    model = load_model(args.model, serving=True)
    predictor = BatchPredictor(model)
    batch = validate_inputs(x, input_shape(model), f"--input {args.input}",
                            strings=predictor.takes_strings)
    if args.cache is None:
        store = None
        predictions = predictor(batch)
    else:
        check_cacheable(model, rounding)
        # the store is created only now that every input was checked
        with closing(open_store(args.cache)) as store:
            cache = PredictionCache(model, store, rounding)
            predictions = cache.predict(batch)
            cache.flush_stats()
            stats = cache.stats()
    atomic_write_npy(args.out, predictions)
    print(f"predicted {len(batch)} rows -> {args.out} {predictions.shape}")
    if store is not None:
        print(f"cache {store.describe()} ({rounding.describe()}): hit rate {stats.hit_rate:.1%} "
              f"({stats.hits} hits, {stats.misses} misses, {stats.stored} stored) in "
              f"{stats.latency_ms_mean:.1f} ms")
    return 0
