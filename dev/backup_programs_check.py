"""``backup_programs`` on a GPU: backups of one-token pages at a smaller budget, loads at theirs (ratio, GEMM).

Usage (GPU): ``python dev/backup_programs_check.py [SHAPE LAYOUT]`` (default MLA fp8 656-byte rows,
``page_first_kv_split``; page 1, 4096 tokens).  For the kernel strategy with no option and with
``backup_programs=4``: the launch grids, then ``backup_all_layers`` and a load burst, each as a ratio to one
pinned copy of the same bytes with a bf16 GEMM's slowdown beside it.  A diagnostic; numbers go to docs by hand.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hicache_core.bench import _Memcpy, _check, _gemm_slowdown, _median_ms, _workload  # noqa: E402
from hicache_core.pool import HostKVPool, allocate_host_buffers  # noqa: E402
from hicache_core.registry import create_registry  # noqa: E402


def main(shape: str = "mla61x656-fp8", layout: str = "page_first_kv_split") -> None:
    reg = create_registry()
    spec, dev, h, s, d = _workload(shape, page_size=1)
    host = allocate_host_buffers(reg.layout(layout).plan(spec), pin_memory=True)
    memcpy, total = _Memcpy(), spec.bytes_per_token * h.numel()
    layers = spec.layer_map.device_layers
    for opts in (None, {"backup_programs": 4}):
        pool = HostKVPool(spec, layout, "kernel", dev, host_buffers=host, registry=reg, strategy_options=opts)
        _check(pool, dev, h, s, d)  # raises unless bit-exact
        tuning = pool.strategy.effective_tuning(spec.device)  # type: ignore[attr-defined]
        backup = lambda: pool.backup_all_layers(h, s)  # noqa: E731
        burst = lambda: [pool.load_layer(layer, h, d) for layer in layers]  # noqa: E731
        row = {"shape": shape, "layout": layout, "options": opts, "backup_programs": tuning.backup.programs,
               "load_programs": tuning.load.programs}
        for name, fn, to_host in (("backup_all_layers", backup, True), ("load_burst", burst, False)):
            ratio = total / _median_ms(fn, 10) / 1e6 / memcpy.gbps(total, to_host, 10)
            row[name] = {"ratio": round(ratio, 3), "gemm_pct": round(100 * _gemm_slowdown(fn), 1)}
        print(json.dumps(row), flush=True)
        del pool


if __name__ == "__main__":
    main(*sys.argv[1:3])
