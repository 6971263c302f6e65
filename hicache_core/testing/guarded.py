"""A strategy's pool beside the reference pool on the same bytes, host buffers between canary guards.

For tests of one io_backend's paths (the kit's :func:`~hicache_core.testing.conformance.check_strategy`
covers whole cases): build both pools with :func:`guarded_pools`, call the strategy under test and the
reference with the same indices, then :func:`assert_same_device` and :func:`guards_intact`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ..pool import HostKVPool
from ..registry import Registry
from ..spec import PoolSpec
from .conformance import CANARY

__all__ = ["GuardedPools", "guarded_pools", "assert_same_device", "guards_intact"]


@dataclass
class GuardedPools:
    """``pool`` (the io_backend under test) and ``ref`` (``reference``) on copies of the same random bytes;
    ``big``: each host buffer's whole allocation (canary ``guard`` bytes on both sides); ``dev_big``: each
    device layer's allocation (canary ``dev_guard`` bytes on both sides)."""

    pool: HostKVPool
    ref: HostKVPool
    big: dict[str, torch.Tensor]
    dev: dict[str, list[torch.Tensor | None]]
    ref_dev: dict[str, list[torch.Tensor | None]]
    guard: int
    dev_big: list[torch.Tensor]
    dev_guard: int


def guarded_pools(registry: Registry, layout: str, io_backend: str, spec: PoolSpec, gen: torch.Generator, *,
                  pin: bool, guard: int = 0, lead: int = 0, dev_guard: int = 0,
                  strategy_options: Mapping[str, Any] | None = None) -> GuardedPools:
    """Random device rows (2 x capacity per layer, between ``dev_guard`` canary bytes of their allocation: a
    multiple of 16 keeps the rows aligned) and host buffers starting ``lead`` bytes after ``guard`` canary bytes
    of their allocation (``pin``: pinned), for a pool of ``io_backend`` and the reference pool."""
    rows = 2 * spec.capacity
    dev: dict[str, list[torch.Tensor | None]] = {}
    ref_dev: dict[str, list[torch.Tensor | None]] = {}
    dev_big: list[torch.Tensor] = []
    for comp in spec.components:
        ts = []
        for _ in range(spec.layer_map.num_device_layers):
            whole = torch.full((rows * comp.row_bytes + 2 * dev_guard,), CANARY, dtype=torch.uint8,
                               device=spec.device)
            rows_view = whole[dev_guard:dev_guard + rows * comp.row_bytes].view(rows, comp.row_bytes)
            rows_view.copy_(torch.randint(0, 256, (rows, comp.row_bytes), dtype=torch.uint8, generator=gen))
            dev_big.append(whole)
            ts.append(rows_view)
        dev[comp.name] = [t.view(comp.dtype) for t in ts]
        ref_dev[comp.name] = [t.clone().view(comp.dtype) for t in ts]
    big, host = {}, {}
    for b in registry.layout(layout).plan(spec).buffers:
        big[b.name] = torch.full((b.nbytes + 2 * guard + lead,), CANARY, dtype=torch.uint8, pin_memory=pin)
        host[b.name] = big[b.name][guard + lead:guard + lead + b.nbytes].view(b.dtype).view(b.shape)
        host[b.name].view(torch.uint8).random_(0, 256, generator=gen)
    pool = HostKVPool(spec, layout, io_backend, dev, host_buffers=host, registry=registry,
                      strategy_options=strategy_options)
    ref = HostKVPool(spec, layout, "reference", ref_dev, registry=registry)
    for name, t in ref.host_buffers.items():
        t.view(torch.uint8).copy_(host[name].view(torch.uint8))
    return GuardedPools(pool, ref, big, dev, ref_dev, guard, dev_big, dev_guard)


def assert_same_device(dev: Mapping[str, list[torch.Tensor | None]],
                       ref_dev: Mapping[str, list[torch.Tensor | None]]) -> None:
    """Every device layer byte-equal to the reference's (the message names the component and layer)."""
    for name in ref_dev:
        for i, (a, b) in enumerate(zip(dev[name], ref_dev[name])):
            if a is None or b is None:
                assert a is None and b is None, f"{name}[{i}]"
                continue
            assert torch.equal(a.view(torch.uint8).cpu(), b.view(torch.uint8).cpu()), f"{name}[{i}]"


def guards_intact(p: GuardedPools) -> bool:
    """Whether the canary bytes on both sides of every host buffer and every device layer are untouched."""
    def intact(b: torch.Tensor, g: int) -> bool:
        return bool((b[:g] == CANARY).all()) and bool((b[len(b) - g:] == CANARY).all())
    return all(intact(b, p.guard) for b in p.big.values()) and all(intact(b, p.dev_guard) for b in p.dev_big)
