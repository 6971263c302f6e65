"""Early reads of device index tensors (``auto``'s ``prefetch``): a new pair's GPU-resident device indices start back
to the host at its first decided load, and a copy plan made later in the burst takes that read instead of waiting for
the stream.

On these CPU pools, :func:`hicache_core.backends.plans.defer_device_read` is told to treat the device indices as
GPU-resident (as tests/test_direct.py does; :func:`_gpu_resident` patches it in plans_plan, where plans and their cache look it up); a
CPU early read has no event, so what is checked here is which values a
plan takes, the bytes it moves, and when ``auto`` starts a read.  The CUDA side (the event a plan waits for) runs
with ``--hicache-device cuda`` on a GPU: the last tests here.
"""

from __future__ import annotations

import pytest
import torch

from hicache_core import HostKVPool, LayerMap, PoolSpec, create_registry
from hicache_core.backends import plans, plans_plan
from hicache_core.backends.auto import AutoStrategy
from hicache_core.backends.auto_rules import pick_key
from hicache_core.backends.plans import EarlyRead, Plan
from hicache_core.calibration import DEFAULT
from hicache_core.errors import ConfigError, IndexRangeError

REG = create_registry()
PS, PAGES, ROW = 16, 8, 96


def _gpu_resident(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    """Tell plans (``Plan``) and their cache (``PlanCache.read_early``) whether to treat device indices as GPU-resident:
    ``defer_device_read`` replaced in plans_plan, where both look it up."""
    monkeypatch.setattr(plans_plan, "defer_device_read", lambda binding: on)


def _pool() -> tuple[HostKVPool, dict, torch.Tensor, torch.Tensor]:
    """A two-layer ``layer_first`` pool served by ``direct``, random host bytes, canary-filled device rows, and a pair
    of page-aligned index tensors (device rows in the upper half, so the lower half stays canaries)."""
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=64, qk_rope_head_dim=16, dtype=torch.uint8,
                        page_size=PS, capacity=PS * PAGES, row_bytes=ROW)
    dev = {"kv": [torch.full((2 * PS * PAGES, 1, ROW), 0xA5, dtype=torch.uint8) for _ in range(2)]}
    pool = HostKVPool(spec, "layer_first", "direct", dev, registry=REG, strategy="core.direct")
    gen = torch.Generator().manual_seed(5)  # the same bytes and pages whatever ran before (a failure reproduces)
    for seg in pool.binding.segments:
        seg.host_flat.copy_(torch.randint(0, 256, seg.host_flat.shape, dtype=torch.uint8, generator=gen))
    pages = torch.randperm(PAGES, generator=gen)[:4]
    h = (pages.repeat_interleave(PS) * PS + torch.arange(PS).repeat(4)).to(torch.int64)
    d_pages = torch.randperm(PAGES, generator=gen)[:4]
    d = d_pages.repeat_interleave(PS) * PS + torch.arange(PS).repeat(4) + PS * PAGES
    return pool, dev, h, d


def test_a_plan_takes_the_early_read_of_its_device_indices(monkeypatch):
    """A plan made after an early read of the same tensor (unchanged) takes its snapshot and its device copy: values
    rewritten behind torch's version counter after the read change nothing; its submission is the one a plan of the
    snapshot's values builds.  An in-place change the counter sees drops the read."""
    _gpu_resident(monkeypatch, True)
    pool, _, h, d = _pool()
    cache = pool.binding.scratch["direct.plans"]
    early = cache.read_early(d, 0)
    assert isinstance(early, EarlyRead) and cache.early_of(d, 0) is early
    assert cache.read_early(d, 0) is None  # one read per tensor and stream
    assert cache.early_of(d, 7) is None and cache.get(h, d, 7)._early is None  # a plan on another stream: its own read
    want = d.clone()
    d.data.copy_(d.data.flip(0))  # behind the version counter: the early read holds the values of its call
    plan = cache.get(h, d, 0)
    assert plan._early is early and plan._d_dev is early.dev and not plan.d_read
    assert cache.early_of(d, 0) is None  # taken: the plan holds it
    sub = plan.submission(1)
    assert plan.d_read and torch.equal(plan.d, want)
    _gpu_resident(monkeypatch, False)
    ref = Plan(pool.binding, h, want, "never", 1)
    ref_sub = ref.submission(1)
    assert torch.equal(sub.host, ref_sub.host) and torch.equal(sub.dev, ref_sub.dev) and torch.equal(sub.lens, ref_sub.lens)
    _gpu_resident(monkeypatch, True)
    d.add_(0)  # the counter moves: the read is of other values now
    assert cache.early_of(d, 0) is None
    assert cache.get(h, d, 0)._early is None


def test_a_load_planned_from_an_early_read_writes_what_the_reference_writes(monkeypatch):
    """Bytes through the pool: a load whose plan took an early read writes the rows the reference backend writes, and
    the device rows it does not name keep their canaries."""
    _gpu_resident(monkeypatch, True)
    pool, dev, h, d = _pool()
    assert pool.binding.scratch["direct.plans"].read_early(d, 0) is not None
    canary = [rows[: PS * PAGES].clone() for rows in dev["kv"]]
    for layer in (0, 1):
        pool.load_layer(layer, h, d)
    assert pool.binding.scratch["direct.plans"].get(h, d, 0)._early is not None
    ref_dev = {"kv": [torch.full_like(rows, 0xA5) for rows in dev["kv"]]}
    ref = HostKVPool(pool.spec, "layer_first", "reference", ref_dev, registry=REG, strategy="core.reference")
    ref.binding.segments[0].host_flat.copy_(pool.binding.segments[0].host_flat)
    for layer in (0, 1):
        ref.load_layer(layer, h, d)
    for rows, want, can in zip(dev["kv"], ref_dev["kv"], canary):
        assert torch.equal(rows, want)
        assert torch.equal(rows[: PS * PAGES], can)


def test_an_early_read_of_rows_out_of_range_raises_before_any_byte_moves(monkeypatch):
    """The early read's values are range-checked when the plan reads them, as a plan's own read is."""
    _gpu_resident(monkeypatch, True)
    pool, dev, h, _ = _pool()
    bad = torch.arange(2 * PS * PAGES - 32, 2 * PS * PAGES - 32 + h.numel())  # runs past the device rows
    cache = pool.binding.scratch["direct.plans"]
    assert cache.read_early(bad, 0) is not None
    before = [rows.clone() for rows in dev["kv"]]
    plan = cache.get(h, bad, 0)
    with pytest.raises(IndexRangeError, match=r"device_indices must lie in 0\.\.255; nothing was copied"):
        plan.submission(1)
    assert all(torch.equal(rows, b) for rows, b in zip(dev["kv"], before))


def test_a_full_check_of_newer_values_does_not_vouch_for_an_early_reads_values(monkeypatch):
    """``validate="full"`` checks the values a tensor holds at the call; a plan taking an early read uses the values of
    the read.  Where those were rewritten behind the version counter in between (out of range at the read, in range
    at the check), the plan range-checks its own values: it raises, and no byte moves."""
    _gpu_resident(monkeypatch, True)
    pool, dev, h, _ = _pool()
    pool = HostKVPool(pool.spec, "layer_first", "direct", dev, registry=REG, strategy="core.direct", validate="full")
    bad = torch.arange(2 * PS * PAGES - 32, 2 * PS * PAGES - 32 + h.numel())  # runs past the device rows
    assert pool.binding.scratch["direct.plans"].read_early(bad, 0) is not None
    bad.data.copy_(torch.arange(h.numel()))  # in range now, behind the version counter
    before = [rows.clone() for rows in dev["kv"]]
    with pytest.raises(IndexRangeError, match=r"device_indices must lie in 0\.\.255; nothing was copied"):
        pool.load_layer(1, h, bad)
    assert all(torch.equal(rows, b) for rows, b in zip(dev["kv"], before))


def test_no_early_read_where_reading_would_not_wait_or_could_not_be_matched():
    """A CPU pool reads its indices without waiting: no early read; nor for tensors off the pool's device or without
    a version counter (they could not be matched to a later call)."""
    pool, _, h, d = _pool()
    cache = pool.binding.scratch["direct.plans"]
    assert cache.read_early(d, 0) is None  # defer_device_read is False on a CPU pool
    with torch.inference_mode():
        frozen = torch.arange(4)
    for t in (d.to("meta"), frozen):
        assert plans.defer_device_read(pool.binding) is False
        assert cache.read_early(t, 0) is None


def _auto(pool: HostKVPool, **options: object) -> AutoStrategy:
    auto = AutoStrategy(**options)  # type: ignore[arg-type]
    auto.direct, auto.kernel, auto.calibration = pool.strategy, object(), DEFAULT  # type: ignore[assignment]
    return auto


def test_auto_prefetch_starts_one_read_at_a_new_pairs_first_decided_load(monkeypatch):
    """With ``prefetch=True``, a new pair's first decided load starts one early read; later calls of the pair, backups
    and all-layer calls start none, nor do pairs whose host indices live off the CPU or that have a plan already.
    Without the option, nothing is read early."""
    _gpu_resident(monkeypatch, True)
    pool, _, h, d = _pool()
    cache = pool.binding.scratch["direct.plans"]
    auto = _auto(pool, prefetch=True)
    auto.pick(pool.binding, h, d, 1, to_host=False)
    assert auto.early_reads == 1 and cache.early_of(d, 0) is not None
    auto.pick(pool.binding, h, d, 0, to_host=False)  # another layer of the same pair: planned or read already
    auto.pick(pool.binding, h, d, 1, to_host=False)
    h2, d2 = h.clone(), d.clone()
    auto.pick(pool.binding, h2, d2, 1, to_host=True)  # a backup
    auto.pick(pool.binding, h2, d2, None, to_host=False)  # all layers
    assert auto.early_reads == 1 and cache.early_of(d2, 0) is None
    off = _auto(pool)
    h3, d3 = h.clone(), d.clone()
    off.pick(pool.binding, h3, d3, 1, to_host=False)
    assert off.early_reads == 0 and cache.early_of(d3, 0) is None
    d4 = d.clone()
    cache.get(h, d4, 0)  # planned already: nothing to read early
    auto.pick(pool.binding, h, d4, 1, to_host=False)
    assert cache.early_of(d4, 0) is None
    d5 = d.clone()
    auto._read_early(pool.binding, h.to("meta"), d5)  # host indices off the CPU (reading them waits anyway)
    assert cache.early_of(d5, 0) is None and auto.early_reads == 1


class _Early:
    def __init__(self, landed: bool) -> None:
        self.landed = landed

    def ready(self) -> bool:
        return self.landed


def test_a_pair_whose_early_read_landed_is_not_held_to_the_kernel(monkeypatch):
    """Beside memory-bound work, a pair the kernel serves in its first burst is held to it when the picks are decided
    again (planning would read its indices behind the queued loads), unless its early read has landed."""
    pool, _, h, d = _pool()
    auto = _auto(pool, forward="memory", prefetch=True)
    auto._layers = 2
    d_gpu = d.to("meta")  # "off the CPU" as far as the rule can tell
    key = pick_key(h, d_gpu, 1, False)
    auto._picks[key], auto._uses[key] = auto.kernel, [1, h, d_gpu]
    cache = pool.binding.scratch["direct.plans"]
    for landed, held in ((None, True), (False, True), (True, False)):
        early = None if landed is None else _Early(landed)
        monkeypatch.setattr(cache, "early_of", lambda t, stream, e=early: e)
        assert (key in auto._held(pool.binding)) == held, landed


def test_prefetch_must_be_a_bool():
    with pytest.raises(ConfigError, match="auto's prefetch option must be True or False, got 'yes'"):
        AutoStrategy(prefetch="yes")  # type: ignore[arg-type]


def _cuda_pool(device: torch.device, backend: str, **options: object) -> tuple[HostKVPool, dict]:
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(4), kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                        page_size=PS, capacity=PS * PAGES, device=device)
    dev = {"kv": [torch.full((2 * PS * PAGES, 1, 576), 7.0, dtype=torch.bfloat16, device=device) for _ in range(4)]}
    pool = HostKVPool(spec, "layer_first", backend, dev, registry=REG, strategy_options=options or None)
    return pool, dev


@pytest.mark.parametrize("backend", ["direct", "auto"])
def test_loads_after_an_early_read_on_the_gpu_are_bit_exact(hicache_device, backend):
    """On a CUDA pool, with GPU-resident device indices: ``direct`` plans from an early read queued behind other work
    (so its values are there only once its event fired), ``auto`` with ``prefetch=True`` starts one per new pair;
    the plan's values are the tensor's, every layer's rows land as the reference backend writes them, and the rows
    not named keep their canaries."""
    if hicache_device.type != "cuda":
        pytest.skip("needs a CUDA device (an early read's event); the CPU side runs above")
    options = {"prefetch": True, "lone": False} if backend == "auto" else {}
    pool, dev = _cuda_pool(hicache_device, backend, **options)
    host = pool.binding.segments[0].host_flat
    host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(6)))
    _, _, h, d_cpu = _pool()
    d = d_cpu.to(hicache_device)
    stream = torch.cuda.current_stream(hicache_device).cuda_stream
    cache = pool.binding.scratch["direct.plans"]
    torch.cuda._sleep(1 << 24)  # the read is queued behind this: reading its buffer before the event fires would fail
    if backend == "direct":
        assert cache.read_early(d, stream) is not None
    for layer in range(4):
        pool.load_layer(layer, h, d)
    if backend == "auto":
        assert pool.strategy.early_reads == 1  # type: ignore[attr-defined]
    plan = cache.peek(h, d, stream)
    if backend == "direct" or plan is not None:  # auto plans only where it picked the copy engine
        assert plan is not None and plan._early is not None and torch.equal(plan.d, d_cpu)
    ref_dev = {"kv": [torch.full_like(rows, 7.0) for rows in dev["kv"]]}
    ref = HostKVPool(pool.spec, "layer_first", "reference", ref_dev, registry=REG, strategy="core.reference")
    ref.binding.segments[0].host_flat.copy_(host)
    for layer in range(4):
        ref.load_layer(layer, h, d)
    torch.cuda.synchronize()
    for rows, want in zip(dev["kv"], ref_dev["kv"]):
        assert torch.equal(rows.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(rows[: PS * PAGES], torch.full_like(rows[: PS * PAGES], 7.0))


def test_explain_tells_whether_auto_reads_early():
    pool, _, _, _ = _pool()
    for prefetch in (False, True):
        lines = AutoStrategy(prefetch=prefetch).describe(pool.spec, REG.layout("layer_first"))
        assert any(line.startswith("auto: prefetch:") for line in lines) is prefetch


def test_an_early_read_is_not_taken_after_a_data_swap(monkeypatch):
    """``d.data = other`` keeps the object and its version counter: the read compares address, length and dtype, so a
    plan made after the swap reads the new values itself."""
    _gpu_resident(monkeypatch, True)
    pool, _, h, d = _pool()
    cache = pool.binding.scratch["direct.plans"]
    assert cache.read_early(d, 0) is not None
    d.data = d.data.flip(0).clone()  # the same rows, in another order: another storage
    assert cache.early_of(d, 0) is None
    plan = cache.get(h, d, 0)
    assert plan._early is None and torch.equal(plan.d, d)


def test_no_early_read_where_the_layout_alone_gives_the_load_to_the_kernel(monkeypatch):
    """One layer of a token-major (``page_first``) host page is rows of 96 bytes: the layout alone bounds the copy
    blocks under the calibrated size, so the kernel serves every such load and no plan will want the values."""
    _gpu_resident(monkeypatch, True)
    pool, dev, h, d = _pool()
    page_first = HostKVPool(pool.spec, "page_first", "direct", dev, registry=REG, strategy="core.direct")
    auto = _auto(page_first, prefetch=True)
    assert auto.pick(page_first.binding, h, d, 1, to_host=False) is auto.kernel
    assert auto.early_reads == 0 and page_first.binding.scratch["direct.plans"].early_of(d, 0) is None
