"""Helpers of the multi-GPU tests: which strategies to cover, device/stream set-up, a stream gate.

Importable without a GPU (the tests must collect on CPU CI); Triton is imported
only when a gate is first launched.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from hicache_core import HostKVPool, PoolSpec, Registry
from hicache_core.testing.conformance import CANARY, Case, clone_buffers, fill_canary, make_device_buffers

__all__ = ["GATE_SPINS", "StreamGate", "cuda_devices", "skip_reason", "strategy_targets", "current_on", "pick_rows",
           "rows_of", "resolve_or_skip", "gated_round_trip", "remove_guards"]

#: Polls of the gate flag before the gate opens by itself: a safety net of several seconds (one
#: poll is an L2 round trip, 0.1-1 us), against milliseconds between closing and opening it in a
#: passing test; only a transfer that synchronises the host with the gated stream waits that long.
GATE_SPINS = 30_000_000


def cuda_devices() -> int:
    """CUDA devices visible here (0 without a CUDA build; never initialises CUDA on CPU builds)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def skip_reason(need: int) -> str | None:
    """Why a test needing ``need`` CUDA devices cannot run here, or ``None``."""
    have = cuda_devices()
    if have >= need:
        return None
    return f"needs {need} CUDA devices, this machine has {have} (run dev/gpu_two.sh on a 2-GPU machine)"


def strategy_targets(reg: Registry) -> list[tuple[str, str, str]]:
    """Every ``(layout, io_backend, strategy)`` the registry can pick for some key, ``reference`` aside.

    Read from the registry, so a newly registered backend (``auto``, a staged
    copy engine, a vendor's) is covered without editing the tests.
    """
    out = set()
    for layout in sorted(reg.layouts):
        for backend in reg.io_backends:
            if backend == "reference":
                continue
            for sharded in (False, True):
                out.update((layout, backend, info.name) for info in reg.candidates(layout, backend, sharded))
    return sorted(out)


@contextlib.contextmanager
def current_on(device: int, stream: torch.cuda.Stream) -> Iterator[None]:
    """Make ``stream`` current on its device while ``device`` stays the current device.

    ``torch.cuda.set_stream`` also switches the current device to the stream's;
    the previous device and that device's previous stream are restored on exit.
    """
    prev_device = torch.cuda.current_device()
    prev_stream = torch.cuda.current_stream(stream.device)
    torch.cuda.set_stream(stream)
    torch.cuda.set_device(device)
    try:
        yield
    finally:
        torch.cuda.set_stream(prev_stream)
        torch.cuda.set_device(prev_device)


def _gate_kernel():  # built on first use: no Triton import at collection
    import triton
    import triton.language as tl

    @triton.jit
    def gate(flag_ptr, status_ptr, max_spins):
        # Spin until *flag_ptr != 0 (opened) or max_spins polls (expired); status 1 = opened, 2 = expired.
        v = tl.load(flag_ptr, volatile=True)
        spins = max_spins * 0  # an int32 tensor from the start (a loop-carried value keeps its type)
        while (v == 0) & (spins < max_spins):
            v = tl.load(flag_ptr, volatile=True)
            spins += 1
        tl.store(status_ptr, 1 + (v == 0).to(tl.int32))

    return gate


_GATE: list = []


class StreamGate:
    """Holds back everything enqueued on one stream after :meth:`close` until :meth:`open`.

    A one-program kernel spins on a device flag; :meth:`open` sets the flag from
    another stream of the same device.  Work enqueued on the gated stream after
    the gate cannot start before the flag is set, whatever the timing; work
    enqueued anywhere else is not held.  Always :meth:`open` in a ``finally``.
    """

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        self.device = stream.device
        self.side = torch.cuda.Stream(self.device)  # never the gated one: used to open and to inspect
        self.flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.status = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.closed = False

    def close(self) -> None:
        """Enqueue the gate on the gated stream (the flag and status are reset first)."""
        if not _GATE:
            _GATE.append(_gate_kernel())
        torch.cuda.synchronize(self.device)
        self.flag.zero_()
        self.status.zero_()
        torch.cuda.synchronize(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            _GATE[0][(1,)](self.flag, self.status, GATE_SPINS)
        self.closed = True

    def open(self) -> str:
        """Open the gate, wait for the gated stream to drain, and say how the gate ended:
        ``opened`` (by this call) or ``expired`` (it gave up waiting before)."""
        if not self.closed:
            return "never closed"
        with torch.cuda.stream(self.side):
            self.flag.fill_(1)
        self.side.synchronize()
        self.stream.synchronize()
        self.closed = False
        with torch.cuda.stream(self.side):
            status = int(self.status.cpu()[0])
        return {1: "opened", 2: "expired"}.get(status, f"status {status}")

    def inspect(self, t: torch.Tensor) -> torch.Tensor:
        """A CPU copy of device tensor ``t`` made on the side stream (never waits for the gated stream)."""
        with torch.cuda.stream(self.side):
            out = t.to("cpu")
        return out


def pages_to_rows(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Token rows of whole pages, in page order."""
    return (pages.unsqueeze(1) * page_size + torch.arange(page_size)).reshape(-1)


def pick_rows(spec: PoolSpec, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host slots (3/4 of the pages, shuffled), backup source rows and load target rows on the device.

    Device rows come from :func:`~hicache_core.testing.make_device_buffers` buffers
    (``2 * capacity + page_size`` rows): page 0 is never used (a canary page), source
    and target pages are disjoint.  All int64 on the CPU, pinned when CUDA is present.
    """
    ps, pages = spec.page_size, spec.num_pages
    hp = torch.randperm(pages, generator=gen)[: max(1, pages * 3 // 4)]
    dp = torch.randperm(2 * pages, generator=gen) + 1
    k = hp.numel()
    rows = [pages_to_rows(p, ps) for p in (hp, dp[:k], dp[k : 2 * k])]
    pin = torch.cuda.is_available()
    h, src, dst = (r.pin_memory() if pin else r for r in rows)
    return h, src, dst


def rows_of(bufs: dict[str, list[torch.Tensor | None]], rows: torch.Tensor) -> dict[str, list[torch.Tensor | None]]:
    """CPU copies of ``rows`` of every device layer tensor (``None`` kept)."""
    return {k: [None if t is None else t[rows.to(t.device)].cpu() for t in lst] for k, lst in bufs.items()}


def resolve_or_skip(reg: Registry, spec: PoolSpec, layout: str, backend: str, strategy: str) -> None:
    """``pytest.skip`` (naming the reason) when ``strategy`` does not serve ``spec`` in ``layout``."""
    import pytest

    res, rejected = reg.try_resolve(spec, layout, backend, override=strategy)
    if res is None:
        pytest.skip(f"{strategy} does not serve {spec.describe()}: {rejected[-1][1] if rejected else '?'}")


def gated_round_trip(reg: Registry, case: Case, layout: str, backend: str, strategy: str, *,
                     pool_device: int = 1, current: int = 0, seed: int = 7) -> None:
    """Backup then layer-by-layer load on a pool of ``cuda:<pool_device>`` while ``cuda:<current>``
    is the current device and a gated non-default stream is current on the pool's device.

    Raises ``AssertionError`` when any byte moved before the gate opened (the work
    was not enqueued on the pool device's current stream), when the calls changed
    the current device or stream, when the gate expired (a call synchronised the
    host with the gated stream), or when the bytes differ from the ``reference``
    backend / the original rows after the gate opened.  Indices are pinned CPU int64
    (no index path needs a host synchronisation).
    """
    device = torch.device("cuda", pool_device)
    torch.cuda.set_device(current)
    gen = torch.Generator().manual_seed(seed)
    spec = case.build(device)
    dev = make_device_buffers(spec, case, gen)
    ref_dev = clone_buffers(dev)
    pool = HostKVPool(spec, layout, backend, dev, registry=reg, strategy=strategy, pin_memory=True, validate="shapes")
    ref = HostKVPool(spec, layout, "reference", ref_dev, registry=reg, strategy="core.reference", pin_memory=False)
    h, src, dst = pick_rows(spec, gen)
    layers = range(spec.layer_map.num_device_layers)
    # Warm up ungated (kernels compile, plans are built): back up and load the source rows onto
    # themselves, which leaves the device bytes as they were; the canaries are written afterwards.
    pool.backup_all_layers(h, src)
    for layer in layers:
        pool.load_layer(layer, h, src)
    for d in range(torch.cuda.device_count()):  # wherever the warm-up went, it is over (or has faulted)
        torch.cuda.synchronize(d)
    fill_canary(pool)
    fill_canary(ref)
    ref.backup_all_layers(h, src)
    original, dst_before = rows_of(dev, src), rows_of(dev, dst)
    canary_page = torch.arange(spec.page_size)
    canary_before = rows_of(dev, canary_page)
    torch.cuda.synchronize(device)
    stream = torch.cuda.Stream(device)
    gate = StreamGate(stream)
    with current_on(current, stream):
        gate.close()
        try:
            pool.backup_all_layers(h, src)
            loaded = [pool.load_layer(layer, h, dst) for layer in layers]
            state = (torch.cuda.current_device(), torch.cuda.current_stream(device))
            for d in range(torch.cuda.device_count()):  # everything not on the gated stream lands now
                if d != pool_device:
                    torch.cuda.synchronize(d)
            torch.cuda.default_stream(device).synchronize()
            early = [f"host buffer {n!r}" for n, t in pool.host_buffers.items()
                     if not bool((t.view(torch.uint8) == CANARY).all())]
            early += [f"device {k}[layer {i}]" for k, lst in dev.items() for i, t in enumerate(lst)
                      if t is not None and not torch.equal(gate.inspect(t)[dst].view(torch.uint8),
                                                           dst_before[k][i].view(torch.uint8))]
        finally:
            how = gate.open()
    torch.cuda.synchronize(device)
    assert how == "opened", (f"{strategy}: the gate {how} before the test opened it: a transfer call waited for "
                             "the gated stream on the host (host synchronisation)")
    assert state == (current, stream), (
        f"{strategy}: after the calls the current device / pool-device stream is {state[0]} / {state[1]}, "
        f"expected {current} / the gated stream (a device guard must restore what it changes)")
    assert not early, (f"{strategy}: bytes moved before the pool device's current stream reached the work "
                       f"(enqueued on another device or stream): {early}")
    assert loaded == [spec.layer_map.owns(x) for x in layers], f"{strategy}: load_layer returned {loaded}"
    for n, t in ref.host_buffers.items():
        assert torch.equal(pool.host_buffers[n].view(torch.uint8), t.view(torch.uint8)), (
            f"{strategy}: host buffer {n!r} differs from the reference backup")
    after, canary_after = rows_of(dev, dst), rows_of(dev, canary_page)
    for k, lst in after.items():
        for i, got in enumerate(lst):
            if got is None:
                continue
            want = original[k][i] if spec.component_map(_component_of(spec, k)).owns(i) else dst_before[k][i]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{strategy}: {k}[layer {i}] after load"
            assert torch.equal(canary_after[k][i].view(torch.uint8), canary_before[k][i].view(torch.uint8)), (
                f"{strategy}: {k}[layer {i}] canary page written")


def _component_of(spec: PoolSpec, name: str) -> str:
    """The component a device buffer name (a component or one of its parts) belongs to."""
    for comp in spec.components:
        if name == comp.name or any(p.name == name for p in comp.parts):
            return comp.name
    raise KeyError(name)


def remove_guards() -> int:
    """Replace :func:`hicache_core.kernel_support.on_pool_device` with a no-op wherever it was imported.

    For the test that proves :func:`gated_round_trip` catches a missing device guard
    (run in a child process: a kernel launched on the wrong device may fault).
    Returns how many modules were patched.
    """
    import sys

    from hicache_core import kernel_support

    original = kernel_support.on_pool_device
    patched = 0
    for mod in list(sys.modules.values()):
        if getattr(mod, "on_pool_device", None) is original:
            mod.on_pool_device = lambda device: contextlib.nullcontext()  # type: ignore[attr-defined]
            patched += 1
    return patched
