"""What ``auto``'s forward watch costs a lone load, piece by piece (H200 probe).

On the H200, ``hicache bench``'s idle lone loads (``load_layer``, one call at a time) ran ~16-20 us slower per call
with ``forward="watch"`` than with the default, whatever the layer's size (MLA 576 bf16, fp8 656 B, MHA): the time
of one timed call.  This probe splits that up.

Usage (GPU): ``python benchmarks/watch_cost.py [--shape SHAPE] [--rounds N] [--out FILE]``.  It prints and writes:

* host microseconds (median of many calls) of what a timed lone load adds before its launch:
  ``torch.cuda.current_stream``, ``Event.record``, ``Event.query``, ``ForwardWatch.due`` with nothing pending, and
  ``ForwardWatch.timed`` around a launch that queues nothing, then landed;
* device microseconds of a lone 4.7 MB pinned copy with and without two timing events around it (alternating);
* event-timed microseconds of one lone ``load_layer`` (the bench's measure: the call starts on an idle GPU) on an
  ``auto`` pool with ``forward="compute"``, one with ``"watch"``, and one with ``"watch"`` whose timing is switched
  off (its watch never due), in alternating rounds so a drift of the host's speed reaches them alike.

Host and event timings only; nothing here is a pass/fail check.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.needs_cuda import require_cuda  # noqa: E402
from hicache_core.backends.forward import ForwardWatch  # noqa: E402
from hicache_core.bench import _check, _host_us, _workload  # noqa: E402
from hicache_core.kernel_support import current_stream_handle  # noqa: E402
from hicache_core.pool import HostKVPool, allocate_host_buffers  # noqa: E402
from hicache_core.registry import create_registry  # noqa: E402


def host_pieces() -> dict[str, float]:
    """Host microseconds of the pieces a timed lone load runs before its launch."""
    stream = torch.cuda.current_stream()
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    watch = ForwardWatch(55.0)

    def timed_then_landed() -> None:
        watch.timed(lambda: None, 5 << 20, 0)
        torch.cuda.synchronize()
        watch.due(5 << 20)

    def sync_then_due() -> None:
        torch.cuda.synchronize()
        watch.due(5 << 20)

    pieces = {"current_stream": lambda: torch.cuda.current_stream(0),
              "current_stream_handle": lambda: current_stream_handle(0),
              "event_record": lambda: event.record(stream), "event_query": event.query,
              "due_nothing_pending": lambda: watch.due(5 << 20)}
    out = {name: round(_host_us(fn, 3000), 2) for name, fn in pieces.items()}  # (bench's: synchronised between calls)
    out["timed_and_landed_minus_sync"] = round(_host_us(timed_then_landed, 1000) - _host_us(sync_then_due, 1000), 2)
    return out


def copy_with_events(nbytes: int = 4_700_000, rounds: int = 200) -> dict[str, float]:
    """Device microseconds of a lone pinned copy, bare and between two timing events (alternating)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream()
    a, b, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(4))

    def lone(events: bool) -> float:
        torch.cuda.synchronize()
        a.record(stream)
        if events:
            e1.record(stream)
        dst.copy_(src, non_blocking=True)
        if events:
            e2.record(stream)
        b.record(stream)
        b.synchronize()
        return a.elapsed_time(b) * 1e3

    out: dict[bool, list[float]] = {False: [], True: []}
    for i in range(2 * rounds):
        out[i % 2 == 1].append(lone(i % 2 == 1))
    return {"copy_us": round(statistics.median(out[False]), 1), "copy_with_events_us": round(statistics.median(out[True]), 1)}


def lone_loads(shape: str, rounds: int, per_round: int = 20) -> dict[str, Any]:
    """Event-timed microseconds of one lone ``load_layer`` per pool variant, alternating rounds."""
    reg = create_registry()
    spec, dev, h, s, d = _workload(shape)
    layer = list(spec.layer_map.device_layers)[len(spec.layer_map.device_layers) // 2]
    variants = {"compute": {"forward": "compute"}, "watch": {"forward": "watch"}, "watch_untimed": {"forward": "watch"}}
    pools = {}
    for name, opts in variants.items():
        host = allocate_host_buffers(reg.layout("layer_first").plan(spec), pin_memory=True)
        pools[name] = HostKVPool(spec, "layer_first", "auto", dev, host_buffers=host, registry=reg, validate="shapes",
                                 strategy_options=opts)
        _check(pools[name], dev, h, s, d)
    untimed = getattr(pools["watch_untimed"].strategy, "watch", None)
    if untimed is not None:
        untimed.due = lambda nbytes: False  # never timed: the lane's plain kernel route
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: dict[str, list[float]] = {name: [] for name in pools}
    for _ in range(rounds):
        for name, pool in pools.items():
            for _ in range(per_round):
                torch.cuda.synchronize()
                time.sleep(2e-4)  # a pause: the call is lone by auto's clock too
                a.record()
                pool.load_layer(layer, h, d)
                b.record()
                b.synchronize()
                times[name].append(a.elapsed_time(b) * 1e3)
    watch = getattr(pools["watch"].strategy, "watch", None)
    return {"shape": shape, "layer_bytes": spec.bytes_per_token // len(spec.layer_map.device_layers) * h.numel(),
            **{f"{name}_us": round(statistics.median(v), 1) for name, v in times.items()},
            "lone_kernel_loads": {name: getattr(p.strategy, "lone_kernel_loads", 0) for name, p in pools.items()},
            "watch_timings": None if watch is None else watch.timings,
            "watch_last_share": None if watch is None else watch.last_share}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="mla61x576-bf16")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out")
    args = ap.parse_args()
    require_cuda(__file__)
    result = {"host_us": host_pieces(), "device": copy_with_events(), "lone_load": lone_loads(args.shape, args.rounds)}
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
