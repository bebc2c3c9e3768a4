"""Hardware-aware measurement: timing harness, knee finder, utilization monitor, roofline,
device probe, precision policies and the logic behind ``kbackend advise``.

Backend-specific pieces (device memory, device transfer, matmul peak, mixed-precision support)
live in ``kbackend.backends`` (the one dispatch point); everything here is backend-agnostic.
"""
