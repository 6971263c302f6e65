"""``hicache explain`` for ``auto``: how it decides for a pool, and what it would pick for a call moving every slot.

:meth:`AutoStrategy.describe <.auto.AutoStrategy.describe>` calls :func:`describe`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ..calibration import DEFAULT, Calibration, load_calibration
from ..layout import Layout
from ..spec import PoolSpec
from . import pace as _pace
from .auto_rules import FED_SHARE, KERNEL_LOAD_USUAL, MEMORY_KERNEL_SHARE, allowed_us, fed
from .direct import DirectStrategy
from .forward import FAST_SHARE, IDLE_SHARE, MAX_ROOM, MIN_TIMED_BYTES, RENEW_S, SLOW_SHARE
from .memcpy import TIGHT_GAP_US
from .reprobe import DROP
from .staging import LAUNCH_US

if TYPE_CHECKING:
    from .auto import AutoStrategy

__all__ = ["describe"]


def _backup_room(auto: AutoStrategy) -> str:
    """What ``auto``'s ``backup_room`` adds to the rule's line (nothing at 1: backups then fit as loads do)."""
    if auto.backup_room == 1.0:
        return ""
    return (f" (backups: {auto.backup_room:g}x it, auto's backup_room"
            + (": a host-bound backup moves at about the host's pace, and leaves the GEMMs their SMs)"
               if auto.backup_room > 1.0 else ")"))


def describe(auto: AutoStrategy, spec: PoolSpec, layout: Layout) -> list[str]:
    """How ``auto`` decides for ``spec`` in ``layout``, and what it would pick for a call moving
    every slot of such a pool, its pages in scattered order (estimated on a CPU copy of the pool: block sizes do not
    depend on the device).  For ``hicache explain``."""
    # what the pool would load (a CPU pool reads the file's "cpu" entry), but for a CUDA spec where torch sees no GPU
    cal = load_calibration(spec.device) if spec.device.type != "cuda" or torch.cuda.is_available() else DEFAULT
    lines = [
        f"auto: the copy engine serves a call when its smallest copy block is >= {cal.d2h_min_block} B (backups) / "
        f"{cal.h2d_min_block} B (loads) and its estimated host time (~{cal.submit_us:.2f} us per descriptor, "
        f"~{cal.call_us:.0f} us per runtime call, "
        f"~{LAUNCH_US:.0f} us per relayout launch) fits its transfer time at {cal.link_gbps:.1f} GB/s{_backup_room(auto)}; "
        f"otherwise {auto.kernel_name or 'the kernel (none available here)'}",
        f"auto: calibration {cal.gpu} ({cal.source})",
    ]
    if auto.use_pace:
        lines.append(f"auto: on a GPU pool, the host's measured pace (the median of its recent copy-engine calls, from "
                     f"{_pace.MIN_SAMPLES} on; a measure stops counting {_pace.STALE_S:g} s after its last call, "
                     f"{_pace.WARM_STALE_S:g} s for calls that reuse a plan) decides "
                     f"too: a burst's submission at that pace must take <= {FED_SHARE:.0%} of the transfer time (loads: "
                     f"that alone decides; backups: <= {FED_SHARE * auto.backup_room:.0%}, and it can only add the copy "
                     "engine); where none is measured and a "
                     "host at the calibrated cost would keep up, the copy engine serves a call to measure it; "
                     "new index tensors are judged at the pace of calls that plan, tensors reused beyond one "
                     "burst at that of calls that reuse a plan")
    if auto.forward == "watch":
        lines.append(f"auto: forward='watch': on a CUDA pool whose kernel has fast load paths, lone kernel loads of "
                     f">= {MIN_TIMED_BYTES >> 20} MiB are timed; once one runs under "
                     f"{SLOW_SHARE:.0%} of the link (until one runs at {FAST_SHARE:.0%} or more), loads are judged "
                     f"as with forward='memory' at the room that slowdown "
                     f"gives (its idle {IDLE_SHARE:.0%} over the share measured, {1 / MEMORY_KERNEL_SHARE:.1f}x to "
                     f"{MAX_ROOM:g}x; lone loads "
                     f"included, but for one per {RENEW_S:g} s that goes to the kernel to be timed again), else as "
                     "with 'compute'")
    if auto.forward == "memory":
        lines.append(f"auto: forward='memory' (a forward pass bound by memory beside the loads, where a kernel's loads "
                     f"keep ~{MEMORY_KERNEL_SHARE:.0%} of their idle speed): a load's submission may take "
                     f"{auto.room:.1f}x the time the rule above allows (at the calibration's costs: "
                     f"{auto.room:.1f}x the transfer time at link speed; at a measured pace: "
                     f"{FED_SHARE * auto.room:.0%} of it)" + ("" if auto.lone else ", lone loads included"))
    kroom = auto.kernel_room_of(cal)
    if kroom > 1.0:
        lines.append(f"auto: the calibration measured this machine's kernel load bursts at {cal.kernel_load_ratio:.2f} "
                     f"of memcpy (usual: {KERNEL_LOAD_USUAL:.2f} or more): a load's submission may take {kroom:.2f}x "
                     "the time the rule above allows"
                     + ("" if auto.forward == "compute" else
                        f" (with forward={auto.forward!r}, the larger of this room and forward's applies, not their "
                        "product)")
                     + (", lone loads included (no lone-load exception)"
                        if auto.drops_lone(kroom) else ""))
    if auto.prefetch:
        lines.append("auto: prefetch: a new index pair's GPU-resident device indices start back to the host at its "
                     "first decided load, so a copy plan made later in the burst waits for that read only")
    if auto.reprobe:
        lines.append("auto: reprobe (on a GPU pool whose host pace is measured, validate='shapes'): where a burst of "
                     "one-layer loads with reused indices goes to the kernel because the host was measured too slow, "
                     "the kernel's own calls are timed, and the host is measured again "
                     f"once they run {DROP:.0%} faster than just after that decision"
                     + ("" if auto.use_pace else " (no effect here: pace=False measures no host)"))
    if auto.lone and getattr(auto.kernel, "fast_load", None) is not None and not auto.drops_lone(kroom):
        lines.append(f"auto: except a lone one-layer load (nothing auto queued on the stream still running, and "
                     f"not within {TIGHT_GAP_US:g} us of its previous call's end), which "
                     f"{auto.kernel_name} serves where its fast load paths take that layer (TMA on Hopper-class GPUs, "
                     "whole-page loads of pages at or above their floor)")
    try:
        lines += _estimate(auto, spec, layout, cal)
    except Exception as exc:  # an estimate only: never let it break explain
        lines.append(f"auto: no estimate for this pool ({type(exc).__name__}: {exc})")
    return lines

def _estimate(auto: AutoStrategy, spec: PoolSpec, layout: Layout, cal: Calibration) -> list[str]:
    from ..pool import HostKVPool

    cpu = replace(spec, device=torch.device("cpu"))
    rows = cpu.capacity
    room = max(auto.room, auto.kernel_room_of(cal))  # a pool's, once prepared
    # uninitialised: only submissions are planned, nothing is copied (zeroed rows of a model's pool took gigabytes)
    bufs = {c.name: [torch.empty(rows, c.row_bytes, dtype=torch.uint8) if i in cpu.layer_map.device_layers else None
                     for i in range(cpu.layer_map.num_device_layers)] for c in cpu.components}
    pool = HostKVPool(cpu, layout.name, "direct", bufs, registry=auto._registry, strategy="core.direct",
                      pin_memory=False)
    direct = pool.strategy
    assert isinstance(direct, DirectStrategy)
    # every slot, page by page in an order no two pages follow each other in (as a serving engine's calls scatter
    # pages): copy blocks never span two pages
    ps = cpu.page_size
    host = (torch.arange(rows // ps).flip(0).unsqueeze(1) * ps + torch.arange(ps)).reshape(-1)
    dev = torch.arange(rows)
    out = []
    for op, layer, to_host in (("backup_all_layers", None, True), ("load_layer", cpu.layer_map.device_layers[0], False)):
        sub = direct.submission(pool.binding, host, dev, layer)
        feeds = fed(sub, cal, to_host=to_host, room=room, backup_room=auto.backup_room)
        big = sub.smallest_block >= cal.min_block(to_host)
        kernel = auto.kernel_name or "kernel"
        if auto.direct is None and auto.kernel is not None:  # no copy engine here (no batch copy API): the kernel
            pick = f"{kernel} (the copy engine is not available here)"
        elif auto.kernel is None and not (big and feeds):  # the copy engine would lose to a kernel there is not
            pick = "direct (the only candidate here: no kernel serves this pool)"
        else:
            pick = "direct" if big and feeds else kernel
        host_us = sub.host_us(cal.submit_us, cal.call_us)
        link_us = allowed_us(sub.nbytes, cal, to_host, room, auto.backup_room)
        out.append(f"auto: {op} of all {rows} slots, pages scattered -> {pick} (blocks of {sub.smallest_block} B and up, "
                   f"{sub.mean_block:.0f} B on average, over "
                   f"{sub.count} copy-engine operations{', staged' if sub.staged is not None else ''}"
                   f"{f', {sub.pitched_count} of them pitched' if sub.pitched_count else ''}: "
                   f"{'large enough' if big else 'too small'} against {cal.min_block(to_host)} B; "
                   f"~{host_us:.0f} us to submit against {link_us:.0f} us allowed for {sub.nbytes / 1e6:.3g} MB, "
                   f"host {'keeps up' if feeds else 'cannot keep up'})")
    return out
