"""pytest plugin (entry point ``pytest11: hicache``): options and parametrization for the kit.

Tests that take the ``hicache_target`` argument are parametrized over every
(layout, io_backend, strategy) the installed registry serves, filtered by
``--hicache-layout`` / ``--hicache-io-backend`` / ``--hicache-strategy``;
``hicache_case`` over :data:`CASES`; ``hicache_variant`` over index variants.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ..registry import create_registry
from .conformance import CASES, INDEX_VARIANTS


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hicache", "hicache conformance kit")
    group.addoption("--hicache-layout", action="append", default=[], help="only this layout (repeatable)")
    group.addoption("--hicache-io-backend", action="append", default=[], help="only this io_backend (repeatable)")
    group.addoption("--hicache-strategy", action="append", default=[], help="only this strategy name (repeatable)")
    group.addoption("--hicache-device", default=None, help="device for device buffers (default: cuda if available)")
    group.addoption("--hicache-case", action="append", default=[], help="only case ids containing this text")


def _targets(config: pytest.Config) -> list[tuple[str, str, str]]:
    reg = create_registry()
    layouts = config.getoption("--hicache-layout") or sorted(reg.layouts)
    backends = config.getoption("--hicache-io-backend") or [b for b in reg.io_backends if b != "reference"]
    wanted = set(config.getoption("--hicache-strategy"))
    out = set()
    for layout in layouts:
        for backend in backends:
            for sharded in (False, True):
                for info in reg.candidates(layout, backend, sharded):
                    if not wanted or info.name in wanted:
                        out.add((layout, backend, info.name))
    return sorted(out)


@pytest.fixture(scope="session")
def hicache_device(pytestconfig: pytest.Config) -> torch.device:
    """The device the conformance kit puts device buffers on."""
    opt = pytestconfig.getoption("--hicache-device")
    return torch.device(opt or ("cuda" if torch.cuda.is_available() else "cpu"))


@pytest.fixture
def hicache_registry() -> Any:
    """A fresh registry loaded from installed entry points."""
    return create_registry()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    cfg = metafunc.config
    if "hicache_target" in metafunc.fixturenames:
        targets = _targets(cfg)
        metafunc.parametrize("hicache_target", targets, ids=["-".join(t) for t in targets])
    if "hicache_case" in metafunc.fixturenames:
        sel = cfg.getoption("--hicache-case")
        cases = [c for c in CASES if not sel or any(s in c.id for s in sel)]
        metafunc.parametrize("hicache_case", cases, ids=[c.id for c in cases])
    if "hicache_variant" in metafunc.fixturenames:
        metafunc.parametrize("hicache_variant", INDEX_VARIANTS)
