"""Tests from a mutation review of the host side of the kernel toolkit (hicache_core.kernel_support, rowcopy,
rowcopy_pages, rowcopy_tma): each kills a mutant the other tests let through.  Transfers are bit-exact against the
reference backend with canary guards around host buffers and device layers; on CPU the kernels run in Triton's
interpreter, so sizes stay small."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import types  # noqa: E402

import pytest  # noqa: E402

from hicache_core import Component, LayerMap, PoolSpec, create_registry  # noqa: E402
from hicache_core.testing.guarded import assert_same_device, guarded_pools, guards_intact  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PIN = DEVICE.type == "cuda"
REGISTRY = create_registry()
GUARD = 64
_sync = torch.cuda.synchronize if PIN else (lambda: None)


def _kv(row: int, *, layers: int = 2, ps: int = 4, cap: int = 8) -> PoolSpec:
    """One ``kv`` row of ``row`` bytes (uint8)."""
    return PoolSpec("mla", (Component("kv", row, torch.uint8),), LayerMap.unsharded(layers), ps, cap, DEVICE)


def _host_bytes(pool) -> dict:
    return {k: t.view(torch.uint8).cpu().clone() for k, t in pool.host_buffers.items()}


def _round_trip(p, h: torch.Tensor, d: torch.Tensor, layer: int) -> None:
    """Backup of every layer and a load of ``layer`` through ``p.pool``'s strategy and the reference's (called
    directly: any slots, not only whole pages): same bytes on both sides, guards intact."""
    p.pool.strategy.backup(p.pool.binding, h.to(DEVICE), d.to(DEVICE), None)
    p.ref.strategy.backup(p.ref.binding, h, d, None)
    _sync()
    assert _host_bytes(p.pool).keys() == _host_bytes(p.ref).keys()
    for k, v in _host_bytes(p.pool).items():
        assert torch.equal(v, _host_bytes(p.ref)[k]), k
    assert guards_intact(p), "guards after backup"
    d2 = torch.flip(d, (0,))  # other device rows: the load moves host rows somewhere new
    p.pool.strategy.load(p.pool.binding, h.to(DEVICE), d2.to(DEVICE), layer)
    p.ref.strategy.load(p.ref.binding, h, d2, layer)
    _sync()
    assert_same_device(p.dev, p.ref_dev)
    assert guards_intact(p), "guards after load"


# -- kernel_support.segment_tables: the access word divides the host layer base ---------------------------------
@pytest.mark.parametrize("lead, word", [(2, 2), (4, 4), (1, 1)])
def test_access_word_divides_the_host_buffer_address(lead, word):
    """Host buffers starting ``lead`` bytes past an aligned address (sizes, strides and device rows all 8-byte
    multiples): the access word shrinks to what the host address allows, and the bytes move exactly (a word that
    ignored the host base would truncate its offset and move every row a few bytes off)."""
    gen = torch.Generator().manual_seed(lead)
    spec = _kv(32)
    p = guarded_pools(REGISTRY, "layer_first", "kernel", spec, gen, pin=PIN, guard=GUARD, lead=lead,
                      dev_guard=GUARD, strategy_options={"tma": False, "pages": False})
    (g,) = p.pool.binding.scratch[p.pool.strategy_name].groups
    assert g.word == word
    h, d = torch.randperm(spec.capacity, generator=gen), torch.randperm(2 * spec.capacity, generator=gen)[:8]
    _round_trip(p, h, d, 1)


def _padded_binding(token: int, page: int, layer: int, *, row: int = 32, ps: int = 4, cap: int = 8, layers: int = 2,
                    gen: torch.Generator):
    """A hand-made host plan for the paged row kernel (``page_first_direct``'s): one ``kv`` segment of ``row``-byte rows at the given host
    token, page and layer strides (bytes; padding between rows), random device rows between canaries."""
    from hicache_core import Addressing, BufferSpec, HostPlan, Segment
    from hicache_core.binding import bind

    spec = _kv(row, layers=layers, ps=ps, cap=cap)
    nbytes = (layers - 1) * layer + (cap // ps - 1) * page + (ps - 1) * token + row
    plan = HostPlan((BufferSpec("kv", (nbytes + 64,), torch.uint8),),
                    (Segment("kv", "kv", None, 0, row, Addressing(0, layer, page, token, row)),))
    host = torch.randint(0, 256, (nbytes + 64,), dtype=torch.uint8, generator=gen).pin_memory() if PIN else \
        torch.randint(0, 256, (nbytes + 64,), dtype=torch.uint8, generator=gen)
    big = [torch.randint(0, 256, (2 * cap * row + 2 * GUARD,), dtype=torch.uint8, generator=gen).to(DEVICE)
           for _ in range(layers)]
    dev = [b[GUARD:GUARD + 2 * cap * row].view(2 * cap, row) for b in big]
    binding = bind(spec, REGISTRY.layout("page_first_direct"), plan, {"kv": host}, {"kv": dev})
    return spec, binding, host, big, dev


@pytest.mark.parametrize("token, page, layer, word", [(36, 144, 288, 4), (32, 132, 264, 4), (32, 128, 260, 4),
                                                      (34, 136, 272, 2)],
                         ids=["token-36", "page-132", "layer-260", "token-34"])
def test_access_word_divides_every_host_stride(token, page, layer, word):
    """Host rows padded so that one host stride (token, page or layer) is not a multiple of 8 bytes while the rows,
    the device rows and the other strides are: the access word divides that stride too, and a backup and a load
    move exactly the bytes the addressing names (a word of 8 would round the stride down and land rows off)."""
    from hicache_page_first.strategy import PageFirstDirectKernelStrategy

    gen = torch.Generator().manual_seed(token + page + layer)
    spec, binding, host, big, dev = _padded_binding(token, page, layer, gen=gen)
    strat = PageFirstDirectKernelStrategy(tma=False, pages=False)
    strat.prepare(binding)
    (g,) = binding.scratch[strat.name].groups
    assert g.word == word
    addr = lambda h, s: h * layer + (s // 4) * page + (s % 4) * token  # noqa: E731
    h, d = torch.tensor([5, 0, 7, 2, 3]), torch.tensor([1, 9, 4, 15, 12])
    before = host.clone()
    strat.backup(binding, h.to(DEVICE), d.to(DEVICE), None)
    _sync()
    want = before.clone()
    for lay in range(2):
        for s, r in zip(h.tolist(), d.tolist()):
            want[addr(lay, s):addr(lay, s) + 32] = dev[lay][r].cpu()
    assert torch.equal(host, want)
    host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8, generator=gen))
    want_dev = [b.cpu().clone() for b in big]
    d2 = torch.tensor([3, 8, 0, 11, 6])
    strat.load(binding, h.to(DEVICE), d2.to(DEVICE), 1)
    _sync()
    for s, r in zip(h.tolist(), d2.tolist()):
        want_dev[1][GUARD + r * 32:GUARD + (r + 1) * 32] = host[addr(1, s):addr(1, s) + 32]
    for b, w in zip(big, want_dev):
        assert torch.equal(b.cpu(), w)


# -- rowcopy_groups._group: members of one group each keep their own anchor's offsets -------------------------------
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_k_and_v_share_a_launch_with_offsets_from_one_anchor(layout):
    """MHA ``k`` and ``v`` (separate device tensors, one launch group): both move exactly through the row kernel,
    each member's device and host offsets shifted to the group's anchor."""
    gen = torch.Generator().manual_seed(3)
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(2), head_num=1, head_dim=8, dtype=torch.float16, page_size=2,
                        capacity=8, device=DEVICE)
    p = guarded_pools(REGISTRY, layout, "kernel", spec, gen, pin=PIN, guard=GUARD, dev_guard=GUARD,
                      strategy_options={"tma": False, "pages": False})
    (g,) = p.pool.binding.scratch[p.pool.strategy_name].groups
    assert g.names == ("k", "v")
    _round_trip(p, torch.tensor([6, 1, 4, 3]), torch.tensor([0, 13, 7, 2]), 1)


# -- kernel_support.segment_tables / rowcopy_groups._group: device indices bounded by the shortest layer ------------
def _uneven_pools(lens: dict[str, list[int]], gen: torch.Generator, layout: str = "layer_first"):
    """MHA ``k``/``v`` device layers of the given row counts (each between canaries), a kernel pool (row kernel) and a
    reference pool on copies of the same bytes."""
    from hicache_core import HostKVPool

    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(2), head_num=1, head_dim=8, dtype=torch.float16, page_size=2,
                        capacity=8, device=DEVICE)
    row = 16
    bigs, dev = [], {}
    for name, ns in lens.items():
        dev[name] = []
        for n in ns:
            b = torch.randint(0, 256, (n * row + 2 * GUARD,), dtype=torch.uint8, generator=gen).to(DEVICE)
            bigs.append(b)
            dev[name].append(b[GUARD:GUARD + n * row].view(n, row).view(torch.float16))
    ref_dev = {k: [t.clone() for t in v] for k, v in dev.items()}
    pool = HostKVPool(spec, layout, "kernel", dev, registry=REGISTRY, pin_memory=PIN,
                      strategy_options={"tma": False, "pages": False})
    ref = HostKVPool(spec, layout, "reference", ref_dev, registry=REGISTRY)
    for name, t in pool.host_buffers.items():
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=gen))
        ref.host_buffers[name].view(torch.uint8).copy_(t.view(torch.uint8))
    return pool, ref, dev, ref_dev, [b.cpu().clone() for b in bigs], bigs


@pytest.mark.parametrize("lens", [{"k": [16, 12], "v": [16, 16]}, {"k": [16, 16], "v": [12, 12]},
                                  {"k": [12, 16], "v": [16, 16]}],
                         ids=["one-short-layer", "one-short-component", "short-anchor-layer"])
def test_device_rows_past_the_shortest_layer_move_nothing(lens):
    """Device layers of unequal lengths: a device row past the shortest layer of the launch group moves nothing in
    either direction (for every layer of the group: the kernel checks one bound), so no row is read or written
    past a short layer's end; the other pairs move as the reference moves them."""
    gen = torch.Generator().manual_seed(sum(sum(v) for v in lens.values()))
    pool, ref, dev, ref_dev, before, bigs = _uneven_pools(lens, gen)
    h, d = torch.tensor([0, 1, 2, 3, 4]), torch.tensor([3, 13, 5, 15, 12])
    ok = d < 12
    pool.strategy.backup(pool.binding, h.to(DEVICE), d.to(DEVICE), None)
    ref.strategy.backup(ref.binding, h[ok], d[ok], None)
    _sync()
    for name, t in ref.host_buffers.items():
        assert torch.equal(pool.host_buffers[name].view(torch.uint8).cpu(), t.view(torch.uint8)), name
    for layer in (0, 1):
        pool.strategy.load(pool.binding, h.to(DEVICE), torch.flip(d, (0,)).to(DEVICE), layer)
        ref.strategy.load(ref.binding, h[torch.flip(ok, (0,))], torch.flip(d, (0,))[torch.flip(ok, (0,))], layer)
    _sync()
    assert_same_device(dev, ref_dev)
    for b, was in zip(bigs, before):  # the canaries around every device layer
        assert torch.equal(b.cpu()[:GUARD], was[:GUARD]) and torch.equal(b.cpu()[-GUARD:], was[-GUARD:])


# -- kernel_support.kernel_indices: kernels read index i at ptr + i ---------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_strided_index_views_on_the_pool_device_are_made_contiguous(dtype):
    """Index tensors already on the pool's device but strided (``t[::2]``, a column of a 2-D tensor): the kernel
    reads what the view holds, not the storage behind it."""
    gen = torch.Generator().manual_seed(5)
    spec = _kv(32)
    p = guarded_pools(REGISTRY, "layer_first", "kernel", spec, gen, pin=PIN, guard=GUARD, dev_guard=GUARD,
                      strategy_options={"tma": False, "pages": False})
    h_store = torch.tensor([[6, 0], [1, 0], [4, 0], [3, 0]], dtype=dtype)  # column 0: the slots
    d_store = torch.tensor([0, 9, 13, 9, 7, 9, 2, 9], dtype=dtype)  # every other element: the rows
    h, d = h_store.to(DEVICE)[:, 0], d_store.to(DEVICE)[::2]
    assert not h.is_contiguous() and not d.is_contiguous()
    p.pool.strategy.backup(p.pool.binding, h, d, None)
    p.ref.strategy.backup(p.ref.binding, h.cpu().contiguous(), d.cpu().contiguous(), None)
    # rows 2, 7, 13, 0: four distinct rows (the strategy is called directly, past the pool's check that refuses a
    # load writing one row twice, whose bytes would depend on the order the GPU writes them)
    p.pool.strategy.load(p.pool.binding, h, torch.flip(d_store.to(DEVICE), (0,))[1::2], 1)
    p.ref.strategy.load(p.ref.binding, h.cpu().contiguous(), torch.flip(d_store, (0,))[1::2].contiguous(), 1)
    _sync()
    for k, v in _host_bytes(p.pool).items():
        assert torch.equal(v, _host_bytes(p.ref)[k]), k
    assert_same_device(p.dev, p.ref_dev)
    assert guards_intact(p)


# -- rowcopy_groups._fusable: parts fuse only where both share the device token stride ------------------------------
@pytest.mark.skipif("page_first_kv_split" not in REGISTRY.layouts, reason="needs the kv_split layout plugin")
def test_parts_right_after_each_other_but_of_other_strides_do_not_fuse():
    """MLA ``rope`` row 0 starts right after ``latent`` row 0 on every layer, but rope rows are half as far apart
    (interleaved into the gaps of the latent rows): fusing them would move rope rows at the latent stride.  Each
    part keeps its own group, and a backup and a load are the reference's."""
    from hicache_core import HostKVPool

    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=16, qk_rope_head_dim=4, dtype=torch.bfloat16,
                        page_size=2, capacity=8, device=DEVICE)
    gen = torch.Generator().manual_seed(4)
    rows, lat, rope, stride = 16, 16, 4, 40  # elements; latent rows 40 apart, rope rows 20 apart from element 16
    bufs = [torch.randn(rows * stride + 64, generator=gen).to(torch.bfloat16).to(DEVICE) for _ in range(2)]
    dev = {"latent": [b.as_strided((rows, lat), (stride, 1)) for b in bufs],
           "rope": [b.as_strided((rows, rope), (stride // 2, 1), lat) for b in bufs]}
    for b in bufs:  # the two parts never share an element
        seen = torch.zeros(b.numel(), dtype=torch.int32)
        for x in (b.as_strided((rows, lat), (stride, 1)), b.as_strided((rows, rope), (stride // 2, 1), lat)):
            idx = (torch.arange(x.shape[0]).unsqueeze(1) * x.stride(0) + torch.arange(x.shape[1]) +
                   x.storage_offset())
            seen[idx.reshape(-1)] += 1
        assert int(seen.max()) == 1
    ref_bufs = [b.clone() for b in bufs]
    ref_dev = {"latent": [b.as_strided((rows, lat), (stride, 1)) for b in ref_bufs],
               "rope": [b.as_strided((rows, rope), (stride // 2, 1), lat) for b in ref_bufs]}
    pool = HostKVPool(spec, "page_first_kv_split", "kernel", dev, registry=REGISTRY, pin_memory=PIN,
                      strategy_options={"tma": False, "pages": False, "fuse_parts": True})
    ref = HostKVPool(spec, "page_first_kv_split", "reference", ref_dev, registry=REGISTRY)
    assert all(g.split == g.width for g in pool.binding.scratch[pool.strategy_name].groups)
    for p in (pool, ref):
        for t in p.host_buffers.values():
            t.view(torch.uint8).fill_(0xA5)
    h, d = torch.tensor([0, 1, 6, 7]), torch.tensor([3, 12, 5, 8])
    pool.strategy.backup(pool.binding, h.to(DEVICE), d.to(DEVICE), None)
    ref.strategy.backup(ref.binding, h, d, None)
    _sync()
    for name, t in ref.host_buffers.items():
        assert torch.equal(pool.host_buffers[name].view(torch.uint8).cpu(), t.view(torch.uint8)), name
    pool.strategy.load(pool.binding, h.to(DEVICE), torch.tensor([1, 14, 10, 0]).to(DEVICE), 0)
    ref.strategy.load(ref.binding, h, torch.tensor([1, 14, 10, 0]), 0)
    _sync()
    for b, r in zip(bufs, ref_bufs):
        assert torch.equal(b.cpu().view(torch.uint8), r.cpu().view(torch.uint8))


# -- rowcopy._prepare_pages / rowcopy_launch._route: page load launch shape -----------------------------------------
def test_page_loads_launch_a_program_per_part_page_and_entry(monkeypatch):
    """Pages read in several parts: with a budget above the work, a page load's grid is pages x parts x entries (a
    layer: one entry; every layer: three), ``PAGE_TOKENS`` the next power of two of the page and the gather tile no
    taller than it; bit-exact."""
    from hicache_core import kernel_lib as kl
    from hicache_core.launch import Launcher
    from hicache_core.rowcopy_pages import pieces

    log, real = [], Launcher.__call__

    def counting(self, grid, args, **kw):
        log.append((self.kernel, grid, dict(zip(self.arg_names, args))))
        real(self, grid, args, **kw)
    monkeypatch.setattr(Launcher, "__call__", counting)
    gen = torch.Generator().manual_seed(2)
    for ps, pt in ((4, 4), (3, 4)):
        spec = PoolSpec.mla(layer_map=LayerMap.unsharded(3), kv_lora_rank=64, qk_rope_head_dim=8, dtype=torch.bfloat16,
                            page_size=ps, capacity=ps * 4, device=DEVICE)
        p = guarded_pools(REGISTRY, "layer_first", "kernel", spec, gen, pin=PIN, guard=GUARD, dev_guard=GUARD,
                          strategy_options={"tma": False, "pages": True, "tile_bytes": 64, "programs": 512})
        (g,) = p.pool.binding.scratch[p.pool.strategy_name].groups
        part, parts, *_ = pieces(ps * g.width, 64 // g.word, g.vec)
        assert parts > 1
        h = torch.cat([torch.arange(2 * ps, 3 * ps), torch.arange(0, ps)])
        d = torch.arange(5 * ps, 7 * ps)
        for layer, ents in ((1, 1), (None, 3)):
            log.clear()
            p.pool.strategy.load(p.pool.binding, h.to(DEVICE), d.to(DEVICE), layer)
            p.ref.strategy.load(p.ref.binding, h, d, layer)
            _sync()
            ((kernel, grid, values),) = log
            assert kernel is kl.PAGE_LOAD and (values["PART"], values["PARTS"]) == (part, parts)
            assert grid == 2 * parts * ents, (ps, layer)
            assert values["PAGE_TOKENS"] == pt and values["TOKENS"] <= pt
            assert_same_device(p.dev, p.ref_dev)
        assert guards_intact(p)
    # default tiles: the row kernel's tile would be far taller than a page; the gather pass keeps to one page
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(1), kv_lora_rank=64, qk_rope_head_dim=8, dtype=torch.bfloat16,
                        page_size=4, capacity=8, device=DEVICE)
    p = guarded_pools(REGISTRY, "layer_first", "kernel", spec, gen, pin=PIN,
                      strategy_options={"tma": False, "pages": True})
    prep = p.pool.binding.scratch[p.pool.strategy_name]
    ((lv, _),) = prep.pages[0]
    values = dict(zip(prep.page_launcher.arg_names, lv.args))
    assert (values["TOKENS"], values["PAGE_TOKENS"]) == (4, 4)


# -- rowcopy_launch._route: TMA plans are per layer -----------------------------------------------------------------
@pytest.mark.parametrize("pages", [True, False])
def test_load_all_layers_with_tma_plans_moves_every_layer(pages):
    """Forced TMA (the interpreter emulates descriptors): per-layer loads go through the TMA kernel, and a load of
    every layer (which TMA plans do not cover) still moves every layer through the page or row kernel, exactly."""
    from hicache_core import kernel_lib as kl
    from hicache_core.launch import Launcher

    gen = torch.Generator().manual_seed(6)
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(2), head_num=2, head_dim=16, dtype=torch.float16, page_size=16,
                        capacity=32, device=DEVICE)
    p = guarded_pools(REGISTRY, "layer_first", "kernel", spec, gen, pin=PIN, guard=GUARD, dev_guard=GUARD,
                      strategy_options={"tma": True, "pages": pages})
    prep = p.pool.binding.scratch[p.pool.strategy_name]
    assert prep.tma and all(t is not None for t in prep.tma)
    h, d = torch.arange(16, 32), torch.arange(40, 56)
    kernels = []
    real = Launcher.__call__

    def counting(self, grid, args, **kw):
        kernels.append(self.kernel)
        return real(self, grid, args, **kw)
    import unittest.mock
    with unittest.mock.patch.object(Launcher, "__call__", counting):
        p.pool.load_all_layers(h.to(DEVICE), d.to(DEVICE))
        p.ref.load_all_layers(h, d)
        _sync()
        assert_same_device(p.dev, p.ref_dev)
        assert kernels and kl.PAGED_TMA_LOAD not in kernels
        assert p.pool.strategy.launch_grid(p.pool.binding, 16, None, to_host=False) > 0
        kernels.clear()
        p.pool.load_layer(1, h.to(DEVICE), torch.flip(d, (0,)).to(DEVICE))
        p.ref.load_layer(1, h, torch.flip(d, (0,)))
        _sync()
        assert_same_device(p.dev, p.ref_dev)
        assert kernels == [kl.PAGED_TMA_LOAD]
    assert guards_intact(p)


# -- rowcopy_pages.group_reason / rowcopy_tma.group_reason: bounds, on hand-made groups -----------------------------
def _fake_group(width: int, *, word: int = 8, split: int | None = None, tok: int | None = None,
                page: int | None = None, dev_stride: int | None = None, off: int = 0, entries: int = 1):
    """What the group checks read of a :class:`~hicache_core.rowcopy.RowGroup`: widths (words), per-entry tables,
    an anchor and host buffers (one small real tensor: addresses only)."""
    t = lambda v: torch.full((entries,), v, dtype=torch.int64)  # noqa: E731
    tok = width if tok is None else tok
    tables = {"host_tok": t(tok), "host_page": t(page if page is not None else 16 * tok), "host_off": t(off),
              "dev_stride": t(width if dev_stride is None else dev_stride), "dev_off": t(0)}
    tables |= {k + "_b": v for k, v in tables.items() if k.startswith("host")}
    host = torch.zeros(64, dtype=torch.int64)
    return types.SimpleNamespace(width=width, split=width if split is None else split, word=word, tables=tables,
                                 anchor=host, hosts=(host,) * entries, vec=1)


def test_page_group_reason_automatic_floor():
    """Automatic page loads take a group only where a page of every host part holds AUTO_MIN_PART_BYTES: exactly
    that is taken, a byte less is not; a fused group's smaller part decides; pages=True ignores the floor."""
    from hicache_core.rowcopy_pages import AUTO_MIN_PART_BYTES, group_reason

    words = AUTO_MIN_PART_BYTES // 8 // 16  # 8-byte words per row in pages of 16 rows of exactly the floor
    assert group_reason(_fake_group(words, page=words * 16), 16, automatic=True) is None
    g = _fake_group(words, word=4, tok=words, page=words * 16)  # 4-byte words: half the bytes
    assert f"under the {AUTO_MIN_PART_BYTES}" in group_reason(g, 16, automatic=True)
    assert group_reason(g, 16) is None
    fused = _fake_group(words + 1, split=words, tok=words, page=words * 16)  # parts of `words` and 1 word
    fused.tables["host_tok_b"] = torch.tensor([1])
    fused.tables["host_page_b"] = torch.tensor([16])
    why = group_reason(fused, 16, automatic=True)
    assert "8-byte parts (of rows split over two host buffers) holds 128 bytes" in why, why
    assert group_reason(fused, 16) is None
    first = _fake_group(words + 1, split=1, tok=1, page=16)  # the small part first: parts of 1 and `words` words
    first.tables["host_tok_b"] = torch.tensor([words])
    first.tables["host_page_b"] = torch.tensor([words * 16])
    assert "8-byte parts" in group_reason(first, 16, automatic=True) and group_reason(first, 16) is None
    odd = _fake_group(words, page=words * 7)  # pages of 7 rows: the bytes of 7 rows, not of a power of two
    assert f"{words * 8}-byte rows holds {7 * words * 8} bytes" in group_reason(odd, 7, automatic=True)
    # a group refused for its layout is refused for that, not sent to pages=True
    unpacked = _fake_group(1, tok=2, page=32)
    assert "not packed" in group_reason(unpacked, 16, automatic=True)


def test_page_group_reason_bounds():
    from hicache_core.rowcopy_pages import MAX_PAGE_TOKENS, group_reason

    assert group_reason(_fake_group(8, page=8 * MAX_PAGE_TOKENS), MAX_PAGE_TOKENS) is None
    assert "more than 1024 tokens" in group_reason(_fake_group(8, page=8 * 2048), MAX_PAGE_TOKENS + 1)
    assert "more than 1024 tokens" in group_reason(_fake_group(8, page=8 * 4096), 2 * MAX_PAGE_TOKENS + 1)
    # a page of 2**31 words is refused, one word less is not (the kernel's in-page offsets are int32)
    assert "2**31 words" in group_reason(_fake_group(1 << 21, page=1 << 31), 1024)
    assert group_reason(_fake_group((1 << 21) - 1, page=1 << 31), 1024) is None
    # packed host rows only: a padded token stride or pages closer than a page of rows keep the row kernel
    assert "not packed" in group_reason(_fake_group(8, tok=9, page=9 * 16), 16)
    assert "page stride is shorter" in group_reason(_fake_group(8, page=8 * 16 - 1), 16)
    assert group_reason(_fake_group(8, page=8 * 16), 16) is None
    assert "no STRIDED" in group_reason(_fake_group(8, page=8 * 16, dev_stride=9), 16, strided_ok=False)
    # a fused group: the second part's tables are checked too
    g = _fake_group(12, split=8, tok=8, page=8 * 16)
    g.tables["host_tok_b"] = torch.tensor([4])
    g.tables["host_page_b"] = torch.tensor([4 * 16 - 1])
    assert "page stride is shorter" in group_reason(g, 16)
    g.tables["host_page_b"] = torch.tensor([4 * 16])
    assert group_reason(g, 16) is None


def test_tma_group_reason_bounds():
    from hicache_core.rowcopy import Tuning
    from hicache_core.rowcopy_tma import AUTO_MIN_ROW_BYTES, group_reason

    t = Tuning(programs=4, num_warps=4, tile_bytes=1 << 16, stages=2)
    assert group_reason(_fake_group(2, word=8), 64, 16, t) is None  # 16-byte rows: one 16-byte box
    assert "narrower than a 16-byte box" in group_reason(_fake_group(2, word=4), 64, 16, t)
    # the host page stride: a whole multiple, at least page_size, of the token stride
    assert group_reason(_fake_group(4, tok=4, page=4 * 18), 64, 16, t) is None
    assert "whole multiple" in group_reason(_fake_group(4, tok=4, page=4 * 16 + 2), 64, 16, t)
    assert "whole multiple" in group_reason(_fake_group(4, tok=4, page=4 * 14), 64, 16, t)
    assert "not multiples of 16 bytes" in group_reason(_fake_group(4, tok=4, page=64, off=1), 64, 16, t)
    # descriptor rows must stay below 2**31 (uniformly strided slots: one row per slot of the capacity)
    assert group_reason(_fake_group(4, tok=4, page=4 * 16), (1 << 31) - 16, 16, t) is None
    assert "32-bit descriptor coordinates" in group_reason(_fake_group(4, tok=4, page=4 * 16), 1 << 31, 16, t)
    assert group_reason(_fake_group(4, tok=4, page=4 * 32), 1 << 30, 16, t) is None  # 2**31 - 16 rows
    assert "32-bit descriptor coordinates" in group_reason(_fake_group(4, tok=4, page=4 * 32), (1 << 30) + 16, 16, t)
    # boxes of at least MIN_TOKENS rows: 16-byte rows in 64-byte tiles give 4
    assert "fewer than 8 rows within tile_bytes" in group_reason(_fake_group(2, page=2 * 16), 64, 16,
                                                                replace_tile(t, 64))
    # automatic: rows of exactly AUTO_MIN_ROW_BYTES are taken
    w = AUTO_MIN_ROW_BYTES // 8
    assert group_reason(_fake_group(w, page=w * 64), 1024, 64, replace_tile(t, 1 << 20), automatic=True) is None


def replace_tile(t, tile_bytes):
    from dataclasses import replace
    return replace(t, tile_bytes=tile_bytes)


@pytest.mark.parametrize("page_words, max_part, vec, want", [
    (31, 16, 1, (16, 1, 8, 4, 2, 1)),  # a rest of four bits: three pieces and a one-word tail
    (62, 32, 2, (32, 1, 16, 8, 4, 2)),
    (23, 16, 1, (16, 1, 4, 2, 1, 0)),  # the rest is exactly three pieces: no tail
    (29, 8, 1, (8, 3, 4, 1, 0, 0)),
])
def test_pieces_tail_is_the_smallest_power_of_two_left(page_words, max_part, vec, want):
    from hicache_core.rowcopy_pages import pieces

    assert pieces(page_words, max_part, vec) == want


def test_box_rows_fill_the_shared_memory_of_stages_minus_one_buffers():
    """``stages`` bulk copies in flight keep ``stages - 1`` boxes buffered: 2 KiB rows at 2 stages fill 64 rows
    (128 KiB <= SMEM_BYTES), at 3 stages 32."""
    from hicache_core.rowcopy_tma import SMEM_BYTES, box_shape

    assert box_shape(256, 8, 1024, 1 << 20, stages=2) == (256, 0, 64) and 64 * 2048 <= SMEM_BYTES
    assert box_shape(256, 8, 1024, 1 << 20, stages=3) == (256, 0, 32)
    assert box_shape(256, 8, 1024, 1 << 20, stages=1) == (256, 0, 64)


def test_tma_descriptors_start_at_the_host_layer_of_a_buffer_view():
    """Host buffers that start 16 bytes into their allocation (a view, aligned enough for TMA): every descriptor's
    base is the layer's first slot in the view, so a forced-TMA per-layer load is the reference's."""
    from hicache_core import kernel_lib as kl
    from hicache_core.launch import Launcher

    gen = torch.Generator().manual_seed(12)
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(2), head_num=2, head_dim=16, dtype=torch.float16, page_size=16,
                        capacity=32, device=DEVICE)
    for layout in ("layer_first", "page_first_direct"):
        p = guarded_pools(REGISTRY, layout, "kernel", spec, gen, pin=PIN, guard=GUARD, lead=16, dev_guard=GUARD,
                          strategy_options={"tma": True})
        assert all(t is not None for t in p.pool.binding.scratch[p.pool.strategy_name].tma)
        kernels, real = [], Launcher.__call__

        def counting(self, grid, args, **kw):
            kernels.append(self.kernel)
            return real(self, grid, args, **kw)
        import unittest.mock
        h, d = torch.tensor([16 + i for i in range(16)] + list(range(16))), torch.randperm(64, generator=gen)[:32]
        with unittest.mock.patch.object(Launcher, "__call__", counting):
            for layer in (0, 1):
                p.pool.load_layer(layer, h.to(DEVICE), d.to(DEVICE))
                p.ref.load_layer(layer, h, d)
        _sync()
        assert kernels and set(kernels) == {kl.PAGED_TMA_LOAD}
        assert_same_device(p.dev, p.ref_dev)
        assert guards_intact(p)


def test_tma_row_limit_and_box_bytes():
    """Automatic TMA: any host token stride other than the row (even one word of padding) limits calls to
    AUTO_MAX_STRIDED_ROWS; a box's bytes count its padded tail box (1600-byte rows: 1024 + 1024, 8 rows = 16 KiB)."""
    from hicache_core.rowcopy import Tuning
    from hicache_core.rowcopy_tma import AUTO_MAX_STRIDED_ROWS, group_reason, row_limit

    assert row_limit(_fake_group(144, tok=145), automatic=True) == AUTO_MAX_STRIDED_ROWS
    assert row_limit(_fake_group(144), automatic=True) is None and row_limit(_fake_group(144, tok=145),
                                                                              automatic=False) is None
    t = Tuning(programs=4, num_warps=4, tile_bytes=1 << 20, stages=1)
    assert group_reason(_fake_group(200, page=200 * 8), 64, 8, t, automatic=True) is None


def test_tma_pairs_only_entries_of_the_same_slot_addressing():
    """A hand-made plan: ``k`` slots uniformly strided (FLAT), ``v`` pages 2 rows apart (paged), one launch group:
    a per-layer TMA load gives each its own launch (a pair shares one FLAT) and moves exactly the addressed bytes."""
    from hicache_core import Addressing, BufferSpec, HostPlan, Segment
    from hicache_core.binding import bind
    from hicache_page_first.strategy import PageFirstDirectKernelStrategy

    gen = torch.Generator().manual_seed(14)
    ps, cap, row, layers = 8, 16, 32, 2
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(layers), head_num=1, head_dim=16, dtype=torch.float16,
                        page_size=ps, capacity=cap, device=DEVICE)
    pages = {"k": ps * row, "v": (ps + 2) * row}
    layer_bytes = {k: (cap // ps) * p for k, p in pages.items()}
    plan = HostPlan(tuple(BufferSpec(k, (layers * layer_bytes[k],), torch.uint8) for k in pages),
                    tuple(Segment(k, k, None, 0, row, Addressing(0, layer_bytes[k], pages[k], row, row))
                          for k in pages))
    host = {k: torch.randint(0, 256, (layers * layer_bytes[k],), dtype=torch.uint8, generator=gen) for k in pages}
    if PIN:
        host = {k: v.pin_memory() for k, v in host.items()}
    dev = {k: [torch.randint(0, 256, (2 * cap, row), dtype=torch.uint8, generator=gen).to(DEVICE).view(torch.float16)
               for _ in range(layers)] for k in pages}
    binding = bind(spec, REGISTRY.layout("page_first_direct"), plan, host, dev)
    strat = PageFirstDirectKernelStrategy(tma=True, pages=False)
    strat.prepare(binding)
    prep = binding.scratch[strat.name]
    assert len(prep.groups) == 1 and prep.tma[0] is not None
    assert [len(v) for v in prep.tma[0].values()] == [2, 2]  # k and v apart: they differ in FLAT
    want = {k: [t.view(torch.uint8).cpu().clone() for t in v] for k, v in dev.items()}
    h, d = torch.arange(cap), torch.randperm(2 * cap, generator=gen)[:cap]
    strat.load(binding, h.to(DEVICE), d.to(DEVICE), 1)
    _sync()
    for k in pages:
        for s, r in zip(h.tolist(), d.tolist()):
            at = layer_bytes[k] + (s // ps) * pages[k] + (s % ps) * row
            want[k][1][r] = host[k][at:at + row]
        for lay in range(layers):
            assert torch.equal(dev[k][lay].view(torch.uint8).cpu(), want[k][lay]), (k, lay)
