"""The staged route's CUDA pipeline (``StagedRoute._run_pipelined``), checked on the CPU against a model of streams.

On a GPU the relayout of one chunk runs on a side stream beside the copy engine's transfer of the previous chunk,
through two halves of one staging buffer; events keep a half from being rewritten before the copy (or scatter) that
reads it has run.  A race there corrupts bytes only when the GPU happens to reorder the work, so a bit-exact GPU test
can pass with a missing wait.  Here streams and events are replaced by a model that records every operation with the
operations it is ordered after (same stream, or waited for through an event), and the test asserts the order itself:
every two operations on one half, one of them a write, are ordered; every relayout comes after the work queued before
the call, after the device rows it reads were put on the device, and before the work queued after the call.  The
operations also run (on the CPU, in program order), so the bytes are checked too: a backup's against the ``reference``
backend's, a load's against the rows the backup saved, with the rows it must not write unchanged."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import pytest
import torch

from hicache_core import HostKVPool, LayerMap, PoolSpec, create_registry
from hicache_core.pool import allocate_host_buffers
from hicache_core.backends import staging as staging_mod
from hicache_core.backends.direct import DirectStrategy
from hicache_core.backends.staging import StagedRoute

REG = create_registry()
PS = 4
PAGES = 8

needs = pytest.mark.skipif(not {"layer_first", "page_first"} <= set(REG.layouts),
                           reason="needs the layer_first and page_first layout plugins")


@dataclass(eq=False)
class Node:
    """One operation queued on a model stream: what it touches and what it is ordered after."""

    stream: str
    what: str
    half: int | None = None  # data pointer of the staging half it reads or writes
    writes_half: bool = False
    preds: set[Node] = field(default_factory=set)


class Event:
    def __init__(self, node: Node | None) -> None:
        self.node = node


class Stream:
    """A model CUDA stream: operations in order, waits as ordering edges."""

    def __init__(self, sim: Sim, name: str) -> None:
        self.sim, self.name, self.last = sim, name, None

    def add(self, node: Node, *after: Node | None) -> Node:
        node.preds |= {n for n in (self.last, *after) if n is not None}
        self.last = node
        self.sim.nodes.append(node)
        return node

    def record_event(self) -> Event:
        return Event(self.last)

    def wait_event(self, ev: Event) -> None:
        self.add(Node(self.name, "wait"), ev.node)

    def wait_stream(self, other: Stream) -> None:
        self.wait_event(other.record_event())


class Sim:
    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.main = Stream(self, "main")
        self.side = Stream(self, "side")
        self.current = self.main

    @contextlib.contextmanager
    def on(self, stream: Stream) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    @staticmethod
    def before(a: Node, b: Node) -> bool:
        """Whether ``a`` is ordered before ``b`` (``b`` reaches ``a`` through its predecessors)."""
        seen, todo = set(), [b]
        while todo:
            n = todo.pop()
            for p in n.preds:
                if p is a:
                    return True
                if p not in seen:
                    seen.add(p)
                    todo.append(p)
        return False


class Buffers:
    """Stands in for :class:`StagingBuffers`: the model side stream and a CPU staging buffer."""

    def __init__(self, sim: Sim) -> None:
        self.sim, self.buf = sim, None

    def side_stream(self, stream: int) -> Stream:
        return self.sim.side

    def get(self, stream: int, nbytes: int) -> torch.Tensor:
        self.buf = torch.full((nbytes,), 0xA5, dtype=torch.uint8)
        return self.buf


def _pool(layout: str, layers: int, io_backend: str = "direct", dev: dict | None = None
          ) -> tuple[HostKVPool, dict[str, list[torch.Tensor]]]:
    """A small MLA pool (its device layers ``dev``, or new random ones) whose host buffers hold canary bytes."""
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(layers), kv_lora_rank=512, qk_rope_head_dim=64,
                        dtype=torch.bfloat16, page_size=PS, capacity=PS * PAGES)
    gen = torch.Generator().manual_seed(layers)
    dev = dev or {"kv": [torch.randint(-9, 9, (spec.capacity, 1, 576), generator=gen).to(torch.bfloat16)
                         for _ in range(layers)]}
    host = allocate_host_buffers(REG.layout(layout).plan(spec), pin_memory=False)
    for t in host.values():
        t.view(torch.uint8).fill_(0x5A)
    # a budget of a few pages: chunks of one page each, so both halves are reused several times
    opts = {"staging": "always", "staging_bytes": 1} if io_backend == "direct" else None
    pool = HostKVPool(spec, layout, io_backend, dev, host_buffers=host, registry=REG,
                      strategy="core.direct" if opts else None, strategy_options=opts)
    return pool, dev


def _pages(pages: list[int]) -> torch.Tensor:
    return (torch.tensor(pages).unsqueeze(1) * PS + torch.arange(PS)).reshape(-1)


def _run_modelled(monkeypatch, pool: HostKVPool, h: torch.Tensor, d: torch.Tensor, *, to_host: bool) -> Sim:
    """One staged transfer through ``_run_pipelined`` with model streams; returns the model with every operation."""
    assert isinstance(pool.strategy, DirectStrategy)
    sub = pool.strategy.submission(pool.binding, h, d, None)
    route = sub.staged
    assert isinstance(route, StagedRoute) and route.chunks >= 4, "the test needs several chunks per half"
    sim = Sim()
    monkeypatch.setattr(staging_mod.torch.cuda, "current_stream", lambda device=None: sim.current)
    monkeypatch.setattr(staging_mod.torch.cuda, "stream", lambda s: sim.on(s))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    copy, relayout, d_dev = route._copy, route._relayout, route._d_dev
    rows_made: list[Node] = []
    caller = 7  # the caller's stream handle, as the copier gets it

    def modelled_copy(copier, p0, p1, base, stream, *, to_host):
        assert stream == caller and sim.current is sim.main  # the copy engine works on the caller's stream
        sim.main.add(Node("main", f"copy {p0}:{p1}", base, writes_half=not to_host))
        copy(copier, p0, p1, base, stream, to_host=to_host)

    def modelled_relayout(half, rows, npages, *, to_image):
        assert sim.current is sim.side  # relayouts go on the side stream
        sim.side.add(Node("side", "gather" if to_image else "scatter", half.data_ptr(), writes_half=to_image))
        relayout(half, rows, npages, to_image=to_image)

    def modelled_d_dev():  # the device rows may be copied to the device here, on the current stream
        rows_made.append(sim.current.add(Node(sim.current.name, "device rows to the device")))
        return d_dev()

    monkeypatch.setattr(route, "_copy", modelled_copy)
    monkeypatch.setattr(route, "_d_dev", modelled_d_dev)
    monkeypatch.setattr(route, "_relayout", modelled_relayout)
    earlier = sim.main.add(Node("main", "earlier work"))
    route._run_pipelined(pool.binding.scratch["direct.copier"], Buffers(sim), caller, [0, 0], to_host=to_host)
    later = sim.main.add(Node("main", "later work"))
    for n in sim.nodes:
        if n.stream == "side" and n.what != "wait":
            assert Sim.before(earlier, n), f"{n.what} is not ordered after the work queued before the call"
            assert Sim.before(n, later), f"{n.what} is not ordered before the work queued after the call"
            assert rows_made and all(Sim.before(r, n) for r in rows_made), f"{n.what} may read rows not yet there"
    ops = [n for n in sim.nodes if n.half is not None]
    assert len({n.half for n in ops}) == 2  # two halves, each used by several chunks
    for i, a in enumerate(ops):
        for b in ops[i + 1:]:
            if a.half == b.half and (a.writes_half or b.writes_half):
                assert Sim.before(a, b), f"{a.what} ({a.stream}) and {b.what} ({b.stream}) race on one half"
    return sim


@needs
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_pipelined_backup_orders_every_reuse_of_a_half(monkeypatch, layout):
    pool, dev = _pool(layout, 3)
    ref, _ = _pool(layout, 3, "reference", dev)
    h, d = _pages([6, 1, 4, 3, 0, 7]), _pages([2, 5, 0, 7, 3, 1])
    sim = _run_modelled(monkeypatch, pool, h, d, to_host=True)
    assert sum(n.what == "gather" for n in sim.nodes) == 6
    ref.backup_all_layers(h, d)
    for name, want in ref.binding.host_buffers.items():  # host pages 2 and 5 keep their canary bytes in both
        assert torch.equal(pool.binding.host_buffers[name].view(torch.uint8), want.view(torch.uint8))


@needs
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_pipelined_load_orders_every_reuse_of_a_half(monkeypatch, layout):
    pool, dev = _pool(layout, 3)
    h, s, d = _pages([6, 1, 4, 3, 0, 7]), _pages([2, 5, 0, 7, 3, 1]), _pages([4, 6, 1, 2, 5, 0])
    pool.backup_all_layers(h, s)  # (the serial CPU route) host pages h hold device pages s
    want = [t[s].clone() for t in dev["kv"]]
    untouched = torch.ones(pool.spec.capacity, dtype=torch.bool)
    untouched[d] = False
    canary = [t[untouched].clone() for t in dev["kv"]]
    sim = _run_modelled(monkeypatch, pool, h, d, to_host=False)
    assert sum(n.what == "scatter" for n in sim.nodes) == 6
    for t, w, c in zip(dev["kv"], want, canary):
        assert torch.equal(t[d].view(torch.int16), w.view(torch.int16))
        assert torch.equal(t[untouched].view(torch.int16), c.view(torch.int16))
