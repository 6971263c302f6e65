"""One context-parallel rank of the two-GPU test: run by ``test_two_rank_cp.py``, one process per GPU.

``python tests/gpu/cp_rank.py --rank R --world 2 --port P --out DIR``.  The rank
joins an NCCL group (``tcp://127.0.0.1:P``, or ``file://FILE`` with ``--rendezvous FILE``
instead of ``--port``: no port to race for), owns its contiguous shard of a
61-layer MLA model (576 bf16 rows, 64-token pages) plus one MTP draft layer,
and for every strategy the registry can pick:

* backs up its shard and loads it back layer by layer (``backup_all_layers`` or
  ``backup_layer`` for every layer id, then ``load_layer`` for every layer id), bit-exact
  against the ``reference`` backend with canary-filled host slots (the conformance kit),
  with the host padded to the largest shard (SGLang's rule) and packed;
* calls ``load_layer`` / ``backup_layer`` for every layer it does not own: each must
  return ``False`` and move nothing (device rows and host buffers byte-identical).

It all-gathers what each rank owns and which strategies it covered, and writes
``DIR/rank<R>.json``.  A watchdog ends the process after ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hicache_core import HostKVPool, LayerMap, PoolSpec, Registry, create_registry  # noqa: E402
from hicache_core.errors import ResolutionError  # noqa: E402
from hicache_core.testing.conformance import Case, check_strategy, fill_canary, make_device_buffers  # noqa: E402

from gpu_support import pick_rows, strategy_targets  # noqa: E402

LAYERS, DRAFTS, PAGE, PAGES = 61, 1, 64, 4


def make_case(rank: int, world: int, *, pad: bool) -> Case:
    """The rank's MLA pool: ``LayerMap.sharded_cp(61, world, rank)`` plus the draft layer, host padded or packed."""
    lmap = LayerMap.sharded_cp(LAYERS, world, rank, draft_layers=DRAFTS, pad_to_largest=pad)

    def build(device: torch.device) -> PoolSpec:
        return PoolSpec.mla(layer_map=lmap, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                            page_size=PAGE, capacity=PAGE * PAGES, device=device)
    return Case(f"mla576-bf16-ps{PAGE}-cp{rank}of{world}{'-padded' if pad else ''}-drafts", build)


def round_trips(reg: Registry, case: Case, target: tuple[str, str, str], device: torch.device, *,
                per_layer: bool) -> str:
    """``ok``, ``unserved: <reason>`` or ``FAIL: <error>``: backup all layers then load layer by layer
    (CPU indices), and with ``per_layer`` also backup layer by layer then load layer by layer (device indices)."""
    layout, backend, name = target
    try:
        check_strategy(reg, case, layout, backend, variant="shuffled-i64", device=device, strategy=name)
        if per_layer:
            check_strategy(reg, case, layout, backend, variant="reversed-i64-dev", device=device, strategy=name,
                           per_layer_backup=True, seed=3)
    except ResolutionError as exc:
        return "unserved: " + str(exc).splitlines()[1].strip()[:200]
    except Exception as exc:  # noqa: BLE001 - reported, the parent test fails on it
        return f"FAIL: {type(exc).__name__}: {exc}"[:2000]
    return "ok"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def unowned_moves_nothing(reg: Registry, case: Case, target: tuple[str, str, str], device: torch.device) -> str:
    """``ok`` when every call for a layer this rank does not own returns ``False`` and changes no byte."""
    layout, backend, name = target
    spec = case.build(device)
    if reg.try_resolve(spec, layout, backend, override=name)[0] is None:
        return "unserved"
    gen = torch.Generator().manual_seed(11)
    dev = make_device_buffers(spec, case, gen)
    pool = HostKVPool(spec, layout, backend, dev, registry=reg, strategy=name, pin_memory=device.type == "cuda")
    fill_canary(pool)
    h, src, dst = pick_rows(spec, gen)
    pool.backup_all_layers(h, src)
    _sync(device)
    host_before = {k: t.clone() for k, t in pool.host_buffers.items()}
    problems = []
    for layer in range(spec.layer_map.num_device_layers):
        if spec.layer_map.owns(layer):
            continue
        before = {k: lst[layer].clone() for k, lst in dev.items() if lst[layer] is not None}
        moved = (pool.load_layer(layer, h, dst), pool.backup_layer(layer, h, src))
        _sync(device)
        if moved != (False, False):
            problems.append(f"layer {layer}: (load_layer, backup_layer) returned {moved}")
        problems += [f"layer {layer}: device {k} changed" for k, t in before.items()
                     if not torch.equal(dev[k][layer].view(torch.uint8), t.view(torch.uint8))]
    problems += [f"host buffer {k!r} changed" for k, t in host_before.items()
                 if not torch.equal(pool.host_buffers[k].view(torch.uint8), t.view(torch.uint8))]
    return "ok" if not problems else "FAIL: " + "; ".join(problems[:10])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=2)
    meet = ap.add_mutually_exclusive_group(required=True)
    meet.add_argument("--port", type=int, help="join at tcp://127.0.0.1:PORT")
    meet.add_argument("--rendezvous", help="join through this file (file://; the ranks share it, no port needed)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=200.0, help="watchdog: dump stacks and exit after this")
    ap.add_argument("--cpu", action="store_true", help="smoke-test the script itself on CPU (gloo, no GPU)")
    ap.add_argument("--backends", default="", help="comma list: only these io_backends (default: all)")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.timeout, exit=True)
    t0 = time.monotonic()
    rank, world = args.rank, args.world
    if args.cpu:
        device, backend, name = torch.device("cpu"), "gloo", "cpu"
    else:
        torch.cuda.set_device(rank)
        device, backend = torch.device("cuda", rank), "nccl"
        name = torch.cuda.get_device_name(device)
    init = f"file://{os.path.abspath(args.rendezvous)}" if args.rendezvous else f"tcp://127.0.0.1:{args.port}"
    print(f"rank {rank}: {name}, joining {init} ({backend})", flush=True)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    result: dict = {"rank": rank, "world": world, "device": str(device)}
    try:
        reg = create_registry()
        only = {b for b in args.backends.split(",") if b}
        targets = [t for t in strategy_targets(reg) if not only or t[1] in only]
        padded, packed = make_case(rank, world, pad=True), make_case(rank, world, pad=False)
        lmap = padded.build(device).layer_map
        mine = {"rank": rank, "owned": list(lmap.device_layers), "num_device_layers": lmap.num_device_layers,
                "host_layer_num": lmap.host_layer_num, "targets": [list(t) for t in targets]}
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)
        result.update(mine, gathered=gathered)
        result["round_trip"], result["unowned"] = {}, {}
        for target in targets:
            key = "/".join(target)
            result["round_trip"][key] = {
                c.id: round_trips(reg, c, target, device, per_layer=c is padded) for c in (padded, packed)}
            result["unowned"][key] = unowned_moves_nothing(reg, padded, target, device)
            print(f"rank {rank}: {key}: {result['round_trip'][key]} unowned {result['unowned'][key]}", flush=True)
    except Exception:  # noqa: BLE001 - reported to the parent test
        result["error"] = traceback.format_exc()
        print(result["error"], flush=True)
    finally:
        result["seconds"] = round(time.monotonic() - t0, 1)
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f, indent=1)
        dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
