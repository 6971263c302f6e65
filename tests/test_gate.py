"""``direct`` with ``submit="worker"``: a worker thread submits calls whose indices are on the GPU, gated
into the caller's stream.  The CPU tests drive the worker with a fake gate (order, errors, sequence
numbers, the strategy's job); the CUDA tests check bytes and stream order on a real device."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from hicache_core import HostKVPool, LayerMap, PoolSpec, create_registry
from hicache_core.backends.direct import DirectStrategy
from hicache_core.backends.gate import SubmitWorker
from hicache_core.errors import ConfigError, DeferredTransferError, IndexRangeError
from hicache_core.testing.conformance import CANARY, CASES, check_strategy

REG = create_registry()
LAYOUTS = sorted(REG.layouts)
CUDA = torch.cuda.is_available()


class FakeGate:
    """Records what a CudaGate would enqueue; ``fail_gate`` makes the caller-side gate fail."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.fail_gate = False
        self._lock = threading.Lock()

    def _add(self, *entry: object) -> None:
        with self._lock:
            self.log.append(entry)

    def record(self, stream: object) -> tuple:
        ev = ("event", stream, len(self.log))
        self._add("record", ev)
        return ev

    def gate(self, stream: object, seq: int) -> None:
        if self.fail_gate:
            raise RuntimeError("cuStreamWaitValue32 failed (CUresult 1)")
        self._add("gate", stream, seq)

    def worker_context(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def follow(self, event: object) -> None:
        self._add("follow", event)

    def wait(self, event: object) -> None:
        self._add("wait", event)

    def release(self, seq: int) -> None:
        self._add("release", seq)

    def entries(self, kind: str) -> list[tuple]:
        return [e[1:] for e in self.log if e[0] == kind]


def test_worker_runs_jobs_in_call_order_behind_their_events_and_opens_every_gate():
    ops = FakeGate()
    worker = SubmitWorker(ops, "test-worker")
    ran: list[int] = []
    for k in range(40):
        worker.submit(f"s{k % 3}", lambda wait, k=k: ran.append(k))
    assert worker.drain(10)
    assert ran == list(range(40)) and worker.pending == 0
    assert ops.entries("gate") == [(f"s{k % 3}", k + 1) for k in range(40)]
    assert ops.entries("release") == [(k + 1,) for k in range(40)]
    # each job's stream waits for the event its caller recorded, the gate follows the record
    assert [e[0] for e in ops.entries("follow")] == [e[0] for e in ops.entries("record")]
    assert [e[0] for e in ops.log if e[0] in ("record", "gate")] == ["record", "gate"] * 40  # event, then gate
    assert not ops.entries("wait")  # no job asked to wait for its caller's work


def test_failed_job_opens_its_gate_and_the_next_call_raises_once():
    ops = FakeGate()
    worker = SubmitWorker(ops, "test-worker")

    def bad(wait):
        raise IndexRangeError("direct: host_indices must lie in 0..15; nothing was copied")
    worker.submit("s", bad)
    assert worker.drain(10)
    assert ops.entries("release") == [(1,)]  # the gate opened although the job failed
    ran: list[int] = []
    with pytest.raises(DeferredTransferError, match="host_indices must lie in 0..15") as info:
        worker.submit("s", lambda wait: ran.append(2))
    assert isinstance(info.value.__cause__, IndexRangeError)
    assert ops.entries("gate") == [("s", 1)] and not ran  # the raising call queued nothing
    worker.submit("s", lambda wait: ran.append(3))  # raised once
    assert worker.drain(10) and ran == [3] and ops.entries("release") == [(1,), (2,)]


def test_gate_failure_raises_in_the_call_and_queues_nothing():
    ops = FakeGate()
    ops.fail_gate = True
    worker = SubmitWorker(ops, "test-worker")
    ran: list[int] = []
    with pytest.raises(RuntimeError, match="cuStreamWaitValue32"):
        worker.submit("s", lambda wait: ran.append(1))
    assert worker.pending == 0 and not ran and not ops.entries("release")
    ops.fail_gate = False
    worker.submit("s", lambda wait: ran.append(2))
    assert worker.drain(10) and ran == [2] and ops.entries("gate") == [("s", 1)]  # the number was not used up


def test_sequence_numbers_wrap_at_32_bits():
    ops = FakeGate()
    worker = SubmitWorker(ops, "test-worker")
    worker._seq = 0xFFFFFFFE
    for _ in range(3):
        worker.submit("s", lambda wait: None)
    assert worker.drain(10)
    assert [e[1] for e in ops.entries("gate")] == [0xFFFFFFFF, 0, 1]  # the driver compares cyclically
    assert ops.entries("release") == [(0xFFFFFFFF,), (0,), (1,)]


def _mla_pool(layout: str, device: str = "cpu", ps: int = 4, layers: int = 3, pages: int = 8) -> tuple[HostKVPool, dict]:
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(layers), kv_lora_rank=512, qk_rope_head_dim=64,
                        dtype=torch.bfloat16, page_size=ps, capacity=ps * pages, device=torch.device(device))
    gen = torch.Generator().manual_seed(3)
    dev = {"kv": [torch.randint(-9, 9, (2 * ps * pages, 1, 576), generator=gen).to(torch.bfloat16).to(device)
                  for _ in range(layers)]}
    pool = HostKVPool(spec, layout, "direct", dev, registry=REG, strategy="core.direct",
                      strategy_options={"submit": "worker"}, pin_memory=device == "cuda")
    return pool, dev


@pytest.mark.skipif("layer_first" not in LAYOUTS, reason="needs the layer_first layout plugin")
def test_strategy_job_waits_for_the_caller_only_to_read_new_indices_and_moves_the_right_bytes():
    """On the CPU the pool's indices are 'on its device', so every call goes through the worker (driven by
    a fake gate here): bytes as the reference writes them, canaries untouched, one wait per new pair."""
    pool, dev = _mla_pool("layer_first")
    assert "direct.worker" not in pool.binding.scratch  # CPU pools submit inline unless given a worker
    ops = FakeGate()
    worker = pool.binding.scratch["direct.worker"] = SubmitWorker(ops, "test-worker")
    ref = HostKVPool(pool.spec, "layer_first", "reference", dev, registry=REG, strategy="core.reference",
                     pin_memory=False)
    for p in (pool, ref):
        for buf in p.host_buffers.values():
            buf.view(torch.uint8).fill_(CANARY)
    gen = torch.Generator().manual_seed(4)
    ps = pool.spec.page_size
    h = (torch.randperm(8, generator=gen)[:5].unsqueeze(1) * ps + torch.arange(ps)).reshape(-1)
    d = (torch.randperm(16, generator=gen)[:5].unsqueeze(1) * ps + torch.arange(ps)).reshape(-1)
    pool.backup_all_layers(h, d)
    ref.backup_all_layers(h, d)
    assert worker.drain(10)
    for name, buf in pool.host_buffers.items():
        assert torch.equal(buf.view(torch.uint8), ref.host_buffers[name].view(torch.uint8)), name
    assert len(ops.entries("wait")) == 1  # a new pair: the job waited for the caller before reading it
    target = (torch.randperm(16, generator=gen)[:5].unsqueeze(1) * ps + torch.arange(ps)).reshape(-1)
    want = [dev["kv"][layer][d].clone() for layer in range(3)]
    for layer in range(3):
        dev["kv"][layer][target] = 0
        pool.load_layer(layer, h, target)
    assert worker.drain(10)
    for layer in range(3):
        assert torch.equal(dev["kv"][layer][target], want[layer]), layer
    assert len(ops.entries("wait")) == 2  # one more new pair, read once for the three layers
    assert ops.entries("release") == [(k,) for k in range(1, 5)]


@pytest.mark.skipif("layer_first" not in LAYOUTS, reason="needs the layer_first layout plugin")
def test_bad_indices_found_by_the_worker_move_nothing_and_the_next_call_raises():
    pool, dev = _mla_pool("layer_first")
    ops = FakeGate()
    worker = pool.binding.scratch["direct.worker"] = SubmitWorker(ops, "test-worker")
    for buf in pool.host_buffers.values():
        buf.view(torch.uint8).fill_(CANARY)
    ps = pool.spec.page_size
    h = torch.arange(ps) + 40 * ps  # past the capacity: the pool's own check is bypassed on purpose
    d = torch.arange(ps)
    assert isinstance(pool.strategy, DirectStrategy)
    pool.strategy.backup(pool.binding, h, d, None)
    assert worker.drain(10) and ops.entries("release") == [(1,)]
    for buf in pool.host_buffers.values():
        assert bool((buf.view(torch.uint8) == CANARY).all())
    with pytest.raises(DeferredTransferError, match="host_indices must lie in") as info:
        pool.backup_all_layers(torch.arange(ps), d)
    assert isinstance(info.value.__cause__, IndexRangeError)
    for buf in pool.host_buffers.values():
        assert bool((buf.view(torch.uint8) == CANARY).all())


@pytest.mark.parametrize("bad", ["threads", "Worker!"])
def test_submit_mode_is_validated(monkeypatch, bad):
    with pytest.raises(ConfigError, match="submit"):
        DirectStrategy(submit=bad)
    monkeypatch.setenv("HICACHE_DIRECT_SUBMIT", bad)
    with pytest.raises(ConfigError, match="HICACHE_DIRECT_SUBMIT"):
        DirectStrategy()
    monkeypatch.setenv("HICACHE_DIRECT_SUBMIT", "Worker")
    assert DirectStrategy().submit == "worker"


# -- on a CUDA device ----------------------------------------------------------------------

cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
GPU_CASES = [c for c in CASES if c.id in ("mla576-bf16-ps16-strided", "mla576-bf16-ps64-splitdev",
                                          "mla576-fp8-ps16-sharded5of2r1", "mha-bf16-ps16-vdim-strided",
                                          "mha-fp16-ps128-drafts")]


@cuda_only
@pytest.mark.parametrize("variant", ["reversed-i64-dev", "shuffled-i64"])
@pytest.mark.parametrize("case", GPU_CASES, ids=[c.id for c in GPU_CASES])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_worker_round_trip_on_the_gpu(monkeypatch, layout, case, variant):
    spec = case.build(torch.device("cuda"))
    if REG.try_resolve(spec, layout, "direct")[0] is None:
        pytest.skip(f"{layout} does not hold {case.id}")
    monkeypatch.setenv("HICACHE_DIRECT_SUBMIT", "worker")
    pool = check_strategy(REG, case, layout, "direct", variant=variant, device="cuda", strategy="core.direct")
    worker = pool.binding.scratch["direct.worker"]
    assert worker.drain(30) and worker.pending == 0
    check_strategy(REG, case, layout, "direct", variant=variant, device="cuda", strategy="core.direct",
                   per_layer_backup=True)


@cuda_only
@pytest.mark.parametrize("layout", [x for x in ("layer_first", "page_first", "page_first_direct") if x in LAYOUTS])
def test_worker_copies_run_after_earlier_work_and_before_later_work_on_the_callers_stream(layout):
    """Writes queued before the call (behind a long sleep) are what the backup moves; a scribble queued right
    after it is not; a load's rows are what a copy queued after it sees."""
    pool, dev = _mla_pool(layout, device="cuda", ps=16, layers=4, pages=8)
    ps = pool.spec.page_size
    gen = torch.Generator().manual_seed(5)
    h = (torch.randperm(8, generator=gen)[:6].unsqueeze(1) * ps + torch.arange(ps)).reshape(-1).cuda()
    d = (torch.randperm(16, generator=gen)[:6].unsqueeze(1) * ps + torch.arange(ps)).reshape(-1).cuda()
    stream = torch.cuda.Stream()
    want = [torch.randint(-99, 99, (h.numel(), 1, 576), generator=gen).to(torch.bfloat16).cuda() for _ in range(4)]
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # tens of milliseconds of queued work before the rows are written
        for layer in range(4):
            dev["kv"][layer][d] = want[layer]
        pool.backup_all_layers(h, d)
        for layer in range(4):
            dev["kv"][layer][d] = 0  # queued after the call: must wait for the backup's copies
        target = (torch.randperm(16, generator=gen)[:6].unsqueeze(1) * ps + torch.arange(ps)).reshape(-1).cuda()
        seen = []
        for layer in range(4):
            dev["kv"][layer][target] = 7
            pool.load_layer(layer, h, target)
            seen.append(dev["kv"][layer][target].clone())  # queued after the load
    stream.synchronize()
    for layer in range(4):
        assert torch.equal(seen[layer], want[layer]), layer
    assert pool.binding.scratch["direct.worker"].pending == 0


@cuda_only
@pytest.mark.skipif("layer_first" not in LAYOUTS, reason="needs the layer_first layout plugin")
def test_worker_out_of_range_gpu_indices_move_nothing_release_the_stream_and_raise_next():
    pool, dev = _mla_pool("layer_first", device="cuda", ps=16, layers=3, pages=8)
    ps = pool.spec.page_size
    for buf in pool.host_buffers.values():
        buf.view(torch.uint8).fill_(CANARY)
    h = (torch.arange(ps) + 100 * ps).cuda()  # device-resident values are not checked in the call
    d = torch.arange(ps).cuda()
    pool.backup_all_layers(h, d)
    torch.cuda.synchronize()  # returns: the failed job opened its gate
    worker = pool.binding.scratch["direct.worker"]
    assert worker.drain(30)
    for buf in pool.host_buffers.values():
        assert bool((buf.view(torch.uint8) == CANARY).all())
    with pytest.raises(DeferredTransferError, match="host_indices must lie in"):
        pool.backup_all_layers(torch.arange(ps).cuda(), d)
    pool.backup_all_layers(torch.arange(ps).cuda(), d)  # raised once; this one runs
    torch.cuda.synchronize()
    assert worker.drain(30)
    target = torch.arange(ps, 2 * ps).cuda()
    for layer in range(3):
        dev["kv"][layer][target] = 0
        pool.load_layer(layer, torch.arange(ps).cuda(), target)
    torch.cuda.synchronize()
    for layer in range(3):
        assert torch.equal(dev["kv"][layer][target], dev["kv"][layer][d]), layer
