"""``layer_first.kernel``: conformance against the reference, and what the layout's addressing needs.

What every row-copy kernel shares (tiles, tuning, groups, words, masking, launches, pinning) is
tested once in ``tests/test_rowcopy.py``.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from hicache_core import Addressing, BufferSpec, HostPlan, LayerMap, PoolSpec, Segment, create_registry  # noqa: E402
from hicache_core.testing.conformance import CASES, assert_page_loads_taken, check_load_all, check_strategy  # noqa: E402
from hicache_layer_first.layout import LAYOUT  # noqa: E402
from hicache_layer_first.strategy import STRATEGY_NAME as NAME, LayerFirstKernelStrategy  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
REGISTRY = create_registry()
SHARDED = [c for c in CASES if "sharded" in c.id or "drafts" in c.id]


@pytest.mark.parametrize("variant", ["shuffled-i64", "last-page-i32-dev"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_conformance_round_trip(monkeypatch, case, variant):
    if variant == "last-page-i32-dev":
        # page loads of every group, pages of any size (the other variant: automatic, >= 2 KiB per host part)
        monkeypatch.setenv("HICACHE_KERNEL_PAGES", "1")
    pool = check_strategy(REGISTRY, case, "layer_first", "kernel", variant=variant, device=DEVICE, strategy=NAME)
    assert pool.strategy_name == NAME
    if variant == "last-page-i32-dev":
        assert_page_loads_taken(pool)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_conformance_load_all_layers(monkeypatch, case):
    monkeypatch.setenv("HICACHE_KERNEL_PAGES", "1")  # page loads of pages of any size (round trips: automatic too)
    check_load_all(REGISTRY, case, "layer_first", "kernel", device=DEVICE, strategy=NAME)


@pytest.mark.parametrize("case", SHARDED, ids=[c.id for c in SHARDED])
def test_conformance_per_layer_backup_sharded(case):
    check_strategy(REGISTRY, case, "layer_first", "kernel", device=DEVICE, strategy=NAME, per_layer_backup=True)


@pytest.mark.parametrize("sharded", [False, True])
def test_resolves_for_both_sharded_keys(sharded):
    lmap = LayerMap.sharded_cp(4, 2, 1) if sharded else LayerMap.unsharded(2)
    spec = PoolSpec.mha(layer_map=lmap, head_num=1, head_dim=8, dtype=torch.float16, page_size=1, capacity=4,
                        device=DEVICE)
    assert spec.sharded is sharded
    assert REGISTRY.resolve(spec, "layer_first", "kernel").info.name == NAME


class _PaddedPages:
    """``[L, P, page_size * row + 64]``: rows whole and contiguous, but pages padded."""

    name = "layer_first"
    description = "layer_first with padded pages"

    def check(self, spec):
        return None

    def plan(self, spec):
        row, ps = spec.components[0].row_bytes, spec.page_size
        page = ps * row + 64
        addr = Addressing(offset=0, layer=spec.num_pages * page, page=page, token=row, chunk_bytes=row)
        return HostPlan((BufferSpec("kv", (1, spec.num_pages, page), torch.uint8),),
                        (Segment("kv", "kv", None, 0, row, addr),))


def test_host_slot_is_addressed_at_slot_times_token_stride():
    """The kernel has no page arithmetic: a page stride other than page_size * token is refused."""
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(1), kv_lora_rank=16, qk_rope_head_dim=0, dtype=torch.uint8,
                        page_size=4, capacity=8, device=DEVICE)
    assert LayerFirstKernelStrategy().supports(spec, LAYOUT) is None
    assert LayerFirstKernelStrategy().supports(spec, _PaddedPages()) == (
        "segment 'kv' has page stride 128 != page_size*token stride 64; layer_first.kernel addresses host slot s "
        "at s*token")
