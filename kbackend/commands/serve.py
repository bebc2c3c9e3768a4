"""``kbackend serve``: an HTTP JSON prediction endpoint on a loopback address."""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

from kbackend.cache import (
    PredictionCache,
    Rounding,
    check_cacheable,
    check_store,
    model_fingerprint,
    open_store,
)
from kbackend.commands import add_import_flag
from kbackend.commands.predict import add_cache_arguments
from kbackend.errors import DataError
from kbackend.model_sources import load_model
from kbackend.serving.model import BatchPredictor, check_model_file, input_shape
from kbackend.serving.server import PredictionServer, check_batching_options, check_port


def register(subparsers: argparse._SubParsersAction, parents: list) -> None:
    parser = subparsers.add_parser("serve", parents=parents,
                                   help="serve predictions over HTTP on localhost")
    parser.add_argument("--model", required=True, metavar="MODEL.keras")
    parser.add_argument("--host", default="127.0.0.1",
                        help="a loopback address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8500, help="TCP port (0: any free port)")
    add_cache_arguments(parser)
    parser.add_argument("--max-batch", type=int, default=1024,
                        help="most rows predicted in one call (power of 2)")
    parser.add_argument("--max-wait-ms", type=float, default=2.0,
                        help="how long the first request of a batch waits for others "
                             "(default 2 ms)")
    parser.add_argument("--max-request-rows", type=int, default=4096,
                        help="most rows in one request")
    add_import_flag(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # a bad host, port range or a port in use: before the model loads
    check_port(args.host, args.port)
    rounding = Rounding.parse(args.decimals)
    if args.decimals is not None and args.cache is None:
        raise DataError("--decimals only applies with --cache (rounding decides the cache key).")
    check_batching_options(args.max_batch, args.max_wait_ms, args.max_request_rows)
    check_model_file(args.model)
    if args.cache:
        check_store(args.cache)  # a bad cache fails before the model loads
    model = load_model(args.model, serving=True)
    predictor = BatchPredictor(model, max_batch=args.max_batch)
    if args.cache:
        check_cacheable(model, rounding)
    store = open_store(args.cache) if args.cache else None  # created once every input was checked
    cache = (PredictionCache(model, store, rounding, predictor=predictor)
             if store is not None else None)
    fingerprint = cache.fingerprint if cache else model_fingerprint(model)
    info = {"model": args.model, "fingerprint": fingerprint,
            "input_shape": list(input_shape(model)),
            "cache": store.describe() if store else None,
            "decimals": rounding.describe() if store else None}
    server = PredictionServer(
        args.host, args.port, predict=cache.predict if cache else predictor,
        row_shape=predictor.input_shape, info=info,
        cache_stats=(lambda: cache.stats().to_dict()) if cache else None,
        max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
        max_request_rows=args.max_request_rows,
        verbose=args.verbose, strings=predictor.takes_strings,
    )
    predictor.warm_up()  # compile the one-row bucket before the first request
    signal.signal(signal.SIGTERM,
                  lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    print(f"serving {args.model} on {server.url}/predict (fingerprint {fingerprint[:16]}"
          + (f", cache {store.describe()}, {rounding.describe()}" if store else ", no cache")
          + ")", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        if cache is not None:
            cache.flush_stats()
        if store is not None:
            store.close()
    print(stop_summary(server.stats()), flush=True)
    return 0


def stop_summary(stats: dict[str, Any]) -> str:
    """What a stopped server did, in a few readable lines (``GET /stats`` has every figure)."""
    lines = [f"stopped after {stats['uptime_s']:.0f} s: {stats['requests']} requests answered, "
             f"{stats['rejected']} rejected; {stats['rows']} rows in {stats['batches']} "
             f"batches ({stats['requests_per_batch']:.1f} requests per batch, largest "
             f"{stats['largest_batch_rows']} rows)"]
    cache = stats.get("cache")
    if cache:
        lines.append(f"cache: {cache['hits']} hits, {cache['misses']} misses "
                     f"({cache['hit_rate']:.0%} of {cache['rows']} rows), "
                     f"{cache['stored']} stored; "
                     f"latency p50 {cache['latency_ms_p50']:.1f} ms, p95 "
                     f"{cache['latency_ms_p95']:.1f} ms")
    return "\n".join(lines)

