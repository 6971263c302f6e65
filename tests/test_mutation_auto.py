"""Mutation-test review of ``auto`` (``backends/auto.py``), the host pace (``backends/pace.py``) and the forward
watch (``backends/forward.py``): tests that pin behaviour the other suites left open.  Fake clocks only."""

from __future__ import annotations

import torch

from hicache_core import HostKVPool, LayerMap, PoolSpec, create_registry
from hicache_core.backends.auto import AutoStrategy
from hicache_core.backends.auto_rules import pick_key
from hicache_core.backends.direct import DirectStrategy
from hicache_core.backends.pace import MODEL_CALL_US, WINDOW, HostPace
from hicache_core.calibration import DEFAULT
from fakes import FakeEvent, check_moved_generation_drops_the_pick, auto_over

REG = create_registry()


def _fill(pace: HostPace, desc_us: float, count: int = WINDOW, ops: int = 64, calls: int = 1) -> None:
    for _ in range(count):
        pace.record(ops * desc_us + calls * MODEL_CALL_US, ops, calls)


def _fp8_pool(ps: int = 64, pages: int = 64) -> tuple[HostKVPool, torch.Tensor, torch.Tensor]:
    """One-layer loads of 64 pages of 656-byte rows (42 KB blocks, 2.7 MB), as in tests/test_pace.py."""
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.uint8,
                        page_size=ps, capacity=ps * pages, row_bytes=656)
    dev = {"kv": [torch.zeros(ps * pages, 1, 656, dtype=torch.uint8) for _ in range(2)]}
    pool = HostKVPool(spec, "layer_first", "direct", dev, registry=REG, strategy="core.direct")
    h = torch.arange(pages).flip(0).repeat_interleave(ps) * ps + torch.arange(ps).repeat(pages)
    return pool, h, torch.arange(ps * pages)


class _Paces:
    def __init__(self) -> None:
        self.t = [50.0]
        self.paces = (HostPace(now=lambda: self.t[0]), HostPace(now=lambda: self.t[0]))
        self.warm = (HostPace(now=lambda: self.t[0], warm=True), HostPace(now=lambda: self.t[0], warm=True))


def test_a_kernel_pick_decided_again_at_its_first_reuse_is_then_served_from_the_memo():
    """Only the *first* reuse of a kernel-picked pair decides again; later reuses take the memo."""
    pool, h, d = _fp8_pool()
    w = _Paces()
    auto = auto_over(pool, w)
    auto.warm_paces, auto._layers = w.warm, 2
    _fill(w.paces[False], 0.9)
    _fill(w.warm[False], 0.9)  # reused plans slow too: the kernel again
    for layer in (1, 0, 1, 0, 1, 0):
        assert auto.pick(pool.binding, h, d, layer, to_host=False) is auto.kernel
    assert auto.decisions == 2  # the first call and the first reuse; none after


def test_the_lane_serves_a_memoised_pick_while_both_directions_are_measured(monkeypatch):
    """The picks of each direction are stamped with that direction's measures' generations: the lane keeps serving the
    memoised route while none moves.  The backups' measure moving (a new generation of the D2H pace) neither drops the
    memoised load picks nor makes the load lane decline (a declined call takes the pool's normal path: 250-450 us
    each on the H100 host of docs/performance.md); the backups' pick is decided again.  And the reverse."""
    pool, h, d = _fp8_pool()
    w = _Paces()
    _fill(w.paces[False], 0.42)
    _fill(w.paces[True], 0.42)
    auto = auto_over(pool, w)
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.direct
    auto.pick(pool.binding, h, d, None, to_host=True)
    ran: list = []
    monkeypatch.setattr(DirectStrategy, "lane", lambda self, binding, to_host: lambda *a: ran.append(a) or True)
    lane = auto.lane(pool.binding, False)
    assert lane is not None and lane(1, h, d) and len(ran) == 1
    decided = auto.decisions
    _fill(w.paces[True], 0.9)  # the backups' measure moved
    assert lane(1, h, d) and len(ran) == 2  # the load lane still serves
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.direct and auto.decisions == decided  # memoised
    auto.pick(pool.binding, h, d, None, to_host=True)
    assert auto.decisions == decided + 1  # the backup: decided again
    _fill(w.paces[False], 0.9)  # the loads' measure moved
    assert not lane(1, h, d) and len(ran) == 2  # declined: load() decides again
    auto.pick(pool.binding, h, d, None, to_host=True)
    assert auto.decisions == decided + 1  # the backup's pick stays
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.kernel and auto.decisions == decided + 2


def test_an_all_layer_kernel_pick_is_not_held_after_its_one_call_burst():
    """``_held``: an all-layer call is a burst of its own, so after one call its pair is not held to the kernel."""
    pool, h, d = _fp8_pool()
    auto = auto_over(pool, _Paces(), forward="memory")
    auto._layers = 4
    on_gpu = (h.to("meta"), d.to("meta"))
    key = pick_key(*on_gpu, None, False)
    auto._picks[key], auto._uses[key] = auto.kernel, [1, *on_gpu]
    assert auto._held(pool.binding) == {}
    one = pick_key(*on_gpu, 1, False)
    auto._picks[one], auto._uses[one] = auto.kernel, [1, *on_gpu]  # one-layer: within its burst of 4
    assert auto._held(pool.binding) == {one: auto.kernel}


def test_a_smallest_block_of_exactly_the_calibrated_size_may_use_the_copy_engine():
    """The calibrated ``min_block`` is the smallest block *with which* the copy engine is used: a block of exactly
    that size is not refused."""
    from dataclasses import replace

    pool, h, d = _fp8_pool()  # 64 x 656 = 41984-byte blocks
    w = _Paces()
    _fill(w.paces[False], 0.42)  # a host fast enough for these loads
    auto = auto_over(pool, w)
    auto.calibration = replace(DEFAULT, h2d_min_block=64 * 656)
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.direct
    auto = auto_over(pool, w)
    auto.calibration = replace(DEFAULT, h2d_min_block=64 * 656 + 1)
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.kernel


def test_a_backups_plan_is_not_remembered_as_a_loads():
    """``_load_blocks`` (what ``_refuse_unread`` judges GPU-resident loads by) records one-layer *loads* only."""
    pool, h, d = _fp8_pool(ps=256, pages=16)  # fed at the calibration's costs: both directions plan
    auto = auto_over(pool, _Paces())
    assert auto.pick(pool.binding, h, d, 1, to_host=True) is auto.direct
    assert auto._load_blocks == {}
    auto.pick(pool.binding, h, d, 1, to_host=False)
    assert {n: entry[:2] for n, entry in auto._load_blocks.items()} == {h.numel(): (16, 16 * 256 * 656)}


def test_a_call_of_exactly_min_ops_blocks_is_sent_to_measure_the_host():
    """32 (MIN_OPS) blocks of 42 KB: the calibrated margin refuses them (28 us > 24.4 us at link speed) but a host at
    the calibration's cost feeds a burst (22 us): with no measure the copy engine serves the call to measure the host
    (the copier samples submissions of MIN_OPS descriptors or more)."""
    pool, h, d = _fp8_pool(ps=64, pages=32)
    auto = auto_over(pool, _Paces())
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.direct and auto.pace_probes == 1


def test_a_partial_page_counts_as_a_page_of_blocks_in_the_host_index_bound():
    """``_least_blocks`` rounds the pages a call touches up: half a page of a page-major layout is one block, so a
    host measured far too slow for one descriptor refuses it without planning."""
    if "page_first_direct" not in REG.layouts:
        import pytest

        pytest.skip("page_first_direct is not installed")
    ps = 64
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                        page_size=ps, capacity=ps * 4)
    dev = {"kv": [torch.zeros(ps * 4, 1, 576, dtype=torch.bfloat16) for _ in range(2)]}
    pool = HostKVPool(spec, "page_first_direct", "direct", dev, registry=REG, strategy="core.direct")
    w = _Paces()
    _fill(w.paces[False], 1e4)
    auto = auto_over(pool, w)
    h = torch.arange(ps // 2)
    assert auto._least_blocks(pool.binding, h, 1) == (1, (ps // 2) * 1152)
    assert auto.pick(pool.binding, h, torch.arange(ps // 2), 1, to_host=False) is auto.kernel
    assert auto._load_blocks == {}  # refused before any plan


def test_a_kernel_that_fails_to_prepare_where_direct_cannot_serve_fails_the_pool():
    """With no ``direct`` candidate, a kernel's failure to prepare is the pool's: it is raised, not swallowed
    (``auto`` would be left with no candidate at all)."""
    import pytest

    pool, _, _ = _fp8_pool()
    auto = AutoStrategy()

    class Broken:
        def prepare(self, binding):  # type: ignore[no-untyped-def]
            raise ImportError("libtriton.so: cannot open shared object file")

    auto.direct, auto.kernel, auto.kernel_name = None, Broken(), "broken.kernel"  # type: ignore[assignment]
    with pytest.raises(ImportError, match="libtriton"):
        auto.prepare(pool.binding)


class _Candidate:
    """A stand-in candidate that records what it serves; the kernel has fast loads for every layer."""

    def __init__(self, name: str, served: list, fast: bool = False) -> None:
        self.name, self.served = name, served
        if fast:
            self.fast_load = lambda binding, layer, n: True

    def load(self, binding, h, d, layer):  # type: ignore[no-untyped-def]
        self.served.append((self.name, layer))

    def backup(self, binding, h, d, layer):  # type: ignore[no-untyped-def]
        self.served.append((self.name + " backup", layer))




def _watched(monkeypatch, t: list, served: list, forward: str = "watch"):  # type: ignore[no-untyped-def]
    """A clocked ``auto`` (CUDA-looking binding, stream 0x77, 4 layers of 1152-byte rows) with ``forward="watch"``
    over stand-in candidates; ``pick`` always says ``direct``."""
    import types

    from hicache_core.backends import auto as auto_mod
    from hicache_core.backends.forward import ForwardWatch
    from hicache_core.backends.memcpy import QueueClock

    spec = types.SimpleNamespace(bytes_per_token=4 * 1152, layer_map=types.SimpleNamespace(device_layers=range(4)))
    binding = types.SimpleNamespace(device=torch.device("cuda", 0), spec=spec, scratch={})
    monkeypatch.setattr(auto_mod, "current_stream_handle", lambda index: 0x77)
    auto = AutoStrategy(forward=forward)
    auto.direct = _Candidate("direct", served)  # type: ignore[assignment]
    auto.kernel = _Candidate("kernel", served, fast=True)  # type: ignore[assignment]
    auto.clock = QueueClock(now=lambda: t[0])
    auto._arm(binding)
    monkeypatch.setattr(auto, "pick", lambda b, hh, dd, layer, to_host: auto.direct)
    ms, done, log = [0.0], [False], []
    if forward == "watch":
        auto.watch = ForwardWatch(55.0, now=lambda: t[0], event=lambda: FakeEvent(log, done, ms), stream=lambda i: i,
                                  min_room=auto.watch.min_room if auto.watch is not None else 1.0)
    return auto, binding, ms, done, log


def test_load_renews_a_memory_bound_verdict_through_the_kernel_once_due(monkeypatch):
    """The normal path (not only the lane): beside memory-bound work a lone load goes by the rule of the rest, but
    once the verdict is RENEW_S old the next lone load goes to the kernel, timed."""
    from hicache_core.backends.forward import RENEW_S

    t, served = [100.0], []
    auto, binding, ms, done, log = _watched(monkeypatch, t, served)
    h = d = torch.arange(4096)  # 4.7 MB per layer: timed
    auto.load(binding, h, d, 0)  # lone: the kernel, timed
    assert served == [("kernel", 0)] and len(log) == 2
    ms[0], done[0] = 1.0, True  # 0.09 of the link: memory-bound
    assert auto.watch.memory_bound()
    t[0] += 1.0  # long drained and paused: lone; the verdict is also due for renewal
    done[0] = False
    auto.load(binding, h, d, 1)
    assert served[-1] == ("kernel", 1) and len(log) == 4 and auto.lone_kernel_loads == 2
    ms[0], done[0] = 1.0, True
    t[0] += RENEW_S / 10  # lone again, but not due: the rule of the rest
    auto.load(binding, h, d, 2)
    assert served[-1] == ("direct", 2) and len(log) == 4


def test_the_lane_leaves_a_kernel_pairs_first_reuse_to_pick_even_where_the_kernel_has_a_lane(monkeypatch):
    """A pair memoised to the kernel is decided again at its first reuse (the pace of reused plans): the lane
    declines that call although the kernel's lane could serve it, and serves the kernel's later calls."""
    pool, h, d = _fp8_pool()
    w = _Paces()
    auto = auto_over(pool, w)
    ran: list = []

    class Kernel:
        def lane(self, binding, to_host):  # type: ignore[no-untyped-def]
            return lambda *a: ran.append(a) or True

    auto.kernel = Kernel()  # type: ignore[assignment]
    auto.warm_paces, auto._layers = w.warm, 2
    _fill(w.paces[False], 0.9)
    _fill(w.warm[False], 0.9)
    assert [auto.pick(pool.binding, h, d, layer, to_host=False) for layer in (1, 0)] == [auto.kernel] * 2
    lane = auto.lane(pool.binding, False)
    assert lane is not None and not lane(1, h, d) and ran == []  # the first reuse: pick() decides
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.kernel
    assert lane(0, h, d) and len(ran) == 1  # later reuses: the memoised kernel's lane


def test_the_lane_declines_once_the_measure_of_reused_plans_aged(monkeypatch):
    """The measure of reused plans ages sooner (WARM_STALE_S) than that of planning calls: once it aged, the lane
    declines the memoised route so that pick() decides again, though the planning measure is still fresh."""
    from hicache_core.backends.pace import STALE_S, WARM_STALE_S

    pool, h, d = _fp8_pool()
    w = _Paces()
    auto = auto_over(pool, w)
    auto.warm_paces = w.warm
    _fill(w.paces[False], 0.42)
    _fill(w.warm[False], 0.42)
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.direct
    ran: list = []
    monkeypatch.setattr(DirectStrategy, "lane", lambda self, binding, to_host: lambda *a: ran.append(a) or True)
    lane = auto.lane(pool.binding, False)
    assert lane is not None and lane(1, h, d) and len(ran) == 1
    w.t[0] += (WARM_STALE_S + STALE_S) / 2
    assert w.warm[False].aged() and not w.paces[False].aged()
    assert not lane(1, h, d) and len(ran) == 1


def test_a_one_layer_load_is_timed_by_its_own_layers_bytes(monkeypatch):
    """The watch times loads of MIN_TIMED_BYTES or more, counting one layer's bytes for a one-layer load: 1024
    positions of one 1152-byte layer (1.2 MB) are not timed, 2048 (2.4 MB) are."""
    t, served = [100.0], []
    auto, binding, ms, done, log = _watched(monkeypatch, t, served)
    small = torch.arange(1024)
    auto.load(binding, small, small, 0)
    assert served == [("kernel", 0)] and log == []
    t[0] += 1.0
    big = torch.arange(2048)
    auto.load(binding, big, big, 0)
    assert served[-1] == ("kernel", 0) and len(log) == 2


def test_a_backup_books_the_loads_stream_so_the_next_load_is_not_lone(monkeypatch):
    t, served = [100.0], []
    auto, binding, *_ = _watched(monkeypatch, t, served, forward="compute")
    h = d = torch.arange(4096)
    auto.backup(binding, h, d, None)
    auto.load(binding, h, d, 0)
    assert served == [("direct backup", None), ("direct", 0)]
    t[0] += 1.0
    auto.load(binding, h, d, 1)
    assert served[-1] == ("kernel", 1)


def test_a_backup_books_its_start_on_the_clock_as_the_lane_does(monkeypatch):
    """The normal path books a backup from the call's start (the lane books from its own start): its submission's
    host time does not push the clock's estimate of the queue's end later."""
    from hicache_core.backends.memcpy import DRAIN_BYTES_PER_US

    t, served = [100.0], []
    auto, binding, *_ = _watched(monkeypatch, t, served, forward="compute")
    h = d = torch.arange(4096)
    submit = auto.direct.backup

    def slow_backup(b, hh, dd, layer):  # type: ignore[no-untyped-def]
        submit(b, hh, dd, layer)
        t[0] += 2e-3  # 2 ms of host time submitting it
    monkeypatch.setattr(auto.direct, "backup", slow_backup)
    start = t[0]
    auto.backup(binding, h, d, None)
    assert abs(auto.clock._until[0x77] - (start + 4096 * 4 * 1152 / DRAIN_BYTES_PER_US * 1e-6)) < 1e-9
    assert abs(auto.clock._last_end[0x77] - (start + 2e-3)) < 1e-9  # the call's end: the gap to the next call


def test_a_measure_counts_until_exactly_its_stale_time():
    from hicache_core.backends.pace import STALE_S

    t = [50.0]
    pace = HostPace(now=lambda: t[0])
    _fill(pace, 0.5)
    t[0] += STALE_S
    assert pace.fresh() == 0.5 and not pace.aged() and not pace.stale()
    t[0] += 1e-6
    assert pace.fresh() is None and pace.aged() and pace.stale()


def test_the_estimate_is_recomputed_every_fourth_sample():
    """Past MIN_SAMPLES the median is recomputed every fourth sample: a full window of 1 us, then eight samples of
    10 us make the estimate 10 us at the eighth (recomputed at the fourth and the eighth)."""
    t = [50.0]
    pace = HostPace(now=lambda: t[0])
    _fill(pace, 1.0)
    assert pace.desc_us == 1.0
    _fill(pace, 10.0, count=7)
    assert pace.desc_us == 1.0  # recomputed at the fourth: still seven of fifteen
    _fill(pace, 10.0, count=1)
    assert pace.desc_us == 10.0


def test_the_layout_bound_on_blocks_is_judged_by_the_calls_direction():
    """18 KB page blocks (page_first_direct, 16 rows of 1152 bytes) under a calibration whose loads take the copy
    engine from 16 KB and backups from 32 KB (the shipped one takes both from 32 KB): a fast host's loads go to the
    copy engine; backups go to the kernel by the layout alone."""
    from dataclasses import replace

    if "page_first_direct" not in REG.layouts:
        import pytest

        pytest.skip("page_first_direct is not installed")
    ps, pages = 16, 64
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                        page_size=ps, capacity=ps * pages)
    dev = {"kv": [torch.zeros(ps * pages, 1, 576, dtype=torch.bfloat16) for _ in range(2)]}
    pool = HostKVPool(spec, "page_first_direct", "direct", dev, registry=REG, strategy="core.direct")
    w = _Paces()
    _fill(w.paces[False], 0.1)
    _fill(w.paces[True], 0.1)
    auto = auto_over(pool, w)
    auto.calibration = cal = replace(DEFAULT, h2d_min_block=16 * 1024)
    assert cal.h2d_min_block <= auto._block_bound(pool.binding, 1) < cal.d2h_min_block
    h, d = torch.arange(ps * pages), torch.arange(ps * pages)
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.direct
    assert auto.pick(pool.binding, h, d, 1, to_host=True) is auto.kernel


def _bare_watch(t: list, ms: list, done: list, log: list, link_gbps: float = 55.0):  # type: ignore[no-untyped-def]
    from hicache_core.backends.forward import ForwardWatch

    return ForwardWatch(link_gbps, now=lambda: t[0], event=lambda: FakeEvent(log, done, ms), stream=lambda i: i)


def _land(watch, t: list, ms: list, done: list, nbytes: int, took_ms: float) -> None:  # type: ignore[no-untyped-def]
    done[0] = False
    watch.timed(lambda: None, nbytes, 0)
    ms[0], done[0] = took_ms, True
    watch.memory_bound()  # lands it


def test_the_watchs_lines_themselves():
    """Boundaries: a load of exactly MIN_TIMED_BYTES is timed; a verdict exactly RENEW_S old is due; a timing of
    exactly MAX_SHARE of the link is kept; a room that moved by exactly ROOM_STEP moves the generation."""
    from hicache_core.backends.forward import MAX_SHARE, MIN_TIMED_BYTES, RENEW_S, ROOM_STEP

    t, ms, done, log = [10.0], [0.0], [False], []
    watch = _bare_watch(t, ms, done, log)
    assert watch.due(MIN_TIMED_BYTES) and not watch.due(MIN_TIMED_BYTES - 1)
    _land(watch, t, ms, done, 4 << 20, 1.0)  # 0.08 of the link: memory-bound, landed at t = 10
    assert watch.memory_bound() and not watch.due(4 << 20)
    t[0] += RENEW_S
    assert watch.due(4 << 20)

    exact = _bare_watch(t, ms, done, log, link_gbps=0.01)  # 10 000 bytes per ms
    _land(exact, t, ms, done, 11000, 1.0)  # exactly MAX_SHARE
    assert MAX_SHARE == 1.1 and exact.dropped == 0 and exact.timings == 1 and exact.last_share == 1.1

    steps = _bare_watch(t, ms, done, log, link_gbps=1.0)  # 1e6 bytes per ms
    _land(steps, t, ms, done, 435000, 1.0)  # share 0.435: memory-bound, room 0.87 / 0.435 = 2
    assert steps.memory_bound() and steps.room() == 2.0 and steps.generation == 1
    t[0] += RENEW_S
    _land(steps, t, ms, done, 290000, 1.0)  # share 0.29: room 3, exactly ROOM_STEP times 2
    assert ROOM_STEP == 1.5 and steps.room() == 3.0 and steps.generation == 2


def test_a_pick_decided_while_the_watchs_verdict_moved_is_not_kept():
    """As for a measure that moved: a pick decided while another thread saw the watch's verdict change was decided at
    the old room, and is not memoised."""
    pool, h, d = _fp8_pool()
    check_moved_generation_drops_the_pick(auto_over(pool, _Paces()), "_watch_gen", pool.binding, h, d)


def test_the_lane_serves_a_probe_pick_while_its_measure_has_no_estimate_yet(monkeypatch):
    """A measure without an estimate has nothing to age: the lane serves the probe's memoised route."""
    pool, h, d = _fp8_pool()
    w = _Paces()
    auto = auto_over(pool, w)
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.direct and auto.pace_probes == 1
    assert not w.paces[False].aged()
    ran: list = []
    monkeypatch.setattr(DirectStrategy, "lane", lambda self, binding, to_host: lambda *a: ran.append(a) or True)
    lane = auto.lane(pool.binding, False)
    assert lane is not None and lane(1, h, d) and len(ran) == 1


def test_a_renewed_verdict_holds_another_renew_s():
    """A timing that renews a memory-bound verdict (memory-bound again) restarts its RENEW_S."""
    from hicache_core.backends.forward import RENEW_S

    t, ms, done, log = [10.0], [0.0], [False], []
    watch = _bare_watch(t, ms, done, log)
    _land(watch, t, ms, done, 4 << 20, 1.0)
    t[0] += RENEW_S
    assert watch.due(4 << 20)
    _land(watch, t, ms, done, 4 << 20, 1.0)  # renewed: still memory-bound
    assert watch.memory_bound() and watch.timings == 2
    t[0] += RENEW_S / 2
    assert not watch.due(4 << 20)


def test_a_timing_lands_when_its_end_event_has_completed():
    """The end event tells a timing finished (the start event completes as soon as the stream reaches it)."""
    t, log = [10.0], []

    class Ev:
        def __init__(self, done: bool) -> None:
            self.done = done

        def record(self, stream: object) -> None:
            log.append(stream)

        def query(self) -> bool:
            return self.done

        def elapsed_time(self, other: object) -> float:
            return 1.0

    made = iter([Ev(True), Ev(False)])  # start completed, end not yet
    from hicache_core.backends.forward import ForwardWatch

    watch = ForwardWatch(55.0, now=lambda: t[0], event=lambda: next(made), stream=lambda i: i)
    watch.timed(lambda: None, 4 << 20, 0)
    assert not watch.memory_bound() and watch.timings == 0 and watch._pending is not None
    watch._events[1].done = True  # type: ignore[index]
    assert watch.memory_bound() and watch.timings == 1


def test_compute_bound_timings_never_move_the_generation_whatever_the_least_room():
    """With ``auto``'s least room (1 / MEMORY_KERNEL_SHARE), timings beside compute keep room 1 and the generation
    (the memoised picks stay)."""
    from hicache_core.backends.auto import MEMORY_KERNEL_SHARE
    from hicache_core.backends.forward import RENEW_S, ForwardWatch

    t, ms, done, log = [10.0], [0.0], [False], []
    watch = ForwardWatch(55.0, now=lambda: t[0], event=lambda: FakeEvent(log, done, ms), stream=lambda i: i,
                         min_room=1 / MEMORY_KERNEL_SHARE)
    for _ in range(3):
        t[0] += RENEW_S
        _land(watch, t, ms, done, 4 << 20, 0.08)  # 0.95 of the link
    assert watch.timings == 3 and not watch.memory_bound() and watch.generation == 0 and watch.room() == 1.0


def test_a_move_of_exactly_redecide_keeps_the_generation():
    """The generation moves when the estimate moves by *more than* REDECIDE of its anchor: 1.25 -> 1.4375 us is
    exactly 15 %, and keeps it; 1.25 -> 1.5 moves it."""
    from hicache_core.backends.pace import REDECIDE

    t = [50.0]
    pace = HostPace(now=lambda: t[0])
    _fill(pace, 1.25)
    assert pace.generation == 1 and REDECIDE == 0.15
    _fill(pace, 1.4375)
    assert pace.desc_us == 1.4375 and pace.generation == 1
    _fill(pace, 1.5)
    assert pace.desc_us == 1.5 and pace.generation == 2
