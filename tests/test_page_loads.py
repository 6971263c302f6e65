"""Page loads of the row-copy strategies (hicache_core.rowcopy_pages, kernel_lib.PAGE_LOAD): whole pages copied as
flat words, bit-exact against the reference backend; pages whose slots or rows are not runs gathered row by row;
out-of-range pairs move nothing; which groups take it; the pieces a page is read in; the switch.  On CPU the
kernels run in Triton's interpreter."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from hicache_kv_split import kernels as kv_split_kernels  # noqa: E402

from hicache_core import HostKVPool, LayerMap, PoolSpec, create_registry, kernel_lib as kl, rowcopy_pages  # noqa: E402
from hicache_core.errors import ConfigError, ResolutionError  # noqa: E402
from hicache_core.rowcopy_pages import ENV_PAGES, pages_enabled, pages_mode, pieces  # noqa: E402
from hicache_core.testing.guarded import assert_same_device as _same, guarded_pools, guards_intact  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PIN = DEVICE.type == "cuda"
REGISTRY = create_registry()
_sync = torch.cuda.synchronize if PIN else (lambda: None)
GUARD = 256


def _spec(kind: str, ps: int, pages: int, layers: int = 3) -> PoolSpec:
    if kind == "mha":
        return PoolSpec.mha(layer_map=LayerMap.unsharded(layers), head_num=2, head_dim=8, dtype=torch.float16,
                            page_size=ps, capacity=ps * pages, device=DEVICE)
    return PoolSpec.mla(layer_map=LayerMap.unsharded(layers), kv_lora_rank=64, qk_rope_head_dim=8,
                        dtype=torch.bfloat16, page_size=ps, capacity=ps * pages, device=DEVICE)


def _pools(layout: str, spec: PoolSpec, gen: torch.Generator, **opts):
    """A kernel pool (TMA off; page loads wherever a group allows them, whatever its pages' size, unless ``opts``
    say otherwise; host buffers and device layers between ``GUARD`` canary bytes) and the reference on the same
    bytes."""
    p = guarded_pools(REGISTRY, layout, "kernel", spec, gen, pin=PIN, guard=GUARD, dev_guard=GUARD,
                      strategy_options={"tma": False, "pages": True, **opts})
    return p, p.pool, p.ref, p.dev, p.ref_dev


def _cases(spec: PoolSpec, gen: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(host slots, device rows): whole pages to page runs; pages whose whole host or device run is out of range,
    or crosses the end of the device rows; runs starting 2**63 - page_size (a bound checked through a sum would
    wrap); whole pages to scattered rows; page-long runs starting mid-page; one page whose device rows are a run
    but for one row; a last page cut short; whole pages with one slot and one row out of range."""
    ps, cap = spec.page_size, spec.capacity
    ar = torch.arange(ps)
    hp = torch.randperm(cap // ps, generator=gen)[: cap // ps - 1]
    dp = torch.randperm(2 * cap // ps - 2, generator=gen)[: hp.numel()]  # the last two device pages: far_d's
    whole = (hp.unsqueeze(1) * ps + ar).reshape(-1)
    runs = (dp.unsqueeze(1) * ps + ar).reshape(-1)
    one_off = runs.clone()
    taken = set(runs.tolist())
    one_off[ps + ps // 2] = next(r for r in range(2 * cap) if r not in taken)  # a row no other pair writes
    out_h, out_d = whole.clone(), runs.clone()
    out_h[1] = cap + 2  # the first page: one slot out of range (that pair moves nothing, the rest is gathered)
    out_d[-1] = 2 * cap + 5  # the last page: one row out of range
    far_h, far_d = whole.clone(), runs.clone()  # whole runs out of range: their first slot / row too
    far_h[:ps] = cap + ar  # a host run just past the capacity
    far_d[ps:2 * ps] = 2 * cap - ps // 2 - 1 + ar  # a device run crossing the end of the device rows
    wrap_h, wrap_d = whole.clone(), runs.clone()  # runs whose end would wrap a 64-bit sum past the bounds
    wrap_h[:ps] = 2**63 - ps + ar
    wrap_d[ps:2 * ps] = 2**63 - ps + ar
    return {"whole-to-runs": (whole, runs),
            "runs-out-of-range": (far_h, far_d),
            "runs-near-2**63": (wrap_h, wrap_d),
            "whole-to-scattered": (whole, torch.randperm(2 * cap, generator=gen)[: whole.numel()]),
            "mid-page-runs": ((whole + ps // 2) % cap, runs),
            "one-row-off": (whole, one_off),
            "last-page-partial": (whole[:-1], runs[:-1]),  # a strategy called directly: no page-multiple check
            "out-of-range": (out_h, out_d)}


@pytest.mark.parametrize("layout,kind", [("layer_first", "mla"), ("page_first_direct", "mla"),
                                         ("page_first_kv_split", "mha"), ("layer_first", "mha"),
                                         ("page_first_kv_split", "mla")])
@pytest.mark.parametrize("ps,tile_bytes,grouped", [(16, 65536, True), (16, 65536, False), (7, 512, False),
                                                   (7, 128, False), (2, 32, False), (2, 8, False)],
                         ids=["ps16-pages-per-item", "ps16-one-page-items", "ps7-pieces-tail", "ps7-parts",
                              "ps2-parts", "ps2-parts-of-one-vector"])
def test_page_loads_are_bit_exact(monkeypatch, launches, layout, kind, ps, tile_bytes, grouped):
    """Per-layer and all-layer loads through the page kernel (pages read in several parts and pieces where
    ``tile_bytes`` is small; these pages of at most 2304 bytes several per work item where ``grouped``, a group of
    them cut short by the end of the call's pages), against the reference: rows outside the indices, rows of pairs
    out of range and the canaries around the host buffers stay as they were."""
    if not grouped:  # (by default small pages go several per work item)
        monkeypatch.setattr(rowcopy_pages, "GROUP_BYTES", 0)
    gen = torch.Generator().manual_seed(ps * 31 + tile_bytes)
    spec = _spec(kind, ps, 4)  # 3 pages per case: a first, a middle and a last one
    guarded, pool, ref, dev, ref_dev = _pools(layout, spec, gen, tile_bytes=tile_bytes)
    prep = pool.binding.scratch[pool.strategy_name]
    assert prep.pages and all(p is not None for p in prep.pages), "every group of this layout takes page loads"
    for i, (name, (h, d)) in enumerate(_cases(spec, gen).items()):
        ok = (h >= 0) & (h < spec.capacity) & (d >= 0) & (d < 2 * spec.capacity)
        launches.clear()
        layer = i % 3  # each case on one layer (the cases cover every layer; the interpreter is slow)
        pool.strategy.load(pool.binding, h.to(DEVICE), d.to(DEVICE), layer)
        ref.strategy.load(ref.binding, h[ok], d[ok], layer)
        _sync()
        assert launches and all(k is kl.PAGE_LOAD for k, _, _ in launches), name
        assert all((v["GROUP"] > 1) is grouped for _, _, v in launches), [v["GROUP"] for _, _, v in launches]
        _same(dev, ref_dev)
        assert guards_intact(guarded), f"{name}: guards"
    dev_h, dev_d = _cases(spec, gen)["whole-to-runs"]  # fresh pages: every layer in one call
    launches.clear()
    pool.load_all_layers(dev_h.to(DEVICE), dev_d.to(DEVICE))
    ref.load_all_layers(dev_h, dev_d)
    _sync()
    assert launches and all(k is kl.PAGE_LOAD for k, _, _ in launches)
    _same(dev, ref_dev)


def test_launch_values_and_grid(launches):
    """One launch per group, its pieces those of :func:`pieces` for the group's page, a grid of at most
    ``programs`` covering pages x parts x entries; pages of 7 rows of 144 bytes at 512-byte parts use every piece."""
    gen = torch.Generator().manual_seed(3)
    spec = _spec("mla", 7, 6)
    _, pool, ref, dev, ref_dev = _pools("layer_first", spec, gen, tile_bytes=512, programs=5)
    (g,) = pool.binding.scratch[pool.strategy_name].groups
    h, d = _cases(spec, gen)["whole-to-runs"]
    pool.load_layer(1, h.to(DEVICE), d.to(DEVICE))
    ref.load_layer(1, h, d)
    _sync()
    _same(dev, ref_dev)
    ((kernel, grid, values),) = launches
    want = pieces(7 * g.width, 512 // g.word, g.vec)
    assert kernel is kl.PAGE_LOAD and all(want[2:]), want  # R1..R4 all present, R4 masked
    assert tuple(values[k] for k in ("PART", "PARTS", "R1", "R2", "R3", "R4")) == want
    assert grid == min(5, h.numel() // 7 * want[1])


def test_split_rows_load_each_host_part_on_its_own(monkeypatch, launches):
    """A fused group (MLA latent + rope in two host buffers) loads through one page launch per host part: the
    part's width, its column in the device row, its host tables, device rows stored row by row (``STRIDED``),
    each grid covering pages x parts x entries; a layer_first group of whole rows stays unstrided."""
    monkeypatch.setattr(rowcopy_pages, "GROUP_BYTES", 8192)
    gen = torch.Generator().manual_seed(5)
    spec = _spec("mla", 8, 6)
    _, pool, ref, dev, ref_dev = _pools("page_first_kv_split", spec, gen, programs=64)
    (g,) = pool.binding.scratch[pool.strategy_name].groups
    assert g.split < g.width  # latent, then rope
    h, d = _cases(spec, gen)["whole-to-runs"]
    pool.load_layer(1, h.to(DEVICE), d.to(DEVICE))
    ref.load_layer(1, h, d)
    _sync()
    _same(dev, ref_dev)
    assert [k for k, _, _ in launches] == [kl.PAGE_LOAD, kl.PAGE_LOAD]
    (_, grid_a, a), (_, grid_b, b) = launches
    assert (a["WIDTH"], b["WIDTH"]) == (g.split, g.width - g.split) and a["STRIDED"] and b["STRIDED"]
    assert torch.equal(b["dev_off"], g.tables["dev_off"] + g.split) and torch.equal(a["dev_off"], g.tables["dev_off"])
    for name in ("host_off", "host_page", "host_tok"):
        assert torch.equal(a[name], g.tables[name]) and torch.equal(b[name], g.tables[name + "_b"])
    pages = h.numel() // 8
    # 8-row pages of 128-byte latents and 16-byte ropes: 1 KiB and 128 bytes, 8 and 64 per work item (pages of 8
    # positions: at most 128 of them per item), each read whole
    assert (a["GROUP"], b["GROUP"]) == (8, 64) and (a["PARTS"], b["PARTS"]) == (1, 1)
    assert (a["PART"], b["PART"]) == (g.split * 8, (g.width - g.split) * 8)
    assert (grid_a, grid_b) == (1, 1)  # one entry per layer, its 5 pages one item
    launches.clear()
    _, pool, *_ = _pools("layer_first", spec, gen)
    pool.load_layer(1, h.to(DEVICE), d.to(DEVICE))
    ((_, _, values),) = launches
    assert values["STRIDED"] is False


def test_a_page_kernel_without_strided_keeps_the_row_kernel_for_split_rows(monkeypatch, caplog, launches):
    """A plugin's own page kernel written for packed device rows (no ``STRIDED`` parameter) is never handed rows
    it would store as packed: those groups keep the row kernel (logged), bit-exact."""
    @triton.jit
    def packed_only(anchor, host_idx, dev_idx, n, WIDTH: tl.constexpr):  # never launched here
        pass
    monkeypatch.setattr(kv_split_kernels, "PAGE_LOAD_KERNEL", packed_only)
    gen = torch.Generator().manual_seed(21)
    spec = _spec("mla", 4, 6)
    with caplog.at_level("INFO", logger="hicache_core.rowcopy"):
        _, pool, ref, dev, ref_dev = _pools("page_first_kv_split", spec, gen)
    assert pool.binding.scratch[pool.strategy_name].pages == (None,)
    assert "takes no STRIDED" in caplog.text
    _row_kernel_load(launches, spec, gen, pool, ref, dev, ref_dev, 1)


@pytest.mark.parametrize("page_words,max_part,vec", [(5248, 8192, 2), (126, 16, 1), (126, 64, 2), (54, 64, 2),
                                                     (1, 4, 1), (4096, 8192, 2), (9216, 1024, 4), (996, 100, 4),
                                                     (36, 1, 4), (20, 2, 4)])
def test_pieces_cover_the_page(page_words, max_part, vec):
    """Parts and pieces are powers of two (0: none) that add up to the page, the masked tail at most doubling the
    last bit of it; a 64 x 656-byte page in 8-byte words is 32 + 8 + 1 KiB."""
    part, parts, r1, r2, r3, r4 = pieces(page_words, max_part, vec)
    for x in (part, r1, r2, r3, r4):
        assert x == 0 or (x & (x - 1) == 0 and x % vec == 0)  # powers of two, every piece on a vec boundary
    assert part <= max(max_part, vec) and parts >= 1
    exact = parts * part + r1 + r2 + r3
    assert exact <= page_words <= exact + r4 and (r4 == 0) == (exact == page_words)
    assert r4 == 0 or r4 >= vec and r4 < 2 * max(vec, page_words - exact)
    assert r1 >= r2 >= r3 and (r1 == 0 or r1 < part)
    if (page_words, max_part) == (5248, 8192):
        assert (part, parts, r1, r2, r3, r4) == (4096, 1, 1024, 128, 0, 0)
    with pytest.raises(ValueError, match="positive"):
        pieces(0, max_part, vec)
    with pytest.raises(ValueError, match="dividing page_words"):
        pieces(page_words, max_part, 3)


@pytest.mark.parametrize("page_words,word,page_tokens,tile_bytes,want", [
    (256, 4, 16, 65536, 8),  # 1 KiB pages: 8 per item of 8 KiB
    (576, 4, 16, 65536, 2),  # 2304 bytes, padded to 4 KiB: 2
    (1024, 4, 16, 65536, 2),  # 4 KiB: 2
    (1025, 4, 16, 65536, 1),  # padded to 8 KiB: one per item
    (2048, 4, 64, 65536, 1),  # 8 KiB: one per item, as before
    (256, 4, 16, 2048, 2),  # tile_bytes under GROUP_BYTES bounds the item
    (256, 4, 16, 1024, 1),
    (8, 2, 2, 65536, 512),  # 16-byte pages of 2 positions: at most 1024 positions checked per item
    (8, 2, 512, 65536, 2),
    (8, 2, 1024, 65536, 1),
])
def test_group_pages(monkeypatch, page_words, word, page_tokens, tile_bytes, want):
    """With ``GROUP_BYTES`` at 8192 (the default), small pages go several per work item, up to ``GROUP_BYTES`` (or
    ``tile_bytes``) of padded pages and ``MAX_PAGE_TOKENS`` positions of index checks; pages of more than half of
    that one per item.  At 0 every page is its own item."""
    assert rowcopy_pages.GROUP_BYTES == 8192
    assert rowcopy_pages.group_pages(page_words, word, page_tokens, tile_bytes) == want
    monkeypatch.setattr(rowcopy_pages, "GROUP_BYTES", 0)
    assert rowcopy_pages.group_pages(page_words, word, page_tokens, tile_bytes) == 1
    with pytest.raises(ValueError, match="must be positive"):
        rowcopy_pages.group_pages(0, word, page_tokens, tile_bytes)


def test_launch_pieces(monkeypatch):
    """A page load's launch values: small pages grouped, read as one power of two of words, masked; one page per
    item in :func:`pieces` (GROUP 1) for a kernel without ``GROUP``, for pages too large to group, and with
    ``GROUP_BYTES`` at 0."""
    assert rowcopy_pages.launch_pieces(576, 4, 2, 16, 65536) == (2, 1024, 1, 0, 0, 0, 0)
    assert rowcopy_pages.launch_pieces(576, 4, 2, 16, 65536, grouping=False) == (1, *pieces(576, 16384, 2))
    assert rowcopy_pages.launch_pieces(2048, 4, 2, 16, 65536) == (1, *pieces(2048, 16384, 2))
    monkeypatch.setattr(rowcopy_pages, "GROUP_BYTES", 0)
    assert rowcopy_pages.launch_pieces(576, 4, 2, 16, 65536) == (1, *pieces(576, 16384, 2))


def _row_kernel_load(launches, spec, gen, pool, ref, dev, ref_dev, layer: int) -> None:
    """Whole pages into page runs of ``layer``: launched without the page kernel, bit-exact against the reference."""
    h, d = _cases(spec, gen)["whole-to-runs"]
    pool.load_layer(layer, h.to(DEVICE), d.to(DEVICE))
    ref.load_layer(layer, h, d)
    _sync()
    assert launches and all(k is not kl.PAGE_LOAD for k, _, _ in launches)
    _same(dev, ref_dev)


@pytest.mark.parametrize("layout,kind,opts,why", [
    ("page_first", "mla", {}, "host token stride is not the row width"),
    ("layer_first", "mla", {"ps": 1}, "pages of one token"),
])
def test_groups_that_keep_the_row_kernel(caplog, launches, layout, kind, opts, why):
    """Groups whose host pages are not packed runs, or of one token, load through the row kernel (logged), bit-exact."""
    gen = torch.Generator().manual_seed(9)
    spec = _spec(kind, opts.get("ps", 4), 6)
    with caplog.at_level("INFO", logger="hicache_core.rowcopy"):
        _, pool, ref, dev, ref_dev = _pools(layout, spec, gen)
    assert why in caplog.text
    _row_kernel_load(launches, spec, gen, pool, ref, dev, ref_dev, 0)


def test_device_rows_wider_than_the_row_take_strided_page_loads(launches):
    """Device layers whose token stride is wider than the row (a view of a wider tensor): page loads store each
    page row by row (``STRIDED``), bit-exact; the columns past each row's end keep their bytes."""
    gen = torch.Generator().manual_seed(11)
    spec = _spec("mla", 4, 6)
    rows, row = 2 * spec.capacity, spec.components[0].row_bytes
    wide = [torch.randint(0, 256, (rows, row + 16), dtype=torch.uint8, generator=gen).to(DEVICE) for _ in range(3)]
    before = [t.clone() for t in wide]
    dev = {spec.components[0].name: [t[:, :row].view(torch.bfloat16) for t in wide]}
    pool = HostKVPool(spec, "layer_first", "kernel", dev, registry=REGISTRY,
                      strategy_options={"tma": False, "pages": True}, pin_memory=PIN)
    ((lv, _),) = pool.binding.scratch[pool.strategy_name].pages[0]
    assert dict(zip(pool.binding.scratch[pool.strategy_name].page_launcher.arg_names, lv.args))["STRIDED"]
    (host,) = pool.host_buffers.values()  # layer_first: [layers, slots, row]
    host.view(torch.uint8).copy_(torch.randint(0, 256, (3, spec.capacity, row), dtype=torch.uint8, generator=gen))
    h, d = _cases(spec, gen)["whole-to-runs"]
    for layer in range(3):
        pool.load_layer(layer, h.to(DEVICE), d.to(DEVICE))
    _sync()
    assert launches and all(k is kl.PAGE_LOAD for k, _, _ in launches)
    for layer in range(3):
        want = before[layer].cpu().clone()
        want[d, :row] = host.view(torch.uint8)[layer].cpu()[h]
        assert torch.equal(wide[layer].cpu(), want), layer


def test_switch(monkeypatch, launches):
    """``pages=False`` or ``HICACHE_KERNEL_PAGES=0``: the row kernel for every load; a bad value is refused."""
    monkeypatch.delenv(ENV_PAGES, raising=False)
    assert pages_enabled(None) and not pages_enabled(False) and pages_enabled(True)
    assert (pages_mode(None), pages_mode(True), pages_mode(False)) == ("auto", "all", None)
    monkeypatch.setenv(ENV_PAGES, "1")
    assert pages_mode(None) == "all" and pages_mode(False) is None
    layer_first = REGISTRY.layout("layer_first")
    every = "\n".join(REGISTRY.resolve(_spec("mla", 4, 6), "layer_first", "kernel").strategy.describe(
        _spec("mla", 4, 6), layer_first))
    # no floor named where none applies (on CUDA the TMA clause names its own "of >= ...")
    assert "loads of whole pages where" in every and "bytes per host buffer" not in every
    monkeypatch.setenv(ENV_PAGES, "0")
    assert not pages_enabled(None) and pages_enabled(True)
    gen = torch.Generator().manual_seed(13)
    spec = _spec("mla", 4, 6)
    _, pool, ref, dev, ref_dev = _pools("layer_first", spec, gen, pages=None)
    assert pool.binding.scratch[pool.strategy_name].pages == ()
    _row_kernel_load(launches, spec, gen, pool, ref, dev, ref_dev, 2)
    monkeypatch.setenv(ENV_PAGES, "sometimes")
    with pytest.raises(ConfigError, match="HICACHE_KERNEL_PAGES='sometimes': use 1"):
        pages_enabled(None)
    with pytest.raises(ResolutionError, match="pages must be True, False or None"):
        HostKVPool(spec, "layer_first", "kernel", dev, registry=REGISTRY, strategy_options={"pages": "yes"},
                   pin_memory=PIN)


@pytest.mark.parametrize("layout,pages,want", [("layer_first", True, True), ("layer_first", False, False),
                                               ("page_first", True, False), ("layer_first", None, False)])
def test_fast_load_counts_page_loads(monkeypatch, layout, pages, want):
    """``fast_load`` (what ``auto`` asks before sending a lone load to the kernel) holds where every group of the
    layer loads through page loads (TMA off here), not where one keeps the row kernel (automatic page loads leave
    these 576-byte pages to it)."""
    monkeypatch.delenv(ENV_PAGES, raising=False)
    spec = _spec("mla", 4, 6)
    _, pool, *_ = _pools(layout, spec, torch.Generator().manual_seed(17), pages=pages)
    assert pool.strategy.fast_load(pool.binding, 1, 8) is want


@pytest.mark.parametrize("layout,kind,opts", [("layer_first", "mla", {}), ("layer_first", "mla", {"programs": 3}),
                                              ("page_first", "mha", {"pages": False}),
                                              ("page_first_kv_split", "mla", {"tile_bytes": 64})])
def test_launch_grid_names_the_grids_a_call_launches(launches, layout, kind, opts):
    """``launch_grid`` (what benchmarks record beside a row) is the largest grid the call launches, for every op
    and path: row kernels, page loads, a budget option, grids capped by the call's work; 0 for an empty call."""
    gen = torch.Generator().manual_seed(5)
    spec = _spec(kind, 4, 4, layers=2)
    _, pool, ref, dev, ref_dev = _pools(layout, spec, gen, **opts)
    strat = pool.strategy
    for pages in (4, 1):
        h, d = _cases(spec, gen)["whole-to-runs"]
        h, d = h[: 4 * pages].to(DEVICE), d[: 4 * pages].to(DEVICE)
        for layer, to_host, call in ((None, True, lambda: pool.backup_all_layers(h, d)),
                                     (1, True, lambda: pool.backup_layer(1, h, d)),
                                     (1, False, lambda: pool.load_layer(1, h, d)),
                                     (None, False, lambda: pool.load_all_layers(h, d))):
            launches.clear()
            call()
            assert launches, (layer, to_host)
            grid = strat.launch_grid(pool.binding, h.numel(), layer, to_host=to_host)
            assert grid == max(g for _, g, _ in launches), (pages, layer, to_host)
            if "programs" in opts:
                assert grid <= opts["programs"]
    assert strat.launch_grid(pool.binding, 0, 1, to_host=False) == 0


@pytest.mark.parametrize("layout,floor,taken", [("layer_first", 576, True), ("layer_first", 577, False),
                                                ("page_first_kv_split", 64, True), ("page_first_kv_split", 65, False)])
def test_automatic_page_loads_take_pages_of_at_least_the_floor(monkeypatch, caplog, launches, layout, floor, taken):
    """Unset ``pages`` (automatic): a group takes page loads only where a page of each host part holds
    ``AUTO_MIN_PART_BYTES`` (here moved to the test's pages: 4 rows of 144 bytes; split, 4 x 128 and 4 x 16 bytes,
    the rope part deciding); below it the row kernel loads, logged, bit-exact; ``pages=True`` takes them all."""
    monkeypatch.delenv(ENV_PAGES, raising=False)
    monkeypatch.setattr(rowcopy_pages, "AUTO_MIN_PART_BYTES", floor)
    gen = torch.Generator().manual_seed(19)
    spec = _spec("mla", 4, 6)
    with caplog.at_level("INFO", logger="hicache_core.rowcopy"):
        _, pool, ref, dev, ref_dev = _pools(layout, spec, gen, pages=None)
    assert (pool.binding.scratch[pool.strategy_name].pages[0] is not None) is taken
    assert ("automatic page loads take" in caplog.text) is not taken
    assert f"of >= {floor} bytes per host buffer" in "\n".join(pool.strategy.describe(spec, REGISTRY.layout(layout)))
    if not taken:
        _row_kernel_load(launches, spec, gen, pool, ref, dev, ref_dev, 1)
        _, forced, *_ = _pools(layout, spec, gen, pages=True)
        assert forced.binding.scratch[forced.strategy_name].pages[0] is not None
