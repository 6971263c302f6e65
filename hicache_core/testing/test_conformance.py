"""The conformance suite.  ``pytest --pyargs hicache_core.testing [--hicache-layout L ...]``."""

from __future__ import annotations

import pytest

from hicache_core.errors import ResolutionError
from hicache_core.testing.conformance import check_load_all, check_strategy


def _run(fn, registry, case, target, device, **kw):
    layout, backend, strategy = target
    try:
        return fn(registry, case, layout, backend, device=device, strategy=strategy, **kw)
    except ResolutionError as exc:
        if "not a candidate" in str(exc) or "rejected" in str(exc) or "no strategy serves" in str(exc):
            pytest.skip(f"{strategy} does not serve {case.id}: {str(exc).splitlines()[1].strip()}")
        raise


def test_round_trip(hicache_registry, hicache_target, hicache_case, hicache_variant, hicache_device):
    _run(check_strategy, hicache_registry, hicache_case, hicache_target, hicache_device, variant=hicache_variant)


def test_per_layer_backup(hicache_registry, hicache_target, hicache_case, hicache_device):
    _run(check_strategy, hicache_registry, hicache_case, hicache_target, hicache_device, per_layer_backup=True)


def test_load_all_layers(hicache_registry, hicache_target, hicache_case, hicache_device):
    _run(check_load_all, hicache_registry, hicache_case, hicache_target, hicache_device)
