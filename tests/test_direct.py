"""The copy-engine ``direct`` backend: both routes bit-exact on every layout, plan memos, options."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest
import torch

from hicache_core import HostKVPool, LayerMap, PoolSpec, create_registry
from hicache_core.backends.direct import DirectStrategy
from hicache_core.backends.plans import Plan
from hicache_core.backends.staging import page_image
from hicache_core.errors import ConfigError, IndexRangeError
from hicache_core.testing.conformance import CASES, check_strategy
from fakes import FakeEvent

REG = create_registry()
LAYOUTS = sorted(REG.layouts)
FAST_CASES = [c for c in CASES if c.id in (
    "mla576-bf16-ps16-strided", "mla576-bf16-ps64-splitdev", "mla576-fp8-ps16-sharded5of2r1",
    "mla576-bf16-ps4-sharded5of2r1-padded-drafts", "mla-dsa-extra-ps4", "mha-bf16-ps16-vdim-strided",
    "mha-fp32-ps64-sharded3of2r0", "mha-fp16-ps128-drafts", "mla576-bf16-ps1")]


def _served(case, layout: str) -> bool:
    spec = case.build(torch.device("cpu"))
    return REG.try_resolve(spec, layout, "direct")[0] is not None


@pytest.mark.parametrize("staging", ["always", "never", "auto"])
@pytest.mark.parametrize("chunk", ["one-page", "default"])
@pytest.mark.parametrize("case", FAST_CASES, ids=[c.id for c in FAST_CASES])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_both_routes(monkeypatch, layout, case, staging, chunk):
    if not _served(case, layout):
        pytest.skip(f"{layout} does not hold {case.id}")
    monkeypatch.setenv("HICACHE_DIRECT_STAGING", staging)
    if chunk == "one-page":
        monkeypatch.setenv("HICACHE_STAGING_BYTES", "1")  # one page per chunk: the chunk loop runs
    for variant in ("shuffled-i64", "reversed-i64-dev", "one-page-i32"):
        check_strategy(REG, case, layout, "direct", variant=variant, strategy="core.direct")
    check_strategy(REG, case, layout, "direct", strategy="core.direct", per_layer_backup=True)


def _mla_pool(layout: str, *, staging: str, ps: int = 16, layers: int = 4, pages: int = 8) -> HostKVPool:
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(layers), kv_lora_rank=512, qk_rope_head_dim=64,
                        dtype=torch.bfloat16, page_size=ps, capacity=ps * pages)
    dev = {"kv": [torch.zeros(ps * pages, 1, 576, dtype=torch.bfloat16) for _ in range(layers)]}
    return HostKVPool(spec, layout, "direct", dev, registry=REG, strategy="core.direct",
                      strategy_options={"staging": staging})


def _submission(pool: HostKVPool, h: torch.Tensor, d: torch.Tensor, layer: int | None):
    assert isinstance(pool.strategy, DirectStrategy)
    return pool.strategy.submission(pool.binding, h, d, layer)


@pytest.mark.parametrize("layout", [x for x in ("page_first", "page_first_direct", "layer_first") if x in LAYOUTS])
def test_auto_stages_only_where_blocks_grow(layout):
    pool = _mla_pool(layout, staging="auto", ps=64, pages=4)
    h = torch.arange(128, 192)  # one page
    d = torch.arange(64, 128)
    sub = _submission(pool, h, d, None)
    if layout == "page_first":
        # token-major host: plain runs are one 1152-byte row; a staged page is 64 tokens x 4 layers x 1152 bytes
        assert sub.staged is not None and sub.mean_block == 64 * 4 * 1152
    else:
        # page-contiguous per layer on both sides: plain runs are already 73.7 KB pages, nothing to gain
        assert sub.staged is None and sub.mean_block == 64 * 1152
    assert sub.nbytes == 64 * 4 * 1152
    layer = _submission(pool, h, d, 2)
    assert layer.staged is None and layer.nbytes == 64 * 1152  # one layer of page_first: staging cannot grow rows


def test_layer_major_staged_image_is_compact_with_one_pitched_copy_per_page():
    pool = _mla_pool("layer_first", staging="always", ps=4, layers=5, pages=8)
    h = (torch.tensor([6, 1, 3]).unsqueeze(1) * 4 + torch.arange(4)).reshape(-1)
    d = torch.randperm(32, generator=torch.Generator().manual_seed(0))[:12]
    st = _submission(pool, h, d, None).staged
    assert st is not None
    (im,) = st.images
    page = 4 * 1152
    # the mirror of a page over 5 host layers would span 4 layers' strides; packed it is 5 pages' bytes
    assert im.compact and im.span == 5 * page and im.rel.tolist() == [k * page for k in range(5)]
    assert im.pitched == (page, 8 * page, page)  # host step: one layer of 8 pages
    assert (st.count, st.blocks, st.nbytes) == (3, 15, 15 * page)
    one = _submission(pool, h, d, 2).staged
    assert one is not None and not one.images[0].compact and one.images[0].pitched is None and one.count == 3
    unpitched = HostKVPool(pool.spec, "layer_first", "direct", {"kv": [r.clone() for r in pool.binding.segments[0].device_rows]},
                           registry=REG, strategy="core.direct", strategy_options={"staging": "always", "pitched": "never"})
    st2 = _submission(unpitched, h, d, None).staged
    assert st2 is not None and st2.images[0].compact and st2.images[0].pitched is None and st2.count == 15


def test_staged_chunk_ops_equal_ops_built_per_chunk():
    """A staged route packs its pitched operations once; a chunk's rows, shifted to the chunk's image
    address, equal the operations packed from that chunk's copies (what CUDA 13 runtimes receive)."""
    from hicache_core.backends.pitched import Pitched, ops_tensor

    pool = _mla_pool("layer_first", staging="always", ps=4, layers=5, pages=8)
    h = (torch.tensor([6, 1, 3, 0, 7]).unsqueeze(1) * 4 + torch.arange(4)).reshape(-1)
    st = _submission(pool, h, torch.arange(20), None).staged
    assert st is not None and st.count == 5
    base = 1 << 40
    for to_host in (True, False):
        for p0, p1 in ((0, 2), (2, 5)):
            shape = st._p_shape.repeat(p1 - p0, 1)
            want = ops_tensor(Pitched(st._p_host[p0:p1].reshape(-1), (st._p_rel[p0:p1] + base).reshape(-1),
                                      *shape.unbind(1)), to_host=to_host)
            assert torch.equal(st._chunk_ops(p0, p1, base, to_host), want)


def _layer_major_backup(*, pitched: str = "auto", staging: str = "auto", layout: str = "layer_first", ps: int = 4):
    """A 16-layer MLA backup of 48 of 64 pages, shuffled, from separately allocated layers."""
    layers, pages = 16, 64
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(layers), kv_lora_rank=512, qk_rope_head_dim=64,
                        dtype=torch.bfloat16, page_size=ps, capacity=ps * pages)
    gen = torch.Generator().manual_seed(5)
    dev = {"kv": [torch.randint(-9, 9, (2 * ps * pages, 1, 576), generator=gen).to(torch.bfloat16) for _ in range(layers)]}
    pool = HostKVPool(spec, layout, "direct", dev, registry=REG, strategy="core.direct",
                      strategy_options={"staging": staging, "pitched": pitched})
    hp = torch.randperm(pages, generator=gen)[:48]
    h = (hp.unsqueeze(1) * ps + torch.arange(ps)).reshape(-1)
    d = (torch.randperm(2 * pages, generator=gen)[:48].unsqueeze(1) * ps + torch.arange(ps)).reshape(-1)
    pool.test_device_buffers = dev  # type: ignore[attr-defined]
    return pool, h, d


def _check_backup_bytes(pool: HostKVPool, h: torch.Tensor, d: torch.Tensor, dev: dict) -> None:
    """Backup into canary-filled host buffers, byte for byte as the reference backend writes them (so
    the slots not named keep their canaries), then every layer loads back as it was (``dev``: the
    pool's device buffers)."""
    segs = pool.binding.segments
    ref = HostKVPool(pool.spec, pool.layout, "reference", dev, registry=REG, strategy="core.reference",
                     pin_memory=False)
    for p in (pool, ref):
        for buf in p.host_buffers.values():
            buf.view(torch.uint8).fill_(0xA5)
    pool.backup_all_layers(h, d)
    ref.backup_all_layers(h, d)
    for name, buf in pool.host_buffers.items():
        assert torch.equal(buf.view(torch.uint8), ref.host_buffers[name].view(torch.uint8)), name
    want = [[r[d].clone() for r in seg.device_rows] for seg in segs]
    target = torch.randperm(segs[0].device_rows[0].shape[0], generator=torch.Generator().manual_seed(6))[: h.numel()]
    for layer in range(len(segs[0].device_rows)):
        pool.load_layer(layer, h, target)
        for seg, rows in zip(segs, want):
            assert torch.equal(seg.device_rows[layer][target], rows[layer]), f"{seg.segment.buffer} layer {layer}"


@pytest.mark.skipif(not {"layer_first", "page_first_direct"} <= set(LAYOUTS), reason="needs both layout plugins")
@pytest.mark.parametrize("layout, threshold, staged", [("layer_first", 1.0, False), ("page_first_direct", 1.0, True),
                                                       ("page_first_direct", 1e6, False)])
def test_auto_stages_page_runs_into_whole_pages_where_submitting_them_costs_the_host(monkeypatch, layout, threshold,
                                                                                     staged):
    # 64-token pages: plain runs of 73.7 KB (large enough for the copy engine), 768 of them.  Staged,
    # a page_first_direct page is one 1.2 MB block over 16 layers; a layer_first page stays 16 blocks
    # (packed, the same sizes: staging would only cut host time, and moved less than plain on the GPU)
    from hicache_core.backends import plans_plan

    monkeypatch.setattr(plans_plan, "STAGE_HOST_US", threshold)
    pool, h, d = _layer_major_backup(layout=layout, ps=64)
    sub = _submission(pool, h, d, None)
    assert (sub.staged is not None) == staged
    assert sub.count == (48 if staged else 768)
    assert sub.mean_block == (16 * 64 * 1152 if staged else 64 * 1152)
    _check_backup_bytes(pool, h, d, pool.test_device_buffers)


@pytest.mark.skipif(not {"page_first", "page_first_kv_split", "page_first_direct"} <= set(LAYOUTS),
                    reason="needs the page layout plugins")
@pytest.mark.parametrize("layout", ["page_first", "page_first_kv_split", "page_first_direct"])
def test_auto_stages_page_major_layouts_without_building_plain_runs(monkeypatch, layout):
    """Where every page image block joins several layers, no plain run can beat the staged blocks:
    the route is decided from the images alone (a split layout's plain runs are 64-byte rope rows,
    tens of milliseconds of host time to build for a large batch)."""
    from hicache_core.backends import plans_plan

    pool, h, d = _layer_major_backup(layout=layout, ps=64)
    plan = Plan(pool.binding, h, d, "auto", 1 << 30, pitched=True)
    sub = plan.submission(None)
    assert sub.staged is not None and sub.count == 48 * len(sub.staged.images)
    assert plan._tables == {}  # no plain run was built
    _check_backup_bytes(pool, h, d, pool.test_device_buffers)
    # device indices on the GPU (here: told so) are not read back for it
    monkeypatch.setattr(plans_plan, "defer_device_read", lambda binding: True)
    unread = Plan(pool.binding, h, d, "auto", 1 << 30, pitched=True)
    assert unread.submission(None).staged is not None and not unread.d_read


@pytest.mark.skipif("page_first" not in LAYOUTS, reason="needs the page_first plugin")
def test_auto_stages_padded_draft_shard_without_reading_device_indices(monkeypatch):
    """SGLang's context-parallel rank with padding and a draft layer: the page image's blocks do not
    all join layers (the draft slot), but no plain run can leave its page, so the staged route is
    still decided without reading GPU-resident device indices."""
    from hicache_core.backends import plans_plan

    ps, pages = 16, 8
    lmap = LayerMap.sharded_cp(9, 2, 1, draft_layers=1, pad_to_largest=True)
    spec = PoolSpec.mla(layer_map=lmap, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                        page_size=ps, capacity=ps * pages)
    gen = torch.Generator().manual_seed(8)
    dev = {"kv": [torch.randint(-9, 9, (2 * ps * pages, 1, 576), generator=gen).to(torch.bfloat16)
                  if i in lmap.device_layers else None for i in range(lmap.num_device_layers)]}
    pool = HostKVPool(spec, "page_first", "direct", dev, registry=REG, strategy="core.direct")
    h = (torch.tensor([3, 6, 0]).unsqueeze(1) * ps + torch.arange(ps)).reshape(-1)
    d = (torch.tensor([11, 2, 7]).unsqueeze(1) * ps + torch.arange(ps)).reshape(-1)
    monkeypatch.setattr(plans_plan, "defer_device_read", lambda binding: True)
    plan = Plan(pool.binding, h, d, "auto", 1 << 30, pitched=True)
    assert plan.submission(None).staged is not None and not plan.d_read


@pytest.mark.skipif("page_first_direct" not in LAYOUTS, reason="needs the page_first plugin")
@pytest.mark.parametrize("pitched", ["auto", "never"])
def test_layers_in_one_allocation_keep_pitched_plain_runs(pitched):
    """Device layers of one ascending allocation: the plain runs go as pitched copies across layers
    (32 operations, no SMs), which staging does not beat; unpitched (512 descriptors, past
    ``STAGE_HOST_US``), staging wins on host time."""
    layers, ps, pages = 16, 64, 32
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(layers), kv_lora_rank=512, qk_rope_head_dim=64,
                        dtype=torch.bfloat16, page_size=ps, capacity=ps * pages)
    one = torch.randint(-9, 9, (layers, 2 * ps * pages, 1, 576), generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    dev = {"kv": list(one.unbind(0))}
    pool = HostKVPool(spec, "page_first_direct", "direct", dev, registry=REG,
                      strategy="core.direct", strategy_options={"staging": "auto", "pitched": pitched})
    gen = torch.Generator().manual_seed(4)
    h = (torch.randperm(pages, generator=gen).unsqueeze(1) * ps + torch.arange(ps)).reshape(-1)
    d = (torch.randperm(2 * pages, generator=gen)[:pages].unsqueeze(1) * ps + torch.arange(ps)).reshape(-1)
    sub = _submission(pool, h, d, None)
    if pitched == "auto":
        assert sub.staged is None and sub.pitched_count == 32 and sub.count == 32
    else:
        assert sub.staged is not None and sub.count == 32
    _check_backup_bytes(pool, h, d, dev)


@pytest.mark.skipif("layer_first" not in LAYOUTS, reason="needs the layer_first layout plugin")
@pytest.mark.parametrize("pitched", ["auto", "never"])
def test_layer_major_staging_always_round_trips(monkeypatch, pitched):
    pool, h, d = _layer_major_backup(staging="always", pitched=pitched)
    st = _submission(pool, h, d, None).staged
    assert st is not None and st.images[0].compact and st.count == (48 if pitched == "auto" else 768)
    _check_backup_bytes(pool, h, d, pool.test_device_buffers)


def test_plan_memo_follows_tensor_identity_and_version():
    pool = _mla_pool(LAYOUTS[0], staging="never")
    h, d = torch.arange(16), torch.arange(16)
    first = _submission(pool, h, d, 1)
    assert _submission(pool, h, d, 1) is first
    assert _submission(pool, h.clone(), d, 1) is not first  # another tensor object
    d.add_(16)  # in place: version counter moves
    again = _submission(pool, h, d, 1)
    assert again is not first and int(again.dev[0] - first.dev[0]) == 16 * 1152
    with torch.inference_mode():
        hi, di = torch.arange(16), torch.arange(16)
    assert _submission(pool, hi, di, 1) is not _submission(pool, hi, di, 1)  # never memoised


def test_plan_range_checks_device_values():
    pool = _mla_pool(LAYOUTS[0], staging="never")
    with pytest.raises(IndexRangeError, match="device_indices must lie in 0..127; nothing was copied"):
        Plan(pool.binding, torch.arange(16), torch.arange(120, 136), "never", 1)
    with pytest.raises(IndexRangeError, match="host_indices must lie in 0..127; nothing was copied"):
        Plan(pool.binding, torch.arange(120, 136), torch.arange(16), "never", 1)


@pytest.mark.skipif("layer_first" not in LAYOUTS, reason="needs the layer_first layout plugin")
def test_staged_route_never_reads_device_resident_indices(monkeypatch):
    """A staged backup indexes with the device copy of GPU-resident indices and never reads their
    values on the host (on CUDA that read waits for the work queued before the call); a plain route
    reads and range-checks them on first need.  On this CPU pool, :func:`.plans_plan.defer_device_read`
    is told to treat the device indices as GPU-resident."""
    pytest.importorskip("triton")
    from hicache_core.backends import plans_plan

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HICACHE_STAGED_RELAYOUT", "kernel")
    pool, h, d = _layer_major_backup(staging="always")
    monkeypatch.setattr(plans_plan, "defer_device_read", lambda binding: True)
    read = []
    real = plans_plan.as_long
    monkeypatch.setattr(plans_plan, "as_long", lambda t, device, **kw: (read.append(t is not h), real(t, device, **kw))[1])
    plan = Plan(pool.binding, h, d, "always", 1 << 30, pitched=True)
    staged = plan.submission(None)
    assert staged.staged is not None and not plan.d_read and read == [False]  # the host indices only
    plain = Plan(pool.binding, h, d, "never", 1 << 30, pitched=True)
    assert plain.submission(None).staged is None and plain.d_read and read == [False, False, True]
    # through the pool: bytes as the reference backend writes them
    seg = pool.binding.segments[0]
    pool.backup_all_layers(h, d)
    ref = HostKVPool(pool.spec, "layer_first", "reference", {"kv": seg.device_rows}, registry=REG,
                     strategy="core.reference")
    ref.backup_all_layers(h, d)
    named = torch.zeros(64, dtype=torch.bool)
    named[h.view(-1, 4)[:, 0] // 4] = True  # compare the 48 pages written (the others hold what each buffer held)
    layers = lambda t: t.view(16, 64, -1)  # noqa: E731
    assert torch.equal(layers(seg.host_flat)[:, named], layers(ref.binding.segments[0].host_flat)[:, named])


def test_device_indices_come_back_with_device_resident_host_indices(monkeypatch):
    """Where both index tensors live on the pool's device, the device indices are queued back before the host indices
    are read (one wait for both); the plain route then takes its values from that copy, range-checked, and a rewrite
    of the caller's tensor after the call changes nothing.  On this CPU pool, :func:`.plans_plan.defer_device_read` is
    told to treat the indices as device-resident."""
    from hicache_core.backends import plans_plan

    pool = _mla_pool(LAYOUTS[0], staging="never")
    monkeypatch.setattr(plans_plan, "defer_device_read", lambda binding: True)
    h, d = torch.arange(32, 64), torch.arange(96, 128).flip(0)
    plan = Plan(pool.binding, h, d, "never", 1)
    assert plan._d_early is not None and not plan.d_read
    d.fill_(0)  # behind the plan's back: it reads its own copy
    sub = plan.submission(1)
    assert plan.d_read and torch.equal(plan.d, torch.arange(96, 128).flip(0))
    monkeypatch.setattr(plans_plan, "defer_device_read", lambda binding: False)
    ref = Plan(pool.binding, h, torch.arange(96, 128).flip(0), "never", 1)
    assert ref._d_early is None
    want = ref.submission(1)
    assert torch.equal(sub.host, want.host) and torch.equal(sub.dev, want.dev) and torch.equal(sub.lens, want.lens)
    monkeypatch.setattr(plans_plan, "defer_device_read", lambda binding: True)
    bad = Plan(pool.binding, h, torch.arange(120, 152), "never", 1)  # rows past the device buffers' 128
    with pytest.raises(IndexRangeError, match="device_indices must lie in 0..127; nothing was copied"):
        bad.submission(1)


@pytest.mark.skipif("layer_first" not in LAYOUTS, reason="needs the layer_first layout plugin")
def test_staged_route_with_unread_out_of_range_rows(monkeypatch):
    """Device rows out of range, not read on the host (``validate="shapes"`` with GPU-resident
    indices): the kernel relayout moves nothing for them and nothing outside the buffers; a torch
    relayout reads and checks them first and raises before any pool byte moves."""
    pytest.importorskip("triton")
    from hicache_core.backends import plans_plan

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(plans_plan, "defer_device_read", lambda binding: True)
    for relayout in ("kernel", "torch"):
        monkeypatch.setenv("HICACHE_STAGED_RELAYOUT", relayout)
        pool, h, d = _layer_major_backup(staging="always")
        seg, strategy = pool.binding.segments[0], pool.strategy
        seg.host_flat.fill_(0xA5)
        pool.backup_all_layers(h, d)  # the host pages named hold the rows d, the others canaries
        host, dev = seg.host_flat.clone(), [r.clone() for r in seg.device_rows]
        bad = d.clone()
        bad[0] = 10 ** 6
        free = torch.tensor(sorted(set(range(512)) - set(d.tolist())))[: d.numel()]
        target = free.clone()
        target[0] = -(10 ** 6)
        if relayout == "torch":
            with pytest.raises(IndexRangeError, match="device_indices must lie in 0..511"):
                strategy.backup(pool.binding, h, bad, None)
            with pytest.raises(IndexRangeError, match="device_indices must lie in 0..511"):
                strategy.load(pool.binding, h, target, None)
            assert torch.equal(seg.host_flat, host)
            assert all(torch.equal(r, r0) for r, r0 in zip(seg.device_rows, dev))
            continue
        seg.host_flat.fill_(0xA5)  # canaries: the masked backup must write the valid rows again
        strategy.backup(pool.binding, h, bad, None)
        assert all(torch.equal(r, r0) for r, r0 in zip(seg.device_rows, dev))
        # every host byte but the slot paired with the bad row is as the valid rows made it
        slot = torch.zeros_like(seg.host_flat, dtype=torch.bool)
        a = seg.segment.addressing
        for layer in range(16):
            lo = a.offset + layer * a.layer + int(h[0]) * a.token
            slot[lo : lo + a.token] = True
        assert torch.equal(seg.host_flat[~slot], host[~slot])
        strategy.load(pool.binding, h, target, None)  # all layers: the staged scatter
        for layer, (r, r0) in enumerate(zip(seg.device_rows, dev)):
            want = r0.clone()
            want[free[1:]] = r0[d[1:]]  # the host slots hold rows d; the bad target moved nothing
            assert torch.equal(r, want), f"layer {layer}"


@pytest.mark.parametrize("bad", [{"staging": "sometimes"}, {"staging_bytes": 0}, {"staging_bytes": "1MB"}])
def test_bad_options_raise_config_error(bad):
    with pytest.raises(ConfigError, match="direct staging"):
        DirectStrategy(**bad)


def test_bad_env_raises_config_error(monkeypatch):
    monkeypatch.setenv("HICACHE_STAGING_BYTES", "lots")
    with pytest.raises(ConfigError, match="HICACHE_STAGING_BYTES='lots'"):
        DirectStrategy()


def test_a_bad_staged_relayout_variable_fails_the_strategy_load_not_a_transfer(monkeypatch):
    """``HICACHE_STAGED_RELAYOUT`` is checked with the other settings when the strategy loads (it was read only by the
    first staged transfer); with staging ``never`` nothing reads it."""
    monkeypatch.setenv("HICACHE_STAGED_RELAYOUT", "sideways")
    with pytest.raises(ConfigError, match="staged relayout='sideways' \\(or HICACHE_STAGED_RELAYOUT\\)"):
        DirectStrategy()
    with pytest.raises(ConfigError, match="HICACHE_STAGED_RELAYOUT"):
        DirectStrategy(staging="always")
    assert DirectStrategy(staging="never").staging == "never"


@pytest.mark.skipif("layer_first" not in LAYOUTS, reason="needs the layer_first layout plugin")
def test_auto_decides_once_per_index_pair_and_batch(monkeypatch):
    """Per-layer calls of a batch reuse the first call's decision (no plan built per call); an in-place
    change of an index tensor, other tensors or the other direction decide again."""
    from hicache_core.backends.auto import AutoStrategy
    from hicache_core.calibration import DEFAULT

    pool = _mla_pool("layer_first", staging="auto", ps=64, layers=4, pages=64)
    auto = AutoStrategy()
    auto.direct, auto.kernel, auto.calibration = pool.strategy, object(), DEFAULT
    calls = []
    real = pool.strategy.submission
    monkeypatch.setattr(pool.strategy, "submission", lambda *a: calls.append(a[3]) or real(*a))
    h, d = torch.arange(0, 2048), torch.arange(2048, 4096)
    first = auto.pick(pool.binding, h, d, 0, to_host=False)
    assert all(auto.pick(pool.binding, h, d, layer, to_host=False) is first for layer in (1, 2, 3))
    assert calls == [0]
    auto.pick(pool.binding, h, d, None, to_host=False)  # all layers: another decision
    auto.pick(pool.binding, h, d, 1, to_host=True)  # other direction
    h[0] = 7  # in place: the version counter moves
    h[0] = 0
    auto.pick(pool.binding, h, d, 1, to_host=False)
    auto.pick(pool.binding, h.clone(), d, 1, to_host=False)  # another tensor
    assert calls == [0, None, 1, 1, 1]


@pytest.mark.skipif("page_first" not in LAYOUTS or "layer_first" not in LAYOUTS, reason="needs the layout plugins")
def test_auto_needs_no_index_values_where_no_block_can_be_large(monkeypatch):
    """One layer of a token-major page is page_size separate rows: no copy block can reach the
    calibrated size whatever the indices, so auto picks the kernel without sizing a plan (which
    would read device-resident indices back to the host).  Where blocks can grow, it sizes one."""
    from hicache_core.backends.auto import AutoStrategy
    from hicache_core.calibration import DEFAULT

    kernel = object()
    h, d = torch.arange(0, 2048), torch.arange(2048, 4096)
    for layout, layer, to_host, sized, want in (("page_first", 1, False, [], kernel),
                                                ("page_first", None, True, [None], None),
                                                ("layer_first", 1, False, [1], None)):
        pool = _mla_pool(layout, staging="auto", ps=64, layers=4, pages=64)
        auto = AutoStrategy()
        auto.direct, auto.kernel, auto.calibration = pool.strategy, kernel, DEFAULT
        calls = []
        real = pool.strategy.submission
        monkeypatch.setattr(pool.strategy, "submission", lambda *a, real=real, calls=calls: calls.append(a[3]) or real(*a))
        got = auto.pick(pool.binding, h, d, layer, to_host=to_host)
        assert calls == sized and (want is None or got is want), (layout, layer)
    # the bound itself: one layer of [S, L, row] is 1152-byte rows; layer_first pages merge across pages
    assert auto._block_bound(pool.binding, 1) == float("inf")


@pytest.mark.skipif("page_first_kv_split" not in LAYOUTS, reason="needs the kv_split layout plugin")
@pytest.mark.parametrize("layer, to_host", [(1, False), (2, True)])
def test_auto_bounds_the_smallest_block_by_the_most_constrained_segment(monkeypatch, layer, to_host):
    """A split MLA page holds the 512-wide nope part and the 64-wide rope part apart: one layer's rope
    blocks (64 tokens x 128 B = 8 KB per page) can never reach the calibrated size, so auto picks the
    kernel for one-layer calls without sizing a plan, however large the nope blocks are.  (All layers of
    a page's rope part are one contiguous block that merges with the next page's: no bound there.)"""
    from hicache_core.backends.auto import AutoStrategy
    from hicache_core.calibration import DEFAULT

    pool = _mla_pool("page_first_kv_split", staging="auto", ps=64, layers=4, pages=8)
    kernel = object()
    auto = AutoStrategy()
    auto.direct, auto.kernel, auto.calibration = pool.strategy, kernel, DEFAULT
    monkeypatch.setattr(pool.strategy, "submission", lambda *a: pytest.fail("sized a plan"))
    bound = auto._block_bound(pool.binding, layer)
    assert bound < DEFAULT.min_block(to_host)
    assert auto.pick(pool.binding, torch.arange(64), torch.arange(64, 128), layer, to_host=to_host) is kernel
    assert auto._block_bound(pool.binding, None) == float("inf")


@pytest.mark.skipif("page_first" not in LAYOUTS, reason="needs the page_first layout plugin")
def test_page_image_merges_owned_layers_only():
    pool = _mla_pool("page_first", staging="always", ps=4, layers=4, pages=2)
    seg = pool.binding.segments[0]
    starts, lens = page_image(seg, [0, 1, 2, 3], 4)
    assert starts.tolist() == [0] and lens.tolist() == [4 * 4 * 1152]  # the whole page, one block
    starts, lens = page_image(seg, [1], 4)  # one layer of a token-major page: one row per token
    assert starts.tolist() == [1152 + t * 4 * 1152 for t in range(4)] and lens.tolist() == [1152] * 4


@pytest.mark.skipif("page_first" not in LAYOUTS or "layer_first" not in LAYOUTS, reason="needs the layout plugins")
def test_auto_picks_copy_engine_only_for_large_fed_blocks():
    from hicache_core.backends.auto import AutoStrategy
    from hicache_core.calibration import DEFAULT

    kernel = object()  # stands in for the layout's kernel strategy: only its identity matters here
    h, d = torch.arange(0, 2048), torch.arange(2048, 4096)  # 32 pages: enough bytes to hide 8 relayout launches
    picks = {}
    for layout in ("layer_first", "page_first"):
        pool = _mla_pool(layout, staging="auto", ps=64, layers=4, pages=64)
        auto = AutoStrategy()
        auto.direct, auto.kernel, auto.calibration = pool.strategy, kernel, DEFAULT
        for layer in (None, 1):
            chosen = auto.pick(pool.binding, h, d, layer, to_host=True)
            picks[layout, layer] = "direct" if chosen is pool.strategy else "kernel"
    # layer_first: whole 73.7 KB pages; page_first all layers: staged 295 KB pages; page_first one layer: 1152 B rows
    assert picks == {("layer_first", None): "direct", ("layer_first", 1): "direct",
                     ("page_first", None): "direct", ("page_first", 1): "kernel"}
    small = _mla_pool("page_first", staging="auto", ps=64, layers=4, pages=64)
    auto = AutoStrategy()
    auto.direct, auto.kernel, auto.calibration = small.strategy, kernel, DEFAULT
    # one page: the 8 relayout launches (~80 us of host time) outlast its 1.2 MB at link speed
    assert auto.pick(small.binding, h[:64], d[:64], None, to_host=True) is kernel


def test_auto_keeps_a_host_margin_for_feeding():
    """A one-layer load of 64 pages of 656-byte rows (42 KB blocks, 2.7 MB: 49 us at 55 GB/s) would cost the host
    64 x 0.5 + 6 = 38 us in a burst's single runtime call, but the decision counts an idle engine's four calls
    (56 us): on the H200 such bursts by the copy engine ran at 0.93 of memcpy on page_first_direct but 0.57-0.62 on
    layer_first rows of the same run (host-bound), against the kernel's steady 0.75-0.79.  Pages of 256 tokens
    (168 KB blocks, 16 per layer) are fed either way."""
    from hicache_core.backends.auto import AutoStrategy
    from hicache_core.backends.cudart import batch_schedule
    from hicache_core.calibration import DEFAULT

    kernel = object()
    for ps, pages, want in ((64, 64, "kernel"), (256, 16, "direct")):
        spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.uint8,
                            page_size=ps, capacity=ps * pages, row_bytes=656)
        dev = {"kv": [torch.zeros(ps * pages, 1, 656, dtype=torch.uint8) for _ in range(2)]}
        pool = HostKVPool(spec, "layer_first", "direct", dev, registry=REG, strategy="core.direct")
        auto = AutoStrategy()
        auto.direct, auto.kernel, auto.calibration = pool.strategy, kernel, DEFAULT
        d = torch.arange(ps * pages)
        h = torch.arange(pages).flip(0).repeat_interleave(ps) * ps + torch.arange(ps).repeat(pages)  # no two pages merge
        sub = _submission(pool, h, d, 1)
        assert sub.count == pages and sub.smallest_block == ps * 656 >= DEFAULT.h2d_min_block
        link_est = sub.nbytes / (DEFAULT.link_gbps * 1e3)  # estimates from the calibration's constants
        idle_est = sub.host_us(DEFAULT.submit_us, DEFAULT.call_us)  # an idle engine's schedule: small calls first
        burst_est = idle_est - (len(batch_schedule(pages)) - len(batch_schedule(pages, eager=False))) * DEFAULT.call_us
        assert (burst_est < link_est < idle_est) == (want == "kernel")  # only the margin decides the 64-page case
        chosen = auto.pick(pool.binding, h, d, 1, to_host=False)
        assert ("direct" if chosen is pool.strategy else "kernel") == want, (ps, pages)


@pytest.mark.skipif("page_first_direct" not in LAYOUTS, reason="needs the page_first layout plugin")
def test_explain_shows_auto_on_a_models_pool(capsys, monkeypatch):
    """``--shape`` (hicache bench's model shapes) with ``--tokens`` and ``--page-size``: auto's picks for a real pool,
    its estimate in numbers; ``--sharded`` shards it; ``--kind``/``--dtype`` beside it are a usage error."""
    from hicache_core import cli

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("HICACHE_CALIBRATION", raising=False)
    monkeypatch.setenv("HOME", "/nonexistent")  # the shipped calibration
    args = ["explain", "--layout", "page_first_direct", "--io-backend", "auto", "--shape", "mla61x576-bf16"]
    assert cli.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "pool: mla [kv:1152B] x 61 layers, page 64 (device cpu)" in lines
    picks = [ln for ln in lines if "pages scattered ->" in ln]
    assert picks == [
        "auto: backup_all_layers of all 4096 slots, pages scattered -> direct (blocks of 4497408 B and up, 4497408 B on "
        "average, over 64 copy-engine operations, staged: large enough against 32768 B; ~3722 us to submit against 6280 us "
        "allowed for 288 MB, host keeps up)",
        "auto: load_layer of all 4096 slots, pages scattered -> direct (blocks of 73728 B and up, 73728 B on average, "
        "over 64 copy-engine operations: large enough against 32768 B; ~56 us to submit against 86 us allowed for "
        "4.72 MB, host keeps up)"]
    assert cli.main(args + ["--tokens", "1000", "--page-size", "16", "--sharded"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "pool: mla [kv:1152B] x 30 layers, page 16, sharded 30/61 layers (device cpu)" in lines
    assert sum("of all 1008 slots, pages scattered ->" in ln for ln in lines) == 2  # whole pages
    assert cli.main(args + ["--kind", "mla", "--dtype", "bf16"]) == 2
    assert capsys.readouterr().err.strip() == ("hicache explain: --shape mla61x576-bf16 sets the pool's kind and dtype; "
                                               "leave out --kind and --dtype")


@pytest.mark.skipif("page_first" not in LAYOUTS, reason="needs the page_first layout plugin")
def test_explain_says_how_auto_decides_and_what_it_picks(capsys, monkeypatch):
    from hicache_core import cli

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # no kernel candidate on this CPU: auto must say so
    assert cli.main(["explain", "--layout", "page_first", "--io-backend", "auto", "--kind", "mla"]) == 0
    lines = capsys.readouterr().out.splitlines()
    auto = [ln for ln in lines if ln.startswith("auto: ")]
    assert auto[0].startswith("auto: the copy engine serves a call when its smallest copy block is >= 32768 B (backups)")
    assert "~0.50 us per descriptor, ~6 us per runtime call" in auto[0]
    assert auto[0].endswith("otherwise the kernel (none available here)")
    assert "fits its transfer time at 55.0 GB/s (backups: 1.2x it, auto's backup_room: " in auto[0]
    assert auto[2].startswith("auto: on a GPU pool, the host's measured pace (the median of its recent copy-engine calls, "
                              "from 7 on; a measure stops counting 1 s after its last call, 0.25 s for calls that reuse a "
                              "plan) decides too: a burst's submission at that pace must take <= 110% of the transfer time")
    assert "(loads: that alone decides; backups: <= 132%, and it can only add the copy engine)" in auto[2]
    assert auto[2].endswith("new index tensors are judged at the pace of calls that plan, tensors reused beyond one "
                            "burst at that of calls that reuse a plan")
    only = "direct (the only candidate here: no kernel serves this pool)"  # not "direct" with reasons against it
    assert auto[3] == (f"auto: backup_all_layers of all 64 slots, pages scattered -> {only} (blocks of 73728 B and up, "
                       "73728 B on average, over 4 copy-engine operations, staged: large enough against 32768 B; ~88 us "
                       "to submit against 6 us allowed for 0.295 MB, host cannot keep up)")
    assert auto[4] == (f"auto: load_layer of all 64 slots, pages scattered -> {only} (blocks of 1152 B and up, 1152 B "
                       "on average, over 64 copy-engine operations: too small against 32768 B; ~56 us to submit "
                       "against 1 us allowed for 0.0737 MB, host cannot keep up)")
    monkeypatch.setenv("HICACHE_AUTO_BACKUP_ROOM", "1")  # backups fit their transfer time, as loads do: said so
    assert cli.main(["explain", "--layout", "page_first", "--io-backend", "auto", "--kind", "mla"]) == 0
    strict = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("auto: ")]
    assert "fits its transfer time at 55.0 GB/s; otherwise" in strict[0] and "backups: 1" not in strict[0]
    assert "backups: <= 110%, and it can only add the copy engine" in strict[2]


def test_staging_buffers_grow_without_deadlock_and_serialise_runs_per_stream():
    import threading

    from hicache_core.backends.staging import StagingBuffers

    bufs = StagingBuffers(torch.device("cpu"))
    small = bufs.get(7, 16)
    done = []
    t = threading.Thread(target=lambda: done.append(bufs.get(7, 1024)))  # grows: must not block
    t.start()
    t.join(120)  # a guard against a deadlock only: the call takes microseconds
    assert done and done[0].numel() == 1024 and small.numel() == 16
    entered, release = threading.Event(), threading.Event()

    def hold(stream):
        with bufs.running(stream):
            entered.set()
            release.wait(120)

    holder = threading.Thread(target=hold, args=(7,))
    holder.start()
    assert entered.wait(120)
    with bufs.running(8):  # another stream: not serialised with 7
        pass
    order = []
    def second():
        with bufs.running(7):
            order.append("second")

    waiter = threading.Thread(target=second)
    waiter.start()
    waiter.join(0.2)  # a chance to overtake; it must not, whatever the timing
    order.append("first done")
    release.set()
    holder.join(120)
    waiter.join(120)
    assert order == ["first done", "second"]


def test_staging_buffers_keep_the_recent_streams_only_and_never_one_mid_transfer():
    import threading

    from hicache_core.backends.staging import MAX_STAGING_STREAMS, StagingBuffers

    assert StagingBuffers(torch.device("cpu")).max_streams == MAX_STAGING_STREAMS
    bufs = StagingBuffers(torch.device("cpu"), max_streams=2)
    one = bufs.get(1, 64)
    bufs.get(2, 64)
    assert bufs.get(1, 32) is one  # kept, and now the most recent
    bufs.get(3, 64)
    assert bufs.streams() == [1, 3]  # 2 was the least recently used
    assert bufs.get(2, 64) is not None and bufs.streams() == [3, 2]

    entered, release = threading.Event(), threading.Event()

    def hold():
        with bufs.running(3):
            entered.set()
            release.wait(120)

    t = threading.Thread(target=hold)
    t.start()
    assert entered.wait(120)
    bufs.get(4, 64)  # 3 is mid-transfer: 2 goes instead
    assert bufs.streams() == [3, 4]
    lone = StagingBuffers(torch.device("cpu"), max_streams=1)
    with lone.running(1):
        lone.get(2, 64)  # 1 is busy: kept beyond the bound rather than pulled from under its transfer
        assert lone.streams() == [1, 2]
    lone.get(3, 64)
    assert lone.streams() == [3]
    release.set()
    t.join(120)
    bufs.get(6, 64)
    assert bufs.streams() == [4, 6]


def test_calibration_rejects_nonsense_values(tmp_path, monkeypatch):
    import json

    from hicache_core.calibration import DEFAULT, load_calibration

    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"cpu": {"d2h_min_block": 1, "h2d_min_block": 1, "link_gbps": 0}}))
    monkeypatch.setenv("HICACHE_CALIBRATION", str(path))
    assert load_calibration(torch.device("cpu")) == DEFAULT  # link_gbps 0 would divide by zero in auto
    path.write_text(json.dumps({"cpu": {"d2h_min_block": 4096, "h2d_min_block": 8192}}))
    cal = load_calibration(torch.device("cpu"))
    assert (cal.d2h_min_block, cal.h2d_min_block, cal.link_gbps) == (4096, 8192, DEFAULT.link_gbps)


def _fake_runtime(version: int):
    """A CudaRuntime whose batch entry point records the descriptors of each call (no CUDA needed)."""
    import threading

    from hicache_core.backends import cudart

    rt = cudart.CudaRuntime.__new__(cudart.CudaRuntime)
    rt.version = rt.driver_version = version
    rt._attrs = cudart._MemcpyAttributes(1, cudart._MemLocation(0, 0), cudart._MemLocation(0, 0), 0)
    rt._attr_idx = (ctypes.c_size_t * 1)(0)
    rt._fail_idx = threading.local()
    calls = []

    def batch(d, s, z, count, attrs, idx, nattrs, *rest):
        calls.append((d, s, z, count, rest[-1]))
        return 0
    rt._batch = batch
    return rt, calls


@pytest.mark.parametrize("version", [12080, 13000])
@pytest.mark.parametrize("n, want", [(5, [5]), (64, [16] * 4), (70, [16] * 4 + [6]), (3904, None)])
def test_copy_batch_submits_small_even_calls_first_then_grows(version, n, want):
    rt, calls = _fake_runtime(version)
    d, s, z = (torch.arange(n, dtype=torch.int64) * k for k in (8, 16, 1))
    rt.copy_batch(d, s, z + 1, stream=0)
    counts = [c[3] for c in calls]
    assert sum(counts) == n
    if want is not None:
        assert counts == want
    else:  # four calls of 16, then 4x growth capped at 512
        assert counts[:6] == [16, 16, 16, 16, 64, 256] and set(counts[6:-1]) == {512} and counts[-1] <= 512
    # consecutive calls cover consecutive descriptors (8 bytes each), on the per-thread stream for stream 0
    offs = [c[0] - d.data_ptr() for c in calls]
    assert offs == [8 * sum(counts[:i]) for i in range(len(counts))]
    assert {c[4] for c in calls} == {2}


def _index_patterns(ps: int, pages: int, gen: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Host/device index pairs: page runs (the fast path: host runs page-aligned, device runs anywhere) and
    three shapes that are not."""
    offs = torch.arange(ps)
    hp, dp = torch.randperm(pages - 1, generator=gen)[: pages // 2], torch.randperm(2 * pages - 1, generator=gen)[: pages // 2]
    runs = lambda p, shift=0: (p.unsqueeze(1) * ps + shift + offs).reshape(-1)  # noqa: E731
    h, d = runs(hp), runs(dp)
    shuffled = torch.randperm(h.numel(), generator=gen)
    return {"page-runs": (h, d), "device-runs-shifted": (h, runs(dp, 1)), "host-runs-shifted": (runs(hp, 1), d),
            "tokens-shuffled": (h[shuffled], d), "partial-page": (h[:-1], d[:-1])}


FAST_PATH_CASES = [c for c in CASES if c.id in (
    "mla576-bf16-ps16-strided", "mla576-bf16-ps64-splitdev", "mla576-fp8-ps16-sharded5of2r1", "mla-dsa-extra-ps4",
    "mha-bf16-ps16-vdim-strided", "mha-fp32-ps64-sharded3of2r0", "mha-bf16-ps2-sharded5of2r1-padded-drafts")]


def _fast_path_pool(layout, case, seed: int) -> tuple[PoolSpec, HostKVPool, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """A CPU ``direct`` pool (plain runs only) of ``case`` in ``layout`` and :func:`_index_patterns` for it, with the
    page runs also as int32 and as strided views; skips where ``direct`` does not serve the pair."""
    from hicache_core.testing.conformance import make_device_buffers

    if not _served(case, layout):
        pytest.skip(f"direct does not serve {layout} for {case.id}")
    spec = case.build(torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    pool = HostKVPool(spec, layout, "direct", make_device_buffers(spec, case, gen), registry=REG,
                      strategy="core.direct", strategy_options={"staging": "never"}, pin_memory=False)
    patterns = _index_patterns(spec.page_size, spec.num_pages, gen)
    h, d = patterns["page-runs"]
    patterns["page-runs-int32"] = (h.int(), d.int())
    patterns["page-runs-strided-views"] = (torch.stack([h, h], 1).reshape(-1)[::2], torch.stack([d, d], 1).reshape(-1)[::2])
    return spec, pool, patterns


@pytest.mark.parametrize("case", FAST_PATH_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_page_run_fast_path_equals_row_coalescing(layout, case):
    """Indices in whole page runs let plans coalesce per page; every descriptor must equal the per-row result
    (device rows strided or split in parts as the case asks, sharded maps, int32 and strided index views)."""
    spec, pool, patterns = _fast_path_pool(layout, case, 3)
    took = set()
    for name, (h, d) in patterns.items():
        fast, slow = Plan(pool.binding, h, d, "never", 1), Plan(pool.binding, h, d, "never", 1)
        slow._page_runs = (None,)  # per-row coalescing only
        for layer in (None, spec.layer_map.device_layers[-1]):
            a, b = fast.submission(layer), slow.submission(layer)
            assert torch.equal(a.host, b.host) and torch.equal(a.dev, b.dev) and torch.equal(a.lens, b.lens), name
        if fast._page_runs is not None and fast._page_runs[0] is not None:  # a segment took the per-page path
            took.add(name)
        runs = name.startswith(("page-runs", "device-runs-shifted")) and spec.page_size > 1
        assert (fast.page_runs is not None) == runs, name
    # the per-page path runs where a layer's rows are adjacent on both sides, never for token-major pages
    if layout in ("layer_first", "page_first_direct") and not (case.strided or case.split_parts) and spec.page_size > 1:
        assert took == {"page-runs", "page-runs-int32", "page-runs-strided-views", "device-runs-shifted"}
    if layout == "page_first":
        assert not took


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_page_run_fast_path_on_contiguous_rows(layout, monkeypatch):
    """Contiguous device rows (the common pool): layouts whose page holds a layer's rows back to back take the
    per-page path, and it equals per-row coalescing."""
    from hicache_core.backends import plans_plan

    pool = _mla_pool(layout, staging="never", ps=16, layers=4, pages=8)
    gen = torch.Generator().manual_seed(5)
    offs = torch.arange(16)
    h, d = ((torch.randperm(8, generator=gen)[:5].unsqueeze(1) * 16 + offs).reshape(-1) for _ in range(2))
    used = []
    real = plans_plan.coalesce
    monkeypatch.setattr(plans_plan, "coalesce", lambda dst, src, nbytes: used.append(nbytes) or real(dst, src, nbytes))
    fast, slow = Plan(pool.binding, h, d, "never", 1), Plan(pool.binding, h, d, "never", 1)
    slow._page_runs = (None,)
    a, b = fast.submission(None), slow.submission(None)
    assert torch.equal(a.host, b.host) and torch.equal(a.dev, b.dev) and torch.equal(a.lens, b.lens)
    per_page = 16 * 1152
    assert (per_page in used) == (layout != "page_first")  # token-major host pages: a layer's rows are not adjacent


@pytest.mark.parametrize("case", FAST_PATH_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_plan_from_the_pools_check_equals_a_plan_that_reads_the_indices(layout, case, monkeypatch):
    """What the pool's check read of an index pair (ranges, page runs) stands in for a plan's own reads of the very
    tensors it checked, and the plan's descriptors are the same; device values the check did not read are still
    range-checked by the plan."""
    from hicache_core.backends import plans_plan
    from hicache_core.errors import HicacheError
    from hicache_core.validate import CheckedPair, check_indices

    spec, pool, patterns = _fast_path_pool(layout, case, 4)
    reads = []
    real = plans_plan._within
    monkeypatch.setattr(plans_plan, "_within", lambda t, n: reads.append(n) or real(t, n))
    checked = 0
    for name, (h, d) in patterns.items():
        for device_values in (True, False):
            try:
                facts = check_indices(spec, h, d, pool.binding.device_rows, device_values=device_values, unique_device=True)
            except HicacheError:
                continue  # the pool would raise before any plan: nothing to stand in for
            checked += 1
            pool.binding.checked = CheckedPair(h, h._version, d, d._version, facts)
            reads.clear()
            taken = Plan(pool.binding, h, d, "never", 1)
            assert reads == ([] if device_values else [pool.binding.device_rows]), name  # only what the check left
            pool.binding.checked = None
            reads.clear()
            own = Plan(pool.binding, h, d, "never", 1)
            assert reads == [spec.capacity, pool.binding.device_rows], name
            assert taken._facts is facts and own._facts is None
            for layer in (None, spec.layer_map.device_layers[-1]):
                a, b = taken.submission(layer), own.submission(layer)
                assert torch.equal(a.host, b.host) and torch.equal(a.dev, b.dev) and torch.equal(a.lens, b.lens), name
            runs_a, runs_b = taken.page_runs, own.page_runs
            assert (runs_a is None) == (runs_b is None), name
            if runs_a is not None and runs_b is not None:
                assert all(torch.equal(x, y) and x.dtype == torch.int64 for x, y in zip(runs_a, runs_b)), name
    assert checked >= 6
    pool.binding.checked = None


@pytest.mark.skipif("layer_first" not in LAYOUTS, reason="needs the layer_first layout plugin")
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_a_plan_builds_later_addresses_from_the_values_it_checked(dtype):
    """A plan builds some addresses on a later call (one table per device row stride, when a layer first needs it).
    It builds them from its own copy of the indices checked at its first call: a caller rewriting its tensors
    behind torch's version counter (through NumPy) afterwards still gets the rows it named then (out-of-range
    values written that way would otherwise reach the copies unchecked; other slots and rows show it here)."""
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64,
                        dtype=torch.bfloat16, page_size=16, capacity=128)
    gen = torch.Generator().manual_seed(6)
    wide = torch.randn(128, 1, 640, generator=gen).to(torch.bfloat16)  # layer 0: rows strided (1280 of 1152 bytes)
    dev = {"kv": [wide[:, :, :576], torch.randn(128, 1, 576, generator=gen).to(torch.bfloat16)]}
    pool = HostKVPool(spec, "layer_first", "direct", dev, registry=REG, strategy="core.direct",
                      strategy_options={"staging": "never"})
    pool.backup_all_layers(torch.arange(32, 64), torch.arange(32))  # host slots 32..63 <- device rows 0..31
    h, d = torch.arange(32, 64, dtype=dtype), torch.arange(96, 128, dtype=dtype)
    canary = [t[:96].clone() for t in dev["kv"]]
    assert pool.load_layer(0, h, d)  # strided rows: no whole-page table yet
    h.numpy()[:] = torch.arange(16).repeat(2).numpy()  # behind torch's back: version unchanged, nothing re-checks
    d.numpy()[:] = torch.arange(64, 96).numpy()
    assert pool.load_layer(1, h, d)  # the plan builds layer 1's table now
    for i, t in enumerate(dev["kv"]):
        assert torch.equal(t[96:128].view(torch.uint8), t[:32].view(torch.uint8)), i
        assert torch.equal(t[:96].view(torch.uint8), canary[i].view(torch.uint8)), i


def test_check_facts_are_only_of_the_checked_tensors_unchanged():
    from hicache_core.validate import CheckedPair, check_indices

    pool = _mla_pool(LAYOUTS[0], staging="never")
    h, d = torch.arange(16, 48), torch.arange(64, 96)
    facts = check_indices(pool.spec, h, d, pool.binding.device_rows, unique_device=True)
    assert torch.equal(facts.host_starts, torch.tensor([16, 32])) and torch.equal(facts.device_starts, torch.tensor([64, 80]))
    assert facts.device_read
    pair = CheckedPair(h, h._version, d, d._version, facts)
    assert pair.facts_of(h, d) is facts
    assert pair.facts_of(h.clone(), d) is None and pair.facts_of(h, d.clone()) is None
    d.add_(0)  # rewritten in place: the check no longer describes it
    assert pair.facts_of(h, d) is None
    assert torch.equal(check_indices(pool.spec, h, torch.arange(65, 97), pool.binding.device_rows).device_starts,
                       torch.tensor([65, 81]))  # device runs need not be aligned
    flipped = check_indices(pool.spec, h, torch.arange(64, 96).flip(0), pool.binding.device_rows)
    assert flipped.device_starts is None and flipped.device_read  # not whole runs: checked, no run starts
    unread = check_indices(pool.spec, h, d, pool.binding.device_rows, device_values=False)
    assert unread.device_starts is None and not unread.device_read
    with torch.inference_mode():
        hi, di = torch.arange(16), torch.arange(16)
    assert CheckedPair(hi, None, di, None, facts).facts_of(hi, di) is None  # no version counter: never trusted


def test_pool_hands_its_check_to_the_plan_of_the_same_call(monkeypatch):
    """A load with new CPU index tensors checks their values once: the plan reads no range again; a call whose
    check the pool skipped (the same tensors again) leaves the plan to read what it needs."""
    from hicache_core.backends import plans_plan

    pool = _mla_pool(LAYOUTS[0], staging="never")
    reads = []
    real = plans_plan._within
    monkeypatch.setattr(plans_plan, "_within", lambda t, n: reads.append(n) or real(t, n))
    seen = []  # what a new plan finds in the binding
    real_init = plans_plan.Plan.__init__
    monkeypatch.setattr(plans_plan.Plan, "__init__",
                        lambda self, binding, *a, **k: (seen.append(binding.checked), real_init(self, binding, *a, **k))[1])
    h, d = torch.arange(32, 64), torch.arange(96, 128)
    assert pool.load_layer(1, h, d)
    assert reads == [] and seen[0] is not None and seen[0].facts_of(h, d) is not None
    assert pool.binding.checked is None  # for that call alone
    pool.binding.scratch["direct.plans"]._slots = []  # the plan is gone; the pool's check memo is not
    assert pool.load_layer(2, h, d)
    assert seen[1] is None and reads == [pool.spec.capacity, pool.binding.device_rows]
    with pytest.raises(IndexRangeError):
        pool.load_layer(1, torch.arange(32, 64), torch.arange(120, 152))  # a failed check leaves nothing behind
    assert pool.binding.checked is None


def test_schedule_calls_counts_the_schedules_runtime_calls_without_building_it():
    """``schedule_calls(n, eager)`` is ``len(batch_schedule(n, eager))`` for every count, both schedules (``auto``
    counts calls with it in each decision); an empty or negative count makes no call."""
    from hicache_core.backends.cudart import batch_schedule, schedule_calls

    for n in [*range(-2, 2200), 3904, 31232, 100_000]:
        for eager in (True, False):
            assert schedule_calls(n, eager) == len(batch_schedule(n, eager)), (n, eager)
    assert schedule_calls(1024, False) == 2 and schedule_calls(1025, False) == 3 and schedule_calls(64) == 4


def test_host_time_estimate_counts_descriptors_and_runtime_calls():
    """The model ``auto`` feeds: ~0.5 us per descriptor plus ~6 us per runtime call of the batch schedule."""
    from hicache_core.backends.cudart import batch_calls, batch_schedule
    from hicache_core.backends.plans import Submission

    for n in (0, 1, 16, 17, 64, 65, 3904, 31232):
        sched = batch_schedule(n)
        assert sum(sched) == n and len(sched) == batch_calls(n)
    assert batch_schedule(64) == [16] * 4 and batch_calls(3904) == 13
    lens = torch.full((3904,), 36864, dtype=torch.int64)
    sub = Submission(lens, lens, lens)
    assert sub.host_us(0.5, 6.0) == pytest.approx(3904 * 0.5 + 13 * 6.0)
    assert sub.smallest_block == 36864 == sub.mean_block


@pytest.mark.skipif("layer_first" not in LAYOUTS or "page_first_kv_split" not in LAYOUTS,
                    reason="needs the layout plugins")
def test_auto_needs_every_block_large_not_just_the_mean():
    """fp8 MLA pages (36 KB) back up through the copy engine (it keeps pace: ~2 ms of submission for
    2.6 ms of transfer); a one-layer load of split latent/rope parts (64 KB and 8 KB blocks, 36 KB on
    average) stays on the kernel, since its 8 KB host-to-device blocks are below the threshold."""
    from hicache_core.backends.auto import AutoStrategy
    from hicache_core.calibration import DEFAULT

    kernel, gen = object(), torch.Generator().manual_seed(1)
    for layout, dtype, to_host, layer, want in (("layer_first", torch.uint8, True, None, "direct"),
                                                ("page_first_kv_split", torch.bfloat16, False, 3, "kernel")):
        spec = PoolSpec.mla(layer_map=LayerMap.unsharded(32), kv_lora_rank=512, qk_rope_head_dim=64, dtype=dtype,
                            page_size=64, capacity=64 * 32)
        dev = {c.name: [torch.zeros(2 * spec.capacity, c.row_bytes, dtype=torch.uint8) for _ in range(32)]
               for c in spec.components}
        pool = HostKVPool(spec, layout, "direct", dev, registry=REG, strategy="core.direct", pin_memory=False)
        pages = torch.randperm(32, generator=gen)
        h = (pages.unsqueeze(1) * 64 + torch.arange(64)).reshape(-1)
        auto = AutoStrategy()
        auto.direct, auto.kernel, auto.calibration = pool.strategy, kernel, DEFAULT
        sub = pool.strategy.submission(pool.binding, h, h + spec.capacity, layer)
        chosen = auto.pick(pool.binding, h, h + spec.capacity, layer, to_host=to_host)
        assert ("direct" if chosen is pool.strategy else "kernel") == want, (layout, sub.smallest_block, sub.mean_block)


PITCH_CASES = [c for c in CASES if c.id in (
    "mla576-bf16-ps16-strided", "mla576-bf16-ps64-splitdev", "mla576-fp8-ps16-sharded5of2r1", "mla-dsa-extra-ps4",
    "mha-bf16-ps16-vdim-strided", "mha-fp32-ps64-sharded3of2r0", "mha-fp16-ps128-drafts")]


@pytest.mark.parametrize("pitched", ["auto", "never"])
@pytest.mark.parametrize("placement", ["separate", "one-allocation", "one-allocation-descending"])
@pytest.mark.parametrize("case", PITCH_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pitched_copies_round_trip(monkeypatch, hicache_device, layout, case, placement, pitched):
    """Device layers carved from one allocation at ascending addresses: all-layer backups move each block
    across the layers as one pitched copy; descending or separately allocated layers (even where the
    allocator spaced them evenly) keep plain descriptors.  Bytes equal the reference and canaries stay
    put either way."""
    if not _served(case, layout):
        pytest.skip(f"{layout} does not hold {case.id}")
    monkeypatch.setenv("HICACHE_DIRECT_PITCHED", pitched)
    monkeypatch.setenv("HICACHE_DIRECT_STAGING", "never")
    seen = []
    real = Plan._plain

    def spy(self, layer):
        sub = real(self, layer)
        seen.append((layer, sub.pitched_count))
        return sub
    monkeypatch.setattr(Plan, "_plain", spy)
    pool = check_strategy(REG, case, layout, "direct", strategy="core.direct", device=hicache_device, placement=placement)
    check_strategy(REG, case, layout, "direct", strategy="core.direct", device=hicache_device, placement=placement,
                   per_layer_backup=True, variant="one-page-i32")
    assert all(k == 0 for layer, k in seen if layer is not None)  # one layer: nothing to span
    all_layers = [k for layer, k in seen if layer is None]
    enabled = pool.binding.scratch["direct.plans"].pitched
    assert all_layers
    if pitched == "never" or placement != "one-allocation":  # one allocation, positive pitches only
        assert set(all_layers) == {0}
    elif enabled:
        assert all(k > 0 for k in all_layers)
    if hicache_device.type == "cpu":  # the CPU runs pitched copies row by row
        assert enabled == (pitched == "auto")
    elif pitched == "auto" and not enabled:
        pytest.skip("round trip bit-exact, but this CUDA runtime has no cudaMemcpy3DBatchAsync: pitched path not run")


def test_pitched_mode_is_validated(monkeypatch):
    with pytest.raises(ConfigError, match="HICACHE_DIRECT_PITCHED"):
        DirectStrategy(pitched="sometimes")
    monkeypatch.setenv("HICACHE_DIRECT_PITCHED", "bogus")
    with pytest.raises(ConfigError, match="use one of auto, never"):
        DirectStrategy()


def test_pitched_submission_counts_operations_rows_and_host_time():
    """61 evenly spaced layers of 64 pages: 64 pitched operations of 61 rows, not 3904 descriptors."""
    from hicache_core.backends.pitched import Pitched
    from hicache_core.backends.plans import PITCHED_OP_US, Submission

    k = 64
    full = lambda v: torch.full((k,), v, dtype=torch.int64)  # noqa: E731
    empty = torch.empty(0, dtype=torch.int64)
    sub = Submission(empty, empty, empty, pitched=Pitched(full(0), full(0), full(73728), full(61), full(1 << 20), full(-(1 << 21))))
    assert (sub.count, sub.blocks, sub.nbytes) == (64, 64 * 61, 64 * 61 * 73728)
    assert sub.smallest_block == 73728 and sub.mean_block == 73728
    assert sub.host_us(0.5, 6.0) == pytest.approx(64 * PITCHED_OP_US + 4 * 6.0)


def test_queue_clock_submits_in_one_call_only_while_the_engine_is_certainly_busy():
    """Small calls first on an idle stream; one call per 512 descriptors in a burst (a submission right after
    the previous one while its copies may still run, or within TIGHT_GAP_US, 50 us) or once the copies queued earlier
    (drained no faster than 64 GB/s) outlast the host time of the submission; streams are separate."""
    from hicache_core.backends.cudart import batch_schedule
    from hicache_core.backends.memcpy import TIGHT_GAP_US, QueueClock

    t = [100.0]
    clock = QueueClock(now=lambda: t[0])
    assert clock.eager(7, 50.0)  # nothing queued yet
    clock.queued(7, 64_000 * 300, since=t[0] - 50e-6)  # 19.2 MB: at least 300 us of work, ended now
    assert not clock.eager(7, 1.0) and clock.eager(8, 1.0)  # back to back on stream 7: a burst
    t[0] += 150e-6  # past the burst gap; 100 us of queued work left
    assert not clock.eager(7, 50.0) and clock.eager(7, 150.0) and clock.eager(8, 1.0)
    t[0] += 60e-6
    assert clock.eager(7, 50.0) and not clock.eager(7, 30.0)  # 40 us left
    clock.queued(7, 64_000 * 100, since=t[0])  # queued behind the rest: 140 us left
    t[0] += 101e-6
    assert not clock.eager(7, 30.0) and clock.eager(7, 40.0)  # 39 us left
    t[0] += 1.0
    assert clock.eager(7, 0.0)  # long drained, long idle
    clock.queued(7, 64, since=t[0])  # a tiny submission just ended
    assert not clock.eager(7, 1.0) and clock.eager(7, 1.0, burstable=False)  # a large one still starts small
    # one load, then a wait for its copies, then the next: the engine is idle again, so small calls first
    t[0] += 1.0
    clock.queued(7, 64_000 * 100, since=t[0] - 40e-6)  # 6.4 MB (>= 100 us of work) took 40 us to submit
    t[0] += 35e-6  # 35 us after the submission ended: 25 us of work may remain
    assert not clock.eager(7, 80.0)
    t[0] += 35e-6  # 70 us after it: drained, though within the burst gap
    assert clock.eager(7, 80.0)
    clock.queued(7, 64, since=t[0])  # a tiny submission; the engine drains it at once
    t[0] += 10e-6  # called again right away: a loop of calls, not a wait
    assert not clock.eager(7, 80.0) and clock.eager(7, 80.0, burstable=False)
    t[0] += (TIGHT_GAP_US - 11) * 1e-6  # 1 us short of the tight gap: still a loop of calls
    assert not clock.eager(7, 80.0)
    t[0] += 2e-6  # past the tight gap with nothing queued
    assert clock.eager(7, 80.0)
    assert batch_schedule(64, eager=False) == [64] and batch_schedule(1200, eager=False) == [512, 512, 176]
    assert batch_schedule(0, eager=False) == []


def test_queue_clock_keeps_a_host_bound_burst_in_whole_calls_with_a_caller_between_submissions():
    """The H100 case (docs/perf/runs.md, second H100 run): one-layer loads of 4.7 MB, each submission taking 95 us of
    host time (longer than the clock's drain estimate of its copies, ~74 us) and ``auto``'s lane around each adding
    ~30 us between one submission's end and the next one's start.  Every submission after the first stays in one
    runtime call (with a 20 us tight gap all 60 would start with small calls here; on the H100 host about 59 of 61
    did); a pause past BURST_GAP_US with the queue drained starts small again."""
    from hicache_core.backends.memcpy import BURST_GAP_US, QueueClock

    t = [10.0]
    clock = QueueClock(now=lambda: t[0])
    eager = []
    for _ in range(61):
        since = t[0]
        eager.append(clock.eager(3, 79.0, burstable=True))
        t[0] += 95e-6  # the submission's host time
        clock.queued(3, 4_718_592, since)
        t[0] += 30e-6  # auto's lane and the caller's loop before the next load
    assert eager[0] and not any(eager[1:])
    t[0] += BURST_GAP_US * 1e-6
    assert clock.eager(3, 79.0, burstable=True)


def test_a_load_within_the_tight_gap_of_the_last_calls_end_is_not_lone_even_when_the_queue_drained():
    """auto's lone-load rule reads the same clock: a host-bound burst (each call's copies drained before the next call,
    ~30 us of caller between calls, as on the H100 host) stays a burst, so no layer mid-burst is sent to the kernel as
    a lone load; a load TIGHT_GAP_US (50 us) or more after the last call's end, with the queue drained, is lone."""
    from hicache_core.backends.memcpy import TIGHT_GAP_US, QueueClock

    t = [5.0]
    clock = QueueClock(now=lambda: t[0])
    clock.queued(9, 640_000, since=t[0] - 95e-6)  # 10 us of copies at the drain estimate, submitted in 95 us
    t[0] += 30e-6
    assert clock.idle(9) and not clock.lone(9, t[0])  # drained, but 30 us after the call: part of the loop
    t[0] += (TIGHT_GAP_US - 30 - 2) * 1e-6
    assert not clock.lone(9, t[0])  # 2 us short of the tight gap: still the loop
    t[0] += 3e-6
    assert clock.lone(9, t[0])  # past the tight gap: lone
    assert TIGHT_GAP_US > 30  # the H100 case above is a burst


def test_queue_clock_forgets_quiet_streams_past_its_bound_and_answers_the_same():
    """A caller making a new stream per call does not grow the clock without bound: past MAX_CLOCK_STREAMS, a new
    stream's entry drops the streams that are idle and quiet past every gap (they answer as never seen), and keeps
    those still busy or recent."""
    from hicache_core.backends.memcpy import MAX_CLOCK_STREAMS, QueueClock

    t = [50.0]
    clock = QueueClock(now=lambda: t[0])
    busy = 10**6
    clock.queued(busy, 64_000 * 10**9, since=t[0])  # 1000 s of queued copies: busy long after the rest
    for s in range(MAX_CLOCK_STREAMS - 1):
        t[0] += 1.0  # each earlier one quiet by the time the next comes
        clock.queued(s, 64, since=t[0])
    recent = MAX_CLOCK_STREAMS - 2
    assert len(clock._last_end) == MAX_CLOCK_STREAMS
    t[0] += 50e-6  # the last stream is still recent (within the burst gap) at the next submission
    answers = {s: (clock.eager(s, 1.0), clock.idle(s), clock.lone(s, t[0])) for s in (0, recent, busy)}
    clock.queued(10**7, 64, since=t[0])  # a new stream past the bound: the quiet ones go
    assert set(clock._last_end) == set(clock._until) == {busy, recent, 10**7}
    assert not clock.idle(busy) and clock.backlog_us(busy, t[0]) > 0
    assert all((clock.eager(s, 1.0), clock.idle(s), clock.lone(s, t[0])) == answers[s] for s in (recent, busy))
    fresh = QueueClock(now=lambda: t[0])
    assert (clock.eager(0, 1.0), clock.idle(0), clock.lone(0, t[0])) == (
        fresh.eager(0, 1.0), fresh.idle(0), fresh.lone(0, t[0])) == answers[0]
    clock.queued(0, 64, since=t[0])  # a known stream again: no sweep needed below the bound
    assert len(clock._last_end) == 4


def test_queue_clock_sweep_survives_a_stream_added_while_it_runs():
    """Another thread's queued() may add a stream while _forget_quiet sweeps (a thread switch can come between any
    two bytecodes of a loop written in Python): the sweep reads a snapshot, never the live dict.  The switch is made
    here by a trace hook at the sweep's first quiet-check."""
    import inspect
    import sys

    from hicache_core.backends import memcpy
    from hicache_core.backends.memcpy import MAX_CLOCK_STREAMS, QueueClock

    t = [50.0]
    clock = QueueClock(now=lambda: t[0])
    for s in range(MAX_CLOCK_STREAMS):
        t[0] += 1.0
        clock.queued(s, 64, since=t[0])
    src, first = inspect.getsourcelines(memcpy.QueueClock._forget_quiet)
    line = first + next(i for i, text in enumerate(src) if "now - end > quiet" in text)
    added = []

    def trace(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "line" and frame.f_lineno == line and frame.f_code.co_filename == memcpy.__file__ and not added:
            added.append(10**8)
            clock._last_end[10**8] = t[0]  # the other thread's new stream, mid-sweep
        return trace

    t[0] += 1.0
    sys.settrace(trace)
    try:
        clock.queued(10**7, 64, since=t[0])  # past the bound: the sweep runs
    finally:
        sys.settrace(None)
    assert added, "the trace hook never ran inside the sweep"
    assert 10**7 in clock._last_end and 10**8 in clock._last_end and 0 not in clock._last_end


@pytest.mark.parametrize("version", [12080, 13000])
def test_copy_batch_not_eager_makes_the_fewest_calls(version):
    rt, calls = _fake_runtime(version)
    d, s, z = (torch.arange(600, dtype=torch.int64) * k for k in (8, 16, 1))
    rt.copy_batch(d, s, z + 1, stream=5, eager=False)
    assert [c[3] for c in calls] == [512, 88] and {c[4] for c in calls} == {5}


def _fake_runtime_3d(version: int, fail_at_call: int | None = None, err: int = 801):
    """A CudaRuntime whose 3D batch entry point records each call (the 12.8 signature carries failIdx)."""
    rt, calls = _fake_runtime(version)
    calls3d = []

    def batch3d(count, ops, *rest):
        calls3d.append((count, ops, rest))
        return err if fail_at_call is not None and len(calls3d) - 1 == fail_at_call else 0
    rt._batch3d = batch3d
    rt.cleared = []  # type: ignore[attr-defined]
    rt._lib = type("Lib", (), {"cudaGetErrorString": staticmethod(lambda code: b"operation not supported"),
                               "cudaGetLastError": staticmethod(lambda: rt.cleared.append(1) or 0)})()
    return rt, calls, calls3d


@pytest.mark.parametrize("eager", [True, False])
def test_copy_3d_batch_follows_the_schedule_and_signature(eager):
    from hicache_core.backends.cudart import batch_schedule
    from hicache_core.backends.pitched import OP_WORDS

    rt, _, calls3d = _fake_runtime_3d(13000)
    ops = torch.zeros((600, OP_WORDS), dtype=torch.int64)
    rt.copy_3d_batch(ops, stream=0, eager=eager)
    assert [c[0] for c in calls3d] == batch_schedule(600, eager)
    starts = [c[1] - ops.data_ptr() for c in calls3d]
    counts = [c[0] for c in calls3d]
    assert starts == [OP_WORDS * 8 * sum(counts[:i]) for i in range(len(counts))]  # 112 bytes per operation
    assert {rest for _, _, rest in calls3d} == {(0, 2)}  # flags, the per-thread stream for stream 0


class _FakeLib:
    """The few libcudart symbols CudaRuntime binds, at a given runtime and driver version."""

    def __init__(self, version: int) -> None:
        def set_version(ref) -> int:
            ref._obj.value = version
            return 0
        noop = lambda *a: 0  # noqa: E731
        self.cudaRuntimeGetVersion = lambda ref: set_version(ref)
        self.cudaDriverGetVersion = lambda ref: set_version(ref)
        self.cudaGetErrorString = lambda *a: b""
        self.cudaMemcpyAsync = self.cudaMemcpyBatchAsync = noop
        self.cudaMemcpy3DBatchAsync = lambda *a: 0
        self.cudaGetLastError = lambda: 0


@pytest.mark.parametrize("version, pitched", [(12080, False), (12090, False), (13000, True), (13020, True)])
def test_pitched_copies_need_a_cuda_13_runtime(version, pitched):
    """The 3D batch call exists since 12.8, but its operations were verified only on CUDA 13: older
    runtimes keep plain descriptors (the batch call itself still serves them)."""
    from hicache_core.backends.cudart import CudaRuntime

    rt = CudaRuntime(_FakeLib(version), "fake")
    assert (rt.version, rt.has_batch, rt.has_batch3d) == (version, True, pitched)


def _cuda_copier(monkeypatch, rt):
    from hicache_core.backends import memcpy

    monkeypatch.setattr(memcpy, "runtime", lambda: rt)
    monkeypatch.setattr(memcpy.BatchCopier, "_on_device", lambda self, fn: fn())
    return memcpy.BatchCopier(torch.device("cuda", 0))


def test_pitched_copies_fall_back_to_rows_when_the_runtime_refuses_them(monkeypatch, caplog):
    """A first 3D call that fails queued nothing: the same rows go as plain descriptors, now and later."""
    from hicache_core.backends.pitched import Pitched, ops_tensor

    rt, calls, calls3d = _fake_runtime_3d(13000, fail_at_call=0)
    copier = _cuda_copier(monkeypatch, rt)
    k = torch.arange(3, dtype=torch.int64)
    p = Pitched(1000 + k * 64, 9000 + k * 64, torch.full((3,), 64), torch.full((3,), 4), torch.full((3,), 4096),
                torch.full((3,), 8192))
    with caplog.at_level("WARNING"):
        copier.copy_pitched(p, lambda: ops_tensor(p, to_host=True), to_host=True, stream=5)
    assert len(calls3d) == 1 and sum(c[3] for c in calls) == 12
    assert "refused pitched copies" in caplog.text
    copier.copy_pitched(p, lambda: ops_tensor(p, to_host=True), to_host=True, stream=5)
    assert len(calls3d) == 1 and sum(c[3] for c in calls) == 24  # not asked again


def test_pitched_copies_raise_when_a_later_call_fails(monkeypatch):
    """A failure after some operations were queued cannot be undone: it raises, saying how many were queued."""
    from hicache_core.backends.cudart import BatchSubmitError
    from hicache_core.backends.pitched import Pitched, ops_tensor

    rt, calls, calls3d = _fake_runtime_3d(13000, fail_at_call=1)
    copier = _cuda_copier(monkeypatch, rt)
    n = 40
    k = torch.arange(n, dtype=torch.int64)
    p = Pitched(k * 64, k * 64, torch.full((n,), 64), torch.full((n,), 2), torch.full((n,), 1 << 20), torch.full((n,), 1 << 20))
    with pytest.raises(BatchSubmitError, match="16 of the 40 copies of this call were queued by earlier runtime "
                                               "calls") as err:
        copier.copy_pitched(p, lambda: ops_tensor(p, to_host=False), to_host=False, stream=5)
    assert err.value.submitted == 16 and not calls  # no plain fallback after a partial submission
    assert rt.cleared == [1]  # the runtime's last error reset: torch would raise it after its next kernel launch


def test_copier_reads_the_current_stream_through_torchs_raw_accessor_or_the_public_api(monkeypatch):
    """Per call the copier asks for the pool device's current stream: the raw handle where torch has the
    accessor (no Stream object built), the public API where it has not; both name the pool's device."""
    from types import SimpleNamespace

    from hicache_core import kernel_support
    from hicache_core.backends.memcpy import BatchCopier

    copier = BatchCopier(torch.device("cuda", 2))  # an explicit index: no CUDA call at construction
    monkeypatch.setattr(kernel_support, "_RAW_STREAM", lambda index: 1000 + index)
    monkeypatch.setattr(kernel_support, "_GET_DEVICE", lambda: 3)
    assert copier.stream() == 1002 and kernel_support.current_device_index() == 3
    monkeypatch.setattr(kernel_support, "_RAW_STREAM", None)
    monkeypatch.setattr(kernel_support, "_GET_DEVICE", None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index: SimpleNamespace(cuda_stream=70 + index))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    assert copier.stream() == 72 and kernel_support.current_device_index() == 5
    assert BatchCopier(torch.device("cpu")).stream() == 0


def test_tiny_copy_engine_blocks_are_reported_once_per_pool_on_cuda(caplog):
    """A CUDA pool whose transfer goes to the copy engine as hundreds of blocks of a few hundred bytes
    logs once that ``auto`` would use the kernel there; large or few blocks, and CPU pools, stay quiet."""
    import logging
    from types import SimpleNamespace

    from hicache_core.backends.plans import WARN_BLOCKS, WARN_MEAN_BLOCK, warn_small_blocks

    def binding(device: str):
        return SimpleNamespace(device=torch.device(device), scratch={}, layout=SimpleNamespace(name="page_first"))

    tiny = SimpleNamespace(blocks=4096, mean_block=1152.0)
    caplog.set_level(logging.WARNING, logger="hicache_core.backends.plans")
    cuda = binding("cuda")
    assert warn_small_blocks(cuda, tiny, 3)
    assert "layer 3" in caplog.text and "'page_first'" in caplog.text and "4096 blocks of 1152 bytes" in caplog.text
    assert "io_backend='auto'" in caplog.text
    assert not warn_small_blocks(cuda, tiny, None)  # once per pool
    assert caplog.text.count("hicache direct:") == 1
    assert not warn_small_blocks(binding("cpu"), tiny, 3)
    assert not warn_small_blocks(binding("cuda"), SimpleNamespace(blocks=4096, mean_block=float(WARN_MEAN_BLOCK)), 3)
    assert not warn_small_blocks(binding("cuda"), SimpleNamespace(blocks=WARN_BLOCKS - 1, mean_block=64.0), 3)
    assert caplog.text.count("hicache direct:") == 1


@pytest.mark.skipif("page_first" not in LAYOUTS, reason="needs the page_first layout plugin")
def test_transfers_vet_each_submission_once(monkeypatch):
    """The small-block check runs on a submission's first transfer only, not on every call of a burst."""
    from hicache_core.backends import direct as direct_mod

    seen: list[int | None] = []
    monkeypatch.setattr(direct_mod, "warn_small_blocks", lambda binding, sub, layer: seen.append(layer) or False)
    pool = _mla_pool("page_first", staging="never", ps=16, layers=4, pages=8)
    h = torch.arange(64)
    d = torch.arange(64, 128)
    for _ in range(3):
        for layer in (0, 1):
            pool.load_layer(layer, h, d)
    pool.backup_all_layers(h, d)
    pool.backup_all_layers(h, d)
    assert seen == [0, 1, None]


@pytest.mark.parametrize("nbytes", [1, 8, 576])
def test_coalesce_small_and_vectorised_paths_agree(monkeypatch, nbytes):
    """Short descriptor lists are merged in Python, long ones with torch: the same runs either way
    (random orders, runs of every length, nothing merging, one copy)."""
    from hicache_core.backends import plans, plans_submission

    gen = torch.Generator().manual_seed(nbytes)
    for trial in range(200):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        step = torch.where(torch.rand(n, generator=gen) < (trial % 4) / 4, nbytes, 3 * nbytes).to(torch.int64)
        dst = torch.cumsum(step, 0) + 1000
        src = torch.cumsum(torch.where(torch.rand(n, generator=gen) < 0.8, step, 2 * nbytes), 0)
        monkeypatch.setattr(plans_submission, "SMALL_COALESCE", 512)
        small = plans.coalesce(dst, src, nbytes)
        monkeypatch.setattr(plans_submission, "SMALL_COALESCE", 0)
        wide = plans.coalesce(dst, src, nbytes)
        assert all(torch.equal(a, b) and a.dtype == torch.int64 for a, b in zip(small, wide))
        assert int(small[2].sum()) == n * nbytes
        assert small[0].data_ptr() != dst.data_ptr()  # never a view of the caller's tensors


class _Candidate:
    """A stand-in for ``auto``'s candidates: records what it serves; the kernel may have fast loads (TMA or page
    loads; not for layer 3) and a lane (``lane_ok``: what its lane answers)."""

    def __init__(self, name: str, served: list, tma: bool | None = None, lane_ok: bool | None = None) -> None:
        self.name, self.served = name, served
        if tma is not None:
            self.fast_load = lambda binding, layer, n: tma and layer != 3
        if lane_ok is not None:
            self.lane = lambda binding, to_host: (
                lambda layer, h, d: served.append((name + " lane", layer)) or lane_ok)

    def load(self, binding, h, d, layer):
        self.served.append((self.name, layer))

    def backup(self, binding, h, d, layer):
        self.served.append((self.name + " backup", layer))


class _AutoWorld:
    """A CUDA-looking binding (stream 0x77, one 1152-byte row per token and layer, 4 layers), a settable clock
    and ``auto`` strategies over :class:`_Candidate` s whose block-size rule always says ``direct``."""

    def __init__(self, monkeypatch) -> None:
        import types

        from hicache_core.backends import auto as auto_mod
        from hicache_core.backends.memcpy import DRAIN_BYTES_PER_US

        self.monkeypatch, self.served, self.t = monkeypatch, [], [100.0]
        spec = types.SimpleNamespace(bytes_per_token=4 * 1152, layer_map=types.SimpleNamespace(device_layers=range(4)))
        self.binding = types.SimpleNamespace(device=torch.device("cuda", 0), spec=spec, scratch={})
        self.on_cpu = types.SimpleNamespace(device=torch.device("cpu"), spec=spec, scratch={})
        monkeypatch.setattr(auto_mod, "current_stream_handle", lambda index: 0x77)
        self.layer_s = 64 * 1152 / DRAIN_BYTES_PER_US * 1e-6  # one 64-token layer at the clock's drain rate

    def make(self, tma: bool | None, lane_ok: bool | None = None, where=None, lone: bool = True,
             direct_lane: bool | None = None, forward: str = "compute"):
        from hicache_core.backends.auto import AutoStrategy
        from hicache_core.backends.memcpy import QueueClock

        auto = AutoStrategy(lone=lone, forward=forward)
        auto.direct = _Candidate("direct", self.served, lane_ok=direct_lane)
        auto.kernel = _Candidate("kernel", self.served, tma, lane_ok)
        auto.clock = QueueClock(now=lambda: self.t[0])
        auto._arm(where or self.binding)  # what prepare does after preparing both candidates
        self.monkeypatch.setattr(auto, "pick", lambda b, hh, dd, layer, to_host: auto.direct)
        return auto


def test_auto_sends_a_lone_tma_load_to_the_kernel_and_the_rest_of_a_burst_by_its_rule(monkeypatch):
    """A one-layer load on a stream where nothing ``auto`` queued may still run, not issued right after the last
    call, goes to a kernel whose load of that layer is TMA only; loads that follow while it may run or in a loop,
    all-layer loads, backups and kernels without TMA loads go by the block-size rule (``pick``).  The clock books
    both candidates' bytes."""
    from hicache_core.backends.memcpy import TIGHT_GAP_US

    w = _AutoWorld(monkeypatch)
    binding, served, t = w.binding, w.served, w.t
    h, d = torch.arange(64), torch.arange(64)
    auto = w.make(True)
    for layer in range(4):  # a burst: the first load finds the stream idle, the others follow it at once
        auto.load(binding, h, d, layer)
    assert served == [("kernel", 0), ("direct", 1), ("direct", 2), ("direct", 3)] and auto.lone_kernel_loads == 1
    t[0] += 3.5 * w.layer_s  # not all four layers' bytes drained yet
    auto.load(binding, h, d, 1)
    t[0] += 2 * w.layer_s  # now they have, but the last call ended microseconds ago: a loop of calls
    auto.load(binding, h, d, 1)
    t[0] += 3 * w.layer_s + TIGHT_GAP_US * 1e-6  # drained, and a pause since the last call: lone
    auto.load(binding, h, d, 1)
    auto.load(binding, h, d, None)  # all layers: the rule, even right after a lone load is done
    assert served[4:] == [("direct", 1), ("direct", 1), ("kernel", 1), ("direct", None)]
    t[0] += 10 * w.layer_s
    auto.backup(binding, h, d, 2)
    auto.load(binding, h, d, 3)  # idle, but the kernel would load layer 3 with its row kernel
    assert served[8:] == [("direct backup", 2), ("direct", 3)]
    served.clear()
    t[0] += 10 * w.layer_s
    plain = w.make(None)  # a kernel without TMA loads: always the rule
    plain.load(binding, h, d, 0)
    cpu = w.make(True, where=w.on_cpu)
    cpu.load(w.on_cpu, h, d, 0)
    off = w.make(True, lane_ok=True, lone=False)  # the option: the block-size rule for every call
    off.load(binding, h, d, 0)
    assert not off.lane(binding, False)(0, h, d)  # no lone route, nothing memoised
    assert served == [("direct", 0)] * 3 and plain.lone_kernel_loads == cpu.lone_kernel_loads == off.lone_kernel_loads == 0
    from hicache_core.backends.auto import AutoStrategy

    with pytest.raises(ConfigError, match="lone"):
        AutoStrategy(lone="yes")




def _watch(t: list, ms: list, done: list, log: list) -> Any:
    from hicache_core.backends.forward import ForwardWatch

    return ForwardWatch(55.0, now=lambda: t[0], event=lambda: FakeEvent(log, done, ms), stream=lambda i: ("stream", i))


def test_the_forward_watch_turns_timed_lone_loads_into_a_verdict_that_holds_until_renewed():
    from hicache_core.backends.forward import IDLE_SHARE, MIN_TIMED_BYTES, RENEW_S, ForwardWatch
    t, ms, done, log = [10.0], [0.0], [False], []
    watch = _watch(t, ms, done, log)
    big = 4 << 20  # 76 us at 55 GB/s
    assert not watch.memory_bound() and watch.generation == 0
    assert watch.due(big) and not watch.due(MIN_TIMED_BYTES - 1)  # small loads are never timed
    assert watch.timed(lambda: False, big, 0) is False and log == [("stream", 0)] * 2 and watch.due(big)  # no launch
    assert watch.timed(lambda: "launched", big, 3) == "launched" and log[-2:] == [("stream", 3)] * 2
    assert not watch.due(big) and not watch.memory_bound()  # pending: no second timing, no verdict yet
    assert watch.timed(lambda: "again", big, 3) == "again" and len(log) == 4  # its events are in use: just launched
    ms[0], done[0] = 0.3, True  # 4 MiB in 300 us: 0.25 of the link
    assert watch.memory_bound() and watch.generation == 1 and watch.timings == 1
    assert watch.last_share == pytest.approx(big / 0.3 / 55e6)
    assert watch.room() == pytest.approx(IDLE_SHARE / watch.last_share)  # the kernel's slowdown: ~3.4x
    t[0] += RENEW_S * 0.9
    assert not watch.due(big) and watch.memory_bound()  # the verdict holds ...
    t[0] += RENEW_S * 0.2
    assert watch.due(big) and watch.memory_bound()  # ... until it is renewed by the next timing
    done[0] = False
    watch.timed(lambda: None, big, 0)
    ms[0], done[0] = 0.08, True  # 0.95 of the link: compute-bound again
    assert watch.generation == 2 and not watch.memory_bound() and watch.timings == 2 and watch.room() == 1.0
    assert watch.due(big)  # beside compute every lone kernel load is timed: a change shows at the next one
    done[0] = False

    def launch() -> None:  # the call's own host work after the start event: 0.7 ms, taken off the 0.78 ms measured
        t[0] += 0.7e-3

    watch.timed(launch, big, 0)
    ms[0], done[0] = 0.78, True
    assert watch.last_share == pytest.approx(big / 0.08 / 55e6) and not watch.memory_bound() and watch.generation == 2
    done[0], t[0] = False, t[0] + RENEW_S
    watch.timed(launch, big, 0)
    ms[0], done[0] = 0.5, True  # more host time (0.7 ms) than measured: no measure of the load, dropped
    assert watch.due(big) and watch.dropped == 1 and watch.timings == 3 and watch.generation == 2
    for share, verdict in ((0.65, False), (0.55, True), (0.65, True), (0.69, True), (0.71, False)):
        done[0] = False  # between SLOW_SHARE and FAST_SHARE a timing keeps the verdict, whichever it is
        t[0] += RENEW_S
        watch.timed(lambda: None, big, 0)
        ms[0], done[0] = big / (share * 55e6), True
        assert watch.memory_bound() is verdict and watch.last_share == pytest.approx(share), share
    assert watch.generation == 4 and watch.timings == 8
    for share, verdict in ((0.6 - 1e-9, True), (0.7 - 1e-9, True), (0.7 + 1e-9, False), (0.6 + 1e-9, False)):
        done[0], t[0] = False, t[0] + RENEW_S  # the lines themselves
        watch.timed(lambda: None, big, 0)
        ms[0], done[0] = big / (share * 55e6), True
        assert watch.memory_bound() is verdict, share
    steps = _watch(t, ms, done, log)  # while memory-bound, a room that moved by ROOM_STEP moves the generation too
    for share, gen in ((0.1, 1), (0.2, 2), (0.25, 2), (0.5, 3), (0.55, 3), (0.65, 3), (0.9, 4)):
        done[0], t[0] = False, t[0] + RENEW_S  # rooms 8, 4.35 (/1.84), 3.48 (/1.25), 1.74 (/2.5), 1.58, 1.34, compute
        steps.timed(lambda: None, big, 0)
        ms[0], done[0] = big / (share * 55e6), True
        assert steps.generation == gen, share
    floor = ForwardWatch(55.0, now=lambda: t[0], event=lambda: FakeEvent(log, done, ms), stream=lambda i: ("stream", i),
                         min_room=2.2)
    for share, room in ((0.8, 1.0), (0.55, 2.2), (0.2, IDLE_SHARE / 0.2), (0.05, 8.0)):  # compute: 1; memory: 2.2-8
        done[0], t[0] = False, t[0] + RENEW_S
        floor.timed(lambda: None, big, 0)
        ms[0], done[0] = big / (share * 55e6), True
        assert floor.room() == pytest.approx(room), share


def test_the_forward_watch_lends_its_events_to_one_timing_at_a_time_and_reads_them_before_lending_them_again():
    """A timing started while another is being recorded (another thread) or pending just launches; a pending timing
    is read while it still holds the events (a thread landing it cannot read events another thread re-records)."""
    t, ms, done, log = [10.0], [0.1], [False], []
    watch = _watch(t, ms, done, log)
    big = 4 << 20
    inner: list = []

    def outer() -> str:  # another thread's timing starts while this one is being recorded
        inner.append(watch.timed(lambda: "inner", big, 0))
        return "outer"

    assert watch.timed(outer, big, 0) == "outer" and inner == ["inner"] and len(log) == 2  # one pair recorded
    assert watch.timed(lambda: "busy", big, 0) == "busy" and len(log) == 2  # pending: its events are in use
    held = []
    real = FakeEvent.elapsed_time

    def elapsed(self: FakeEvent, other: FakeEvent) -> float:
        held.append(watch._pending is not None)  # still claimed while it is read
        return real(self, other)

    FakeEvent.elapsed_time = elapsed  # type: ignore[method-assign]
    try:
        done[0] = True
        assert watch.due(big) and held == [True] and watch.timings == 1
    finally:
        FakeEvent.elapsed_time = real  # type: ignore[method-assign]
    assert watch.timed(lambda: False, big, 0) is False and watch.due(big)  # a declined launch leaves nothing pending


def test_auto_watching_the_forward_pass_times_lone_kernel_loads_and_loads_by_the_verdict(monkeypatch):
    """``forward="watch"``: a lone load the kernel would serve is timed; while the verdict says memory-bound, lone
    loads go by the rule of the rest (here: ``direct``) except one per RENEW_S that renews it through the kernel, and
    loads get the memory room; the lane serves lone loads as load() would (timing those due) and declines once the verdict
    changed.  Pools
    without the lone-load rule keep no watch; ``lone=False`` is refused."""
    from hicache_core.backends.auto import MEMORY_KERNEL_SHARE, AutoStrategy
    from hicache_core.backends.auto_rules import pick_key
    from hicache_core.backends.forward import MAX_ROOM, RENEW_S, ForwardWatch

    w = _AutoWorld(monkeypatch)
    binding, served, t = w.binding, w.served, w.t
    h, d = torch.arange(4096), torch.arange(4096)  # 4.7 MB per layer: timed
    auto = w.make(True, lane_ok=True, direct_lane=True)
    assert auto.watch is None  # forward="compute": nothing watched
    with pytest.raises(ConfigError, match="forward='watch' times lone loads through the kernel: it needs lone=True"):
        AutoStrategy(forward="watch", lone=False)
    auto = AutoStrategy(forward="watch")
    assert auto.lone and auto.room == 1.0
    auto = w.make(True, lane_ok=True, direct_lane=True, forward="watch")
    assert isinstance(auto.watch, ForwardWatch) and auto.watch.min_room == pytest.approx(1 / MEMORY_KERNEL_SHARE)
    ms, done, log = [0.0], [False], []
    auto.watch = _watch(t, ms, done, log)
    assert w.make(True, where=w.on_cpu, forward="watch").watch is None  # a CPU pool keeps no clock: no watch (acts as compute)

    auto.load(binding, h, d, 0)  # lone: the kernel, timed
    assert served == [("kernel", 0)] and len(log) == 2 and auto.lone_kernel_loads == 1
    ms[0], done[0] = 1.0, True  # 4.7 MB in 1 ms: 0.09 of the link
    assert auto.watch.memory_bound() and auto.room == MAX_ROOM  # the kernel slowed ~10x: the most room
    drained = 70 * w.layer_s  # a 4096-token layer's bytes drained, and a pause: the next call is lone
    t[0] += drained
    assert auto.clock.lone(0x77, t[0])
    auto.load(binding, h, d, 1)  # lone, but memory-bound and not due: the rule of the rest
    assert served[-1] == ("direct", 1) and len(log) == 2
    assert auto._watch_moved() and not auto._watch_moved()  # what pick() asks first: the verdict moved once
    lane = auto.lane(binding, False)
    t[0] += drained
    assert auto.clock.lone(0x77, t[0])
    assert not lane(1, h, d) and served[-1] == ("direct", 1)  # lone, memory-bound, not due, nothing memoised: declined
    for layer in (1, 2):
        auto._picks[pick_key(h, d, layer, False)] = auto.direct  # (pick is stubbed here: the memo by hand)
    assert lane(1, h, d) and served[-1] == ("direct lane", 1)  # lone beside memory-bound work: the memoised route
    auto.load(binding, h, d, 2)  # right after a call: not lone, the memoised route
    assert lane(2, h, d) and served[-1] == ("direct lane", 2)
    t[0] += RENEW_S  # the verdict is due for renewal: the next lone load goes to the kernel's lane, timed
    done[0] = False
    assert auto.clock.lone(0x77, t[0]) and lane(0, h, d) and served[-1] == ("kernel lane", 0) and len(log) == 4
    assert auto.lone_kernel_loads == 2
    ms[0], done[0] = 0.09, True  # 0.95 of the link: compute-bound
    assert lane(2, h, d) is False  # the verdict changed: the normal path decides again
    assert not auto.watch.memory_bound() and auto.room == 1.0
    assert auto._watch_moved()  # (what pick() does first on the normal path)
    t[0] += drained
    done[0] = False
    assert lane(0, h, d) and served[-1] == ("kernel lane", 0) and len(log) == 6  # beside compute every lone load: timed
    t[0] += drained
    assert lane(0, h, d) and served[-1] == ("kernel lane", 0) and len(log) == 6  # one pending: launched, not timed
    done[0], t[0] = True, t[0] + drained
    auto.load(binding, h, d, 0)  # the normal path times a lone load alike
    assert served[-1] == ("kernel", 0) and len(log) == 8 and auto.lone_kernel_loads == 5
    assert auto.watch.timings == 3 and not auto.watch.memory_bound()
    small = torch.arange(64)  # 74 KB: never timed; beside compute a lone one takes the kernel's lane untimed
    t[0] += drained
    assert lane(0, small, small) and served[-1] == ("kernel lane", 0) and len(log) == 8 and auto.lone_kernel_loads == 6
    declining = w.make(True, lane_ok=False, direct_lane=True, forward="watch")  # the kernel's lane declines
    declining.watch = _watch(t, ms, done, log)
    decl = declining.lane(binding, False)
    t[0] += drained
    assert not decl(0, h, d) and served[-1] == ("kernel lane", 0)  # tried, declined: the normal path takes the call
    assert declining.watch._pending is None and declining.lone_kernel_loads == 0  # nothing pending, counted ...
    assert declining.clock.lone(0x77, t[0])  # ... or booked
    declining.kernel.lane = None
    assert declining.lane(binding, False)(0, h, d) is False and declining.lone_kernel_loads == 0  # no kernel lane


def test_auto_lane_is_the_lane_of_the_candidate_load_would_take(monkeypatch):
    """``auto``'s fast path takes the kernel's lane exactly where :meth:`load` would send a lone load to the kernel,
    and otherwise the lane of the candidate memoised for these tensors; it books the bytes only when that lane
    launched, and declines everything else (the normal path decides), bad arguments included."""
    from hicache_core.backends.auto_rules import pick_key

    w = _AutoWorld(monkeypatch)
    served, t = w.served, w.t
    h, d = torch.arange(64), torch.arange(64)
    auto = w.make(True, lane_ok=True, direct_lane=True)
    lane = auto.lane(w.binding, False)
    assert lane(0, h, d) and auto.lone_kernel_loads == 1
    assert not lane(1, h, d)  # the stream is busy with layer 0 by the clock, and no decision is memoised
    auto._picks[pick_key(h, d, 1, False)] = auto.direct
    assert lane(1, h, d) and not auto.clock.idle(0x77, t[0] + 1.5 * w.layer_s)  # the memoised route, booked
    t[0] += 3 * w.layer_s
    assert lane(1, h, d)  # drained, but right after the last call: not lone, the memoised route again
    t[0] += 1e-3
    assert not lane(None, h, d)  # nothing memoised for all layers
    assert lane(3, h, d)  # lone, but no TMA loads for layer 3: the memoised route (per-layer calls share it)
    t[0] += 1e-3
    assert lane(1, h, d)  # lone: the kernel
    assert served == [("kernel lane", 0), ("direct lane", 1), ("direct lane", 1), ("direct lane", 3),
                      ("kernel lane", 1)]
    for bad in ([0, 1], None, "x"):  # never raises, never moves: the pool's checks speak
        assert not lane(1, bad, d) and not lane(1, h, bad)
    backups = auto.lane(w.binding, True)
    auto._picks[pick_key(h, d, None, True)] = auto.kernel
    t[0] += 1e-3
    assert backups(None, h, d) and served[-1] == ("kernel lane", None) and not auto.clock.idle(0x77)
    served.clear()
    t[0] += 1e-3
    refused = w.make(True, lane_ok=False)  # the kernel's lane declines (e.g. tensors it has not seen)
    assert not refused.lane(w.binding, False)(0, h, d) and refused.clock.idle(0x77)  # nothing booked
    served.clear()
    assert w.make(True).lane(w.binding, False) is None  # no candidate has a lane
    plain = w.make(None, lane_ok=True)  # a kernel without TMA loads: only memoised routes
    assert not plain.lane(w.binding, False)(0, h, d) and served == [] and plain.lone_kernel_loads == 0
    cpu = w.make(True, lane_ok=True, where=w.on_cpu)  # no clock on a CPU pool: only memoised routes
    cpu._picks[pick_key(h, d, 0, False)] = cpu.kernel
    assert cpu.lane(w.on_cpu, False)(0, h, d) and cpu.lone_kernel_loads == 0 and served == [("kernel lane", 0)]


@pytest.mark.parametrize("layout", [x for x in ("layer_first", "page_first") if x in LAYOUTS])
@pytest.mark.parametrize("staging", ["never", "always"])
def test_direct_lane_repeats_a_checked_submission_of_its_direction_only(layout, staging):
    """``direct``'s fast path resubmits what a call of the same direction submitted for these tensors and layer
    (the bytes of the normal path, canaries untouched); the other direction, new or changed tensors and bad
    arguments reach the pool's checks, which raise before any byte moves."""
    from hicache_core.errors import DuplicateIndexError, IndexDtypeError, IndexRangeError

    pool = _mla_pool(layout, staging=staging, ps=16, layers=3, pages=8)
    dev = pool.binding.segments[0].device_rows
    g = torch.Generator().manual_seed(5)
    for rows in dev:
        rows.copy_(torch.randint(0, 256, rows.shape, dtype=torch.uint8, generator=g))
    src = [rows.clone() for rows in dev]
    h = torch.tensor([2, 5], dtype=torch.int64).repeat_interleave(16) * 16 + torch.arange(16).repeat(2)
    s = torch.arange(0, 32)
    d = torch.arange(64, 96)
    pool.backup_all_layers(h, s)
    for layer in range(3):
        pool.load_layer(layer, h, d)

    def checked(*a, **k):
        raise AssertionError("a lane call reached the pool's checks")

    canary = [rows[96:].clone() for rows in dev]
    for rows in dev:
        rows[64:96] = 0
    pool._check = checked  # an instance attribute over the method: every call below must take the lane
    try:
        for layer in range(3):
            assert pool.load_layer(layer, h, d)
        pool.backup_all_layers(h, s)
    finally:
        del pool._check
    for rows, orig, can in zip(dev, src, canary):
        assert torch.equal(rows[64:96], orig[0:32]) and torch.equal(rows[96:], can)
    dup = torch.cat([s[:16], s[:16]])  # a backup may read a device row twice; a load must not write one twice
    assert pool.backup_layer(0, h, dup) and pool.backup_layer(0, h, dup)
    with pytest.raises(DuplicateIndexError):
        pool.load_layer(0, h, dup)  # the backup's submission of layer 0 exists, but not one of this direction
    for bad in ([0, 1], h.tolist()):
        with pytest.raises(IndexDtypeError):
            pool.load_layer(0, bad, d)
    d[0] = 10_000  # in place: the version moves, the pool checks again
    with pytest.raises(IndexRangeError):
        pool.load_layer(0, h, d)


@pytest.mark.parametrize("layout", [x for x in ("layer_first", "page_first_direct", "page_first") if x in LAYOUTS])
def test_one_layer_submission_is_its_row_of_the_plans_table(layout):
    """A one-layer plain submission is that layer's row of the pair's address table (the all-layer submission's
    slice), and the byte count a plan gives it from its tables is the reduction of its run lengths."""
    from hicache_core.backends.plans import Submission

    pool = _mla_pool(layout, staging="never", ps=16, layers=3, pages=8)
    h = torch.tensor([5, 2, 7], dtype=torch.int64).repeat_interleave(16) * 16 + torch.arange(16).repeat(3)
    d = torch.arange(16, 64)
    fast = [_submission(pool, h, d, layer) for layer in range(3)]
    whole = _submission(pool, h.clone(), d.clone(), None)  # new tensors: a new plan
    assert whole.plain_nbytes == int(whole.lens.sum()) == 3 * 48 * 1152
    k = whole.lens.numel() // 3
    general = [Submission(whole.host[r * k:(r + 1) * k], whole.dev[r * k:(r + 1) * k], whole.lens[r * k:(r + 1) * k])
               for r in range(3)]  # byte count by reduction
    for a, b in zip(fast, general):
        assert torch.equal(a.host, b.host) and torch.equal(a.dev, b.dev) and torch.equal(a.lens, b.lens)
        assert a.plain_nbytes == b.plain_nbytes == int(b.lens.sum()) == 48 * 1152
        assert a.staged is None and a.pitched is None


def test_plain_byte_count_beside_pitched_copies():
    """Layers 0-2 in one allocation go as pitched copies, layer 3 (its own allocation) as plain runs: the plain byte
    count the plan gives from its tables is the reduction of the plain run lengths, and both parts add up."""
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(4), kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                        page_size=16, capacity=16 * 8)
    one = torch.zeros(3, 16 * 8, 1, 576, dtype=torch.bfloat16)
    dev = {"kv": [*one.unbind(0), torch.zeros(16 * 8, 1, 576, dtype=torch.bfloat16)]}
    pool = HostKVPool(spec, LAYOUTS[0], "direct", dev, registry=REG, strategy="core.direct",
                      strategy_options={"staging": "never", "pitched": "auto"})
    h = torch.tensor([5, 2], dtype=torch.int64).repeat_interleave(16) * 16 + torch.arange(16).repeat(2)
    sub = _submission(pool, h, torch.arange(16, 48), None)
    assert sub.pitched is not None and sub.lens.numel() > 0
    assert sub.plain_nbytes == int(sub.lens.sum()) == 32 * 1152
    assert sub.nbytes == 4 * 32 * 1152


@pytest.mark.parametrize("validate, env, lanes", [("shapes", None, True), ("shapes", "0", False),
                                                   ("full", None, False), ("strict", None, False)])
def test_pools_take_lanes_only_where_calls_may_skip_their_checks(monkeypatch, validate, env, lanes):
    """Pools that check every call (``validate="full"``/``"strict"``) never take a strategy's fast path, nor any
    pool built under ``HICACHE_LANES=0``."""
    if env is not None:
        monkeypatch.setenv("HICACHE_LANES", env)
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64,
                        dtype=torch.bfloat16, page_size=16, capacity=64)
    dev = {"kv": [torch.zeros(64, 1, 576, dtype=torch.bfloat16) for _ in range(2)]}
    pool = HostKVPool(spec, "layer_first", "direct", dev, registry=REG, strategy="core.direct", validate=validate)
    assert all((lane is not None) == lanes for lane in pool._lanes)


def test_auto_lane_with_one_candidate_takes_its_lane_without_a_decision(monkeypatch):
    """Where only one candidate serves the pool (e.g. the kernel could not prepare), ``auto`` routes every call to
    it without a decision memo, and so does its lane."""
    w = _AutoWorld(monkeypatch)
    h, d = torch.arange(64), torch.arange(64)
    auto = w.make(True, lane_ok=True, direct_lane=True)
    auto.kernel = None
    auto._arm(w.binding)
    assert auto.lane(w.binding, False)(2, h, d) and w.served == [("direct lane", 2)]
    auto = w.make(True, lane_ok=True)
    auto.direct = None
    auto._arm(w.binding)
    assert auto.lane(w.binding, True)(None, h, d) and w.served[-1] == ("kernel lane", None)


def test_copy_batch_refuses_descriptor_arrays_it_cannot_hand_the_runtime_by_address():
    """The runtime reads the arrays by address: a strided, shorter or non-int64 one would give it other memory as
    addresses and sizes.  Checked before the runtime is touched, so this holds on any machine."""
    from hicache_core.backends.cudart import CudaRuntime

    rt = CudaRuntime.__new__(CudaRuntime)  # no library needed: the checks come first
    ok = torch.arange(4, dtype=torch.int64)
    bad = {
        "srcs": (ok, torch.arange(8, dtype=torch.int64)[::2], ok),
        "sizes": (ok, ok, torch.arange(3, dtype=torch.int64)),
        "dsts": (ok.to(torch.int32), ok, ok),
    }
    for name, (d, s, z) in bad.items():
        with pytest.raises(ValueError, match=f"copy_batch: {name} must be a contiguous CPU int64"):
            rt.copy_batch(d, s, z, stream=0)
    with pytest.raises(ValueError, match=r"contiguous CPU int64 \[n, 14\]"):
        rt.copy_3d_batch(torch.zeros(3, 14, dtype=torch.int64)[:, :13], stream=0)
    with pytest.raises(ValueError, match="not contiguous"):
        rt.copy_3d_batch(torch.zeros(14, 3, dtype=torch.int64).t(), stream=0)


@pytest.mark.skipif("layer_first" not in LAYOUTS, reason="needs the layer_first layout plugin")
@pytest.mark.parametrize("io_backend", ["direct", "auto"])
def test_under_full_validation_no_plan_outlives_its_call(io_backend):
    """``validate="full"`` checks and copies every call afresh: an index tensor rewritten behind torch's version
    counter (through NumPy) between calls moves the rows it names now, in both directions, and a bad value written
    that way is refused; a plan still serves the whole call that made it (one plan per call)."""
    from hicache_core.backends import plans as plans_mod
    from hicache_core.errors import IndexRangeError

    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64,
                        dtype=torch.bfloat16, page_size=4, capacity=32)
    gen = torch.Generator().manual_seed(11)
    dev = {"kv": [torch.randn(32, 1, 576, generator=gen).to(torch.bfloat16) for _ in range(2)]}
    pool = HostKVPool(spec, "layer_first", io_backend, dev, registry=REG, validate="full", pin_memory=False)
    for b in pool.host_buffers.values():
        b.view(torch.uint8).fill_(0xA5)
    h, d = torch.arange(0, 4), torch.arange(8, 12)
    made = []
    real = plans_mod.Plan.__init__

    def counted(self, *args, **kwargs):
        made.append(1)
        real(self, *args, **kwargs)

    plans_mod.Plan.__init__ = counted  # type: ignore[method-assign]
    try:
        pool.backup_all_layers(h, d)
        assert len(made) == 1
        h.numpy()[:] = [12, 13, 14, 15]  # host page 3, device rows 20..23 now: versions unchanged
        d.numpy()[:] = [20, 21, 22, 23]
        pool.backup_all_layers(h, d)
        assert len(made) == 2
    finally:
        plans_mod.Plan.__init__ = real  # type: ignore[method-assign]
    rows = lambda lo: torch.cat([dev["kv"][i][lo:lo + 4].reshape(-1).view(torch.uint8) for i in range(2)])  # noqa: E731
    assert torch.equal(pool.get_page(3), rows(20)) and torch.equal(pool.get_page(0), rows(8))
    assert bool((pool.get_page(1) == 0xA5).all()) and bool((pool.get_page(2) == 0xA5).all())
    h.numpy()[:] = [96, 97, 98, 99]  # out of range, behind torch's back: checked all the same
    with pytest.raises(IndexRangeError):
        pool.backup_all_layers(h, d)
    h.numpy()[:] = [12, 13, 14, 15]
    pool.load_all_layers(h, d)  # rows 20..23 <- page 3
    canary = [t.clone() for t in dev["kv"]]
    d.numpy()[:] = [28, 29, 30, 31]
    pool.load_all_layers(h, d)
    for i, t in enumerate(dev["kv"]):
        assert torch.equal(t[28:32].view(torch.uint8), t[20:24].view(torch.uint8)), i
        assert torch.equal(t[:28].view(torch.uint8), canary[i][:28].view(torch.uint8)), i


@pytest.mark.skipif("layer_first" not in LAYOUTS, reason="needs the layer_first layout plugin")
@pytest.mark.parametrize("io_backend", ["direct", "auto"])
def test_a_data_swap_to_a_strided_view_at_the_same_address_moves_the_rows_it_names(io_backend):
    """``d.data = store[::2]`` after ``d = store[:4]`` keeps d's identity, version, address, length and dtype: the
    pool's check memo and the copy plans compare strides too, so the next call moves the rows named now."""
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(1), kv_lora_rank=512, qk_rope_head_dim=64,
                        dtype=torch.bfloat16, page_size=4, capacity=32)
    dev = {"kv": [torch.randn(32, 1, 576, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)]}
    pool = HostKVPool(spec, "layer_first", io_backend, dev, registry=REG, pin_memory=False)
    h, store = torch.arange(0, 4), torch.tensor([8, 9, 10, 11, 20, 21, 22, 23])
    d = store[:4]
    pool.backup_all_layers(h, d)
    version = d._version
    d.data = store.as_strided((4,), (2,), 0)  # rows 8, 10, 20, 22
    assert d._version == version and d.data_ptr() == store.data_ptr() and d.numel() == 4
    pool.backup_all_layers(h, d)
    rows = dev["kv"][0][torch.tensor([8, 10, 20, 22])].reshape(-1).view(torch.uint8)
    assert torch.equal(pool.get_page(0), rows)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif("layer_first" not in LAYOUTS, reason="needs the layer_first layout plugin")
@pytest.mark.parametrize("wait", ["synchronize", "query"])
def test_a_backup_on_the_legacy_default_stream_is_covered_by_waiting_for_that_stream(wait):
    """On torch's default (legacy) stream the copies go to the per-thread stream (the batch API refuses the legacy
    one); synchronising or querying the legacy stream, as a caller of a pool that enqueues on the current stream
    would, must still cover them (a backup large enough to take milliseconds, the last host page checked)."""
    layers, ps, pages = 8, 64, 512  # 8 x 32768 rows of 1152 B: 302 MB
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(layers), kv_lora_rank=512, qk_rope_head_dim=64,
                        dtype=torch.bfloat16, page_size=ps, capacity=ps * pages, device="cuda")
    dev = {"kv": [torch.full((ps * pages, 1, 576), float(i + 1), dtype=torch.bfloat16, device="cuda")
                  for i in range(layers)]}
    pool = HostKVPool(spec, "layer_first", "direct", dev, registry=REG, strategy="core.direct",
                      strategy_options={"staging": "never"})
    assert torch.cuda.current_stream().cuda_stream == 0
    for trial in range(3):
        for b in pool.host_buffers.values():
            b.view(torch.uint8).fill_(0)
        for t in dev["kv"]:
            t.add_(1)
        torch.cuda.synchronize()
        idx = torch.arange(ps * pages)
        pool.backup_all_layers(idx, idx)
        s = torch.cuda.current_stream()
        if wait == "synchronize":
            s.synchronize()
        else:
            while not s.query():
                pass
        last = pool.get_page(pages - 1).view(torch.bfloat16).view(layers, ps, 576)
        want = torch.stack([t[-ps:, 0].cpu() for t in dev["kv"]])
        assert torch.equal(last, want), trial


def test_a_call_never_takes_another_threads_check_of_the_same_tensors():
    """An engine's load and backup threads share a pool.  Thread A's call checked its index pair and has not yet run
    its strategy; thread B rewrites the device indices behind torch's version counter (through ``.data``) and calls
    with the same tensors: its check is skipped by the pool's memo, and its plan must not take A's check (the binding's
    ``checked`` is per thread), so the plan's own range check refuses the rows past the device tensors."""
    import threading

    from hicache_core.validate import CheckedPair

    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(3), head_num=2, head_dim=4, v_head_dim=2, dtype=torch.float16,
                        page_size=4, capacity=16)
    dev = {"k": [torch.zeros(40, 2, 4, dtype=torch.float16)[:32] for _ in range(3)],
           "v": [torch.zeros(40, 2, 2, dtype=torch.float16)[:32] for _ in range(3)]}
    pool = HostKVPool(spec, "layer_first", "direct", dev, registry=REG, strategy="core.direct", pin_memory=False)
    h, d = torch.arange(4, 8), torch.arange(8, 12)
    checked, go = threading.Event(), threading.Event()
    seen: dict[str, object] = {}
    real = pool.strategy.load

    def held(*args, **kwargs):  # type: ignore[no-untyped-def]
        if threading.current_thread().name == "A":
            seen["A"] = pool.binding.checked
            checked.set()
            go.wait(120)  # a guard against a hang only: the main thread sets it once its call raised
        return real(*args, **kwargs)

    pool.strategy.load = held  # type: ignore[method-assign]
    a = threading.Thread(target=lambda: pool.load_all_layers(h, d), name="A")
    a.start()
    try:
        assert checked.wait(120)  # a guard against a hang only (a loaded CI machine may start A late)
        assert isinstance(seen["A"], CheckedPair) and pool.binding.checked is None  # A's check is A's alone
        d.data.copy_(torch.arange(32, 36))  # behind the version counter: rows past the device tensors
        with pytest.raises(IndexRangeError, match="device_indices must lie in 0..31"):
            pool.load_all_layers(h, d)
    finally:
        go.set()
        a.join()


def test_auto_refuses_options_its_kernel_refuses_instead_of_dropping_the_kernel():
    """A misspelt auto option (or a kernel option the kernel refuses) used to go to the kernel's factory, fail there,
    and leave auto serving the pool by the copy engine alone, silently; the pool now refuses to build, naming it."""
    import inspect

    from fakes import pool_device
    from hicache_core.backends.auto import AUTO_OPTIONS, AutoStrategy
    from hicache_core.errors import ResolutionError

    own = tuple(n for n in inspect.signature(AutoStrategy.__init__).parameters if n not in ("self", "kernel_options"))
    assert own == AUTO_OPTIONS  # the message lists exactly auto's own options
    device = pool_device("kernel")  # where a kernel serves the pool (a CPU pool's kernel needs the interpreter)
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                        page_size=16, capacity=64, device=device)
    dev = {"kv": [torch.zeros(64, 1, 576, dtype=torch.bfloat16, device=device) for _ in range(2)]}
    pool = HostKVPool(spec, "page_first", "auto", dev, registry=REG, strategy_options={"programs": 4})
    assert pool.strategy.kernel is not None  # a kernel option the kernel takes
    for options, why in (({"forwrd": "memory"}, "unexpected keyword argument 'forwrd'"),
                         ({"programs": -3}, "programs=-3")):
        with pytest.raises(ResolutionError, match=rf"auto's option\(s\) \['{next(iter(options))}'\] .* go to the kernel "
                                                  rf"strategy.*, which refused them .*{why}"):
            HostKVPool(spec, "page_first", "auto", dev, registry=REG, strategy_options=options)
    if "page_head" not in REG.layouts:
        return
    # a layout no kernel strategy serves: nothing could take a kernel option, misspelt or not
    mha = PoolSpec.mha(layer_map=LayerMap.unsharded(2), head_num=1, head_dim=8, dtype=torch.float16, page_size=4,
                       capacity=8)
    kv = {c: [torch.zeros(8, 1, 8, dtype=torch.float16) for _ in range(2)] for c in "kv"}
    assert HostKVPool(mha, "page_head", "auto", kv, registry=REG).strategy.kernel is None
    for options in ({"forwrd": "memory"}, {"programs": 4}):
        with pytest.raises(ResolutionError, match=rf"auto's option\(s\) \['{next(iter(options))}'\] are not auto's own "
                                                  r".*no kernel strategy is registered for layout 'page_head'"):
            HostKVPool(mha, "page_head", "auto", kv, registry=REG, strategy_options=options)


def test_a_row_of_one_chunk_with_an_odd_chunk_stride_is_a_whole_row(monkeypatch):
    """A plan that gives one-chunk rows a chunk_stride (written for several heads, used with one) is the plain
    layout to the copy engine: the same page-sized blocks (not staged for 1152-byte runs), the same descriptors,
    bytes equal to the reference; the staged route takes its rows whole too."""
    from fakes import odd_stride_layout
    from hicache_core import hookimpl

    class Plugin:
        @hookimpl
        def hicache_register_layouts(self, register):  # type: ignore[no-untyped-def]
            register(odd_stride_layout())

    reg = create_registry(plugins=[("odd", Plugin())])
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(4), kv_lora_rank=512, qk_rope_head_dim=64,
                        dtype=torch.bfloat16, page_size=64, capacity=64 * 4)

    def pool(layout: str) -> HostKVPool:
        dev = {"kv": [torch.zeros(64 * 4, 1, 576, dtype=torch.bfloat16) for _ in range(4)]}
        return HostKVPool(spec, layout, "direct", dev, registry=reg, strategy="core.direct",
                          strategy_options={"staging": "auto"})

    from hicache_core.backends import plans, plans_plan

    h, d = torch.arange(128, 192), torch.arange(64, 128)
    used: list[int] = []
    real = plans_plan.coalesce
    monkeypatch.setattr(plans_plan, "coalesce", lambda dst, src, nbytes: used.append(nbytes) or real(dst, src, nbytes))
    odd, plain = (_submission(pool(name), h, d, None) for name in ("layer_first_odd_stride", "layer_first"))
    assert used == [64 * 1152] * 2  # each a page per block from the page runs, not row by row
    assert odd.staged is None and odd.mean_block == plain.mean_block == 64 * 1152
    assert torch.equal(odd.lens, plain.lens) and odd.nbytes == plain.nbytes
    from types import SimpleNamespace

    from hicache_core.backends.relayout import _chunking

    seg = pool("layer_first_odd_stride").binding.segments[0]
    assert plans._longest_run(seg, 64) == 64 * 1152  # the staged route's bound on plain runs: a page, not a row
    assert _chunking(SimpleNamespace(seg=seg)) == (1152, 1, 1152)  # the relayout kernel copies the row whole
    for staging in ("never", "always"):
        monkeypatch.setenv("HICACHE_DIRECT_STAGING", staging)
        for case in (CASES[0], CASES[2]):
            check_strategy(reg, case, "layer_first_odd_stride", "direct", strategy="core.direct")
