"""``auto``'s rules, apart from its state: the key a call's decision is memoised under, and whether the host feeds the
copy engine a submission within its transfer time (:func:`fed`), at the calibration's costs or at a measured pace.

:class:`~.auto.AutoStrategy` applies them per call; ``hicache explain`` and the tests apply them to a submission alone.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import cast

import torch

from ..calibration import Calibration
from ..errors import ConfigError
from .cudart import schedule_calls
from .forward import MAX_ROOM
from .pace import MIN_OPS, MODEL_CALL_US
from .plans import Submission

__all__ = ["pick_key", "fed", "worth_measuring", "allowed_us", "burst_us", "FED_SHARE", "BACKUP_ROOM", "FORWARD_MODES",
           "ENV_FORWARD", "ENV_BACKUP_ROOM", "MEMORY_KERNEL_SHARE", "backup_room_option", "KERNEL_LOAD_USUAL",
           "kernel_room", "SLOW_KERNEL_ROOM"]


def pick_key(host_indices: torch.Tensor, device_indices: torch.Tensor, layer: int | None,
             to_host: bool) -> tuple | None:
    """A call's key in :attr:`AutoStrategy._picks` (tensor ids and versions, length, one layer or all, direction),
    ``None`` for tensors without a version counter (never memoised)."""
    try:
        vh, vd = host_indices._version, device_indices._version
    except RuntimeError:
        return None
    return id(host_indices), vh, id(device_indices), vd, host_indices.numel(), layer is None, to_host


#: Share of a call's transfer time at link speed that the host's *measured* submission time may take (:func:`fed`):
#: a host-bound copy engine moves a burst at the host's pace, so it stays ahead of the kernels' loads (0.84-0.90 of
#: memcpy) while the host submits within ~1.1x the link time (H200: fp8 MLA bursts 0.92 of memcpy at 45 us of host
#: time per 43 us layer; bf16 MLA bursts 0.94 at 88 us per 86 us layer).
FED_SHARE = 1.1


#: The kernels' per-layer load bursts, as a ratio to a pinned memcpy of the same bytes, on the hosts :data:`FED_SHARE`
#: was measured on (H200 and H100 hosts: MLA 1152-byte rows 0.87-0.89, fp8 576- and 656-byte rows 0.83-0.85;
#: docs/performance.md).  A calibration that measured this host's kernel loads slower (``kernel_load_ratio``) gives
#: the copy engine's loads the room :func:`kernel_room` says.
KERNEL_LOAD_USUAL = 0.84
#: A kernel room from which ``auto`` drops its lone-load rule (the kernel's lone loads reach the link faster than the
#: copy engine's only where the kernel runs at its usual speed: H200, 0.88-0.91 against 0.68-0.90), unless
#: ``forward="watch"`` times those loads itself: the kernel's loads measured under ~0.67 of memcpy.
SLOW_KERNEL_ROOM = 1.25


def kernel_room(cal: Calibration) -> float:
    """The room (:func:`allowed_us`'s ``room``) a calibration's measure of the kernels' load bursts gives the copy
    engine's loads: :data:`KERNEL_LOAD_USUAL` over ``cal.kernel_load_ratio`` where that is lower, at most
    :data:`~.forward.MAX_ROOM`; 1 where it was not measured or the kernels load at their usual speed.  A host-bound copy
    engine moves a load burst at the host's pace, so where the kernel is slow it wins with a slower host too (an H100
    host whose kernel ran fp8 MLA load bursts at 0.58 of memcpy, against the copy engine's 0.88-0.93:
    docs/performance.md)."""
    ratio = cal.kernel_load_ratio
    if ratio is None or ratio >= KERNEL_LOAD_USUAL:
        return 1.0
    return min(MAX_ROOM, KERNEL_LOAD_USUAL / ratio)


#: Values of :class:`AutoStrategy`'s ``forward`` option (see the module docstring).
FORWARD_MODES = ("compute", "memory", "watch")
#: Environment variable giving ``forward`` where the option is not passed (e.g. to pools the SGLang bridge makes).
ENV_FORWARD = "HICACHE_AUTO_FORWARD"
#: Share of their idle speed that SM-driven load bursts keep beside memory-bound work: H200, a reduction over 2 GiB
#: of device memory on another stream, hicache's, SGLang 0.5.23's and LMCache's kernels alike: 0.35-0.59 of memcpy
#: against 0.73-0.91 idle (MLA 576 bf16: 0.40 of 0.87), while copy-engine bursts held 0.90-0.98 (docs/perf/runs.md,
#: "transfers beside a memory-bound kernel").  With ``forward="memory"``, the host may take up to 1 / this as long to
#: submit a load as with ``"compute"`` before the kernel is judged faster.
MEMORY_KERNEL_SHARE = 0.45


#: Factor by which a backup's host submission may exceed its transfer time at link speed and still go to the copy
#: engine: a choice of the forward pass over the backup's speed.  Copies start with the first runtime call, so a
#: host-bound backup moves at about the host's pace, while the kernels' backups slow a GEMM beside them by +11% to +19%
#: on small pages (576- and 656-byte rows, 64-token pages).  H100 hosts, fp8 656 B rows in a layer-major layout, 4096
#: tokens, all layers: where this room moved the backup to the copy engine, it ran at +0.0-1.0% GEMM, faster than the
#: kernel on two hosts (0.911 against 0.799, 0.938 against 0.909, the kernel at +17-20%) and slower on another (0.700
#: against 0.879, its host submitting for 1.22x the link time); docs/perf/runs.md, fourth H100 run.  At 1.0 a backup
#: must fit within its transfer time, as loads do.  ``auto``'s ``backup_room`` option (or :data:`ENV_BACKUP_ROOM`) sets
#: it per pool.  Measured before the kernels' backups went out in launches of at most 32 MiB
#: (:data:`hicache_core.rowcopy_tuning.BACKUP_LAUNCH_BYTES`, 2026-12-07), which cost a GEMM -1.4% to +2.7% (record calls
#: 57-59): with them the room's premise no longer holds, but 1.0 has not been measured against them yet.  In record
#: call 62 (H100, the peers' 4096-token backup cells, pages of 64) the copy engine ran 0.960-0.989 at +0.5% to +3.8%
#: against those kernels' 0.926-0.934 at -0.2% to +2.5%, its submission well under the transfer time (1.0 picks it
#: too); the cells this room decides (a submission of 1.0-1.2x the transfer time: small pages, fp8 rows) are untimed.
#: With the split's launches made dependent (record call 64) the kernels ran 0.916-0.945 at -1.3% to +0.9% (fp8 656 B
#: 0.878 at +3.1%): still below the copy engine in those cells.
BACKUP_ROOM = 1.2
#: Environment variable giving ``auto``'s ``backup_room`` where the option is not passed (e.g. to pools the SGLang
#: bridge makes).
ENV_BACKUP_ROOM = "HICACHE_AUTO_BACKUP_ROOM"


def backup_room_option(value: object) -> float:
    """``auto``'s ``backup_room`` option (``None``: :data:`ENV_BACKUP_ROOM` if set, else :data:`BACKUP_ROOM`) as a
    positive finite float.

    :raises ConfigError: not a positive finite number, naming the option or the variable and the fix."""
    where, shown, number = "auto's backup_room option", value, None
    if value is None:
        raw = os.environ.get(ENV_BACKUP_ROOM, "")
        if not raw.strip():
            return BACKUP_ROOM
        where, shown = ENV_BACKUP_ROOM, raw
        try:
            number = float(raw)
        except ValueError:
            pass
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int beyond any float
            pass
    if number is None or not math.isfinite(number) or number <= 0:
        raise ConfigError(f"{where} is {shown!r}: use a positive number, the times its transfer time at link speed a "
                          f"backup's submission may take and still go to the copy engine (default {BACKUP_ROOM:g}; 1.0: "
                          "it must fit its transfer time, as a load must)")
    return number


def allowed_us(nbytes: int, cal: Calibration, to_host: bool, room: float, backup_room: float = BACKUP_ROOM) -> float:
    """The time a submission of ``nbytes`` may take: their transfer time at link speed, times ``backup_room`` for
    backups (:data:`BACKUP_ROOM` unless ``auto``'s option says otherwise), times ``room`` for loads (the factor by which
    the forward pass beside them slows the kernel's loads; 1 with ``forward="compute"``)."""
    return nbytes / (cal.link_gbps * 1e3) * (backup_room if to_host else room)


def burst_us(sub: Submission, desc_us: float) -> float:
    """Host time of submitting plain ``sub`` in a burst (the fewest runtime calls) at ``desc_us`` per descriptor."""
    n = int(sub.lens.numel())
    return n * desc_us + schedule_calls(n, eager=False) * MODEL_CALL_US


def fed(sub: Submission, cal: Calibration, desc_us: float | None = None, to_host: bool = True,
         room: float = 1.0, backup_room: float = BACKUP_ROOM) -> bool:
    """Whether the host submits ``sub`` within its transfer time at link speed (:func:`allowed_us`; backups: times
    ``backup_room``, default :data:`BACKUP_ROOM`; loads: times ``room``, the factor by which the kernel's loads are
    slowed by the forward pass beside them, 1 with ``forward="compute"``).

    Where the pool has measured its host in this direction lately (``desc_us``: :class:`~.pace.HostPace`,
    microseconds per descriptor of whole ``direct`` calls, a new batch's planning included, waits on the GPU left out:
    :class:`~.pace.WaitLog`) and ``sub`` is plain
    descriptors, a burst's submission at that pace must take at most :data:`FED_SHARE` of the transfer time.  For
    loads that measure decides alone: the kernels' loads cost a model's GEMM next to nothing, so the faster route
    wins (H200, MLA 1152-byte rows with new GPU-resident indices every batch: the copy engine's bursts 0.54-0.59 of
    memcpy against the kernel's 0.87, its host planning and reading the indices back each batch; the same bursts
    with indices reused 0.95).  For backups it can only add the copy engine (a kernel's backup in one launch slowed a
    GEMM by +13% or more; in launches of at most 32 MiB, as the shipped kernels' backups go since 2026-12-07, -1.4% to
    +2.7%: :data:`BACKUP_ROOM`).  Otherwise, at the calibration's host cost and an idle engine's schedule (small first
    calls): a margin for a host of unknown speed (fp8 MLA rows, 36.9-42 KB pages, 64 per layer, 43-49 us per layer at link
    speed: bursts by the copy engine reached 0.92-0.93 of memcpy in the host's fast stretches but 0.57-0.68 in its
    slow ones, against the kernel's steady 0.83-0.85; docs/performance.md)."""
    link_us = allowed_us(sub.nbytes, cal, to_host, room, backup_room)
    measured = desc_us is not None and sub.staged is None and sub.pitched is None
    if measured and burst_us(sub, cast(float, desc_us)) <= FED_SHARE * link_us:
        return True
    if measured and not to_host:
        return False
    return sub.host_us(cal.submit_us, cal.call_us) <= link_us


def worth_measuring(sub: Submission, cal: Calibration, to_host: bool = True, room: float = 1.0,
                    backup_room: float = BACKUP_ROOM) -> bool:
    """Whether a host at the calibration's per-descriptor cost would feed ``sub`` in a burst (so measuring the host
    may unlock the copy engine for it): plain descriptors whose burst submission fits :data:`FED_SHARE` of the time
    :func:`allowed_us` gives (backups: ``backup_room`` times the transfer time; loads: ``room`` times it), and enough
    of them that the copier samples the call (:data:`~.pace.MIN_OPS`: a probe it never samples would be repeated
    forever)."""
    if sub.staged is not None or sub.pitched is not None or sub.count < MIN_OPS:
        return False
    return burst_us(sub, cal.submit_us) <= FED_SHARE * allowed_us(sub.nbytes, cal, to_host, room, backup_room)
