"""Benchmarks: one runner (``runner``), one registry (``registry.BENCHMARKS``), a module per family.

``python scripts/bench_<name>.py`` and ``python -m kbackend.bench bench_<name>`` run the same thing.
"""
