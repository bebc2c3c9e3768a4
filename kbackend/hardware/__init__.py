"""Hardware-aware measurement: the measurement harness (``measure``: timing, the probes' key,
the per-machine store), knee finder, utilization monitor, roofline, device probe and precision
policies: what training's probes, ``kbackend advise`` (``kbackend.advise``) and the benchmarks
measure below training.

Backend-specific pieces (device memory, device transfer, matmul peak, mixed-precision support)
live in ``kbackend.backends`` (the one dispatch point); everything here is backend-agnostic.
"""
