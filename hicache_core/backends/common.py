"""Helpers shared by strategies: index placement and selected entries."""

from __future__ import annotations

from typing import Iterator

import torch

from ..binding import BoundSegment, PoolBinding

__all__ = ["as_long", "selected"]


def as_long(t: torch.Tensor, device: torch.device | str, copy: bool = False) -> torch.Tensor:
    """``t`` as int64 on ``device`` (no copy when it already is, unless ``copy``: then always a tensor of its own,
    which later writes to ``t`` do not reach).

    Copies *to* the CPU are blocking: the values are read right after, and a
    non-blocking device-to-pageable copy may not have landed yet.
    """
    target = torch.device(device)
    return t.to(device=target, dtype=torch.int64, non_blocking=target.type != "cpu", copy=copy)


def selected(binding: PoolBinding, layer: int | None) -> Iterator[tuple[BoundSegment, int]]:
    """``(segment, entry)`` pairs a transfer of ``layer`` (``None``: all) touches."""
    for seg in binding.segments:
        for e in seg.entries(layer):
            yield seg, e
