"""What one kernel launch costs the host, by route (H200 probe for the replayed ``load_layer``).

Usage (GPU): ``python benchmarks/launch_floor.py [--out FILE]``.  Mean host microseconds per launch (median of
several bursts of launches, each burst synchronised before it starts) of:

* ``triton_run``: Triton's compiled-kernel launcher (a C extension) for a one-pointer empty kernel;
* ``ctypes_cdll`` / ``ctypes_pydll``: ``cuLaunchKernel`` of the same kernel through :mod:`ctypes` with prebuilt C
  arguments (as :mod:`hicache_core.drvlaunch`), releasing the GIL (``CDLL``) or not (``PyDLL``);
* ``c_loop``: the same launch repeated by a C loop (a helper built here with the system compiler): the driver's
  own cost, with no Python per launch;
* ``replay_relaunch`` / ``replay_relaunch_ctypes`` / ``replay_c_loop``: a replayed MLA ``layer_first`` load's
  launch (TMA kernel, its packed parameters) through :meth:`~hicache_core.drvlaunch.DriverKernel.relaunch`
  (the compiled call of :mod:`hicache_core.claunch` where built; then through ctypes), and repeated by the C loop;
* ``load_layer`` / ``load_layer_ctypes``: the whole replayed public call, for reference; ``load_layer_nolane``: the
  same on a second pool without the pool's fast path (the pool's checks, then the strategy's replay);
* ``load_layer_new_batch`` / ``..._nolane``: per call of a batch loaded layer by layer with index tensors the pool
  has not seen (an engine's pattern: each batch's first call is checked and resolved, the others replay).
  These four are timed in alternating rounds (a drift of the host's speed reaches them alike);
* ``c_loop_ex`` / ``c_loop_ex_pdl``: the C loop through ``cuLaunchKernelEx``, with no attribute, and with the
  programmatic stream serialization attribute for the kernel compiled with ``launch_pdl`` (a dependent launch's
  driver cost);
* ``backup_<shape>_pdl`` / ``..._plain``: a replayed all-layer backup (``layer_first``, 4096 tokens) split into
  launches, with dependent launches and without (``backup_pdl``), per driver launch, in alternating rounds, with
  ``..._call_us`` per call and ``..._launches``: whether dependent launches cost the caller's thread more.

Host timings only; nothing here is a pass/fail check.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import itertools
import statistics
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.needs_cuda import require_cuda  # noqa: E402
from hicache_core import claunch, drvlaunch  # noqa: E402
from hicache_core.bench import SHAPES, _device_buffers, _indices  # noqa: E402
from hicache_core.pool import HostKVPool, allocate_host_buffers  # noqa: E402
from hicache_core.registry import create_registry  # noqa: E402
from launch_cost import _per_call_us  # type: ignore[import-not-found]  # noqa: E402  (benchmarks/ is this script's directory)

_C = r"""
#include <stddef.h>
#include <string.h>
%(launch_ex_types)s
typedef int (*launch_t)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**,
                        void**);
int loop_launch(void* launch, void* fn, unsigned grid, unsigned block, unsigned shared, void* stream, void** params,
                int n) {
  int res = 0;
  for (int i = 0; i < n && !res; ++i)
    res = ((launch_t)launch)(fn, grid, 1, 1, block, 1, 1, shared, stream, params, 0);
  return res;
}
/* the same through cuLaunchKernelEx, with the programmatic stream serialization attribute on (pdl) or no attribute */
int loop_launch_ex(void* launch_ex, void* fn, unsigned grid, unsigned block, unsigned shared, void* stream,
                   void** params, int n, int pdl) {
  launch_attr_t attr;
  memset(&attr, 0, sizeof attr);
  attr.id = PDL_ATTRIBUTE;
  attr.value.on = 1;
  launch_config_t cfg = {grid, 1, 1, block, 1, 1, shared, stream, pdl ? &attr : NULL, pdl ? 1u : 0u};
  int res = 0;
  for (int i = 0; i < n && !res; ++i)
    res = ((launch_ex_t)launch_ex)(&cfg, fn, params, 0);
  return res;
}
""" % {"launch_ex_types": claunch.LAUNCH_EX_TYPES}


def _helper() -> Any:
    d = tempfile.mkdtemp()
    src, lib = os.path.join(d, "floor.c"), os.path.join(d, "floor.so")
    Path(src).write_text(_C)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", src, "-o", lib], check=True)
    h = ctypes.CDLL(lib)
    h.loop_launch.restype = ctypes.c_int
    h.loop_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    h.loop_launch_ex.restype = ctypes.c_int
    h.loop_launch_ex.argtypes = h.loop_launch.argtypes + [ctypes.c_int]
    return h


def _alternating(fns: dict[str, tuple[Callable[[], Any], int]], rounds: int = 9) -> dict[str, float]:
    """Per launch, each ``(fn, launches)`` of ``fns`` timed in turn, one short round each, ``rounds`` times over:
    the median of each one's rounds."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn, _ in fns.values():
        fn()
    for _ in range(rounds):
        for name, (fn, launches) in fns.items():
            times[name].append(_per_call_us(fn, calls=max(5, 100 // launches), rounds=1) / launches)
    return {name: round(statistics.median(t), 2) for name, t in times.items()}


def _per_launch_us(fn: Callable[[], Any], launches: int = 1, calls: int = 100) -> float:
    """:func:`launch_cost._per_call_us` of ``fn`` (after one warm-up call) per launch (``fn`` makes ``launches``)."""
    fn()
    return round(_per_call_us(fn, calls=calls) / launches, 2)


def _relaunches(fn: Callable[[], Any]) -> int:
    """Driver launches a replayed call of ``fn`` makes (:meth:`~hicache_core.drvlaunch.DriverKernel.relaunch` calls)."""
    count, real = [0], drvlaunch.DriverKernel.relaunch

    def counting(self: Any, *a: Any, **kw: Any) -> Any:
        count[0] += 1
        return real(self, *a, **kw)
    drvlaunch.DriverKernel.relaunch = counting  # type: ignore[method-assign]
    try:
        fn()
    finally:
        drvlaunch.DriverKernel.relaunch = real  # type: ignore[method-assign]
    return count[0]


def _split_backups(reg: Any) -> dict[str, Any]:
    """Host time of a replayed all-layer backup split into launches, with dependent launches (``backup_pdl``, the
    default on compute capability >= 9.0) and without, two pools of each shape timed in alternating rounds: per call
    and per driver launch (``backup_<shape>_<pdl|plain>`` us per launch, ``..._call_us``, ``..._launches``)."""
    row: dict[str, Any] = {}
    for shape in ("mla61x576-bf16", "mha80x8x128-bf16"):
        spec = SHAPES[shape](4096, 64, torch.device("cuda"))
        hi, si, _ = _indices(spec, torch.Generator().manual_seed(1))
        fns: dict[str, tuple[Callable[[], Any], int]] = {}
        for mode, on in (("pdl", True), ("plain", False)):
            pool = HostKVPool(spec, "layer_first", "kernel", _device_buffers(spec, 2 * 4096 + 64), registry=reg,
                              host_buffers=allocate_host_buffers(reg.layout("layer_first").plan(spec), pin_memory=True),
                              strategy_options={"backup_pdl": on}, validate="shapes")
            call: Callable[[], Any] = functools.partial(pool.backup_all_layers, hi, si)
            for _ in range(3):  # compile, record, replay
                call()
            torch.cuda.synchronize()
            n = _relaunches(call)
            key = f"backup_{shape.split('-')[0]}_{mode}"
            row[f"{key}_launches"] = n
            fns[key] = (call, max(n, 1))
        per_launch = _alternating(fns)
        for key, (_, n) in fns.items():
            row[key] = per_launch[key]
            row[f"{key}_call_us"] = round(per_launch[key] * n, 1)
        del fns
        torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="launch_floor.json")
    args = ap.parse_args()
    require_cuda(__file__)
    import triton
    import triton.language as tl

    @triton.jit
    def _empty(x):
        tl.store(x + tl.program_id(0), 1)

    row: dict[str, Any] = {"gpu": torch.cuda.get_device_name()}
    x = torch.zeros(4, dtype=torch.int32, device="cuda")
    compiled = _empty[(1,)](x)
    stream = torch.cuda.current_stream().cuda_stream
    row["triton_run"] = _per_launch_us(lambda: compiled.run(1, 1, 1, stream, compiled.function,
                                                            compiled.packed_metadata, None, None, None, x))
    ptr, null = ctypes.c_uint64(x.data_ptr()), ctypes.c_uint64(0)
    params = (ctypes.c_void_p * 3)(ctypes.addressof(ptr), ctypes.addressof(null), ctypes.addressof(null))
    one = ctypes.c_uint(1)
    block = 32 * compiled.metadata.num_warps
    call = (ctypes.c_void_p(compiled.function), one, one, one, ctypes.c_uint(block), one, one,
            ctypes.c_uint(compiled.metadata.shared), ctypes.c_void_p(stream), params, None)
    sizes = drvlaunch.ptx_params(compiled.asm["ptx"], compiled.metadata.name)
    row["empty_params"] = sizes
    if sizes is not None and len(sizes) <= 3:
        for name, dll in (("ctypes_cdll", ctypes.CDLL), ("ctypes_pydll", ctypes.PyDLL)):
            lib = dll("libcuda.so.1")
            f = lib.cuLaunchKernel
            f.restype = ctypes.c_int
            row[name] = _per_launch_us(functools.partial(f, *call))
        cu = ctypes.CDLL("libcuda.so.1")
        addr = ctypes.cast(cu.cuLaunchKernel, ctypes.c_void_p).value
        try:
            h = _helper()
            row["c_loop"] = _per_launch_us(lambda: h.loop_launch(addr, compiled.function, 1, block,
                                                                 compiled.metadata.shared, stream, params, 100),
                                           launches=100, calls=5)
        except (OSError, subprocess.CalledProcessError) as exc:
            row["c_loop"] = f"not built: {exc}"
            h = None
        ex = getattr(cu, "cuLaunchKernelEx", None)
        if h is not None and ex is not None:  # the driver's cost of cuLaunchKernelEx, plain and dependent
            ex_addr = ctypes.cast(ex, ctypes.c_void_p).value
            dependent = _empty[(1,)](x, launch_pdl=True)  # compiled for programmatic dependent launch
            for name, kernel, pdl in (("c_loop_ex", compiled, 0), ("c_loop_ex_pdl", dependent, 1)):
                row[name] = _per_launch_us(
                    functools.partial(h.loop_launch_ex, ex_addr, kernel.function, 1, 32 * kernel.metadata.num_warps,
                                      kernel.metadata.shared, stream, params, 100, pdl),
                    launches=100, calls=5)
    else:
        h, addr = None, None
    reg = create_registry()
    spec = SHAPES["mla61x576-bf16"](4096, 64, torch.device("cuda"))
    dev = _device_buffers(spec, 2 * 4096 + 64)
    hi, _, di = _indices(spec, torch.Generator().manual_seed(0))
    host = allocate_host_buffers(reg.layout("layer_first").plan(spec), pin_memory=True)
    pool = HostKVPool(spec, "layer_first", "kernel", dev, host_buffers=host, registry=reg, validate="shapes")
    layer = spec.layer_map.device_layers[0]
    for _ in range(3):
        pool.load_layer(layer, hi, di)
    prep = pool.binding.scratch[pool.strategy_name]
    # a second pool on other buffers, without the pool's fast path (its checks, then the strategy's replay);
    # the two are timed in alternating rounds, so a drift of the host's speed reaches both alike
    other = HostKVPool(spec, "layer_first", "kernel", _device_buffers(spec, 2 * 4096 + 64),
                       host_buffers=allocate_host_buffers(reg.layout("layer_first").plan(spec), pin_memory=True),
                       registry=reg, validate="shapes")
    other._lanes = (None, None)
    layers = spec.layer_map.device_layers
    fresh = [(hi.clone(), di.clone()) for _ in range(8)]

    def batches(p: HostKVPool) -> Callable[[], None]:
        turn = itertools.cycle(fresh)

        def batch() -> None:  # an engine's pattern: every layer once per batch, each batch its own index tensors
            hn, dn = next(turn)
            for one in layers:
                p.load_layer(one, hn, dn)
        return batch
    row.update(_alternating({
        "load_layer": (lambda: pool.load_layer(layer, hi, di), 1),
        "load_layer_nolane": (lambda: other.load_layer(layer, hi, di), 1),
        "load_layer_new_batch": (batches(pool), len(layers)),
        "load_layer_new_batch_nolane": (batches(other), len(layers)),
    }))
    pool.load_layer(layer, hi, di)  # its batch current again (read below)
    ready = getattr(prep.replays, "_ready", [{}])[False].get(layer) if prep.replays is not None else None
    if ready is not None:
        b, launches = ready
        row["replay_launches"] = len(launches)
        relaunch = lambda: [st.kernel.relaunch(g, b.stream, st.packed, v) for st, g, v in launches]  # noqa: E731
        row["c_launch"] = launches[0][0].packed.fast is not None
        row["replay_relaunch"] = _per_launch_us(relaunch, launches=len(launches))
        claunch.set_c_launch(False)
        row["replay_relaunch_ctypes"] = _per_launch_us(relaunch, launches=len(launches))
        row["load_layer_ctypes"] = _per_launch_us(lambda: pool.load_layer(layer, hi, di))
        claunch.set_c_launch(None)
        st, g, v = launches[0]
        st.kernel.relaunch(g, b.stream, st.packed, v)  # the packed values now hold this launch's
        if h is not None:
            c = st.packed.call
            row["replay_c_loop"] = _per_launch_us(
                lambda: h.loop_launch(addr, c[0].value, g, c[4].value, c[7].value, b.stream, st.packed.array, 100),
                launches=100, calls=5)
    row.update(_split_backups(reg))
    print(json.dumps(row), flush=True)
    with open(args.out, "w") as out:
        json.dump(row, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
