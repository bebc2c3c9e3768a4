"""Both backend packages implement every member of the one declared boundary, ``BackendOps``."""

from __future__ import annotations

import importlib.util
import inspect
import types

import pytest

from kbackend.backends import BackendOps, backend_package

MODULE_NAMES = ("ops", "native", "data_parallel", "gradients", "probes", "reference")


def protocol_members() -> dict[str, inspect.Signature | None]:
    """Member name -> signature without ``self`` (None for callable attributes)."""
    members: dict[str, inspect.Signature | None] = {}
    for name, value in vars(BackendOps).items():
        if name.startswith("_"):
            continue
        if inspect.isfunction(value):
            signature = inspect.signature(value)
            members[name] = signature.replace(parameters=list(signature.parameters.values())[1:])
    for name in BackendOps.__annotations__:
        members.setdefault(name, None)
    return members


def contract_violations(package: types.ModuleType) -> list[str]:
    """What ``package`` lacks or declares differently from ``BackendOps``."""
    problems = []
    for name, expected in protocol_members().items():
        member = getattr(package, name, None)
        if member is None or not callable(member):
            problems.append(f"{name}: missing")
            continue
        if expected is not None:
            got = inspect.signature(member)
            if list(got.parameters) != list(expected.parameters):
                problems.append(f"{name}: parameters {list(got.parameters)}"
                                f" != {list(expected.parameters)}")
    return problems


def test_protocol_declares_what_the_code_uses():
    members = protocol_members()
    assert len(members) >= 25
    assert {"native_trainer", "gradients", "initialize_processes", "devices"} <= set(members)


@pytest.mark.parametrize("backend", ["jax", "tensorflow"])
def test_backend_package_exposes_every_member(backend):
    package = backend_package(backend)
    assert contract_violations(package) == []
    for module in MODULE_NAMES:  # the same module names in each package
        assert importlib.util.find_spec(f"{package.__name__}.{module}") is not None, module


def test_a_package_missing_a_member_is_caught():
    """Negative control: the check above can fail."""
    package = backend_package("jax")
    broken = types.ModuleType("broken")
    broken.__dict__.update({k: v for k, v in vars(package).items() if k != "gradients"})
    broken.devices = lambda extra: []
    problems = contract_violations(broken)
    assert "gradients: missing" in problems
    assert any(p.startswith("devices: parameters") for p in problems)
