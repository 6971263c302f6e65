"""``hicache doctor``: torch and CUDA, Triton and its interpreter, numpy, the copy engine's runtime, auto's
calibration, the plugins, and which cells ``verify`` will skip on this machine."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import sys

import torch

from ..kernel_support import interpreting
from ..registry import Registry
from . import shared
from .matrix import Cell, matrix_cells
from .shared import INTERPRET_EXTRA, _first_line, _interpreter_problem, _n, _version, install_problems, no_layout
from .verify import verified_cells


def _module_version(module: str) -> str | None:
    """The installed version of ``module``, without importing it when its distribution says (importing
    Triton would fix its interpreter mode for the whole process), else from the imported module."""
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return str(getattr(importlib.import_module(module), "__version__", "installed"))
    except Exception as exc:  # a broken install is reported, not raised
        return f"installed but fails to import: {_first_line(exc)}"


def _copy_engine_runtime() -> str:
    """Which CUDA runtime the copy engine binds, whether it batches, and the other runtimes mapped beside it."""
    from ..backends import cudart

    try:
        rt = cudart.runtime()
    except RuntimeError as exc:
        return f"unavailable ({_first_line(exc)})"
    how = "batched copies" if rt.has_batch else "one call per copy (no cudaMemcpyBatchAsync)"
    text = f"CUDA runtime {rt.path} (runtime {rt.version}, driver {rt.driver_version}: {how})"
    bound = os.path.realpath(rt.path)  # (a soname or a link next to torch; /proc/self/maps names the file)
    others = [p for p in cudart.loaded_cudart_paths() if os.path.realpath(p) != bound]
    return text + (f"; also mapped, unused: {', '.join(others)}" if others else "")


def _calibration_line() -> str:
    """The calibration ``auto`` reads for the first GPU, and whether it was measured on another model."""
    from ..calibration import DEFAULT, calibration_path, load_calibration

    cal = load_calibration(torch.device("cuda", 0), warn_other_gpu=False)  # the line below says it, once
    text = (f"{cal.gpu}, {cal.source} (file: {calibration_path()}): copy engine from {cal.d2h_min_block} B blocks "
            f"(backups) / {cal.h2d_min_block} B (loads), {cal.submit_us:.2f} us per descriptor, {cal.call_us:g} us per "
            f"call, link {cal.link_gbps:.1f} GB/s")
    if cal.kernel_load_ratio is not None:
        from ..backends.auto_rules import kernel_room

        room = kernel_room(cal)
        text += (f"; kernels' load bursts {cal.kernel_load_ratio:.2f} of memcpy"
                 + (f": auto's loads get {room:.2f}x room on the copy engine" if room > 1.0 else ""))
    elif cal is not DEFAULT:  # a file's entry written before calibrate measured the kernels, or with --no-kernel
        text += "; kernels' load speed not measured (taken as usual): `hicache calibrate` measures it"
    here = torch.cuda.get_device_name(0)
    if cal.gpu != here:
        text += f"; measured on another GPU than this {here}: run `hicache calibrate` here"
    return text


def doctor_lines(reg: Registry) -> list[str]:
    """The environment report of ``hicache doctor``: one fact per line, then the cells this machine skips."""
    cuda = torch.cuda.is_available()
    lines = [f"hicache-core {_version('hicache-core') or '(not installed as a distribution)'}, "
             f"Python {sys.version.split()[0]}, torch {torch.__version__} "
             f"(CUDA build: {torch.version.cuda or 'no'})"]
    if cuda:
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        lines.append(f"CUDA: available, {_n(torch.cuda.device_count(), 'device')} ({', '.join(names)})")
        torch.cuda.init()
        lines.append("copy engine (direct): " + _copy_engine_runtime())
        lines.append("auto's calibration: " + _calibration_line())
    else:
        lines.append("CUDA: not available (CPU pools only; the kernel io_backend needs TRITON_INTERPRET=1)")
        lines.append("copy engine (direct): memmove on CPU pools (no CUDA runtime needed)")
    from ..calibration import file_report

    where, problems = file_report()
    lines.append(f"calibration file: {where}")
    lines += [f"  PROBLEM: {p}" for p in problems]
    triton = _module_version("triton")
    lines.append(f"Triton: {triton}" if triton else "Triton: not installed (pip install triton); kernel cells skip")
    numpy = _module_version("numpy")
    interp = "on (TRITON_INTERPRET=1)" if interpreting() else "off"
    lines.append(f"Triton interpreter: {interp}; numpy: {numpy or f'not installed (the interpreter needs it: {INTERPRET_EXTRA})'}")
    lines.append(f"plugins: {_n(len(reg.plugins), 'plugin')} ({sum(1 for p in reg.plugins if p.error)} broken), "
                 f"layouts: {', '.join(sorted(reg.layouts)) or '(none)'}; io_backends: {', '.join(reg.io_backends) or '(none)'}")
    lines += [f"  BROKEN {p.name} ({p.label}): {p.error}" for p in reg.plugins if p.error]
    lines += [f"  DISABLED: {c.message}" for c in reg.conflicts]
    if install_problems(reg):
        lines.append("  (verify and plugins exit 1 until these are mended)")
    if not reg.layouts:
        return lines + [no_layout(reg)]
    device = torch.device("cuda" if cuda else "cpu")
    cells = verified_cells(reg, matrix_cells(reg, device=device))
    unserved = [c for c in cells if c.strategy is None]
    failing = sum(c.load_failed for c in unserved)
    lines.append(f"verify on {device}: {len(cells) - len(unserved)} of {_n(len(cells), 'cell')} will run, "
                 f"{len(unserved) - failing} will be skipped" + (f", {failing} will fail" if failing else "")
                 + (":" if unserved else ""))
    by_reason: dict[str, list[Cell]] = {}
    for c in unserved:
        by_reason.setdefault(c.reason, []).append(c)
    for reason, group in by_reason.items():
        lines.append(f"  {_n(len(group), 'cell')} ({', '.join(sorted({f'{c.layout}/{c.io_backend}' for c in group}))}): "
                     f"{reason}")
    problem = _interpreter_problem()
    if problem and device.type == "cpu":
        lines.append(f"problem: {problem}")
    return lines


def _cmd_doctor(args: argparse.Namespace) -> int:
    print("\n".join(doctor_lines(shared._registry())))
    return 0


def _parser_doctor(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("doctor", parents=[common],
                       help="torch/CUDA, Triton, interpreter, numpy, copy engine, and which verify cells will skip")
    p.set_defaults(func=_cmd_doctor)

