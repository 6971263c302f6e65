"""``fakedma``: a vendor strategy that records every call and moves bytes with the core's DirectStrategy."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache_core import Layout, PoolBinding, PoolSpec
from hicache_core.backends.direct import DirectStrategy

__all__ = ["Call", "FakeDmaStrategy"]


@dataclass(frozen=True)
class Call:
    """One call the strategy received: ``op`` is ``prepare``, ``backup`` or ``load``."""

    op: str
    layer: int | None = None
    tokens: int = 0


class FakeDmaStrategy:
    """Delegates to :class:`DirectStrategy`; ``calls`` lists what it was asked to do, in order."""

    #: the rejections the conformance kit may see (any other rejection of a kit case fails)
    conformance_rejects = (r"^fakedma moves 1- and 2-byte element pools only",)

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._inner = DirectStrategy()

    def supports(self, spec: PoolSpec, layout: Layout) -> str | None:
        wide = [c.name for c in spec.components if c.dtype == torch.float32]
        if wide:
            return f"fakedma moves 1- and 2-byte element pools only; components {wide} are float32"
        return self._inner.supports(spec, layout)

    def prepare(self, binding: PoolBinding) -> None:
        self.calls.append(Call("prepare"))
        self._inner.prepare(binding)

    def backup(self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor,
               layer: int | None) -> None:
        self.calls.append(Call("backup", layer, host_indices.numel()))
        self._inner.backup(binding, host_indices, device_indices, layer)

    def load(self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor,
             layer: int | None) -> None:
        self.calls.append(Call("load", layer, host_indices.numel()))
        self._inner.load(binding, host_indices, device_indices, layer)
