"""dev/ptx_diff.py: two versions of a kernel compiled ahead of time for sm_90 on this machine (no GPU), their PTX
compared without comments and debug information.  Run as a contributor runs it (a subprocess, Triton's interpreter
off, so the kernels compile)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KV = "plugins/kv_split/hicache_kv_split/kernels.py"
CONST = "WIDTH=82,SPLIT=64,BLOCK=64,BLOCK_B=32,TOKENS=32,VEC=2,TO_HOST=1,STAGES=1,PAGE_SIZE=64"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "dev/ptx_diff.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def compiles() -> None:
    probe = _run("--old", KV, "--new", KV, "--const", CONST + ",ENTRIES_INNER=1", "--warps", "8")
    if probe.returncode not in (0, 1):
        pytest.skip(f"Triton cannot compile for sm_90 here: {probe.stderr.strip().splitlines()[-1:]}")
    return None


def test_the_same_kernel_and_values_are_identical(compiles):
    done = _run("--old", KV, "--new", KV, "--const", CONST + ",ENTRIES_INNER=1", "--warps", "8")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("identical PTX code")


def test_another_constexpr_value_differs(compiles):
    done = _run("--old", KV, "--new", KV, "--const", CONST, "--old-const", "ENTRIES_INNER=1", "--new-const",
                "ENTRIES_INNER=0", "--warps", "8")
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.startswith("PTX differs")


def test_a_missing_constexpr_is_named():
    done = _run("--old", KV, "--new", KV, "--const", "WIDTH=82")
    assert done.returncode == 2
    assert "no value for constexpr parameter(s)" in done.stderr and "SPLIT" in done.stderr


def test_an_unreadable_version_is_named():
    done = _run("--old", "no-such-rev:" + KV, "--new", KV, "--const", CONST)
    assert done.returncode == 2
    assert "neither a file nor REV:PATH" in done.stderr
