"""Start-up: the train command's set-up imports none of what training does not need.

A fresh process (this test process has long since imported everything): ``kbackend train
--help`` builds the train command's parser, importing the train command and all it imports at
module level. None of the libraries below may be among them (docs/engines.md, "Start-up
profile"): plotting, stores, scikit-learn, TFDS, Ray, and no framework before the backend is
chosen. Not timing-based: it checks ``sys.modules``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOT_AT_SETUP = ("matplotlib", "sklearn", "sqlite3", "tensorflow_datasets", "ray", "scipy",
                "keras", "jax", "tensorflow", "optax")


def modules_after(code: str) -> list[str]:
    """Which of ``NOT_AT_SETUP`` a fresh Python process holds after running ``code``."""
    script = (f"import json, sys\n{code}\n"
              f"print(json.dumps([m for m in {NOT_AT_SETUP!r} if m in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_train_commands_setup_imports_nothing_training_does_not_need():
    code = ("from kbackend.cli import main\n"
            "try:\n    main(['train', '--help'])\nexcept SystemExit:\n    pass")
    assert modules_after(code) == []


def test_the_check_sees_a_cut_import_come_back():
    """Negative control: a set-up that imports one of them is caught."""
    assert modules_after("import sqlite3") == ["sqlite3"]
