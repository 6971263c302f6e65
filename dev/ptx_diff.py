"""Does a kernel edit change the compiled kernel?  Compare two versions' PTX, compiled ahead of time on any machine.

Usage (no GPU needed; Triton's own ptxas-free PTX path)::

    python dev/ptx_diff.py --old 72e0b14:plugins/kv_split/hicache_kv_split/kernels.py \\
        --new plugins/kv_split/hicache_kv_split/kernels.py \\
        --const WIDTH=82,SPLIT=64,BLOCK=64,BLOCK_B=32,TOKENS=32,VEC=2,TO_HOST=1,STAGES=1,PAGE_SIZE=64 \\
        --new-const ENTRIES_INNER=1 --warps 8

``--old`` and ``--new`` are files, or ``REV:PATH`` for a file at a git revision.  ``--const`` gives the constexpr
values both versions take, ``--old-const`` / ``--new-const`` those only one declares; every other parameter is an
``*i64`` pointer except ``n``/``n_ents`` (``i32``) and ``capacity``/``dev_rows`` (``i64``), as the row-copy launches
pass them.  Each version's ``KERNEL`` (or ``--kernel``) is compiled for ``--arch`` (default sm_90) and its PTX
compared without comments and debug information (file names and line numbers differ between any two files).
Exit status 0 when the code is identical, 1 when it differs (the first differing lines are printed), 2 when a
constexpr has no value or a version cannot be read.

A refactor of a kernel whose compiled code is unchanged needs no new GPU run; any other edit does.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

INT32 = {"n", "n_ents"}
INT64 = {"capacity", "dev_rows", "page_size"}


def _values(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        out[name.strip()] = int(value)
    return out


def _source(spec: str, tmp: Path, tag: str) -> Path:
    """A file path, or ``REV:PATH`` read from git into ``tmp``."""
    if Path(spec).is_file():
        return Path(spec)
    rev, _, path = spec.partition(":")
    got = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])  # the checkout this script is in
    if got.returncode != 0:
        print(f"{spec}: neither a file nor REV:PATH in this checkout ({got.stderr.strip()})", file=sys.stderr)
        raise SystemExit(2)
    text = got.stdout
    out = tmp / f"{tag}_{Path(path).name}"
    out.write_text(text)
    return out


def compile_kernel(fn: Any, consts: dict[str, Any], warps: int = 4, arch: int = 90) -> Any:
    """``fn`` (a ``@triton.jit`` kernel) compiled for compute capability ``arch`` with the constexpr values ``consts``
    (those it declares); its other parameters typed as the row-copy launches pass them (see the module's doc)."""
    names = fn.arg_names
    sig = {a: "constexpr" if a in consts else "i32" if a in INT32 else "i64" if a in INT64 else "*i64" for a in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items() if k in names})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})


def code(ptx: str) -> str:
    """``ptx`` without debug sections, comments and source-location directives (what differs between two files)."""
    text = ptx.split(".section\t.debug")[0]
    text = re.sub(r"//.*$", "", text, flags=re.M)
    return re.sub(r"^\s*\.(file|loc)\b.*$", "", text, flags=re.M)


def _ptx(path: Path, tag: str, kernel: str, consts: dict[str, Any], warps: int, arch: int) -> str:
    spec = importlib.util.spec_from_file_location(f"ptx_diff_{tag}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, kernel)
    missing = [a for a in fn.arg_names if a.isupper() and a not in consts]
    if missing:
        print(f"{tag}: no value for constexpr parameter(s) {', '.join(missing)}: add them to --const or "
              f"--{tag}-const", file=sys.stderr)
        raise SystemExit(2)
    return code(compile_kernel(fn, consts, warps, arch).asm["ptx"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="file, or REV:PATH")
    ap.add_argument("--new", required=True, help="file, or REV:PATH")
    ap.add_argument("--kernel", default="KERNEL")
    ap.add_argument("--const", default="", help="NAME=INT,... constexprs of both versions (booleans as 0/1)")
    ap.add_argument("--old-const", default="")
    ap.add_argument("--new-const", default="")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--arch", type=int, default=90, help="compute capability as an int (90: sm_90)")
    args = ap.parse_args()
    both = _values(args.const)
    with tempfile.TemporaryDirectory() as tmp:
        old = _ptx(_source(args.old, Path(tmp), "old"), "old", args.kernel, {**both, **_values(args.old_const)},
                   args.warps, args.arch)
        new = _ptx(_source(args.new, Path(tmp), "new"), "new", args.kernel, {**both, **_values(args.new_const)},
                   args.warps, args.arch)
    if old == new:
        print(f"identical PTX code ({len(old.splitlines())} lines, sm_{args.arch}, Triton {triton.__version__})")
        return 0
    diff = list(difflib.unified_diff(old.splitlines(), new.splitlines(), "old", "new", lineterm="", n=1))
    print(f"PTX differs ({sum(1 for line in diff if line[:1] in '+-')} lines changed); first lines:")
    print("\n".join(diff[:40]))
    return 1


if __name__ == "__main__":
    sys.exit(main())
