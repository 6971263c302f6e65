"""dev/kernel_resources.py: every row and page-load launch of a pool, compiled for sm_90 on a CPU (no GPU), with the
compiled kernel's registers, stack, local and shared memory.  Run as a contributor runs it (a subprocess)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_core.kernel_support import interpreter_problem
from hicache_core.rowcopy import PAGE_LOAD_TUNING
from hicache_core.rowcopy_pages import pieces
from hicache_core.rowcopy_tuning import tile

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"(?P<label>.+?)\s+(?P<warps>\d+) warps\s+(?P<regs>\d+) registers,\s+(?P<stack>\d+) B stack,\s+"
                  r"(?P<local>\d+) B local,\s+(?P<shared>\d+) B shared")
NAME = "mla61x576-bf16 page_first_kv_split latent/rope"
WORD = {"*i32": 4, "*i64": 8, "*i16": 2, "*u8": 1, "*i8": 1}

pytestmark = pytest.mark.skipif(interpreter_problem() is not None,
                                reason=f"the tool prepares pools under Triton's CPU interpreter: {interpreter_problem()}")


def _run(tmp_path: Path, *args: str) -> tuple[list[dict[str, str]], list[dict]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # nothing left in the user's Triton cache
    out = tmp_path / "launches.json"
    done = subprocess.run([sys.executable, "dev/kernel_resources.py", "--shapes", "mla61x576-bf16", "--layouts",
                           "page_first_kv_split", "--tokens", "256", "--json", str(out), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    head, *lines = done.stdout.strip().splitlines()
    assert head.startswith("sm_90, Triton ") and head.endswith("256 tokens, page 64"), head
    rows = []
    for line in lines:
        m = LINE.fullmatch(line.strip())
        assert m, line
        assert 0 < int(m["regs"]) <= 255, line
        rows.append(m.groupdict())
    return rows, json.loads(out.read_text())["rows"]


def test_every_launch_with_the_values_its_pool_passes(tmp_path):
    """MLA bf16 rows split over two host buffers: the fused row kernel's backup and load (the load marked: page
    loads serve this group), and a page load per part, each with the tile, pieces and warps the strategy launches."""
    rows, launches = _run(tmp_path)
    assert [r["label"] for r in rows] == [f"{NAME} backup", f"{NAME} load (page loads off only)",
                                         f"{NAME} page load part 0", f"{NAME} page load part 1"]
    from hicache_kv_split.strategy import TUNING

    want = [TUNING.backup, TUNING.load, PAGE_LOAD_TUNING, PAGE_LOAD_TUNING]
    assert [int(r["warps"]) for r in rows] == [t.num_warps for t in want]  # as compiled
    for one, t in zip(launches[:2], want):
        c, word = one["consts"], WORD[one["types"]["anchor"]]
        assert (c["BLOCK"], c["BLOCK_B"], c["TOKENS"]) == tile(c["WIDTH"], c["SPLIT"], word, t.tile_bytes)
        assert c["PAGE_SIZE"] == 64 and c["TO_HOST"] == (one is launches[0])
    widths = []
    for one in launches[2:]:
        c, word = one["consts"], WORD[one["types"]["anchor"]]
        widths.append(c["WIDTH"] * word)
        assert (c["PART"], c["PARTS"], c["R1"], c["R2"], c["R3"], c["R4"]) == pieces(
            64 * c["WIDTH"], PAGE_LOAD_TUNING.tile_bytes // word, c["VEC"])
        assert c["STRIDED"] is True and c["PAGE_SIZE"] == 64  # each part a piece of the device's 1152-byte rows
        assert one["usage"]["shared"] > 0  # the page kernel's cross-warp run check
    assert widths == [1024, 128]  # latent 512 and rope 64 bf16 elements per token


def test_forced_warps_are_the_compiled_kernels(tmp_path):
    rows, launches = _run(tmp_path, "--warps", "2")
    assert [int(r["warps"]) for r in rows] == [2] * 4 and [one["warps"] for one in launches] == [2] * 4
