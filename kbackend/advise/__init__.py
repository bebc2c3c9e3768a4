"""``kbackend advise``: the advisor (``advisor``) and what it measures by training
(``engine_probe``); the measurements below training live in ``kbackend.hardware``."""
