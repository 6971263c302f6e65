"""More mutation-testing gaps of the ``direct`` backend's host-side planning (plans, pitched, memcpy, direct): pitched
copies over several segments and of two layers, address tables of one segment with mixed device strides, plan memos
of inference-mode index tensors.  Every transfer is compared bit for bit with the ``reference`` backend on fresh random
data, host buffers filled with canary bytes that slots not named must keep."""

from __future__ import annotations

import pytest
import torch

from hicache_core import HostKVPool, LayerMap, PoolSpec, create_registry

REG = create_registry()
CANARY = 0x5A
PS, PAGES = 4, 8
CAP = PS * PAGES
ROWS = 2 * CAP

needs_layer_first = pytest.mark.skipif("layer_first" not in REG.layouts, reason="needs the layer_first layout plugin")


def _mla(layers: int) -> PoolSpec:
    return PoolSpec.mla(layer_map=LayerMap.unsharded(layers), kv_lora_rank=512, qk_rope_head_dim=64,
                        dtype=torch.bfloat16, page_size=PS, capacity=CAP)


def _mha(layers: int) -> PoolSpec:
    return PoolSpec.mha(layer_map=LayerMap.unsharded(layers), head_num=2, head_dim=64, dtype=torch.bfloat16,
                        page_size=PS, capacity=CAP)


def _twins(spec: PoolSpec, make_rows, layout: str = "layer_first", staging: str = "never", pitched: str = "auto"):
    """A CPU ``direct`` pool and a ``reference`` pool over equal random device rows (``make_rows()``: fresh buffers,
    called twice on one seed), host buffers canary-filled."""
    pool = HostKVPool(spec, layout, "direct", make_rows(), registry=REG, strategy="core.direct",
                      strategy_options={"staging": staging, "pitched": pitched}, pin_memory=False)
    ref = HostKVPool(spec, layout, "reference", make_rows(), registry=REG, strategy="core.reference",
                     pin_memory=False)
    for p in (pool, ref):
        for t in p.host_buffers.values():
            t.view(torch.uint8).fill_(CANARY)
    return pool, ref


def _one_allocation(seed: int, layers: int, names: dict[str, tuple[int, ...]]):
    """Per component: every layer's rows carved from one ``[layers, ROWS, ...]`` allocation (ascending)."""
    def make():
        gen = torch.Generator().manual_seed(seed)
        return {name: list(torch.randint(-100, 100, (layers, ROWS, *shape), generator=gen).to(torch.bfloat16).unbind(0))
                for name, shape in names.items()}
    return make


def _assert_host_equal(pool: HostKVPool, ref: HostKVPool) -> None:
    for name, t in ref.host_buffers.items():
        assert torch.equal(pool.host_buffers[name].view(torch.uint8), t.view(torch.uint8)), name


def _assert_dev_equal(pool: HostKVPool, ref: HostKVPool) -> None:
    for seg, rseg in zip(pool.binding.segments, ref.binding.segments):
        for a, b in zip(seg.device_rows, rseg.device_rows):
            assert torch.equal(a, b)


def _pages(pages: list[int]) -> torch.Tensor:
    return (torch.tensor(pages).unsqueeze(1) * PS + torch.arange(PS)).reshape(-1)


def _all_layer_sub(pool: HostKVPool, h: torch.Tensor, d: torch.Tensor):
    return pool.binding.scratch["direct.plans"].get(h, d, 0).submission(None)


def _scramble_device(pool: HostKVPool, ref: HostKVPool, seed: int) -> None:
    """Fresh random bytes in every device row of both pools (equal), so a load must write what the host holds."""
    gen = torch.Generator().manual_seed(seed)
    for seg, rseg in zip(pool.binding.segments, ref.binding.segments):
        for a, b in zip(seg.device_rows, rseg.device_rows):
            a.copy_(torch.randint(0, 256, a.shape, generator=gen, dtype=torch.uint8))
            b.copy_(a)


def _round_trip(pool: HostKVPool, ref: HostKVPool, h: torch.Tensor, d: torch.Tensor, seed: int) -> None:
    """All-layer backup, then (device rows scrambled) all-layer load of the same pairs, each bit-exact against ``ref``."""
    for p in (pool, ref):
        p.backup_all_layers(h, d)
    _assert_host_equal(pool, ref)
    _scramble_device(pool, ref, seed)
    for p in (pool, ref):
        p.load_all_layers(h, d)
    _assert_dev_equal(pool, ref)


# -- pitched copies -------------------------------------------------------------------------------------------------

@needs_layer_first
def test_pitched_copies_of_several_segments_keep_each_sides_pitch():
    """K and V layers each carved from one allocation: an all-layer transfer is one pitched copy per block and
    segment, concatenated; the host pitch (a host layer slot) differs from the device pitch (a device layer of
    ``2 * capacity`` rows), and each side keeps its own.  Heights, directions and bytes equal the reference."""
    layers = 3
    pool, ref = _twins(_mha(layers), _one_allocation(21, layers, {"k": (2, 64), "v": (2, 64)}))
    h, d = _pages([5, 1, 6]), _pages([9, 2, 14])
    sub = _all_layer_sub(pool, h, d)
    assert sub.staged is None and sub.pitched_count >= 2 and len(pool.binding.segments) == 2
    # checked before any copy: a pitch on the wrong side would move rows outside the buffers
    for seg in pool.binding.segments:
        assert seg.segment.addressing.layer == CAP * 256 and seg.dev_ptrs[1] - seg.dev_ptrs[0] == ROWS * 256
    assert bool((sub.pitched.host_pitch == CAP * 256).all()) and bool((sub.pitched.dev_pitch == ROWS * 256).all())
    for p in (pool, ref):
        p.backup_all_layers(h, d)
    _assert_host_equal(pool, ref)
    _scramble_device(pool, ref, 22)
    h2, d2 = _pages([6, 5]), _pages([3, 11])
    for p in (pool, ref):
        p.load_all_layers(h2, d2)
    _assert_dev_equal(pool, ref)
    for p in (pool, ref):
        p.load_all_layers(h, d)
    _assert_dev_equal(pool, ref)


@needs_layer_first
def test_two_layers_of_one_allocation_go_as_one_pitched_copy_per_block():
    """Two evenly spaced layers are already worth a pitched copy (``MIN_HEIGHT`` rows): an all-layer backup of a
    two-layer pool carved from one allocation submits pitched copies only, and moves what the reference moves."""
    pool, ref = _twins(_mla(2), _one_allocation(23, 2, {"kv": (1, 576)}))
    h, d = _pages([3, 0, 7]), _pages([12, 4, 13])
    sub = _all_layer_sub(pool, h, d)
    assert sub.pitched_count > 0 and sub.lens.numel() == 0
    assert all(int(x) == 2 for x in sub.pitched.height)
    _round_trip(pool, ref, h, d, 24)


# -- address tables --------------------------------------------------------------------------------------------------

@needs_layer_first
@pytest.mark.parametrize("padded", [0, 1])
def test_one_segment_with_two_device_strides_keeps_one_table_per_stride(padded):
    """Layers of one segment whose device rows have different strides (one layer padded to 640 bytes a row): each
    stride's rows are addressed with their own stride, whichever table is built first."""
    layers = 3

    def make():
        gen = torch.Generator().manual_seed(25)
        rows = []
        for i in range(layers):
            if i == padded:
                rows.append(torch.randint(-100, 100, (ROWS, 1, 640), generator=gen).to(torch.bfloat16)[..., :576])
            else:
                rows.append(torch.randint(-100, 100, (ROWS, 1, 576), generator=gen).to(torch.bfloat16))
        return {"kv": rows}

    pool, ref = _twins(_mla(layers), make, pitched="never")
    assert len(set(pool.binding.segments[0].dev_strides)) == 2
    h, d = _pages([2, 7, 4]), _pages([1, 15, 8])
    for p in (pool, ref):
        p.backup_all_layers(h, d)
    _assert_host_equal(pool, ref)
    _scramble_device(pool, ref, 26)
    for p in (pool, ref):
        p.load_layer(1 - padded, h, d)  # a one-layer submission of the other stride first, from the plan's tables
        p.load_all_layers(h, d)
    _assert_dev_equal(pool, ref)


# -- plan memo -------------------------------------------------------------------------------------------------------

@needs_layer_first
@pytest.mark.parametrize("side", ["host", "device"])
def test_inference_mode_index_tensors_are_never_memoised(side):
    """An inference-mode index tensor has no version counter: its plan is not kept, so calls after it is rewritten
    in place move the rows it names now (and nothing asks it for a version)."""
    pool, ref = _twins(_mla(2), _one_allocation(27, 2, {"kv": (1, 576)}), pitched="never")
    h, d = _pages([1, 6]), _pages([3, 12])
    with torch.inference_mode():
        t = (h if side == "host" else d).clone()
    h, d = (t, d) if side == "host" else (h, t)
    for p in (pool, ref):
        p.backup_all_layers(h, d)
    _assert_host_equal(pool, ref)
    with torch.inference_mode():
        t.copy_(_pages([4, 0]) if side == "host" else _pages([10, 5]))
    _round_trip(pool, ref, h, d, 28)


# -- rows split into chunks ------------------------------------------------------------------------------------------

@pytest.mark.skipif("page_head" not in REG.layouts, reason="needs the page_head test layout plugin")
def test_head_chunked_host_rows_are_addressed_by_chunk_stride_on_the_host_only():
    """``page_head`` splits a token's row into one chunk per head, ``page_size * L * D`` items apart on the host and
    back to back in the device row: plain runs step chunks by the host's chunk stride and the device's chunk bytes."""
    layers = 2

    def make():
        gen = torch.Generator().manual_seed(29)
        return {name: [torch.randint(-100, 100, (ROWS, 2, 64), generator=gen).to(torch.bfloat16) for _ in range(layers)]
                for name in ("k", "v")}

    pool, ref = _twins(_mha(layers), make, layout="page_head", pitched="never")
    h, d = _pages([6, 2, 3]), _pages([0, 13, 7])
    for p in (pool, ref):
        p.backup_all_layers(h, d)
        p.backup_layer(1, _pages([4]), _pages([9]))
    _assert_host_equal(pool, ref)
    _scramble_device(pool, ref, 30)
    for p in (pool, ref):
        p.load_layer(0, h, d)
        p.load_all_layers(_pages([4, 6]), _pages([11, 1]))
    _assert_dev_equal(pool, ref)


# -- queue clock -----------------------------------------------------------------------------------------------------

def test_queue_clock_starts_small_where_the_queue_does_not_outlast_the_submission():
    """One call only while the queued copies certainly outlast the submission's host time: a backlog exactly as
    long as the submission's cost starts with small calls; one a hair longer does not (a fake clock, no timing)."""
    import math

    from hicache_core.backends.memcpy import QueueClock

    t = [3.0]
    clock = QueueClock(now=lambda: t[0])
    clock.queued(7, 64_000 * 100, since=t[0])  # about 100 us of copies
    left = clock.backlog_us(7, t[0])
    assert left > 0
    assert clock.eager(7, left, burstable=False)
    assert not clock.eager(7, math.nextafter(left, 0.0), burstable=False)
