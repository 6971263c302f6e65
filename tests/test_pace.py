"""The host's measured submission pace (``backends.pace``), the copier's samples, and ``auto``'s use of them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hicache_core import HostKVPool, LayerMap, PoolSpec, create_registry
from hicache_core.backends import auto as auto_mod
from hicache_core.backends import memcpy as memcpy_mod
from hicache_core.backends.auto import ENV_FORWARD, FED_SHARE, MEMORY_KERNEL_SHARE, AutoStrategy
from hicache_core.backends.auto_rules import fed, pick_key, worth_measuring
from hicache_core.backends.cudart import batch_schedule
from hicache_core.backends.direct import DirectStrategy
from hicache_core.backends.memcpy import DRAIN_BYTES_PER_US, BatchCopier, QueueClock
from hicache_core.backends.pace import (MAX_BACKLOG_US, MIN_OPS, MIN_SAMPLES, MODEL_CALL_US, REDECIDE, STALE_S, WARM_STALE_S,
                                        WINDOW, HostPace)
from hicache_core.calibration import DEFAULT
from hicache_core.errors import ConfigError
from fakes import auto_over, check_moved_generation_drops_the_pick

REG = create_registry()


def _fill(pace: HostPace, desc_us: float, count: int = WINDOW, ops: int = 64, calls: int = 1) -> None:
    for _ in range(count):
        pace.record(ops * desc_us + calls * MODEL_CALL_US, ops, calls)


def test_pace_is_the_median_of_recent_samples_and_moves_its_generation_only_on_real_change():
    t = [10.0]
    pace = HostPace(now=lambda: t[0])
    assert pace.stale() and pace.fresh() is None
    for i in range(MIN_SAMPLES - 1):
        pace.record(64 * 0.4 + MODEL_CALL_US, 64, 1)
        assert pace.desc_us is None and pace.generation == 0  # too few samples: no estimate
    assert not pace.stale() and pace.fresh() is None  # a measure under way
    pace.record(64 * 0.4 + MODEL_CALL_US, 64, 1)
    assert pace.desc_us == pytest.approx(0.4) and pace.fresh() == pace.desc_us and pace.generation == 1
    assert pace.ages_at == t[0] + pace.stale_s  # aged() from then on
    pace.record(64 * 50.0 + MODEL_CALL_US, 64, 1)  # one stalled submission (thread descheduled): the median holds
    _fill(pace, 0.4, count=3)
    assert pace.desc_us == pytest.approx(0.4) and pace.generation == 1
    _fill(pace, 0.4 * (1 + REDECIDE / 2))  # a small drift: a new estimate, the same generation
    assert pace.desc_us == pytest.approx(0.4 * (1 + REDECIDE / 2)) and pace.generation == 1
    _fill(pace, 0.9)  # the host slowed down: a new generation
    assert pace.desc_us == pytest.approx(0.9) and pace.generation == 2
    assert len(pace.samples()) == WINDOW
    pace.record(1.0, 64, 3)  # less than the model's call cost: floored, never negative
    assert min(pace.samples()) > 0
    t[0] += STALE_S * 1.01  # an old measure no longer counts
    assert pace.stale() and pace.aged() and pace.fresh() is None and pace.desc_us is not None
    pace.reset()  # the estimate dropped: a new generation (decisions made from it are made again)
    assert pace.samples() == [] and pace.desc_us is None and pace.generation == 3 and not pace.aged()
    assert pace.ages_at < t[0] and pace.stale()  # still the last sample's: stale, with no estimate to age
    pace.reset()  # nothing to drop
    assert pace.generation == 3
    _fill(pace, 0.9, count=MIN_SAMPLES)  # a new measure: a new generation even at the old value
    assert pace.fresh() == pytest.approx(0.9) and pace.generation == 4


def test_cold_first_submissions_never_make_the_estimate():
    """The first submissions after the host idled can take several times the steady pace (H200 trace: 1.46 and
    0.78 us per descriptor, then 0.5-0.6): an estimate exists only once the median holds the steady pace, so the
    route it picks (and keeps until the measure ages) is not picked from a cold start."""
    pace = HostPace(now=lambda: 0.0)
    for desc_us in (1.46, 0.78) + (0.55,) * (WINDOW - 2):
        pace.record(64 * desc_us + MODEL_CALL_US, 64, 1)
        assert pace.desc_us is None or pace.desc_us == pytest.approx(0.55), pace.samples()
    assert pace.desc_us == pytest.approx(0.55)


def test_a_measure_of_reused_plans_ages_sooner_than_one_of_planning_calls():
    """A copier's measures of calls that reused a plan age after WARM_STALE_S (measuring them again is cheap), those
    of planning calls after STALE_S; a measure in between is fresh for the one and aged for the other."""
    assert 0 < WARM_STALE_S < STALE_S
    t = [0.0]
    copier = BatchCopier(torch.device("cpu"))
    assert all(p.stale_s == WARM_STALE_S for p in copier.warm_paces)
    assert all(p.stale_s == STALE_S for p in copier.paces)
    warm, planning = HostPace(now=lambda: t[0], warm=True), HostPace(now=lambda: t[0])
    _fill(warm, 0.5, count=MIN_SAMPLES)
    _fill(planning, 3.0, count=MIN_SAMPLES)
    t[0] += (WARM_STALE_S + STALE_S) / 2
    assert warm.aged() and warm.fresh() is None
    assert not planning.aged() and planning.fresh() == pytest.approx(3.0)


class _FakeRuntime:
    def __init__(self, t: list[float], desc_us: float) -> None:
        self.t, self.desc_us = t, desc_us
        self.calls: list[tuple[int, int, bool]] = []

    def copy_batch(self, dsts, srcs, lens, stream, eager):
        calls = batch_schedule(int(dsts.numel()), eager)
        self.calls.append((int(dsts.numel()), stream, eager))
        self.t[0] += (len(calls) * MODEL_CALL_US + int(dsts.numel()) * self.desc_us) * 1e-6


def _copier(monkeypatch, t: list[float], desc_us: float) -> tuple[BatchCopier, _FakeRuntime]:
    rt = _FakeRuntime(t, desc_us)
    monkeypatch.setattr(memcpy_mod, "runtime", lambda: rt)
    monkeypatch.setattr(memcpy_mod, "current_device_index", lambda: 0)
    copier = BatchCopier(torch.device("cuda", 0))  # nothing touches a GPU: the runtime is the fake's
    copier.clock = QueueClock(now=lambda: t[0])
    # The measures' own clock (when a measure goes stale) stands still: the samples a test takes are one measure
    # however long the machine running it stalls between them (a real clock here made the tests depend on the CI
    # machine's load: a stall of STALE_S between two samples started a new measure).  Their staleness is tested on
    # fake clocks of their own above.
    for pace in (*copier.paces, *copier.warm_paces):
        pace.now = lambda: 0.0
    return copier, rt


def test_copier_samples_its_host_time_per_descriptor_and_direction_but_not_small_or_queued_submissions(monkeypatch):
    t = [100.0]
    copier, rt = _copier(monkeypatch, t, desc_us=0.45)
    loads, backups = copier.paces[False], copier.paces[True]

    def submit(n: int, block: int = 40_000, to_host: bool | None = False) -> None:
        z = torch.zeros(n, dtype=torch.int64)
        copier.copy(z, z, torch.full((n,), block, dtype=torch.int64), stream=0x55, to_host=to_host)

    submit(MIN_OPS - 1)  # small: not sampled
    t[0] += 1.0
    submit(64, to_host=None)  # no direction given: not sampled
    assert loads.samples() == backups.samples() == []
    t[0] += 1.0  # the engine idle again
    submit(64)  # an idle engine's schedule: four small calls, measured and taken off
    assert rt.calls[-1] == (64, 0x55, True)
    assert loads.samples() == [pytest.approx(0.45)] and backups.samples() == []
    t[0] += 1.0
    submit(3904, block=400_000, to_host=True)  # a backup's worth: many calls in the eager schedule
    assert backups.samples() == [pytest.approx(0.45)]
    # behind a deep queue (a large submission right before): the runtime may wait for room, not sampled
    assert copier.clock.backlog_us(0x55, t[0]) > MAX_BACKLOG_US
    submit(64)
    assert len(loads.samples()) == 1
    t[0] += 2 * 3904 * 400_000 / DRAIN_BYTES_PER_US * 1e-6  # drained
    assert copier.clock.backlog_us(0x55, t[0]) == 0.0
    for _ in range(MIN_SAMPLES - 1):
        submit(64)  # a burst: one runtime call each (but the first), taken off as one
    assert rt.calls[-1] == (64, 0x55, False)
    assert len(loads.samples()) == MIN_SAMPLES and loads.desc_us == pytest.approx(0.45) and backups.desc_us is None


def _fp8_pool(ps: int = 64, pages: int = 64) -> tuple[HostKVPool, torch.Tensor, torch.Tensor]:
    """One-layer loads of 64 pages of 656-byte rows (42 KB blocks, 2.7 MB: 49 us at 55 GB/s), as in
    tests/test_direct.py::test_auto_keeps_a_host_margin_for_feeding."""
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.uint8,
                        page_size=ps, capacity=ps * pages, row_bytes=656)
    dev = {"kv": [torch.zeros(ps * pages, 1, 656, dtype=torch.uint8) for _ in range(2)]}
    pool = HostKVPool(spec, "layer_first", "direct", dev, registry=REG, strategy="core.direct")
    h = torch.arange(pages).flip(0).repeat_interleave(ps) * ps + torch.arange(ps).repeat(pages)  # no two pages merge
    return pool, h, torch.arange(ps * pages)


class _Paces:
    def __init__(self) -> None:
        self.t = [50.0]
        self.paces = (HostPace(now=lambda: self.t[0]), HostPace(now=lambda: self.t[0]))
        self.warm = (HostPace(now=lambda: self.t[0]), HostPace(now=lambda: self.t[0]))


def test_a_measured_fast_host_unlocks_the_copy_engine_where_the_margin_refuses_it():
    """The calibrated margin gives these loads to the kernel (the idle schedule's 56 us > 49 us); at a measured
    0.42 us per descriptor a burst's submission (33 us) fits the transfer time: the copy engine; at 0.9 us (a slow
    stretch: 64 us) it does not.  A move of the pace decides again; an old measure, the other direction's, no
    measure on a pool without one, or ``pace=False``: the calibration alone decides."""
    pool, h, d = _fp8_pool()
    direct = pool.strategy
    assert isinstance(direct, DirectStrategy)
    sub = direct.submission(pool.binding, h, d, 1)
    link_us = sub.nbytes / (DEFAULT.link_gbps * 1e3)
    assert not fed(sub, DEFAULT, to_host=False) and not fed(sub, DEFAULT, None, False)
    assert fed(sub, DEFAULT, 0.42, False) and not fed(sub, DEFAULT, 0.9, False)
    assert 64 * 0.42 + MODEL_CALL_US <= FED_SHARE * link_us < 64 * 0.9 + MODEL_CALL_US
    assert worth_measuring(sub, DEFAULT, to_host=False)  # 64 x 0.5 + 6 = 38 us <= 49 us
    assert fed(sub, DEFAULT)  # as a backup: 56 us <= 1.2 x 49 us (BACKUP_ROOM)

    w = _Paces()
    auto = auto_over(pool, w)
    _fill(w.paces[False], 0.42)
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is direct
    assert auto._picks[pick_key(h, d, 1, False)] is direct and auto.pace_probes == 0
    _fill(w.paces[False], 0.9)  # the host slowed down: a new generation, decided again
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.kernel
    _fill(w.paces[True], 0.42)  # the other direction's measure does not count for loads
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.kernel
    plain = auto_over(pool, None)  # no measures (pace=False, or a CPU pool): the calibration alone
    assert plain.pick(pool.binding, h, d, 1, to_host=False) is plain.kernel and plain.pace_probes == 0


def test_backup_room_is_an_option_of_auto_and_decides_a_backup_the_link_time_alone_refuses(monkeypatch):
    """One layer's backup of the fp8 pool: 56 us of calibrated submission for 49 us at link speed.  The default room
    (1.2x) gives it to the copy engine, ``backup_room=1.0`` to the kernel (no measure to start: a host at the
    calibration's cost would not feed it either); loads are untouched.  The option, or ``HICACHE_AUTO_BACKUP_ROOM``
    where it is not passed, must be a positive finite number: anything else raises, naming where it came from."""
    from hicache_core.backends.auto_rules import BACKUP_ROOM, ENV_BACKUP_ROOM

    monkeypatch.delenv(ENV_BACKUP_ROOM, raising=False)
    pool, h, d = _fp8_pool()
    roomy, strict = auto_over(pool, None), auto_over(pool, None, backup_room=1.0)
    assert (roomy.backup_room, strict.backup_room) == (BACKUP_ROOM, 1.0)
    # each rule takes the pool's room: the bound before a plan, and the plan's own
    least = roomy._least_blocks(pool.binding, h, 1)
    assert roomy._may_feed(*least, DEFAULT, True, None) and not strict._may_feed(*least, DEFAULT, True, None)
    sub = pool.strategy.submission(pool.binding, h, d, 1)
    assert fed(sub, DEFAULT, backup_room=roomy.backup_room) and not fed(sub, DEFAULT, backup_room=strict.backup_room)
    assert roomy.pick(pool.binding, h, d, 1, to_host=True) is pool.strategy
    assert strict.pick(pool.binding, h, d, 1, to_host=True) is strict.kernel and strict.pace_probes == 0
    assert roomy.pick(pool.binding, h, d, 1, to_host=False) is roomy.kernel  # loads: their own rule

    # all layers (no bound before the plan): the plan's rule alone decides, at a host cost between the two rooms ...
    between = replace(DEFAULT, submit_us=0.65)
    every = pool.strategy.submission(pool.binding, h, d, None)
    assert fed(every, between) and not fed(every, between, backup_room=1.0)
    for auto, pick in ((auto_over(pool, None), "direct"), (auto_over(pool, None, backup_room=1.0), "kernel")):
        auto.calibration = between
        assert auto.pick(pool.binding, h, d, None, to_host=True) is (pool.strategy if pick == "direct" else auto.kernel)
    # ... and where neither room feeds it, whether a measure starts (paces kept, none measured yet)
    slower = replace(DEFAULT, submit_us=0.85)
    assert not fed(every, slower) and worth_measuring(every, slower) and not worth_measuring(every, slower,
                                                                                          backup_room=1.0)
    for room, probes in ((None, 1), (1.0, 0)):
        auto = auto_over(pool, _Paces(), **({} if room is None else {"backup_room": room}))
        auto.calibration = slower
        auto.pick(pool.binding, h, d, None, to_host=True)
        assert auto.pace_probes == probes

    monkeypatch.setenv(ENV_BACKUP_ROOM, " 1.0 ")
    assert AutoStrategy().backup_room == 1.0 and AutoStrategy(backup_room=2).backup_room == 2.0  # the option wins
    for bad in ("fast", "0", " -1", "nan", "1e400"):
        monkeypatch.setenv(ENV_BACKUP_ROOM, bad)
        with pytest.raises(ConfigError, match=f"^{ENV_BACKUP_ROOM} is {bad!r}: use a positive number"):
            AutoStrategy()  # the value as written, not as parsed
    monkeypatch.delenv(ENV_BACKUP_ROOM)
    from fractions import Fraction

    assert AutoStrategy(backup_room=Fraction(6, 5)).backup_room == 1.2  # any real number
    for bad in (0, -1.0, float("nan"), True, "1.2", 10**400, None.__class__):
        with pytest.raises(ConfigError, match="^auto's backup_room option is .*: use a positive number"):
            AutoStrategy(backup_room=bad)


def test_auto_measures_the_host_where_no_recent_measure_exists():
    """Without a recent measure in the call's direction, a call the calibrated host would feed in a burst goes to
    the copy engine, whose submissions measure the host; the new measure decides again.  Calls a host at the
    calibration's cost could not feed are not sent to measure it."""
    pool, h, d = _fp8_pool()
    direct = pool.strategy
    w = _Paces()
    loads = w.paces[False]
    auto = auto_over(pool, w)
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is direct and auto.pace_probes == 1  # no measure: probe
    _fill(loads, 0.9, count=MIN_SAMPLES)  # the probe's submissions: a slow host
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.kernel and auto.pace_probes == 1
    w.t[0] += STALE_S * 2  # the measure is old: the next decision measures afresh
    h2 = h.clone()
    assert auto.pick(pool.binding, h2, d, 1, to_host=False) is direct and auto.pace_probes == 2
    assert loads.samples() == []  # a new measure started
    _fill(loads, 0.4, count=MIN_SAMPLES)
    assert auto.pick(pool.binding, h2, d, 1, to_host=False) is direct and auto.pace_probes == 2  # measured: fed

    small, hs, ds = _fp8_pool(ps=16, pages=256)  # 10.5 KB blocks: under the loads' calibrated 32 KB
    auto = auto_over(small, _Paces())
    assert auto.pick(small.binding, hs, ds, 1, to_host=False) is auto.kernel and auto.pace_probes == 0

    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.uint8,
                        page_size=32, capacity=32 * 512, row_bytes=656)  # 21 KB blocks, 512 per layer
    dev = {"kv": [torch.zeros(32 * 512, 1, 656, dtype=torch.uint8) for _ in range(2)]}
    many = HostKVPool(spec, "layer_first", "direct", dev, registry=REG, strategy="core.direct")
    hm = torch.arange(512).flip(0).repeat_interleave(32) * 32 + torch.arange(32).repeat(512)
    sub = many.strategy.submission(many.binding, hm, torch.arange(32 * 512), 1)  # type: ignore[attr-defined]
    assert not worth_measuring(sub, DEFAULT)  # 512 x 0.5 + 6 = 262 us > 196 us
    auto = auto_over(many, _Paces())
    assert auto.pick(many.binding, hm, torch.arange(32 * 512), 1, to_host=False) is auto.kernel
    assert auto.pace_probes == 0


def test_a_slow_measure_takes_loads_but_never_backups_from_the_copy_engine_and_leaves_staged_routes_alone():
    """Calls the calibration feeds: a recent measure of a slow host (a serving loop planning every batch anew) gives
    loads to the kernel, whose loads cost a GEMM next to nothing; backups stay with the copy engine however slow the
    host measures (a kernel's backup slows a GEMM far more).  A staged route is judged by the calibration alone."""
    pool, h, d = _fp8_pool(ps=256, pages=16)  # 168 KB blocks, 16 per layer: fed at the calibration's costs
    direct = pool.strategy
    assert isinstance(direct, DirectStrategy)
    sub = direct.submission(pool.binding, h, d, 1)
    assert fed(sub, DEFAULT) and fed(sub, DEFAULT, 50.0, to_host=True) and not fed(sub, DEFAULT, 50.0, to_host=False)
    assert fed(sub, DEFAULT, 0.5, to_host=False)
    w = _Paces()
    _fill(w.paces[False], 50.0)
    _fill(w.paces[True], 50.0)
    auto = auto_over(pool, w)
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.kernel
    assert auto.pick(pool.binding, h, d, 1, to_host=True) is direct
    w.t[0] += 2 * STALE_S  # an old measure: the calibration decides, and a new measure starts only where it refuses
    assert auto.pick(pool.binding, h.clone(), d, 1, to_host=False) is direct and auto.pace_probes == 0

    if "page_first" in REG.layouts:
        spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64,
                            dtype=torch.bfloat16, page_size=64, capacity=64 * 4)
        dev = {"kv": [torch.zeros(64 * 4, 1, 576, dtype=torch.bfloat16) for _ in range(2)]}
        staged = HostKVPool(spec, "page_first", "direct", dev, registry=REG, strategy="core.direct",
                            strategy_options={"staging": "always"})
        idx = torch.arange(64 * 4)
        s = staged.strategy.submission(staged.binding, idx, idx, None)  # type: ignore[attr-defined]
        assert s.staged is not None
        assert fed(s, DEFAULT, 1e-6) == fed(s, DEFAULT) and not worth_measuring(s, DEFAULT)


def test_auto_lane_declines_after_the_pace_moved_so_the_call_decides_again(monkeypatch):
    pool, h, d = _fp8_pool()
    w = _Paces()
    _fill(w.paces[False], 0.42)
    auto = auto_over(pool, w)
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.direct
    ran = []
    monkeypatch.setattr(DirectStrategy, "lane", lambda self, binding, to_host: lambda *a: ran.append(a) or True)
    lane = auto.lane(pool.binding, False)
    assert lane is not None and lane(1, h, d) and len(ran) == 1  # the memoised route
    _fill(w.paces[False], 0.9)  # the host's pace moved: a new generation
    assert not lane(1, h, d) and len(ran) == 1  # declined: load() decides again
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.kernel
    assert lane(1, h, d) is False and len(ran) == 1  # the kernel's route (a bare object here: no lane)


def test_dropping_one_directions_picks_never_puts_back_what_another_thread_dropped():
    """While pick() drops the picks of a direction whose measure moved, another thread's 33rd new pair makes _use forget
    every counted pair and its picks: none comes back (no pick outlives the count of its tensors, whose ids a new
    tensor could take)."""
    class Hooked(dict):  # runs the other thread's work at the first removal from the memo
        hook = None

        def _fire(self) -> None:
            hook, Hooked.hook = Hooked.hook, None
            if hook is not None:
                hook()

        def pop(self, *args):  # type: ignore[no-untyped-def]
            self._fire()
            return super().pop(*args)

        def clear(self) -> None:
            self._fire()
            super().clear()

    pool, h, d = _fp8_pool()
    w = _Paces()
    _fill(w.paces[False], 0.42)
    _fill(w.paces[True], 0.42)
    auto = auto_over(pool, w)
    auto._picks = Hooked()
    auto.pick(pool.binding, h, d, 1, to_host=False)
    auto.pick(pool.binding, h, d, None, to_host=True)
    assert len(auto._picks) == 2
    _fill(w.paces[False], 0.9)  # the loads' measure moved: the next load drops the loads' picks
    other = [torch.arange(1) for _ in range(auto_mod._USES + 1)]
    Hooked.hook = lambda: [auto._use(("pair", i), t, t, None) for i, t in enumerate(other)]
    h2 = h.clone()
    auto.pick(pool.binding, h2, d, 1, to_host=False)
    assert Hooked.hook is None  # the other thread ran
    assert all(key in auto._uses for key in auto._picks)  # the backup's pick went with its count, and stayed gone
    assert pick_key(h, d, None, True) not in auto._picks


def test_auto_pace_option_and_cpu_pools():
    with pytest.raises(ConfigError, match="pace"):
        AutoStrategy(pace="yes")  # type: ignore[arg-type]
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64,
                        dtype=torch.bfloat16, page_size=16, capacity=64)
    dev = {"kv": [torch.zeros(64, 1, 576, dtype=torch.bfloat16) for _ in range(2)]}
    for opts in (None, {"pace": False}):
        pool = HostKVPool(spec, "layer_first", "auto", dev, registry=REG, strategy_options=opts)
        auto = pool.strategy
        assert isinstance(auto, AutoStrategy)
        assert auto.use_pace == (opts is None)
        assert auto.paces is None  # a CPU pool's copies measure no host submission: never probed


def test_auto_refuses_the_copy_engine_from_the_host_indices_alone_where_no_device_index_could_save_it():
    """64 random pages of 656-byte rows: 64 blocks whatever the device rows, too many for the calibrated host, so a
    new batch goes to the kernel without a copy plan (no device index read, no planning time).  Consecutive host
    pages might merge into a single block: there the plan decides (here: the copy engine, one block).  A measured
    fast host, or no measure yet (the copy engine would measure it), needs the plan too."""
    pool, h, d = _fp8_pool()
    plans = pool.binding.scratch["direct.plans"]
    auto = auto_over(pool, None)
    assert auto._least_blocks(pool.binding, h, 1) == (64, 64 * 64 * 656)
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.kernel
    assert plans._slots == []  # decided without a plan
    run = torch.arange(64 * 64)  # one run of host slots: one block at best
    assert auto._least_blocks(pool.binding, run, 1) == (1, 64 * 64 * 656)
    assert auto.pick(pool.binding, run, d, 1, to_host=False) is auto.direct and len(plans._slots) == 1
    # host indices off the CPU: not read, so the bound counts one block for a segment whose blocks may span pages
    assert auto._least_blocks(pool.binding, h.to("meta"), 1) == (1, 64 * 64 * 656)
    assert auto._least_blocks(pool.binding, h[:100], 1) == (1 + int((h[1:100] - h[:99] != 1).sum()), 100 * 656)

    w = _Paces()
    _fill(w.paces[False], 0.42)
    fast = auto_over(pool, w)
    assert fast.pick(pool.binding, h, d, 1, to_host=False) is fast.direct and len(plans._slots) == 2
    unmeasured = auto_over(pool, _Paces())
    h2 = h.clone()
    assert unmeasured.pick(pool.binding, h2, d, 1, to_host=False) is unmeasured.direct  # measures the host
    assert unmeasured.pace_probes == 1 and len(plans._slots) == 3
    w2 = _Paces()
    _fill(w2.paces[False], 0.9)
    slow = auto_over(pool, w2)
    assert slow.pick(pool.binding, h.clone(), d, 1, to_host=False) is slow.kernel and len(plans._slots) == 3

    if "page_first_direct" in REG.layouts:  # a layer's block never continues into the next page: pages count
        spec = pool.spec
        dev = {"kv": [torch.zeros(spec.capacity, 1, 656, dtype=torch.uint8) for _ in range(2)]}
        pfd = HostKVPool(spec, "page_first_direct", "direct", dev, registry=REG, strategy="core.direct")
        auto = auto_over(pfd, None)
        assert auto._least_blocks(pfd.binding, run, 1) == (64, 64 * 64 * 656)
        assert auto.pick(pfd.binding, run, d, 1, to_host=False) is auto.kernel
        assert pfd.binding.scratch["direct.plans"]._slots == []


def test_copier_samples_the_whole_call_from_its_start(monkeypatch):
    t = [100.0]
    copier, _ = _copier(monkeypatch, t, desc_us=0.45)
    z = torch.zeros(64, dtype=torch.int64)
    copier.copy(z, z, torch.full((64,), 40_000, dtype=torch.int64), stream=0x55, to_host=False,
                since=t[0] - 32e-6)  # the call began 32 us before its submission (planning a new batch)
    assert copier.paces[False].samples() == [pytest.approx(0.45 + 32 / 64)]


def test_direct_samples_its_plain_calls_by_direction_and_not_its_staged_ones(monkeypatch):
    seen = []
    real = BatchCopier.copy

    def spy(self, dsts, srcs, lens, stream=None, nbytes=None, to_host=None, since=None, warm=False):
        seen.append((to_host, since is not None, warm))
        return real(self, dsts, srcs, lens, stream, nbytes, to_host, since, warm)

    monkeypatch.setattr(BatchCopier, "copy", spy)
    pool, h, d = _fp8_pool(ps=16, pages=4)
    pool.backup_all_layers(h, d)
    pool.load_layer(1, h, d)
    assert seen == [(True, True, False), (False, True, False)]  # each planned its descriptors: not warm
    pool.load_layer(1, h, d)
    pool.load_layer(0, h, d)  # a layer not served yet: planned in the call
    pool.load_layer(0, h.clone(), d)  # a new pair: planned
    pool.backup_all_layers(h, d)
    assert seen[2:] == [(False, True, True), (False, True, False), (False, True, False), (True, True, True)]
    if "page_first" in REG.layouts:
        spec = pool.spec
        dev = {"kv": [torch.zeros(spec.capacity, 1, 656, dtype=torch.uint8) for _ in range(2)]}
        staged = HostKVPool(spec, "page_first", "direct", dev, registry=REG, strategy="core.direct",
                            strategy_options={"staging": "always"})
        seen.clear()
        staged.backup_all_layers(h, d)
        assert seen and all(to_host is None for to_host, _, _ in seen)


def test_an_old_measure_restarts_with_the_next_decision_and_gpu_resident_indices_are_not_read_for_a_slow_host():
    """Loads the calibration feeds (168 KB blocks): after a second without samples the next new batch goes by the
    calibration to the copy engine and its calls start a new measure, which then decides (slow: the kernel).  With
    host indices on the GPU (not read for a bound), a load of as many positions as the last planned one goes to the
    kernel without a plan while the host measures too slow for that plan's blocks."""
    pool, h, d = _fp8_pool(ps=256, pages=16)
    direct = pool.strategy
    w = _Paces()
    loads = w.paces[False]
    _fill(loads, 50.0)
    auto = auto_over(pool, w)
    auto.clock = QueueClock(now=lambda: w.t[0])  # the last plan's age (_refuse_unread): a fake clock, not the CI's
    w.t[0] += 2 * STALE_S
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is direct and loads.samples() == []
    _fill(loads, 50.0, count=MIN_SAMPLES)  # the new measure: slow
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.kernel  # decided again for the same batch
    assert auto._load_blocks[h.numel()][:2] == (16, 16 * 256 * 656)
    plans = pool.binding.scratch["direct.plans"]
    planned = len(plans._slots)
    on_gpu = h.to("meta")  # stands for GPU-resident host indices: never read for a bound
    assert auto._least_blocks(pool.binding, on_gpu, 1) == (1, 16 * 256 * 656)  # one block at least: no refusal
    assert auto._refuse_unread(h.numel(), DEFAULT, loads)
    assert auto.pick(pool.binding, on_gpu, d, 1, to_host=False) is auto.kernel and len(plans._slots) == planned
    assert not auto._refuse_unread(h.numel() // 2, DEFAULT, loads)  # no plan of that size yet: the plan decides
    assert not auto._refuse_unread(h.numel(), DEFAULT, None)  # no measure, the calibration feeds the plan
    _fill(loads, 0.5)  # the host fast again: the plan decides
    assert not auto._refuse_unread(h.numel(), DEFAULT, loads)


def test_a_calibration_that_refuses_without_measuring_reads_no_gpu_resident_indices():
    """A calibration whose host is too slow both to feed these loads and to be worth measuring for them (0.84 us per
    descriptor, as an H100 host's ``hicache calibrate`` wrote): no measure ever starts, so a new batch with
    GPU-resident host indices is refused from the last plan of as many positions at the calibration's cost, with no
    plan (no device read); a page-major layout, whose blocks never span pages, is refused from the count alone, with
    no plan even the first time.  (Before, only a recent measure refused these, and every new batch was planned.)"""
    pool, h, d = _fp8_pool()
    slow = replace(DEFAULT, submit_us=0.84)
    sub = pool.strategy.submission(pool.binding, h, d, 1)
    assert not fed(sub, slow, to_host=False) and not worth_measuring(sub, slow, to_host=False)
    w = _Paces()
    auto = auto_over(pool, w)
    auto.clock = QueueClock(now=lambda: w.t[0])  # the last plan's age (_refuse_unread): a fake clock, not the CI's
    auto.calibration = slow
    plans = pool.binding.scratch["direct.plans"]
    planned = len(plans._slots)  # the one sized above
    assert auto.pick(pool.binding, h.clone(), d, 1, to_host=False) is auto.kernel  # CPU host indices: counted, no plan
    assert len(plans._slots) == planned and auto.pace_probes == 0
    on_gpu = h.to("meta")  # stands for GPU-resident host indices: their runs are not counted
    auto._load_blocks[h.numel()] = (64, 64 * 64 * 656, auto.clock.now())  # the last plan of as many positions
    assert auto._refuse_unread(h.numel(), slow, auto.paces[False])
    assert not auto._refuse_unread(h.numel(), DEFAULT, auto.paces[False])  # the shipped one would start a measure
    assert auto.pick(pool.binding, on_gpu, d, 1, to_host=False) is auto.kernel and len(plans._slots) == planned
    assert not auto._refuse_unread(h.numel() // 2, slow, auto.paces[False])  # no plan of that size yet: a plan decides
    t = [auto.clock.now()]
    auto.clock = QueueClock(now=lambda: t[0])
    auto._load_blocks[h.numel()] = (64, 64 * 64 * 656, t[0])
    t[0] += STALE_S * 1.01  # a verdict no plan renewed for a second (a refused call plans nothing): a plan decides
    assert not auto._refuse_unread(h.numel(), slow, auto.paces[False])
    assert auto._planned(pool.binding, h, d) and not auto._planned(pool.binding, h.clone(), d)  # a plan exists: no
    # read to spare, so such a pair is decided from its plan, not refused from another batch's
    # a lower bound under MIN_OPS blocks: a plan might reach MIN_OPS and start a measure (21 us at link speed: 32
    # blocks would fit a burst at the calibration's cost, 20 alone do not feed)
    nbytes = 1_155_000  # 21 us at the shipped calibration's 55 GB/s
    assert DEFAULT.link_gbps == 55.0
    assert not auto._may_feed(20, nbytes, DEFAULT, False, None)
    assert auto._may_feed(20, nbytes, DEFAULT, False, auto.paces[False])
    assert not auto._may_feed(20, nbytes, DEFAULT, False, auto.paces[False], least=False)  # a plan's own count
    if "page_first_direct" in REG.layouts:  # a layer's block never continues into the next page: pages count
        spec = pool.spec
        dev = {"kv": [torch.zeros(spec.capacity, 1, 656, dtype=torch.uint8) for _ in range(2)]}
        pfd = HostKVPool(spec, "page_first_direct", "direct", dev, registry=REG, strategy="core.direct")
        auto = auto_over(pfd, _Paces())
        auto.calibration = slow
        assert auto._least_blocks(pfd.binding, on_gpu, 1) == (64, 64 * 64 * 656)
        assert auto.pick(pfd.binding, on_gpu, d, 1, to_host=False) is auto.kernel
        assert pfd.binding.scratch["direct.plans"]._slots == []


def test_auto_lane_has_direct_sample_the_host_from_the_lane_start(monkeypatch):
    """A reused pair's call through ``auto``'s lane to ``direct``'s is sampled from when ``auto``'s lane began (its
    clock is the copier's), as the normal path samples from the call's start: the host's measured pace of calls
    through ``auto`` holds ``auto``'s own time per call (H100 host: 6-8 us of 90-100 us calls, which the decision
    between the routes did not see)."""
    t = [200.0]
    copier, _ = _copier(monkeypatch, t, desc_us=0.45)
    pool, h, d = _fp8_pool(ps=256, pages=16)  # 168 KB blocks: the calibration gives them to the copy engine
    auto = auto_over(pool, None)
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.direct
    pool.binding.scratch["direct.copier"] = copier  # its clock: a fake one (the lane reads nothing else of it)
    seen = []

    def make(self, binding, to_host):  # type: ignore[no-untyped-def]
        def fake(*args):  # type: ignore[no-untyped-def]
            seen.append(args)
            return True
        fake.takes_since = True  # type: ignore[attr-defined]  # as DirectStrategy's own lane says
        return fake

    monkeypatch.setattr(DirectStrategy, "lane", make)

    class Slow(dict):
        def get(self, key, default=None):  # type: ignore[no-untyped-def]
            t[0] += 20e-6  # auto's own work before direct's submission
            return super().get(key, default)

    auto._picks = Slow(auto._picks)
    lane = auto.lane(pool.binding, False)
    assert lane is not None
    start = t[0]
    assert lane(1, h, d) and len(seen) == 1
    assert seen[0][3] == start and t[0] == pytest.approx(start + 20e-6)
    assert seen[0][4] is None  # an unclocked pool read no stream: direct's lane reads it
    # clocked (a CUDA pool): the stream auto's lane read is handed over, not read again
    auto._clocked, auto._fast_memo[(1, h.numel())] = True, False  # not a fast load: no lone-load rule
    monkeypatch.setattr(auto_mod, "current_stream_handle", lambda index: 0x77)
    lane = auto.lane(pool.binding, False)
    start = t[0]
    assert lane is not None and lane(1, h, d) and seen[1][4] == 0x77 and seen[1][3] == start
    auto.clock = QueueClock(now=copier.clock.now)  # one clock: the reading auto's lane makes anyway is the start
    lane = auto.lane(pool.binding, False)
    start = t[0]
    assert lane is not None and lane(1, h, d) and seen[2][3] == start and seen[2][4] == 0x77
    # a lane of the plain three-argument kind (a wrapper that does not say it takes more) gets three
    monkeypatch.setattr(DirectStrategy, "lane", lambda self, binding, to_host: lambda *a: seen.append(a) or True)
    lane = auto.lane(pool.binding, False)
    assert lane is not None and lane(1, h, d) and len(seen[3]) == 3
    monkeypatch.undo()  # DirectStrategy's own lanes say they take the start and the stream
    real = pool.strategy.lane(pool.binding, False)
    assert getattr(real, "takes_since", False) is True


def test_a_memoised_pick_is_made_again_once_its_measure_aged(monkeypatch):
    """Indices reused batch after batch keep their pick; once the measure behind it is a second old, the lane declines
    and the next call decides again (here by the calibration: the copy engine), so a kernel picked while the host
    planned new batches does not outlive the host's speed."""
    pool, h, d = _fp8_pool(ps=256, pages=16)
    w = _Paces()
    _fill(w.paces[False], 50.0)
    auto = auto_over(pool, w)
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.kernel
    ran = []
    monkeypatch.setattr(DirectStrategy, "lane", lambda self, binding, to_host: lambda *a: ran.append(a) or True)
    lane = auto.lane(pool.binding, False)
    assert lane is not None and not lane(1, h, d)  # the kernel's route: a bare object here, no lane
    w.t[0] += 2 * STALE_S
    assert w.paces[False].aged() and not lane(1, h, d)
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is pool.strategy and not w.paces[False].aged()
    assert lane(1, h, d) and len(ran) == 1  # the new pick's route
    # a measure under way (samples, no estimate yet) that went stale has nothing to age: the lane keeps serving, as
    # aged() says (the lane reads ages_at and desc_us instead of calling it)
    _fill(w.paces[False], 0.4, count=MIN_SAMPLES - 1)
    w.t[0] += 2 * STALE_S
    assert w.paces[False].desc_us is None and w.paces[False].stale() and not w.paces[False].aged()
    assert lane(1, h, d) and len(ran) == 2


def test_a_reused_index_pair_is_judged_at_the_pace_of_reused_plans(monkeypatch):
    """Calls that plan their descriptors (a new pair, a new layer) measure a slower host than calls that reuse a plan.
    A new pair is judged at the former (a serving loop plans every batch); a pair used beyond one burst (one call per
    owned layer) is decided again at the latter, measured first where no measure exists, so indices reused batch
    after batch are not held to the pace of their first burst."""
    pool, h, d = _fp8_pool()
    w = _Paces()
    auto = auto_over(pool, w)
    auto.warm_paces = w.warm
    auto._layers = 2
    cold, warm = w.paces[False], w.warm[False]
    _fill(cold, 0.9)  # planning calls: too slow to feed these loads
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.kernel  # first burst: the planning pace
    assert auto.pick(pool.binding, h, d, 0, to_host=False) is auto.kernel
    key = pick_key(h, d, 1, False)
    assert auto._uses[key][0] == 2 and auto._uses[key][1] is h  # the tensors are held while counted
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.direct  # reused, no measure of reused plans: probe
    assert auto.pace_probes == 1 and auto.decisions == 2  # the first call and the first reuse decided
    _fill(warm, 0.42)  # reused plans submit fast: a new generation, decided again
    assert auto.pick(pool.binding, h, d, 0, to_host=False) is auto.direct and auto.pace_probes == 1
    h2 = h.clone()  # a new batch is still judged at the planning pace
    assert auto.pick(pool.binding, h2, d, 1, to_host=False) is auto.kernel
    _fill(warm, 0.9)  # reused plans slow too
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.kernel
    for _ in range(3):  # fresh tensors every batch never count as reused, whatever ids they get
        hb, db = h.clone(), d.clone()
        assert [auto.pick(pool.binding, hb, db, layer, to_host=False) is auto.kernel for layer in (1, 0)] == [True] * 2
        assert auto._uses[pick_key(hb, db, 1, False)][0] == 2
    _fill(warm, 0.42)
    assert auto.pick(pool.binding, hb, db, 1, to_host=False) is auto.direct  # its third call: reused

    # an all-layer call counts as a burst of its own: the second is a reuse
    pages = _Paces()
    auto = auto_over(pool, pages)
    auto.warm_paces = pages.warm
    _fill(pages.paces[False], 0.9)
    _fill(pages.warm[False], 0.42)
    assert [auto.pick(pool.binding, h, d, None, to_host=False) is auto.direct for _ in range(2)] == [False, True]

    # the lane counts as pick() does, and leaves the first reuse of a kernel-picked pair to it
    lw = _Paces()
    auto = auto_over(pool, lw)
    auto.warm_paces, auto._layers = lw.warm, 2
    _fill(lw.paces[False], 0.9)
    _fill(lw.warm[False], 0.42)
    ran = []
    monkeypatch.setattr(DirectStrategy, "lane", lambda self, binding, to_host: lambda *a: ran.append(a) or True)
    lane = auto.lane(pool.binding, False)
    assert lane is not None
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.kernel
    assert not lane(0, h, d) and auto._uses[key][0] == 1  # the kernel's route (a bare object: no lane): declined ...
    assert auto.pick(pool.binding, h, d, 0, to_host=False) is auto.kernel and auto._uses[key][0] == 2  # ... counted once
    assert not lane(1, h, d) and auto._uses[key][0] == 2  # the pair's first reuse: declined, not counted
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.direct
    assert lane(0, h, d) and ran and auto._uses[key][0] == 4


def test_a_memory_bound_forward_pass_gives_loads_to_the_copy_engine_at_a_slower_host_pace(monkeypatch):
    """``forward="memory"``: beside memory-bound work a kernel's loads keep ~MEMORY_KERNEL_SHARE of their speed, so the
    copy engine takes a load while the host submits it within 1 / that share of the time ``compute`` allows: a host
    measured at 0.9 us per descriptor (too slow for these loads beside a GEMM) feeds them; one at 2.5 us does not.
    Without a measure the calibrated margin grows alike.  Backups are decided as before; lone loads are no exception
    unless ``lone=True`` is passed."""
    pool, h, d = _fp8_pool()
    direct = pool.strategy
    assert isinstance(direct, DirectStrategy)
    sub = direct.submission(pool.binding, h, d, 1)
    room = 1 / MEMORY_KERNEL_SHARE
    assert not fed(sub, DEFAULT, 0.9, to_host=False) and fed(sub, DEFAULT, 0.9, to_host=False, room=room)
    assert not fed(sub, DEFAULT, 2.5, to_host=False, room=room)
    assert not fed(sub, DEFAULT, to_host=False) and fed(sub, DEFAULT, to_host=False, room=room)  # the calibration
    assert fed(sub, DEFAULT, 0.9, to_host=True, room=room) == fed(sub, DEFAULT, 0.9, to_host=True)  # backups: as before

    for forward, slow_pick in (("compute", "kernel"), ("memory", "direct")):
        w = _Paces()
        _fill(w.paces[False], 0.9)
        auto = auto_over(pool, w, forward=forward)
        assert auto.forward == forward and auto.lone == (forward == "compute")
        assert auto.pick(pool.binding, h, d, 1, to_host=False) is getattr(auto, slow_pick)
        assert auto._may_feed(64, sub.nbytes, DEFAULT, False, w.paces[False]) == (forward == "memory")
        _fill(w.paces[False], 2.5)  # slower still: the kernel in both modes
        assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.kernel
        unmeasured = auto_over(pool, None, forward=forward)  # the calibration alone (no plan needed to refuse it)
        assert unmeasured.pick(pool.binding, h.clone(), d, 1, to_host=False) is getattr(unmeasured, slow_pick)

    # the rules that refuse the copy engine before a plan, or start a measure, give loads the same room
    n, nbytes = h.numel(), sub.nbytes
    for forward, refused in (("compute", True), ("memory", False)):
        auto = auto_over(pool, None, forward=forward)
        t = [50.0]  # one fake clock for the plan's age and the measure's: neither ages while the CI machine stalls
        auto.clock = QueueClock(now=lambda: t[0])
        auto._load_blocks[n] = (64, nbytes, auto.clock.now())  # the last plan of a load of n positions
        measured = HostPace(now=lambda: t[0])
        _fill(measured, 0.9)
        assert auto._refuse_unread(n, DEFAULT, measured) == refused
        assert auto._refuse_unread(n, DEFAULT, None) == refused  # no measure to start: the calibration's margin decides
    slow = replace(DEFAULT, submit_us=1.5)  # a burst at 1.5 us per descriptor: 96 us and more, for 49 us at link speed
    assert not worth_measuring(sub, slow, to_host=False)  # too slow a host to feed it beside a GEMM ...
    assert worth_measuring(sub, slow, to_host=False, room=room)  # ... but fast enough beside memory-bound work
    assert not worth_measuring(sub, slow, to_host=True, room=room)  # backups: not the loads' room (BACKUP_ROOM alone)

    assert AutoStrategy(forward="memory", lone=True).lone and AutoStrategy(forward=" Memory ").forward == "memory"
    with pytest.raises(ConfigError, match="^auto's forward option is 'decode': use one of compute, memory"):
        AutoStrategy(forward="decode")
    monkeypatch.setenv(ENV_FORWARD, " Memory ")
    assert AutoStrategy().forward == "memory" and AutoStrategy(forward="compute").forward == "compute"
    monkeypatch.setenv(ENV_FORWARD, "decode")
    with pytest.raises(ConfigError, match=f"^{ENV_FORWARD} is 'decode': use one of compute, memory"):
        AutoStrategy()
    monkeypatch.delenv(ENV_FORWARD)
    for lone in (None, True):
        explain = AutoStrategy(forward="memory", lone=lone)
        explain.use_registry(REG)
        assert explain.supports(pool.spec, REG.layout("layer_first")) is None
        has_kernel = explain.kernel is not None  # a CPU pool's kernel needs Triton's interpreter (CPU CI runs it)
        lines = explain.describe(pool.spec, REG.layout("layer_first"))
        assert any("forward='memory'" in line and "244% of it" in line for line in lines)
        assert any(line.startswith("auto: load_layer of all") for line in lines)  # the estimate ran
        assert any("lone one-layer" in line for line in lines) == (bool(lone) and has_kernel)
        assert any("lone loads included" in line for line in lines) == (not lone)


def test_every_auto_variant_hicache_bench_measures_is_a_valid_auto():
    from hicache_core.bench import _configs

    variants = _configs("auto", [None], ["auto"])
    assert [label for label, _ in variants] == ["", "lone=off", "pace=off", "forward=memory", "forward=watch"]
    made = [AutoStrategy(**(opts or {})) for _, opts in variants]  # type: ignore[arg-type]
    assert [(a.lone, a.use_pace, a.forward) for a in made] == [
        (True, True, "compute"), (False, True, "compute"), (True, False, "compute"), (False, True, "memory"),
        (True, True, "watch")]



def test_auto_decides_its_memoised_picks_again_when_the_watch_changes_its_verdict():
    """A pick memoised beside compute (the kernel: the host is too slow for these loads at the default room) is decided
    again once the watch says memory-bound (the copy engine: the memory room), and back."""
    from hicache_core.backends.forward import ForwardWatch

    pool, h, d = _fp8_pool()
    w = _Paces()
    _fill(w.paces[False], 0.9)
    auto = auto_over(pool, w, forward="watch")
    ms = [0.08]

    class Event:
        def record(self, stream: object) -> None: ...
        def query(self) -> bool: return True
        def elapsed_time(self, other: object) -> float: return ms[0]

    auto.watch = ForwardWatch(55.0, now=lambda: w.t[0], event=Event, stream=lambda i: i)
    auto._layers = 8  # these calls are one burst's (no reuse to decide again for)
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.kernel
    auto.watch.timed(lambda: None, 4 << 20, 0)  # 4 MiB in 80 us: compute-bound, nothing changes
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.kernel and auto.decisions == 1
    ms[0] = 0.5
    auto.watch.timed(lambda: None, 4 << 20, 0)  # 4 MiB in 500 us: memory-bound
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.direct and auto.decisions == 2
    ms[0] = 0.08
    auto.watch.timed(lambda: None, 4 << 20, 0)
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is auto.kernel and auto.decisions == 3


def test_beside_memory_bound_work_a_burst_the_kernel_serves_is_not_moved_mid_burst_where_planning_reads_the_gpu(
        monkeypatch):
    """When the picks are decided again (the host's pace moved), a pair the kernel serves within its first burst
    keeps the kernel where its indices live off the CPU and no copy plan exists (planning would read them back behind
    every queued load); not with ``forward="compute"``, not after its first burst, not for CPU indices, not once
    planned, and never the copy engine's picks."""
    pool, h, d = _fp8_pool()
    on_gpu = (h.to("meta"), d.to("meta"))  # "off the CPU" as far as the rule can tell
    for forward, kept in (("compute", False), ("memory", True), ("watch", True)):
        w = _Paces()
        auto = auto_over(pool, w, forward=forward)
        if forward == "watch":
            from hicache_core.backends.forward import ForwardWatch

            auto.watch = ForwardWatch(55.0)  # what a clocked CUDA pool gets (an unclocked one acts as compute)
        auto._layers = 4
        key = pick_key(*on_gpu, 1, False)
        auto._picks[key], auto._uses[key] = auto.kernel, [2, *on_gpu]
        cpu_key = pick_key(h, d, 1, False)
        auto._picks[cpu_key], auto._uses[cpu_key] = auto.kernel, [2, h, d]
        assert auto._held(pool.binding) == ({key: auto.kernel} if kept else {})
        _fill(w.paces[False], 0.42)  # the pace moved: pick() decides again, but what _held keeps
        auto.pick(pool.binding, h, d, 1, to_host=False)
        assert (key in auto._picks) == kept
        auto._picks[key] = auto.kernel
        auto._uses[key][0] = 4  # its first burst is over
        assert key not in auto._held(pool.binding)
        auto._uses[key][0] = 2
        auto._picks[key] = auto.direct
        assert key not in auto._held(pool.binding)
    auto._picks[key] = auto.kernel
    assert key in auto._held(pool.binding)
    auto.watch = None  # forward="watch" on a pool without the lone-load rule acts as compute
    assert auto._held(pool.binding) == {}
    auto.forward = "memory"
    monkeypatch.setattr(pool.binding.scratch["direct.plans"], "peek", lambda *a: object())  # planned already
    assert key not in auto._held(pool.binding)


def test_no_probe_the_copier_would_not_sample():
    """A call of fewer than MIN_OPS descriptors is never sampled by the copier: it is never sent to measure the host
    (it would be sent again every time, measuring nothing)."""
    pool, h, d = _fp8_pool(pages=MIN_OPS - 1)
    sub = pool.strategy.submission(pool.binding, h, d, 1)  # type: ignore[attr-defined]
    assert sub.count == MIN_OPS - 1 and not worth_measuring(sub, DEFAULT)
    auto = auto_over(pool, _Paces())
    for _ in range(3):
        auto.pick(pool.binding, h.clone(), d, 1, to_host=False)
    assert auto.pace_probes == 0


def test_dropping_the_use_counts_drops_the_picks_too(monkeypatch):
    """The picks are memoised by tensor ids the use counts keep alive: when the counts are dropped (too many pairs),
    so are the picks, so a new tensor at a freed tensor's address never gets an old pair's pick."""

    monkeypatch.setattr(auto_mod, "_PICKS", 10 * auto_mod._USES)  # the picks' own bound out of the way
    pool, h, d = _fp8_pool()
    auto = auto_over(pool, None)
    for _ in range(auto_mod._USES):
        auto.pick(pool.binding, h.clone(), d, 1, to_host=False)
    assert len(auto._uses) == auto_mod._USES and auto._picks
    auto.pick(pool.binding, h.clone(), d, 1, to_host=False)  # the counts start again: so do the picks
    assert len(auto._uses) == 1 and len(auto._picks) == 1


@pytest.mark.parametrize("failure", [
    ImportError("libtriton.so: cannot open shared object file"),
    # a ConfigError that is no user's setting: a plugin kernel declaring a launch parameter the launch lacks
    ConfigError("plugin.kernels.KERNEL declares ['extra'], which the row-copy launch does not provide"),
], ids=["triton-import", "plugin-kernel-defect"])
def test_a_kernel_whose_prepare_fails_in_any_way_leaves_direct_serving(monkeypatch, caplog, failure):
    """Not only hicache's own errors: a kernel failing to prepare for any reason (a Triton that fails to import, a
    plugin kernel's defect) leaves the pool on the copy engine, with a warning, where ``direct`` can serve it; a bad
    setting does not (below)."""
    pool, h, d = _fp8_pool()
    auto = AutoStrategy()
    auto.direct = pool.strategy  # type: ignore[assignment]

    class Broken:
        def prepare(self, binding):  # type: ignore[no-untyped-def]
            raise failure

    auto.kernel, auto.kernel_name = Broken(), "broken.kernel"  # type: ignore[assignment]
    with caplog.at_level("WARNING", logger="hicache_core.backends.auto"):
        auto.prepare(pool.binding)
    assert auto.kernel is None and f"the kernel cannot serve this pool ({str(failure)[:20]}" in caplog.text
    assert auto.pick(pool.binding, h, d, 1, to_host=False) is pool.strategy


def test_auto_hands_direct_the_start_of_its_call_so_a_new_pairs_planning_is_sampled(monkeypatch):
    """``auto`` plans a new pair while deciding; the planning pace's sample of the call ``direct`` then serves must
    start before that planning, as it does for ``direct``'s own calls (tests above)."""
    from hicache_core.backends.plans import PlanCache

    pool, h, d = _fp8_pool()
    w = _Paces()
    auto = auto_over(pool, w)
    _fill(w.paces[False], 0.42)  # a fast host: the copy engine serves the loads
    copier = pool.binding.scratch["direct.copier"]
    tick = [0.0]

    def now() -> float:
        tick[0] += 1.0
        return tick[0]

    monkeypatch.setattr(copier.clock, "now", now)
    seen: list[tuple[float | None, bool]] = []
    planned: list[float] = []
    real_copy, real_get = BatchCopier.copy, PlanCache.get

    def spy(self, dsts, srcs, lens, stream=None, nbytes=None, to_host=None, since=None, warm=False):
        seen.append((since, warm))
        return real_copy(self, dsts, srcs, lens, stream, nbytes, to_host, since, warm)

    def get(self, *args, **kwargs):
        planned.append(now())
        return real_get(self, *args, **kwargs)

    monkeypatch.setattr(BatchCopier, "copy", spy)
    monkeypatch.setattr(PlanCache, "get", get)
    auto.load(pool.binding, h, d, 1)
    assert auto._picks[pick_key(h, d, 1, False)] is pool.strategy
    since, warm = seen[0]
    assert since is not None and since < planned[0] and not warm  # the sample covers the plan made while deciding


def test_copies_submitted_for_the_legacy_stream_are_marked_on_it(monkeypatch):
    """The batch API refuses the legacy default stream (handle 0): cudart queues such copies on the per-thread
    stream, and the copier records an event on the legacy stream after them (so that synchronising or querying
    the legacy stream covers them); copies for any other stream are not marked."""
    t = [100.0]
    copier, rt = _copier(monkeypatch, t, desc_us=0.45)
    marks = []
    monkeypatch.setattr(copier, "_mark_legacy", lambda: marks.append(rt.calls[-1][1]))
    z = torch.zeros(4, dtype=torch.int64)
    copier.copy(z, z, torch.full((4,), 64, dtype=torch.int64), stream=0x55)
    assert marks == []
    copier.copy(z, z, torch.full((4,), 64, dtype=torch.int64), stream=0)
    assert marks == [0]  # after the submission


def test_samples_older_than_the_measure_lasts_never_make_an_estimate():
    """Six samples (one short of an estimate), then a sample after the measure went stale: the old six are gone, not
    the median of the new estimate; the same for a whole window whose estimate aged (its generation moves)."""
    t = [10.0]
    pace = HostPace(now=lambda: t[0])
    _fill(pace, 3.0, count=MIN_SAMPLES - 1)
    t[0] += STALE_S * 1.5
    _fill(pace, 0.4, count=1)
    assert pace.samples() == [pytest.approx(0.4)] and pace.desc_us is None
    _fill(pace, 0.4, count=MIN_SAMPLES - 1)
    assert pace.desc_us == pytest.approx(0.4) and pace.generation == 1
    t[0] += STALE_S * 1.5
    _fill(pace, 3.0, count=1)  # the aged estimate is dropped (decisions made from it are made again)
    assert pace.samples() == [pytest.approx(3.0)] and pace.desc_us is None and pace.generation == 2


def test_a_reset_from_another_thread_mid_record_loses_the_sample_quietly():
    """``auto`` resets an aged measure from the thread deciding while another thread's submission records into it:
    the record must not raise (its copies are already queued), whatever point the reset lands at."""
    from collections import deque

    pace = HostPace(now=lambda: 10.0)

    class ResetOnCount(deque):
        def __len__(self) -> int:  # the other thread's reset lands right after the sample is counted
            n = super().__len__()
            if n >= MIN_SAMPLES:
                pace.reset()
            return n

    pace._samples = ResetOnCount(maxlen=WINDOW)
    _fill(pace, 0.4, count=MIN_SAMPLES)
    assert pace.desc_us is None and pace.samples() == []


@pytest.mark.skipif("page_first_direct" not in REG.layouts, reason="needs the page_first layout plugin")
def test_explain_names_the_kernel_where_auto_has_no_copy_engine():
    """A CUDA host without the batch copy API leaves ``auto`` the kernel alone: its estimate must not name direct."""
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(4), kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                        page_size=64, capacity=64 * 64)
    lay = REG.layout("page_first_direct")
    auto = AutoStrategy()
    auto.use_registry(REG)
    auto.direct, auto.kernel, auto.kernel_name = None, object(), "page_first.kernel"  # type: ignore[assignment]
    picks = [line for line in auto.describe(spec, lay) if "pages scattered ->" in line]
    assert len(picks) == 2 and all("-> page_first.kernel (the copy engine is not available here)" in p for p in picks)
    assert auto.pick(None, torch.arange(4), torch.arange(4), 1, to_host=False) is auto.kernel  # type: ignore[arg-type]


def test_a_pick_made_while_another_thread_dropped_the_memo_is_not_kept():
    """Another thread's 33rd new pair drops the use counts and the picks while this thread decides: its pick is not
    memoised for tensors no count holds (a later pair at the same ids would get it without deciding); nor one decided
    from a measure that moved meanwhile."""
    import threading

    pool, h, d = _fp8_pool()
    auto = auto_over(pool, None)
    decide = auto._decide

    def racing(*args, **kwargs):
        pick = decide(*args, **kwargs)
        t = threading.Thread(target=lambda: [auto._use(("pair", i), h, d, None) for i in range(auto_mod._USES + 1)])
        t.start()
        t.join()
        return pick

    auto._decide = racing  # type: ignore[method-assign]
    hh, dd = h.clone(), d.clone()
    assert auto.pick(pool.binding, hh, dd, 1, to_host=False) is auto.kernel
    assert pick_key(hh, dd, 1, False) not in auto._picks
    check_moved_generation_drops_the_pick(auto_over(pool, _Paces()), "_pace_gen", pool.binding, hh, dd)


@pytest.mark.parametrize("validate,warm", [("shapes", True), ("full", False), ("strict", False)])
def test_a_pool_that_plans_every_call_judges_reused_pairs_at_the_planning_pace(validate, warm):
    """On ``validate="full"``/``"strict"`` pools no plan outlives its call, so no call reuses one: auto reads the
    planning calls' measure only (the reused plans' measure would never get a sample)."""
    from types import SimpleNamespace

    from hicache_core.backends.auto import host_measures
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=8, qk_rope_head_dim=8, dtype=torch.bfloat16,
                        page_size=4, capacity=32)
    dev = {"kv": [torch.zeros(32, 1, 16, dtype=torch.bfloat16) for _ in range(2)]}
    pool = HostKVPool(spec, "layer_first", "direct", dev, registry=REG, strategy="core.direct", validate=validate)
    copier = SimpleNamespace(paces=(HostPace(), HostPace()), warm_paces=(HostPace(warm=True), HostPace(warm=True)))
    paces, warm_paces = host_measures(pool.binding, copier)  # type: ignore[arg-type]
    assert paces is copier.paces
    assert warm_paces is (copier.warm_paces if warm else None)
    assert host_measures(pool.binding, None) == (None, None)


def test_a_reused_pair_leaves_the_copy_engine_when_every_call_plans_and_the_host_is_slow():
    """A ``validate="full"`` pool: every ``direct`` call plans again and feeds the planning measure.  A reused pair
    goes to the copy engine to measure the host (a probe), then to the kernel once that measure finds the host too
    slow; judged at the reused plans' measure, which never forms there, it stayed on the copy engine."""
    from types import SimpleNamespace

    from hicache_core.backends.auto import host_measures
    t = [50.0]
    clock = lambda: t[0]  # noqa: E731
    copier = SimpleNamespace(paces=(HostPace(now=clock), HostPace(now=clock)),
                             warm_paces=(HostPace(now=clock, warm=True), HostPace(now=clock, warm=True)))
    ps, pages = 64, 64
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.uint8,
                        page_size=ps, capacity=ps * pages, row_bytes=656)
    dev = {"kv": [torch.zeros(ps * pages, 1, 656, dtype=torch.uint8) for _ in range(2)]}
    pool = HostKVPool(spec, "layer_first", "direct", dev, registry=REG, strategy="core.direct", validate="full")
    h = torch.arange(pages).flip(0).repeat_interleave(ps) * ps + torch.arange(ps).repeat(pages)
    d = torch.arange(ps * pages)
    auto = auto_over(pool, None)
    auto.paces, auto.warm_paces = host_measures(pool.binding, copier)
    auto._layers = 2
    routes = []
    for i in range(40):
        p = auto.pick(pool.binding, h, d, i % 2, to_host=False)
        routes.append("D" if p is auto.direct else "K")
        if p is auto.direct:  # a host at 5 us per descriptor: far too slow for a 64-descriptor layer
            copier.paces[False].record(64 * 5.0 + MODEL_CALL_US, 64, 1)
        t[0] += 0.001
    assert auto.pace_probes >= 1 and routes[0] == "D"
    assert copier.paces[False].desc_us == pytest.approx(5.0)
    assert set(routes[-20:]) == {"K"}


@pytest.mark.parametrize("env,value", [("HICACHE_KERNEL_PROGRAMS", "-3"), ("HICACHE_KERNEL_TMA", "maybe"),
                                       ("HICACHE_KERNEL_PAGES", "sometimes")])
def test_a_kernel_setting_with_a_bad_value_fails_auto_too(monkeypatch, env, value):
    """A typo in a kernel variable raises when the pool is built, under ``auto`` as under ``kernel``: it was logged and
    the pool served by the copy engine alone, the kernel silently gone."""
    pool, h, d = _fp8_pool()
    auto = AutoStrategy()
    auto.direct = pool.strategy  # type: ignore[assignment]

    from hicache_core import rowcopy_pages, rowcopy_tma
    from hicache_core.kernel_support import sm_budget

    monkeypatch.setenv(env, value)
    read = {"HICACHE_KERNEL_PROGRAMS": lambda: sm_budget(8, torch.device("cpu")),  # what the kernel's prepare reads
            "HICACHE_KERNEL_TMA": lambda: rowcopy_tma.tma_mode(None, torch.device("cpu")),
            "HICACHE_KERNEL_PAGES": lambda: rowcopy_pages.pages_enabled(None)}[env]

    class Configured:
        def prepare(self, binding):  # type: ignore[no-untyped-def]
            read()

    auto.kernel, auto.kernel_name = Configured(), "layer_first.kernel"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match=f"^{env}='{value}': ") as exc:
        auto.prepare(pool.binding)
    assert exc.value.setting == env
