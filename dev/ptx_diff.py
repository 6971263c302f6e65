"""Does a kernel edit change the compiled kernel?  Two versions' PTX, compiled ahead of time on a CPU, compared.

Usage (Linux, Triton with its NVIDIA backend; no GPU needed)::

    python dev/ptx_diff.py --file plugins/kv_split/hicache_kv_split/kernels.py --old 72e0b14 \\
        --const WIDTH=82,SPLIT=64,BLOCK=64,BLOCK_B=32,TOKENS=32,VEC=2,TO_HOST=1,STAGES=1,PAGE_SIZE=64,FENCE=1 \\
        --new-const ENTRIES_INNER=1 --warps 8

Each version is a whole tree: ``--old REV`` (and ``--new REV``; without it, this working tree) is exported from git
(``hicache_core``, ``plugins``), or is a folder that holds them, and its ``--file``'s ``KERNEL`` (or ``--kernel``) is
compiled in a process of its own
with that tree first on the path, so an edit to ``hicache_core/kernel_lib.py`` (the pieces every kernel is built
from) counts as much as one to the kernel's file.  ``--const`` gives the constexpr values both versions take,
``--old-const`` / ``--new-const`` those only one declares (integers; 0/1 for booleans compile as ``False``/``True``).

Signatures: pointers ``*i64``; the scalars ``n``, ``n_ents``, ``capacity``, ``dev_rows``, ``page_size`` ``i32``
(what a Python int below 2**31 becomes); ``--types NAME=TYPE,...`` overrides any of them (e.g. ``anchor=*i32``).
Each version is compiled twice, with 64-bit and with 32-bit index tensors (``host_idx``, ``dev_idx``: a pool
accepts both).  Line information is off (``TRITON_DISABLE_LINE_INFO``) and comments are stripped, so moving code
between functions or files does not count as a change.  What this does not see: the divisibility hints a launch
gives its pointer and integer arguments (Triton specialises on multiples of 16) and values other than those given.

Each version's registers per thread and bytes of stack (where spilled registers go) and of local memory are
printed too, as the ``cuobjdump`` Triton ships reads them from the compiled kernel, with the shared memory its
launch asks for: seen without a GPU, for the constexpr values given (a launch's own come from its tuning).

Exit status: 0 when every compiled pair has identical PTX, 1 when one differs (its first differing lines are
printed), 2 when a version cannot be compiled or read (the reason is printed).
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path
from typing import Any


ROOT = Path(__file__).resolve().parents[1]
#: Scalars typed as the launches pass them (Python ints below 2**31); every other parameter is a ``*i64`` pointer.
INT32 = ("n", "n_ents", "capacity", "dev_rows", "page_size")
#: The index tensors, compiled as int64 and as int32.
INDEX = ("host_idx", "dev_idx")


def compile_kernel(fn: Any, consts: dict[str, Any], warps: int = 4, arch: int = 90,
                   types: dict[str, str] | None = None, maxnreg: int | None = None) -> Any:
    """``fn`` (a ``@triton.jit`` kernel) compiled for compute capability ``arch`` with the constexpr values ``consts``
    (those it declares; a constexpr left out takes its default); other parameters typed by ``types``, else as the module's doc says; ``maxnreg`` caps the
    registers per thread (as a tuning's ``maxnreg`` does)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_kernel compiles for a GPU: run it in a process without TRITON_INTERPRET (kernels "
                           "decorated under the interpreter cannot be compiled)")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    given = types or {}
    for prm in getattr(fn, "params", ()):  # a constexpr left out takes its default (e.g. a kernel's PDL=0)
        default = getattr(prm, "default", inspect.Parameter.empty)
        if getattr(prm, "is_constexpr", False) and prm.name not in consts and default is not inspect.Parameter.empty:
            consts = {**consts, prm.name: default}
    sig = {a: "constexpr" if a in consts else given.get(a, "i32" if a in INT32 else "*i64") for a in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items() if k in names})
    options: dict[str, Any] = {"num_warps": warps}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def code(ptx: str) -> str:
    """``ptx`` without debug sections, comments, source-location directives and blank lines."""
    text = ptx.split(".section\t.debug")[0]
    text = re.sub(r"//.*$", "", text, flags=re.M)
    text = re.sub(r"^\s*\.(file|loc)\b.*$", "", text, flags=re.M)
    return "\n".join(line.rstrip() for line in text.splitlines() if line.strip())


#: Run in each version's process (its tree first on sys.path): the kernel's PTX code per index width, as JSON.
_CHILD = r"""
import importlib.util, json, sys
tree, path, kernel, consts, types, warps, arch, tool = json.loads(sys.argv[1])
sys.path[:0] = [tree] + [p for p in sys.argv[2:]]
sys.path.append(tool)  # this script's folder: ptx_diff itself, whichever version is compiled
import hicache_core
if not hicache_core.__file__.startswith(tree):
    sys.exit(f"hicache_core came from {hicache_core.__file__}, not from {tree}")
from ptx_diff import code, compile_kernel, resources, INDEX
spec = importlib.util.spec_from_file_location("ptx_diff_kernel", f"{tree}/{path}")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
fn = getattr(module, kernel, None)
if fn is None:
    sys.exit(f"{path} has no {kernel}")
missing = [p.name for p in fn.params if p.is_constexpr and p.name not in consts and not p.has_default]
if missing:
    sys.exit(f"no value for constexpr parameter(s) {', '.join(missing)}")
out, res = {}, {}
for width in ("*i64", "*i32"):
    both = {**{name: width for name in INDEX}, **types}
    compiled = compile_kernel(fn, consts, warps, arch, both)
    out[width] = code(compiled.asm["ptx"])
    res[width] = resources(compiled)
print(json.dumps({"ptx": out, "resources": res}))
"""

#: ``cuobjdump --dump-resource-usage``'s figures of a kernel, by the names reported here.
_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def resources(compiled: Any) -> dict[str, int] | str:
    """Registers per thread, bytes of stack (spills show here) and of local memory of a compiled kernel, read from
    its cubin by the ``cuobjdump`` Triton ships, and the shared memory its launch asks for (Triton's metadata:
    ``cuobjdump`` sees only the static part); a string saying why where the cubin cannot be read."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        try:
            got = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True)
        except OSError as exc:
            return f"cuobjdump not run: {exc}"
    m = _USAGE.search(got.stdout)
    if m is None:
        return f"cuobjdump gave no resource line: {(got.stderr or got.stdout).strip()[-200:]}"
    usage = dict(zip(("registers", "stack", "static_shared", "local"), map(int, m.groups())))
    usage["shared"] = max(int(getattr(compiled.metadata, "shared", 0) or 0), usage.pop("static_shared"))
    return usage


def _usage(res: dict[str, int] | str) -> str:
    if isinstance(res, str):
        return res
    return (f"{res['registers']} registers per thread, {res['stack']} bytes of stack, {res['shared']} of shared "
            f"memory, {res['local']} of local memory")


def plugin_paths(tree: Path) -> list[str]:
    """The plugin packages' folders of the checkout ``tree`` (each holds its ``hicache_*`` package)."""
    return [str(p) for p in sorted((tree / "plugins").glob("*")) if p.is_dir()]


def _tree(rev: str | None, tmp: Path, tag: str) -> Path:
    """This working tree (``rev`` None), a folder holding ``hicache_core`` and ``plugins`` (``rev`` names one), or
    ``rev``'s ``hicache_core`` and ``plugins`` exported from git into ``tmp``."""
    if rev is None:
        return ROOT
    if (Path(rev) / "hicache_core").is_dir():
        return Path(rev).resolve()
    try:
        got = subprocess.run(["git", "archive", "--format=tar", rev, "hicache_core", "plugins"], cwd=ROOT,
                             capture_output=True)
    except OSError as exc:  # no git
        raise SystemExit(_fail(f"{tag}: cannot export {rev!r} from {ROOT}: {exc}")) from None
    if got.returncode != 0:
        raise SystemExit(_fail(f"{tag}: cannot export {rev!r} from {ROOT}: {got.stderr.decode().strip()}"))
    out = tmp / tag
    with tarfile.open(fileobj=BytesIO(got.stdout)) as tar:
        tar.extractall(out, filter="data")
    return out


def _fail(message: str) -> int:
    print(message, file=sys.stderr)
    return 2


def _ptx(tree: Path, tag: str, args: argparse.Namespace, consts: dict[str, int], tmp: Path) -> dict[str, Any]:
    """The kernel's PTX code (``"ptx"``) and :func:`resources` (``"resources"``) per index width, compiled in a
    process of its own from ``tree``."""
    plugins = plugin_paths(tree)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DISABLE_LINE_INFO="1", TRITON_CACHE_DIR=str(tmp / f"cache-{tag}"), PYTHONPATH="")
    payload = json.dumps([str(tree), args.file, args.kernel, consts, _pairs(args.types, str), args.warps, args.arch,
                          str(Path(__file__).resolve().parent)])
    got = subprocess.run([sys.executable, "-c", _CHILD, payload, *plugins], capture_output=True, text=True, env=env,
                         cwd=tmp)
    if got.returncode != 0:
        tail = (got.stderr.strip().splitlines() or ["no message"])[-1]
        raise SystemExit(_fail(f"{tag}: {args.file} did not compile: {tail}"))
    result: dict[str, Any] = json.loads(got.stdout.strip().splitlines()[-1])
    return result


def _pairs(text: str, kind: type) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise SystemExit(_fail(f"{item!r}: write NAME=VALUE"))
        try:
            out[name] = kind(value)
        except ValueError:
            raise SystemExit(_fail(f"{item!r}: the value must be an integer (0/1 for a boolean)")) from None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", required=True, help="the kernel's file, relative to the checkout's root")
    ap.add_argument("--old", required=True, help="the old version: a git revision, or a folder holding its tree")
    ap.add_argument("--new", default=None, help="the new version, as --old (default: this working tree)")
    ap.add_argument("--kernel", default="KERNEL")
    ap.add_argument("--const", default="", help="NAME=INT,... constexprs of both versions (booleans as 0/1)")
    ap.add_argument("--old-const", default="")
    ap.add_argument("--new-const", default="")
    ap.add_argument("--types", default="", help="NAME=TYPE,... parameter types over the defaults (e.g. anchor=*i32)")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--arch", type=int, default=90, help="compute capability as an int (90: sm_90)")
    args = ap.parse_args()
    both = _pairs(args.const, int)
    with tempfile.TemporaryDirectory() as tmp:
        old = _ptx(_tree(args.old, Path(tmp), "old"), "old", args, {**both, **_pairs(args.old_const, int)}, Path(tmp))
        new = _ptx(_tree(args.new, Path(tmp), "new"), "new", args, {**both, **_pairs(args.new_const, int)}, Path(tmp))
    import triton

    for width in old["ptx"]:
        print(f"{width} index tensors: old {_usage(old['resources'][width])}; new {_usage(new['resources'][width])}")
    for width, was in old["ptx"].items():
        if was != new["ptx"][width]:
            diff = list(difflib.unified_diff(was.splitlines(), new["ptx"][width].splitlines(), "old", "new",
                                             lineterm="", n=1))
            changed = sum(1 for line in diff[2:] if line[:1] in "+-")
            print(f"PTX differs with {width} index tensors ({changed} lines changed); first lines:")
            print("\n".join(diff[:40]))
            return 1
    lines = len(new["ptx"]["*i64"].splitlines())
    print(f"identical PTX code with 64- and 32-bit index tensors ({lines} lines, sm_{args.arch}, "
          f"Triton {triton.__version__})")
    return 0


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)  # kernels must compile, not interpret (each version's process too)
    sys.exit(main())
