"""Per-GPU copy-engine calibration: from which block size the copy engine beats SM kernels.

The copy engine leaves every SM to the model but needs large contiguous
blocks: measured on an H200 (PCIe Gen5), batched copies of random 36 KB blocks
reach 0.97 (D2H) and 0.99 (H2D) of a pinned contiguous ``copy_``, 9 KB blocks
only 0.47-0.53 (D2H) and 0.85-0.89 (H2D).  ``auto`` serves a call through the
copy engine when every block it would submit is at least the calibrated
threshold for that direction, else through the layout's kernel.

``hicache calibrate`` measures the thresholds on the local GPU and writes them
to :func:`calibration_path`; without a file the shipped H200 values apply.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .jsonfile import check_writable, write_json
from .logonce import log_once
from .spec import as_int

__all__ = ["Calibration", "DEFAULT", "ENV_CALIBRATION", "calibration_path", "load_calibration", "measure", "rated", "add_parser"]

logger = logging.getLogger(__name__)

#: Path of the calibration file (default ``~/.cache/hicache/calibration.json``).
ENV_CALIBRATION = "HICACHE_CALIBRATION"


@dataclass(frozen=True)
class Calibration:
    """Copy-engine thresholds of one GPU model.

    :param gpu: device name the values were measured on (``torch.cuda.get_device_name``).
    :param d2h_min_block: smallest copy block (bytes) with which backups use the copy engine.
    :param h2d_min_block: same for loads.
    :param source: where the numbers come from (a date and command, or ``shipped``).
    :param submit_us: host time to submit one copy-engine descriptor, microseconds.
    :param link_gbps: the host link's GB/s (the pace the host must keep up with): ``hicache calibrate`` takes, per
        direction, the faster of a pinned memcpy and its best batched copy, and writes the median over the rows.
    :param call_us: host time of one batched-copy runtime call besides its descriptors, microseconds
        (``hicache calibrate`` does not measure it and writes the shipped value; its ``submit_us``
        is measured over calls of up to 512 descriptors, so it holds a small share of the call cost).
    :param kernel_load_ratio: the layout kernels' per-layer load bursts on this machine as a ratio to a pinned memcpy
        of the same bytes (``hicache calibrate``: the slower of MLA 1152- and 576-byte rows); ``None`` where not
        measured, taken as the usual speed (:data:`~hicache_core.backends.auto_rules.KERNEL_LOAD_USUAL`).  A host whose
        SM-driven loads run slower gives ``auto``'s copy engine more room on loads
        (:func:`~hicache_core.backends.auto_rules.kernel_room`).
    """

    gpu: str
    d2h_min_block: int
    h2d_min_block: int
    source: str
    submit_us: float = 0.5
    link_gbps: float = 55.0
    call_us: float = 6.0
    kernel_load_ratio: float | None = None

    def min_block(self, to_host: bool) -> int:
        return self.d2h_min_block if to_host else self.h2d_min_block


#: Shipped thresholds (H200, PCIe Gen5 x16, random block order; docs/performance.md): with the
#: host's submission hidden, D2H needs >= 32 KB blocks for >= 0.95 of memcpy; H2D reaches 0.85-0.89
#: at 8-16 KiB and 0.90-0.96 from 32 KiB (``hicache calibrate`` on an H200,
#: docs/perf/gpu-pace-reprobe-2026-12-06-h200-summary.txt: 16 KiB 0.877, 32 KiB 0.957, 64-256 KiB
#: 0.90-0.94; the first H200 measure gave 0.97-0.99 from 36 KB; every H100
#: calibration of docs/perf/ agrees), so both directions take the copy engine from 32 KiB, as the
#: calibration's default target (0.92) decides on either GPU.  Submitting costs ~0.5 us per descriptor (``hicache calibrate``; a
#: 61-layer MLA backup of 3904 descriptors took 1.8-2.1 ms of host time in bench runs) plus ~6 us per
#: runtime call (benchmarks/ce_probe.py: 6.7 us for a call of 1-4 descriptors, 34.5 us for 64), so
#: ``auto`` also requires the estimated host time of a call to fit in its transfer time at link speed (backups: 1.2x
#: it, ``auto_rules.BACKUP_ROOM``).
DEFAULT = Calibration("NVIDIA H200", d2h_min_block=32 * 1024, h2d_min_block=32 * 1024, source="shipped (H200)",
                      submit_us=0.5, link_gbps=55.0, call_us=6.0)


def calibration_path() -> str:
    """Where ``hicache calibrate`` writes and ``auto`` reads the calibration."""
    return os.environ.get(ENV_CALIBRATION) or os.path.join(os.path.expanduser("~"), ".cache", "hicache", "calibration.json")


#: Keys an entry of the calibration file may hold besides :class:`Calibration`'s fields.
_EXTRA_KEYS = {"measurements", "kernel_measurements"}
#: The largest ``kernel_load_ratio`` an entry may hold (a ratio to memcpy far above 1 is a measuring or writing slip).
MAX_KERNEL_LOAD_RATIO = 2.0


def _warn_once(message: str) -> None:
    """Log ``message`` at WARNING the first time (pools load the calibration one by one)."""
    log_once(logger, logging.WARNING, message)


def _number(entry: dict, key: str, default: float | None = None, *, integer: bool = False) -> Any:
    """``entry[key]`` (``default`` where absent) as a finite number (an integer where ``integer``)."""
    if key not in entry:
        if default is None:
            raise ValueError(f"{key!r} is missing")  # (a KeyError's str() would quote the message again)
        return default
    value = entry[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise ValueError(f"{key!r} must be a finite number, got {_short(value)}")
    if integer and not (isinstance(value, int) or float(value).is_integer()):
        raise ValueError(f"{key!r} must be a whole number of bytes, got {value!r}")
    return int(value) if integer else float(value)


def _finite(value: int | float) -> bool:
    """Whether ``value`` is a finite float (a JSON integer too large for a float is not: ``math.isfinite`` would raise
    ``OverflowError`` on it)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _short(value: object, limit: int = 40) -> str:
    """``repr(value)``, cut to ``limit`` characters (a 400-digit number in a warning says nothing more)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _read_json(path: str) -> Any:
    """The JSON value of the file at ``path``.

    :raises ValueError: not JSON, not UTF-8, or nested too deeply to parse (``json`` raises ``RecursionError`` there).
    :raises OSError: the file cannot be opened or read."""
    with open(path) as f:
        try:
            return json.load(f)
        except RecursionError:
            raise ValueError("nested too deeply to parse") from None


def load_calibration(device: torch.device, *, warn_other_gpu: bool = True) -> Calibration:
    """The calibration for ``device``'s GPU model (``cpu`` for CPU pools): the file's entry if any, else
    :data:`DEFAULT`.  Without a file, a GPU other than :data:`DEFAULT`'s is warned about (once), unless
    ``warn_other_gpu`` is false (a caller that reports it itself: ``hicache doctor``).  A file that
    ``$HICACHE_CALIBRATION`` names but that is missing, unreadable, not an object of GPU entries, without an entry for
    this GPU, or with a malformed entry (a value that is not a finite number, block sizes that are not whole positive
    numbers, a link speed over :data:`MAX_LINK_GBPS`) gives :data:`DEFAULT` with a warning naming the file and the fix (once per message); unknown keys are
    warned about and ignored."""
    path = calibration_path()
    named = bool(os.environ.get(ENV_CALIBRATION))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    fix = ("run `hicache calibrate` on this GPU, or fix the file" if device.type == "cuda" else
           "fix the file: CPU pools read its \"cpu\" entry, written by hand (`hicache calibrate` needs a CUDA GPU)")
    try:
        data = _read_json(path)
    except FileNotFoundError:
        if named:
            _warn_once(f"hicache: {ENV_CALIBRATION}={path} does not exist; using the shipped calibration ({DEFAULT.gpu}); "
                       f"{fix}")
        elif warn_other_gpu and device.type == "cuda" and gpu != DEFAULT.gpu:
            # the shipped numbers are one GPU's and its host's: elsewhere auto's line between the copy engine and the
            # kernel may sit several points off the better route (docs/perf/runs.md, the H100 runs)
            _warn_once(f"hicache: no calibration for {gpu!r} ({path} does not exist); auto uses the shipped one, "
                       f"measured on an {DEFAULT.gpu}; run `hicache calibrate` on this GPU")
        return DEFAULT
    except (OSError, ValueError) as exc:
        _warn_once(f"hicache: ignoring unreadable calibration {path} ({exc}); using the shipped calibration; {fix}")
        return DEFAULT
    if not isinstance(data, dict):
        _warn_once(f"hicache: calibration {path} must be a JSON object of GPU name -> entry, got {type(data).__name__}; "
                   f"using the shipped calibration; {fix}")
        return DEFAULT
    if gpu not in data:
        if named or device.type == "cuda":  # (CPU pools of a machine whose file holds its GPUs: no noise)
            _warn_once(f"hicache: calibration {path} has no entry for {gpu!r} (entries: {sorted(data)}); using the "
                       f"shipped calibration ({DEFAULT.gpu}); {fix}")
        return DEFAULT
    try:
        cal, unknown = _entry(gpu, data[gpu], path)
    except (TypeError, ValueError) as exc:
        _warn_once(f"hicache: calibration {path} entry {gpu!r} is malformed ({exc}); using the shipped calibration; "
                   f"{fix}")
        return DEFAULT
    if unknown:
        _warn_once(f"hicache: calibration {path} entry {gpu!r}: unknown keys {unknown} ignored")
    return cal


#: The fastest host link a calibration may claim (GB/s per direction; NVLink-C2C hosts reach ~450): a larger value is
#: taken for a unit slip (MB/s written as GB/s).
MAX_LINK_GBPS = 1000.0


def _entry(gpu: str, entry: object, path: str) -> tuple[Calibration, list[str]]:
    """The :class:`Calibration` of one file entry and its unknown keys.

    :raises TypeError: the entry is not an object.
    :raises ValueError: a value is missing, not a finite number, a block size not a whole positive number of bytes, a
        negative time, a link speed outside ``(0, MAX_LINK_GBPS]``, or a ``kernel_load_ratio`` (``null`` allowed)
        outside ``(0, MAX_KERNEL_LOAD_RATIO]``."""
    if not isinstance(entry, dict):
        raise TypeError(f"the entry must be an object, got {type(entry).__name__}")
    unknown = sorted(set(entry) - {f for f in Calibration.__dataclass_fields__ if f != "gpu"} - _EXTRA_KEYS)
    cal = Calibration(gpu, _number(entry, "d2h_min_block", integer=True), _number(entry, "h2d_min_block", integer=True),
                      str(entry.get("source", path)), _number(entry, "submit_us", DEFAULT.submit_us),
                      _number(entry, "link_gbps", DEFAULT.link_gbps), _number(entry, "call_us", DEFAULT.call_us),
                      _number(entry, "kernel_load_ratio") if entry.get("kernel_load_ratio") is not None else None)
    if cal.kernel_load_ratio is not None and not 0 < cal.kernel_load_ratio <= MAX_KERNEL_LOAD_RATIO:
        raise ValueError(f"kernel_load_ratio={cal.kernel_load_ratio:g} must be in (0, {MAX_KERNEL_LOAD_RATIO:g}] (a ratio "
                         "to a pinned memcpy of the same bytes), or null where not measured")
    if min(cal.d2h_min_block, cal.h2d_min_block) < 1 or min(cal.submit_us, cal.call_us) < 0 or cal.link_gbps <= 0:
        raise ValueError("block sizes and link_gbps must be positive, submit_us and call_us not negative")
    if cal.link_gbps > MAX_LINK_GBPS:
        raise ValueError(f"link_gbps={cal.link_gbps:g} is over {MAX_LINK_GBPS:g} GB/s, faster than any host link: "
                         "write GB/s (1e9 bytes per second), not MB/s")
    return cal, unknown


def file_report() -> tuple[str, list[str]]:
    """What ``hicache doctor`` says of the calibration file, whatever the machine: one line (where it is, which GPUs it
    holds) and a problem per entry ``auto`` would refuse or key it would ignore (each named as the warnings name
    them).  A missing file is no problem (the shipped values apply)."""
    path = calibration_path()
    try:
        data = _read_json(path)
    except FileNotFoundError:
        named = f" ({ENV_CALIBRATION} names it)" if os.environ.get(ENV_CALIBRATION) else ""
        return f"no file at {path}{named}: the shipped values ({DEFAULT.gpu}) apply", (
            [f"{ENV_CALIBRATION}={path} does not exist"] if named else [])
    except (OSError, ValueError) as exc:
        return f"{path}", [f"{path} is unreadable ({exc}): auto uses the shipped calibration"]
    if not isinstance(data, dict):
        return f"{path}", [f"{path} must be a JSON object of GPU name -> entry, got {type(data).__name__}"]
    problems = []
    for gpu, entry in data.items():
        try:
            unknown = _entry(gpu, entry, path)[1]
        except (TypeError, ValueError) as exc:
            problems.append(f"{path} entry {gpu!r} is malformed ({exc}): auto uses the shipped calibration for that GPU")
            continue
        if unknown:
            problems.append(f"{path} entry {gpu!r}: unknown keys {unknown} ignored")
    return f"{path}, entries for {sorted(data) or 'no GPU'}", problems


def measure(block_sizes: list[int], total_bytes: int, reps: int = 10) -> list[dict[str, float]]:
    """Copy-engine ratio to the link's speed for random blocks of each size, both directions.

    The stream is held by a GPU sleep while the host submits, so the ratio is the copy
    engine's own efficiency; the host's submission time per descriptor is reported apart.
    The link's speed in a direction (each row's ``link_gbps``) is the faster of one pinned contiguous
    ``copy_`` (``memcpy_gbps``, timed before and after the blocks, the better kept) and the best batched
    copy: a memcpy slowed by a passing disturbance, or slower than batched copies on some hosts (an H100
    host measured 38.9 GB/s D2H for it once, against 54.2 for 256 KB blocks), must not let small blocks
    pass the target nor understate the link (:func:`rated`).

    After measuring (also when measuring fails), the process's cached device memory and cached pinned host memory are handed back
    (:func:`hicache_core.bench.timing._release_memory`): its buffers would otherwise stay cached until exit.

    :raises ValueError: ``total_bytes`` or ``reps`` is not a whole number >= 1, or a block size is not a whole number
        in ``1..total_bytes`` (checked before anything is allocated).
    """
    total_bytes = as_int(total_bytes, "measure(total_bytes)", ValueError)
    reps = as_int(reps, "measure(reps)", ValueError)
    if total_bytes < 1 or reps < 1:
        raise ValueError(f"measure(total_bytes={total_bytes}, reps={reps}): both must be >= 1")
    block_sizes = [as_int(b, "measure(block_sizes) entry", ValueError) for b in block_sizes]
    bad = [b for b in block_sizes if not 1 <= b <= total_bytes]
    if bad:
        raise ValueError(f"measure(block_sizes): {bad[:4]} outside 1..total_bytes={total_bytes}; pass block sizes of at "
                         "least one byte that fit total_bytes at least once, or a larger total_bytes")
    from .bench.timing import _release_memory

    try:
        return _measure(block_sizes, total_bytes, reps)
    finally:
        _release_memory()  # the pinned buffer and the device one are the caching allocators' until handed back


def _measure(block_sizes: list[int], total_bytes: int, reps: int) -> list[dict[str, float]]:
    """:func:`measure`'s timing, its arguments checked."""
    from .backends.cudart import runtime
    from .bench.timing import _median_ms

    rt = runtime()
    host = torch.empty(total_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(total_bytes, dtype=torch.uint8, device="cuda")
    out: list[dict[str, float]] = []
    memcpy: dict[bool, float] = {}
    for to_host in (True, False):
        dst_t, src_t = (host, dev) if to_host else (dev, host)

        def base() -> float:
            return total_bytes / _median_ms(lambda: dst_t.copy_(src_t, non_blocking=True), reps, warmup=1) / 1e6

        memcpy[to_host] = base()
        for block in block_sizes:
            n = total_bytes // block
            perm = torch.randperm(n, dtype=torch.int64) * block
            off = torch.arange(n, dtype=torch.int64) * block
            dsts = (perm if to_host else off) + dst_t.data_ptr()
            srcs = (off if to_host else perm) + src_t.data_ptr()
            lens = torch.full((n,), block, dtype=torch.int64)
            stream = int(torch.cuda.current_stream().cuda_stream)
            times, submits = [], []
            for _ in range(reps + 1):
                torch.cuda.synchronize()
                torch.cuda._sleep(int(2e6 + 3000 * n))  # ~1 ms + ~1.5 us per descriptor at ~2 GHz
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                t0 = time.perf_counter()
                rt.copy_batch(dsts, srcs, lens, stream)
                submits.append((time.perf_counter() - t0) * 1e6 / n)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            gbps = n * block / statistics.median(times[1:]) / 1e6
            out.append({"to_host": to_host, "block": block, "gbps": gbps,
                        "submit_us_per_block": statistics.median(submits[1:])})
        memcpy[to_host] = max(memcpy[to_host], base())
    return rated(out, memcpy)


def rated(rows: list[dict[str, Any]], memcpy: dict[bool, float]) -> list[dict[str, Any]]:
    """``rows`` (``to_host``, ``block``, ``gbps``, ...) with ``memcpy_gbps`` (``memcpy[to_host]``), ``link_gbps`` (the
    faster of it and the direction's best ``gbps``) and ``ratio`` (``gbps / link_gbps``, so never above 1) added."""
    link = {t: max([m] + [float(r["gbps"]) for r in rows if bool(r["to_host"]) == t]) for t, m in memcpy.items()}
    return [{**r, "memcpy_gbps": memcpy[bool(r["to_host"])], "link_gbps": link[bool(r["to_host"])],
             "ratio": float(r["gbps"]) / link[bool(r["to_host"])]} for r in rows]


def _threshold(rows: list[dict[str, float]], to_host: bool, target: float) -> int | None:
    """The smallest measured block size that reached ``target`` in the direction ``to_host``; ``None`` if none did."""
    ok = sorted(int(r["block"]) for r in rows if bool(r["to_host"]) == to_host and r["ratio"] >= target)
    return ok[0] if ok else None


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 < value <= 1.0:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"must be a ratio in (0, 1], got {text!r}")
    return value


def add_parser(subparsers: Any) -> None:
    from .cli import _positive_int

    p = subparsers.add_parser("calibrate", help="measure this GPU's copy-engine block-size thresholds for auto")
    p.add_argument("--target", type=_share, default=0.92, help="ratio to the link's speed (the faster of a pinned memcpy "
                   "and the best batched copy) the copy engine must reach, in (0, 1] (default 0.92)")
    p.add_argument("--total-mb", type=_positive_int, default=64, help="bytes per measurement, MB (default 64)")
    p.add_argument("--out", default=None, help=f"file to update (default {ENV_CALIBRATION} or ~/.cache/hicache/calibration.json)")
    p.add_argument("--no-kernel", dest="kernel", action="store_false",
                   help="skip the measure of the layout kernels' load bursts (kernel_load_ratio; by default measured "
                        "where a layout plugin's kernel is installed; the GPU's entry is replaced whole, so one "
                        "measured before is dropped)")
    p.set_defaults(func=_cmd)


def _existing(path: str) -> dict:
    """The calibration file at ``path`` to update (``{}`` when there is none).

    :raises ValueError: the file exists but is not a JSON object (it is never overwritten then)."""
    try:
        data = _read_json(path)
    except (FileNotFoundError, NotADirectoryError):  # none yet (whether one can be written is asked next)
        return {}
    except (OSError, ValueError) as exc:
        raise ValueError(f"calibration file {path} exists but cannot be read ({exc}); fix or move it, or pass --out "
                         "another file (it is never overwritten)") from None
    if not isinstance(data, dict):
        raise ValueError(f"calibration file {path} is not a JSON object of GPU name -> entry; fix or move it, or pass "
                         "--out another file (it is never overwritten)")
    return data


def _kernel_rows() -> list[dict[str, Any]]:
    """The layout kernels' load bursts (:func:`~hicache_core.kernel_rate.measure_kernel_loads`), printed; none where
    no layout plugin's kernel is installed or it cannot run here (said, not fatal: the copy engine's measure stands)."""
    from .kernel_rate import measure_kernel_loads

    try:
        krows = measure_kernel_loads()
    except Exception as exc:  # e.g. Triton missing or failing to compile here: kernel_load_ratio is left unmeasured
        print(f"hicache calibrate: the kernels' load bursts not measured ({type(exc).__name__}: "
              f"{str(exc).splitlines()[0] if str(exc) else ''}); kernel_load_ratio left out", file=sys.stderr)
        return []
    if not krows:
        print("hicache calibrate: no installed layout's kernel to measure; kernel_load_ratio left out", file=sys.stderr)
    for r in krows:
        print(f"kernel load bursts, {r['shape']} via {r['layout']}: ratio {r['ratio']:.3f} to memcpy")
    return krows


def _cmd(args: argparse.Namespace) -> int:
    # the CLI refuses the command without CUDA before it gets here (usage error, exit 2)
    path = args.out or calibration_path()
    try:
        data = _existing(path)  # before measuring: a file that would be lost stops the command
    except ValueError as exc:
        print(f"hicache calibrate: {exc}", file=sys.stderr)
        return 2
    problem = check_writable(path)  # before measuring too: a measure that cannot be written is lost
    if problem:
        print(f"hicache calibrate: {problem}; pass --out a file in a folder you can write", file=sys.stderr)
        return 2
    blocks = [4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10]
    rows = measure(blocks, args.total_mb * 1_000_000)
    for r in rows:
        print(f"{'D2H' if r['to_host'] else 'H2D'} {int(r['block']) >> 10:4d} KiB blocks: {r['gbps']:6.1f} GB/s "
              f"ratio {r['ratio']:.3f}  submit {r['submit_us_per_block']:.2f} us/block")
    # a memcpy below the batched copies: the ratios are to the faster (measure()); a direction's rows share both speeds
    for to_host, r in {bool(r["to_host"]): r for r in rows}.items():
        if r["memcpy_gbps"] < 0.97 * r["link_gbps"]:
            print(f"{'D2H' if to_host else 'H2D'}: one pinned memcpy reached {r['memcpy_gbps']:.1f} GB/s, batched copies "
                  f"{r['link_gbps']:.1f}: ratios and the link's speed are taken from the faster")
    gpu = torch.cuda.get_device_name()
    d2h, h2d = _threshold(rows, True, args.target), _threshold(rows, False, args.target)
    if d2h is None or h2d is None:
        for to_host, found in ((True, d2h), (False, h2d)):
            if found is None:
                best = max((r for r in rows if bool(r["to_host"]) == to_host), key=lambda r: r["ratio"])
                print(f"hicache calibrate: no block size up to {max(blocks) >> 10} KiB reached --target "
                      f"{args.target} {'D2H' if to_host else 'H2D'} (best {best['ratio']:.3f} at "
                      f"{int(best['block']) >> 10} KiB blocks)", file=sys.stderr)
        print(f"hicache calibrate: nothing written to {path} (this GPU's entry, if any, is kept); measure again on an "
              "idle GPU, or pass a lower --target", file=sys.stderr)
        return 1
    kernel_rows = _kernel_rows() if args.kernel else []
    cal = Calibration(gpu, d2h, h2d, f"hicache calibrate --target {args.target} on {time.strftime('%Y-%m-%d')}",
                      statistics.median(r["submit_us_per_block"] for r in rows),
                      statistics.median(r["link_gbps"] for r in rows),
                      kernel_load_ratio=min((r["ratio"] for r in kernel_rows), default=None))
    data[gpu] = {**{k: v for k, v in asdict(cal).items() if k != "gpu" and v is not None}, "measurements": rows}
    if kernel_rows:
        data[gpu]["kernel_measurements"] = kernel_rows
    try:
        write_json(path, data)
    except OSError as exc:
        print(f"hicache calibrate: cannot write {path} ({exc}); the measurement as JSON on stdout:", file=sys.stderr)
        print(json.dumps({gpu: data[gpu]}, indent=1))
        return 2
    kernel = "" if cal.kernel_load_ratio is None else f"; kernel load bursts {cal.kernel_load_ratio:.3f} of memcpy"
    print(f"{gpu}: copy engine from {cal.d2h_min_block} B blocks (D2H), {cal.h2d_min_block} B (H2D){kernel}; "
          f"written to {path}")
    return 0
