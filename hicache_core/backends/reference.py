"""``reference``: plain torch indexing on any device.  The oracle every other strategy is checked against."""

from __future__ import annotations

import torch

from ..binding import PoolBinding
from ..errors import IndexRangeError
from ..layout import Layout
from ..spec import PoolSpec
from .common import as_long, selected

__all__ = ["ReferenceStrategy"]


class ReferenceStrategy:
    """Gathers rows with advanced indexing and scatters them through the strided host view.

    Slow and synchronous on CUDA (rows travel through pageable memory); use it
    to check, not to serve.
    """

    def supports(self, spec: PoolSpec, layout: Layout) -> str | None:
        return None

    def prepare(self, binding: PoolBinding) -> None:
        return None

    @staticmethod
    def _indices(binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Host (page, offset) pairs and device rows, range-checked (the oracle may synchronise)."""
        h = as_long(host_indices, "cpu")
        d = as_long(device_indices, binding.device, copy=True)  # its own: a segment's copy may overwrite the caller's
        rows = binding.device_rows
        cap = binding.spec.capacity
        if h.numel() and (int(h.min()) < 0 or int(h.max()) >= cap or int(d.min()) < 0 or int(d.max()) >= rows):
            rng = f"in 0..{rows - 1}" if rows else "nowhere (the shortest device layer has no rows)"
            raise IndexRangeError(
                f"reference: host_indices must lie in 0..{cap - 1} and device_indices {rng}; nothing was moved"
            )
        ps = binding.spec.page_size
        return h // ps, h % ps, d

    def backup(self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor, layer: int | None) -> None:
        pages, offs, d = self._indices(binding, host_indices, device_indices)
        for seg, e in selected(binding, layer):
            rows = seg.device_rows[e][d].to("cpu")
            view = seg.host_view[seg.host_layers[e]]
            view[pages, offs] = rows.view(rows.shape[0], view.shape[2], view.shape[3])

    def load(self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor, layer: int | None) -> None:
        pages, offs, d = self._indices(binding, host_indices, device_indices)
        for seg, e in selected(binding, layer):
            data = seg.host_view[seg.host_layers[e]][pages, offs]
            seg.device_rows[e][d] = data.reshape(data.shape[0], seg.width).to(binding.device)
