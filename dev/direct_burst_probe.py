"""Where ``direct``'s host time goes in a burst of per-layer loads: our Python or the CUDA runtime (GPU diagnostic).

Usage (GPU): ``python dev/direct_burst_probe.py``.  MLA 61 x 576 bf16, 4096 tokens, page 64, GPU-resident
indices, device layers allocated separately (as ``hicache bench``), layouts ``layer_first`` and
``page_first_direct``.  Per call inside bursts of one ``load_layer`` per layer (synchronised between bursts),
median host microseconds of:

* ``pool``: ``pool.load_layer`` through ``direct`` (its lane after the first burst);
* ``raw_layers``: one ``cudaMemcpyBatchAsync`` call per layer with the descriptors ``direct`` built for that
  layer (no Python of ours between the calls but the loop);
* ``raw_same``: the same, the middle layer's descriptors every time (the same addresses each call);

then a cProfile of two ``pool`` bursts.  A diagnostic, not a benchmark.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hicache_core.backends import cudart  # noqa: E402
from hicache_core.backends.direct import DirectStrategy  # noqa: E402
from hicache_core.bench import SHAPES, _check, _device_buffers, _indices  # noqa: E402
from hicache_core.kernel_support import current_stream_handle  # noqa: E402
from hicache_core.pool import HostKVPool, allocate_host_buffers  # noqa: E402
from hicache_core.registry import create_registry  # noqa: E402


def _per_call(calls: list, bursts: int = 20) -> float:
    times = []
    for _ in range(bursts):
        torch.cuda.synchronize()
        for fn in calls:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return round(statistics.median(times), 1)


def main() -> None:
    reg = create_registry()
    rt = cudart.runtime()
    spec = SHAPES["mla61x576-bf16"](4096, 64, torch.device("cuda"))
    dev = _device_buffers(spec, 2 * 4096 + 64)
    h, s, d = _indices(spec, torch.Generator().manual_seed(0))
    owned = list(spec.layer_map.device_layers)
    for layout in ("layer_first", "page_first_direct"):
        host = allocate_host_buffers(reg.layout(layout).plan(spec), pin_memory=True)
        pool = HostKVPool(spec, layout, "direct", dev, host_buffers=host, registry=reg, validate="shapes",
                          strategy="core.direct")
        _check(pool, dev, h, s, d)
        stream = current_stream_handle(torch.cuda.current_device())
        subs = [DirectStrategy._submission(pool.binding, h, d, layer, stream) for layer in owned]
        stream = stream or cudart.STREAM_PER_THREAD  # the batch call refuses the legacy stream, as copy_batch knows
        counts = sorted({int(x.lens.numel()) for x in subs})

        def raw(sub):  # type: ignore[no-untyped-def]
            dp, sp, zp, n = sub.dev.data_ptr(), sub.host.data_ptr(), sub.lens.data_ptr(), int(sub.lens.numel())

            def call() -> None:
                err = rt.submit_batch(dp, sp, zp, n, stream)
                if err:
                    raise RuntimeError(f"cudaMemcpyBatchAsync: {rt.error_string(err)}")
            return call
        mid = subs[len(subs) // 2]
        row = {"layout": layout, "descriptors_per_layer": counts, "staged": any(x.staged is not None for x in subs),
               "pitched": any(x.pitched is not None for x in subs)}
        pool_calls = [lambda lay=lay: pool.load_layer(lay, h, d) for lay in owned]
        for rnd in range(3):  # alternating rounds: the host's speed drifts
            row[f"pool_{rnd}"] = _per_call(pool_calls)
            if not (row["staged"] or row["pitched"]):
                row[f"raw_layers_{rnd}"] = _per_call([raw(x) for x in subs])
                row[f"raw_same_{rnd}"] = _per_call([raw(mid)] * len(subs))
        print(json.dumps(row), flush=True)
        prof = cProfile.Profile()
        prof.enable()
        _per_call(pool_calls, bursts=2)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
        print(buf.getvalue()[-3500:], flush=True)
        del pool, host


if __name__ == "__main__":
    main()
