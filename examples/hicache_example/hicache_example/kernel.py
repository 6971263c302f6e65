"""``example.kernel``: one Triton launch per (segment, layer) copying whole row bytes between pools.

Deliberately simple and written from scratch (byte copies, one launch per
layer and segment), to show the bare strategy contract.  A layout whose rows
are whole and contiguous gets word-sized accesses, one launch per group of
layers, persistent SM budgets and per-direction tuning from the core's
row-copy toolkit instead (``hicache_core.rowcopy.RowKernelStrategy`` with a
kernel built from ``hicache_core.kernel_lib``), as the plugins in the hicache
tree do.  Device-resident index values are not range-checked by the pool, so
the kernel masks rows whose host slot or device row is out of range.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hicache_core import DirectionalStrategy, Layout, PoolBinding, PoolSpec
from hicache_core.kernel_support import kernel_unsupported_reason, on_pool_device, require_pinned, transfer_indices
from hicache_core.launch import Launcher

__all__ = ["PackedKernel"]

ROWS = 16  # index rows per program
COLS = 128  # bytes per inner step


@triton.jit
def _copy_rows(host_ptr, dev_ptr, host_idx, dev_idx, n, host_slots, host_stride, dev_rows, dev_stride, row_bytes,
               ROWS: tl.constexpr, COLS: tl.constexpr, TO_HOST: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    in_batch = r < n
    h = tl.load(host_idx + r, mask=in_batch, other=-1).to(tl.int64)
    d = tl.load(dev_idx + r, mask=in_batch, other=-1).to(tl.int64)
    ok = in_batch & (h >= 0) & (h < host_slots) & (d >= 0) & (d < dev_rows)
    for start in range(0, row_bytes, COLS):
        c = start + tl.arange(0, COLS)
        m = ok[:, None] & (c < row_bytes)[None, :]
        hp = host_ptr + h[:, None] * host_stride + c[None, :]
        dp = dev_ptr + d[:, None] * dev_stride + c[None, :]
        if TO_HOST:
            tl.store(hp, tl.load(dp, mask=m), mask=m)
        else:
            tl.store(dp, tl.load(hp, mask=m), mask=m)


class PackedKernel(DirectionalStrategy):
    """Triton strategy for ``example_packed``; ``programs`` is accepted (as ``strategy_options``) and ignored."""

    def __init__(self, programs: int | None = None) -> None:
        self._launch = Launcher(_copy_rows)

    def supports(self, spec: PoolSpec, layout: Layout) -> str | None:
        return kernel_unsupported_reason(spec)

    def prepare(self, binding: PoolBinding) -> None:
        require_pinned(binding, "example.kernel")
        # (host layer slot view [S, token bytes] at the segment's offset, device rows, stride) per segment and entry
        plan = []
        for seg in binding.segments:
            a = seg.segment.addressing
            for i in range(len(seg.device_layers)):
                host = seg.host_flat[seg.host_layers[i] * a.layer + a.offset:]
                plan.append((seg, i, host, seg.device_rows[i], a.token))
        binding.scratch["example.kernel"] = plan

    def transfer(self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor,
                 layer: int | None, *, to_host: bool) -> None:
        h, d = transfer_indices(binding, host_indices, device_indices)
        n = h.numel()
        grid = triton.cdiv(n, ROWS)
        with on_pool_device(binding.device):
            for seg, i, host, dev, token in binding.scratch["example.kernel"]:
                if layer is not None and seg.device_layers[i] != layer:
                    continue
                # host slot s of this layer starts at host + s * token; the segment's ``width`` bytes are there
                args = (host, dev, h, d, n, binding.spec.capacity, token, dev.shape[0], dev.stride(0), seg.width,
                        ROWS, COLS, to_host)
                self._launch(grid, args, num_warps=4)
