"""``auto``'s host-pace rule over time: forward-pass load bursts through the kernel, ``direct`` and ``auto`` in turn.

Usage (GPU): ``python benchmarks/pace_probe.py --out FILE.json [--shapes mla61x576-fp8,mla61x656-fp8]
[--layouts layer_first,page_first_direct] [--seconds 30] [--reuse] [--with-memory] [--with-watch] [--with-prefetch]
[--hbm] [--profile DIR] [--lane-detail] [--with-lone-off] [--with-direct-only] [--with-reprobe]``.

Per shape and layout, three pools share the device layers (4096 tokens, page 64, separately allocated layers,
random pages): the layout's kernel, ``direct`` and ``auto`` (and ``auto`` with ``pace=False`` where
``--with-off``).  Each cycle takes new index tensors (a new forward batch: each strategy decides and plans anew),
backs all layers up through ``auto`` (a serving loop backs up after prefills), then runs one burst of per-layer
loads (every layer, back to back, after a synchronise) through each pool in a rotating order, event-timed against
a pinned copy of the burst's bytes timed in the same cycle.  With ``--reuse`` every cycle uses the same index tensors
(indices reused batch after batch: plans built once, then reused).  It records per cycle the three ratios, what served
``auto``'s burst and the host pace it measured, so the host's drift and ``auto``'s tracking of it show side by
side.  The summary gives, per cell, how often ``auto`` was within 3 points of the better of kernel and ``direct``.
``--with-memory`` adds ``auto`` with ``forward="memory"``, ``--with-watch`` with ``forward="watch"``,
``--with-prefetch`` ``auto`` with ``prefetch=True`` (and ``forward="watch"`` with it, with ``--with-watch``),
``--with-reprobe`` ``auto`` with ``reprobe=True`` (its re-probes so far, per cycle: ``reprobes``); ``--hbm``
runs every burst beside a memory-bound reduction on another stream (``hicache bench --hbm``'s neighbour, queued to
outlast the burst), against the idle pinned copy.  The summary's ``stalls`` lists, per candidate, the cycles whose
burst had a call over :data:`STALL_US`.  ``--profile DIR`` cProfiles each candidate's bursts (their host time grows
under the profiler, the ratios with it: use it to find where a candidate's host time goes, not to compare ratios).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from typing import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.needs_cuda import require_cuda  # noqa: E402
from hicache_core.backends.auto_rules import pick_key  # noqa: E402
from hicache_core.bench import _check, _hbm_reader, _median_ms, _queue, _workload  # noqa: E402
from hicache_core.pool import HostKVPool, allocate_host_buffers  # noqa: E402
from hicache_core.registry import create_registry  # noqa: E402


#: Host microseconds of each call of the last burst (:func:`_burst_ms`).
CALL_US: list[float] = []


def _count_decisions(strategy: object) -> dict[str, int]:
    """Count what ``auto``'s decisions (calls not served by a memoised pick) give to each candidate."""
    counts = {"kernel": 0, "direct": 0}
    decide = strategy._decide  # type: ignore[attr-defined]

    def counted(*args: object, **kwargs: object) -> object:
        pick = decide(*args, **kwargs)
        counts["direct" if pick is strategy.direct else "kernel"] += 1  # type: ignore[attr-defined]
        return pick

    strategy._decide = counted  # type: ignore[attr-defined]
    return counts


def _relane(pool: HostKVPool) -> None:
    """Make the pool's lanes again from its strategy (after a candidate or its lane was replaced)."""
    st = pool.strategy
    pool._lanes = (st.lane(pool.binding, False), st.lane(pool.binding, True))  # type: ignore[attr-defined]


def _counting(inner: Callable[..., bool], counts: dict[str, int], tag: str) -> Callable[..., bool]:
    """``inner`` (a load lane), counting its calls, declines and time into ``counts`` under ``tag``."""
    k_ns, k_calls, k_declined = tag + "_lane_ns", tag + "_lane", tag + "_lane_declined"

    def counted(layer: object, h: torch.Tensor, d: torch.Tensor, *rest: object) -> bool:
        t0 = time.perf_counter()
        ok = inner(layer, h, d, *rest)  # rest: what auto hands direct's lane (its start, the stream)
        counts[k_ns] += int((time.perf_counter() - t0) * 1e9)
        counts[k_calls] += 1
        counts[k_declined] += not ok
        return ok
    setattr(counted, "takes_since", getattr(inner, "takes_since", False))  # what auto hands it, as to inner
    return counted


def _count_own(pool: HostKVPool) -> dict[str, int]:
    """For a pool that is not ``auto``'s, with ``--lane-detail``: the same counting layer around its own load lane as
    :func:`_count_inner` puts around an ``auto`` pool's candidates' lanes (``own_lane``, ``own_lane_declined``,
    ``own_lane_ns``), so that every pool's bursts pay it once per call: without it, the counting layer's host time
    (0.84 us per call on a CPU where ``auto``'s whole lane costs 1.2 us over ``direct``'s) counted against ``auto``
    alone.  Wrap the result with :func:`_count_lane` after this, not before."""
    counts = dict.fromkeys(("own_lane", "own_lane_declined", "own_lane_ns"), 0)
    lane = pool._lanes[0]  # type: ignore[attr-defined]
    if lane is not None:
        pool._lanes = (_counting(lane, counts, "own"), pool._lanes[1])  # type: ignore[attr-defined]
    return counts


def _count_inner(pool: HostKVPool) -> dict[str, int]:
    """For an ``auto`` pool: count its candidates' load-lane calls and declines within its own load lane
    (``direct_lane``/``direct_lane_declined``, ``kernel_lane``/``kernel_lane_declined``) and what ``pick()`` returned on
    the normal path (``picked_direct``/``picked_kernel``).  Rebuilds the pool's lanes with the counting candidates'
    lanes inside (wrap the result with :func:`_count_lane` after this, not before)."""
    st = pool.strategy
    counts = dict.fromkeys(("direct_lane", "direct_lane_declined", "direct_lane_ns", "kernel_lane",
                            "kernel_lane_declined", "kernel_lane_ns", "picked_direct", "picked_kernel"), 0)
    for tag in ("direct", "kernel"):
        cand = getattr(st, tag, None)
        make = getattr(cand, "lane", None)
        if not callable(make):
            continue

        def counting_make(binding: object, to_host: bool, make: object = make, tag: str = tag) -> object:
            inner = make(binding, to_host)  # type: ignore[operator]
            if not inner or to_host:
                return inner  # backups (the cycle's, through auto) are not counted
            return _counting(inner, counts, tag)
        cand.lane = counting_make  # type: ignore[union-attr]  # this pool's candidate object only
    pick = st.pick

    def counted_pick(*args: object, **kwargs: object) -> object:
        got = pick(*args, **kwargs)
        counts["picked_direct" if got is st.direct else "picked_kernel"] += 1
        return got
    st.pick = counted_pick
    _relane(pool)
    return counts


def _count_lane(pool: HostKVPool) -> dict[str, int]:
    """Count the pool's one-layer loads its load lane served (``served``) and those it left to the normal path
    (``declined``: ``pick()`` then decides or reads its memo, at more host time per call), the lane's time (``ns``),
    and its copier's submissions (``submits``) and those its clock told to start with small runtime calls
    (``eager``)."""
    counts = {"served": 0, "declined": 0, "ns": 0, "eager": 0, "submits": 0}
    copier = pool.binding.scratch.get("direct.copier")
    if copier is not None:  # submissions the copier's clock told to start with small runtime calls
        eager = copier.clock.eager

        def counted_eager(*args: object, **kwargs: object) -> bool:
            got = eager(*args, **kwargs)
            counts["eager"] += got
            counts["submits"] += 1
            return got
        copier.clock.eager = counted_eager
    lane = pool._lanes[0]  # type: ignore[attr-defined]
    if lane is None:
        return counts

    def counted(layer: object, host_indices: torch.Tensor, device_indices: torch.Tensor) -> bool:
        t0 = time.perf_counter()
        ok = lane(layer, host_indices, device_indices)
        counts["ns"] += int((time.perf_counter() - t0) * 1e9)
        counts["served" if ok else "declined"] += 1
        return ok

    pool._lanes = (counted, pool._lanes[1])  # type: ignore[attr-defined]
    return counts


class _Neighbour:
    """``--hbm``: reductions queued on their own stream ahead of a burst, enough to outlast it."""

    def __init__(self) -> None:
        self.work, self.stream = _hbm_reader(), torch.cuda.Stream()
        with torch.cuda.stream(self.stream):
            self.ms = _median_ms(self.work, 3, warmup=1)

    def cover(self, ms: float) -> None:
        _queue(self.stream, self.work, int(1.5 * ms / max(self.ms, 1e-3)) + 2)


def _burst_ms(pool: HostKVPool, layers: list[int], h: torch.Tensor, d: torch.Tensor,
              beside: tuple[_Neighbour, float] | None = None) -> tuple[float, float]:
    """The burst's GPU time (ms) and its host time per call (us); ``beside``: a neighbour to run for about that many
    milliseconds next to it."""
    torch.cuda.synchronize()
    if beside is not None:
        beside[0].cover(beside[1])
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    t0 = time.perf_counter()
    for layer in layers:
        t1 = time.perf_counter()
        pool.load_layer(layer, h, d)
        CALL_US.append((time.perf_counter() - t1) * 1e6)
    host_us = (time.perf_counter() - t0) * 1e6 / len(layers)
    b.record()
    b.synchronize()
    if beside is not None:
        torch.cuda.synchronize()  # the neighbour's rest, before anything else is timed
    return a.elapsed_time(b), host_us


def _copy_ms(dst: torch.Tensor, src: torch.Tensor) -> float:
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    dst.copy_(src, non_blocking=True)
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


#: ``auto``'s candidates: label -> strategy options.
VARIANTS: dict[str, dict[str, object]] = {
    "auto": {"forward": "compute"}, "auto pace=off": {"pace": False, "forward": "compute"},
    "auto forward=memory": {"forward": "memory"}, "auto forward=watch": {"forward": "watch"},
    "auto prefetch": {"forward": "compute", "prefetch": True},
    "auto forward=watch prefetch": {"forward": "watch", "prefetch": True},
    "auto lone=off": {"forward": "compute", "lone": False}, "auto direct-only": {"forward": "compute"},
    "auto reprobe": {"forward": "compute", "reprobe": True}}
#: The optional ones: label -> the tag of their summary keys.
TAGS = {"auto pace=off": "off", "auto forward=memory": "memory", "auto forward=watch": "watch",
        "auto prefetch": "prefetch", "auto forward=watch prefetch": "watch_prefetch", "auto lone=off": "lone_off",
        "auto direct-only": "direct_only", "auto reprobe": "reprobe"}
#: A call slower than this many microseconds counts as a stall in the summary (a read of GPU indices behind queued
#: loads took 20-38 ms on the H200).
STALL_US = 10_000.0
#: How many of a burst's first calls the summary times one by one (``call_us_first``).
FIRST_CALLS = 4


def _by(name: str) -> str:
    """The cycle key of what served ``auto`` candidate ``name`` (``auto_by``, ``auto_by forward=memory``, ...)."""
    return name.replace("auto", "auto_by", 1)


def run_cell(shape: str, layout: str, seconds: float, with_off: bool, reuse: bool = False, with_memory: bool = False,
             hbm: bool = False, with_watch: bool = False, with_prefetch: bool = False, profile: str | None = None,
             lane_detail: bool = False, with_lone_off: bool = False, with_direct_only: bool = False,
             with_reprobe: bool = False) -> dict:
    reg = create_registry()
    spec, dev, h, s, d = _workload(shape)
    layers = list(spec.layer_map.device_layers)
    nbytes = spec.bytes_per_token * h.numel()
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    chosen = {"auto pace=off": with_off, "auto forward=memory": with_memory, "auto forward=watch": with_watch,
              "auto prefetch": with_prefetch, "auto forward=watch prefetch": with_prefetch and with_watch,
              "auto lone=off": with_lone_off, "auto direct-only": with_direct_only, "auto reprobe": with_reprobe}
    names = ["kernel", "direct", "auto"] + [n for n, on in chosen.items() if on]
    neighbour = _Neighbour() if hbm else None
    last_ms = 20.0  # the neighbour covers twice this many ms (then: the slowest recent burst)
    pools = {}
    for name in names:
        backend, opts = name.split()[0], VARIANTS.get(name)
        host = allocate_host_buffers(reg.layout(layout).plan(spec), pin_memory=True)
        pools[name] = HostKVPool(spec, layout, backend, dev, host_buffers=host, registry=reg, validate="shapes",
                                 strategy_options=opts)
        if name == "auto direct-only":  # auto's own path with no decision to make: its lane's single-candidate route
            st = pools[name].strategy
            st.kernel, st._clocked = None, False  # type: ignore[attr-defined]
            _relane(pools[name])
        _check(pools[name], dev, h, s, d)
    auto = pools["auto"].strategy
    counts = {name: _count_decisions(pools[name].strategy) for name in names if name.startswith("auto")}
    # with --lane-detail every pool's load lane holds one counting layer (auto's inside it, around its candidates'),
    # so that each pays its host time alike
    inner = {name: (_count_inner if name.startswith("auto") else _count_own)(pools[name])
             for name in names if lane_detail}
    lanes = {name: _count_lane(pools[name]) for name in names}
    cycles = []
    profs: dict[str, cProfile.Profile] | None = {} if profile else None
    t_end = time.perf_counter() + seconds
    k = 0
    while time.perf_counter() < t_end:
        # a new batch: new tensors, new decisions (or, with reuse, the same ones every batch)
        hk, sk, dk = (h, s, d) if reuse else (h.clone(), s.clone(), d.clone())
        pools["auto"].backup_all_layers(hk, sk)
        base = _copy_ms(target, pinned)
        order = names[k % len(names):] + names[:k % len(names)]
        row: dict = {"t": round(time.perf_counter(), 4)}
        for name in order:
            st = pools[name].strategy
            probes, lone, decided = (getattr(st, k, 0) for k in ("pace_probes", "lone_kernel_loads", "decisions"))
            # every counter starts at zero with the burst: the cycle's backup through auto counts in none of them
            for group in (counts, lanes, inner):
                if name in group:
                    group[name].update(dict.fromkeys(group[name], 0))
            if profs is not None:
                profs.setdefault(name, cProfile.Profile()).enable()
            ms, host_us = _burst_ms(pools[name], layers, hk, dk,
                                    None if neighbour is None else (neighbour, 2.0 * last_ms))
            if profs is not None:
                profs[name].disable()
            last_ms = max(ms, 0.8 * last_ms)  # slow candidates stay covered after fast ones
            row[name] = round(base / ms, 4)
            row[name + "_host_us"] = round(host_us, 1)
            row[name + "_call_us_median_max"] = [round(statistics.median(CALL_US), 1), round(max(CALL_US), 1)]
            row[name + "_call_us_first"] = [round(u, 1) for u in CALL_US[:FIRST_CALLS]]
            CALL_US.clear()
            lc = lanes[name]
            row[name + "_lane_declined"] = lc["declined"]
            row[name + "_lane_us"] = round(lc["ns"] / 1e3 / max(1, lc["served"] + lc["declined"]), 2)
            row[name + "_eager"] = [lc["eager"], lc["submits"]]
            if name in inner:
                row[name + "_inner"] = dict(inner[name])
            if name in counts:  # decisions of this burst, by candidate
                row[name + "_decisions"] = dict(counts[name])
            if name == "auto":
                row["auto_probed"] = auto.pace_probes - probes  # type: ignore[attr-defined]
                row["auto_lone"] = auto.lone_kernel_loads - lone  # type: ignore[attr-defined]
                row["auto_decided"] = auto.decisions - decided  # type: ignore[attr-defined]
        # what auto memoised for the burst (read, not asked: asking would count as one more call of the pair)
        for name in [n for n in names if n.startswith("auto") and n != "auto pace=off"]:
            st = pools[name].strategy
            pick = st._picks.get(pick_key(hk, dk, layers[-1], False))  # type: ignore[attr-defined]
            row[_by(name)] = ("direct" if pick is st.direct or st.kernel is None  # type: ignore[attr-defined]
                              else "kernel" if pick is not None else "lone/none")  # (direct-only: never memoised)
        if with_reprobe:  # re-probes so far of auto reprobe's pool
            rp = pools["auto reprobe"].strategy.reprobe_watch  # type: ignore[attr-defined]
            row["reprobes"] = None if rp is None else rp.triggers
        for attr, tag in (("paces", ""), ("warm_paces", "_reused")):
            paces = getattr(auto, attr)
            row["h2d_us" + tag] = None if paces is None or paces[0].desc_us is None else round(paces[0].desc_us, 3)
            row["d2h_us" + tag] = None if paces is None or paces[1].desc_us is None else round(paces[1].desc_us, 3)
        cycles.append(row)
        k += 1
        time.sleep(0.02)  # a forward pass's compute between bursts
    better = [max(c["kernel"], c["direct"]) for c in cycles]
    gaps = [c["auto"] - b for c, b in zip(cycles, better)]
    summary = {
        "shape": shape, "layout": layout, "reuse": reuse, "hbm": hbm, "cycles": len(cycles),
        "median": {n: round(statistics.median(c[n] for c in cycles), 4) for n in names},
        "direct_better_share": round(sum(c["direct"] > c["kernel"] for c in cycles) / len(cycles), 3),
        "auto_by_direct_share": round(sum(c["auto_by"] == "direct" for c in cycles) / len(cycles), 3),
        "auto_within_3pts_share": round(sum(g >= -0.03 for g in gaps) / len(gaps), 3),
        "auto_gap_median": round(statistics.median(gaps), 4),
        "auto_probes": auto.pace_probes,  # type: ignore[attr-defined]
        # per candidate: the share of a burst's loads its pool's lane left to the normal path (median, mean)
        "lane_declined_share": {n: round(statistics.median(c[n + "_lane_declined"] for c in cycles) / len(layers), 3)
                                for n in names},
        "lane_declined_mean_share": {n: round(statistics.mean(c[n + "_lane_declined"] for c in cycles) / len(layers), 3)
                                     for n in names},
        # per candidate: cycles whose burst had a call over STALL_US, and in which cycles (the first ones: warm-up)
        "stalls": {n: [i for i, c in enumerate(cycles) if c[n + "_call_us_median_max"][1] > STALL_US] for n in names},
        # per candidate: the host microseconds of a burst's first calls, one by one (median over cycles), then the
        # median call's (where a new batch's decisions and plans cost the host, against its steady lane)
        "call_us_first": {n: [round(statistics.median(c[n + "_call_us_first"][i] for c in cycles), 1)
                              for i in range(min(FIRST_CALLS, len(layers)))] for n in names},
        "call_us_median": {n: round(statistics.median(c[n + "_call_us_median_max"][0] for c in cycles), 1)
                           for n in names},
    }
    for name in (n for n in names if n in TAGS):
        tag, other = TAGS[name], [c[name] - b for c, b in zip(cycles, better)]
        summary[f"{tag}_within_3pts_share"] = round(sum(g >= -0.03 for g in other) / len(other), 3)
        summary[f"{tag}_gap_median"] = round(statistics.median(other), 4)
        if _by(name) in cycles[0]:
            summary[f"{tag}_by_direct_share"] = round(sum(c[_by(name)] == "direct" for c in cycles) / len(cycles), 3)
    if with_watch:
        watch = pools["auto forward=watch"].strategy.watch  # type: ignore[attr-defined]
        summary["watch_timings"] = None if watch is None else watch.timings
        summary["watch_last_share"] = None if watch is None else watch.last_share
    if profile and profs:
        _write_profiles(profs, Path(profile) / f"pace-profile-{shape}-{layout}-{'reuse' if reuse else 'fresh'}.txt")
    return {"summary": summary, "cycles": cycles}


def _write_profiles(profs: dict[str, cProfile.Profile], path: Path) -> None:
    """Each candidate's bursts of the cell, cProfiled: the top functions by own time and by cumulative time (where
    ``auto``'s calls spend host time that ``direct``'s own do not)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for name, prof in profs.items():
            for sort in ("tottime", "cumtime"):
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats(sort).print_stats(30)
                f.write(f"===== {name}, by {sort} =====\n{buf.getvalue()}\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default="mla61x576-fp8,mla61x656-fp8")
    p.add_argument("--layouts", default="layer_first,page_first_direct")
    p.add_argument("--seconds", type=float, default=30.0, help="per cell")
    p.add_argument("--with-off", action="store_true", help="also auto with pace=False")
    p.add_argument("--reuse", action="store_true", help="the same index tensors every cycle")
    p.add_argument("--with-memory", action="store_true", help="also auto with forward='memory'")
    p.add_argument("--with-watch", action="store_true", help="also auto with forward='watch'")
    p.add_argument("--hbm", action="store_true", help="every burst beside a memory-bound reduction on another stream")
    p.add_argument("--with-prefetch", action="store_true",
                   help="also auto with prefetch=True (and forward='watch' with it, with --with-watch)")
    p.add_argument("--min-samples", type=int, default=None,
                   help="samples a host-pace estimate needs (default: hicache's MIN_SAMPLES), to compare settings")
    p.add_argument("--stale-s", type=float, default=None,
                   help="seconds after which a host-pace measure ages (default: hicache's STALE_S), to compare settings")
    p.add_argument("--warm-stale-s", type=float, default=None,
                   help="the same for measures of reused plans (default: hicache's WARM_STALE_S)")
    p.add_argument("--with-lone-off", action="store_true", help="also auto with lone=False (no lone-load rule)")
    p.add_argument("--with-direct-only", action="store_true",
                   help="also auto whose kernel candidate is removed (its lane then routes every call to direct's)")
    p.add_argument("--with-reprobe", action="store_true",
                   help="also auto with reprobe=True (a burst held on the kernel by a slow host is measured again once "
                        "the kernel's calls speed up)")
    p.add_argument("--lane-detail", action="store_true",
                   help="per auto burst: its candidates' lane calls and declines inside auto's lane, and what pick() "
                        "returned on the normal path (the cycle's auto_inner); the other pools' lanes get the same "
                        "counting layer (their _inner), so that every burst pays its host time alike")
    p.add_argument("--tight-gap-us", type=float, default=None,
                   help="TIGHT_GAP_US (default: hicache's): the copier clock's burst gap and auto's lone-load gap at once, "
                        "to compare settings")
    p.add_argument("--fed-share", type=float, default=None,
                   help="FED_SHARE (default: hicache's): the share of a transfer's time at link speed that a burst's "
                        "measured submission may take and still go to the copy engine, to compare settings")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="cProfile each candidate's bursts; one pace-profile-SHAPE-LAYOUT-MODE.txt per cell into DIR")
    args = p.parse_args()
    require_cuda(__file__)
    from hicache_core.backends import pace  # read when a pool is made: a setting applies to the pools made next
    if args.min_samples is not None:
        pace.MIN_SAMPLES = args.min_samples
    if args.stale_s is not None:
        pace.STALE_S = args.stale_s
    if args.warm_stale_s is not None:
        pace.WARM_STALE_S = args.warm_stale_s
    if args.fed_share is not None:
        if not args.fed_share > 0:
            p.error("--fed-share must be > 0")
        from hicache_core.backends import auto, auto_rules  # both read it per call: auto.py holds its own name
        auto_rules.FED_SHARE = auto.FED_SHARE = args.fed_share  # type: ignore[misc]
    if args.tight_gap_us is not None:
        from hicache_core.backends import memcpy  # read per call (QueueClock.eager, .lone)
        memcpy.TIGHT_GAP_US = args.tight_gap_us
    out = []
    for shape in args.shapes.split(","):
        for layout in args.layouts.split(","):
            cell = run_cell(shape, layout, args.seconds, args.with_off, args.reuse, args.with_memory, args.hbm,
                            args.with_watch, args.with_prefetch, args.profile, args.lane_detail,
                            args.with_lone_off, args.with_direct_only, args.with_reprobe)
            print(json.dumps(cell["summary"]), flush=True)
            out.append(cell)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
