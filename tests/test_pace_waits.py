"""Waits on the GPU within a call (reading GPU-resident indices back) stay out of the host's measured pace
(``backends.pace.WaitLog``, the copier's samples, the plans' reads)."""

from __future__ import annotations

import threading

import pytest
import torch

from hicache_core import HostKVPool, LayerMap, PoolSpec, create_registry
from hicache_core.backends import memcpy as memcpy_mod
from hicache_core.backends import plans_plan
from hicache_core.backends.cudart import batch_schedule
from hicache_core.backends.memcpy import BatchCopier, QueueClock
from hicache_core.backends.pace import MODEL_CALL_US, WaitLog
from hicache_core.backends.plans import Plan, PlanCache

REG = create_registry()


def test_a_wait_log_gives_a_sample_the_waits_of_its_own_call_and_thread_only():
    t = [10.0]
    log = WaitLog(lambda: t[0])

    def wait(seconds: float) -> str:
        t[0] += seconds
        return "read"

    assert log.take(0.0) == 0.0  # nothing logged
    assert log.timed(lambda: wait(0.004)) == "read"  # an earlier call's wait, never sampled
    since = t[0]
    t[0] += 0.001  # the call's own work
    log.timed(lambda: wait(0.003))
    log.timed(lambda: wait(0.002))
    assert log.take(since) == pytest.approx(0.005)  # its two waits, not the earlier one
    assert log.take(0.0) == 0.0  # taken: forgotten, the earlier one with them

    def fails() -> None:
        t[0] += 0.001
        raise RuntimeError("device lost")

    with pytest.raises(RuntimeError):
        log.timed(fails)
    elsewhere: list[float] = []
    other = threading.Thread(target=lambda: elsewhere.append(log.take(0.0)))
    other.start()
    other.join()
    assert elsewhere == [0.0]  # another thread's sample sees none of this thread's waits
    assert log.take(0.0) == pytest.approx(0.001)  # a wait that raised still counts


class _FakeRuntime:
    def __init__(self, t: list[float], desc_us: float) -> None:
        self.t, self.desc_us = t, desc_us

    def copy_batch(self, dsts, srcs, lens, stream, eager):  # type: ignore[no-untyped-def]
        calls = batch_schedule(int(dsts.numel()), eager)
        self.t[0] += (len(calls) * MODEL_CALL_US + int(dsts.numel()) * self.desc_us) * 1e-6


def test_the_copier_takes_the_calls_waits_on_the_gpu_off_its_sample(monkeypatch):
    """A call that waited 5 ms for the stream before its plan could read GPU-resident indices, then planned for 32 us
    and submitted 64 descriptors at 0.45 us each: sampled at 0.45 + 32 / 64, not 5 ms more."""
    t = [100.0]
    monkeypatch.setattr(memcpy_mod, "runtime", lambda: _FakeRuntime(t, 0.45))
    monkeypatch.setattr(memcpy_mod, "current_device_index", lambda: 0)
    copier = BatchCopier(torch.device("cuda", 0))  # nothing touches a GPU: the runtime is the fake's
    copier.clock = QueueClock(now=lambda: t[0])  # the wait log reads the copier's clock, whichever it holds
    z = torch.zeros(64, dtype=torch.int64)
    lens = torch.full((64,), 40_000, dtype=torch.int64)

    def call(wait_s: float, to_host: bool) -> None:
        since = t[0]
        copier.waits.timed(lambda: t.__setitem__(0, t[0] + wait_s))
        t[0] += 32e-6
        copier.copy(z, z, lens, stream=0x55, to_host=to_host, since=since)
        t[0] += 1.0  # the engine drains before the next call

    call(0.005, False)
    call(0.0, True)
    assert copier.paces[False].samples() == [pytest.approx(0.45 + 32 / 64)]
    assert copier.paces[True].samples() == [pytest.approx(0.45 + 32 / 64)]
    copier.waits.timed(lambda: t.__setitem__(0, t[0] + 0.005))  # a wait of a call that was never sampled
    t[0] += 1.0
    call(0.0, False)
    assert copier.paces[False].samples()[-1] == pytest.approx(0.45 + 32 / 64)  # not taken off a later call


def _pool() -> HostKVPool:
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.uint8,
                        page_size=16, capacity=64, row_bytes=656)
    dev = {"kv": [torch.zeros(64, 1, 656, dtype=torch.uint8) for _ in range(2)]}
    return HostKVPool(spec, "layer_first", "direct", dev, registry=REG, strategy="core.direct")


def test_direct_hands_its_copiers_wait_log_to_its_plans():
    pool = _pool()
    copier = pool.binding.scratch["direct.copier"]
    assert pool.binding.scratch["direct.plans"].waits is copier.waits


class _GpuLike:
    """Stands for a CUDA tensor in :meth:`Plan._to_host` (its read is faked below)."""
    is_cuda = True
    device = torch.device("cuda", 0)


def test_a_plan_waits_for_the_stream_apart_before_reading_gpu_resident_values(monkeypatch):
    t = [0.0]
    log = WaitLog(lambda: t[0])
    pool = _pool()
    h = torch.arange(16)
    plan = Plan(pool.binding, h, torch.arange(16), "never", 1, waits=log)
    assert log.take(-1.0) == 0.0  # CPU indices: nothing waited for
    synced: list[torch.device] = []

    class _Stream:
        def __init__(self, device: torch.device) -> None:
            self.device = device

        def synchronize(self) -> None:
            synced.append(self.device)
            t[0] += 0.007

    monkeypatch.setattr(plans_plan.torch.cuda, "current_stream", lambda device: _Stream(device))
    monkeypatch.setattr(plans_plan, "as_long", lambda x, device, copy=False: torch.arange(4))
    assert torch.equal(plan._to_host(_GpuLike()), torch.arange(4))  # type: ignore[arg-type]
    assert synced == [torch.device("cuda", 0)]
    assert log.take(-1.0) == pytest.approx(0.007)
    plan._to_host(h)  # a CPU tensor: no stream waited for
    assert synced == [torch.device("cuda", 0)] and log.take(-1.0) == 0.0


def test_a_plans_deferred_reads_of_device_indices_are_logged_as_waits(monkeypatch):
    """The reads a plan defers until a route needs the device indices' values wait for the GPU too: from its device
    copy (the stream's queued work) or from an early read (its event); both go through the wait log.  A cache's plans
    get its log."""
    t = [0.0]
    log = WaitLog(lambda: t[0])
    pool = _pool()
    cache = PlanCache(pool.binding, "never", 1, waits=log)
    h, d = torch.arange(16), torch.arange(16)
    assert cache.get(h, d, 0)._waits is log

    class _Stream:
        def synchronize(self) -> None:
            t[0] += 0.004

    monkeypatch.setattr(plans_plan.torch.cuda, "current_stream", lambda device: _Stream())
    monkeypatch.setattr(plans_plan, "as_long", lambda x, device, copy=False: torch.arange(4))
    plan = Plan(pool.binding, h, d, "never", 1, waits=log)
    plan._d, plan._d_dev, plan._d_early = None, _GpuLike(), None  # type: ignore[assignment]  # as on a CUDA pool
    assert torch.equal(plan.d, torch.arange(4)) and log.take(-1.0) == pytest.approx(0.004)

    class _Early:
        def values(self) -> torch.Tensor:  # waits for the early read's event
            t[0] += 0.002
            return torch.arange(4)

    plan._d, plan._early = None, _Early()  # type: ignore[assignment]
    assert torch.equal(plan.d, torch.arange(4)) and log.take(-1.0) == pytest.approx(0.002)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_a_new_pairs_read_back_is_logged_and_taken_by_the_calls_sample(monkeypatch):
    """CUDA pool, CPU host indices, GPU-resident device indices, the stream busy before the call: the plan's read of
    the device indices waits once, through the copier's wait log, and the call's sample takes that wait; the bytes
    land as the reference backend writes them, canaries untouched."""
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.uint8,
                        page_size=16, capacity=1024, row_bytes=656, device="cuda")
    g = torch.Generator().manual_seed(7)
    dev = {"kv": [torch.randint(0, 256, (1024, 1, 656), dtype=torch.uint8, generator=g).cuda() for _ in range(2)]}
    # plain descriptors, which the copier samples (a pitched or staged route is not sampled)
    pool = HostKVPool(spec, "layer_first", "direct", dev, registry=REG, strategy="core.direct",
                      strategy_options={"pitched": "never", "staging": "never"})
    ref = HostKVPool(spec, "layer_first", "reference", dev, registry=REG, strategy="core.reference", pin_memory=False)
    for p in (pool, ref):
        for buf in p.host_buffers.values():
            buf.view(torch.uint8).fill_(0xA5)
    copier = pool.binding.scratch["direct.copier"]
    timed: list[float] = []
    taken: list[float] = []
    real_timed, real_take = copier.waits.timed, copier.waits.take

    def spy_timed(wait):  # type: ignore[no-untyped-def]
        timed.append(copier.clock.now())
        return real_timed(wait)

    def spy_take(since: float) -> float:
        taken.append(real_take(since))
        return taken[-1]

    monkeypatch.setattr(copier.waits, "timed", spy_timed)
    monkeypatch.setattr(copier.waits, "take", spy_take)
    pages = torch.randperm(64, generator=g)[:40]
    h = (pages.unsqueeze(1) * 16 + torch.arange(16)).reshape(-1)  # CPU-resident, pages in random order: 80 blocks
    d = torch.arange(640, device="cuda")  # GPU-resident, as an engine hands them over
    torch.cuda._sleep(100_000_000)  # ~50-70 ms of work queued before the call: the read back waits for it
    pool.backup_all_layers(h, d)
    torch.cuda.synchronize()
    assert len(timed) == 1 and len(taken) == 1
    assert taken[0] >= 0.005  # the wait for the queued work went through the log (ms, not a sync of an idle stream)
    samples = copier.paces[True].samples()
    assert len(samples) == 1 and samples[0] * 80 * 1e-6 < taken[0] / 2  # at most 80 descriptors: the wait is not in
    ref.backup_all_layers(h, d)
    torch.cuda.synchronize()
    for name, buf in pool.host_buffers.items():
        assert torch.equal(buf.view(torch.uint8), ref.host_buffers[name].view(torch.uint8)), name
