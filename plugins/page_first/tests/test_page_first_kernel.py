"""``page_first.kernel`` and ``page_first_direct.kernel``: conformance against the reference, the layout each
serves, and the order each walks work items in.

What every row-copy kernel shares (tiles, tuning, groups, words, masking, launches, pinning) is
tested once in ``tests/test_rowcopy.py``.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from hicache_core import Component, HostKVPool, LayerMap, PoolSpec, create_registry  # noqa: E402
from hicache_core.testing.conformance import CASES, assert_page_loads_taken, check_load_all, check_strategy  # noqa: E402
from hicache_page_first.layout import PAGE_FIRST, PAGE_FIRST_DIRECT  # noqa: E402
from hicache_page_first.strategy import PageFirstDirectKernelStrategy, PageFirstKernelStrategy  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
REGISTRY = create_registry()
STRATEGIES = {"page_first": "page_first.kernel", "page_first_direct": "page_first_direct.kernel"}
CASE_IDS = [c.id for c in CASES]


@pytest.mark.parametrize("variant", ["shuffled-i64", "last-page-i32-dev", "per-layer-backup", "load-all"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("layout", STRATEGIES)
def test_conformance(monkeypatch, layout, case, variant):
    kw = dict(device=DEVICE, strategy=STRATEGIES[layout])
    if variant in ("last-page-i32-dev", "load-all"):  # page_first_direct's page loads of pages of any size too
        monkeypatch.setenv("HICACHE_KERNEL_PAGES", "1")  # (the other variants: automatic, >= 2 KiB per host part)
    if variant == "load-all":
        check_load_all(REGISTRY, case, layout, "kernel", **kw)
    elif variant == "per-layer-backup":
        check_strategy(REGISTRY, case, layout, "kernel", per_layer_backup=True, **kw)
    else:
        pool = check_strategy(REGISTRY, case, layout, "kernel", variant=variant, **kw)
        assert pool.strategy_name == kw["strategy"]
        if variant == "last-page-i32-dev" and layout == "page_first_direct":  # (page_first's host rows: token-major)
            assert_page_loads_taken(pool)


def test_cases_cover_sharded_mla_fp8_rows():
    """The conformance cases this plugin relies on: sharded MLA fp8 576-byte rows and 656-byte rows."""
    specs = [c.build(torch.device("cpu")) for c in CASES]
    fp8 = [s for s in specs if s.kind == "mla" and s.components[0].dtype == torch.uint8]
    assert {s.components[0].row_bytes for s in fp8} >= {576, 656}
    assert any(s.sharded and s.components[0].row_bytes == 576 for s in fp8)


def test_each_strategy_serves_its_own_layout():
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.uint8,
                        page_size=4, capacity=8, device=DEVICE)
    assert PageFirstKernelStrategy().supports(spec, PAGE_FIRST) is None
    assert PageFirstDirectKernelStrategy().supports(spec, PAGE_FIRST_DIRECT) is None
    assert PageFirstDirectKernelStrategy().supports(spec, PAGE_FIRST) == (
        "page_first_direct.kernel serves layout(s) 'page_first_direct', not 'page_first'")
    assert PageFirstKernelStrategy().supports(spec, PAGE_FIRST_DIRECT) == (
        "page_first.kernel serves layout(s) 'page_first', not 'page_first_direct'")


@pytest.mark.parametrize("layout, entries_inner", [("page_first", True), ("page_first_direct", False)])
def test_work_item_order(layout, entries_inner):
    """``page_first`` walks the layers of one token before the next token; ``page_first_direct`` the tokens of
    one layer before the next layer.  Seen on one program, one token per tile, device layer 1 a view of layer 0
    one row on: device row 2 is written by (token 0, layer 1) and by (token 1, layer 0); the later item wins."""
    spec = PoolSpec("mla", (Component("kv", 16, torch.uint8),), LayerMap.unsharded(2), 1, 8, DEVICE)
    rows = torch.zeros(9, 16, dtype=torch.uint8, device=DEVICE)
    pool = HostKVPool(spec, layout, "kernel", {"kv": [rows[:8], rows[1:]]}, registry=REGISTRY,
                      pin_memory=DEVICE.type == "cuda", strategy_options={"programs": 1, "tile_bytes": 1})
    filler = {"kv": [torch.full((8, 16), v, dtype=torch.uint8, device=DEVICE) for v in (10, 11)]}
    HostKVPool(spec, layout, "reference", filler, host_buffers=pool.host_buffers,
               registry=REGISTRY).backup_all_layers(torch.arange(8), torch.arange(8))  # host layer l holds 10 + l
    pool.load_all_layers(torch.tensor([3, 4]), torch.tensor([1, 2]))
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert rows[:, 0].tolist() == [0, 10, 10 if entries_inner else 11, 11, 0, 0, 0, 0, 0]
