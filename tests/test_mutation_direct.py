"""Mutation-testing gaps of the ``direct`` backend's host-side planning (plans, pitched, memcpy, direct): boundaries
of the range checks and pitch limits, the plan memo's keys, and option parsing.  Every transfer is compared bit for
bit with the ``reference`` backend on fresh random data, host buffers filled with canary bytes that slots not named
must keep."""

from __future__ import annotations

import pytest
import torch

from hicache_core import HostKVPool, LayerMap, PoolSpec, create_registry
from hicache_core.backends.direct import DirectStrategy
from hicache_core.backends.pitched import MAX_PITCH, group_bases
from hicache_core.backends.plans import Plan, PlanCache
from hicache_core.errors import ConfigError, IndexRangeError

REG = create_registry()
CANARY = 0x5A
PS, PAGES, LAYERS = 4, 8, 3
CAP = PS * PAGES

needs_layer_first = pytest.mark.skipif("layer_first" not in REG.layouts, reason="needs the layer_first layout plugin")


def _spec() -> PoolSpec:
    return PoolSpec.mla(layer_map=LayerMap.unsharded(LAYERS), kv_lora_rank=512, qk_rope_head_dim=64,
                        dtype=torch.bfloat16, page_size=PS, capacity=CAP)


def _twins(seed: int, staging: str = "never", layout: str = "layer_first"):
    """A CPU ``direct`` pool and a ``reference`` pool over equal random device rows, host buffers canary-filled."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(-100, 100, (2 * CAP, 1, 576), generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]
    spec = _spec()
    pool = HostKVPool(spec, layout, "direct", {"kv": [r.clone() for r in rows]}, registry=REG, strategy="core.direct",
                      strategy_options={"staging": staging}, pin_memory=False)
    ref = HostKVPool(spec, layout, "reference", {"kv": [r.clone() for r in rows]}, registry=REG,
                     strategy="core.reference", pin_memory=False)
    for p in (pool, ref):
        for t in p.host_buffers.values():
            t.view(torch.uint8).fill_(CANARY)
    return pool, ref


def _assert_host_equal(pool: HostKVPool, ref: HostKVPool) -> None:
    for name, t in ref.host_buffers.items():
        assert torch.equal(pool.host_buffers[name].view(torch.uint8), t.view(torch.uint8)), name


def _assert_dev_equal(pool: HostKVPool, ref: HostKVPool) -> None:
    for a, b in zip(pool.binding.segments[0].device_rows, ref.binding.segments[0].device_rows):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _pages(pages: list[int]) -> torch.Tensor:
    return (torch.tensor(pages).unsqueeze(1) * PS + torch.arange(PS)).reshape(-1)


# -- range checks of a plan built outside a pool's check ------------------------------------------------------------

@needs_layer_first
@pytest.mark.parametrize("bad", [CAP, -1])
def test_plan_refuses_host_indices_just_outside_the_pool(bad):
    pool, _ = _twins(1)
    h = torch.arange(CAP - PS, CAP)
    Plan(pool.binding, h, torch.arange(PS), "never", 1)  # the last slot is in range
    Plan(pool.binding, torch.arange(PS), torch.arange(PS), "never", 1)  # slot 0 too
    h = h.clone()
    h[-1 if bad == CAP else 0] = bad
    with pytest.raises(IndexRangeError, match=f"host_indices must lie in 0..{CAP - 1}"):
        Plan(pool.binding, h, torch.arange(PS), "never", 1)


@needs_layer_first
@pytest.mark.parametrize("bad", ["end", -1])
def test_plan_refuses_device_indices_just_outside_the_rows(bad):
    pool, _ = _twins(2)
    rows = pool.binding.device_rows
    d = torch.arange(rows - PS, rows)
    Plan(pool.binding, torch.arange(PS), d, "never", 1)  # the last row is in range
    d = d.clone()
    d[-1] = rows if bad == "end" else -1
    with pytest.raises(IndexRangeError, match=f"device_indices must lie in 0..{rows - 1}"):
        Plan(pool.binding, torch.arange(PS), d, "never", 1)


# -- the plan memo's keys ------------------------------------------------------------------------------------------

@needs_layer_first
def test_plan_memo_is_per_stream():
    pool, _ = _twins(3)
    cache: PlanCache = pool.binding.scratch["direct.plans"]
    h, d = _pages([2, 5]), _pages([7, 1])
    first = cache.get(h, d, 1)
    assert cache.get(h, d, 1) is first
    assert cache.peek(h, d, 2) is None
    other = cache.get(h, d, 2)
    assert other is not first and cache.peek(h, d, 1) is first and cache.peek(h, d, 2) is other


@needs_layer_first
@pytest.mark.parametrize("which", ["host", "device"])
@pytest.mark.parametrize("how", ["in-place", "new-tensor"])
def test_a_reused_index_pair_changed_on_one_side_moves_the_rows_named_now(which, how):
    """Backups and loads with the same (or a fresh) index tensor on one side and the other side's tensor rewritten
    in place (or replaced by a new object at another value) move the rows named now, as the reference does."""
    pool, ref = _twins(4)
    h, d = _pages([1, 6]), _pages([3, 12])
    for p in (pool, ref):
        p.backup_all_layers(h, d)
        p.load_layer(1, h, _pages([14, 9]))  # a one-layer plan of this pair too
    new_h, new_d = _pages([4, 0]), _pages([10, 5])
    if how == "in-place":
        (h if which == "host" else d).copy_(new_h if which == "host" else new_d)
    else:
        h, d = (new_h, d) if which == "host" else (h, new_d)
    for p in (pool, ref):
        p.backup_all_layers(h, d)
    _assert_host_equal(pool, ref)
    for p in (pool, ref):
        p.load_layer(1, h, _pages([15, 8]) if which == "device" and how == "new-tensor" else d)
        p.load_all_layers(h, d)
    _assert_dev_equal(pool, ref)


# -- pitched grouping limits ---------------------------------------------------------------------------------------

def test_group_bases_accepts_pitches_at_both_limits():
    """A pitch equal to the row width (rows back to back) and one equal to ``max_pitch`` still group."""
    assert group_bases([0, 64, 128], [0, 64, 128], 64, 2**31) == [[0, 1, 2]]
    assert group_bases([0, 100, 200], [0, 2**31, 2**32], 64, 2**31) == [[0, 1, 2]]
    assert group_bases([0, 2**31, 2**32], [0, 100, 200], 64, 2**31) == [[0, 1, 2]]
    assert group_bases([0, 100, 200], [0, MAX_PITCH + 1, 2 * MAX_PITCH + 2], 64, MAX_PITCH) == [[0], [1], [2]]
    assert group_bases([0, 63, 126], [0, 64, 128], 64, 2**31) == [[0], [1], [2]]


# -- options -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [True, False, 1.5, None])
def test_staging_bytes_must_be_a_whole_positive_count(bad):
    if bad is None:
        assert DirectStrategy(staging_bytes=1).staging_bytes == 1
        return
    with pytest.raises(ConfigError, match="staging_bytes"):
        DirectStrategy(staging_bytes=bad)


@pytest.mark.parametrize("value", ["", "  ", " Never "])
def test_blank_staging_and_pitched_variables_mean_the_default(monkeypatch, value):
    monkeypatch.setenv("HICACHE_DIRECT_STAGING", value)
    monkeypatch.setenv("HICACHE_DIRECT_PITCHED", value)
    s = DirectStrategy()
    want = value.strip().lower() or "auto"
    assert s.staging == want and s.pitched == want


@needs_layer_first
@pytest.mark.parametrize("side", ["host", "device"])
def test_a_plan_range_checks_what_the_pools_check_did_not_read(side):
    """A pool's check may leave the host values (or the device values) unread; a plan handed that check's facts
    must still refuse an out-of-range value on that side before any copy."""
    from hicache_core.validate import CheckedPair, check_indices

    pool, _ = _twins(5)
    h, d = _pages([1, 2]), _pages([3, 4])
    if side == "host":
        h[-1] = CAP
    else:
        d[-1] = pool.binding.device_rows
    facts = check_indices(pool.spec, h, d, pool.binding.device_rows, host_values=side != "host",
                          device_values=side != "device")
    assert (facts.host_starts is None) == (side == "host") and facts.device_read == (side != "device")
    pool.binding.checked = CheckedPair(h, h._version, d, d._version, facts)
    try:
        with pytest.raises(IndexRangeError, match=f"{side}_indices must lie in"):
            Plan(pool.binding, h, d, "never", 1)
    finally:
        pool.binding.checked = None
