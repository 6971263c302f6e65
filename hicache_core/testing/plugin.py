"""pytest plugin (entry point ``pytest11: hicache``): options and parametrization for the kit.

Tests that take the ``hicache_target`` argument are parametrized over every
(layout, io_backend, strategy) the installed registry serves, filtered by
``--hicache-layout`` / ``--hicache-io-backend`` / ``--hicache-strategy``;
``hicache_case`` over :data:`CASES`; ``hicache_variant`` over index variants.

A name given to ``--hicache-layout`` / ``--hicache-io-backend`` / ``--hicache-strategy``
that the registry does not have is a usage error.  Without a CUDA device the kit sets
``TRITON_INTERPRET=1`` itself (kernel strategies then run in Triton's CPU interpreter),
and the end of the run says so, as well as every strategy it could not run here.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest
import torch

from ..registry import PLUGINS_COME_FROM, create_registry
from .conformance import CASES, INDEX_VARIANTS


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hicache", "hicache conformance kit")
    group.addoption("--hicache-layout", action="append", default=[], help="only this layout (repeatable)")
    group.addoption("--hicache-io-backend", action="append", default=[], help="only this io_backend (repeatable)")
    group.addoption("--hicache-strategy", action="append", default=[], help="only this strategy name (repeatable)")
    group.addoption("--hicache-device", default=None, help="device for device buffers (default: cuda if available)")
    group.addoption("--hicache-case", action="append", default=[], help="only case ids containing this text")


_ENVIRONMENT_SKIPS: Counter[tuple[str, str]] = Counter()
_STATE: dict[str, bool] = {"interpreter_set": False}


#: (strategy, "sharded" / "unsharded") -> cases skipped because the strategy registers no key for such pools.
_UNREGISTERED_SKIPS: Counter[tuple[str, str]] = Counter()


def record_environment_skip(strategy: str, reason: str) -> None:
    """Count a case skipped because ``strategy`` cannot run on this machine (reported at the end)."""
    _ENVIRONMENT_SKIPS[(strategy, reason)] += 1


def record_unregistered_skip(strategy: str, what: str) -> None:
    """Count a case skipped because ``strategy``'s registration has no key for its pool's sharding (``what``:
    ``"sharded"`` or ``"unsharded"``; reported at the end: a strategy that forgot ``sharded=(False, True)`` would
    otherwise pass with its sharded half untested)."""
    _UNREGISTERED_SKIPS[(strategy, what)] += 1


def _use_interpreter_without_gpu() -> None:
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "") in ("", "0"):
        os.environ["TRITON_INTERPRET"] = "1"
        _STATE["interpreter_set"] = True


def _check_selection(config: pytest.Config, reg: Any) -> None:
    known = {"--hicache-layout": sorted(reg.layouts), "--hicache-io-backend": reg.io_backends,
             "--hicache-strategy": sorted(reg.strategies)}
    for option, names in known.items():
        unknown = [x for x in config.getoption(option) if x not in names]
        if unknown:
            raise pytest.UsageError(f"{option} {', '.join(unknown)}: not installed; installed: {', '.join(names)}"
                                    f" {PLUGINS_COME_FROM}")


def _check_cases(config: pytest.Config) -> None:
    """Each ``--hicache-case`` text must be part of some case id (index variants are not: they are test ids)."""
    empty = [s for s in config.getoption("--hicache-case") if not any(s in c.id for c in CASES)]
    if empty:
        variants = [s for s in empty if any(v.split("-")[0] in s for v in INDEX_VARIANTS)]
        raise pytest.UsageError(
            f"--hicache-case {', '.join(empty)}: no case id contains it; case ids: {', '.join(c.id for c in CASES)}"
            + (f" (the index variant in {', '.join(variants)} is not part of a case id: select variants with -k)"
               if variants else ""))


def pytest_configure(config: pytest.Config) -> None:
    if any(config.getoption(o) for o in ("--hicache-layout", "--hicache-io-backend", "--hicache-strategy")):
        _check_selection(config, create_registry())
    _check_cases(config)


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
        _use_interpreter_without_gpu()  # before any strategy factory imports Triton
        targets = _targets(cfg)
        metafunc.parametrize("hicache_target", targets, ids=["-".join(t) for t in targets])
    if "hicache_case" in metafunc.fixturenames:
        sel = cfg.getoption("--hicache-case")
        cases = [c for c in CASES if not sel or any(s in c.id for s in sel)]
        metafunc.parametrize("hicache_case", cases, ids=[c.id for c in cases])
    if "hicache_variant" in metafunc.fixturenames:
        metafunc.parametrize("hicache_variant", INDEX_VARIANTS)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _STATE["interpreter_set"]:
        terminalreporter.write_line(
            "hicache conformance kit: no CUDA device, so it set TRITON_INTERPRET=1: kernel strategies ran in "
            "Triton's CPU interpreter (correctness only; run on a GPU for the real kernels)", yellow=True, bold=True)
    for (strategy, what), n in sorted(_UNREGISTERED_SKIPS.items()):
        terminalreporter.write_line(
            f"hicache conformance kit: {strategy} registers no key for {what} pools: its {n} {what} cases were "
            f"skipped, not tested (where it serves them, add {what == 'sharded'} to its registration's sharded)",
            yellow=True)
    if _ENVIRONMENT_SKIPS:
        terminalreporter.write_line(
            "hicache conformance kit: WARNING: these strategies could not run on this machine and were NOT tested:",
            red=True, bold=True)
        for (strategy, reason), n in sorted(_ENVIRONMENT_SKIPS.items()):
            terminalreporter.write_line(f"  {strategy}: {n} cases skipped: {reason}", red=True)
