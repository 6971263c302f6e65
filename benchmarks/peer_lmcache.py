"""LMCache's multi-layer CUDA transfer kernel as a benchmark peer, on hicache's own buffers.

LMCache keeps a chunk of tokens in one contiguous memory object, ``[kv, L, T, row]``
(``kv`` = 1 for MLA, 2 for K and V), and gathers/scatters device rows with one kernel
over all layers (``multi_layer_kv_transfer_unilateral``: the entry its SGLang connector
calls, with SGLang's device formats ``NL_X_NBBS_ONE_HS`` for MLA and
``TWO_X_NL_X_NBBS_NH_HS`` for MHA).  That memory object is our ``layer_first`` host
buffer with host slots ``0..T-1`` in order, so the peer runs on our pinned
``layer_first`` buffers with contiguous host indices (MHA: ``k`` and ``v`` as the two
halves of one ``[2, L, S, row]`` tensor) and on our device tensors.  Its grid covers
every token (no SM budget).  A per-layer load is the same kernel given one layer.

Only the compiled extension is needed: ``lmcache/c_ops*.so`` (0.5.0-0.5.3) or
``lmcache/cuda_ops*.so`` (0.5.4+) on ``sys.path``, imported as a namespace package so
that LMCache's own ``__init__`` (and its dependencies) never runs.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from hicache_core.spec import PoolSpec

#: Extension module names, newest first.
MODULES = ("lmcache.cuda_ops", "lmcache.c_ops")


def load_ops() -> tuple[Any, str | None]:
    """LMCache's CUDA ops module, or ``None`` and every import error."""
    errors = []
    for name in MODULES:
        try:
            return importlib.import_module(name), None
        except Exception as e:  # noqa: BLE001
            errors.append(f"import {name}: {type(e).__name__}: {e}")
    return None, "; ".join(errors)


def fused_host(spec: PoolSpec, pin: bool) -> dict[str, torch.Tensor]:
    """``layer_first`` host buffers as LMCache's memory object: one ``[kv, L, S, row]`` tensor, split per component."""
    comps = spec.components
    L = len(spec.layer_map.device_layers)
    items = comps[0].row_bytes // comps[0].itemsize
    whole = torch.empty((len(comps), L, spec.capacity, items), dtype=comps[0].dtype, pin_memory=pin)
    return {c.name: whole[i] for i, c in enumerate(comps)}


class LmcacheMultiLayer:
    """``multi_layer_kv_transfer_unilateral`` over all layers (or one) on shared buffers."""

    ops_supported: tuple[str, ...] = ("backup_all_layers", "load_layer", "load_burst", "load_burst_new", "backup_new")
    contiguous_host = True
    note = "LMCache: host slots contiguous (its memory object); grid over every token, no SM budget"

    def __init__(self, ops: Any, spec: PoolSpec, layout: str, dev: dict[str, list[torch.Tensor | None]],
                 host: dict[str, torch.Tensor]) -> None:
        if ops is None:
            raise RuntimeError("LMCache's CUDA ops are not importable")
        if layout != "layer_first":
            raise ValueError("LMCache's memory object is [kv, L, T, row]: our layer_first layout")
        names = [c.name for c in spec.components]
        first = host[names[0]]
        if len(names) == 2 and host[names[1]].data_ptr() != first.data_ptr() + first.nbytes:
            raise ValueError("MHA host k and v must be the halves of one [2, L, S, row] tensor (peer_lmcache.fused_host)")
        whole = first.as_strided((len(names), *first.shape), (first.numel(), *first.stride()))
        # One layer of a [2, L, T, row] object is not contiguous; the kernel addresses the
        # object by its shape, so per-layer MHA loads are not offered.
        self.ops_supported = self.ops_supported if len(names) == 1 else ("backup_all_layers",)
        self.ops, self.whole, self.host_buffers = ops, whole, host
        self.fmt = ops.EngineKVFormat.NL_X_NBBS_ONE_HS if len(names) == 1 else ops.EngineKVFormat.TWO_X_NL_X_NBBS_NH_HS
        layers = [[t for t in dev[n] if t is not None] for n in names]
        self.rows = layers[0][0].shape[0]
        self.device = spec.device
        self.ptrs = torch.tensor([t.data_ptr() for group in layers for t in group], dtype=torch.int64, device=self.device)
        self.layer_ptrs = [torch.tensor([g[i].data_ptr() for g in layers], dtype=torch.int64, device=self.device)
                           for i in range(len(layers[0]))]

    def ctas(self, op: str) -> None:
        return None  # one thread per element over all tokens: no budget

    def _run(self, kv: torch.Tensor, ptrs: torch.Tensor, slots: torch.Tensor, to_host: bool) -> None:
        direction = self.ops.TransferDirection.D2H if to_host else self.ops.TransferDirection.H2D
        self.ops.multi_layer_kv_transfer_unilateral(kv, ptrs, slots, self.device, self.rows, direction, self.fmt)

    def backup_all_layers(self, h: torch.Tensor, s: torch.Tensor) -> None:
        self._run(self.whole, self.ptrs, s, True)

    def load_layer(self, layer: int, h: torch.Tensor, d: torch.Tensor) -> None:
        self._run(self.whole[:, layer : layer + 1], self.layer_ptrs[layer], d, False)
