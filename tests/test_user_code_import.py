"""One importer for the user's Python files (builders, ``--import`` files, data functions):
``data.user.function.import_user_file``, used by ``model_sources`` and the data function
reader alike."""

from __future__ import annotations

import sys

import pytest

from kbackend.data.user.function import import_user_file


def test_a_users_file_is_imported_once_per_version_and_a_failure_leaves_nothing(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text("VALUE = 1\n")
    first = import_user_file(path, "kbackend_test")
    assert first.VALUE == 1 and import_user_file(path, "kbackend_test") is first
    path.write_text("VALUE = 22\n")  # another version: imported again
    assert import_user_file(path, "kbackend_test").VALUE == 22
    broken = tmp_path / "broken.py"
    broken.write_text("import helper_next_to_it\nraise KeyError('mine')\n")
    (tmp_path / "helper_next_to_it.py").write_text("")  # its folder is on sys.path meanwhile
    path_before = list(sys.path)
    with pytest.raises(KeyError, match="mine"):
        import_user_file(broken, "kbackend_test")
    assert sys.path == path_before
    assert not [name for name in sys.modules if name.startswith("kbackend_test_broken")]
    sys.modules.pop("helper_next_to_it", None)
