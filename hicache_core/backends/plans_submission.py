"""Submissions of the ``direct`` backend's copy plans: what one transfer hands the copy engine (:class:`Submission`),
the coalescing of equal-size copies into runs (:func:`coalesce`) and the once-per-pool warning about blocks too small
for the copy engine (:func:`warn_small_blocks`).

Part of the copy plans whose public face is :mod:`hicache_core.backends.plans` (every name here is importable from
there too).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..binding import PoolBinding
from .pitched import PITCHED_OP_US, Pitched, ops_tensor

if TYPE_CHECKING:
    from .staging import StagedRoute

__all__ = ["coalesce", "Submission", "warn_small_blocks", "WARN_MEAN_BLOCK", "WARN_BLOCKS", "SMALL_COALESCE"]

# the name users see: the warning below has always come from hicache_core.backends.plans
logger = logging.getLogger("hicache_core.backends.plans")

#: A CUDA pool warns once when a transfer's copy-engine blocks average below this many bytes over at
#: least :data:`WARN_BLOCKS` blocks: the copy engine moves such blocks at a few percent of the link
#: (H200: 0.02-0.08 of memcpy for one-layer loads of a token-major host layout, 1152-byte rows),
#: where ``auto`` picks the layout's kernel.
WARN_MEAN_BLOCK = 4096
WARN_BLOCKS = 256
#: :func:`coalesce` merges up to this many copies in Python, more with vectorised torch operations.
SMALL_COALESCE = 512


def warn_small_blocks(binding: PoolBinding, sub: Submission, layer: int | None) -> bool:
    """Log, once per pool, that ``sub`` (a transfer of ``layer``; ``None``: all layers) is a poor fit
    for the copy engine (:data:`WARN_MEAN_BLOCK`); returns whether it warned.  CPU pools never warn
    (their copies are ``memmove``)."""
    if binding.device.type != "cuda" or binding.scratch.get("direct.warned_small"):
        return False
    blocks, mean = sub.blocks, sub.mean_block
    if blocks < WARN_BLOCKS or mean >= WARN_MEAN_BLOCK:
        return False
    binding.scratch["direct.warned_small"] = True
    what = "all layers" if layer is None else f"layer {layer}"
    logger.warning(
        "hicache direct: a transfer of %s in layout %r goes to the copy engine as %d blocks of %.0f bytes on "
        "average; the copy engine moves blocks this small at a few percent of the link. io_backend='auto' "
        "serves such calls with the layout's kernel ('hicache explain' shows what it picks); this is logged "
        "once per pool", what, binding.layout.name, blocks, mean)
    return True


def coalesce(dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge equal-size copies ``src[k] -> dst[k]`` (byte offsets, in order) into maximal runs.

    Returns ``(dst_starts, src_starts, lengths)``.
    """
    n = dst.numel()
    if n == 0:
        return dst, src, dst
    if n <= SMALL_COALESCE:  # a page-level plan: a loop over Python ints beats a dozen small torch ops
        d, s = dst.tolist(), src.tolist()
        first = [0] + [i for i in range(1, n) if d[i] - d[i - 1] != nbytes or s[i] - s[i - 1] != nbytes]
        if len(first) == n:  # nothing merges (random pages): the copies as they are
            return dst.clone(), src.clone(), torch.full((n,), nbytes, dtype=torch.int64)
        lens = [(e - b) * nbytes for b, e in zip(first, first[1:] + [n])]
        at = torch.tensor(first, dtype=torch.int64)
        return dst[at], src[at], torch.tensor(lens, dtype=torch.int64)
    brk = torch.ones_like(dst, dtype=torch.bool)
    brk[1:] = (dst[1:] - dst[:-1] != nbytes) | (src[1:] - src[:-1] != nbytes)
    starts = brk.nonzero().squeeze(1)
    counts = torch.diff(starts, append=torch.tensor([n]))
    return dst[starts], src[starts], counts * nbytes


@dataclass
class Submission:
    """What one transfer submits: plain runs (``host``/``dev``/``lens``) plus pitched copies of the
    same block across evenly spaced layers (``pitched``), or a staged route."""

    host: torch.Tensor
    dev: torch.Tensor
    lens: torch.Tensor
    staged: StagedRoute | None = None
    pitched: Pitched | None = None
    #: ``lens.sum()`` where the builder knows it (a plan counts it from its tables: no reduction per submission)
    known_nbytes: int | None = None

    def __post_init__(self) -> None:
        # derived once: a Submission is not changed after it is built (plans memoise it)
        self._ops: dict[bool, torch.Tensor] = {}
        #: By ``to_host``: whether a transfer of that direction submitted it (the pool checked its indices
        #: for that direction then), which ``direct``'s lane requires; before any, it is new (see warn_small_blocks).
        self.served = [False, False]
        if self.known_nbytes is not None:
            self.plain_nbytes = self.known_nbytes
        else:
            self.plain_nbytes = int(self.lens.sum()) if self.lens.numel() else 0
        self.pitched_nbytes = self.pitched.nbytes if self.pitched is not None else 0

    def pitched_ops(self, to_host: bool) -> torch.Tensor:
        """The ``cudaMemcpy3DBatchOp`` array of :attr:`pitched` for one direction (built once)."""
        assert self.pitched is not None
        ops = self._ops.get(to_host)
        if ops is None:
            ops = self._ops[to_host] = ops_tensor(self.pitched, to_host=to_host)
        return ops

    @property
    def pitched_count(self) -> int:
        return self.pitched.count if self.pitched is not None else 0

    @property
    def count(self) -> int:
        """Copy-engine operations per transfer (plain descriptors plus pitched operations)."""
        if self.staged is not None:
            return self.staged.count
        return int(self.lens.numel()) + self.pitched_count

    @property
    def nbytes(self) -> int:
        """Bytes the copy engine moves per transfer."""
        if self.staged is not None:
            return self.staged.nbytes
        return self.plain_nbytes + self.pitched_nbytes

    def host_us(self, submit_us: float, call_us: float = 0.0) -> float:
        """Estimated host time to submit this transfer: ``submit_us`` per copy-engine descriptor,
        ``call_us`` per runtime call (:func:`.cudart.batch_calls`, per staging chunk of pages), and
        the relayout launches of a staged route."""
        from .cudart import batch_calls

        if self.staged is not None:
            return self.staged.host_us(submit_us, call_us)
        n, k = int(self.lens.numel()), self.pitched_count
        return n * submit_us + batch_calls(n) * call_us + k * PITCHED_OP_US + batch_calls(k) * call_us

    @property
    def smallest_block(self) -> int:
        """Bytes of the smallest copy-engine descriptor (small blocks cost the copy engine most,
        and small host-to-device ones cost the host too)."""
        if self.staged is not None:
            return min(int(im.lens.min()) for im in self.staged.images) if self.staged.images else 0
        mins = [int(t.min()) for t in (self.lens, self.pitched.width if self.pitched is not None else self.lens)
                if t.numel()]
        return min(mins) if mins else 0

    @property
    def blocks(self) -> int:
        """Contiguous blocks the copy engine moves (a pitched operation moves one per row)."""
        if self.staged is not None:
            return self.staged.blocks
        return int(self.lens.numel()) + (int(self.pitched.height.sum()) if self.pitched is not None else 0)

    @property
    def mean_block(self) -> float:
        """Mean bytes per contiguous block (what decides copy-engine efficiency)."""
        return self.nbytes / self.blocks if self.blocks else 0.0
