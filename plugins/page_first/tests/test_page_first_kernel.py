"""``page_first.kernel`` and ``page_first_direct.kernel``: conformance, word sizes, masking, SM budget, pinning."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses

import pytest

from hicache_core import (
    Addressing,
    BufferSpec,
    Component,
    HostKVPool,
    HostPlan,
    LayerMap,
    PoolSpec,
    Segment,
    create_registry,
)
from hicache_core.errors import HostBufferError
from hicache_core.kernel_support import ENV_PROGRAMS, Budget
from hicache_core.testing.conformance import CASES, check_load_all, check_strategy
from hicache_page_first.layout import PAGE_FIRST
from hicache_page_first.strategy import (
    DEFAULT_BACKUP_PROGRAMS,
    DEFAULT_LOAD_PROGRAMS,
    PageFirstDirectKernelStrategy,
    PageFirstKernelStrategy,
    WorkPlan,
    work_plan,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PIN = DEVICE.type == "cuda"
STRATEGIES = {"page_first": "page_first.kernel", "page_first_direct": "page_first_direct.kernel"}
LAYOUTS = tuple(STRATEGIES)
CASE_IDS = [c.id for c in CASES]


@pytest.fixture(scope="module")
def registry():
    return create_registry()


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


# -- conformance: every core case, both layouts ------------------------------------------------


@pytest.mark.parametrize("variant", ["shuffled-i64", "last-page-i32-dev"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_conformance_round_trip(registry, layout, case, variant):
    pool = check_strategy(registry, case, layout, "kernel", variant=variant, device=DEVICE, strategy=STRATEGIES[layout])
    assert pool.strategy_name == STRATEGIES[layout]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_conformance_per_layer_backup(registry, layout, case):
    check_strategy(registry, case, layout, "kernel", device=DEVICE, strategy=STRATEGIES[layout], per_layer_backup=True)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_conformance_load_all(registry, layout, case):
    check_load_all(registry, case, layout, "kernel", device=DEVICE, strategy=STRATEGIES[layout])


def test_cases_cover_sharded_mla_fp8_rows():
    """The conformance cases this plugin relies on: sharded MLA fp8 576-byte rows and 656-byte rows."""
    specs = {c.id: c.build(torch.device("cpu")) for c in CASES}
    fp8 = [s for s in specs.values() if s.kind == "mla" and s.components[0].dtype == torch.uint8]
    assert {s.components[0].row_bytes for s in fp8} >= {576, 656}
    assert any(s.sharded and s.components[0].row_bytes == 576 for s in fp8)


# -- helpers for hand-built pools ----------------------------------------------------------------


def _mla_spec(lmap: LayerMap, *, ps: int, pages: int, row_bytes: int) -> PoolSpec:
    return PoolSpec(kind="mla", components=(Component("kv", row_bytes, torch.uint8),), layer_map=lmap,
                    page_size=ps, capacity=ps * pages, device=DEVICE)


def _layers(spec: PoolSpec, rows: int, gen: torch.Generator, *, byte_offset: int = 0, pad: int = 0) -> list:
    """Random uint8 ``[rows, row_bytes]`` device tensors starting ``byte_offset`` bytes into their storage."""
    row = spec.components[0].row_bytes
    out = []
    for _ in range(spec.layer_map.num_device_layers):
        raw = torch.randint(0, 256, (byte_offset + rows * (row + pad),), dtype=torch.uint8, generator=gen).to(DEVICE)
        out.append(raw[byte_offset:].view(rows, row + pad)[:, :row])
    return out


def _clone(layers: list) -> list:
    out = []
    for t in layers:
        c = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        c.copy_(t)
        out.append(c)
    return out


def _pages(spec: PoolSpec, pages: list[int]) -> torch.Tensor:
    ps = spec.page_size
    return torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in pages])


def _round_trip(registry, layout: str, spec: PoolSpec, layers: list, *, dtype=torch.int64, programs=None) -> HostKVPool:
    """backup_all + load_layer + load_all through the kernel and the reference; bit-exact or raise."""
    ref_layers = _clone(layers)
    pool = HostKVPool(spec, layout, "kernel", {"kv": layers}, registry=registry, pin_memory=PIN)
    if programs is not None:
        pool.strategy = type(pool.strategy)(programs=programs)
        pool.strategy.prepare(pool.binding)
    ref = HostKVPool(spec, layout, "reference", {"kv": ref_layers}, registry=registry, pin_memory=False)
    for p in (pool, ref):
        for t in p.host_buffers.values():
            t.view(torch.uint8).fill_(0xA5)
    pages = list(range(spec.num_pages))[::-1]
    h = _pages(spec, pages)
    src = torch.randperm(spec.capacity, generator=torch.Generator().manual_seed(3))[: h.numel()]
    dst = src + spec.capacity
    pool.backup_all_layers(h.to(dtype), src.to(dtype))
    ref.backup_all_layers(h, src)
    _sync()
    for name, t in ref.host_buffers.items():
        assert torch.equal(pool.host_buffers[name].view(torch.uint8), t.view(torch.uint8)), f"backup differs ({name})"
    owned = spec.layer_map.device_layers
    pool.load_layer(owned[0], h.to(dtype), dst.to(dtype))
    pool.load_all_layers(h.to(dtype), dst.to(dtype))
    ref.load_all_layers(h, dst)
    _sync()
    for d in owned:
        assert torch.equal(layers[d], ref_layers[d]), f"load differs on device layer {d}"
        assert torch.equal(layers[d][dst.to(DEVICE)], layers[d][src.to(DEVICE)]), f"round trip differs on layer {d}"
    return pool


def _word(pool: HostKVPool) -> int:
    return pool.binding.scratch[pool.strategy_name].segments[0].table.word


# -- access word fallback ----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("row_bytes,byte_offset,word", [
    (656, 0, 8), (576, 0, 8), (12, 0, 4), (6, 0, 2), (7, 0, 1), (576, 2, 2), (576, 1, 1),
], ids=["656B", "576B", "12B", "6B", "7B", "576B-dev+2", "576B-dev+1"])
def test_word_size_fallback(registry, layout, row_bytes, byte_offset, word):
    spec = _mla_spec(LayerMap.unsharded(2), ps=4, pages=3, row_bytes=row_bytes)
    pool = _round_trip(registry, layout, spec, _layers(spec, 2 * spec.capacity, torch.Generator().manual_seed(0),
                                                       byte_offset=byte_offset))
    assert _word(pool) == word


@pytest.mark.parametrize("layout", LAYOUTS)
def test_odd_device_stride_and_sharded_map(registry, layout):
    """Device rows padded by 3 bytes (word 1) with a sharded map of 5 layers over 2 ranks."""
    spec = _mla_spec(LayerMap.sharded_cp(5, 2, 0, pad_to_largest=True), ps=2, pages=4, row_bytes=656)
    pool = _round_trip(registry, layout, spec, _layers(spec, 2 * spec.capacity, torch.Generator().manual_seed(1), pad=3))
    assert _word(pool) == 1


# -- index dtypes and page sizes ----------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_index_dtypes(registry, layout, dtype):
    spec = _mla_spec(LayerMap.unsharded(3), ps=4, pages=4, row_bytes=576)
    _round_trip(registry, layout, spec, _layers(spec, 2 * spec.capacity, torch.Generator().manual_seed(2)), dtype=dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ps", [1, 16, 64, 128])
def test_page_sizes(registry, layout, ps):
    spec = _mla_spec(LayerMap.unsharded(2), ps=ps, pages=max(2, 16 // ps), row_bytes=40)
    _round_trip(registry, layout, spec, _layers(spec, 2 * spec.capacity, torch.Generator().manual_seed(ps)))


# -- masking: bad indices never touch memory out of bounds -----------------------------------------------

GUARD = 4096  # guard bytes around every buffer


def _guarded_host(plan: HostPlan) -> tuple[dict, dict]:
    bufs, backing = {}, {}
    for b in plan.buffers:
        raw = torch.full((b.nbytes + 2 * GUARD,), 0x5A, dtype=torch.uint8, pin_memory=PIN)
        backing[b.name] = raw
        bufs[b.name] = raw[GUARD : GUARD + b.nbytes].view(b.dtype).view(b.shape)
    return bufs, backing


@pytest.mark.parametrize("layout", LAYOUTS)
def test_out_of_range_indices_are_masked(registry, layout):
    """Indices past validation (``validate='shapes'`` skips device-resident index values) move nothing
    outside the buffers: the strategy is called directly with bad pairs; only valid pairs move."""
    row, rows, guard_rows = 64, 16, 8
    spec = _mla_spec(LayerMap.unsharded(2), ps=1, pages=8, row_bytes=row)
    gen = torch.Generator().manual_seed(4)
    backing_dev = [torch.randint(0, 256, (rows + 2 * guard_rows, row), dtype=torch.uint8, generator=gen).to(DEVICE)
                   for _ in range(2)]
    layers = [b[guard_rows : guard_rows + rows] for b in backing_dev]
    plan = registry.layout(layout).plan(spec)
    host, backing_host = _guarded_host(plan)
    pool = HostKVPool(spec, layout, "kernel", {"kv": layers}, host_buffers=host, registry=registry,
                      validate="shapes")
    host_before = {k: v.clone() for k, v in backing_host.items()}
    dev_before = [b.clone() for b in backing_dev]
    h = torch.tensor([0, 1, spec.capacity, -1, 2, 2**40], dtype=torch.int64, device=DEVICE)
    d = torch.tensor([5, rows, 2, 3, -1, 6], dtype=torch.int64, device=DEVICE)
    pool.strategy.backup(pool.binding, h, d, None)
    _sync()
    hv = host["kv"].view(torch.uint8).reshape(-1)
    expect = host_before["kv"].clone()
    exp_v = expect[GUARD : GUARD + hv.numel()]
    view = pool.binding.segments[0].host_view
    exp_view = exp_v.as_strided(view.shape, view.stride())
    for e in range(2):
        exp_view[e, 0, 0, 0] = layers[e][5].cpu()  # slot 0 (page 0, token 0): the only valid pair
    assert torch.equal(backing_host["kv"], expect), "backup wrote outside the valid pair"
    view_now = hv.as_strided(view.shape, view.stride())
    view_now[:, 0, 0, 0] = 0x11  # make the valid load visible
    pool.strategy.load(pool.binding, h, d, None)
    _sync()
    for e in range(2):
        dev_before[e][guard_rows + 5] = 0x11
        assert torch.equal(backing_dev[e], dev_before[e]), "load wrote to device rows of invalid pairs or guards"


# -- SM budget ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("programs", [1, 3])
def test_sm_budget_argument(registry, layout, programs):
    spec = _mla_spec(LayerMap.unsharded(3), ps=2, pages=6, row_bytes=576)
    pool = _round_trip(registry, layout, spec, _layers(spec, 2 * spec.capacity, torch.Generator().manual_seed(5)),
                       programs=programs)
    assert pool.binding.scratch[pool.strategy_name].programs == Budget(programs, programs)


def test_sm_budget_default_and_env(monkeypatch):
    monkeypatch.delenv(ENV_PROGRAMS, raising=False)
    cpu = torch.device("cpu")
    assert PageFirstKernelStrategy().budget(cpu) == Budget(DEFAULT_BACKUP_PROGRAMS, DEFAULT_LOAD_PROGRAMS)
    assert DEFAULT_BACKUP_PROGRAMS < DEFAULT_LOAD_PROGRAMS  # loads are latency-bound: more bytes in flight
    monkeypatch.setenv(ENV_PROGRAMS, "7")
    assert PageFirstDirectKernelStrategy().budget(cpu) == Budget(7, 7)
    assert PageFirstKernelStrategy(programs=5).budget(cpu) == Budget(5, 5)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_sm_budget_rejects_non_positive(bad):
    with pytest.raises(ValueError, match="programs must be a positive int"):
        PageFirstKernelStrategy(programs=bad)


def test_work_plan_page_first_groups_layers():
    # enough token tiles: every item covers all layers (a token's all-layer block per program)
    assert work_plan(4096, 61, tile_rows=8, page_size=64, programs=132, per_page=False) == WorkPlan(132, 8, 61)
    # a small batch (8 token tiles): layers split into 16 groups of 4 so the grid fills
    assert work_plan(64, 61, tile_rows=8, page_size=64, programs=132, per_page=False) == WorkPlan(128, 8, 4)
    # per-layer transfer: one entry
    assert work_plan(64, 1, tile_rows=8, page_size=64, programs=132, per_page=False) == WorkPlan(8, 8, 1)
    assert work_plan(64, 61, tile_rows=8, page_size=64, programs=4, per_page=False) == WorkPlan(4, 8, 61)


def test_work_plan_page_first_direct_uses_page_layer_blocks():
    assert work_plan(4096, 61, tile_rows=8, page_size=64, programs=132, per_page=True) == WorkPlan(132, 64, 1)
    # two 3-token pages fit an 8-row tile: 8 items x 2 layers
    assert work_plan(48, 2, tile_rows=8, page_size=3, programs=132, per_page=True) == WorkPlan(16, 6, 1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_launch_per_segment(registry, layout):
    """backup_all_layers launches once per segment (all layers in one launch); per-layer calls once per segment."""
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(3), head_num=2, head_dim=8, dtype=torch.float16,
                        page_size=4, capacity=16, device=DEVICE)
    gen = torch.Generator().manual_seed(6)
    dev = {c: [torch.randint(0, 256, (32, 32), dtype=torch.uint8, generator=gen).to(DEVICE).view(torch.float16)
               for _ in range(3)] for c in ("k", "v")}
    pool = HostKVPool(spec, layout, "kernel", dev, registry=registry, pin_memory=PIN)
    state = pool.binding.scratch[pool.strategy_name]
    calls = []

    class Counting:
        tile_shape = staticmethod(state.kernels.tile_shape)

        @staticmethod
        def launch(grid, *args, **kw):
            calls.append((grid, kw["n_ent"]))
            state.kernels.launch(grid, *args, **kw)

    pool.binding.scratch[pool.strategy_name] = dataclasses.replace(state, kernels=Counting)
    h, d = torch.arange(8), torch.arange(8, 16)
    pool.backup_all_layers(h, d)
    assert [n for _, n in calls] == [3, 3]
    calls.clear()
    pool.load_layer(1, h, d)
    assert [n for _, n in calls] == [1, 1]
    assert all(1 <= g <= state.programs.load for g, _ in calls)


# -- capability checks and pinning ------------------------------------------------------------------------


def test_supports_rejects_other_layouts_and_chunked_rows():
    spec = _mla_spec(LayerMap.unsharded(2), ps=4, pages=2, row_bytes=576)
    assert PageFirstKernelStrategy().supports(spec, PAGE_FIRST) is None
    why = PageFirstDirectKernelStrategy().supports(spec, PAGE_FIRST)
    assert why == "page_first_direct.kernel serves layout 'page_first_direct', not 'page_first'"

    class Chunked:
        name = "page_first"
        description = "page_first with rows split in two chunks"

        def check(self, spec):
            return None

        def plan(self, spec):
            a = Addressing(offset=0, layer=576, page=4 * 2 * 576, token=2 * 576, chunk_bytes=288, chunk_stride=288)
            return HostPlan((BufferSpec("kv", (8, 2, 576), torch.uint8),), (Segment("kv", "kv", None, 0, 576, a),))

    why = PageFirstKernelStrategy().supports(spec, Chunked())
    assert why == "segment 'kv' stores rows in 288-byte chunks; page_first.kernel moves whole contiguous rows only"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning is checked only on CUDA")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_unpinned_host_memory_is_rejected(registry, layout):
    spec = _mla_spec(LayerMap.unsharded(2), ps=4, pages=2, row_bytes=576)
    layers = _layers(spec, 16, torch.Generator().manual_seed(7))
    with pytest.raises(HostBufferError, match="host buffers must be pinned"):
        HostKVPool(spec, layout, "kernel", {"kv": layers}, registry=registry, pin_memory=False)
