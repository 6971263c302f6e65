"""Layout-agnostic host-side support for Triton kernel strategies.

Kernel strategies differ in how they address host memory; everything else —
deciding where a kernel may run, the widest safe access word, per-layer
offset tables built once per pool, index placement, the SM budget — is the
same and lives here.  Nothing in this module imports Triton.

Addressing convention for kernels: one *anchor* tensor is passed as a kernel
pointer argument (Triton then knows its alignment); every other address
(per-layer device tensors, pinned host buffers — same unified address space)
is an int64 offset from it, in *words* of :attr:`SegmentTable.word` bytes.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import os
import re
from dataclasses import dataclass

import torch

from .binding import BoundSegment, PoolBinding
from .errors import HostBufferError
from .spec import PoolSpec
from .validate import parse_programs, tensor_version, tensor_where

__all__ = [
    "current_stream_handle",
    "current_device_index",
    "SegmentTable",
    "kernel_unsupported_reason",
    "access_word",
    "segment_tables",
    "word_anchor",
    "kernel_indices",
    "IndexMemo",
    "index_memos",
    "transfer_indices",
    "on_pool_device",
    "tensor_version",
    "require_pinned",
    "sm_budget",
    "interpreting",
    "dependent_launches",
    "ENV_PROGRAMS",
]

#: Override the number of programs (SM budget) of every kernel launch.
ENV_PROGRAMS = "HICACHE_KERNEL_PROGRAMS"

_WORD_DTYPE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dependent_launches(device: torch.device) -> bool:
    """Whether launches on ``device`` may be programmatic dependent launches (PTX ``griddepcontrol``, compute
    capability 9.0 and later): a CUDA device outside Triton's interpreter."""
    return (device.type == "cuda" and not interpreting() and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device)[0] >= 9)


#: Oldest Triton whose CPU interpreter runs the kernels: 3.6's fails in their persistent loops (``tl.range`` from
#: ``tl.program_id``: "only 0-dimensional arrays can be converted to Python scalars", with numpy 2.4); 3.7 runs them.
MIN_INTERPRETER_TRITON = (3, 7)


@functools.lru_cache(maxsize=1)
def interpreter_problem() -> str | None:
    """Why the installed Triton's CPU interpreter cannot run the kernels, or ``None`` (read from its install metadata:
    no Triton import)."""
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None  # no Triton: said where it matters (kernel_unsupported_reason)
    parts = re.match(r"(\d+)\.(\d+)", version)
    if parts is None or (int(parts[1]), int(parts[2])) >= MIN_INTERPRETER_TRITON:
        return None
    floor = ".".join(map(str, MIN_INTERPRETER_TRITON))
    return (f"Triton {version}'s CPU interpreter cannot run the kernels (it fails in their persistent loops); install "
            f"triton>={floor} for TRITON_INTERPRET=1 on CPU, or use the direct io_backend")


def kernel_unsupported_reason(spec: PoolSpec) -> str | None:
    """``None`` when a Triton kernel can run for ``spec`` here, else why not."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton)"
    if spec.device.type == "cuda":
        if getattr(torch.version, "hip", None):
            # the kernels read and write host memory through its host address; on ROCm registered host memory has
            # a device address of its own (SGLang asks for it before its kernels touch host memory)
            return "the kernels address pinned host memory by its host address, which ROCm does not map; use direct"
        return None
    if spec.device.type == "cpu" and interpreting():
        return interpreter_problem()
    return f"Triton kernels need a CUDA device (or TRITON_INTERPRET=1 on CPU); the pool is on {spec.device}"


def access_word(*quantities: int, max_word: int = 8) -> int:
    """Largest power of two <= ``max_word`` dividing every byte quantity (sizes, strides, addresses)."""
    w = max_word
    while w > 1 and any(q % w for q in quantities):
        w //= 2
    return w


@dataclass(frozen=True)
class SegmentTable:
    """One bound segment prepared for a kernel, in ``word``-byte units.

    ``dev_off[e]`` / ``host_off[e]``: offset (words, from ``anchor``) of device
    row 0 and of the host layer slot of entry ``e`` (the segment's addressing
    offset included); ``dev_stride[e]``: device token stride (words).  The host
    strides ``layer``, ``page``, ``token``, ``chunk_stride`` and the ``width``,
    ``chunk`` sizes are in words too.  Tables live on the pool's device.
    """

    segment: BoundSegment
    word: int
    anchor: torch.Tensor
    dev_off: torch.Tensor
    dev_stride: torch.Tensor
    host_off: torch.Tensor
    width: int
    chunk: int
    chunk_stride: int
    layer: int
    page: int
    token: int
    rows: int  # device rows of the shortest layer (kernels mask indices against it)


def segment_tables(binding: PoolBinding, *, max_word: int = 8) -> list[SegmentTable]:
    """Build (once per pool) a :class:`SegmentTable` per bound segment."""
    tables = []
    device = binding.device
    for seg in binding.segments:
        a = seg.segment.addressing
        hbase = seg.host_flat.data_ptr() + a.offset
        host_bases = [hbase + h * a.layer for h in seg.host_layers]
        # a segment holding no layer of this rank moves nothing: any valid address anchors it (its host buffer may be
        # an empty view, whose address need not lie in its storage)
        anchor_src = (seg.device_rows[0] if seg.device_rows else seg.host_flat if seg.host_flat.numel()
                      else torch.zeros(8, dtype=torch.uint8, device=device))
        # a row of one chunk, or of chunks that follow each other, is one contiguous run: a chunk of the whole width
        chunk_bytes, stride = (seg.width, 0) if a.whole_row(seg.width) else (a.chunk_bytes, a.chunk_stride)
        word = access_word(seg.width, chunk_bytes, stride, a.layer, a.page, a.token, hbase,
                           anchor_src.untyped_storage().data_ptr(), *seg.dev_ptrs, *seg.dev_strides,
                           max_word=max_word)
        anchor = word_anchor(anchor_src, word)
        base = anchor.data_ptr()
        def to_words(addrs: list[int]) -> torch.Tensor:
            return torch.tensor([(x - base) // word for x in addrs], dtype=torch.int64, device=device)
        tables.append(SegmentTable(
            segment=seg, word=word, anchor=anchor,
            dev_off=to_words(list(seg.dev_ptrs)),
            dev_stride=torch.tensor([s // word for s in seg.dev_strides], dtype=torch.int64, device=device),
            host_off=to_words(host_bases),
            width=seg.width // word, chunk=chunk_bytes // word, chunk_stride=(stride or chunk_bytes) // word,
            layer=a.layer // word, page=a.page // word, token=a.token // word,
            rows=min(seg.dev_lens, default=0),
        ))
    return tables


def word_anchor(rows: torch.Tensor, word: int) -> torch.Tensor:
    """A one-word tensor at ``rows``' first byte, typed as the access word."""
    storage = rows.untyped_storage()
    byte_off = rows.data_ptr() - storage.data_ptr()
    t = torch.empty(0, dtype=_WORD_DTYPE[word], device=rows.device)
    return t.set_(storage, byte_off // word, (1,), (1,))


class IndexMemo:
    """The last CPU index tensor a strategy moved to its device, and the copy.

    An engine passes the same index tensors to every per-layer call of a batch
    (80 ``load_layer`` calls with one pair of tensors); with a memo the copy is
    made once.  A hit needs the *same tensor object* with an unchanged version
    counter, address and length, so an in-place change (``idx[0] = 5``) or a ``.data`` swap is seen and copied
    again (writes that bypass torch, in place through ``.data`` or a NumPy view, are not: a pool
    built with ``validate="full"`` or ``"strict"`` therefore disables its memos);
    tensors without a version counter (made under ``torch.inference_mode``) are
    never memoised.  The copy is reused only on the stream that made it (another
    stream could read it before the copy lands).

    Thread-safe: the entry is one immutable tuple, replaced whole by
    :meth:`store` and read once by :meth:`lookup`, so a lookup never pairs one
    thread's source tensor with another thread's copy (an engine's load and
    backup threads share one pool).

    :param enabled: ``False`` makes every lookup miss and every store a no-op.
    """

    __slots__ = ("_entry", "enabled")

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        # (source tensor, its version, its address/length/dtype, its storage (held: no other storage takes its address
        # while the entry compares it), stream, device copy): one snapshot, replaced atomically
        self._entry: tuple[torch.Tensor, int, tuple, torch.UntypedStorage, int | None, torch.Tensor] | None = None

    def lookup(self, t: torch.Tensor, stream: int | None) -> torch.Tensor | None:
        """The copy stored for ``t`` on ``stream`` if ``t`` is unchanged since (its version counter, and its address
        and length, which a ``.data`` swap changes while keeping the object and its counter), else ``None``."""
        entry = self._entry  # read once: the checks and the result come from the same store
        if entry is None or not self.enabled:
            return None
        src, version, where, _, made_on, out = entry
        if t is src and stream == made_on and tensor_version(t) == version and tensor_where(t) == where:
            return out
        return None

    def store(self, t: torch.Tensor, stream: int | None, out: torch.Tensor) -> None:
        """Remember ``out`` as ``t``'s copy on ``stream`` (forgets everything when ``t`` has no version counter)."""
        version = tensor_version(t)
        self._entry = (None if version is None or not self.enabled
                       else (t, version, tensor_where(t), t.untyped_storage(), stream, out))


def index_memos(binding: PoolBinding) -> tuple[IndexMemo, IndexMemo]:
    """The (host, device) index memos of ``binding``, created on first use."""
    memos = binding.scratch.get("core.index_memos")
    if memos is None:
        memos = binding.scratch["core.index_memos"] = (IndexMemo(), IndexMemo())
    return memos


# torch's own fast accessors (what Triton's launcher and Inductor's generated code call), where this
# build has them; CPU-only builds do not, and the public API serves.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None)


def current_stream_handle(index: int) -> int:
    """The ``cudaStream_t`` of CUDA device ``index``'s current stream.

    The same value as ``torch.cuda.current_stream(index).cuda_stream``, without building a
    ``torch.cuda.Stream`` object (a few microseconds per transfer call otherwise)."""
    if _RAW_STREAM is not None:
        return int(_RAW_STREAM(index))
    return int(torch.cuda.current_stream(index).cuda_stream)


def current_device_index() -> int:
    """The current CUDA device's index (``torch.cuda.current_device()``, without its Python wrapper)."""
    if _GET_DEVICE is not None:
        return int(_GET_DEVICE())
    return torch.cuda.current_device()


def kernel_indices(t: torch.Tensor, device: torch.device, memo: IndexMemo | None = None) -> torch.Tensor:
    """An index tensor on the kernel's device, contiguous (int32 or int64 kept as is).

    Kernels read indices at ``ptr + i``: a strided view (``t[::2]``) is made
    contiguous.  CPU indices are copied, asynchronously when pinned; with a
    ``memo`` (see :func:`index_memos`) repeated calls with the same unchanged
    tensor reuse the first copy.
    """
    if t.device != device:
        if device.type == "cuda":
            stream: int | None = current_stream_handle(device.index if device.index is not None
                                                        else current_device_index())
        else:
            stream = None
        if memo is not None:
            hit = memo.lookup(t, stream)
            if hit is not None:
                return hit
        out = t.to(device, non_blocking=True)
        out = out if out.is_contiguous() else out.contiguous()
        if memo is not None:
            memo.store(t, stream, out)
        return out
    return t if t.is_contiguous() else t.contiguous()


def transfer_indices(binding: PoolBinding, host_indices: torch.Tensor,
                     device_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both index tensors of a transfer as kernels read them (:func:`kernel_indices`, with the
    pool's :func:`index_memos`, so per-layer calls with the same tensors copy them once)."""
    memo_h, memo_d = index_memos(binding)
    device = binding.device
    return kernel_indices(host_indices, device, memo_h), kernel_indices(device_indices, device, memo_d)


def on_pool_device(device: torch.device) -> contextlib.AbstractContextManager:
    """A context that makes ``device`` current for a launch (its current stream then), when it is not already."""
    if device.type == "cuda" and device.index is not None and device.index != current_device_index():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def require_pinned(binding: PoolBinding, strategy: str) -> None:
    """Zero-copy kernels read and write host memory directly: on CUDA it must be pinned."""
    if binding.device.type == "cuda" and not binding.host_pinned:
        raise HostBufferError(
            f"{strategy} reads and writes host memory directly, so host buffers must be pinned: allocate them "
            "with pin_memory=True (or let the pool allocate them), or use io_backend 'direct'"
        )


def sm_budget(default: int, device: torch.device) -> int:
    """Programs to launch: ``HICACHE_KERNEL_PROGRAMS`` if set, else ``default`` (at most 4x the SM count)."""
    env = os.environ.get(ENV_PROGRAMS)
    n = parse_programs(env, ENV_PROGRAMS) if env else default
    if device.type == "cuda" and torch.cuda.is_available():  # (hicache explain --device cuda describes it anywhere)
        n = min(n, torch.cuda.get_device_properties(device).multi_processor_count * 4)
    return max(1, n)
