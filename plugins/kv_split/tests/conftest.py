"""Fixtures of the kv_split plugin tests: registries with configured kernel strategies, round trips."""

import os
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from hicache_core import HostKVPool, PoolSpec, StrategyInfo, create_registry, hookimpl  # noqa: E402
from hicache_core.testing.conformance import CANARY, clone_buffers, fill_canary  # noqa: E402
from hicache_kv_split.layout import LAYOUT  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class _ConfiguredKernel:
    """A local plugin registering ``KVSplitKernelStrategy(**kwargs)`` under its own io_backend name."""

    def __init__(self, backend: str, **kwargs):
        self.backend = backend
        self.kwargs = kwargs

    @hookimpl
    def hicache_register_strategies(self, register):
        from hicache_kv_split.strategy import KVSplitKernelStrategy

        kwargs = self.kwargs
        register(StrategyInfo(f"test.{self.backend}", self.backend, (LAYOUT.name,),
                              lambda: KVSplitKernelStrategy(**kwargs)))


def registry_with(backend: str, **kwargs):
    """The installed registry plus a kernel strategy configured with ``kwargs`` under io_backend ``backend``."""
    return create_registry(plugins=[(f"kv-split-{backend}", _ConfiguredKernel(backend, **kwargs))])


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1).view(torch.uint8) if t.dim() > 1 else t.view(torch.uint8)


def snapshot(bufs):
    """Byte copies of every device tensor (``None`` kept)."""
    return {k: [None if t is None else as_bytes(t).clone() for t in lst] for k, lst in bufs.items()}


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def round_trip(spec: PoolSpec, dev, io_backend: str, registry, h, src, dst, *, strategy=None):
    """Backup rows ``src`` to host slots ``h``, then load every layer id into rows ``dst``, through
    ``io_backend`` and through the reference backend on a clone of ``dev``.  Asserts bit-exact host
    buffers, bit-exact device buffers, the round trip, and that no other device row changed.
    Returns the pool under test."""
    dev_ref = clone_buffers(dev)
    pool = HostKVPool(spec, LAYOUT.name, io_backend, dev, registry=registry, strategy=strategy,
                      pin_memory=DEVICE.type == "cuda")
    ref = HostKVPool(spec, LAYOUT.name, "reference", dev_ref, registry=registry, strategy="core.reference")
    fill_canary(pool)
    fill_canary(ref)
    owned = spec.layer_map.device_layers
    before = snapshot(dev)
    pool.backup_all_layers(h, src)
    ref.backup_all_layers(h.cpu(), src.cpu())
    sync()
    for name, t in ref.host_buffers.items():
        assert torch.equal(pool.host_buffers[name].view(torch.uint8), t.view(torch.uint8)), f"backup: {name}"
    for layer in range(spec.layer_map.num_device_layers):
        assert pool.load_layer(layer, h, dst) == (layer in owned)
        ref.load_layer(layer, h.cpu(), dst.cpu())
    sync()
    after, after_ref = snapshot(dev), snapshot(dev_ref)
    d, s = dst.cpu().long(), src.cpu().long()
    for k, lst in after.items():
        for layer, rows in enumerate(lst):
            if rows is None:
                continue
            rows, old = rows.cpu(), before[k][layer].cpu()
            assert torch.equal(rows, after_ref[k][layer].cpu()), f"load: {k}[{layer}] differs from the reference"
            keep = torch.ones(rows.shape[0], dtype=torch.bool)
            if layer in owned:
                assert torch.equal(rows[d], old[s]), f"round trip: {k}[{layer}]"
                keep[d] = False
            assert torch.equal(rows[keep], old[keep]), f"stray write: {k}[{layer}]"
    return pool


@pytest.fixture
def kv():
    """Helpers shared by the kv_split tests."""
    return SimpleNamespace(DEVICE=DEVICE, LAYOUT=LAYOUT.name, registry_with=registry_with, round_trip=round_trip,
                           snapshot=snapshot, clone_buffers=clone_buffers, fill_canary=fill_canary, sync=sync,
                           as_bytes=as_bytes)
