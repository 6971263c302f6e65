"""Where ``auto``'s host-pace rule sits against the outcomes of a ``benchmarks/pace_probe.py --reuse`` run.

Usage: ``python benchmarks/pace_bins.py PACE.json [--link-gbps G] [--follow 7] [--bin 0.05] [--json OUT]``
(CPU; reads the probe's JSON, runs nothing on a GPU).

Per cell of the probe it prints:

- ``direct``'s ratio to memcpy by its own host time per layer (4 us buckets), beside the kernel's median: the host
  time at which the copy engine stops beating the kernel on that host;
- by the kernel pool's own host time per layer (1 us buckets): ``direct``'s host time and both routes' ratios in the
  same cycles, i.e. how well the kernel route's calls tell the host's speed (what ``auto``'s ``reprobe`` option reads),
  and, per factor of ``--kernel-factors``, a counterfactual route per burst: ``direct`` where the previous burst's
  kernel host time was within that factor of its least in the run, else the kernel (an upper bound for any rule that
  reads the kernel's calls: it switches at once and pays no probe);
- after each cycle in which ``auto`` measured the host again (``auto_probed``), the estimate it then held for
  reused plans (``h2d_us_reused``, microseconds per descriptor) in bins of ``--bin``, and the medians of ``direct``,
  the kernel and ``auto`` over the next ``--follow`` cycles: which estimates preceded cycles where the copy engine
  was the faster route;
- with ``--link-gbps`` (the calibration's ``link_gbps``), the largest estimate :func:`~hicache_core.backends.
  auto_rules.fed` lets a reused-index burst of one layer take to the copy engine: ``FED_SHARE`` times the layer's
  time at link speed, less the runtime calls' modelled cost, per descriptor;
- with ``--link-gbps``, per share of ``--shares`` (candidate values of ``FED_SHARE``), what that rule would have made
  of the probes' estimates, counterfactually: after each probe the route it picks at that share (``direct`` where the
  estimate is within the share's limit, else the kernel), scored by that route's median over the next ``--follow``
  cycles (both routes ran in every cycle, in their own pools), against the better of the two.  Where the estimate
  picks ``direct``, ``auto`` would have measured the host again and might have moved within those cycles: a bound on
  what the threshold alone can win, not a replay.

A probe's estimate comes from the first :data:`~hicache_core.backends.pace.MIN_SAMPLES` calls of a burst after the
host idled between bursts, and an estimate that sends the burst to the kernel gets no more samples until it ages:
the bins show whether such first estimates stand for the host's pace in the cycles that follow.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: Width of the buckets of ``direct``'s own host time per layer, microseconds.
HOST_BUCKET_US = 4.0
#: The probe's workload (``hicache_core.bench._workload``'s defaults): tokens and page size.
TOKENS, PAGE_SIZE = 4096, 64


def layer_geometry(shape: str, layout: str) -> tuple[int, int]:
    """Bytes of one layer's load and descriptors of one plain copy-engine submission of it, for ``shape`` (a
    :data:`hicache_core.bench.SHAPES` name) at the probe's workload, counted as one per page and host segment of the
    layout's plan (pages in random order: no two are contiguous)."""
    import torch

    from hicache_core.bench import SHAPES
    from hicache_core.registry import create_registry

    spec = SHAPES[shape](TOKENS, PAGE_SIZE, torch.device("cpu"))
    layers = max(1, len(spec.layer_map.device_layers))
    nbytes = spec.bytes_per_token // layers * TOKENS
    plan = create_registry().layout(layout).plan(spec)
    return nbytes, TOKENS // PAGE_SIZE * max(1, len(plan.segments))


def kernel_buckets(cycles: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per 1 us bucket of the kernel pool's host time per layer: the cycles, and the medians of ``direct``'s host time
    per layer and of both routes' ratios in them (cycles without those host times are left out)."""
    by: dict[int, list[dict[str, Any]]] = {}
    for c in cycles:
        if c.get("kernel_host_us") is None or c.get("direct_host_us") is None:
            continue
        by.setdefault(int(c["kernel_host_us"]), []).append(c)
    return [{"kernel_host_us_from": k, "cycles": len(v),
             "direct_host_us": round(statistics.median(c["direct_host_us"] for c in v), 1),
             "direct": round(statistics.median(c["direct"] for c in v), 4),
             "kernel": round(statistics.median(c["kernel"] for c in v), 4)} for k, v in sorted(by.items())]


def kernel_rule(cycles: list[dict[str, Any]], factors: list[float]) -> list[dict[str, Any]]:
    """Per factor: bursts from the second on, routed by the previous burst's kernel host time (``direct`` within
    ``factor`` times its least, else the kernel), scored against the better route of each burst: mean and median
    gap in points of memcpy and the share within 3 points; the first row (``factor`` ``None``) is ``auto`` as run."""
    rows = [c for c in cycles if c.get("kernel_host_us") is not None]
    if len(rows) < 2:
        return []
    least = min(c["kernel_host_us"] for c in rows)
    best = [max(c["direct"], c["kernel"]) for c in rows[1:]]

    def row(factor: float | None, got: list[float]) -> dict[str, Any]:
        gaps = [(g - b) * 100 for g, b in zip(got, best)]
        return {"factor": factor, "bursts": len(gaps), "gap_mean": round(statistics.mean(gaps), 2),
                "gap_median": round(statistics.median(gaps), 2),
                "within_3": round(sum(x >= -3.0 for x in gaps) / len(gaps), 3)}

    out = [row(None, [c["auto"] for c in rows[1:]])]
    for f in factors:
        out.append(row(f, [c["direct"] if prev["kernel_host_us"] <= f * least else c["kernel"]
                           for prev, c in zip(rows, rows[1:])]))
    return out


def estimate_limit(nbytes: int, descs: int, link_gbps: float, share: float | None = None) -> float:
    """The largest per-descriptor estimate with which :func:`~hicache_core.backends.auto_rules.fed` sends a burst's
    one-layer load of ``nbytes`` in ``descs`` descriptors to the copy engine (``forward="compute"``), at ``share``
    in place of ``FED_SHARE`` where given."""
    from hicache_core.backends.auto_rules import FED_SHARE
    from hicache_core.backends.cudart import batch_schedule
    from hicache_core.backends.pace import MODEL_CALL_US

    link_us = nbytes / (link_gbps * 1e3)
    return ((FED_SHARE if share is None else share) * link_us
            - len(batch_schedule(descs, eager=False)) * MODEL_CALL_US) / descs


def host_buckets(cycles: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``direct``'s ratio by its own host time per layer, one row per :data:`HOST_BUCKET_US` bucket (cycles of probes
    that did not record that time, before 2026-12-01's ``b`` run, are left out)."""
    by: dict[float, list[float]] = {}
    for c in cycles:
        if c.get("direct_host_us") is None:
            continue
        lo = c["direct_host_us"] // HOST_BUCKET_US * HOST_BUCKET_US
        by.setdefault(lo, []).append(c["direct"])
    return [{"host_us_from": lo, "cycles": len(v), "direct": round(statistics.median(v), 4)}
            for lo, v in sorted(by.items())]


def probes(cycles: list[dict[str, Any]], follow: int) -> list[tuple[float, float, float, float, str]]:
    """After each cycle in which ``auto`` probed the host and ``follow`` cycles followed: its estimate for reused
    plans (read in the next cycle's row, the state the next burst starts from), the medians of ``direct``, the kernel
    and ``auto`` over those cycles, and the route ``auto`` took in the first of them."""
    out = []
    for i, c in enumerate(cycles):
        nxt = cycles[i + 1:i + 1 + follow]
        if not c.get("auto_probed") or len(nxt) < follow or nxt[0].get("h2d_us_reused") is None:
            continue
        out.append((float(nxt[0]["h2d_us_reused"]), statistics.median(x["direct"] for x in nxt),
                    statistics.median(x["kernel"] for x in nxt), statistics.median(x["auto"] for x in nxt),
                    nxt[0].get("auto_by", "?")))
    return out


def estimate_bins(cycles: list[dict[str, Any]], follow: int, width: float) -> list[dict[str, Any]]:
    """:func:`probes`' estimates binned by ``width``, with the medians of the three routes over the cycles after
    them."""
    by: dict[int, list[tuple[float, float, float, str]]] = {}
    for est, direct, kernel, auto, auto_by in probes(cycles, follow):
        by.setdefault(int(est / width), []).append((direct, kernel, auto, auto_by))
    rows = []
    for k, v in sorted(by.items()):
        rows.append({"estimate_from": round(k * width, 4), "estimate_to": round((k + 1) * width, 4),
                     "probes": len(v), "direct": round(statistics.median(x[0] for x in v), 4),
                     "kernel": round(statistics.median(x[1] for x in v), 4),
                     "auto": round(statistics.median(x[2] for x in v), 4),
                     "auto_by_direct": sum(x[3] == "direct" for x in v)})
    return rows


def share_sweep(cycles: list[dict[str, Any]], follow: int, nbytes: int, descs: int, link_gbps: float,
                shares: list[float]) -> list[dict[str, Any]]:
    """Per share: its limit (:func:`estimate_limit`) and, over :func:`probes`, the mean of the route that limit picks
    (``direct`` at an estimate within it, else the kernel) less the better of the two, in points of memcpy, and the
    probes it leaves within 3 points of the better; the first row (``share`` ``None``) is what ``auto`` measured."""
    found = probes(cycles, follow)
    if not found:
        return []
    best = [max(direct, kernel) for _, direct, kernel, _, _ in found]

    def row(share: float | None, limit: float | None, got: list[float]) -> dict[str, Any]:
        gaps = [(g - b) * 100 for g, b in zip(got, best)]
        return {"share": share, "limit": None if limit is None else round(limit, 4), "probes": len(found),
                "gap_points": round(statistics.mean(gaps), 2), "within_3": sum(x >= -3.0 for x in gaps)}

    rows = [row(None, None, [auto for _, _, _, auto, _ in found])]
    for share in shares:
        limit = estimate_limit(nbytes, descs, link_gbps, share)
        rows.append(row(share, limit, [direct if est <= limit else kernel for est, direct, kernel, _, _ in found]))
    return rows


def report(cells: list[dict[str, Any]], follow: int, width: float,
           link_gbps: float | None, shares: list[float] | None = None,
           kernel_factors: list[float] | None = None) -> list[dict[str, Any]]:
    """One entry per reused-index cell of a pace probe's JSON (``{"summary", "cycles"}`` each); cells run with new
    indices every batch are left out (their estimate is the planning calls', ``h2d_us``)."""
    out = []
    for cell in cells:
        s, cycles = cell["summary"], cell["cycles"]
        if not s.get("reuse") or not cycles:
            continue
        entry: dict[str, Any] = {"shape": s["shape"], "layout": s["layout"], "cycles": len(cycles),
                                 "kernel": round(statistics.median(c["kernel"] for c in cycles), 4),
                                 "by_direct_host_time": host_buckets(cycles),
                                 "by_kernel_host_time": kernel_buckets(cycles),
                                 "by_kernel_rule": kernel_rule(cycles, kernel_factors or []),
                                 "by_estimate": estimate_bins(cycles, follow, width)}
        if link_gbps is not None:
            nbytes, descs = layer_geometry(s["shape"], s["layout"])
            entry.update(layer_bytes=nbytes, descriptors=descs,
                         layer_us_at_link=round(nbytes / (link_gbps * 1e3), 2),
                         estimate_limit=round(estimate_limit(nbytes, descs, link_gbps), 4),
                         by_share=share_sweep(cycles, follow, nbytes, descs, link_gbps, shares or []))
        out.append(entry)
    return out


def _print(entry: dict[str, Any]) -> None:
    print(f"{entry['shape']} {entry['layout']}: {entry['cycles']} cycles, kernel {entry['kernel']:.3f}")
    if "estimate_limit" in entry:
        print(f"  a layer: {entry['layer_bytes']} B in {entry['descriptors']} descriptors, "
              f"{entry['layer_us_at_link']} us at link speed; auto's limit {entry['estimate_limit']:.3f} us/descriptor")
    _section("direct by its host time per layer", entry["by_direct_host_time"],
             lambda r: f"{r['host_us_from']:5.0f}+ us  {r['cycles']:4d} cycles  direct {r['direct']:.3f}")
    if entry.get("by_kernel_host_time"):
        _section("by the kernel pool's host time per layer", entry["by_kernel_host_time"],
                 lambda r: f"{r['kernel_host_us_from']:3d}+ us  {r['cycles']:4d} cycles  direct's host time "
                           f"{r['direct_host_us']:5.1f} us  direct {r['direct']:.3f}  kernel {r['kernel']:.3f}")
    _counterfactual("each burst routed by the previous one's kernel host time", entry.get("by_kernel_rule", []),
                    lambda r: f"direct within {r['factor']:.2f}x the least",
                    lambda r: f"mean {r['gap_mean']:+6.2f}  median {r['gap_median']:+6.2f}  within 3 points "
                              f"{r['within_3']:.0%} of {r['bursts']}")
    _section("after a probe, by auto's estimate for reused plans (us/descriptor)", entry["by_estimate"],
             lambda r: f"{r['estimate_from']:.2f}-{r['estimate_to']:.2f}  {r['probes']:3d} probes  direct "
                       f"{r['direct']:.3f}  kernel {r['kernel']:.3f}  auto {r['auto']:.3f}  (auto on direct after "
                       f"{r['auto_by_direct']})")
    _counterfactual("the route each probe's estimate picks at a share", entry.get("by_share", []),
                    lambda r: f"share {r['share']:.2f} (limit {r['limit']:.3f})",
                    lambda r: f"{r['gap_points']:+6.2f}  within 3 points after {r['within_3']} of {r['probes']}")


def _section(title: str, rows: list[dict[str, Any]], line: Callable[[dict[str, Any]], str]) -> None:
    """Print a titled section, a line per row."""
    print(f"  {title}:")
    for r in rows:
        print(f"    {line(r)}")


def _counterfactual(title: str, rows: list[dict[str, Any]], name: Callable[[dict[str, Any]], str],
                    figures: Callable[[dict[str, Any]], str]) -> None:
    """Print a counterfactual's rows (the first: ``auto`` as run), when it has any beside that one."""
    if len(rows) < 2:
        return
    print(f"  counterfactual, {title} (points of memcpy against the better route):")
    for i, r in enumerate(rows):
        print(f"    {'auto as run' if i == 0 else name(r):30s} {figures(r)}")


def _positive(p: argparse.ArgumentParser, flag: str, raw: str) -> list[float]:
    """``raw`` as comma-separated positive numbers, else ``p`` exits naming ``flag``."""
    try:
        values = [float(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        p.error(f"{flag} {raw!r}: give comma-separated numbers, e.g. 1.1,1.3")
    if any(not x > 0 for x in values):
        p.error(f"{flag} {raw!r}: every value must be a positive number")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pace_json", help="a benchmarks/pace_probe.py --reuse result")
    p.add_argument("--link-gbps", type=float, default=None, help="the calibration's link_gbps (prints auto's limit)")
    p.add_argument("--follow", type=int, default=7, help="cycles after a probe that its estimate is judged by")
    p.add_argument("--bin", type=float, default=0.05, help="width of the estimate's bins, us per descriptor")
    p.add_argument("--shares", default="1.0,1.1,1.2,1.3,1.4,1.5",
                   help="comma-separated candidate FED_SHARE values for the counterfactual (with --link-gbps)")
    p.add_argument("--kernel-factors", default="1.2,1.3,1.4",
                   help="comma-separated factors of the least kernel host time for the kernel-rule counterfactual")
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args(argv)
    if args.follow < 1 or args.bin <= 0:
        p.error("--follow must be >= 1 and --bin > 0")
    shares, factors = (_positive(p, flag, raw) for flag, raw in (("--shares", args.shares),
                                                                ("--kernel-factors", args.kernel_factors)))
    with open(args.pace_json) as f:
        entries = report(json.load(f), args.follow, args.bin, args.link_gbps, shares, factors)
    if not entries:
        print(f"{args.pace_json}: no reused-index cell (run pace_probe.py with --reuse)", file=sys.stderr)
        return 1
    for e in entries:
        _print(e)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(entries, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
