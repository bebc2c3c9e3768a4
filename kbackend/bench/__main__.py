"""``python -m kbackend.bench NAME [--quick] [--out DIR] ...``: run one registered benchmark."""

import sys

from kbackend.bench.runner import main_from_command_line

if __name__ == "__main__":
    raise SystemExit(main_from_command_line(sys.argv[1:]))
