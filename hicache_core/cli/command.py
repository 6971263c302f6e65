"""The ``hicache`` command's parser and :func:`main`: one parser builder per subcommand in :data:`SUBCOMMANDS`, the
logging setup, and the exit codes of usage errors (2) and of a reader that went away (:data:`BROKEN_PIPE`)."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from typing import Callable

import torch

from .. import __version__
from ..envflags import OFF
from ..errors import RegistryError
from ..registry import ENV_TRACE
from .doctor import _parser_doctor
from .explain import _parser_explain
from .matrix import _parser_matrix
from .plugins import _parser_plugins
from .shared import UsageError, _version
from .verify import _parser_verify

#: The package :mod:`hicache_core` (this module is ``hicache_core.cli.command``).
_CORE = __name__.partition(".")[0]
#: Exit code when the reader of the output went away (``hicache plugins | head -1``): 128 + SIGPIPE, as a shell
#: reports a process that signal ends; never 1 (a failing ``verify`` cell).
BROKEN_PIPE = 141


def _version_text() -> str:
    return f"hicache {_version('hicache-core') or __version__}"


def _common() -> argparse.ArgumentParser:
    """Options every subcommand also accepts after its name (``hicache verify -v``)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                        help="log INFO (-v) or DEBUG (-vv) to stderr")
    return common


def _needs_cuda(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Wrap ``bench``: without CUDA it is a usage error, before anything is written."""
    def run(args: argparse.Namespace) -> int:
        asks_help = getattr(args, "peers", False) and bool({"-h", "--help"} & set(getattr(args, "peers_args", "").split()))
        if not getattr(args, "plot_only", "") and not asks_help and not torch.cuda.is_available():
            raise UsageError("needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is False)")
        return func(args)
    return run


def _parser_bench(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    if importlib.util.find_spec(f"{_CORE}.bench") is None:
        return
    from .. import bench

    bench.add_parser(sub)
    p = sub.choices["bench"]
    p.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                   help="log INFO (-v) or DEBUG (-vv) to stderr")
    p.set_defaults(func=_needs_cuda(p.get_default("func")))


def _parser_calibrate(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    from .. import calibration

    calibration.add_parser(sub)
    p = sub.choices["calibrate"]
    p.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                   help="log INFO (-v) or DEBUG (-vv) to stderr")
    p.set_defaults(func=_needs_cuda(p.get_default("func")))


#: One parser builder per subcommand, in ``--help`` order.
SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction, argparse.ArgumentParser], None], ...] = (
    _parser_plugins, _parser_matrix, _parser_explain, _parser_verify, _parser_doctor, _parser_bench,
    _parser_calibrate,
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``hicache`` (``bench`` is added when :mod:`hicache_core.bench` exists)."""
    parser = argparse.ArgumentParser(prog="hicache", description="hicache: KV cache host pools in any layout.")
    parser.add_argument("--version", action="version", version=_version_text())
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log INFO (-v) or DEBUG (-vv) to stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = _common()
    for add in SUBCOMMANDS:
        add(sub, common)
    return parser


def _configure_logging(verbose: int) -> None:
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    if os.environ.get(ENV_TRACE, "").strip().lower() not in ("", *OFF):  # resolutions are INFO records of the registry
        logging.getLogger(f"{_CORE}.registry").setLevel(min(level, logging.INFO))


def main(argv: list[str] | None = None) -> int:
    """Run ``hicache``; returns the exit code."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # with the command's own usage (argparse gives the top-level one, which lists no option of the command)
        given = list(sys.argv[1:] if argv is None else argv)
        before = args.command in given and any(x in given[:given.index(args.command)] for x in extra)
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        (parser if before else commands.choices[args.command]).error(f"unrecognized arguments: {' '.join(extra)}")
    _configure_logging(args.verbose)
    try:
        return int(args.func(args))
    except (RegistryError, UsageError) as exc:
        print(f"hicache {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. ``hicache verify | head``: stop quietly, with the code of a process SIGPIPE ends
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE
