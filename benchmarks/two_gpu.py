"""Two GPUs moving KV at once, each over its own host link: per-GPU and aggregate GB/s.

Usage (a machine with >= 2 GPUs)::

    python benchmarks/two_gpu.py --out DIR [--gpus 0,1] [--tokens 4096,32768]

One process per GPU, as serving engines run (each bound to the CPUs that
``nvidia-smi topo -m`` lists as its GPU's affinity, unless ``--bind none``).
MLA 61 x 576 bf16 pools, 64-token pages, random pages, index tensors on the GPU.
For each token count, each operation (``backup_all_layers``; a load burst: one
``load_layer`` per layer back to back) and each transfer (pinned ``copy_`` of
the same bytes in the same direction = ``memcpy``, then every strategy that
resolves for the ``--io-backends`` in the ``--layouts``), the processes meet
at a barrier and measure

* ``alone``: each GPU in turn while the others wait;
* ``both``: every GPU at the same time.

Each measurement is a timed run of back-to-back calls lasting about
``--seconds`` (CUDA events).  Data are checked bit-exact (round trip against
the original rows) before timing.  The ratio of a GPU is its GB/s over its own
memcpy GB/s under the same condition.  The aggregate is all bytes moved by
all GPUs over the union of their timed windows (wall clock); ``overlap`` is the
fraction of that union during which all of them were running.

Prints the machine topology and markdown tables; writes ``two_gpu.json`` and
``two_gpu.md`` to ``--out``.  A hard ``--timeout`` kills the workers and keeps
what was measured.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue as queue_mod
import re
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

try:
    from benchmarks.needs_cuda import require_cuda
except ImportError:  # run as a script: its folder, benchmarks/, is on sys.path
    from needs_cuda import require_cuda

SHAPE = "mla61x576-bf16"
BACKUP, BURST = "backup_all_layers", "load_layer burst"
OPS = {BACKUP: True, BURST: False}  # op -> to_host
MEMCPY = ("-", "memcpy", "memcpy")


# -- topology ------------------------------------------------------------------------------
def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"({' '.join(cmd)} failed: {exc})"


def topology() -> dict[str, str]:
    """``nvidia-smi topo -m`` and each GPU's bus id, PCIe link and NUMA node."""
    return {
        "topo": _run(["nvidia-smi", "topo", "-m"]),
        "links": _run(["nvidia-smi", "--query-gpu=index,name,pci.bus_id,pcie.link.gen.current,pcie.link.gen.max,"
                       "pcie.link.width.current,pcie.link.width.max", "--format=csv"]),
    }


def _cpu_list(text: str) -> list[int] | None:
    cpus: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not m:
            return None
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        cpus += range(lo, hi + 1)
    return cpus or None


def cpu_affinity(topo: str, gpus: list[int]) -> dict[int, list[int]]:
    """GPU index -> CPUs from the ``CPU Affinity`` column of ``nvidia-smi topo -m`` (missing when unparsable)."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", topo)  # some nvidia-smi versions underline the header
    lines = [line for line in plain.splitlines() if line.strip()]
    if not lines:
        return {}
    header = [c.strip() for c in lines[0].split("\t")]
    if "CPU Affinity" not in header:
        return {}
    col = header.index("CPU Affinity")
    out = {}
    for line in lines[1:]:
        cells = [c.strip() for c in line.split("\t")]
        m = re.fullmatch(r"GPU(\d+)", cells[0]) if cells else None
        if m and int(m.group(1)) in gpus and col < len(cells):
            cpus = _cpu_list(cells[col])
            if cpus:
                out[int(m.group(1))] = cpus
    return out


# -- worker (one process per GPU) -------------------------------------------------------------
def _timed(fn: Callable[[], Any], reps: int) -> tuple[float, float, float]:
    """(seconds on the GPU by CUDA events, wall start, wall end) of ``reps`` back-to-back calls."""
    import torch

    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.monotonic()
    e0.record()
    for _ in range(reps):
        fn()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) / 1e3, t0, time.monotonic()


class _Worker:
    def __init__(self, idx: int, gpu: int, cfg: dict[str, Any], barrier: Any, out: Any) -> None:
        self.idx, self.gpu, self.cfg, self.barrier, self.out = idx, gpu, cfg, barrier, out

    def measure(self, fn: Callable[[], Any] | None) -> tuple[dict[str, Any], str | None]:
        """Warm up, then alone (each GPU in turn), then all GPUs at once.  Every barrier is always reached."""
        res: dict[str, Any] = {}
        error = None
        reps = 0
        if fn is not None:
            try:
                fn()
                fn()
                one, _, _ = _timed(fn, 1)
                reps = max(3, min(2000, math.ceil(self.cfg["seconds"] / max(one, 1e-6))))
            except Exception as exc:  # noqa: BLE001 - recorded in the row
                error = f"{type(exc).__name__}: {exc}"
        for turn in range(self.cfg["workers"]):
            self.barrier.wait()
            if turn == self.idx and reps and error is None:
                try:
                    res["alone"] = _timed(fn, reps)  # type: ignore[arg-type]
                except Exception as exc:  # noqa: BLE001
                    error = f"{type(exc).__name__}: {exc}"
            self.barrier.wait()
        self.barrier.wait()
        if reps and error is None:
            try:
                res["both"] = _timed(fn, reps)  # type: ignore[arg-type]
            except Exception as exc:  # noqa: BLE001
                error = f"{type(exc).__name__}: {exc}"
        self.barrier.wait()
        res["reps"] = reps
        return res, error

    def calls(self, target: tuple[str, str, str], spec: Any, dev: Any, idx: tuple[Any, Any, Any],
              hosts: dict[str, Any], reg: Any) -> dict[str, Callable[[], Any]]:
        import torch

        from hicache_core.bench import _check
        from hicache_core.pool import HostKVPool, allocate_host_buffers

        h, s, d = idx
        nbytes = spec.bytes_per_token * h.numel()
        if target == MEMCPY:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            buf = torch.empty(nbytes, dtype=torch.uint8, device=spec.device)
            return {BACKUP: lambda: host.copy_(buf, non_blocking=True), BURST: lambda: buf.copy_(host, non_blocking=True)}
        layout, backend, name = target
        if layout not in hosts:
            hosts.clear()  # one layout's host buffers at a time
            hosts[layout] = allocate_host_buffers(reg.layout(layout).plan(spec), pin_memory=True)
        pool = HostKVPool(spec, layout, backend, dev, host_buffers=hosts[layout], strategy=name, registry=reg,
                          validate="shapes")
        _check(pool, dev, h, s, d)
        layers = spec.layer_map.device_layers

        def burst() -> None:
            for layer in layers:
                pool.load_layer(layer, h, d)
        return {BACKUP: lambda: pool.backup_all_layers(h, s), BURST: burst}

    def run(self) -> None:
        import torch

        from hicache_core.bench import SHAPES, _device_buffers, _indices, _targets
        from hicache_core.registry import create_registry

        torch.cuda.set_device(self.gpu)
        reg = create_registry()
        gen = torch.Generator().manual_seed(0)
        ps = self.cfg["page_size"]
        for n in self.cfg["tokens"]:
            spec = SHAPES[SHAPE](n, ps, torch.device("cuda", self.gpu))
            torch.cuda.empty_cache()
            dev = _device_buffers(spec, 2 * n + ps)
            idx = _indices(spec, gen)
            targets = [MEMCPY] + _targets(reg, spec, self.cfg["layouts"] or None, self.cfg["backends"])
            hosts: dict[str, Any] = {}
            for target in targets:
                try:
                    calls: dict[str, Callable[[], Any]] = self.calls(target, spec, dev, idx, hosts, reg)
                    setup_error = None
                except Exception as exc:  # noqa: BLE001 - the other GPUs still need this worker at the barriers
                    calls, setup_error = {}, f"{type(exc).__name__}: {exc}"
                for op, to_host in OPS.items():
                    res, error = self.measure(calls.get(op))
                    self.out.put(("row", self.gpu, dict(
                        gpu=self.gpu, tokens=n, layout=target[0], io_backend=target[1], strategy=target[2], op=op,
                        to_host=to_host, bytes=spec.bytes_per_token * n, error=setup_error or error, **res)))
                calls = {}
            del dev, hosts
        self.out.put(("done", self.gpu, None))


def _worker_main(idx: int, gpu: int, cfg: dict[str, Any], barrier: Any, out: Any) -> None:
    cpus = cfg["cpus"].get(str(gpu))
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as exc:
            out.put(("log", gpu, f"GPU{gpu}: could not bind to CPUs {cpus[:4]}...: {exc}"))
    try:
        _Worker(idx, gpu, cfg, barrier, out).run()
    except BaseException:  # noqa: BLE001 - reported to the parent; the barrier is broken so others stop too
        out.put(("error", gpu, traceback.format_exc()))
        barrier.abort()


# -- parent: results and tables ----------------------------------------------------------------
def _gbps(row: dict[str, Any], phase: str) -> float | None:
    m = row.get(phase)
    return row["bytes"] * row["reps"] / m[0] / 1e9 if m else None


def summarise(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(per-GPU rows with ratios to that GPU's memcpy, aggregate rows per configuration)."""
    memcpy = {(r["gpu"], r["tokens"], r["op"]): r for r in rows if r["strategy"] == "memcpy"}
    per_gpu = []
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        base = memcpy.get((r["gpu"], r["tokens"], r["op"]))
        alone, both = _gbps(r, "alone"), _gbps(r, "both")
        m_alone = _gbps(base, "alone") if base else None
        m_both = _gbps(base, "both") if base else None
        per_gpu.append(dict(
            tokens=r["tokens"], op=r["op"], layout=r["layout"], strategy=r["strategy"], gpu=r["gpu"],
            alone_gbps=alone, both_gbps=both, memcpy_alone_gbps=m_alone, memcpy_both_gbps=m_both,
            ratio_alone=alone / m_alone if alone and m_alone else None,
            ratio_both=both / m_both if both and m_both else None, error=r.get("error")))
        groups.setdefault((r["tokens"], r["op"], r["layout"], r["strategy"]), []).append(r)
    per_gpu.sort(key=lambda r: (r["tokens"], r["op"], r["strategy"] != "memcpy", r["layout"], r["strategy"], r["gpu"]))
    agg = []
    for (tokens, op, layout, strategy), rs in groups.items():
        both = [r for r in rs if r.get("both")]
        if len(both) < 2 or len(both) != len(rs):
            agg.append(dict(tokens=tokens, op=op, layout=layout, strategy=strategy, gpus=len(rs), aggregate_gbps=None))
            continue
        start, end = min(r["both"][1] for r in both), max(r["both"][2] for r in both)
        common = min(r["both"][2] for r in both) - max(r["both"][1] for r in both)
        moved = sum(r["bytes"] * r["reps"] for r in both)
        alone_sum = sum(_gbps(r, "alone") or 0.0 for r in rs)
        total = moved / (end - start) / 1e9
        agg.append(dict(tokens=tokens, op=op, layout=layout, strategy=strategy, gpus=len(rs), aggregate_gbps=total,
                        sum_both_gbps=sum(_gbps(r, "both") or 0.0 for r in both), sum_alone_gbps=alone_sum,
                        scaling=total / alone_sum if alone_sum else None, overlap=max(0.0, common) / (end - start)))
    agg.sort(key=lambda a: (a["tokens"], a["op"], a["strategy"] != "memcpy", a["layout"], a["strategy"]))
    return per_gpu, agg


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "—" if x is None else fmt.format(x)


def markdown(per_gpu: list[dict[str, Any]], agg: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"### Two GPUs at once: {meta['shape']}, page {meta['page_size']}, {meta['gpus_desc']}", ""]
    if "seconds" in meta:
        bind = meta["cpu_binding"]
        bind = ", ".join(f"GPU{g} CPUs {c}" for g, c in bind.items()) if isinstance(bind, dict) else bind
        lines += [f"One process per GPU (CPU binding: {bind}), timed runs of ~{meta['seconds']} s "
                  f"(CUDA events), index tensors {meta['indices']}, {meta['date']}, torch {meta['torch']}.", ""]
    lines += ["Per GPU (GB/s; ratio = that GPU's GB/s over its own pinned memcpy of the same bytes, same condition):", ""]
    lines += ["| tokens | op | layout | strategy | GPU | alone | both at once | memcpy alone | memcpy both | "
              "ratio alone | ratio both |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in per_gpu:
        err = f" ({r['error'][:60]})" if r.get("error") else ""
        lines.append(f"| {r['tokens']} | {r['op']} | {r['layout']} | {r['strategy']}{err} | {r['gpu']} | "
                     f"{_f(r['alone_gbps'])} | {_f(r['both_gbps'])} | {_f(r['memcpy_alone_gbps'])} | "
                     f"{_f(r['memcpy_both_gbps'])} | {_f(r['ratio_alone'], '{:.2f}')} | {_f(r['ratio_both'], '{:.2f}')} |")
    lines += ["", "Aggregate (all GPUs at once; bytes over the union of the timed windows):", ""]
    lines += ["| tokens | op | layout | strategy | GPUs | aggregate GB/s | sum of alone | scaling | overlap |",
              "|---|---|---|---|---|---|---|---|---|"]
    for a in agg:
        lines.append(f"| {a['tokens']} | {a['op']} | {a['layout']} | {a['strategy']} | {a['gpus']} | "
                     f"{_f(a['aggregate_gbps'])} | {_f(a.get('sum_alone_gbps'))} | {_f(a.get('scaling'), '{:.2f}')} | "
                     f"{_f(a.get('overlap'), '{:.2f}')} |")
    return "\n".join(lines) + "\n"


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="two-gpu-results", help="folder for two_gpu.json and two_gpu.md")
    ap.add_argument("--gpus", default="0,1", help="GPU indices, one process each")
    ap.add_argument("--tokens", default="4096,32768")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--layouts", default="layer_first,page_first_direct", help="comma list ('' = all installed)")
    ap.add_argument("--io-backends", default="direct,kernel,auto", help="those not registered are left out")
    ap.add_argument("--seconds", type=float, default=0.25, help="length of each timed run")
    ap.add_argument("--bind", choices=("topo", "none"), default="topo", help="bind each process to its GPU's CPUs")
    ap.add_argument("--timeout", type=float, default=240.0, help="hard limit (s); partial results are kept")
    args = ap.parse_args(argv)
    require_cuda(__file__)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.monotonic()

    import torch

    from hicache_core.registry import create_registry

    gpus = _ints(args.gpus)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(gpus) < 2 or max(gpus) >= have:
        print(f"two_gpu: needs the GPUs {gpus} (at least two); this machine has {have}", file=sys.stderr)
        return 2
    reg = create_registry()
    backends = [b for b in args.io_backends.split(",") if b in reg.io_backends]
    left_out = [b for b in args.io_backends.split(",") if b and b not in reg.io_backends]
    layouts = [x for x in args.layouts.split(",") if x in reg.layouts]
    left_out += [x for x in args.layouts.split(",") if x and x not in reg.layouts]
    topo = topology()
    cpus = cpu_affinity(topo["topo"], gpus) if args.bind == "topo" else {}
    names = [torch.cuda.get_device_name(g) for g in gpus]
    meta = dict(shape=SHAPE, page_size=args.page_size, tokens=_ints(args.tokens), gpus=gpus, gpu_names=names,
                gpus_desc=f"{len(gpus)} x {names[0]}", torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                argv=sys.argv[1:], backends=backends, not_installed=left_out,
                layouts=layouts, seconds=args.seconds, indices="on the GPU",
                cpu_binding={str(g): f"{c[0]}..{c[-1]} ({len(c)} CPUs)" for g, c in cpus.items()} or "none")
    print("nvidia-smi topo -m:\n" + topo["topo"] + "\n\n" + topo["links"] + "\n", flush=True)
    print(f"layouts {layouts}, backends {backends} (not installed: {left_out}); CPU binding {meta['cpu_binding']}", flush=True)
    cfg = dict(tokens=meta["tokens"], page_size=args.page_size, layouts=meta["layouts"], backends=backends,
               seconds=args.seconds, workers=len(gpus), cpus={str(g): c for g, c in cpus.items()})
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(gpus), timeout=max(30.0, args.timeout / 2))
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker_main, args=(i, g, cfg, barrier, out), daemon=True) for i, g in enumerate(gpus)]
    for p in procs:
        p.start()
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    done: set[int] = set()
    deadline = t_start + args.timeout
    while len(done) < len(gpus) and time.monotonic() < deadline:
        try:
            kind, gpu, payload = out.get(timeout=1.0)
        except queue_mod.Empty:
            if all(not p.is_alive() for p in procs):
                break
            continue
        if kind == "row":
            rows.append(payload)
            print(f"GPU{gpu} {payload['tokens']} {payload['layout']}/{payload['strategy']} {payload['op']}: "
                  f"alone {_f(_gbps(payload, 'alone'))} GB/s, both {_f(_gbps(payload, 'both'))} GB/s"
                  + (f" ERROR {payload['error']}" if payload.get("error") else ""), flush=True)
        elif kind in ("error", "log"):
            errors.append(f"GPU{gpu}: {payload}")
            print(f"GPU{gpu}: {payload}", file=sys.stderr, flush=True)
        else:
            done.add(gpu)
    incomplete = len(done) < len(gpus)
    for p in procs:
        p.join(timeout=0.1 if incomplete else 10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    if incomplete:
        errors.append(f"incomplete: stopped after {time.monotonic() - t_start:.0f} s (--timeout {args.timeout:.0f})")
        print(errors[-1], file=sys.stderr, flush=True)
    per_gpu, agg = summarise(rows)
    table = markdown(per_gpu, agg, meta)
    print("\n" + table, flush=True)
    with open(os.path.join(args.out, "two_gpu.json"), "w") as f:
        json.dump(dict(meta=meta, topology=topo, rows=rows, per_gpu=per_gpu, aggregate=agg, errors=errors,
                       incomplete=incomplete), f, indent=1)
    with open(os.path.join(args.out, "two_gpu.md"), "w") as f:
        f.write(table + "\nTopology (`nvidia-smi topo -m`):\n\n```\n" + topo["topo"] + "\n```\n\n```\n"
                + topo["links"] + "\n```\n")
    return 1 if incomplete or errors else 0


if __name__ == "__main__":
    sys.exit(main())
