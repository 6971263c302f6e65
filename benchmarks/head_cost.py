"""Where a new batch's first load calls spend host time: ``auto`` against the layout's kernel, part by part.

Usage (GPU): ``python benchmarks/head_cost.py --out FILE.json [--shape mla61x576-fp8] [--layout layer_first]
[--cycles 150]``.

A forward pass's load burst (every layer, back to back) with new index tensors every cycle, as
``benchmarks/pace_probe.py`` runs it, through the kernel's pool and ``auto``'s in turn.  A burst's first calls
decide and plan what the rest reuse, and the GPU waits for the first launch: their host time is the part of the
burst's time that the link does not hide.  Each part of a call (the pool's lane, its index check, ``auto``'s
``load``, ``pick``, ``_decide`` and the rules it runs, the kernel's ``load``) is timed inclusively by a wrapper on the
pool's own objects, per position in the burst (the first :data:`HEAD` calls, then the rest together).  The report
gives per part and position the median microseconds over the cycles where the part ran (for ``rest``: its time per
call over all of the burst's later calls), and the share of cycles it ran in.
The wrappers cost about a microsecond each: compare parts, not totals with ``pace_probe.py``'s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.needs_cuda import require_cuda  # noqa: E402
from hicache_core.bench import _check, _workload  # noqa: E402
from hicache_core.pool import HostKVPool, allocate_host_buffers  # noqa: E402
from hicache_core.registry import create_registry  # noqa: E402

#: Positions in the burst reported one by one; later calls are reported together as ``rest``.
HEAD = 3
#: The parts timed on an ``auto`` strategy (methods looked up on the instance at call time), and on its candidates.
AUTO_PARTS = ("load", "_serve", "pick", "_decide", "_lone", "_least_blocks", "_may_feed", "_refuse_unread",
              "_planned", "_book", "_fast", "_use", "_pace_moved", "_block_bound")
CANDIDATE_PARTS = ("load", "transfer", "submission")


class Timer:
    """Inclusive host time of named parts, per burst position (:attr:`position`, set by the burst loop)."""

    def __init__(self) -> None:
        self.position = 0
        self.cycle: dict[tuple[str, str], float] = {}  # (part, position label) -> us in this cycle

    def label(self) -> str:
        return str(self.position) if self.position < HEAD else "rest"

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                key = (name, self.label())
                self.cycle[key] = self.cycle.get(key, 0.0) + (time.perf_counter() - t0) * 1e6
        return timed


def _instrument(pool: HostKVPool, timer: Timer) -> None:
    """Wrap the pool's lane, index check and strategy parts (on the instances: other pools are untouched)."""
    st = pool.strategy
    if hasattr(st, "kernel") and hasattr(st, "direct"):  # auto (its name carries its plugin's prefix)
        for part in AUTO_PARTS:
            if callable(getattr(st, part, None)):
                setattr(st, part, timer.wrap("auto." + part, getattr(st, part)))
        for tag in ("kernel", "direct"):
            cand = getattr(st, tag, None)
            for part in CANDIDATE_PARTS:
                if cand is not None and callable(getattr(cand, part, None)):
                    setattr(cand, part, timer.wrap(f"{tag}.{part}", getattr(cand, part)))
    else:
        st.load = timer.wrap("kernel.load", st.load)  # type: ignore[method-assign]
        st.transfer = timer.wrap("kernel.transfer", st.transfer)  # type: ignore[method-assign]
    kernel = getattr(st, "kernel", st)
    prep = pool.binding.scratch.get(getattr(kernel, "name", ""))
    replays = getattr(prep, "replays", None)
    if replays is not None:  # the kernel's replays: a batch made or matched, a layer's recorded launches replayed
        for part in ("batch", "run"):
            setattr(replays, part, timer.wrap("replays." + part, getattr(replays, part)))
    pool._check = timer.wrap("pool._check", pool._check)  # type: ignore[method-assign]
    lane = pool._lanes[0]  # type: ignore[attr-defined]
    if lane is not None:
        pool._lanes = (timer.wrap("pool.lane", lane), pool._lanes[1])  # type: ignore[attr-defined]


def run(shape: str, layout: str, cycles: int) -> dict[str, Any]:
    reg = create_registry()
    spec, dev, h, s, d = _workload(shape)
    layers = list(spec.layer_map.device_layers)
    pools, timers = {}, {}
    for name in ("kernel", "auto"):
        host = allocate_host_buffers(reg.layout(layout).plan(spec), pin_memory=True)
        pools[name] = HostKVPool(spec, layout, name, dev, host_buffers=host, registry=reg, validate="shapes",
                                 strategy_options={"forward": "compute"} if name == "auto" else None)
        _check(pools[name], dev, h, s, d)
        timers[name] = Timer()
        _instrument(pools[name], timers[name])
    samples: dict[str, dict[tuple[str, str], list[float]]] = {n: {} for n in pools}
    calls: dict[str, dict[str, list[float]]] = {n: {} for n in pools}
    for k in range(cycles):
        hk, sk, dk = h.clone(), s.clone(), d.clone()
        pools["auto"].backup_all_layers(hk, sk)
        for name in (("kernel", "auto") if k % 2 else ("auto", "kernel")):
            timer, pool = timers[name], pools[name]
            timer.cycle = {}
            torch.cuda.synchronize()
            for i, layer in enumerate(layers):
                timer.position = i
                t0 = time.perf_counter()
                pool.load_layer(layer, hk, dk)
                calls[name].setdefault(timer.label(), []).append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
            for key, us in timer.cycle.items():
                samples[name].setdefault(key, []).append(us / (len(layers) - HEAD if key[1] == "rest" else 1))
        time.sleep(0.02)
    report: dict[str, Any] = {"shape": shape, "layout": layout, "cycles": cycles}
    for name in pools:
        report[name] = {
            "call_us": {pos: round(statistics.median(v), 1) for pos, v in calls[name].items()},
            "parts": {f"{part}@{pos}": [round(statistics.median(v), 1), round(len(v) / cycles, 2)]
                      for (part, pos), v in sorted(samples[name].items())}}
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shape", default="mla61x576-fp8")
    p.add_argument("--layout", default="layer_first")
    p.add_argument("--cycles", type=int, default=150)
    args = p.parse_args()
    require_cuda(__file__)
    report = run(args.shape, args.layout, args.cycles)
    Path(args.out).write_text(json.dumps(report, indent=1))
    for name in ("kernel", "auto"):
        print(name, "call us by position:", report[name]["call_us"])
        for key, (us, share) in report[name]["parts"].items():
            print(f"  {key:28s} {us:8.1f} us  in {share:.2f} of cycles")


if __name__ == "__main__":
    main()
