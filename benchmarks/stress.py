"""Reliability stress: interleaved transfers on several streams and pools, an SGLang-shaped
two-thread pattern, and a pool lifecycle leak check.  Every byte is checked against a reference model.

Usage (GPU, < 3 minutes on an H200)::

    python benchmarks/stress.py --out stress.json

CPU smoke run (seconds; generic backends only)::

    python benchmarks/stress.py --tiny --out stress.json

Phases:

``interleaved``
    ``--transfers`` random calls (``backup_all_layers``, ``backup_layer``, ``load_layer``;
    random page counts, random host pages, random device rows, indices on the CPU or the
    device) spread over ``--streams`` CUDA streams and every pool of ``--targets``.  A call
    waits (``Stream.wait_event``) only on the events of earlier calls that touch the same
    host pages or device rows (write-after-read, read-after-write, write-after-write).
    Device rows are split into a source region (only ever read by backups) and a target
    region (only written by loads); the model tracks which source rows every host page
    and target row must hold.  At the end every target row, every host page (read back
    through one more load), the untouched target rows and the source region are compared.
``sglang``
    One pool; a backup thread backs up pages on its own stream and hands them (with an
    event) to a loader thread, which loads them layer by layer on its own stream into
    target rows and hands the pages back (with an event) for reuse.
``lifecycle``
    ``--lifecycles`` times: build a pool (pinned host memory on CUDA), back up, load,
    drop it.  Live tensors, CUDA allocated/reserved memory and (where torch reports
    it) pinned host memory must not grow after the first few lifecycles.

Prints a summary, writes JSON to ``--out`` and exits 1 on any corrupt byte or leak,
2 when no target could be built.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import queue
import random
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache_core import HostKVPool, LayerMap, PoolSpec
from hicache_core.errors import HicacheError

log = logging.getLogger("stress")

GPU_TARGETS = "layer_first:kernel:mha,page_first:kernel:mla,page_first_direct:direct:mha,page_first_kv_split:kernel:mha"
CPU_TARGETS = "layer_first:direct:mha,page_first:reference:mla,page_first_direct:direct:mha"


# --- pools and the reference model -------------------------------------------------------

def make_spec(kind: str, device: torch.device, tiny: bool, page_size: int, pages: int) -> PoolSpec:
    layers = 3 if tiny else 8
    if kind == "mla":
        return PoolSpec.mla(layer_map=LayerMap.unsharded(layers), kv_lora_rank=32 if tiny else 512,
                            qk_rope_head_dim=8 if tiny else 64, dtype=torch.bfloat16, page_size=page_size,
                            capacity=page_size * pages, device=device)
    return PoolSpec.mha(layer_map=LayerMap.unsharded(layers), head_num=2 if tiny else 8, head_dim=8 if tiny else 128,
                        dtype=torch.bfloat16, page_size=page_size, capacity=page_size * pages, device=device)


@dataclass
class Subject:
    """A pool under test, its device buffers and the reference model of what every row must hold."""

    name: str
    pool: HostKVPool
    dev: dict[str, list[torch.Tensor]]  # per component, per layer: [rows, items]
    source_ref: dict[str, list[torch.Tensor]]  # CPU uint8 copies of the source region (rows 0..S-1)
    target_init: dict[str, list[torch.Tensor]]  # CPU uint8 copies of the target region at start
    host_model: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (layer, page) -> source rows
    target_model: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (layer, block) -> source rows
    page_written: dict[int, Any] = field(default_factory=dict)  # page -> event of the backup that wrote it
    page_reads: dict[int, list[Any]] = field(default_factory=dict)  # page -> events of loads reading it since
    block_written: dict[int, Any] = field(default_factory=dict)  # target block -> event of the load that wrote it

    @property
    def spec(self) -> PoolSpec:
        return self.pool.spec

    @property
    def layers(self) -> tuple[int, ...]:
        return self.spec.layer_map.device_layers


def as_rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1).view(torch.uint8)


def build_subject(name: str, layout: str, backend: str, spec: PoolSpec, seed: int) -> Subject:
    cap = spec.capacity
    gen = torch.Generator(device=spec.device).manual_seed(seed)  # random bytes made where they live
    dev: dict[str, list[torch.Tensor]] = {}
    for comp in spec.components:
        items = comp.row_bytes // comp.itemsize
        dev[comp.name] = [torch.randint(0, 256, (2 * cap, comp.row_bytes), dtype=torch.uint8, generator=gen,
                                        device=spec.device).view(comp.dtype).reshape(2 * cap, items)
                          for _ in range(spec.layer_map.num_device_layers)]
    pool = HostKVPool(spec, layout, backend, dev, pin_memory=spec.device.type == "cuda")
    for t in pool.host_buffers.values():
        t.view(torch.uint8).fill_(0xA5)
    src = {k: [as_rows(t[:cap]).cpu().clone() for t in lst] for k, lst in dev.items()}
    tgt = {k: [as_rows(t[cap:]).cpu().clone() for t in lst] for k, lst in dev.items()}
    return Subject(name, pool, dev, src, tgt)


class Lane:
    """A CUDA stream (or, on the CPU, nothing: calls run in order)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def context(self) -> Any:
        return torch.cuda.stream(self.stream) if self.stream is not None else _Null()

    def wait(self, events: list[Any]) -> None:
        if self.stream is not None:
            for ev in events:
                if ev is not None:
                    self.stream.wait_event(ev)

    def record(self) -> Any:
        if self.stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def expand(pages: torch.Tensor, ps: int, base: int = 0) -> torch.Tensor:
    return (pages.unsqueeze(1) * ps + torch.arange(ps)).reshape(-1) + base


def place(t: torch.Tensor, device: torch.device, rng: random.Random) -> torch.Tensor:
    """Indices as an engine might pass them: CPU int64, or device int32/int64 (made on the current stream)."""
    choice = rng.randrange(3)
    if choice == 0 or device.type != "cuda":
        return t
    return t.to(device, torch.int32 if choice == 1 else torch.int64)


# --- phase 1: interleaved ----------------------------------------------------------------

def backup(s: Subject, lane: Lane, rng: random.Random, gen: torch.Generator, max_pages: int, layer: int | None) -> None:
    ps, pages_n = s.spec.page_size, s.spec.num_pages
    k = rng.randint(1, max_pages)
    pages = torch.randperm(pages_n, generator=gen)[:k]
    rows = torch.randperm(s.spec.capacity, generator=gen)[: k * ps]
    lane.wait([s.page_written.get(p) for p in pages.tolist()] + [e for p in pages.tolist() for e in s.page_reads.get(p, [])])
    with lane.context():
        hi, di = place(expand(pages, ps), s.spec.device, rng), place(rows, s.spec.device, rng)
        if layer is None:
            s.pool.backup_all_layers(hi, di)
        else:
            s.pool.backup_layer(layer, hi, di)
    ev = lane.record()
    for i, p in enumerate(pages.tolist()):
        s.page_written[p], s.page_reads[p] = ev, []
        for L in (s.layers if layer is None else (layer,)):
            s.host_model[(L, p)] = rows[i * ps:(i + 1) * ps]


def load(s: Subject, lane: Lane, rng: random.Random, gen: torch.Generator, max_pages: int, layer: int) -> bool:
    ps = s.spec.page_size
    ready = [p for (L, p) in s.host_model if L == layer]
    if not ready:
        return False
    k = rng.randint(1, min(max_pages, len(ready)))
    pages = torch.tensor(rng.sample(ready, k))
    blocks = torch.randperm(s.spec.num_pages, generator=gen)[:k]
    lane.wait([s.page_written.get(p) for p in pages.tolist()] + [s.block_written.get(b) for b in blocks.tolist()])
    with lane.context():
        hi = place(expand(pages, ps), s.spec.device, rng)
        di = place(expand(blocks, ps, s.spec.capacity), s.spec.device, rng)
        s.pool.load_layer(layer, hi, di)
    ev = lane.record()
    for p, b in zip(pages.tolist(), blocks.tolist()):
        s.page_reads.setdefault(p, []).append(ev)
        s.block_written[b] = ev
        s.target_model[(layer, b)] = s.host_model[(layer, p)]
    return True


def verify(s: Subject) -> dict[str, int]:
    """Corrupt bytes in target rows, untouched target rows, source rows, and host pages (read back by a load)."""
    sync(s.spec.device)
    ps, cap = s.spec.page_size, s.spec.capacity
    bad = {"target": 0, "untouched": 0, "source": 0, "host": 0}
    for name, lst in s.dev.items():
        for L in s.layers:
            now = as_rows(lst[L]).cpu()
            bad["source"] += int((now[:cap] != s.source_ref[name][L]).sum())
            expected = s.target_init[name][L].clone()
            for (layer, b), src_rows in s.target_model.items():
                if layer == L:
                    expected[b * ps:(b + 1) * ps] = s.source_ref[name][L][src_rows]
            diff = now[cap:] != expected
            touched = torch.zeros(cap, dtype=torch.bool)
            for (layer, b) in s.target_model:
                if layer == L:
                    touched[b * ps:(b + 1) * ps] = True
            bad["target"] += int(diff[touched].sum())
            bad["untouched"] += int(diff[~touched].sum())
    for L in s.layers:  # read every modelled host page back through one load into the target region
        pages = sorted(p for (layer, p) in s.host_model if layer == L)
        if not pages:
            continue
        s.pool.load_layer(L, expand(torch.tensor(pages), ps), expand(torch.arange(len(pages)), ps, cap))
        sync(s.spec.device)
        for name, lst in s.dev.items():
            got = as_rows(lst[L]).cpu()[cap:cap + len(pages) * ps]
            want = torch.cat([s.source_ref[name][L][s.host_model[(L, p)]] for p in pages])
            bad["host"] += int((got != want).sum())
    return bad


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(subjects: list[Subject], args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    rng, gen = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    lanes = [Lane(device) for _ in range(args.streams)]
    counts = {"backup_all_layers": 0, "backup_layer": 0, "load_layer": 0}
    t0 = time.perf_counter()
    done = 0
    while done < args.transfers:
        s, lane = rng.choice(subjects), rng.choice(lanes)
        r = rng.random()
        if r < 0.25:
            backup(s, lane, rng, gen, args.max_pages, None)
            counts["backup_all_layers"] += 1
        elif r < 0.45:
            backup(s, lane, rng, gen, args.max_pages, rng.choice(s.layers))
            counts["backup_layer"] += 1
        elif load(s, lane, rng, gen, args.max_pages, rng.choice(s.layers)):
            counts["load_layer"] += 1
        else:
            continue
        done += 1
    sync(device)
    seconds = time.perf_counter() - t0
    if args.inject_fault:  # proves the check can fail: flip one byte of a backed-up host page
        s = subjects[0]
        layer, page = next(iter(s.host_model))
        s.pool.set_page(page, s.pool.get_page(page) ^ 0xFF)
    corrupt = {s.name: verify(s) for s in subjects}
    return {"transfers": done, "calls": counts, "streams": args.streams, "pools": [s.name for s in subjects],
            "seconds": round(seconds, 3), "corrupt_bytes": corrupt,
            "corrupt_total": sum(sum(v.values()) for v in corrupt.values())}


# --- phase 2: SGLang-shaped threads ------------------------------------------------------------

def sglang_threads(s: Subject, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    ps, n_pages = s.spec.page_size, s.spec.num_pages
    batch = max(1, min(args.max_pages, n_pages // 4))
    to_loader: queue.Queue = queue.Queue()
    free: queue.Queue = queue.Queue()
    for start in range(0, n_pages - batch + 1, batch):
        free.put((torch.arange(start, start + batch), None))
    errors: list[BaseException] = []
    loaded: list[tuple[int, int, torch.Tensor]] = []  # (layer, target block, source rows), in load order
    gen = torch.Generator().manual_seed(args.seed + 1)

    def backup_thread() -> None:
        lane = Lane(device)
        try:
            for _ in range(args.sglang_batches):
                pages, ev = free.get(timeout=60)
                lane.wait([ev])
                rows = torch.randperm(s.spec.capacity, generator=gen)[: batch * ps]
                with lane.context():
                    s.pool.backup_all_layers(expand(pages, ps), rows.to(device))
                to_loader.put((pages, rows, lane.record()))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
        finally:
            to_loader.put(None)

    def load_thread() -> None:
        lane = Lane(device)
        block = 0
        try:
            while (item := to_loader.get(timeout=60)) is not None:
                pages, rows, ev = item
                lane.wait([ev])
                blocks = (torch.arange(batch) + block) % n_pages
                block = (block + batch) % n_pages
                with lane.context():
                    hi, di = expand(pages, ps).to(device), expand(blocks, ps, s.spec.capacity).to(device)
                    for L in s.layers:  # one pair of index tensors for every layer, as a forward pass does
                        s.pool.load_layer(L, hi, di)
                for i, b in enumerate(blocks.tolist()):
                    for L in s.layers:
                        loaded.append((L, b, rows[i * ps:(i + 1) * ps]))
                free.put((pages, lane.record()))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=backup_thread, name="backup", daemon=True),
               threading.Thread(target=load_thread, name="load", daemon=True)]  # a hang must not keep the process
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    hung = [t.name for t in threads if t.is_alive()]
    sync(device)
    s.target_model.clear()
    s.host_model.clear()  # the host check of verify() is for phase 1; here the loads carry the check
    for L, b, rows in loaded:
        s.target_model[(L, b)] = rows
    corrupt = verify(s)
    return {"pool": s.name, "batches": args.sglang_batches, "pages_per_batch": batch,
            "seconds": round(time.perf_counter() - t0, 3), "errors": [repr(e) for e in errors], "hung": hung,
            "corrupt_bytes": corrupt, "corrupt_total": sum(corrupt.values())}


# --- phase 3: lifecycles -----------------------------------------------------------------------

def live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance on some torch module attributes warns of deprecation
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def memory(device: torch.device) -> dict[str, int]:
    out = {"live_tensors": live_tensors()}
    if device.type == "cuda":
        out["cuda_allocated"] = torch.cuda.memory_allocated(device)
        out["cuda_reserved"] = torch.cuda.memory_reserved(device)
        host_stats = getattr(torch.cuda, "host_memory_stats", None)  # pinned (caching host allocator)
        try:
            st = host_stats() if host_stats is not None else {}
        except RuntimeError:
            st = {}
        for key, name in (("allocated_bytes.all.current", "pinned_allocated"), ("allocated_bytes.current", "pinned_allocated"),
                          ("reserved_bytes.all.current", "pinned_reserved"), ("reserved_bytes.current", "pinned_reserved")):
            if key in st and name not in out:
                out[name] = int(st[key])
    return out


def rss_bytes() -> int | None:
    """Resident set size of this process (informational: the allocator may keep freed pages)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def lifecycles(target: tuple[str, str, str], args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    layout, backend, kind = target
    warmup = min(5, args.lifecycles)
    start: dict[str, int] = {}
    for i in range(args.lifecycles):
        if i == warmup:
            sync(device)
            start = memory(device)
        spec = make_spec(kind, device, args.tiny, args.page_size, min(args.pages, 32))
        s = build_subject("lifecycle", layout, backend, spec, args.seed + i)
        slots = s.pool.alloc(spec.page_size * 2)
        s.pool.backup_all_layers(slots, torch.arange(slots.numel()))
        s.pool.load_layer(s.layers[0], slots, torch.arange(slots.numel()) + spec.capacity)
        s.pool.free(slots)
        sync(device)
        del s, slots, spec
    sync(device)
    end = memory(device)
    growth = {k: end[k] - start.get(k, end[k]) for k in end}
    return {"target": ":".join(target), "lifecycles": args.lifecycles, "after_warmup": start, "end": end,
            "growth": growth, "leak": any(v > 0 for v in growth.values()), "rss_bytes_end": rss_bytes(),
            "pinned_reported": "pinned_allocated" in end or device.type != "cuda"}


# --- main --------------------------------------------------------------------------------------

def parse_targets(text: str) -> list[tuple[str, str, str]]:
    out = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != 3 or parts[2] not in ("mha", "mla"):
            raise SystemExit(f"--targets: {item!r} is not layout:io_backend:mha|mla")
        out.append((parts[0], parts[1], parts[2]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="path of the JSON result")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and counts (CPU smoke run)")
    p.add_argument("--targets", default=None, help=f"layout:io_backend:kind,... (GPU default {GPU_TARGETS}; "
                                                   f"CPU default {CPU_TARGETS})")
    p.add_argument("--transfers", type=int, default=None, help="interleaved calls (default 2000; tiny 120)")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--page-size", type=int, default=None, help="tokens per page (default 16; tiny 2)")
    p.add_argument("--pages", type=int, default=None, help="host pages per pool (default 256; tiny 8)")
    p.add_argument("--max-pages", type=int, default=None, help="most pages per call (default 32; tiny 3)")
    p.add_argument("--sglang-batches", type=int, default=None, help="batches of the two-thread phase (default 200; tiny 6)")
    p.add_argument("--lifecycles", type=int, default=None, help="pool lifecycles (default 100; tiny 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inject-fault", action="store_true", help="corrupt one host page on purpose (must then fail)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    tiny = args.tiny
    defaults = dict(transfers=(120, 2000), page_size=(2, 16), pages=(8, 256), max_pages=(3, 32),
                    sglang_batches=(6, 200), lifecycles=(8, 100))
    for k, (small, big) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, small if tiny else big)
    targets = parse_targets(args.targets or (GPU_TARGETS if device.type == "cuda" else CPU_TARGETS))
    result: dict[str, Any] = {"device": str(device), "torch": torch.__version__, "args": vars(args), "skipped": {}}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    subjects = []
    for i, (layout, backend, kind) in enumerate(targets):
        name = f"{layout}:{backend}:{kind}"
        try:
            spec = make_spec(kind, device, tiny, args.page_size, args.pages)
            subjects.append(build_subject(name, layout, backend, spec, args.seed * 100 + i))
        except HicacheError as exc:  # e.g. a strategy that cannot run here: recorded, not fatal
            result["skipped"][name] = str(exc).splitlines()[0]
            log.warning("skipped %s: %s", name, result["skipped"][name])
    if not subjects:
        log.error("no target could be built: %s", result["skipped"])
        _write(args.out, result)
        return 2
    t0 = time.perf_counter()
    result["interleaved"] = interleaved(subjects, args, device)
    log.info("interleaved: %d transfers (%s) on %d streams over %d pools in %.1f s: %d corrupt bytes %s",
             result["interleaved"]["transfers"], result["interleaved"]["calls"], args.streams, len(subjects),
             result["interleaved"]["seconds"], result["interleaved"]["corrupt_total"], result["interleaved"]["corrupt_bytes"])
    # Triton's CPU interpreter keeps global launch state: two threads launching at once break it
    threaded = [x for x in subjects if device.type == "cuda" or not x.name.split(":")[1] == "kernel"]
    if threaded:
        result["sglang"] = sglang_threads(threaded[0], args, device)
    else:
        result["sglang"] = {"pool": "(none: Triton's interpreter is not thread-safe; run on CUDA)", "batches": 0,
                            "seconds": 0.0, "errors": [], "hung": [], "corrupt_total": 0}
    sg = result["sglang"]
    log.info("sglang-shaped threads on %s: %d batches in %.1f s: %d corrupt bytes, errors %s, hung %s",
             sg["pool"], sg["batches"], sg["seconds"], sg["corrupt_total"], sg["errors"], sg["hung"])
    del subjects
    first = next((t for t in targets if ":".join(t) not in result["skipped"]))
    result["lifecycle"] = lc = lifecycles(first, args, device)
    log.info("lifecycle %s x %d: growth after warm-up %s -> %s", lc["target"], lc["lifecycles"], lc["growth"],
             "LEAK" if lc["leak"] else "no growth")
    result["seconds"] = round(time.perf_counter() - t0, 1)
    failed = (result["interleaved"]["corrupt_total"] or sg["corrupt_total"] or sg["errors"] or sg["hung"] or lc["leak"])
    result["ok"] = not failed
    _write(args.out, result)
    log.info("stress %s in %.1f s; JSON in %s", "PASSED" if not failed else "FAILED", result["seconds"], args.out)
    return 1 if failed else 0


def _write(path: str, result: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)


if __name__ == "__main__":
    sys.exit(main())
