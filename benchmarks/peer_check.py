"""Bit-exact pre-check of a benchmark target against hicache's ``reference`` backend.

A *target* is anything with ``host_buffers`` (name -> host tensor, as a layout plans
them), ``backup_all_layers(h, s)`` and ``load_layer(layer, h, d)``, optionally
``ops_supported``: a :class:`~hicache_core.pool.HostKVPool`, or a peer adapter
(``peer_sglang``, ``peer_lmcache``) working on a pool's buffers.  The *truth* is a
``reference`` pool of the same spec and layout, over the same device tensors, with host
buffers of its own.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

__all__ = ["PeerMismatch", "ALL_OPS", "check_bit_exact", "sync"]

#: Operations a target may support (``load_burst`` is ``load_layer`` over every layer;
#: ``load_burst_new`` the same with index tensors it has not seen, as each new batch brings;
#: ``backup_new`` is ``backup_all_layers`` with such tensors).
ALL_OPS = ("backup_all_layers", "load_layer", "load_burst", "load_burst_new", "backup_new")


class PeerMismatch(AssertionError):
    """A target's bytes differ from the reference backend's; nothing of it is timed."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bytes(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8).to(device)


def _first_difference(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> str | None:
    """``None`` when equal, else ``'k of n bytes differ (first at byte i)'``."""
    x, y = _bytes(a, device), _bytes(b, device)
    if x.shape == y.shape and torch.equal(x, y):
        return None
    if x.shape != y.shape:
        return f"sizes differ ({x.numel()} vs {y.numel()} bytes)"
    ne = (x != y).nonzero()
    return f"{ne.numel()} of {x.numel()} bytes differ (first at byte {int(ne[0])})"


def _randomize(t: torch.Tensor, device: torch.device) -> None:
    t.view(-1).view(torch.uint8).copy_(torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8,
                                                     device=device))


def check_bit_exact(
    target: Any,
    truth: Any,
    device_buffers: Mapping[str, Sequence[torch.Tensor | None]],
    host_indices: torch.Tensor,
    device_src: torch.Tensor,
    device_dst: torch.Tensor,
    *,
    label: str,
) -> None:
    """Raise :class:`PeerMismatch` unless ``target`` moves exactly the bytes ``truth`` moves.

    Backup: both host buffer sets start from the same random bytes, each side backs up
    rows ``device_src`` of every layer into slots ``host_indices``; every host byte must
    match (untouched slots included).  Loads: for each layer, the target rows
    ``device_dst`` are scribbled with random bytes, the target loads, the scribbled state
    is restored and the truth loads; the whole device layer must match.  ``device_src``
    and ``device_dst`` must be disjoint.  Operations outside ``target.ops_supported``
    are not checked.
    """
    ops = getattr(target, "ops_supported", ALL_OPS)
    host, want = target.host_buffers, truth.host_buffers
    device = next(t for ts in device_buffers.values() for t in ts if t is not None).device
    for name, buf in host.items():
        if "backup_all_layers" in ops:
            _randomize(buf, device)
        want[name].copy_(buf)
    if "backup_all_layers" in ops:
        target.backup_all_layers(host_indices, device_src)
        truth.backup_all_layers(host_indices, device_src)
        sync(device)
        for name, buf in host.items():
            diff = _first_difference(buf, want[name], device)
            if diff:
                raise PeerMismatch(f"{label}: backup_all_layers wrote host buffer {name!r} differently from the "
                                   f"reference backend: {diff}")
    if "load_layer" not in ops:
        return
    layers = max(len(ts) for ts in device_buffers.values())
    for layer in range(layers):
        tensors = {n: t for n, ts in device_buffers.items() if (t := ts[layer]) is not None}
        for t in tensors.values():
            _randomize_rows(t, device_dst)
        before = {n: t.clone() for n, t in tensors.items()}
        target.load_layer(layer, host_indices, device_dst)
        sync(device)
        got = {n: t.clone() for n, t in tensors.items()}
        for n, t in tensors.items():
            t.copy_(before[n])
        truth.load_layer(layer, host_indices, device_dst)
        sync(device)
        for n, t in tensors.items():
            diff = _first_difference(got[n], t, device)
            if diff:
                raise PeerMismatch(f"{label}: load_layer({layer}) wrote device {n!r} differently from the "
                                   f"reference backend: {diff}")


def _randomize_rows(t: torch.Tensor, rows: torch.Tensor) -> None:
    flat = t.view(t.shape[0], -1)
    nbytes = flat.shape[1] * flat.element_size()
    noise = torch.randint(0, 256, (rows.numel(), nbytes), dtype=torch.uint8, device=t.device)
    flat[rows.to(t.device)] = noise.view(flat.dtype)
