"""The staged route's relayout kernel (Triton interpreter) against the torch relayout, byte for byte.

Pools, specs and device buffers come from the conformance kit (as in
``test_direct.py``); every layout that holds a spec is checked in both
directions, over several chunks (the last one partial), with canary bytes
around the staged image.
"""

from __future__ import annotations

import sys

import pytest
import torch

from hicache_core import HostKVPool, LayerMap, PoolSpec, create_registry
from hicache_core.backends import relayout
from hicache_core.backends.staging import StagedRoute, page_images
from hicache_core.errors import ConfigError
from hicache_core.testing.conformance import CANARY, CASES, Case, check_strategy, make_device_buffers

pytest.importorskip("triton")

REG = create_registry()
LAYOUTS = sorted(REG.layouts)
PAD = 64  # canary bytes either side of the staged image


def _mla(lmap: LayerMap, ps: int, pages: int):
    return lambda device: PoolSpec.mla(layer_map=lmap, kv_lora_rank=256, qk_rope_head_dim=32, dtype=torch.bfloat16,
                                       page_size=ps, capacity=ps * pages, device=device)


def _mha(lmap: LayerMap, ps: int, pages: int, vd: int | None = None):
    return lambda device: PoolSpec.mha(layer_map=lmap, head_num=2, head_dim=8, v_head_dim=vd, dtype=torch.float16,
                                       page_size=ps, capacity=ps * pages, device=device)


#: MLA and MHA, page sizes 1 and 4, sharded and not; strided device rows, split device parts,
#: a ``v`` head dim of its own and extra components (three row widths: three launches per chunk).
SPECS = (
    Case("mla-ps1", _mla(LayerMap.unsharded(3), 1, 6)),
    Case("mla-ps4-strided", _mla(LayerMap.unsharded(3), 4, 4), strided=True),
    Case("mla-ps1-sharded-drafts", _mla(LayerMap.sharded_cp(5, 2, 1, draft_layers=1), 1, 6), split_parts=True),
    Case("mla-ps4-sharded-padded", _mla(LayerMap.sharded_cp(5, 2, 1, pad_to_largest=True), 4, 4), strided=True),
    Case("mha-ps1-strided", _mha(LayerMap.unsharded(3), 1, 6), strided=True),
    Case("mha-ps4-vdim", _mha(LayerMap.unsharded(2), 4, 4, vd=4)),
    Case("mha-ps1-sharded", _mha(LayerMap.sharded_cp(4, 2, 0), 1, 6)),
    Case("mha-ps4-sharded-drafts", _mha(LayerMap.sharded_cp(4, 2, 1, draft_layers=1), 4, 4), strided=True),
    next(c for c in CASES if c.id == "mla-dsa-extra-ps4"),
)


@pytest.fixture
def interpret(monkeypatch):
    """Kernels in Triton's CPU interpreter, whatever mode an earlier test loaded the kernel in."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _pool(case: Case, layout: str, device: str = "cpu") -> HostKVPool | None:
    spec = case.build(torch.device(device))
    if REG.try_resolve(spec, layout, "direct", override="core.direct")[0] is None:
        return None
    dev = make_device_buffers(spec, case, torch.Generator().manual_seed(1))
    return HostKVPool(spec, layout, "direct", dev, registry=REG, strategy="core.direct",
                      strategy_options={"staging": "always"})


def _routes(pool: HostKVPool, layer: int | None, pages: int = 3) -> tuple[StagedRoute, StagedRoute, torch.Tensor, torch.Tensor]:
    """Kernel and torch routes over ``pages`` shuffled host pages, two pages per chunk, and their indices."""
    spec, b = pool.spec, pool.binding
    gen = torch.Generator().manual_seed(2)
    ps = spec.page_size
    hp = torch.randperm(spec.num_pages, generator=gen)[:pages]
    h = (hp.unsqueeze(1) * ps + torch.arange(ps)).reshape(-1)
    d = torch.randperm(b.device_rows, generator=gen)[: h.numel()].to(spec.device)
    budget = 4 * sum(im.span for im in page_images(b, layer, False))  # two pages per half
    kernel = StagedRoute.build(b, h, lambda: d, layer, budget, relayout="kernel")
    torch_ = StagedRoute.build(b, h, lambda: d, layer, budget, relayout="torch")
    assert kernel is not None and torch_ is not None
    assert kernel.chunk_pages == torch_.chunk_pages == 2 and kernel.chunks == 2
    return kernel, torch_, h, d


def _device_bytes(pool: HostKVPool) -> list[torch.Tensor]:
    return [r for seg in pool.binding.segments for r in seg.device_rows]


def _snapshot(pool: HostKVPool) -> list[torch.Tensor]:
    return [r.clone() for r in _device_bytes(pool)]


def _restore(pool: HostKVPool, snap: list[torch.Tensor]) -> None:
    for r, s in zip(_device_bytes(pool), snap):
        r.copy_(s)


def _relay(route: StagedRoute, image: torch.Tensor, rows: torch.Tensor, npages: int, *, to_image: bool) -> None:
    """The route's relayout; a kernel route must launch its kernel (no silent torch fallback)."""
    if route._kernel is None:
        route._relayout(image, rows, npages, to_image=to_image)
    else:
        assert route._kernel.run(image, rows, npages, route.chunk_pages, to_image=to_image)


@pytest.mark.parametrize("select", ["all", "one"])
@pytest.mark.parametrize("case", SPECS, ids=[c.id for c in SPECS])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_relayout_matches_torch(interpret, layout, case, select):
    pool = _pool(case, layout)
    if pool is None:
        pytest.skip(f"{layout} does not hold {case.id}")
    owned = pool.spec.layer_map.device_layers
    check_relayout(pool, None if select == "all" else owned[len(owned) // 2])


def check_relayout(pool: HostKVPool, layer: int | None) -> None:
    """Kernel against torch relayout of ``layer``'s staged route, every chunk, both directions (any device)."""
    kernel, ref, h, d = _routes(pool, layer)
    assert kernel.relayout == "kernel" and ref.relayout == "torch"
    ps, cp, device = pool.spec.page_size, kernel.chunk_pages, pool.spec.device
    gen = torch.Generator().manual_seed(3)
    for p0 in range(0, h.numel() // ps, cp):
        npages = min(cp, h.numel() // ps - p0)
        rows = d[p0 * ps : (p0 + npages) * ps]
        # backup: device rows -> image; the canaries and every byte the image leaves out stay as they were
        bufs = [torch.full((kernel.chunk_bytes + 2 * PAD,), CANARY, dtype=torch.uint8, device=device) for _ in range(2)]
        _relay(kernel, bufs[0][PAD:-PAD], rows, npages, to_image=True)
        _relay(ref, bufs[1][PAD:-PAD], rows, npages, to_image=True)
        assert torch.equal(bufs[0], bufs[1]), f"backup image of pages {p0}.. differs"
        assert bool((bufs[0][:PAD] == CANARY).all() and (bufs[0][-PAD:] == CANARY).all())
        # load: image -> device rows; rows not in the chunk stay as they were; the image is only read
        image = torch.randint(0, 256, (kernel.chunk_bytes + 2 * PAD,), dtype=torch.uint8, generator=gen).to(device)
        before = _snapshot(pool)
        results = []
        for route in (kernel, ref):
            _restore(pool, before)
            src = image.clone()
            _relay(route, src[PAD:-PAD], rows, npages, to_image=False)
            assert torch.equal(src, image)
            results.append(_snapshot(pool))
        _restore(pool, before)
        for got, want in zip(*results):
            assert torch.equal(got, want), f"load of pages {p0}.. differs"


@pytest.mark.parametrize("layout", ["page_first", "page_head", "layer_first", "page_first_kv_split"])
def test_pool_round_trip_with_kernel_relayout(interpret, monkeypatch, layout):
    """Through the pool: ``direct`` staged (one page per chunk) with the kernel relayout, against ``reference``
    (layer-major host layouts stage into packed page images, :attr:`.staging._Image.compact`)."""
    monkeypatch.setenv("HICACHE_DIRECT_STAGING", "always")
    monkeypatch.setenv("HICACHE_STAGING_BYTES", "1")
    monkeypatch.setenv(relayout.ENV_RELAYOUT, "kernel")
    for case in (SPECS[3], SPECS[7]):
        if _pool(case, layout) is not None:
            pool = check_strategy(REG, case, layout, "direct", strategy="core.direct")
            routes = [sub.staged for *_, plan in pool.binding.scratch["direct.plans"]._slots
                      for sub in plan._subs.values() if sub.staged is not None]
            assert routes and all(r.relayout == "kernel" and r.chunk_pages == 1 for r in routes)
            if layout == "layer_first":  # all-layer routes pack one block per layer
                assert any(im.compact for r in routes for im in r.images)


def test_launches_per_chunk_follow_the_relayout(interpret):
    pool = _pool(SPECS[8], "page_first")  # MLA kv + index_k + index_scale: three row widths
    assert pool is not None
    kernel, ref, _, _ = _routes(pool, None)
    entries = sum(len(im.entries) for im in ref.images)
    assert ref.launches_per_chunk == 2 * entries
    assert kernel.launches_per_chunk == 3  # one launch per segment group
    assert relayout.kernel_relayout(pool.binding, kernel.images) is kernel._kernel  # tables built once per pool
    # chunk sizing: chunks no longer grow with two launches per entry (6 MiB for 3 MLA layers)
    many = _pool(Case("mla-ps1-many", _mla(LayerMap.unsharded(3), 1, 4096)), "page_first")
    assert many is not None
    h = d = torch.arange(4096)
    k = StagedRoute.build(many.binding, h, lambda: d, None, 8 << 20, relayout="kernel")
    t = StagedRoute.build(many.binding, h, lambda: d, None, 8 << 20, relayout="torch")
    assert k is not None and t is not None and (k.launches_per_chunk, t.launches_per_chunk) == (1, 6)
    per_page = 3 * 576
    assert (k.chunk_pages, t.chunk_pages) == ((2 << 20) // per_page, (4 << 20) // per_page)


def test_misaligned_staging_falls_back_to_torch(interpret):
    pool = _pool(SPECS[4], "page_first")
    assert pool is not None
    kernel, ref, _, d = _routes(pool, None)
    ps = pool.spec.page_size
    rows = d[: 2 * ps]
    bufs = []
    for route in (kernel, ref):
        buf = torch.full((kernel.chunk_bytes + 2 * PAD,), CANARY, dtype=torch.uint8)
        route._relayout(buf[1 : 1 + kernel.chunk_bytes], rows, 2, to_image=True)  # 1 byte off the access word
        bufs.append(buf)
    assert kernel._kernel is not None and not kernel._kernel.run(bufs[0][1:], rows, 2, 2, to_image=True)
    assert torch.equal(bufs[0], bufs[1])


def test_kernel_never_strays_out_of_bounds(interpret):
    """Bad device rows read nothing (callers validate; the kernel masks anyway): a gather writes zeros to their image
    slots, never what an earlier transfer staged there; a too-short image is touched nowhere past its end."""
    pool = _pool(SPECS[1], "page_first")
    assert pool is not None
    kernel, ref, _, d = _routes(pool, None)
    n = 2 * pool.spec.page_size
    bad = d[:n].clone()
    bad[0], bad[1] = -1, pool.binding.device_rows + 5
    got = torch.full((kernel.chunk_bytes + 2 * PAD,), CANARY, dtype=torch.uint8)
    want = got.clone()
    assert kernel._kernel is not None and kernel._kernel.run(got[PAD:-PAD], bad, 2, 2, to_image=True)
    ref._relayout(want[PAD:-PAD], d[:n], 2, to_image=True)
    differ = got != want
    assert bool(differ.any()) and bool((got[differ] == 0).all())  # only the two bad rows' slots: zeros
    assert int(differ.sum()) <= 2 * 3 * pool.spec.component("kv").row_bytes
    assert bool((got[:PAD] == CANARY).all()) and bool((got[-PAD:] == CANARY).all())  # nothing outside the image
    short = torch.full_like(got, CANARY)
    half = kernel.chunk_bytes // 2
    assert kernel._kernel.run(short[PAD : PAD + half], d[:n], 2, 2, to_image=True)
    assert bool((short[PAD + half :] == CANARY).all()) and torch.equal(short[: PAD + half // 2], want[: PAD + half // 2])
    before = _snapshot(pool)
    assert kernel._kernel.run(want[PAD:-PAD], bad, 2, 2, to_image=False)
    for r, b in zip(_device_bytes(pool), before):
        assert torch.equal(r, b)  # the image holds these rows' own bytes: nothing else was written


def test_relayout_choice(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert relayout.resolve_relayout(cpu, "auto") == "torch"  # auto takes the kernel on CUDA only
    assert relayout.resolve_relayout(cpu, "kernel") == "kernel"
    assert relayout.resolve_relayout(cuda, "auto") == "torch"  # the interpreter cannot address CUDA memory
    monkeypatch.setenv(relayout.ENV_RELAYOUT, "torch")
    assert relayout.resolve_relayout(cpu) == "torch"
    monkeypatch.setenv(relayout.ENV_RELAYOUT, "sideways")
    with pytest.raises(ConfigError, match="HICACHE_STAGED_RELAYOUT"):
        relayout.resolve_relayout(cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        relayout.resolve_relayout(cpu, "kernel")
    real = relayout.importlib.util.find_spec
    monkeypatch.setattr(relayout.importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    assert relayout.resolve_relayout(cuda, "auto") == "torch"
    with pytest.raises(ConfigError, match="Triton is not installed"):
        relayout.resolve_relayout(cuda, "kernel")


def test_kernel_loaded_compiled_first_still_interprets(monkeypatch):
    """Triton fixes the mode when it decorates: a kernel module imported compiled is not reused interpreted."""
    monkeypatch.setattr(relayout, "_loaded", {})
    monkeypatch.delitem(sys.modules, relayout._KERNEL_MODULE, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    compiled, _ = relayout._kernel()
    assert not relayout._is_interpreted(compiled.relayout_kernel)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    interpreted, _ = relayout._kernel()
    assert relayout._is_interpreted(interpreted.relayout_kernel)
    assert relayout._kernel()[0] is interpreted and sys.modules[relayout._KERNEL_MODULE] is compiled
    pool = _pool(SPECS[1], "page_first_direct")
    kernel, ref, _, d = _routes(pool, None)
    rows = d[: 2 * pool.spec.page_size]
    bufs = [torch.zeros(kernel.chunk_bytes, dtype=torch.uint8) for _ in range(2)]
    _relay(kernel, bufs[0], rows, 2, to_image=True)
    _relay(ref, bufs[1], rows, 2, to_image=True)
    assert torch.equal(*bufs) and bool(bufs[0].any())


def test_a_page_image_larger_than_the_staging_limit_goes_by_plain_runs(monkeypatch):
    """A chunk holds at least one page; where two images of one page would need more than both the budget and the
    default (a page image spanning most of the pool), no staged route is built: ``direct`` moves plain runs, byte for
    byte as the reference backend."""
    from hicache_core.backends import staging as staging_mod

    pool = _pool(SPECS[3], "layer_first")
    assert pool is not None
    b = pool.binding
    per_page = sum(im.span for im in page_images(b, None, False))
    h = torch.arange(2 * pool.spec.page_size)
    d = torch.arange(h.numel())
    assert StagedRoute.build(b, h, lambda: d, None, 1) is not None  # under the default: one page per chunk
    monkeypatch.setattr(staging_mod, "DEFAULT_STAGING_BYTES", 2 * per_page - 1)
    assert StagedRoute.build(b, h, lambda: d, None, 2 * per_page - 1) is None
    assert StagedRoute.build(b, h, lambda: d, None, 2 * per_page) is not None  # a budget that holds it
    monkeypatch.setenv("HICACHE_DIRECT_STAGING", "always")
    monkeypatch.setenv("HICACHE_STAGING_BYTES", "1")
    check_strategy(REG, SPECS[3], "layer_first", "direct", strategy="core.direct")
