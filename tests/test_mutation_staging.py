"""Mutation-testing gaps of ``direct``'s staged route (staging, relayout and its kernel's host side) and ``auto``'s
rules: the page-image memo's key, the pitched-copy height threshold, the staged byte count, chunk arithmetic of
several images, the kernel's row bounds and tables, and the rules' margins.  Transfers are compared bit for bit
with the ``reference`` backend on fresh random data, with canary bytes around every host buffer and device layer
(:mod:`hicache_core.testing.guarded`)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the relayout kernel in Triton's CPU interpreter

import pytest  # noqa: E402

from hicache_core import HostKVPool, LayerMap, PoolSpec, create_registry  # noqa: E402
from hicache_core.backends import relayout  # noqa: E402
from hicache_core.backends.direct import DirectStrategy  # noqa: E402
from hicache_core.backends.staging import StagedRoute, page_images  # noqa: E402
from hicache_core.testing.conformance import CANARY  # noqa: E402
from hicache_core.testing.guarded import assert_same_device, guarded_pools, guards_intact  # noqa: E402

REG = create_registry()
PS = 4

needs = pytest.mark.skipif(not {"layer_first", "page_first"} <= set(REG.layouts),
                           reason="needs the layer_first and page_first layout plugins")


def _mla(layers: int, pages: int = 8, ps: int = PS) -> PoolSpec:
    return PoolSpec.mla(layer_map=LayerMap.unsharded(layers), kv_lora_rank=512, qk_rope_head_dim=64,
                        dtype=torch.bfloat16, page_size=ps, capacity=ps * pages)


def _pool(layout: str, layers: int, *, pages: int = 8, staging: str = "always", pitched: str = "auto") -> HostKVPool:
    spec = _mla(layers, pages)
    gen = torch.Generator().manual_seed(layers)
    dev = {"kv": [torch.randint(-9, 9, (spec.capacity, 1, 576), generator=gen).to(torch.bfloat16)
                  for _ in range(layers)]}
    return HostKVPool(spec, layout, "direct", dev, registry=REG, strategy="core.direct",
                      strategy_options={"staging": staging, "pitched": pitched}, pin_memory=False)


def _pages(pages: list[int], ps: int = PS) -> torch.Tensor:
    return (torch.tensor(pages).unsqueeze(1) * ps + torch.arange(ps)).reshape(-1)


def _staged(pool: HostKVPool, h: torch.Tensor, d: torch.Tensor, layer: int | None) -> StagedRoute:
    assert isinstance(pool.strategy, DirectStrategy)
    st = pool.strategy.submission(pool.binding, h, d, layer).staged
    assert st is not None
    return st


# -- page images ------------------------------------------------------------------------------------------------------


@needs
def test_page_images_are_memoised_per_pitched_choice():
    """The memo of a pool's page images keys the pitched choice too: a route without pitched copies never gets the
    pitched images built before for the same layers (nor the other way round)."""
    for first in (True, False):
        pool = _pool("layer_first", 3)
        a = page_images(pool.binding, None, first)
        b = page_images(pool.binding, None, not first)
        pitched, plain = (a, b) if first else (b, a)
        assert pitched[0].pitched == (PS * 1152, 8 * PS * 1152, PS * 1152)
        assert plain[0].pitched is None
        assert page_images(pool.binding, None, first) is a  # still memoised


@needs
def test_two_evenly_spaced_blocks_are_one_pitched_copy():
    """MIN_HEIGHT blocks (two layers of a layer-major host) already make one pitched copy per page."""
    pool = _pool("layer_first", 2)
    st = _staged(pool, _pages([5, 2, 7]), torch.arange(12), None)
    (im,) = st.images
    assert im.compact and im.pitched == (PS * 1152, 8 * PS * 1152, PS * 1152)
    assert st.count == 3 and st.blocks == 6


@needs
def test_staged_byte_count_is_the_blocks_not_the_image_span():
    """One layer of a token-major host: each page's rows are ``ps`` blocks a host token apart, mirrored with gaps in
    the image; the route moves (and ``auto`` judges) the rows' bytes only, not the gaps."""
    pool = _pool("page_first", 4)
    st = _staged(pool, _pages([6, 1, 3]), torch.arange(12), 2)
    (im,) = st.images
    assert not im.compact and im.span > int(im.lens.sum())
    assert st.nbytes == 3 * PS * 1152
    assert pool.strategy.submission(pool.binding, _pages([6, 1, 3]), torch.arange(12), 2).nbytes == 3 * PS * 1152


@needs
def test_host_indices_that_start_pages_but_do_not_fill_them_in_order_are_not_staged():
    """Only whole pages in order (slot ``k`` of a group at ``page * ps + k``) stage (:meth:`StagedRoute.build`, for
    callers below the pool's checks): a group that starts a page but swaps two of its slots gets no staged route
    (the pool itself refuses such indices)."""
    from hicache_core.errors import PageAlignmentError

    pool = _pool("page_first", 3)
    h = torch.tensor([8, 9, 10, 11, 20, 21, 23, 22])  # the second group starts page 5, slots 2 and 3 swapped
    d = torch.tensor([3, 17, 20, 9, 30, 1, 13, 12])
    assert StagedRoute.build(pool.binding, h, lambda: d, None, 1 << 20) is None
    assert StagedRoute.build(pool.binding, _pages([2, 5]), lambda: d, None, 1 << 20) is not None
    assert isinstance(pool.strategy, DirectStrategy)
    assert pool.strategy.submission(pool.binding, h, d, None).staged is None
    with pytest.raises(PageAlignmentError, match="host_indices must be whole pages"):
        pool.backup_all_layers(h, d)


# -- chunk arithmetic and host time ------------------------------------------------------------------------------------


def _chunked(layout: str, pitched: bool) -> tuple[StagedRoute, int]:
    """A torch-relayout route over 23 shuffled pages of a 4-layer pool, 20 pages per chunk (a partial last chunk)."""
    pool = _pool(layout, 4, pages=32, pitched="auto" if pitched else "never")
    b = pool.binding
    span = sum(im.span for im in page_images(b, None, pitched))
    hp = torch.randperm(32, generator=torch.Generator().manual_seed(3))[:23].tolist()
    h = _pages(hp)
    st = StagedRoute.build(b, h, lambda: torch.arange(h.numel()), None, 40 * span, relayout="torch", pitched=pitched)
    assert st is not None and st.launches_per_chunk == 8  # two torch ops per layer entry
    assert (st.chunk_pages, st.chunks) == (20, 2)
    return st, span


@needs
def test_staged_host_time_counts_every_chunk_and_the_partial_last_one():
    from hicache_core.backends.cudart import batch_calls
    from hicache_core.backends.pitched import PITCHED_OP_US
    from hicache_core.backends.staging import LAUNCH_US

    assert (batch_calls(20), batch_calls(3)) == (2, 1)  # the schedule's small first calls: a full chunk needs two
    calls = batch_calls(20) + batch_calls(3)
    # page_first: one block per page (every layer's rows of a page are contiguous), plain descriptors
    st, _ = _chunked("page_first", False)
    assert st.count == 23 and st.blocks == 23
    assert st.host_us(1.0, 100.0) == pytest.approx(23 * 1.0 + calls * 100.0 + 2 * 8 * LAUNCH_US)
    # layer_first, pitched: one pitched copy of 4 layer blocks per page
    st, _ = _chunked("layer_first", True)
    assert st.count == 23 and st.blocks == 23 * 4
    assert st.host_us(1.0, 100.0) == pytest.approx(23 * PITCHED_OP_US + calls * 100.0 + 2 * 8 * LAUNCH_US)



@needs
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_staged_round_trip_with_a_partial_last_chunk(layout):
    """23 shuffled pages at 20 per chunk (the torch relayout on the CPU): the last chunk holds 3 pages; backup and
    load equal the reference backend's bytes, canaries intact."""
    spec = _mla(4, pages=32)
    span = 4 * PS * 1152  # every layer's rows of a page, packed or contiguous
    gen = torch.Generator().manual_seed(31)
    g = guarded_pools(REG, layout, "direct", spec, gen, pin=False, guard=64, dev_guard=64,
                      strategy_options={"staging": "always", "staging_bytes": 40 * span})
    h = _pages(torch.randperm(32, generator=gen)[:23].tolist())
    d = torch.randperm(g.pool.binding.device_rows, generator=gen)[: h.numel()]
    st = _staged(g.pool, h, d, None)
    assert (st.chunk_pages, st.chunks) == (20, 2) and sum(im.span for im in st.images) == span
    g.pool.backup_all_layers(h, d)
    g.ref.backup_all_layers(h, d)
    for name, t in g.ref.host_buffers.items():
        assert torch.equal(g.pool.host_buffers[name].view(torch.uint8), t.view(torch.uint8)), name
    d2 = torch.randperm(g.pool.binding.device_rows, generator=gen)[: h.numel()]
    g.pool.load_all_layers(h, d2)
    g.ref.load_all_layers(h, d2)
    assert_same_device(g.dev, g.ref_dev)
    assert guards_intact(g)


@needs
def test_host_indices_that_are_not_whole_pages_are_not_staged():
    """Below the pool's checks (which refuse such indices first), a route for a count that is not a page multiple is
    None, not a reshape error."""
    pool = _pool("page_first", 2)
    h = torch.arange(PS + 3)
    assert StagedRoute.build(pool.binding, h, lambda: h, None, 1 << 20) is None


@needs
def test_a_chunk_that_fails_to_submit_says_which_pages_the_chunks_before_it_moved():
    """A staged load in one-page chunks whose third copy-engine call fails: the two chunks before it were queued whole
    and moved their pages (the error says so, and counts their copies in ``submitted``); the pages after the failing
    chunk stay untouched.  A failure in the first chunk is the runtime's own error, unchanged."""
    from hicache_core.backends.cudart import BatchSubmitError

    gen = torch.Generator().manual_seed(14)
    dev_rows = [torch.randint(-9, 9, (8 * PS, 1, 576), generator=gen).to(torch.bfloat16) for _ in range(3)]
    pool = HostKVPool(_mla(3), "page_first", "direct", {"kv": dev_rows},
                      registry=REG, strategy="core.direct", strategy_options={"staging": "always", "staging_bytes": 1},
                      pin_memory=False)
    b = pool.binding
    h, d = _pages([1, 2, 3, 4]), _pages([0, 1, 2, 3])
    pool.backup_all_layers(h, _pages([4, 5, 6, 7]))  # the host pages hold device pages 4-7
    st = _staged(pool, h, d, None)
    assert st.chunk_pages == 1 and st.chunks == 4
    before = [rows.clone() for seg in b.segments for rows in seg.device_rows]
    copier = b.scratch["direct.copier"]
    real, calls = copier.copy, [0]

    def failing_at(k: int):  # type: ignore[no-untyped-def]
        def copy(dsts, srcs, lens, stream=None, *args, **kwargs):  # type: ignore[no-untyped-def]
            calls[0] += 1
            if calls[0] == k:
                raise BatchSubmitError("cudaMemcpyBatchAsync failed: injected; 0 of the copies of this call", 0)
            return real(dsts, srcs, lens, stream, *args, **kwargs)
        return copy

    copier.copy = failing_at(3)
    with pytest.raises(BatchSubmitError) as err:
        pool.load_all_layers(h, d)
    per_page = int(st._host[:1].numel() + st._p_host[:1].numel())
    assert err.value.submitted == 2 * per_page > 0
    assert "pages 0-1" in str(err.value) and "pages 2-2 (the failing chunk)" in str(err.value)
    assert isinstance(err.value.__cause__, BatchSubmitError)
    after = [rows for seg in b.segments for rows in seg.device_rows]
    moved = [any(not torch.equal(x[p * PS:(p + 1) * PS], y[p * PS:(p + 1) * PS]) for x, y in zip(before, after))
             for p in range(4)]
    assert moved == [True, True, False, False]
    calls[0] = 0
    copier.copy = failing_at(1)
    with pytest.raises(BatchSubmitError) as err:
        pool.load_all_layers(h, d)
    assert err.value.submitted == 0 and "staged" not in str(err.value) and err.value.__cause__ is None


# -- the relayout kernel (Triton's interpreter on the CPU) -----------------------------------------------------------

needs_kernel = pytest.mark.skipif(relayout.kernel_unavailable(torch.device("cpu")) is not None,
                                  reason="the relayout kernel does not run on the CPU here")


def _kernel_routes(g, layer: int | None, hp: list[int], d: torch.Tensor) -> tuple[StagedRoute, StagedRoute]:
    b = g.pool.binding
    h = _pages(hp)
    budget = 4 * sum(im.span for im in page_images(b, layer, False))  # two pages per chunk
    kernel = StagedRoute.build(b, h, lambda: d, layer, budget, relayout="kernel")
    ref = StagedRoute.build(b, h, lambda: d, layer, budget, relayout="torch")
    assert kernel is not None and ref is not None and kernel._kernel is not None and kernel.chunk_pages == 2
    return kernel, ref


@needs
@needs_kernel
def test_kernel_masks_the_device_row_just_past_the_end(monkeypatch):
    """Device row ``rows`` (one past the last): a load writes nothing there (the canary after the device layer stays),
    a gather reads nothing there and leaves zeros in its image slot; every other row moves as the torch relayout
    moves it."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = _mla(3)
    g = guarded_pools(REG, "page_first", "direct", spec, torch.Generator().manual_seed(11), pin=False, dev_guard=2048,
                      strategy_options={"staging": "always"})
    n_dev = g.pool.binding.device_rows
    good = torch.randperm(n_dev, generator=torch.Generator().manual_seed(12))[: 2 * PS]
    kernel, ref = _kernel_routes(g, None, [3, 6], good)
    bad = good.clone()
    bad[PS + 1] = n_dev  # just past the end
    nbytes = kernel.chunk_bytes
    # gather
    got = torch.full((nbytes,), CANARY, dtype=torch.uint8)
    want = torch.full((nbytes,), CANARY, dtype=torch.uint8)
    assert kernel._kernel.run(got, bad, 2, 2, to_image=True)
    ref._relayout(want, good, 2, to_image=True)
    differ = got != want
    assert bool(differ.any()) and bool((got[differ] == 0).all())
    assert int(differ.sum()) <= 3 * 1152  # the bad row's slot of each layer only
    assert guards_intact(g)
    # scatter
    image = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(13))
    before = [r.clone() for r in g.pool.binding.segments[0].device_rows]
    assert kernel._kernel.run(image, bad, 2, 2, to_image=False)
    assert guards_intact(g)  # nothing written past the last device row
    after = [r.clone() for r in g.pool.binding.segments[0].device_rows]
    for r, b0 in zip(g.pool.binding.segments[0].device_rows, before):
        r.copy_(b0)
    keep = torch.cat([good[: PS + 1], good[PS + 2 :]])
    ref._relayout(image, good, 2, to_image=False)
    for a, r, b0 in zip(after, g.pool.binding.segments[0].device_rows, before):
        assert torch.equal(a[keep], r[keep])  # the good rows as torch scatters them
        assert torch.equal(a[good[PS + 1]], b0[good[PS + 1]])  # the row the bad index replaced: untouched


@needs
@needs_kernel
def test_kernel_tables_are_kept_per_layer_selection(monkeypatch):
    """The kernel's tables are cached per pool and layer selection: two single layers of equal image spans get
    tables of their own (a route of layer 1 after one of layer 0 moves layer 1's rows)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = _mla(3)
    g = guarded_pools(REG, "page_first", "direct", spec, torch.Generator().manual_seed(21), pin=False,
                      strategy_options={"staging": "always"})
    d = torch.randperm(g.pool.binding.device_rows, generator=torch.Generator().manual_seed(22))[: 2 * PS]
    images = []
    for layer in (0, 1, None):
        kernel, ref = _kernel_routes(g, layer, [5, 2], d)
        assert kernel.images[0].entries == ((0, 1, 2) if layer is None else (layer,))
        images.append(kernel.images[0].span)
        got = torch.full((kernel.chunk_bytes,), CANARY, dtype=torch.uint8)
        want = got.clone()
        assert kernel._kernel.run(got, d, 2, 2, to_image=True)
        ref._relayout(want, d, 2, to_image=True)
        assert torch.equal(got, want), layer
    assert images[0] == images[1]


# -- auto's rules on synthetic submissions ----------------------------------------------------------------------------


def _cal(submit_us: float):
    from hicache_core.calibration import Calibration

    # 1 GB/s: a submission's link time is its bytes / 1000 microseconds
    return Calibration("test", d2h_min_block=1, h2d_min_block=1, source="test", submit_us=submit_us, link_gbps=1.0,
                       call_us=6.0)


def _plain(n: int, block: int = 1000, pitched_rows: int = 0):
    from hicache_core.backends.pitched import Pitched
    from hicache_core.backends.plans import Submission

    z = torch.zeros(n, dtype=torch.int64)
    p = None
    if pitched_rows:
        one = torch.tensor([block])
        p = Pitched(torch.tensor([0]), torch.tensor([0]), one, torch.tensor([pitched_rows]), one, one)
    return Submission(z, z, torch.full((n,), block, dtype=torch.int64), pitched=p)


def test_auto_rule_margins():
    from hicache_core.backends.auto_rules import allowed_us, burst_us, fed

    sub = _plain(100)  # 100 KB: 100 us at link speed; bursts of <= 512 descriptors are one runtime call
    assert allowed_us(sub.nbytes, _cal(0.5), True, 2.0) == pytest.approx(120.0)  # backups: BACKUP_ROOM, not room
    assert allowed_us(sub.nbytes, _cal(0.5), False, 2.0) == pytest.approx(200.0)
    assert burst_us(sub, 0.5) == pytest.approx(100 * 0.5 + 6.0)  # one call (an idle schedule would make five)
    # a measured pace: a burst may take FED_SHARE (1.1) of the link time; loads at a slower pace go to the kernel
    assert fed(sub, _cal(0.5), 1.0, to_host=False)  # 106 us <= 110 us
    assert not fed(sub, _cal(0.5), 1.05, to_host=False)  # 111 us
    assert fed(sub, _cal(0.5), 2.0, to_host=False, room=2.0)  # 206 us <= 220 us
    # the calibration (idle schedule, five calls of 100): no share beyond the link time for loads
    assert fed(_plain(100), _cal(0.7), to_host=False)  # 70 + 30 = 100 us
    assert not fed(_plain(100), _cal(0.75), to_host=False)  # 105 us
    # backups: 1.2x the link time, at the calibration's cost and (times FED_SHARE) at a measured pace
    assert fed(_plain(100), _cal(0.9))  # 90 + 30 = 120 us
    assert not fed(_plain(100), _cal(0.95))  # 125 us
    assert fed(sub, _cal(0.95), 1.25) and not fed(sub, _cal(0.95), 1.3)  # 131 us <= 132 us < 136 us
    # pitched copies are never judged at a measured pace (it counts plain descriptors only)
    mixed = _plain(100, pitched_rows=2)  # 102 KB; calibrated 85 + 30 + 3 + 6 = 124 us, over 1.2 x 102 us
    assert not fed(mixed, _cal(0.85)) and not fed(mixed, _cal(0.85), 0.01) and not fed(mixed, _cal(0.85), 0.01, False)


def test_auto_worth_measuring_bounds():
    from hicache_core.backends.auto_rules import worth_measuring
    from hicache_core.backends.pace import MIN_OPS

    big = 1 << 20
    assert worth_measuring(_plain(MIN_OPS, big), _cal(0.5))  # exactly as many as the copier samples
    assert not worth_measuring(_plain(MIN_OPS - 1, big), _cal(0.5))
    assert not worth_measuring(_plain(MIN_OPS, big, pitched_rows=2), _cal(0.5))  # pitched: never sampled per descriptor
    # 100 x 2 us + 6 = 206 us: over 1.1 x 120 us for backups, within 1.1 x 200 us for loads given room 2
    assert not worth_measuring(_plain(100), _cal(2.0), to_host=True, room=2.0)
    assert worth_measuring(_plain(100), _cal(2.0), to_host=False, room=2.0)
    assert not worth_measuring(_plain(100), _cal(2.0), to_host=False, room=1.0)
    # 100 x 1.2 us + 6 = 126 us: within 1.1 x 1.2 x 100 us for backups (once, not twice), over 1.1 x 100 us for loads
    assert worth_measuring(_plain(100), _cal(1.2)) and not worth_measuring(_plain(100), _cal(1.2), to_host=False)
    assert not worth_measuring(_plain(100), _cal(1.4))  # 146 us: over 132 us (1.2 applied twice would allow 158 us)


def test_auto_may_feed_gives_backups_the_backup_room_once():
    """``auto``'s bound before a plan (:meth:`AutoStrategy._may_feed`) judges a backup at ``BACKUP_ROOM`` times its
    transfer time, once, and a load at its transfer time, from the calibration alone (no measure)."""
    from hicache_core.backends.auto import AutoStrategy

    auto = AutoStrategy()
    # 100 descriptors of 1000 B: 100 us at 1 GB/s; the calibration's idle schedule makes five runtime calls (30 us)
    assert auto._may_feed(100, 100_000, _cal(0.9), True, None)  # 90 + 30 = 120 us <= 1.2 x 100 us
    assert not auto._may_feed(100, 100_000, _cal(0.95), True, None)  # 125 us: not 1.2 x 1.2 x 100 us either
    assert auto._may_feed(100, 100_000, _cal(0.7), False, None)  # 100 us: a load fits its transfer time
    assert not auto._may_feed(100, 100_000, _cal(0.75), False, None)  # 105 us


def test_pick_key_tells_directions_and_layer_selections_apart():
    from hicache_core.backends.auto_rules import pick_key

    h, d = torch.arange(8), torch.arange(8)
    keys = {pick_key(h, d, layer, to_host) for layer in (None, 0) for to_host in (True, False)}
    assert len(keys) == 4
    assert pick_key(h, d, 0, True) == pick_key(h, d, 3, True)  # any one layer decides alike
    assert pick_key(h, d, 0, True) != pick_key(h.clone(), d, 0, True)


@needs
@needs_kernel
def test_kernel_declines_staging_aligned_to_its_word_but_not_its_vector(monkeypatch):
    """The kernel tells Triton every access is ``vec`` words wide: an image at a word but not a vector boundary
    launches nothing (``False``: the torch relayout moves it)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = guarded_pools(REG, "page_first", "direct", _mla(3), torch.Generator().manual_seed(41), pin=False,
                      strategy_options={"staging": "always"})
    d = torch.arange(2 * PS)
    kernel, _ = _kernel_routes(g, None, [1, 4], d)
    (grp,) = kernel._kernel.groups
    assert grp.vec > 1
    buf = torch.zeros(kernel.chunk_bytes + 64, dtype=torch.uint8)
    off = -buf.data_ptr() % (grp.word * grp.vec)
    assert kernel._kernel.run(buf[off : off + kernel.chunk_bytes], d, 2, 2, to_image=True)
    assert not kernel._kernel.run(buf[off + grp.word : off + grp.word + kernel.chunk_bytes - grp.word], d, 1, 2,
                                  to_image=True)


@needs
@needs_kernel
def test_a_kernel_route_checks_unread_rows_before_falling_back_to_torch(monkeypatch):
    """The kernel masks bad rows, so a kernel route does not read the rows' values first; where it falls back to the
    torch relayout (a misaligned image), the rows are checked before torch's index ops see them, once."""
    from hicache_core.errors import IndexRangeError

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = guarded_pools(REG, "page_first", "direct", _mla(3), torch.Generator().manual_seed(51), pin=False,
                      strategy_options={"staging": "always"})
    b = g.pool.binding
    d = torch.arange(2 * PS)
    calls = []

    def check():
        calls.append(1)
        raise IndexRangeError("device_indices out of range (test)")

    budget = 4 * sum(im.span for im in page_images(b, None, False))
    route = StagedRoute.build(b, _pages([1, 4]), lambda: d, None, budget, relayout="kernel", check_rows=check)
    assert route is not None and route._kernel is not None
    buf = torch.zeros(route.chunk_bytes + 64, dtype=torch.uint8)
    off = -buf.data_ptr() % 64
    route._relayout(buf[off : off + route.chunk_bytes], d, 2, to_image=True)  # the kernel: no check
    assert calls == []
    with pytest.raises(IndexRangeError, match=r"out of range \(test\)"):
        route._relayout(buf[off + 1 : off + 1 + route.chunk_bytes - 1], d, 1, to_image=True)
    assert calls == [1]
