"""Registers per thread, stack (spilled registers), local and shared memory of every row and page-load kernel launch
a pool makes, compiled for sm_90 on a CPU: no GPU needed.

Usage (Linux, Triton >= 3.7 with its NVIDIA backend: the pools are prepared under its CPU interpreter)::

    python dev/kernel_resources.py [--shapes mla61x656-fp8,mla61x576-bf16] [--layouts layer_first,...]
        [--tokens 1024] [--page-size 64] [--warps N] [--json PATH]

For each shape (``hicache bench``'s shapes) and layout, a CPU pool of the layout's ``kernel`` strategy is prepared
in a process of its own under Triton's interpreter; what each launch would pass (the kernel, its constexpr values,
its argument types, the tuning's warps and register cap) is read from the prepared pool, and another process,
without the interpreter, compiles each launch for sm_90 and reads the compiled kernel's figures
(:func:`ptx_diff.resources`).  One line per group, direction and kind: the row kernel's backup and load (the
latter marked where the group's loads go to the page kernel, which gathers the pages that are not runs itself:
the row kernel then loads only with page loads off, ``HICACHE_KERNEL_PAGES=0``), and each page-load part (page
loads as the environment sets them: by default only groups whose pages hold >= 2 KiB per host part,
``HICACHE_KERNEL_PAGES=1`` for pages of any size).
``--warps`` compiles every launch with that many warps instead of its tuning's (what a ``num_warps`` option would
launch); ``--json`` also writes every launch's constexpr values and figures.  Index tensors compile as int64 (a
pool takes int32 ones too); like ``ptx_diff``, this does not see the divisibility hints a launch adds to pointers
and integer arguments.  TMA loads (per-layer loads of rows of >= 1152 bytes on sm_90) are not listed.  Backups
compile as a CPU pool prepares them, unfenced (``FENCE`` False; on CUDA wide rows add one ``fence.sc.gpu`` per work
item, ``kernel_lib.tile_done``).

The figures are this Triton's (the version is printed): register allocation differs between versions, so compare
figures from one version only, and confirm on a GPU (Nsight Compute's "Registers Per Thread") before relying on
them.  ``--tokens`` is the pools' capacity (a multiple of ``--page-size``); the launches' values do not depend
on it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ptx_diff import plugin_paths  # type: ignore[import-not-found]  # this script's folder, first on sys.path

ROOT = Path(__file__).resolve().parents[1]

#: Run under the interpreter (this tree's ``hicache_core`` and plugins first on the path): every launch, as JSON.
_COLLECT = r"""
import inspect, json, sys
sys.path[:0] = sys.argv[2:]
from hicache_core.kernel_support import interpreter_problem
if interpreter_problem():
    sys.exit(interpreter_problem())
import torch
from hicache_core import HostKVPool, create_registry
from hicache_core.bench import SHAPES
from hicache_core.bench.workload import _device_buffers
shapes, layouts, tokens, page = json.loads(sys.argv[1])
reg = create_registry()
PTR = {torch.int64: "*i64", torch.int32: "*i32", torch.int16: "*i16", torch.int8: "*i8", torch.uint8: "*u8",
       torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.float64: "*fp64"}
PER_CALL = {"host_idx": "*i64", "dev_idx": "*i64", "n": "i32", "ents": "*i64", "n_ents": "i32"}

def launch(label, launcher, lv):
    fn = launcher.kernel.fn
    params = inspect.signature(fn).parameters
    consts, types = {}, {}
    for name, value in zip(launcher.arg_names, lv.args):
        if "constexpr" in str(params[name].annotation):
            consts[name] = value
        elif name in PER_CALL:
            types[name] = PER_CALL[name]
        elif isinstance(value, torch.Tensor):
            types[name] = PTR[value.dtype]
        elif isinstance(value, int):
            types[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        else:
            consts[name] = value  # None: a parameter this launch does not use
    t = lv.tuning
    return dict(label=label, module=fn.__module__, kernel=fn.__name__, consts=consts, types=types,
                warps=t.num_warps, maxnreg=t.maxnreg)

out = []
for shape in shapes:
    for layout in layouts:
        spec = SHAPES[shape](tokens, page, torch.device("cpu"))
        dev = _device_buffers(spec, tokens)
        pool = HostKVPool(spec, layout, "kernel", dev, registry=reg, pin_memory=False, validate="shapes",
                          strategy_options={"tma": False})
        prep = pool.binding.scratch[pool.strategy_name]
        for gi, g in enumerate(prep.groups):
            name = f"{shape} {layout} {'/'.join(g.names)}"
            paged = bool(prep.pages) and prep.pages[gi] is not None
            out.append(launch(f"{name} backup", prep.launcher, prep.launches[gi][True]))
            out.append(launch(f"{name} load{' (page loads off only)' if paged else ''}", prep.launcher,
                              prep.launches[gi][False]))
            for part, (lv, _) in enumerate(prep.pages[gi] if prep.pages and prep.pages[gi] else ()):
                out.append(launch(f"{name} page load part {part}", prep.page_launcher, lv))
print(json.dumps(out))
"""

#: Run without the interpreter: each launch compiled, its figures as JSON.
_COMPILE = r"""
import importlib, json, sys
sys.path[:0] = sys.argv[2:]
from ptx_diff import compile_kernel, resources
import triton
launches, warps = json.loads(sys.argv[1])
out = []
for one in launches:
    fn = getattr(importlib.import_module(one["module"]), one["kernel"])
    compiled = compile_kernel(fn, one["consts"], warps or one["warps"], types=one["types"], maxnreg=one["maxnreg"])
    out.append(dict(one, warps=compiled.metadata.num_warps, usage=resources(compiled)))
print(json.dumps({"triton": triton.__version__, "rows": out}))
"""


def _paths() -> list[str]:
    """This tree and its plugins, ahead of any installed copy (as ``ptx_diff`` compiles each tree's own)."""
    return [str(ROOT), *plugin_paths(ROOT)]


def _run(code: str, *args: str, interpret: bool) -> Any:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    got = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=ROOT)
    if got.returncode != 0:
        raise SystemExit(f"{'collecting' if interpret else 'compiling'} failed:\n{got.stderr.strip()[-3000:]}")
    return json.loads(got.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="mla61x656-fp8,mla61x576-bf16,mha80x8x128-bf16")
    ap.add_argument("--layouts", default="layer_first,page_first,page_first_direct,page_first_kv_split")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--warps", type=int, default=0, help="compile every launch with this many warps (0: its tuning's)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write every launch's values and figures here")
    args = ap.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    layouts = [s for s in args.layouts.split(",") if s]
    launches = _run(_COLLECT, json.dumps([shapes, layouts, args.tokens, args.page_size]), *_paths(), interpret=True)
    got = _run(_COMPILE, json.dumps([launches, args.warps]), str(Path(__file__).resolve().parent), *_paths(),
               interpret=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(got, f, indent=1)
    print(f"sm_90, Triton {got['triton']}, {args.tokens} tokens, page {args.page_size}")
    for row in got["rows"]:
        u = row["usage"]
        what = u if isinstance(u, str) else (f"{u['registers']:3d} registers, {u['stack']:4d} B stack, "
                                             f"{u['local']:4d} B local, {u['shared']:6d} B shared")
        print(f"{row['label']:70s} {row['warps']:2d} warps  {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
