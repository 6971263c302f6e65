"""The benchmark's grid: the pool shapes it measures (:data:`SHAPES`), its operations and their constants, and the
row it reports (:class:`BenchRow`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..spec import LayerMap, PoolSpec


def _mla(layers: int, dtype: torch.dtype, row_bytes: int | None = None) -> Callable[[int, int, torch.device], PoolSpec]:
    def build(tokens: int, ps: int, device: torch.device) -> PoolSpec:
        return PoolSpec.mla(layer_map=LayerMap.unsharded(layers), kv_lora_rank=512, qk_rope_head_dim=64, dtype=dtype,
                            page_size=ps, capacity=tokens, row_bytes=row_bytes, device=device)
    return build


def _mha(layers: int, heads: int, dim: int) -> Callable[[int, int, torch.device], PoolSpec]:
    def build(tokens: int, ps: int, device: torch.device) -> PoolSpec:
        return PoolSpec.mha(layer_map=LayerMap.unsharded(layers), head_num=heads, head_dim=dim, dtype=torch.bfloat16,
                            page_size=ps, capacity=tokens, device=device)
    return build


#: name -> spec builder(tokens, page_size, device)
SHAPES: dict[str, Callable[[int, int, torch.device], PoolSpec]] = {
    "mla61x576-bf16": _mla(61, torch.bfloat16),
    "mla61x576-fp8": _mla(61, torch.uint8),
    "mla61x656-fp8": _mla(61, torch.uint8, 656),
    "mha80x8x128-bf16": _mha(80, 8, 128),
    "mha80x4x128-bf16": _mha(80, 4, 128),  # 1 KiB k and v rows (4 KV heads per rank)
    "mha32x8x128-bf16": _mha(32, 8, 128),
}

#: ``direct`` submits one copy per contiguous run; above this many per call the
#: measurement would take minutes per configuration (small pages), so it is skipped.
MAX_DIRECT_COPIES = 200_000

OPS = ("backup_all_layers", "backup_layer", "load_layer", "load_all_layers", "load_burst", "backup_burst")
#: Operations whose GEMM slowdown ``--gemm`` measures (the ones a forward pass overlaps; ``backup_burst``: one-layer
#: backups of every owned layer back to back, as a layer-by-layer write-back, e.g. a layer-sharded one, issues them).
GEMM_OPS = ("backup_all_layers", "backup_burst", "load_burst")
#: ``--hbm``: ops whose ratio beside the reduction is measured one call at a time (each call lone), without the
#: reduction's slowdown (one call is too short to cover its timing windows).
HBM_LONE_OPS = ("load_layer",)
#: Bytes one call of ``--hbm``'s memory-bound neighbour reads (:func:`_hbm_reader`).
HBM_READ_BYTES = 2 << 30
#: ``direct`` variants: strategy options per label (``--direct-variants``).
DIRECT_VARIANTS = {"auto": {"staging": "auto"}, "never": {"staging": "never"}, "always": {"staging": "always"},
                   "unpitched": {"staging": "auto", "pitched": "never"}}
#: Device layer placement of the benchmark's pools (see :func:`_device_buffers`).
ENV_PLACEMENT = "HICACHE_BENCH_PLACEMENT"


@dataclass
class BenchRow:
    shape: str
    layout: str
    io_backend: str
    strategy: str
    page_size: int
    tokens: int
    programs: int | None
    op: str
    bytes: int
    ms: float
    gbps: float
    memcpy_gbps: float
    ratio: float
    host_us: float
    gemm_slowdown: float | None = None
    variant: str = ""
    served_by: str = ""
    #: ``--hbm``: the slowdown of a memory-bound reduction (:func:`_hbm_reader`) while the op runs beside it
    hbm_slowdown: float | None = None
    #: ``--hbm``: the op's own ratio to memcpy while that reduction runs without pause beside it
    hbm_ratio: float | None = None
    #: ``--gemm``: the op's own ratio to memcpy while bf16 GEMMs run without pause beside it (a kernel whose programs
    #: leave the GEMM its SMs waits for them; the copy engine does not)
    gemm_ratio: float | None = None
    #: the most programs one kernel launch of the timed call ran (``programs`` is the budget asked for, ``None`` for
    #: the strategy's default); ``None`` where the serving strategy launched no row kernel (e.g. the copy engine)
    launched_programs: int | None = None


#: Untimed calls before a row's timed ones.
WARMUP = 3
#: Rounds an operation's timed calls are split into (``--rounds``), the targets of a cell's layout taking turns in
#: each: the host's speed drifts over seconds, so targets timed one after another were compared at different speeds
#: (identical kernel routes measured up to 5.7 points apart in the peer benchmark, docs/perf/runs.md, 2026-12-06);
#: in turns, every target's calls sample the whole window (within 0.5 points there).
DEFAULT_ROUNDS = 3
