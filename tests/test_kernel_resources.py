"""dev/kernel_resources.py: every row and page-load launch of a pool, compiled for sm_90 on a CPU (no GPU), with the
compiled kernel's registers, stack, local and shared memory.  Run as a contributor runs it (a subprocess)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"(?P<label>.+?)\s+(?P<warps>\d+) warps\s+(?P<regs>\d+) registers,\s+(?P<stack>\d+) B stack,\s+"
                  r"(?P<local>\d+) B local,\s+(?P<shared>\d+) B shared")


def _run(*args: str) -> list[dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "dev/kernel_resources.py", "--shapes", "mla61x576-bf16", "--layouts",
                           "page_first_kv_split", "--tokens", "256", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    head, *lines = done.stdout.strip().splitlines()
    assert head.startswith("sm_90, Triton ") and head.endswith("256 tokens, page 64"), head
    rows = []
    for line in lines:
        m = LINE.fullmatch(line.strip())
        assert m, line
        assert 0 < int(m["regs"]) <= 255, line
        rows.append(m.groupdict())
    return rows


def test_every_launch_of_the_pool_with_its_tuning_and_with_forced_warps():
    """MLA bf16 rows split over two host buffers: the fused row kernel's backup and load, and a page load per
    part; each at its tuning's warps, then all at the warps asked for."""
    rows = _run()
    name = "mla61x576-bf16 page_first_kv_split latent/rope"
    assert [r["label"] for r in rows] == [f"{name} backup", f"{name} load", f"{name} page load part 0",
                                         f"{name} page load part 1"]
    from hicache_kv_split.strategy import TUNING
    from hicache_core.rowcopy import PAGE_LOAD_TUNING

    assert [int(r["warps"]) for r in rows] == [TUNING.backup.num_warps, TUNING.load.num_warps,
                                               PAGE_LOAD_TUNING.num_warps, PAGE_LOAD_TUNING.num_warps]
    assert all(int(r["shared"]) > 0 for r in rows[2:])  # the page kernel's cross-warp run check
    assert [int(r["warps"]) for r in _run("--warps", "2")] == [2] * 4
