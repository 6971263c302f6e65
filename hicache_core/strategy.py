"""The strategy contract: what a transfer implementation provides and receives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch

from .binding import PoolBinding
from .layout import Layout
from .spec import PoolSpec

__all__ = ["Strategy", "StrategyInfo", "DirectionalStrategy", "ANY_LAYOUT", "OPERATIONS"]

#: Layout wildcard: a strategy registered for it serves every layout whose
#: descriptor declares addressing (the generic backends do).
ANY_LAYOUT = "*"

#: The four operations every strategy serves, in matrix order.
OPERATIONS = ("backup_all_layers", "backup_layer", "load_layer", "load_all_layers")


@runtime_checkable
class Strategy(Protocol):
    """A way to move rows between device buffers and host buffers.

    Strategies are built once per pool (``StrategyInfo.factory()``), asked
    ``supports`` at resolution, ``prepare``-d once when the pool binds its
    buffers, then called for every transfer.

    ``backup`` moves device rows ``device_indices`` to host slots
    ``host_indices``; ``load`` moves the other way.  ``layer`` is a device layer
    id (the pool has checked that this rank owns it), or ``None`` for every owned
    layer.  Indices arrive as one-dimensional int32/int64 tensors of equal length,
    a non-zero multiple of ``page_size`` (the pool answers empty calls itself), on the CPU or the pool's device.  Their values are
    range-checked only when they live on the CPU (or with ``validate="full"``):
    a strategy must keep device-resident values in bounds itself (mask or check).
    Work is enqueued on the current stream of the pool's device; no host
    synchronisation.  Rows of other slots must stay untouched.

    Optional, outside the protocol: ``lane(binding, to_host)`` returning ``None`` or a callable
    ``(layer, host_indices, device_indices) -> bool``, a fast path for repeated calls.  A pool asks once
    per direction after ``prepare`` (never with ``validate="full"`` or ``"strict"``: those check every call); each transfer call of that direction then first calls the lane, before
    the pool's own checks, with the layer (an ``int`` exactly, never a subclass, or ``None`` for every
    layer) and the index tensors as the caller passed them (empty ones too: a lane returns ``False`` for them, as
    no earlier call received them).  ``True``: the lane has enqueued exactly what
    ``backup``/``load`` would, and the pool returns.  ``False``: nothing was enqueued; the pool checks and
    calls ``backup``/``load`` as usual.  A lane may return ``True`` only for a layer and index tensors
    (the same objects, unchanged) that an earlier ``backup``/``load`` call of its direction received, i.e.
    that the pool checked (:meth:`hicache_core.replay.Replays.lane` is the built-in one).
    """

    def supports(self, spec: PoolSpec, layout: Layout) -> str | None:
        """``None`` when this strategy can serve ``spec`` in ``layout``, else a one-line reason."""
        ...

    def prepare(self, binding: PoolBinding) -> None:
        """One-time set-up per pool (pointer tables, launch parameters)."""
        ...

    def backup(
        self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor, layer: int | None
    ) -> None: ...

    def load(
        self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor, layer: int | None
    ) -> None: ...


class DirectionalStrategy:
    """Convenience base for strategies whose backup and load are one routine.

    Subclasses implement :meth:`transfer`; ``backup`` and ``load`` call it with
    ``to_host`` set.  ``supports`` accepts everything and ``prepare`` does
    nothing unless overridden.
    """

    def supports(self, spec: PoolSpec, layout: Layout) -> str | None:
        return None

    def prepare(self, binding: PoolBinding) -> None:
        return None

    def backup(
        self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor, layer: int | None
    ) -> None:
        """Device rows ``device_indices`` of ``layer`` (``None``: every owned layer) -> host slots."""
        self.transfer(binding, host_indices, device_indices, layer, to_host=True)

    def load(
        self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor, layer: int | None
    ) -> None:
        """Host slots ``host_indices`` -> device rows ``device_indices`` of ``layer`` (``None``: all)."""
        self.transfer(binding, host_indices, device_indices, layer, to_host=False)

    def transfer(
        self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor, layer: int | None,
        *, to_host: bool,
    ) -> None:
        """Move rows in the direction ``to_host`` says; see :class:`Strategy` for the contract."""
        raise NotImplementedError


@dataclass(frozen=True)
class StrategyInfo:
    """A registration: which keys a strategy serves and how to build it.

    :param name: unique strategy name, ``<dist-ish prefix>.<backend>`` by convention.
    :param io_backend: the io_backend key (``kernel``, ``direct``, ``reference``...).
    :param layouts: layout names served, or ``(ANY_LAYOUT,)`` for generic strategies.
    :param sharded: which values of the ``sharded`` key are served.
    :param factory: callable returning a :class:`Strategy`, called with no
        arguments or with the pool's ``strategy_options`` as keywords; heavy
        imports (Triton) belong inside it, never at registration.
    :param description: one line for ``hicache plugins``.
    """

    name: str
    io_backend: str
    layouts: tuple[str, ...]
    factory: Callable[..., Strategy]
    sharded: tuple[bool, ...] = (False, True)
    description: str = ""

    @property
    def generic(self) -> bool:
        return ANY_LAYOUT in self.layouts
