"""Hardware-aware measurement: timing harness, knee finder, utilization monitor, roofline,
device probe and precision policies: what ``kbackend advise`` (``kbackend.advise``) and the
benchmarks measure below training.

Backend-specific pieces (device memory, device transfer, matmul peak, mixed-precision support)
live in ``kbackend.backends`` (the one dispatch point); everything here is backend-agnostic.
"""
