"""dev/ptx_diff.py: two versions of a kernel, each compiled for sm_90 from its own tree in a process of its own (no
GPU), their PTX compared without comments and debug information.  Run as a contributor runs it (a subprocess)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "dev"))

from ptx_diff import code  # noqa: E402

KV = "plugins/kv_split/hicache_kv_split/kernels.py"
CONST = "WIDTH=82,SPLIT=64,BLOCK=64,BLOCK_B=32,TOKENS=32,VEC=2,TO_HOST=1,STAGES=1,PAGE_SIZE=64,FENCE=1"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "dev/ptx_diff.py", "--file", KV, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> str:
    """This checkout's hicache_core and plugins copied elsewhere: the same code at another path (no git needed)."""
    out = tmp_path_factory.mktemp("tree")
    for part in ("hicache_core", "plugins"):
        shutil.copytree(ROOT / part, out / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    return str(out)


def test_one_tree_at_two_paths_is_identical(copy):
    """The working tree and its copy, each compiled afresh (a cache per version): line information and file names
    do not count, and both index widths are compared."""
    done = _run("--old", copy, "--const", CONST + ",ENTRIES_INNER=1", "--warps", "8")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[2].startswith("identical PTX code with 64- and 32-bit index tensors")
    # each version's resources, read from its cubin: the same code, the same figures
    for width, line in zip(("*i64", "*i32"), lines[:2]):
        got = re.fullmatch(rf"\{width} index tensors: old (.+); new (.+)", line)
        assert got and got[1] == got[2], line
        assert re.fullmatch(r"\d+ registers per thread, \d+ bytes of stack, \d+ of shared memory, \d+ of local memory",
                            got[1]), line


def test_another_constexpr_value_differs(copy):
    done = _run("--old", copy, "--const", CONST, "--old-const", "ENTRIES_INNER=1",
                "--new-const", "ENTRIES_INNER=0", "--warps", "8")
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines()[2].startswith("PTX differs with *i64 index tensors")


def test_what_cannot_compile_or_be_read_exits_2_with_its_reason(copy):
    missing = _run("--old", copy, "--const", "WIDTH=82")
    assert missing.returncode == 2 and "no value for constexpr parameter(s) SPLIT" in missing.stderr
    unreadable = _run("--old", "no-such-rev", "--const", CONST)
    assert unreadable.returncode == 2 and "cannot export 'no-such-rev'" in unreadable.stderr
    not_int = _run("--old", copy, "--const", "TO_HOST=True")
    assert not_int.returncode == 2 and "must be an integer" in not_int.stderr
    no_kernel = _run("--old", copy, "--kernel", "NOPE", "--const", CONST)
    assert no_kernel.returncode == 2 and "has no NOPE" in no_kernel.stderr


def test_code_drops_comments_debug_sections_locations_and_blank_lines():
    ptx = ("\t.reg .b32 %r<4>;  // registers\n\n\t.loc 1 12 5\n\tadd.s32 %r1, %r2, %r3;\n"
           ".section\t.debug_info\n{\n.b8 111\n}\n")
    assert code(ptx) == "\t.reg .b32 %r<4>;\n\tadd.s32 %r1, %r2, %r3;"
    assert code(ptx.replace("// registers", "// other words")) == code(ptx)
    assert code(ptx.replace("%r3", "%r2")) != code(ptx)
