"""Where ``auto``'s host-pace samples come from, during ``hicache bench``'s rows of one cell.

Usage (GPU): ``python benchmarks/pace_trace.py --out FILE.json [--shape mla61x656-fp8] [--layout layer_first]
[--io-backends direct,auto] [--reps 20] [--gemm]``.

Runs :func:`hicache_core.bench.run_bench` for one shape and layout (4096 tokens, page 64) with every
:class:`~hicache_core.backends.pace.HostPace` sample traced: the bench phase it came from (the pool's check,
the timed calls of each op, the GEMM windows, the host-time bursts), the pace it went to (planning or plan
reused, load or backup), the host time of the submission, its descriptors and runtime calls, and the sample
(microseconds per descriptor).  The summary gives, per pool, op, phase and pace, the samples' median, and
per runtime-call count (a submission split into several calls is one that started on an idle engine).

Each sample also carries what the copier's :class:`~hicache_core.backends.memcpy.QueueClock` knew when the
submission started (``backlog_us``, ``gap_us`` since the previous submission on the stream ended) and, from CUDA
events recorded after every traced submission, whether the copy engine still held the previous submission's
copies when this one started (``busy_start``) and when it ended (``busy_end``: the engine was never starved
while the host submitted).  ``--decisions`` also lists every decision ``auto`` made (layer, reused pair, the
pace it read, the candidate).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.needs_cuda import require_cuda  # noqa: E402
from hicache_core import bench  # noqa: E402
from hicache_core.backends import auto as auto_mod  # noqa: E402
from hicache_core.backends import memcpy  # noqa: E402
from hicache_core.backends.cudart import runtime, schedule_calls  # noqa: E402
from hicache_core.backends.pace import HostPace  # noqa: E402

_STATE: dict[str, Any] = {"row": "", "phase": "setup", "to_host": None, "warm": False,
                          "end_query": lambda: None}


def _phased(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        before, _STATE["phase"] = _STATE["phase"], name
        try:
            return fn(*args, **kwargs)
        finally:
            _STATE["phase"] = before
    return run


class _Events:
    """One CUDA event per stream, recorded after each traced submission (through the runtime's C API: a
    microsecond each); :meth:`busy` tells whether the last one is still pending (``None``: none yet)."""

    _NOT_READY = 600  # cudaErrorNotReady

    def __init__(self) -> None:
        self.lib: Any = None
        self.ev: dict[int, ctypes.c_void_p] = {}

    def _lib(self) -> Any:
        if self.lib is None:
            lib = runtime()._lib
            lib.cudaEventCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
            lib.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            lib.cudaEventQuery.argtypes = [ctypes.c_void_p]
            self.lib = lib
        return self.lib

    def busy(self, stream: int) -> bool | None:
        ev = self.ev.get(stream)
        if ev is None:
            return None
        return bool(self._lib().cudaEventQuery(ev) == self._NOT_READY)

    def mark(self, stream: int) -> None:
        lib = self._lib()
        ev = self.ev.get(stream)
        if ev is None:
            ev = self.ev[stream] = ctypes.c_void_p()
            lib.cudaEventCreateWithFlags(ctypes.byref(ev), 2)  # cudaEventDisableTiming
        lib.cudaEventRecord(ev, ctypes.c_void_p(stream))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="mla61x656-fp8")
    ap.add_argument("--layout", default="layer_first")
    ap.add_argument("--io-backends", default="direct,auto")
    ap.add_argument("--ops", default="load_layer,load_burst")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--gemm", action="store_true")
    ap.add_argument("--decisions", action="store_true", help="list auto's decisions too")
    args = ap.parse_args()
    require_cuda(__file__)
    events = _Events()

    samples: list[dict[str, Any]] = []
    real_copy, real_record = memcpy.BatchCopier.copy, HostPace.record

    def traced_copy(self: memcpy.BatchCopier, dsts: Any, srcs: Any, lens: Any, stream: Any = None,
                    nbytes: Any = None, to_host: Any = None, since: Any = None, warm: bool = False) -> None:
        _STATE["to_host"], _STATE["warm"] = to_host, warm  # what record() below is told about the sample
        s = self.stream() if stream is None else stream
        now = self.clock.now()
        _STATE["backlog_us"] = round(self.clock.backlog_us(s, now), 1)
        _STATE["gap_us"] = round((now - self.clock._last_end.get(s, float("-inf"))) * 1e6, 1)
        _STATE["busy_start"] = events.busy(s)
        _STATE["end_query"] = lambda: events.busy(s)
        real_copy(self, dsts, srcs, lens, stream, nbytes, to_host, since, warm)
        events.mark(s)

    def record(self: HostPace, host_us: float, ops: int, calls: int) -> None:
        busy_end = _STATE["end_query"]()  # before the sample is taken in: what the engine held at the end
        real_record(self, host_us, ops, calls)
        samples.append({"backlog_us": _STATE["backlog_us"], "gap_us": _STATE["gap_us"],
                        "busy_start": _STATE["busy_start"], "busy_end": busy_end,
                        "row": _STATE["row"], "phase": _STATE["phase"], "to_host": bool(_STATE["to_host"]),
                        "pace": "reused" if _STATE["warm"] else "planning", "ops": ops, "calls": calls,
                        "eager": calls > schedule_calls(ops, False),  # split: an idle engine
                        "desc_us": round(self.samples()[-1], 4), "host_us": round(host_us, 2),
                        "estimate_us": self.desc_us})

    decisions: list[dict[str, Any]] = []
    real_decide = auto_mod.AutoStrategy._decide

    def decide(self: Any, binding: Any, host_indices: Any, device_indices: Any, layer: Any, to_host: bool,
               reused: bool, *rest: Any) -> Any:
        pick = real_decide(self, binding, host_indices, device_indices, layer, to_host, reused, *rest)
        group = self.warm_paces if reused and self.warm_paces is not None else self.paces
        pace = group[to_host] if group is not None else None
        decisions.append({"row": _STATE["row"], "phase": _STATE["phase"], "layer": layer, "to_host": to_host,
                          "reused": reused, "desc_us": None if pace is None else pace.fresh(),
                          "pick": "direct" if pick is self.direct else "kernel", "probe": self.pace_probes})
        return pick
    if args.decisions:
        auto_mod.AutoStrategy._decide = decide  # type: ignore[method-assign,assignment]
    memcpy.BatchCopier.copy = traced_copy  # type: ignore[method-assign]
    HostPace.record = record  # type: ignore[method-assign]
    # replaced in the modules run_bench looks them up in (hicache_core/bench/__init__.py says why)
    for module, name in ((bench.timing, "_samples_ms"), (bench.timing, "_gemm_slowdown"), (bench.timing, "_burst_host_us"),
                         (bench.workload, "_check"), (bench.timing, "_host_us"), (bench.run, "_served_by")):
        setattr(module, name, _phased(name.strip("_"), getattr(module, name)))

    rows: list[dict[str, Any]] = []

    def progress(msg: str) -> None:
        print(msg, flush=True)

    def sink(row: bench.BenchRow) -> None:
        rows.append(asdict(row))

    real_init = bench.run.HostKVPool.__init__

    def init(self: Any, *a: Any, **kw: Any) -> None:
        _STATE["row"] = f"{kw.get('strategy')} {kw.get('strategy_options')}"
        real_init(self, *a, **kw)
    bench.run.HostKVPool.__init__ = init  # type: ignore[method-assign]

    # one pool per run_bench call: a layout's pools are all built before any is timed, and the trace names the row
    # by the pool built last; one memcpy reference for all of them, so that their ratios share a baseline
    reference = bench.timing._Memcpy()
    for backend in args.io_backends.split(","):
        for variant in [v for v, _ in bench._configs(backend, [None], ["auto"])
                        if backend != "auto" or v in ("", "lone=off")]:
            bench._one_pool_each(bench.run_bench(
                shapes=[args.shape], tokens=[4096], page_sizes=[64], programs=[None], layouts=[args.layout],
                backends=[backend], variants=[variant], ops=args.ops.split(","), reps=args.reps, gemm=args.gemm,
                progress=progress, sink=sink, memcpy=reference))
    groups: dict[tuple[str, str, bool, str], list[float]] = defaultdict(list)
    for s in samples:
        groups[(s["row"], s["phase"], s["to_host"], f"{s['pace']}{' eager' if s['eager'] else ''}")].append(s["desc_us"])
    summary = [{"row": r, "phase": p, "to_host": t, "pace": k, "n": len(v), "median_desc_us": statistics.median(v),
                "min": min(v), "max": max(v)} for (r, p, t, k), v in groups.items()]
    for s in summary:
        print(f"{s['row']:60s} {s['phase']:14s} {'D2H' if s['to_host'] else 'H2D'} {s['pace']:8s} n={s['n']:4d} "
              f"median {s['median_desc_us']:.3f} us/desc (min {s['min']:.3f}, max {s['max']:.3f})")
    # the same samples split by what the engine held when the submission ended (busy_end: never starved by it)
    split: dict[tuple[str, str, bool, str, Any], list[float]] = defaultdict(list)
    for s in samples:
        split[(s["row"], s["phase"], s["to_host"], s["pace"], s["busy_end"])].append(s["desc_us"])
    for (r, p, t, k, b), v in split.items():
        print(f"{r:60s} {p:14s} {'D2H' if t else 'H2D'} {k:8s} busy_end={b!s:5s} n={len(v):4d} "
              f"median {statistics.median(v):.3f} us/desc")
    for d in decisions:
        print(f"decision {d['row']:40s} {d['phase']:14s} layer={d['layer']} {'D2H' if d['to_host'] else 'H2D'} "
              f"reused={d['reused']} pace={d['desc_us']} -> {d['pick']} (probes {d['probe']})")
    Path(args.out).write_text(json.dumps({"samples": samples, "summary": summary, "rows": rows,
                                          "decisions": decisions}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
