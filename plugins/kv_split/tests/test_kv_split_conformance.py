"""The core conformance kit run against the kv_split kernel strategy (sharded and unsharded cases)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from hicache_core import create_registry  # noqa: E402
from hicache_core.testing.conformance import CASES, assert_page_loads_taken, check_load_all, check_strategy  # noqa: E402
from hicache_kv_split.layout import LAYOUT as _LAYOUT  # noqa: E402
from hicache_kv_split.strategy import NAME  # noqa: E402

LAYOUT = _LAYOUT.name
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

CASE_IDS = [c.id for c in CASES]


@pytest.fixture(scope="module")
def registry():
    return create_registry()


@pytest.mark.parametrize("variant", ["shuffled-i64", "last-page-i32-dev"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_round_trip(monkeypatch, registry, case, variant):
    if variant == "last-page-i32-dev":
        # page loads of every group, pages of any size (the other variant: automatic, >= 2 KiB per host part)
        monkeypatch.setenv("HICACHE_KERNEL_PAGES", "1")
    pool = check_strategy(registry, case, LAYOUT, "kernel", variant=variant, device=DEVICE, strategy=NAME)
    assert pool.strategy_name == NAME
    if variant == "last-page-i32-dev":
        assert_page_loads_taken(pool)
    assert pool.spec.sharded == ("sharded" in case.id)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_per_layer_backup(registry, case):
    check_strategy(registry, case, LAYOUT, "kernel", variant="reversed-i64-dev", device=DEVICE, strategy=NAME,
                   per_layer_backup=True)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_load_all_layers(monkeypatch, registry, case):
    monkeypatch.setenv("HICACHE_KERNEL_PAGES", "1")  # page loads of pages of any size (round trips: automatic too)
    check_load_all(registry, case, LAYOUT, "kernel", device=DEVICE, strategy=NAME)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_unfused_one_program(kv, case):
    """No latent/rope fusion (each part its own launch group) on a single program: same bytes."""
    reg = kv.registry_with("kernel-unfused", programs=1, fuse_parts=False)
    pool = check_strategy(reg, case, LAYOUT, "kernel-unfused", variant="one-page-i32", device=DEVICE)
    groups = pool.binding.scratch[NAME].groups
    assert all(g.split == g.width for g in groups)
