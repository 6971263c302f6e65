"""The plugins' row kernels and the shared page-load and TMA load kernels compiled by this Triton for sm_90 (its
bundled ptxas, no GPU needed; a separate process, outside the interpreter, through ``dev/ptx_diff.py``'s
``compile_kernel``): no per-row 64-bit division, and one fence per work item in backups only.

Every thread of a row kernel holds all its tile's rows, so per-row arithmetic is paid ``TOKENS`` times per thread
per tile; a 64-bit division there (the page split by a runtime page size) held ``page_first_direct``'s backups of
656-byte rows to half the link (docs/performance.md, "What limits them").  The count of 64-bit ``div``/``rem``
instructions in each kernel's PTX must not grow with ``TOKENS``, backups and loads, for a power-of-two page size
and another.  A row kernel's backup launched with ``FENCE`` (the plugins' backups) waits once per work item until the
GPU has taken its writes (``kernel_lib.tile_done``): one ``fence.sc.gpu`` in its PTX, none in a load's; launched with
``PDL`` 2, one ``griddepcontrol.launch_dependents`` and one ``griddepcontrol.wait``; with ``PDL`` 1 (a split call's last
launch) the wait only."""

from __future__ import annotations


_COUNT = r"""
import json, re, sys
sys.path.insert(0, "dev")
from ptx_diff import compile_kernel
from hicache_kv_split import kernels as kv
from hicache_layer_first import kernels as lf
from hicache_page_first import kernels as pf

DIV64 = re.compile(r"\b(div|rem)\.[su]64\b")
out = {}
for name, kernel, extra in (("layer_first", lf.KERNEL, {"BLOCK": 128}),
                            ("page_first", pf.KERNEL, {"BLOCK": 128, "ENTRIES_INNER": False}),
                            ("page_first_kv_split", kv.KERNEL, {"BLOCK": 64, "SPLIT": 64, "BLOCK_B": 32,
                                                                "ENTRIES_INNER": True})):
    for to_host in (True, False):
        for page in (64, 48):
            for tokens in (16, 64):
                consts = dict(WIDTH=82, TOKENS=tokens, VEC=2, TO_HOST=to_host, STAGES=1, PAGE_SIZE=page,
                              FENCE=to_host, PDL=2 if to_host else 0, **extra)
                ptx = compile_kernel(kernel, consts).asm["ptx"]
                key = f"{'backup' if to_host else 'load'}, page {page}, {tokens} tokens"
                out.setdefault(name, {})[key] = len(DIV64.findall(ptx))
                out.setdefault("fences", {})[f"{name} {key}"] = ptx.count("fence.sc.gpu")
                out.setdefault("pdl", {})[f"{name} {key}"] = [ptx.count("griddepcontrol.launch_dependents"),
                                                               ptx.count("griddepcontrol.wait")]
                if to_host and page == 64 and tokens == 16:  # a split call's last launch: it waits, never signals
                    ptx = compile_kernel(kernel, {**consts, "PDL": 1}).asm["ptx"]
                    out.setdefault("pdl last", {})[name] = [ptx.count("griddepcontrol.launch_dependents"),
                                                            ptx.count("griddepcontrol.wait")]
from hicache_core import kernel_lib as kl
from hicache_core.rowcopy_pages import pieces
for page in (64, 48):
    for tokens in (16, 64):
        part, parts, r1, r2, r3, r4 = pieces(page * 82, 1024, 2)  # as a launch splits the page
        consts = dict(WIDTH=82, BLOCK=128, TOKENS=tokens, PAGE_TOKENS=64, VEC=2, PART=part, PARTS=parts, R1=r1, R2=r2,
                      R3=r3, R4=r4, STAGES=1, STRIDED=False, PAGE_SIZE=page, GROUP=1)
        ptx = compile_kernel(kl.PAGE_LOAD, consts).asm["ptx"]
        out.setdefault("PAGE_LOAD", {})[f"load, page {page}, {tokens} tokens"] = len(DIV64.findall(ptx))
    for group in (2, 8):  # small pages (16-word rows, e.g. rope parts of wider device rows), several per work item
        for strided in (False, True):
            consts = dict(WIDTH=16, BLOCK=16, TOKENS=16, PAGE_TOKENS=64, VEC=2, PART=1024, PARTS=1, R1=0, R2=0,
                          R3=0, R4=0, STAGES=1, STRIDED=strided, PAGE_SIZE=page, GROUP=group)
            ptx = compile_kernel(kl.PAGE_LOAD, consts).asm["ptx"]
            out.setdefault("PAGE_LOAD grouped", {})[f"load, page {page}, group {group}, strided {strided}"] = len(
                DIV64.findall(ptx))
ints = {n: "i32" for n in kl.PAGED_TMA_LOAD.arg_names if n.islower()}
for page in (64, 48):
    for tokens in (16, 64):
        consts = dict(host_desc_b=None, host_tail_b=None, WIDTH=288, BOX=256, TAIL=32, TOKENS=tokens, VEC=4, STAGES=4,
                      FLAT=False, ENTRIES=1, PAGE_SIZE=page)
        types = {**ints, "anchor": "*i32", "host_idx": "*i64", "dev_idx": "*i64",
                 "host_desc": f"tensordesc<i32[{tokens}, 256]>", "host_tail": f"tensordesc<i32[{tokens}, 32]>"}
        ptx = compile_kernel(kl.PAGED_TMA_LOAD, consts, types=types).asm["ptx"]
        out.setdefault("PAGED_TMA_LOAD", {})[f"load, page {page}, {tokens} tokens"] = len(DIV64.findall(ptx))
print(json.dumps(out))
"""


def test_row_kernels_divide_in_64_bits_per_tile_not_per_row(tmp_path):
    from fakes import compiled_json

    counts = compiled_json(_COUNT, tmp_path)  # compiled afresh, and nothing left in the user's Triton cache
    assert set(counts) == {"layer_first", "page_first", "page_first_kv_split", "PAGE_LOAD", "PAGE_LOAD grouped",
                           "PAGED_TMA_LOAD", "fences", "pdl", "pdl last"}
    grouped = counts.pop("PAGE_LOAD grouped")
    # backups fence once per work item (kernel_lib.tile_done: one fence.sc.gpu per thread), loads not at all
    fences = counts.pop("fences")
    assert fences and all(v == (1 if k.split(" ", 1)[1].startswith("backup") else 0) for k, v in fences.items()), fences
    # backups launched with PDL (the plugins' with backup_pdl): one signal (at a program's last item) and one wait (at
    # its end) in the PTX (kernel_lib.let_next_begin, await_previous); loads, PDL False, neither
    pdl = counts.pop("pdl")
    assert pdl and all(v == ([1, 1] if k.split(" ", 1)[1].startswith("backup") else [0, 0]) for k, v in pdl.items()), pdl
    last = counts.pop("pdl last")
    assert len(last) == 3 and all(v == [0, 1] for v in last.values()), last
    for page in (64, 48):  # per item, not per page of the item
        for strided in (False, True):
            few, many = (grouped[f"load, page {page}, group {g}, strided {strided}"] for g in (2, 8))
            assert few == many <= 4, grouped
    for name, by in counts.items():
        for way in ("backup", "load") if name in ("layer_first", "page_first", "page_first_kv_split") else ("load",):
            for page in (64, 48):
                few, many = by[f"{way}, page {page}, 16 tokens"], by[f"{way}, page {page}, 64 tokens"]
                assert few == many <= 4, (name, by)  # per tile (item // n_tiles: 1 on Triton 3.9), not per row
