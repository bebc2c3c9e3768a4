"""Every benchmark, by name: the one table ``scripts/bench_<name>.py`` and ``nox -s bench`` use."""

from __future__ import annotations

from kbackend.bench import (
    adaptive,
    cache,
    data_memory,
    engines,
    hardware,
    parallel,
    population,
    reproduce,
    scale_out,
    study_ray,
    time_to_target,
    tuner,
    unroll,
    user_model,
)
from kbackend.bench.spec import Benchmark

BENCHMARKS: dict[str, Benchmark] = {
    bench.name: bench
    for module in (hardware, engines, cache, data_memory, parallel, population, reproduce,
                   scale_out, study_ray, time_to_target, unroll, user_model, adaptive, tuner)
    for bench in module.BENCHMARKS
}
