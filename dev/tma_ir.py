"""What Triton made of the TMA load kernel (hicache's, per layout, and the probe's): buffers, copies, registers.

Usage (CUDA, Hopper): ``python dev/tma_ir.py [LAYOUT ...]`` (default: layer_first page_first_direct).  Writes
each kernel's TTGIR and PTX to ``$OUT`` (default /tmp) and prints, per kernel, shared memory, registers and
spills and counts of the TTGIR operations that show pipelining (TMA copies, barriers, async copies).
"""

from __future__ import annotations

import os
import re
import sys

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

import hicache_core.kernel_lib as kl
from hicache_core import HostKVPool, LayerMap, PoolSpec
from hicache_core.rowcopy import _LAUNCHERS

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from tma_load_probe import _tma_strided_load  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
OPS = ("async_tma_copy_global_to_local", "local_alloc", "barrier_expect", "wait_barrier", "async_copy_global_to_local",
       "async_wait", "scf.for", "scf.if")


def summary(name: str, compiled) -> None:
    ttgir = compiled.asm["ttgir"]
    with open(os.path.join(OUT, f"{name}.ttgir"), "w") as f:
        f.write(ttgir)
    with open(os.path.join(OUT, f"{name}.ptx"), "w") as f:
        f.write(compiled.asm.get("ptx", ""))
    print(f"== {name}: shared {compiled.metadata.shared}, regs {getattr(compiled, 'n_regs', '?')}, "
          f"spills {getattr(compiled, 'n_spills', '?')}")
    for op in OPS:
        print(f"  {op}: {len(re.findall(re.escape(op), ttgir))}")
    for m in sorted(set(re.findall(r"!ttg\.memdesc<[^,]*,", ttgir))):
        print("    ", m)


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                        page_size=64, capacity=4096, device=torch.device("cuda"))
    dev = {"kv": [torch.zeros(8192, 576, dtype=torch.bfloat16, device="cuda") for _ in range(2)]}
    idx = torch.arange(4096, device="cuda")
    for layout in sys.argv[1:] or ["layer_first", "page_first_direct"]:
        pool = HostKVPool(spec, layout, "kernel", dev, strategy_options={"tma": True})
        for _ in range(2):  # the first launch compiles, the second goes through the kept handle
            pool.load_layer(0, idx, idx)
        torch.cuda.synchronize()
        launcher = _LAUNCHERS[kl.PAGED_TMA_LOAD]
        for i, compiled in enumerate(launcher._compiled.values()):
            summary(f"hicache-{layout}-{i}", compiled)
        launcher._compiled.clear()
    host = torch.zeros(8192, 61, 144, dtype=torch.int64).pin_memory()
    dst = torch.zeros(8192, 144, dtype=torch.int64, device="cuda")
    ha = TensorDescriptor(host[:, 30, :128], [8192, 128], [61 * 144, 1], [32, 128])
    hb = TensorDescriptor(host[:, 30, 128:], [8192, 16], [61 * 144, 1], [32, 16])
    starts = (torch.arange(64) * 64).to(torch.int32).cuda()
    compiled = _tma_strided_load[(4,)](ha, hb, dst, starts, starts.long(), 128, TOK=32, PER_PAGE=2, STAGES=4,
                                       num_warps=4)
    torch.cuda.synchronize()
    summary("probe-page_first", compiled)


if __name__ == "__main__":
    main()
