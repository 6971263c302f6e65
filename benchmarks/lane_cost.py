"""What ``auto``'s load lane costs the host per call beside ``direct``'s own, with the copies themselves left out (CPU).

Usage: ``python benchmarks/lane_cost.py [--out FILE.json] [--calls 20000] [--rounds 7]``.

One ``layer_first`` pool of fp8 MLA rows (656 bytes, 4096 tokens in 64-token pages, pages in reverse order: 64
descriptors per layer, as the pace probes load them) is served by ``direct``; its index pair is planned and reused.
Then :meth:`BatchCopier.copy <hicache_core.backends.memcpy.BatchCopier.copy>` is replaced by a no-op, so what is timed
is Python: ``direct``'s lane alone, and ``auto``'s lane routing the same calls to it (the pair memoised to ``direct``,
a stand-in kernel), unclocked (a CPU pool's lane) and clocked (a CUDA pool's: the lone-load check and the clock's
booking, with the stream's handle read as a constant and the stand-in never taking the load as a lone one).  Then a
lone load: ``auto``'s clocked lane sending every call to the stand-in kernel's lane as a lone load (its clock reads a
time that moves a second per reading, so every call finds the stream idle), beside that stand-in lane called alone
(``kernel_us``): what ``auto`` adds to a lone load's call, the part in front of the launch (which the load waits for)
and the count and clock booking after it.  Each figure is the least over ``--rounds`` rounds of the mean over
``--calls`` calls, in microseconds per call.

On an H100 host ``auto``'s bursts on the copy engine ran ~4 us per layer behind ``direct``'s (docs/perf/runs.md,
fifth H100 run); this prices the Python part of that gap on whatever host runs it.  Timings only: nothing here is a
pass/fail check.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from hicache_core import HostKVPool, LayerMap, PoolSpec, create_registry  # noqa: E402
from hicache_core.backends import auto as auto_mod  # noqa: E402
from hicache_core.backends.auto import AutoStrategy  # noqa: E402
from hicache_core.backends.auto_rules import pick_key  # noqa: E402
from hicache_core.backends.memcpy import BatchCopier, QueueClock  # noqa: E402
from hicache_core.calibration import DEFAULT  # noqa: E402

LAYERS, PAGE, PAGES, ROW = 4, 64, 64, 656


class _Kernel:
    """The stand-in kernel candidate: a lane that serves every call at once; ``fast``: whether its loads take a fast
    path (``auto`` gives lone loads only to such a kernel)."""

    def __init__(self, fast: bool = False) -> None:
        self.fast = fast
        self.served = 0

    def lane(self, binding: object, to_host: bool) -> Callable[..., bool]:
        def serve(layer: object, h: object, d: object) -> bool:
            self.served += 1
            return True
        return serve

    def fast_load(self, binding: object, layer: int, n: int) -> bool:
        return self.fast


def _pool() -> tuple[HostKVPool, torch.Tensor, torch.Tensor]:
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(LAYERS), kv_lora_rank=512, qk_rope_head_dim=64,
                        dtype=torch.uint8, page_size=PAGE, capacity=PAGE * PAGES, row_bytes=ROW)
    dev = {"kv": [torch.zeros(PAGE * PAGES, 1, ROW, dtype=torch.uint8) for _ in range(LAYERS)]}
    pool = HostKVPool(spec, "layer_first", "direct", dev, registry=create_registry(), strategy="core.direct",
                      pin_memory=False)
    h = torch.arange(PAGES).flip(0).repeat_interleave(PAGE) * PAGE + torch.arange(PAGE).repeat(PAGES)
    d = torch.arange(PAGE * PAGES)
    for layer in range(LAYERS):  # planned and served once: the lanes take every later call
        pool.load_layer(layer, h, d)
    return pool, h, d


def _auto_lane(pool: HostKVPool, h: torch.Tensor, d: torch.Tensor, clocked: bool,
               kernel: _Kernel | None = None) -> Callable[..., bool]:
    """``auto``'s load lane over ``pool``'s ``direct``, the pair memoised to it (beyond its first burst); with a
    ``kernel`` whose loads are fast, a clock on which every call is a lone load (it serves them)."""
    auto = AutoStrategy()
    auto.direct, auto.kernel, auto.calibration = pool.strategy, kernel or _Kernel(), DEFAULT  # type: ignore[assignment]
    if kernel is not None and kernel.fast:
        ticks = itertools.count()
        auto.clock = QueueClock(now=lambda: float(next(ticks)))  # a second between readings: the stream idle
    copier = pool.binding.scratch["direct.copier"]
    auto.paces, auto.warm_paces = copier.paces, copier.warm_paces  # measures, as on a CUDA pool (none form here)
    auto._layers, auto._layer_token_bytes, auto._token_bytes = LAYERS, ROW, ROW * LAYERS
    auto._clocked = clocked
    key = pick_key(h, d, 1, False)
    assert key is not None  # tensors with version counters
    auto._picks[key] = pool.strategy
    auto._uses[key] = [LAYERS + 1, h, d]
    lane = auto.lane(pool.binding, False)
    assert lane is not None
    return lane


def _time(fn: Callable[[], object], calls: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return round(best, 3)


def measure(calls: int, rounds: int) -> dict[str, Any]:
    """The three lanes' host time per call (microseconds) and ``auto``'s extra over ``direct``'s."""
    pool, h, d = _pool()
    real_copy, real_handle = BatchCopier.copy, auto_mod.current_stream_handle
    submitted = [0]

    def no_copy(self: BatchCopier, *args: object, **kwargs: object) -> None:
        submitted[0] += 1

    BatchCopier.copy = no_copy  # type: ignore[method-assign]
    auto_mod.current_stream_handle = lambda index: 0  # type: ignore[assignment]  # the CPU copier's stream
    try:
        direct = pool.strategy.lane(pool.binding, False)  # type: ignore[attr-defined]
        lanes = {"direct": direct, "auto": _auto_lane(pool, h, d, False),
                 "auto clocked": _auto_lane(pool, h, d, True)}
        out: dict[str, Any] = {"calls": calls, "rounds": rounds}
        for name, lane in lanes.items():
            before = submitted[0]
            if not lane(1, h, d) or submitted[0] != before + 1:
                raise RuntimeError(f"{name}'s lane did not submit through direct: nothing to time")
            out[name + "_us"] = _time(lambda: lane(1, h, d), calls, rounds)
        for name in ("auto", "auto clocked"):
            out[name.replace(" ", "_") + "_extra_us"] = round(out[name + "_us"] - out["direct_us"], 3)
        kernel = _Kernel(fast=True)
        alone, lone = kernel.lane(pool.binding, False), _auto_lane(pool, h, d, True, kernel)
        before = submitted[0], kernel.served
        if not lone(1, h, d) or (submitted[0], kernel.served) != (before[0], before[1] + 1):
            raise RuntimeError("auto's lane did not send a lone load to the kernel: nothing like a lone load to time")
        out["kernel_us"] = _time(lambda: alone(1, h, d), calls, rounds)
        out["auto_lone_us"] = _time(lambda: lone(1, h, d), calls, rounds)
        out["auto_lone_extra_us"] = round(out["auto_lone_us"] - out["kernel_us"], 3)
        return out
    finally:
        BatchCopier.copy = real_copy  # type: ignore[method-assign]
        auto_mod.current_stream_handle = real_handle


def timing_main(description: str, measure: Callable[[int, int], dict[str, Any]], argv: list[str] | None,
                calls: int) -> int:
    """The command line of a CPU timing script (this one, ``decision_cost.py``): ``--out``, ``--calls`` (default
    ``calls``), ``--rounds``; prints ``measure(calls, rounds)`` as JSON and writes it to ``--out``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default=None, help="write the figures here (JSON)")
    p.add_argument("--calls", type=int, default=calls, help="calls per round")
    p.add_argument("--rounds", type=int, default=7, help="rounds; the least mean is kept")
    args = p.parse_args(argv)
    if args.calls < 1 or args.rounds < 1:
        p.error("--calls and --rounds must be >= 1")
    out = measure(args.calls, args.rounds)
    print(json.dumps(out))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    return timing_main(__doc__.splitlines()[0], measure, argv, 20000)


if __name__ == "__main__":
    sys.exit(main())
