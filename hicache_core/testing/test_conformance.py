"""The conformance suite.  ``pytest --pyargs hicache_core.testing [--hicache-layout L ...]``.

A case a target rejects is skipped only when the rejection is declared (the layout's
``check``, the strategy's registration, or a pattern in the strategy class's
``conformance_rejects``) or comes from the environment (a kernel strategy without a
GPU or Triton interpreter; counted and reported at the end of the run).  Any other
rejection fails.
"""

from __future__ import annotations

import pytest

from hicache_core.testing.conformance import check_load_all, check_strategy, classify_rejection
from hicache_core.testing.plugin import record_environment_skip, record_unregistered_skip


def _run(fn, registry, case, target, device, **kw):
    layout, backend, strategy = target
    rejection = classify_rejection(registry, case, layout, backend, strategy, device)
    if rejection is None:
        return fn(registry, case, layout, backend, device=device, strategy=strategy, **kw)
    if rejection.kind == "undeclared":
        pytest.fail(rejection.reason)
    if rejection.kind == "environment":
        record_environment_skip(strategy, rejection.reason)
    elif rejection.unregistered:
        record_unregistered_skip(strategy, rejection.unregistered)
    who = f"layout {layout}" if rejection.by_layout else strategy
    pytest.skip(f"{who} does not serve {case.id}: {rejection.reason}")


def test_round_trip(hicache_registry, hicache_target, hicache_case, hicache_variant, hicache_device):
    _run(check_strategy, hicache_registry, hicache_case, hicache_target, hicache_device, variant=hicache_variant)


def test_per_layer_backup(hicache_registry, hicache_target, hicache_case, hicache_device):
    _run(check_strategy, hicache_registry, hicache_case, hicache_target, hicache_device, per_layer_backup=True)


def test_load_all_layers(hicache_registry, hicache_target, hicache_case, hicache_device):
    _run(check_load_all, hicache_registry, hicache_case, hicache_target, hicache_device)
