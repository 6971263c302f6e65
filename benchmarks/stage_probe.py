"""Staged layer-major backup probe: which staging image order the copy engine's pitched copies like.

Usage (GPU): ``python benchmarks/stage_probe.py [--out DIR]``.  An MLA all-layer
backup (61 layers, 4096 tokens x 1152 bytes, 64-token pages, random host pages)
is copied D2H from a contiguous device staging buffer to a pinned layer-major
host buffer as 64 pitched operations (one per page, 61 rows), with the staging
buffer ordered two ways:

* ``page-major``: ``[page, layer, block]`` (row pitch = one block, 73.7 KB);
* ``layer-major``: ``[layer, page, block]`` (row pitch = 64 blocks);

and as 3904 plain descriptors from the page-major buffer, next to one pinned
``copy_`` of the same bytes.  Each is checked byte for byte; ratio and host
time of the submission go to ``<out>/stage_probe.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ce_probe import _event_ms, probe_setup  # noqa: E402
from hicache_core.backends.pitched import Pitched, expand, ops_tensor  # noqa: E402


def main() -> int:
    args, rt, stream = probe_setup(20)
    res: dict = {"gpu": torch.cuda.get_device_name(), "runtime": rt.version, "rows": []}
    for L, row, label in ((61, 1152, "mla61x576-bf16"), (80, 2048 * 8 // 8, "mha80-k-part")):
        tokens, ps = 4096, 64
        pages, block = tokens // ps, ps * row
        host_layer = tokens * row
        host = torch.empty(L * host_layer, dtype=torch.uint8, pin_memory=True)
        stage = torch.randint(0, 255, (L * pages * block,), dtype=torch.uint8, device="cuda")
        hpage = torch.randperm(pages, generator=torch.Generator().manual_seed(0)).to(torch.int64)
        k = torch.arange(pages, dtype=torch.int64)
        base = _event_ms(lambda: host.copy_(stage, non_blocking=True), args.reps)[0]
        full = lambda t: torch.full((pages,), t, dtype=torch.int64)  # noqa: E731
        ways = {
            "page-major": (Pitched(hpage * block + host.data_ptr(), k * L * block + stage.data_ptr(), full(block),
                                   full(L), full(host_layer), full(block)),
                           lambda: stage.view(pages, L, block).transpose(0, 1)),
            "layer-major": (Pitched(hpage * block + host.data_ptr(), k * block + stage.data_ptr(), full(block),
                                    full(L), full(host_layer), full(pages * block)),
                            lambda: stage.view(L, pages, block)),
        }
        for way, (p, want_fn) in ways.items():
            for kind in ("2d", "1d"):
                if kind == "1d" and way == "layer-major":
                    continue
                if kind == "2d":
                    ops = ops_tensor(p, to_host=True)
                    fn = lambda o=ops: rt.copy_3d_batch(o, stream)  # noqa: E731
                else:
                    h1, d1, z1 = expand(p)
                    fn = lambda h1=h1, d1=d1, z1=z1: rt.copy_batch(h1, d1, z1, stream)  # noqa: E731
                host.zero_()
                fn()
                torch.cuda.synchronize()
                got = host.view(L, pages, block)[:, hpage]
                ok = bool(torch.equal(got, want_fn().cpu()))
                ms, host_us = _event_ms(fn, args.reps)
                r = {"shape": label, "way": way, "kind": kind, "ops": p.count if kind == "2d" else p.count * L,
                     "bit_exact": ok, "ratio": base / ms, "ms": ms, "host_us": host_us}
                res["rows"].append(r)
                print(r, flush=True)
        del host, stage
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "stage_probe.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
