"""TMA loads of the row-copy strategies (hicache_core.rowcopy_tma, kernel_lib.PAGED_TMA_LOAD): bit-exact per-layer
loads through tensor descriptors, the gather fallback for indices that are not whole pages, bounds, which groups
take it, and the switch.  On CPU the kernels run in Triton's interpreter (descriptors emulated); on a GPU both
paths run (TMA forced on and off)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest  # noqa: E402

from hicache_core import LayerMap, PoolSpec, create_registry, kernel_lib as kl  # noqa: E402
from hicache_core.errors import ConfigError  # noqa: E402
from hicache_core.launch import _traits  # noqa: E402
from hicache_core.rowcopy import KernelTuning  # noqa: E402
from hicache_core import rowcopy  # noqa: E402
from hicache_core import rowcopy_tma  # noqa: E402
from hicache_core.rowcopy_tma import (AUTO_MAX_STRIDED_ROWS, AUTO_MIN_BOX_BYTES, AUTO_MIN_ROW_BYTES, ENV_TMA,  # noqa: E402
                                      MIN_TOKENS, box_shape, tma_mode)
from hicache_core.testing.conformance import CANARY, CASES, check_strategy  # noqa: E402
from hicache_core.testing.guarded import assert_same_device, guarded_pools  # noqa: E402
from hicache_layer_first.strategy import LayerFirstKernelStrategy  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PIN = DEVICE.type == "cuda"
REGISTRY = create_registry()
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_first_kv_split")
#: On CPU the row kernel's loads are covered by the plugins' own conformance tests; on a GPU run both here.
MODES = (True, False) if PIN else (True,)
_sync = torch.cuda.synchronize if PIN else (lambda: None)


@pytest.mark.parametrize("tma", MODES, ids=lambda t: f"tma={t}")
@pytest.mark.parametrize("variant", ["shuffled-i64", "offset-view-i32-dev"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_per_layer_loads_round_trip(monkeypatch, launches, layout, case, variant, tma):
    """Every conformance case, bit-exact against the reference; with TMA on, every group a descriptor can
    address loads through the TMA kernel (one launch per segment of the layer), the others through the row kernel."""
    monkeypatch.setenv(ENV_TMA, "1" if tma else "0")
    pool = check_strategy(REGISTRY, case, layout, "kernel", variant=variant, device=DEVICE)
    prep = pool.binding.scratch[pool.strategy_name]
    tma_kernels = [c for k, _, c in launches if k is kl.PAGED_TMA_LOAD]
    if not tma:
        assert prep.tma == () and tma_kernels == []
        return
    plans = [p for p in prep.tma if p is not None]
    assert len(tma_kernels) == sum(len(v) for p in plans for v in p.values())  # each (segment, layer) entry once
    spec = case.build(DEVICE)
    fused = layout == "page_first_kv_split" and bool(spec.components[0].parts) and not case.split_parts
    whole = spec.page_size & -spec.page_size  # boxes never straddle pages: their rows divide the page
    assert bool(plans) == (whole >= MIN_TOKENS and not fused), [p is not None for p in prep.tma]


def _pool(layout: str, spec: PoolSpec, gen: torch.Generator, *, tma: bool = True, guard: int = 0,
          lead: int = 0, **opts):
    """A kernel pool with random device rows (2 x capacity of them) and host buffers inside ``guard`` canary bytes
    (starting ``lead`` bytes into their allocation), plus the reference pool on copies of the same bytes."""
    p = guarded_pools(REGISTRY, layout, "kernel", spec, gen, pin=PIN, guard=guard, lead=lead,
                      strategy_options={"tma": tma, **opts})
    return p.pool, p.ref, p.big, p.dev, p.ref_dev


_same = assert_same_device


def _mla(ps: int, pages: int, layers: int = 3) -> PoolSpec:
    return PoolSpec.mla(layer_map=LayerMap.unsharded(layers), kv_lora_rank=64, qk_rope_head_dim=8,
                        dtype=torch.bfloat16, page_size=ps, capacity=ps * pages, device=DEVICE)


def _patterns(spec: PoolSpec, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Host slot patterns: whole pages; arbitrary slots; page-long runs starting mid-page; whole pages whose tiles
    start at a bad slot; and the same with a few slots out of range."""
    ps, cap = spec.page_size, spec.capacity
    pages = torch.randperm(cap // ps, generator=gen)[: cap // ps - 1]
    whole = (pages.unsqueeze(1) * ps + torch.arange(ps)).reshape(-1)
    shifted = (whole + ps // 2) % cap
    first_bad = whole.clone()
    first_bad[::8] = -1  # every tile's first slot (tiles are >= 8 rows) is out of range
    out = whole.clone()
    out[torch.randperm(out.numel(), generator=gen)[:5]] = cap + 3
    return {"whole-pages": whole, "arbitrary": torch.randperm(cap, generator=gen)[: whole.numel()],
            "mid-page-runs": shifted, "first-slot-bad": first_bad, "some-out-of-range": out}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_indices_that_are_not_whole_pages_are_gathered(layout, launches):
    """As with validate='shapes' and device-resident indices (the strategy is called directly): a tile's rows that
    are not its box's rows are gathered one by one, out-of-range pairs move nothing; every other device row, and
    the guard bytes around the host buffers, stay as they were."""
    gen = torch.Generator().manual_seed(5)
    spec = _mla(16, 6)
    pool, ref, big, dev, ref_dev = _pool(layout, spec, gen, guard=256, tile_bytes=16 * 144, fuse_parts=False)
    prep = pool.binding.scratch[pool.strategy_name]
    assert any(p is not None for p in prep.tma), "this spec should take TMA loads"
    for name, h in _patterns(spec, gen).items():
        d = torch.randperm(2 * spec.capacity, generator=gen)[: h.numel()]
        d[3] = 2 * spec.capacity + 1 if name == "some-out-of-range" else d[3]
        ok = (h >= 0) & (h < spec.capacity) & (d < 2 * spec.capacity)
        launches.clear()
        for layer in range(3):
            pool.strategy.load(pool.binding, h.to(DEVICE), d.to(DEVICE), layer)
            ref.strategy.load(ref.binding, h[ok], d[ok], layer)
        _sync()
        assert any(k is kl.PAGED_TMA_LOAD for k, _, _ in launches)
        _same(dev, ref_dev)
        for name_b, b in big.items():
            assert bool((b[:256] == CANARY).all()) and bool((b[-256:] == CANARY).all()), f"{name} {name_b} guards"


import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit(do_not_specialize=["n"])
def _RUNTIME_PAGE_TMA(anchor, host_desc, host_tail, host_idx, dev_idx, n, dev_base, dev_stride, host_base, host_page,
                      host_tok, page_size, capacity, dev_rows, WIDTH: tl.constexpr, BOX: tl.constexpr,
                      TAIL: tl.constexpr, TOKENS: tl.constexpr, VEC: tl.constexpr, STAGES: tl.constexpr,
                      FLAT: tl.constexpr):
    """A plugin's TMA load kernel written before the shared kernel took ``PAGE_SIZE``: one entry per launch, the
    runtime ``page_size`` handed to :func:`kernel_lib.load_entry` in its place."""
    kl.load_entry(anchor, host_desc, host_tail, host_idx, dev_idx, n, dev_base, dev_stride, host_base, host_page,
                  host_tok, page_size, capacity, dev_rows, WIDTH, BOX, TAIL, TOKENS, VEC, STAGES, FLAT)


@pytest.mark.parametrize("kind", ["mla", "mha"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_a_tma_kernel_taking_the_runtime_page_size_still_loads(monkeypatch, layout, kind, launches):
    """A plugin's own TMA load kernel that declares ``page_size`` (not ``PAGE_SIZE``) and calls ``load_entry`` with
    it: the launch still passes it, and every pattern (whole pages, arbitrary slots, mid-page runs, slots out of
    range: the gather pass divides by it) loads as the reference does.  It declares no ``ENTRIES``: MHA ``k`` and
    ``v`` of a layer take a launch each (paired, ``v`` would never load)."""
    from hicache_layer_first import kernels as lf_kernels
    from hicache_page_first import kernels as pf_kernels

    for module in (lf_kernels, pf_kernels):
        monkeypatch.setattr(module, "TMA_LOAD_KERNEL", _RUNTIME_PAGE_TMA)
    gen = torch.Generator().manual_seed(12)
    spec = _mla(16, 6) if kind == "mla" else PoolSpec.mha(
        layer_map=LayerMap.unsharded(3), head_num=2, head_dim=16, dtype=torch.float16, page_size=16, capacity=96,
        device=DEVICE)
    pool, ref, big, dev, ref_dev = _pool(layout, spec, gen, guard=256, tile_bytes=16 * 144)
    for name, h in _patterns(spec, gen).items():
        d = torch.randperm(2 * spec.capacity, generator=gen)[: h.numel()]
        ok = (h >= 0) & (h < spec.capacity)
        launches.clear()
        for layer in range(3):
            pool.strategy.load(pool.binding, h.to(DEVICE), d.to(DEVICE), layer)
            ref.strategy.load(ref.binding, h[ok], d[ok], layer)
        _sync()
        assert launches and all(k is _RUNTIME_PAGE_TMA for k, _, _ in launches), name
        assert all(c["page_size"] == spec.page_size for _, _, c in launches), name
        assert len(launches) == 3 * (2 if kind == "mha" else 1), name  # a launch per entry of each layer
        _same(dev, ref_dev)
        for name_b, b in big.items():
            assert bool((b[:256] == CANARY).all()) and bool((b[-256:] == CANARY).all()), f"{name} {name_b} guards"


def test_launch_shape_and_what_keeps_the_row_kernel(launches):
    """One launch per (segment, layer) with a grid of at most ``programs``; each entry's descriptor is 2-D at the
    host token stride: as many rows as slots where slots are uniformly strided (layer_first, page_first), the
    layer's last slot's row where pages sit ``layers`` pages apart (page_first_direct); backups and
    load_all_layers stay on the row kernel."""
    gen = torch.Generator().manual_seed(6)
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(2), head_num=2, head_dim=16, dtype=torch.float16, page_size=16,
                        capacity=64, device=DEVICE)
    h, d = torch.arange(16, 48), torch.arange(64, 96)
    word_row = 64  # bytes of one k (or v) row: 2 heads x 16 x fp16
    for layout, rows, tok_rows in (("layer_first", 64, 1), ("page_first", 64, 2),  # 2 layers per slot
                                   ("page_first_direct", 3 * 2 * 16 + 16, 1)):  # 4 pages, 2 layers per page
        pool, *_ = _pool(layout, spec, gen, programs=3)
        launches.clear()
        pool.backup_all_layers(h, d)
        pool.load_all_layers(h, d)
        assert all(k is not kl.PAGED_TMA_LOAD for k, _, _ in launches)
        launches.clear()
        pool.load_layer(1, h, d)
        tma = [(grid, c) for k, grid, c in launches if k is kl.PAGED_TMA_LOAD]
        assert len(tma) == len(launches) == 1 and tma[0][1]["ENTRIES"] == 2  # k and v: one launch
        for grid, c in tma:
            word = pool.binding.scratch[pool.strategy_name].groups[0].word
            assert grid == min(3, -(-32 // c["TOKENS"])) and c["TOKENS"] == 16  # one page
            assert c["WIDTH"] * word == word_row and c["FLAT"] is (layout != "page_first_direct")
            assert c["TAIL"] == 0 and c["host_tail"] is None and c["host_tail_b"] is None  # nothing to encode
            for desc in (c["host_desc"], c["host_desc_b"]):
                assert list(desc.shape) == [rows, c["WIDTH"]] and list(desc.block_shape) == [16, c["BOX"]]
                assert list(desc.strides) == [c["WIDTH"] * tok_rows, 1]
    _sync()


@pytest.mark.parametrize("spec_kw, layout, why", [
    (dict(ps=4), "layer_first", "pages of 4 tokens give boxes of fewer than 8 rows"),
    (dict(ps=12), "page_first_direct", "pages of 12 tokens give boxes of fewer than 8 rows"),  # 4 rows divide 12
    (dict(ps=16, tile_bytes=512), "page_first", "give boxes of fewer than 8 rows within tile_bytes"),
    (dict(ps=16), "page_first_kv_split", "split over two host buffers"),
    (dict(ps=16, lead=8), "layer_first", "not multiples of 16 bytes"),
])
def test_groups_a_descriptor_cannot_address_keep_the_row_kernel(caplog, launches, spec_kw, layout, why):
    gen = torch.Generator().manual_seed(7)
    spec = _mla(spec_kw["ps"], 4, layers=2)
    opts = {"tile_bytes": spec_kw["tile_bytes"]} if "tile_bytes" in spec_kw else {}
    with caplog.at_level("INFO", logger="hicache_core.rowcopy"):
        pool, ref, _, dev, ref_dev = _pool(layout, spec, gen, lead=spec_kw.get("lead", 0), **opts)
    assert why in caplog.text
    h = torch.arange(spec.capacity)
    d = torch.randperm(2 * spec.capacity, generator=gen)[: spec.capacity]
    launches.clear()
    pool.load_layer(1, h, d)
    ref.load_layer(1, h, d)
    _sync()
    assert launches and all(k is not kl.PAGED_TMA_LOAD for k, _, _ in launches)
    _same(dev, ref_dev)


def test_switch(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(ENV_TMA, raising=False)
    assert tma_mode(None, cpu) is None and tma_mode(True, cpu) == "all"
    monkeypatch.setenv(ENV_TMA, "1")
    assert tma_mode(None, cpu) == "all" and tma_mode(False, cpu) is None
    monkeypatch.delenv(ENV_TMA)
    monkeypatch.setattr(rowcopy_tma, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for major, want in ((8, None), (9, "auto"), (10, None), (12, None)):  # automatic: the measured generation only
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, m=major: (m, 0))
        assert tma_mode(None, torch.device("cuda", 0)) == want
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # explain describes CUDA pools without a GPU
    assert tma_mode(None, torch.device("cuda", 0)) is None
    monkeypatch.undo()
    monkeypatch.delenv(ENV_TMA, raising=False)
    monkeypatch.setenv(ENV_TMA, "maybe")
    with pytest.raises(ConfigError, match="HICACHE_KERNEL_TMA='maybe': use 1"):
        tma_mode(None, cpu)
    with pytest.raises(ConfigError, match="tma must be True, False or None"):
        LayerFirstKernelStrategy(tma="yes")

    class NoTma(LayerFirstKernelStrategy):
        name = "no_tma.kernel"
        tuning = KernelTuning(LayerFirstKernelStrategy.tuning.backup, LayerFirstKernelStrategy.tuning.load)
    spec = _mla(16, 2)
    from hicache_core.binding import bind
    layout = REGISTRY.layout("layer_first")
    plan = layout.plan(spec)
    hosts = {b.name: torch.zeros(b.shape, dtype=b.dtype, pin_memory=PIN) for b in plan.buffers}
    devs = {"kv": [torch.zeros(2 * spec.capacity, 72, dtype=torch.bfloat16, device=DEVICE) for _ in range(3)]}
    with pytest.raises(ConfigError, match="no_tma.kernel has no TMA load kernel"):
        NoTma(tma=True).prepare(bind(spec, layout, plan, hosts, devs))
    monkeypatch.setenv(ENV_TMA, "1")  # the environment asks every strategy; one without TMA loads keeps its row kernel
    NoTma().prepare(bind(spec, layout, plan, hosts, devs))
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # a Triton without tensor descriptors (< 3.4)
                        lambda name, *a: None if name == "triton.tools.tensor_descriptor" else real(name, *a))
    binding = bind(spec, layout, plan, hosts, devs)
    LayerFirstKernelStrategy().prepare(binding)  # asked by the environment: the row kernel, no error
    assert binding.scratch["layer_first.kernel"].tma == ()
    with pytest.raises(ConfigError, match="tma=True needs Triton tensor descriptors"):
        LayerFirstKernelStrategy(tma=True).prepare(bind(spec, layout, plan, hosts, devs))


@pytest.mark.parametrize("width, word, ps, tile, stages, want", [
    (144, 8, 64, 40960, 4, (128, 16, 32)),  # 1152-byte MLA rows: 128 + 16 words, 32 rows fill 36 KiB
    (256, 8, 64, 40960, 4, (256, 0, 16)),  # 2 KiB MHA rows
    (82, 8, 128, 40960, 4, (64, 32, 32)),  # 656-byte fp8 rows: the tail box is a power of two
    (72, 8, 16, 1 << 20, 1, (64, 8, 16)),  # at most a page of rows
    (72, 8, 48, 1 << 20, 1, (64, 8, 16)),  # ... a power of two dividing the page (boxes never straddle pages)
    (72, 8, 1024, 1 << 20, 1, (64, 8, 256)),  # at most 256 rows (a descriptor's box limit)
    (256, 8, 1024, 1 << 20, 4, (256, 0, 16)),  # 3 buffers of boxes fit the shared memory budget
    (256, 8, 1024, 1 << 20, 8, (256, 0, 8)),
    (20, 1, 16, 4096, 1, (16, 16, 16)),  # a tail box is at least 16 bytes
])
def test_box_shape(width, word, ps, tile, stages, want):
    assert box_shape(width, word, ps, tile, stages=stages) == want
    rows = want[2]
    assert rows * (want[0] * (width // want[0]) + want[1]) * word * max(1, stages - 1) <= rowcopy_tma.SMEM_BYTES
    assert box_shape(width, word, ps, tile, stages=stages, capacity=12)[2] == min(rows, 8)  # no box taller than the pool


def test_automatic_tma_takes_measured_row_and_box_sizes(monkeypatch, caplog):
    """As on a Hopper GPU (automatic mode "auto"): loads of 1152-byte rows in 16-row boxes go through TMA whatever
    the host slot addressing (uniformly strided or paged); narrower rows, and 8-row boxes of pages of 8 tokens,
    keep the row kernel, and the log says why."""
    monkeypatch.delenv(ENV_TMA, raising=False)
    monkeypatch.setattr(rowcopy, "tma_mode",
                        lambda option, device: "auto" if option is None else tma_mode(option, device))
    gen = torch.Generator().manual_seed(8)
    big = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                       page_size=32, capacity=64, device=DEVICE)
    narrow = _mla(16, 4, layers=2)
    small_pages = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64,
                               dtype=torch.bfloat16, page_size=8, capacity=64, device=DEVICE)
    assert (64 + 8) * 2 < AUTO_MIN_ROW_BYTES <= (512 + 64) * 2  # narrow rows, big rows
    with caplog.at_level("INFO", logger="hicache_core.rowcopy"):
        for spec, layout, planned in ((big, "layer_first", True), (big, "page_first", True),
                                      (big, "page_first_direct", True), (narrow, "layer_first", False),
                                      (narrow, "page_first_direct", False), (small_pages, "layer_first", False)):
            pool, ref, _, dev, ref_dev = _pool(layout, spec, gen, tma=None)
            prep = pool.binding.scratch[pool.strategy_name]
            assert [p is not None for p in prep.tma] == [planned], layout
            assert (f"of rows of >= {AUTO_MIN_ROW_BYTES} bytes in boxes of >= 16 KiB (rows strided on the host: calls "
                    f"of <= {AUTO_MAX_STRIDED_ROWS} rows) by TMA") in pool.strategy.describe(spec, pool.binding.layout)[0]
            h, d = torch.arange(spec.capacity), torch.randperm(2 * spec.capacity, generator=gen)[: spec.capacity]
            pool.load_layer(1, h, d)
            ref.load_layer(1, h, d)
            _sync()
            _same(dev, ref_dev)
    assert f"bytes are under {AUTO_MIN_ROW_BYTES} (automatic TMA takes the row sizes where it measured" in caplog.text
    assert (f"boxes of 8 rows ({8 * 1152} bytes) are under {AUTO_MIN_BOX_BYTES} (automatic TMA takes the box sizes"
            in caplog.text)


@pytest.mark.parametrize("layout, strided", [("page_first", True), ("layer_first", False), ("page_first_direct", False)])
@pytest.mark.parametrize("forced", [False, True], ids=["automatic", "tma=True"])
def test_automatic_tma_limits_calls_over_strided_host_rows(monkeypatch, launches, layout, strided, forced):
    """Token-major host rows (``page_first``: one row per slot, the other layers' rows between) load through TMA
    only up to AUTO_MAX_STRIDED_ROWS rows per call in automatic mode (the row kernel above, where it measured
    faster); forced TMA and page-contiguous host rows take every call.  Bit-exact either way."""
    monkeypatch.delenv(ENV_TMA, raising=False)
    monkeypatch.setattr(rowcopy, "tma_mode",
                        lambda option, device: "auto" if option is None else tma_mode(option, device))
    monkeypatch.setattr(rowcopy_tma, "AUTO_MAX_STRIDED_ROWS", 64)  # small pools here: the limit scaled down
    gen = torch.Generator().manual_seed(9)
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                        page_size=32, capacity=128, device=DEVICE)
    pool, ref, _, dev, ref_dev = _pool(layout, spec, gen, tma=True if forced else None)
    prep = pool.binding.scratch[pool.strategy_name]
    assert prep.tma_rows == ((64 if strided and not forced else None),)
    for n, tma_expected in ((64, True), (96, forced or not strided)):
        pages = torch.randperm(spec.capacity // 32, generator=gen)[: n // 32]
        h = (pages.unsqueeze(1) * 32 + torch.arange(32)).reshape(-1)
        d = torch.randperm(2 * spec.capacity, generator=gen)[:n]
        launches.clear()
        pool.load_layer(1, h, d)
        ref.load_layer(1, h, d)
        _sync()
        _same(dev, ref_dev)
        kernels = {k for k, _, _ in launches if k is not None}
        assert (kl.PAGED_TMA_LOAD in kernels) == tma_expected and len(kernels) == 1, (n, kernels)  # one or the other


def test_descriptors_specialise_the_launch_key():
    from triton.tools.tensor_descriptor import TensorDescriptor

    t = torch.zeros(64, 32, dtype=torch.int64)
    a, b = TensorDescriptor(t, [64, 32], [32, 1], [16, 32]), TensorDescriptor(t, [64, 32], [32, 1], [8, 32])
    c = TensorDescriptor(t.view(torch.int32), [64, 64], [64, 1], [16, 32])
    assert _traits(a) == _traits(TensorDescriptor(t[32:], [32, 32], [32, 1], [16, 32]))  # hashable, base-free
    assert len({_traits(a), _traits(b), _traits(c)}) == 3


@pytest.mark.skipif(PIN and torch.cuda.get_device_capability()[0] < 9, reason="TMA needs compute capability >= 9")
@pytest.mark.parametrize("ps, pages, gap, width, tokens, box, tail", [
    (16, 5, 3, 12, 8, 8, 4),   # pages 19 token strides apart: page_rows is no multiple of page_size; a tail box
    (16, 5, 0, 12, 8, 8, 4),   # uniformly strided slots (FLAT)
    (32, 3, 17, 8, 16, 8, 0),  # a wide gap between pages, no tail
    (16, 4, 1, 20, 16, 16, 4),  # boxes of a whole page
])
def test_the_kernel_maps_slots_to_descriptor_rows(ps, pages, gap, width, tokens, box, tail):
    """:data:`kernel_lib.PAGED_TMA_LOAD` called directly on a hand-built host layer whose page stride is
    ``ps + gap`` token strides and whose token stride is padded past the row: every valid position's device row
    equals its host slot's row, byte for byte (whole pages, shuffled slots, mid-page runs, runs past the last
    slot, repeats, negative and too-large slots, int32 and int64 indices); other device rows keep the canary."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    gen = torch.Generator().manual_seed(ps + gap + width)
    tok, cap, off = width + 4, ps * pages, 8  # words (int32); host slot 0 at word 8 (32-byte aligned)
    page = (ps + gap) * tok
    rows = rowcopy_tma.descriptor_rows(cap, ps, page // tok)
    host_words = pages * page + 64
    patterns = [torch.arange(cap), torch.randperm(cap, generator=gen), (torch.arange(cap) + ps // 2 + 3) % cap,
                torch.arange(cap - 5, cap + 9), torch.tensor([cap - 1] * 9 + [cap - 2, cap - 3, 0, 1, -1, cap + 4, 5]),
                torch.arange(-3, 20)]
    for h in patterns:
        for dtype in (torch.int64, torch.int32):
            n = h.numel()
            big = torch.randint(-2**31, 2**31 - 1, (host_words + n * width,), dtype=torch.int32, generator=gen)
            big[host_words:] = int.from_bytes(bytes([CANARY]) * 4, "little", signed=True)
            big = big.to(DEVICE)
            desc = TensorDescriptor(big[off:], [rows, width], [tok, 1], [tokens, box])
            tail_desc = TensorDescriptor(big[off:], [rows, width], [tok, 1], [tokens, tail]) if tail else None
            expect = big.clone()
            out = expect[host_words:].view(n, width)
            for i, s in enumerate(h.tolist()):
                if 0 <= s < cap:
                    start = off + (s // ps) * page + (s % ps) * tok
                    out[i] = big[start:start + width]
            kl.PAGED_TMA_LOAD[(3,)](big, desc, tail_desc, None, None, h.to(dtype).to(DEVICE),
                                    torch.arange(n).to(DEVICE), n, host_words, width, off, page, tok, 0, 0, 0, 0, 0,
                                    cap, n, WIDTH=width, BOX=box, TAIL=tail, TOKENS=tokens, VEC=1, STAGES=2,
                                    FLAT=gap == 0, ENTRIES=1, PAGE_SIZE=ps)
            _sync()
            assert torch.equal(big, expect), (h.tolist(), dtype)
