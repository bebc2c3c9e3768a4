"""``python -m kbackend``: the command line (``kbackend.cli``).

Ctrl-C while the command line is still being imported (nothing has run yet) ends the process
with status 130 like any later one; ``cli.main`` then installs its own handler first thing.
"""

import os
import signal
import sys


def _interrupted_while_starting(signum: int, frame: object) -> None:
    sys.stderr.write("kbackend: interrupted\n")
    os._exit(130)


if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _interrupted_while_starting)

from kbackend.cli import entrypoint  # noqa: E402  (after the handler: the import takes a while)

entrypoint()
