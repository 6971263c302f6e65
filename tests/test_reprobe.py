"""``auto``'s ``reprobe`` option (``backends.reprobe``): a reused pair's burst held on the kernel by a slow measure of the
host is measured again once the kernel's own calls show the host sped up."""

from __future__ import annotations

import pytest
import torch

from hicache_core import HostKVPool, LayerMap, PoolSpec, create_registry
from hicache_core.backends.auto import AutoStrategy
from hicache_core.backends.memcpy import QueueClock
from hicache_core.backends.pace import MIN_SAMPLES, WARM_STALE_S, WINDOW, HostPace
from hicache_core.backends.reprobe import DROP, Reprobe
from hicache_core.errors import ConfigError
from fakes import auto_over

REG = create_registry()


def _fill(pace: HostPace, desc_us: float) -> None:
    for _ in range(WINDOW):
        pace.record(64 * desc_us, 64, 0)


def test_a_reprobe_resets_the_measure_once_when_the_kernels_calls_run_faster_than_after_the_decision():
    t = [0.0]
    target = HostPace(now=lambda: t[0], warm=True)
    _fill(target, 0.9)
    gen = target.generation
    rp = Reprobe(now=lambda: t[0])
    rp.record(20.0)  # not armed: nothing kept
    assert rp.kernel.samples() == [] and rp.ref is None
    rp.arm(target)
    for _ in range(WINDOW - 1):
        rp.record(20.0)
    assert rp.ref is None  # the reference needs a full window after the decision
    rp.record(20.0)
    assert rp.ref == pytest.approx(20.0)
    for _ in range(WINDOW):
        rp.record(20.0 * (1 - DROP) + 0.5)  # faster, but by less than DROP: the host's noise
    assert rp.triggers == 0 and target.desc_us == pytest.approx(0.9)
    calls = 0
    while rp.target is not None:
        rp.record(12.0)  # the host's fast state
        calls += 1
        assert calls <= WINDOW
    assert rp.triggers == 1 and target.desc_us is None and target.generation == gen + 1
    for _ in range(WINDOW):
        rp.record(5.0)  # once per arming
    assert rp.triggers == 1

    _fill(target, 0.9)
    rp.arm(target)  # armed anew: the kernel's earlier samples are not its reference
    assert rp.kernel.samples() == [] and rp.ref is None
    for us in [20.0] * WINDOW + [30.0] * 2 * WINDOW:  # a host that slows further never re-probes
        rp.record(us)
    assert rp.triggers == 1 and target.desc_us == pytest.approx(0.9)
    rp.disarm()
    rp.record(1.0)
    assert rp.target is None and rp.kernel.samples()[-1] == pytest.approx(30.0)  # disarmed: nothing kept


class _Kernel:
    """A kernel candidate whose load lane serves every call and takes ``cost`` microseconds of the fake clock."""

    def __init__(self, t: list[float]) -> None:
        self.t, self.cost, self.served = t, 20.0, 0

    def lane(self, binding: object, to_host: bool):  # type: ignore[no-untyped-def]
        def serve(layer, h, d):  # type: ignore[no-untyped-def]
            self.t[0] += self.cost * 1e-6
            self.served += 1
            return True
        return serve


def _auto(reprobe: bool = True) -> tuple[AutoStrategy, HostKVPool, torch.Tensor, torch.Tensor, list[float], _Kernel]:
    """``auto`` over a ``direct`` pool of one-layer fp8 loads (64 pages of 656-byte rows, no two pages adjacent: 64
    descriptors, 2.7 MB), a fake kernel with a load lane, and measures of the host on one fake clock."""
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.uint8,
                        page_size=64, capacity=64 * 64, row_bytes=656)
    dev = {"kv": [torch.zeros(64 * 64, 1, 656, dtype=torch.uint8) for _ in range(2)]}
    pool = HostKVPool(spec, "layer_first", "direct", dev, registry=REG, strategy="core.direct")
    h = torch.arange(64).flip(0).repeat_interleave(64) * 64 + torch.arange(64).repeat(64)
    t = [50.0]

    class _Measures:
        paces = (HostPace(now=lambda: t[0]), HostPace(now=lambda: t[0]))

    auto = auto_over(pool, _Measures, reprobe=reprobe)
    auto.warm_paces = (HostPace(now=lambda: t[0], warm=True), HostPace(now=lambda: t[0], warm=True))
    auto._layers = 2
    auto.clock = QueueClock(now=lambda: t[0])
    kernel = _Kernel(t)
    auto.kernel = kernel  # type: ignore[assignment]
    auto.reprobe_watch = Reprobe(now=lambda: t[0]) if reprobe else None
    _fill(auto.paces[False], 0.9)  # type: ignore[index]  # planning calls: too slow for these loads
    _fill(auto.warm_paces[False], 0.9)  # and reused plans too
    return auto, pool, h, torch.arange(64 * 64), t, kernel


def test_a_burst_held_on_the_kernel_by_a_slow_host_is_measured_again_once_the_kernels_calls_speed_up():
    auto, pool, h, d, t, kernel = _auto()
    rp = auto.reprobe_watch
    assert rp is not None
    b = pool.binding
    assert [auto.pick(b, h, d, layer, to_host=False) is kernel for layer in (1, 0)] == [True, True]
    assert rp.target is None  # the pair's first burst, judged at the planning pace: not armed
    assert auto.pick(b, h, d, 1, to_host=False) is kernel  # reused, judged at the reused plans' slow pace
    assert rp.target is auto.warm_paces[False]  # type: ignore[index]
    lane = auto.lane(b, False)
    assert lane is not None
    for i in range(WINDOW):
        assert lane(i % 2, h, d)
    assert rp.ref == pytest.approx(20.0, abs=1.0)  # the kernel's calls as timed by the lane (its own time included)
    kernel.cost = 12.0
    served = kernel.served
    while lane(0, h, d):
        assert kernel.served - served <= WINDOW
    assert rp.triggers == 1 and auto.warm_paces[False].desc_us is None  # type: ignore[index]
    # the next call decides again: no measure of reused plans, so the copy engine serves it to measure the host
    assert auto.pick(b, h, d, 1, to_host=False) is auto.direct and auto.pace_probes == 1
    assert rp.target is None


def test_only_a_slow_measure_of_reused_plans_arms_it_and_every_new_decision_disarms_it():
    auto, pool, h, d, t, kernel = _auto()
    rp = auto.reprobe_watch
    assert rp is not None
    b = pool.binding
    for layer in (1, 0, 1):
        auto.pick(b, h, d, layer, to_host=False)
    assert rp.target is auto.warm_paces[False]  # type: ignore[index]
    t[0] += 2 * WARM_STALE_S  # the measure aged: the next call decides again and probes the copy engine
    assert auto.pick(b, h, d, 0, to_host=False) is auto.direct and rp.target is None
    # backups never arm it, nor are they watched
    assert auto.pick(b, h, d, None, to_host=True) is not None and rp.target is None
    # without the option nothing is watched and the lane serves the kernel's route as before
    auto, pool, h, d, t, kernel = _auto(reprobe=False)
    for layer in (1, 0, 1):
        assert auto.pick(pool.binding, h, d, layer, to_host=False) is kernel
    lane = auto.lane(pool.binding, False)
    assert lane is not None and all(lane(0, h, d) for _ in range(3 * WINDOW))
    assert auto.reprobe_watch is None and kernel.served == 3 * WINDOW


def test_reprobe_is_an_option_of_auto_and_explain_names_it():
    with pytest.raises(ConfigError, match="reprobe"):
        AutoStrategy(reprobe="yes")  # type: ignore[arg-type]
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                        page_size=16, capacity=64)
    dev = {"kv": [torch.zeros(64, 1, 576, dtype=torch.bfloat16) for _ in range(2)]}
    for on in (False, True):
        pool = HostKVPool(spec, "layer_first", "auto", dev, registry=REG, strategy_options={"reprobe": on})
        auto = pool.strategy
        assert isinstance(auto, AutoStrategy) and auto.reprobe is on
        assert auto.reprobe_watch is None  # a CPU pool measures no host: nothing to watch
        lines = auto.describe(pool.spec, pool.binding.layout)
        assert any("reprobe" in line for line in lines) is on
        assert not any("no effect here" in line for line in lines)
    pool = HostKVPool(spec, "layer_first", "auto", dev, registry=REG, strategy_options={"reprobe": True, "pace": False})
    lines = pool.strategy.describe(pool.spec, pool.binding.layout)
    assert any("reprobe" in line and "no effect here: pace=False" in line for line in lines)
    assert MIN_SAMPLES <= WINDOW  # the reference comes from a full window, after an estimate exists


class _Staged:
    """A staged submission standing for ``sub``: the copy engine's route after a relayout, which ``fed`` judges at the
    calibration's costs alone (here far too slow), whatever the measure says."""

    def __init__(self, sub):  # type: ignore[no-untyped-def]
        self._sub, self.staged, self.pitched = sub, object(), None

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._sub, name)

    def host_us(self, submit_us: float, call_us: float = 0.0) -> float:
        return 1e9


def test_a_kernel_pick_no_measure_made_arms_nothing(monkeypatch):
    """Only a refusal by the measure arms the watch: not a staged plan the calibration refuses while the host is
    measured fast, nor backups or all-layer loads judged at a slow measure of reused plans."""
    from dataclasses import replace

    from hicache_core.calibration import DEFAULT

    auto, pool, h, d, t, kernel = _auto()
    rp, b = auto.reprobe_watch, pool.binding
    assert rp is not None
    real = auto.direct.submission  # type: ignore[union-attr]
    monkeypatch.setattr(auto.direct, "submission", lambda *a: _Staged(real(*a)))
    _fill(auto.paces[False], 0.001)  # type: ignore[index]  # a fast host: plain descriptors would go to the copy engine
    _fill(auto.warm_paces[False], 0.001)  # type: ignore[index]
    assert [auto.pick(b, h, d, layer, to_host=False) is kernel for layer in (1, 0, 1)] == [True] * 3
    assert rp.target is None
    monkeypatch.undo()

    auto, pool, h, d, t, kernel = _auto()
    rp, b = auto.reprobe_watch, pool.binding
    assert rp is not None
    auto.calibration = replace(DEFAULT, submit_us=100.0)  # the calibration alone refuses every call here
    for to_host in (True, False):
        _fill(auto.paces[to_host], 5.0)  # type: ignore[index]  # too slow even with a backup's room
        _fill(auto.warm_paces[to_host], 5.0)  # type: ignore[index]
        # an all-layer call's second is a reuse, judged at the slow measure of reused plans: the kernel, not watched
        assert [auto.pick(b, h, d, None, to_host=to_host) is kernel for _ in range(2)] == [True, True]
        assert rp.target is None, to_host
    # armed by a one-layer load burst, the kernel's backups and all-layer loads through the lanes are not timed
    for layer in (1, 0, 1):
        auto.pick(b, h, d, layer, to_host=False)
    assert rp.target is auto.warm_paces[False]  # type: ignore[index]
    # one-layer backups of the pair, beyond its first burst (the lane leaves that burst's end to pick())
    assert [auto.pick(b, h, d, layer, to_host=True) is kernel for layer in (1, 0, 1)] == [True] * 3
    assert rp.target is auto.warm_paces[False]  # type: ignore[index]  # backups neither arm nor disarm it
    backup, load = auto.lane(b, True), auto.lane(b, False)
    assert backup is not None and load is not None
    for _ in range(WINDOW):
        assert backup(None, h, d) and backup(1, h, d) and load(None, h, d)
    assert rp.kernel.samples() == [] and kernel.served == 3 * WINDOW
    assert load(1, h, d) and len(rp.kernel.samples()) == 1  # a one-layer load is
