"""Pitched (2D) copies: one copy-engine operation moves ``height`` equal rows spaced by a pitch on each side.

An all-layer transfer of a layer-major pool moves, for every page, the same
block out of every layer; when the layers' base addresses are evenly spaced and
ascending on both sides, within one host buffer and one device allocation (a
``[L, rows, width]`` device tensor), those blocks form one 2D copy.  (Layers
allocated one by one, as SGLang's pools do, keep plain descriptors: the
runtime moves 2D copies across allocations or with a negative pitch slowly.)  A 61-layer MLA
backup of 64 pages is then 64 operations instead of 3904 descriptors, and the
host pays the runtime's per-operation cost 64 times.

:class:`Pitched` holds such copies as int64 tensors; :func:`ops_tensor` packs
them into the ``cudaMemcpy3DBatchOp`` array ``cudaMemcpy3DBatchAsync`` takes
(vectorised, no per-element Python objects); :func:`expand` turns them back
into row descriptors for the CPU and for runtimes without the 3D batch call.
:func:`group_bases` finds the evenly spaced groups of layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Pitched", "OP_WORDS", "ops_tensor", "expand", "group_bases", "MIN_HEIGHT", "MAX_PITCH", "PITCHED_OP_US", "OPERAND_PTR"]

#: int64 words per ``struct cudaMemcpy3DBatchOp`` (112 bytes on LP64, CUDA 12.8 through 13.x):
#: src operand (type, ptr, rowLength, layerHeight, locHint) 5 words, dst operand 5 words,
#: extent (width, height, depth) 3 words, srcAccessOrder and flags packed in the last word.
OP_WORDS = 14
_OPERAND_POINTER = 1  # cudaMemcpyOperandTypePointer
#: Word of an operation row holding the pointer of its source (``False``) and destination (``True``) operand.
OPERAND_PTR = {False: 1, True: 6}
_SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream
#: Fewest evenly spaced layers worth one pitched operation (two rows already halve the descriptors).
MIN_HEIGHT = 2
#: Largest pitch a pitched operation may use: 5 GiB, verified bit-exact on the H200 (beyond the
#: 2 GiB ``cudaDevAttrMaxPitch`` of 2D copies, which ``cudaMemcpy3DBatchAsync`` does not apply); layers
#: further apart keep plain descriptors.  Pitches
#: are positive: a descending device layer step copies correctly through the size_t wrap-around but
#: the runtime then moves it at 0.41 of memcpy with 9.6 ms of host time for a 61-layer backup, worse
#: than plain descriptors (docs/performance.md).
MAX_PITCH = 5 << 30
#: Host time of one pitched (2D) operation inside ``cudaMemcpy3DBatchAsync``: about 2.7 us for 61 rows
#: of 72 KB on the H200 (benchmarks/ce2d_probe.py), where the same rows as plain descriptors cost ~0.5 us each.
PITCHED_OP_US = 3.0


@dataclass
class Pitched:
    """``n`` 2D copies: copy ``k`` moves ``height[k]`` rows of ``width[k]`` bytes; row ``r`` of the
    host side starts at ``host[k] + r * host_pitch[k]``, of the device side at ``dev[k] + r * dev_pitch[k]``."""

    host: torch.Tensor
    dev: torch.Tensor
    width: torch.Tensor
    height: torch.Tensor
    host_pitch: torch.Tensor
    dev_pitch: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.host.numel())

    @property
    def nbytes(self) -> int:
        return int((self.width * self.height).sum())

    @staticmethod
    def cat(parts: list[Pitched]) -> Pitched:
        if len(parts) == 1:
            return parts[0]
        return Pitched(*(torch.cat([getattr(p, f) for p in parts]) for f in
                         ("host", "dev", "width", "height", "host_pitch", "dev_pitch")))


def ops_tensor(p: Pitched, *, to_host: bool) -> torch.Tensor:
    """The ``cudaMemcpy3DBatchOp`` array for ``p`` in one direction: a contiguous ``[n, 14]`` int64 tensor."""
    n = p.count
    ops = torch.zeros((n, OP_WORDS), dtype=torch.int64)
    (src, sp), (dst, dp) = ((p.dev, p.dev_pitch), (p.host, p.host_pitch)) if to_host else \
        ((p.host, p.host_pitch), (p.dev, p.dev_pitch))
    for base, ptr, pitch in ((OPERAND_PTR[False] - 1, src, sp), (OPERAND_PTR[True] - 1, dst, dp)):
        ops[:, base] = _OPERAND_POINTER
        ops[:, base + 1] = ptr
        ops[:, base + 2] = pitch  # rowLength: for pointer operands, elements are bytes
        ops[:, base + 3] = p.height  # layerHeight
        # base + 4: locHint {cudaMemLocationTypeInvalid, 0}: ignored for device and pinned host memory
    ops[:, 10] = p.width
    ops[:, 11] = p.height
    ops[:, 12] = 1
    ops[:, 13] = _SRC_ACCESS_ORDER_STREAM  # flags (high 32 bits) 0
    return ops


def expand(p: Pitched) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(host, dev, lens)`` row descriptors equal to ``p`` (rows of each copy in order)."""
    if p.count == 0:
        empty = torch.empty(0, dtype=torch.int64)
        return empty, empty, empty
    reps = p.height
    r = torch.arange(int(reps.sum()), dtype=torch.int64) - torch.repeat_interleave(torch.cumsum(reps, 0) - reps, reps)
    pick = lambda t: torch.repeat_interleave(t, reps)  # noqa: E731
    return pick(p.host) + r * pick(p.host_pitch), pick(p.dev) + r * pick(p.dev_pitch), pick(p.width)


def group_bases(host: list[int], dev: list[int], width: int, max_pitch: int) -> list[list[int]]:
    """Split positions ``0..n-1`` into groups evenly spaced on both sides.

    Positions are taken in ascending host address; a group grows while the
    next position continues both progressions with pitches at least ``width``
    (rows may not overlap) and at most ``max_pitch``; both pitches are positive.
    Groups shorter than :data:`MIN_HEIGHT` are returned as singletons for plain descriptors.
    """
    order = sorted(range(len(host)), key=lambda i: host[i])
    groups: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if len(cur) >= 2:
            hp, dp = host[cur[1]] - host[cur[0]], dev[cur[1]] - dev[cur[0]]
            if host[i] - host[cur[-1]] == hp and dev[i] - dev[cur[-1]] == dp:
                cur.append(i)
                continue
        elif len(cur) == 1:
            hp, dp = host[i] - host[cur[0]], dev[i] - dev[cur[0]]
            if width <= hp <= max_pitch and width <= dp <= max_pitch:
                cur.append(i)
                continue
        if cur:
            groups.append(cur)
        cur = [i]
    if cur:
        groups.append(cur)
    out: list[list[int]] = []
    for g in groups:
        out.extend([g] if len(g) >= MIN_HEIGHT else [[i] for i in g])
    return out
