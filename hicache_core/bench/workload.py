"""The benchmark's data: random device layers (:func:`_device_buffers`), random host and device pages
(:func:`_indices`), the probes' common set-up (:func:`_workload`), and the bit-exact round-trip check every pool passes
before it is timed (:func:`_check`)."""

from __future__ import annotations

import os
from typing import Iterable

import torch

from ..pool import HostKVPool
from ..spec import PoolSpec
from ..testing.conformance import DEVICE_PLACEMENTS
from .shapes import ENV_PLACEMENT, SHAPES


def _device_buffers(spec: PoolSpec, rows: int, placement: str | None = None) -> dict[str, list[torch.Tensor | None]]:
    """Random per-layer device tensors; ``placement`` (default ``$HICACHE_BENCH_PLACEMENT`` or
    ``separate``): one allocation per layer as SGLang's pools make them, or the layers of one
    allocation at ascending / descending addresses (``one-allocation``, ``one-allocation-descending``)."""
    placement = placement or os.environ.get(ENV_PLACEMENT, "").strip() or "separate"
    if placement not in DEVICE_PLACEMENTS:
        raise ValueError(f"{ENV_PLACEMENT}={placement!r}: use one of {', '.join(DEVICE_PLACEMENTS)}")
    out: dict[str, list[torch.Tensor | None]] = {}
    layers = spec.layer_map.num_device_layers
    for comp in spec.components:
        items = comp.row_bytes // comp.itemsize
        if placement == "separate":
            raws = [torch.randint(0, 256, (rows, comp.row_bytes), dtype=torch.uint8, device=spec.device)
                    for _ in range(layers)]
        else:
            one = torch.randint(0, 256, (layers, rows, comp.row_bytes), dtype=torch.uint8, device=spec.device)
            raws = [one[k] for k in (range(layers) if placement == "one-allocation" else reversed(range(layers)))]
        out[comp.name] = [r.view(comp.dtype).view(rows, items) for r in raws]
    return out


def _workload(shape: str, tokens: int = 4096, page_size: int = 64,
              seed: int = 0) -> tuple[PoolSpec, dict[str, list[torch.Tensor | None]], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The probes' common set-up: a CUDA ``spec`` of :data:`SHAPES` ``shape``, random device layers holding
    2x the tokens, and :func:`_indices` (host slots, backup source rows, load target rows)."""
    spec = SHAPES[shape](tokens, page_size, torch.device("cuda"))
    dev = _device_buffers(spec, 2 * tokens + page_size)
    h, s, d = _indices(spec, torch.Generator().manual_seed(seed))
    return spec, dev, h, s, d


def _indices(spec: PoolSpec, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random host pages, random device pages for backup, other random device pages for load (on the GPU)."""
    ps, pages = spec.page_size, spec.num_pages
    offs = torch.arange(ps)
    hp = torch.randperm(pages, generator=gen)
    dp = torch.randperm(2 * pages, generator=gen)
    ex = lambda p: (p.unsqueeze(1) * ps + offs).reshape(-1)  # noqa: E731
    return ex(hp).cuda(), ex(dp[:pages]).cuda(), ex(dp[pages:]).cuda()


def _scramble(pool: HostKVPool, dev: dict[str, list[torch.Tensor | None]], s: torch.Tensor, d: torch.Tensor) -> None:
    """Make a round trip's result unmistakable: the host buffers zeroed and every byte of the load target rows ``d``
    the complement of the source rows ``s``.  Pools of one grid cell share the device and host buffers, so without
    this an earlier pool's round trip (``d`` already equal to ``s``, the host already holding ``s``) would let a
    later strategy that moves nothing pass."""
    for buf in pool.host_buffers.values():
        buf.zero_()
    for lst in dev.values():
        for t in lst:
            if t is not None:
                raw = t.view(torch.uint8)
                raw[d] = raw[s] ^ 0xFF


def _compare(pool: HostKVPool, dev: dict[str, list[torch.Tensor | None]], s: torch.Tensor, d: torch.Tensor,
             what: str) -> None:
    torch.cuda.synchronize()
    for name, lst in dev.items():
        for i, t in enumerate(lst):
            if t is not None and not torch.equal(t[s].view(torch.uint8), t[d].view(torch.uint8)):
                raise AssertionError(f"bench data check failed: {pool.strategy_name} {what} {name}[{i}]")


def _check(pool: HostKVPool, dev: dict[str, list[torch.Tensor | None]], h: torch.Tensor, s: torch.Tensor,
           d: torch.Tensor, ops: Iterable[str] = ()) -> None:
    """Round trip ``s`` -> host ``h`` -> ``d`` bit-exact: ``backup_all_layers`` then ``load_layer`` of every
    layer, and for the other ``ops`` to be timed (``backup_layer`` and ``backup_burst``, ``load_all_layers``) their own
    round trip,
    each from scrambled buffers (:func:`_scramble`)."""
    layers = pool.spec.layer_map.device_layers

    def backup_all() -> None:
        pool.backup_all_layers(h, s)

    def backup_each() -> None:
        for layer in layers:
            pool.backup_layer(layer, h, s)

    def load_each() -> None:
        for layer in layers:
            pool.load_layer(layer, h, d)

    trips = [("backup_all_layers", backup_all, "load_layer", load_each)]
    if "load_all_layers" in ops:
        trips.append(("backup_all_layers", backup_all, "load_all_layers", lambda: pool.load_all_layers(h, d)))
    if "backup_layer" in ops or "backup_burst" in ops:
        trips.append(("backup_layer", backup_each, "load_layer", load_each))
    for backup_name, backup, load_name, load in trips:
        _scramble(pool, dev, s, d)
        backup()
        load()
        _compare(pool, dev, s, d, f"{backup_name} + {load_name}")
