"""Where a kernel ``load_layer``'s host time goes, layer by layer of the call (H200 probe).

Usage (GPU): ``python benchmarks/launch_cost.py [--out FILE]``.  For MLA 61 x 576 bf16 and
MHA 80 x 8 x 128 bf16 (4096 tokens, 64-token pages, GPU-resident indices), layouts
``layer_first`` and ``page_first_direct``, TMA loads on and off, it times (mean host
microseconds per call over a burst of calls, median of several bursts):

* ``load_layer``: the whole public call (in a burst: the link busy with the calls before it), replays on
  (:mod:`hicache_core.replay`: the same index tensors, so every call after the first is replayed);
* ``relaunch``: a replayed call's driver launches alone (``cuLaunchKernel`` through :mod:`ctypes`, parameters
  resolved): the floor of ``load_layer``;
* ``load_layer_ctypes``: ``load_layer`` with the driver called through :mod:`ctypes` (``HICACHE_C_LAUNCH=0``;
  ``c_launch``: whether the compiled call was used otherwise);
* ``load_layer_noreplay``: the same with ``HICACHE_REPLAY=0`` (every call derives its launches);
* ``load_layer_idle``: the whole call issued on an idle GPU (synchronised before each call), as a lone
  load pays it;
* ``check``: the pool's argument checks alone;
* ``transfer``: the strategy's transfer alone (index placement and launches);
* ``load_layer_triton``: the whole call with the CUDA driver launch off (Triton's compiled-kernel launcher);
* ``launcher``: hicache's :class:`~hicache_core.launch.Launcher` call for the layer's launches, Triton's launcher;
* ``launcher_driver``: the same call through the CUDA driver launch (:mod:`hicache_core.drvlaunch`);
* ``compiled_run``: Triton's compiled-kernel ``run`` with the same arguments (no key lookup);
* ``encode``: Triton's own per-launch encoding of one host tensor descriptor (TMA only);
* ``empty_kernel``: ``compiled.run`` of a one-argument kernel (the floor of a Triton launch).

Timings are host-side only; nothing here is a pass/fail check.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import torch

from hicache_core import claunch
from hicache_core.bench import SHAPES, _device_buffers, _indices
from hicache_core.kernel_support import transfer_indices
from hicache_core.launch import set_driver_launch
from hicache_core.pool import HostKVPool, allocate_host_buffers
from hicache_core.registry import create_registry
from hicache_core.replay import set_replay
from host_time import _sync_us  # benchmarks/ is this script's directory

try:
    from benchmarks.needs_cuda import require_cuda
except ImportError:  # run as a script: its folder, benchmarks/, is on sys.path
    from needs_cuda import require_cuda


def _per_call_us(fn: Callable[[], Any], calls: int = 60, rounds: int = 7) -> float:
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) * 1e6 / calls)
    torch.cuda.synchronize()
    return round(statistics.median(out), 2)


def _empty_kernel_us() -> float | None:
    import triton
    import triton.language as tl

    @triton.jit
    def _empty(x):
        tl.store(x + tl.program_id(0), 1)

    x = torch.zeros(4, dtype=torch.int32, device="cuda")
    compiled = _empty[(1,)](x)
    stream = torch.cuda.current_stream().cuda_stream
    return _per_call_us(lambda: compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata,
                                             None, None, None, x))


def _encode_us(compiled: Any, args: list) -> float | None:
    """Triton's per-launch encoding of the first host descriptor in ``args`` (None where this Triton differs)."""
    try:
        from triton.backends.nvidia import driver as nv

        meta = getattr(compiled.metadata, "tensordesc_meta", None)
        desc = next(a for a in args if hasattr(a, "block_shape") and hasattr(a, "base"))
        fn = nv.make_tensordesc_arg
        try:
            fn(desc, meta[0])
            call = lambda: fn(desc, meta[0])  # noqa: E731
        except TypeError:
            fn(desc, meta[0], None)
            call = lambda: fn(desc, meta[0], None)  # noqa: E731
        return _per_call_us(call, calls=200)
    except Exception as exc:  # internal API of this Triton version
        print("encode: not measured:", repr(exc))
        return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="launch_cost.json")
    args = ap.parse_args()
    require_cuda(__file__)
    reg = create_registry()
    rows: list[dict[str, Any]] = []
    floor = _empty_kernel_us()
    print(f"empty kernel compiled.run: {floor} us", flush=True)
    for shape in ("mla61x576-bf16", "mha80x8x128-bf16"):
        spec = SHAPES[shape](4096, 64, torch.device("cuda"))
        dev = _device_buffers(spec, 2 * 4096 + 64)
        h, _, d = _indices(spec, torch.Generator().manual_seed(0))
        for layout in ("layer_first", "page_first_direct"):
            for tma in (True, False):
                host = allocate_host_buffers(reg.layout(layout).plan(spec), pin_memory=True)
                pool = HostKVPool(spec, layout, "kernel", dev, host_buffers=host, registry=reg, validate="shapes",
                                  strategy_options={"tma": tma})
                layer = spec.layer_map.device_layers[0]
                strat, binding = pool.strategy, pool.binding
                prep = binding.scratch[strat.name]
                for lch in (prep.launcher, prep.tma_launcher):
                    if lch is not None:
                        lch._compiled.clear()  # launchers are shared by pools: keep this pool's handle only
                        lch._driver.clear()
                pool.load_layer(layer, h, d)
                row: dict[str, Any] = {"shape": shape, "layout": layout, "tma": tma, "strategy": strat.name}
                hits = prep.replays.hits if prep.replays is not None else 0
                row["load_layer"] = _per_call_us(lambda: pool.load_layer(layer, h, d))
                row["c_launch"] = claunch.module() is not None
                claunch.set_c_launch(False)
                row["load_layer_ctypes"] = _per_call_us(lambda: pool.load_layer(layer, h, d))
                claunch.set_c_launch(None)
                row["replayed"] = (prep.replays.hits if prep.replays is not None else 0) - hits
                ready = getattr(prep.replays, "_ready", [{}])[False].get(layer) if prep.replays is not None else None
                if ready is not None:  # the layer's launches as a replay makes them: ctypes and the driver only
                    rb = ready[0]

                    def relaunch_only() -> None:
                        for st, g, values in ready[1]:
                            st.kernel.relaunch(g, rb.stream, st.packed, values)
                    row["relaunch"] = _per_call_us(relaunch_only)
                set_replay(False)
                row["load_layer_noreplay"] = _per_call_us(lambda: pool.load_layer(layer, h, d))
                set_replay(None)
                row["load_layer_idle"] = round(_sync_us(lambda: pool.load_layer(layer, h, d), 60), 2)
                set_driver_launch(False)
                row["load_layer_triton"] = _per_call_us(lambda: pool.load_layer(layer, h, d))
                set_driver_launch(None)
                row["check"] = _per_call_us(lambda: pool._check(h, d, to_host=False), calls=200)
                row["transfer"] = _per_call_us(lambda: strat.transfer(binding, h, d, layer, to_host=False))
                row["indices"] = _per_call_us(lambda: transfer_indices(binding, h, d), calls=200)
                hh, dd = transfer_indices(binding, h, d)
                n = int(hh.numel())
                plan = prep.tma[0] if prep.tma else None
                if plan is not None:
                    lv = plan[layer][0]
                    t = prep.tuning.tma_load
                    launch_args = list(lv.args)
                    for name, i in lv.slots:
                        launch_args[i] = {"host_idx": hh, "dev_idx": dd, "n": n}[name]
                    grid = max(1, min(t.programs, -(-n // lv.tokens)))
                    launcher, key, dyn, warps = prep.tma_launcher, lv.key, prep.tma_dynamic, t.num_warps
                    row["launches_per_layer"] = len(plan[layer])
                else:
                    lv = prep.launches[0][False]
                    ents = prep.groups[0].entries(layer)
                    launch_args = list(lv.args)
                    for name, i in lv.slots:
                        launch_args[i] = {"host_idx": hh, "dev_idx": dd, "n": n, "ents": ents,
                                          "n_ents": ents.numel()}[name]
                    grid = max(1, min(lv.tuning.programs, -(-n // lv.tokens) * ents.numel()))
                    launcher, key, dyn, warps = prep.launcher, lv.key, prep.dynamic, lv.tuning.num_warps
                    row["launches_per_layer"] = len(prep.groups)
                row["launcher"] = _per_call_us(lambda: launcher(grid, launch_args, num_warps=warps, static_key=key,
                                                                dynamic=dyn))
                packs: dict = {}
                before = launcher.driver_launches
                row["launcher_driver"] = _per_call_us(lambda: launcher(grid, launch_args, num_warps=warps,
                                                                       static_key=key, dynamic=dyn, packs=packs))
                row["driver_used"] = launcher.driver_launches > before
                compiled = next(iter(launcher._compiled.values()), None)
                if compiled is not None:
                    stream = torch.cuda.current_stream().cuda_stream
                    row["compiled_run"] = _per_call_us(
                        lambda: compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata,
                                             None, None, None, *launch_args))
                    if plan is not None:
                        row["encode"] = _encode_us(compiled, launch_args)
                    row["n_args"] = len(launch_args)
                row["empty_kernel"] = floor
                rows.append(row)
                print(json.dumps(row), flush=True)
                del pool, host
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
