"""Run keys never change by a refactor: every kind of model and data source gives the content
digests recorded on 9819043 (``tests/digest_pins.py`` builds the cases and records them)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import BACKEND
from tests.digest_pins import PINS, case_digests, case_names, write_inputs

PINNED = json.loads(PINS.read_text())


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_inputs(tmp_path_factory.mktemp("digest_pins"))


def test_every_case_is_pinned_on_both_backends():
    assert set(PINNED) == {"jax", "tensorflow"}
    for backend in PINNED.values():
        assert sorted(backend) == sorted(case_names())


@pytest.mark.parametrize("name", case_names())
def test_the_digests_are_the_pinned_ones(name, inputs):
    assert case_digests(name, inputs) == PINNED[BACKEND][name]
