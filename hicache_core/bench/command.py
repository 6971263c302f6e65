"""``hicache bench``'s command line: the subcommand's parser (:func:`add_parser`), its handler (``_cmd``: the grid, the
peer benchmark, or a plot of an earlier ``bench.json``), the standalone :func:`main`, and the plot (:func:`plot`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import asdict
from typing import Any, Callable, Iterable

import torch

from ..jsonfile import check_writable, write_json
from ..registry import create_registry
from . import run
from .run import _uneven
from .shapes import DEFAULT_ROUNDS, DIRECT_VARIANTS, GEMM_OPS, HBM_LONE_OPS, HBM_READ_BYTES, OPS, SHAPES, BenchRow

logger = logging.getLogger(__package__)  # hicache_core.bench: the name its records had before bench was a package


def plot(rows: list[dict[str, Any]], path: str) -> bool:
    """Ratio vs tokens per (strategy, op), one panel per op.  ``False`` when matplotlib is missing."""
    try:
        import matplotlib  # type: ignore[import-not-found,unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        logger.warning("matplotlib is not installed; no plot written")
        return False
    fig, axes = plt.subplots(1, len(OPS), figsize=(5 * len(OPS), 4), sharey=True)
    for ax, op in zip(axes, OPS):
        best: dict[tuple[str, str, int], dict[int, float]] = {}
        for r in rows:
            if r["op"] != op:
                continue
            key = (r["shape"], r["strategy"], r["page_size"])
            best.setdefault(key, {})
            best[key][r["tokens"]] = max(best[key].get(r["tokens"], 0.0), r["ratio"])
        for (shape, strat, ps), pts in sorted(best.items()):
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], marker="o", label=f"{strat} {shape} ps{ps}")
        ax.set_xscale("log", base=2)
        ax.set_title(op)
        ax.set_xlabel("tokens per call")
        ax.axhline(1.0, color="grey", lw=0.5)
    axes[0].set_ylabel("ratio to pinned memcpy (best SM budget)")
    axes[-1].legend(fontsize=5, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def _int_list(least: int) -> Callable[[str], list[int]]:
    """An argparse type: a comma list of whole numbers >= ``least``, at least one."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            values = []
        if not values or any(v < least for v in values):
            raise argparse.ArgumentTypeError(f"must be a comma list of whole numbers >= {least}, got {text!r}")
        return values
    return parse


def _name_list(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """An argparse type: a comma list of names from ``choices``, at least one."""
    known = sorted(choices)

    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in names if x not in known]
        if not names or bad:
            raise argparse.ArgumentTypeError(f"{', '.join(map(repr, bad)) or repr(text)} not among {', '.join(known)}")
        return names
    return parse


#: io_backends measured by default (those installed).
DEFAULT_BACKENDS = ("kernel", "direct", "auto")
#: Keys of a bench.json row that the plot reads.
PLOT_KEYS = ("op", "shape", "strategy", "page_size", "tokens", "ratio")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench", help="GPU throughput of every strategy vs pinned memcpy (JSON + PNG)",
        description="GPU throughput of every installed layout and io_backend against a pinned memcpy of the same bytes "
                    "(ratio), host time per call, and with --gemm the slowdown of a GEMM beside it. The default grid "
                    "(2 shapes x 2 token counts x 2 page sizes x 4 SM budgets x every layout, backend and op) is "
                    "hundreds of configurations; for a quick look narrow it, e.g. --tokens 4096 --page-sizes 64 "
                    "--programs 0 (the runs in docs/performance.md name theirs).")
    from ..cli import _positive_int

    p.add_argument("--out", default=None, help="folder for bench.json and bench.png (default bench-results; with "
                   "--plot-only, the JSON file's folder)")
    p.add_argument("--shapes", type=_name_list(SHAPES), default="mla61x576-bf16,mha80x8x128-bf16",
                   help=f"comma list of {sorted(SHAPES)} (default: %(default)s)")
    p.add_argument("--tokens", type=_int_list(1), default="4096,32768",
                   help="comma list of tokens per call (default: %(default)s)")
    p.add_argument("--page-sizes", type=_int_list(1), default="1,64",
                   help="comma list of tokens per page (default: %(default)s)")
    p.add_argument("--programs", type=_int_list(0), default="4,8,16,0",
                   help="SM budgets for kernel strategies; 0 = strategy default (default: %(default)s)")
    p.add_argument("--layouts", default="", help="comma list (default: all installed)")
    p.add_argument("--io-backends", default=None, help=f"comma list (default: those of {','.join(DEFAULT_BACKENDS)} "
                   "installed)")
    p.add_argument("--direct-variants", type=_name_list(DIRECT_VARIANTS), default="auto",
                   help=f"direct staging modes to measure, comma list of {sorted(DIRECT_VARIANTS)} (default: "
                        "%(default)s)")
    p.add_argument("--ops", type=_name_list(OPS), default=",".join(OPS), help=f"comma list of {list(OPS)} (default: all)")
    p.add_argument("--reps", type=_positive_int, default=20,
                   help="timed calls per configuration and operation, after 3 warm-up calls (and one more in each later "
                        "round); the median is reported (default: %(default)s)")
    p.add_argument("--rounds", type=_positive_int, default=DEFAULT_ROUNDS,
                   help="rounds each operation's timed calls are split into, the configurations of a layout taking "
                        "turns in each (the host's speed drifts over seconds; 1: each configuration's calls back to "
                        "back, one configuration after another) (default: %(default)s)")
    p.add_argument("--gemm", action="store_true",
                   help=f"measure GEMM slowdown during {', '.join(GEMM_OPS)}, and their own ratio while GEMMs run "
                        "beside them (gemm_ratio)")
    p.add_argument("--hbm", action="store_true",
                   help=f"during {', '.join(GEMM_OPS)}, also measure the slowdown of a memory-bound reduction over "
                        f"{HBM_READ_BYTES >> 30} GiB (a decode step's attention reads the KV cache that way) and the "
                        f"transfer's own ratio while it runs; for {' and '.join(HBM_LONE_OPS)}, that ratio alone")
    p.add_argument("--plot-only", default="", help="render the plot of an existing bench.json and exit")
    p.add_argument("--peers", action="store_true",
                   help="run the peer benchmark (SGLang's and LMCache's kernels beside ours; source checkout only) "
                        "with --peers-args instead of the strategy grid")
    p.add_argument("--peers-args", default="", help="arguments for the peer benchmark, one string (see --peers-args=--help)")
    p.set_defaults(func=_cmd)


def _progress_printer() -> Callable[[str], None]:
    """A tqdm bar that also prints each result line, or plain stderr lines without tqdm."""
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]
    except ImportError:
        return lambda msg: print(msg, file=sys.stderr, flush=True)
    bar = tqdm(desc="hicache bench", unit="cfg", file=sys.stderr)

    def show(msg: str) -> None:
        bar.update(1)
        bar.write(msg)
    return show


def peers_module() -> Any:
    """``benchmarks/peers.py`` of the source checkout this package runs from (it is not installed)."""
    import importlib.util

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # hicache_core: this module is in its bench/
    path = os.path.join(os.path.dirname(package), "benchmarks", "peers.py")
    if not os.path.exists(path):
        raise FileNotFoundError(
            "the peer benchmark ships in the source repository (benchmarks/peers.py), not in the installed "
            "package; run hicache bench --peers from an editable install of a checkout, or python -m benchmarks.peers there"
        )
    root = os.path.dirname(os.path.dirname(path))
    if root not in sys.path:
        sys.path.insert(0, root)  # peers.py imports its sibling modules as benchmarks.*
    spec = importlib.util.spec_from_file_location("benchmarks.peers", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["benchmarks.peers"] = module
    spec.loader.exec_module(module)
    return module


def _cmd(args: argparse.Namespace) -> int:
    if getattr(args, "peers", False):
        import shlex

        try:
            peers = peers_module()
        except FileNotFoundError as exc:
            print(f"hicache bench --peers: {exc}", file=sys.stderr)
            return 2
        # --out only when given: the peer benchmark has its own default folder (None there crashed it)
        out_args = ["--out", args.out] if args.out else []
        return int(peers.main([*out_args, *shlex.split(args.peers_args)]) or 0)
    if args.plot_only:
        try:
            rows = _plot_rows(args.plot_only)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"hicache bench --plot-only: cannot read rows from {args.plot_only} ({type(exc).__name__}: {exc}); "
                  "give a bench.json written by hicache bench", file=sys.stderr)
            return 2
    out = args.out or (os.path.dirname(os.path.abspath(args.plot_only)) if args.plot_only else "bench-results")
    if args.plot_only:
        try:
            os.makedirs(out, exist_ok=True)
        except OSError as exc:
            print(f"hicache bench: cannot create --out {out} ({exc})", file=sys.stderr)
            return 2
        return 0 if plot(rows, os.path.join(out, "bench.png")) else 1
    uneven = _uneven(args.tokens, args.page_sizes)
    if uneven:
        print(f"hicache bench: every --tokens value must be a multiple of every --page-sizes value; {uneven}",
              file=sys.stderr)
        return 2
    reg = create_registry()
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()] or None
    backends = ([x.strip() for x in args.io_backends.split(",") if x.strip()] if args.io_backends is not None
                else [b for b in DEFAULT_BACKENDS if b in reg.io_backends])
    for option, names, known in (("--layouts", layouts or [], reg.layouts), ("--io-backends", backends, reg.io_backends)):
        bad = [x for x in names if x not in known]
        if bad or (option == "--io-backends" and not names):
            print(f"hicache bench: {option} {', '.join(map(repr, bad)) or 'is empty'}: installed are "
                  f"{', '.join(sorted(known))}", file=sys.stderr)
            return 2
    problem = check_writable(os.path.join(out, "bench.json"))
    if problem:
        print(f"hicache bench: {problem}; pass --out a folder you can write", file=sys.stderr)
        return 2
    progress = _progress_printer()
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "sms": torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count, "argv": sys.argv[1:],
            "reps": args.reps, "rounds": args.rounds}
    path = os.path.join(out, "bench.json")
    done: list[dict[str, Any]] = []

    def sink(row: BenchRow) -> None:  # rewritten whole after every row: a killed run keeps its results
        done.append(asdict(row))
        write_json(path, {"meta": meta, "rows": done})

    run.run_bench(
        shapes=args.shapes, tokens=args.tokens, page_sizes=args.page_sizes,
        programs=[p or None for p in args.programs], layouts=layouts, backends=backends, ops=args.ops,
        reps=args.reps, rounds=args.rounds, gemm=args.gemm, hbm=args.hbm, direct_variants=args.direct_variants, registry=reg,
        progress=progress, sink=sink,
    )
    if not done:
        print("hicache bench: no cell of the grid could be measured (no installed strategy serves these layouts, "
              "io_backends and shapes: see hicache matrix); nothing written", file=sys.stderr)
        return 2
    plot(done, os.path.join(out, "bench.png"))
    return 0


def _plot_rows(path: str) -> list[dict[str, Any]]:
    """The rows of a bench.json at ``path``, each with what :func:`plot` reads.

    :raises OSError, ValueError, KeyError, TypeError: not such a file (nothing is plotted)."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    if not isinstance(rows, list) or not rows:
        raise ValueError("'rows' must be a non-empty list")
    for i, r in enumerate(rows):
        missing = [k for k in PLOT_KEYS if not isinstance(r, dict) or k not in r]
        if missing:
            raise KeyError(f"row {i} lacks {', '.join(missing)}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hicache-bench")
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)
