"""Run one backup of all layers and one per-layer load through a kernel strategy, for Nsight Compute.

Usage (GPU)::

    ncu --target-processes all -k regex:KERNEL --launch-skip 4 --launch-count 2 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \\
        python benchmarks/profile_kernel.py --layout layer_first --options '{"programs": 8}'

Two warm-up rounds (compilation, first-touch) come first, so ``--launch-skip`` steps over them.
"""

from __future__ import annotations

import argparse
import json

import torch

from hicache_core.bench import SHAPES, _device_buffers, _indices
from hicache_core.pool import HostKVPool

try:
    from benchmarks.needs_cuda import require_cuda
except ImportError:  # run as a script: its folder, benchmarks/, is on sys.path
    from needs_cuda import require_cuda


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="layer_first")
    ap.add_argument("--shape", default="mla61x576-bf16", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--options", default="{}", help="strategy options as JSON")
    args = ap.parse_args()
    require_cuda(__file__)
    spec = SHAPES[args.shape](args.tokens, args.page_size, torch.device("cuda"))
    dev = _device_buffers(spec, 2 * args.tokens + args.page_size)
    h, s, d = _indices(spec, torch.Generator().manual_seed(0))
    pool = HostKVPool(spec, args.layout, "kernel", dev, strategy_options=json.loads(args.options), pin_memory=True)
    for _ in range(3):
        pool.backup_all_layers(h, s)
        pool.load_layer(1, h, d)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
