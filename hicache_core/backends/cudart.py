"""The CUDA runtime the process already loaded, through ctypes: batched async copies of raw addresses.

Descriptor arrays are passed as the data pointers of contiguous CPU int64
tensors, so submitting ``n`` copies costs no per-element Python object.  The
runtime is the one torch loaded (found in ``/proc/self/maps``), so streams and
the primary context are shared with torch; no ``cuda-bindings`` needed.

``cudaMemcpyBatchAsync`` changed signature in CUDA 13 (the ``failIdx``
argument was removed); the signature is chosen from ``cudaRuntimeGetVersion``.
Where the batch entry point is missing (CUDA < 12.8) copies go one
``cudaMemcpyAsync`` per descriptor.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import _ctypes
import glob
import functools
import logging
import os
import threading
from typing import Callable, Optional

import torch

from .pitched import OP_WORDS

__all__ = ["CudaRuntime", "runtime", "runtime_unavailable_reason", "STREAM_PER_THREAD", "batch_schedule", "batch_calls",
           "schedule_calls", "submit_in_schedule", "BatchSubmitError", "MAX_PER_CALL", "loaded_cudart_paths"]

logger = logging.getLogger(__name__)

#: ``cudaStreamPerThread``: a blocking stream, ordered with the legacy default stream.
STREAM_PER_THREAD = 2
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault (unified addressing infers the direction)
_SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream
#: Descriptors per runtime call.  The runtime starts copying only when a call returns, so one
#: huge batch leaves the link idle while the host submits (~0.5 us per descriptor plus ~6 us per
#: call on an H200: 2 ms for the 3904 pages of a 61-layer backup, 0.72 of memcpy).  The first
#: :data:`_EVEN_CALLS` calls carry :data:`_FIRST_CHUNK` descriptors each, so the copy engine starts
#: within microseconds and a one-layer load (64 pages of 72 KB) never waits on one long call
#: (measured on the H200: 0.87-0.89 of memcpy for 4 calls of 16, 0.79 for 16 then 48, 0.74 for one
#: call of 64; benchmarks/ce_probe.py); later calls grow 4x up to :data:`_MAX_CHUNK`, so large
#: batches pay the per-call cost rarely and the host stays ahead of the link.
_FIRST_CHUNK = 16
_EVEN_CALLS = 4
_MAX_CHUNK = 512
#: The most descriptors (or pitched operations) one runtime call carries.
MAX_PER_CALL = _MAX_CHUNK


def _check_arrays(dsts: torch.Tensor, srcs: torch.Tensor, sizes: torch.Tensor) -> None:
    """Raise unless the three descriptor arrays are contiguous CPU int64 tensors of one length: the runtime reads them
    by address, so a strided or shorter array would hand it other memory as addresses and sizes."""
    n = dsts.numel()
    for name, t in (("dsts", dsts), ("srcs", srcs), ("sizes", sizes)):
        if t.dtype is not torch.int64 or t.device.type != "cpu" or not t.is_contiguous() or t.numel() != n:
            raise ValueError(f"copy_batch: {name} must be a contiguous CPU int64 tensor of {n} elements like dsts "
                             f"(call .contiguous() / .to(torch.int64)), got {t.dtype} of {t.numel()} on {t.device}"
                             f"{'' if t.is_contiguous() else ', not contiguous'}")


def batch_schedule(n: int, eager: bool = True) -> list[int]:
    """Descriptors per runtime call when :meth:`CudaRuntime.copy_batch` submits ``n`` of them.

    ``eager=False`` (the copy engine still has enough queued work to cover the host's submission):
    calls of :data:`_MAX_CHUNK`, the fewest runtime calls."""
    if not eager:
        return [min(_MAX_CHUNK, n - k) for k in range(0, n, _MAX_CHUNK)]
    out, chunk = [], _FIRST_CHUNK
    while n > 0:
        count = min(chunk, n)
        out.append(count)
        n -= count
        if len(out) >= _EVEN_CALLS:
            chunk = min(_MAX_CHUNK, chunk * 4)
    return out


@functools.lru_cache(maxsize=4096)
def schedule_calls(n: int, eager: bool = True) -> int:
    """``len(batch_schedule(n, eager))``, remembered per count (``auto`` counts a burst's runtime calls several times in
    each decision it makes, and a new batch's decision is on the path to its first launch; the counts a pool meets
    are few).  The rule lives in :func:`batch_schedule` alone."""
    return len(batch_schedule(n, eager))


def batch_calls(n: int) -> int:
    """Runtime calls :meth:`CudaRuntime.copy_batch` makes for ``n`` descriptors on an idle stream (each
    costs ~6 us of host time)."""
    return schedule_calls(n)


class BatchSubmitError(RuntimeError):
    """A runtime call of a batched submission failed; :attr:`submitted` operations of the batch were
    queued before it (they stay queued: the stream runs them)."""

    def __init__(self, message: str, submitted: int) -> None:
        super().__init__(message)
        self.submitted = submitted


def submit_in_schedule(n: int, submit: Callable[[int, int], int], call: str, rt: CudaRuntime,
                       eager: bool = True) -> None:
    """Call ``submit(start, count)`` for the slices of :func:`batch_schedule` ``(n, eager)``; raise
    :class:`BatchSubmitError` on a cudaError."""
    start = 0
    for count in batch_schedule(n, eager):
        err = submit(start, count)
        if err:
            rt.clear_error()
            raise BatchSubmitError(f"{call} failed: {rt.error_string(err)} (cudaError {err}); {start} of the "
                                   f"{n} copies of this call were queued by earlier runtime calls, the failing call's "
                                   "copies were not (or only in part)", start)
        start += count


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """``struct cudaMemcpyAttributes`` (identical in CUDA 12.8 and 13.x headers)."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_uint),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


def loaded_cudart_paths() -> list[str]:
    """Paths of every ``libcudart`` mapped into this process, sorted (:func:`_candidate_paths` puts torch's first)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line and "/" in line}
    except OSError:
        return []
    return sorted(paths)


class _LinkMap(ctypes.Structure):
    """The head of glibc's ``struct link_map``: the load bias, then the path the loader mapped."""

    _fields_ = [("l_addr", ctypes.c_void_p), ("l_name", ctypes.c_char_p)]


_RTLD_DI_LINKMAP = 2


def _loader_path(soname: str) -> Optional[str]:
    """The path of the library the dynamic loader already resolves ``soname`` to in this process, or ``None``.

    The loader matches a bare soname against the libraries loaded so far, first loaded first: for the runtime's
    soname that is the copy torch's own libraries were linked against.  Nothing is loaded (``RTLD_NOLOAD``); ``None``
    where no library of that soname is loaded, or where the C library lacks ``dlinfo`` (not glibc)."""
    try:
        lib = ctypes.CDLL(soname, mode=os.RTLD_NOLOAD)
        libc = ctypes.CDLL(None)
        dlinfo = libc.dlinfo
    except (OSError, AttributeError):
        return None
    dlinfo.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    dlinfo.restype = ctypes.c_int
    lm = ctypes.POINTER(_LinkMap)()
    try:
        if dlinfo(lib._handle, _RTLD_DI_LINKMAP, ctypes.byref(lm)) != 0 or not lm or not lm.contents.l_name:
            return None
        path = os.fsdecode(lm.contents.l_name)
    finally:
        _ctypes.dlclose(lib._handle)  # the lookup took a reference to the already loaded library: give it back
    return os.path.realpath(path) if path else None


def _torchs_first(paths: list[str]) -> list[str]:
    """``paths`` with the runtimes of torch's CUDA major version (``libcudart.so.<major>``, the soname torch links)
    first: another one mapped into the process (an extension's bundled ``libcudart.so.11.0``, say) may lack the batch
    call torch's runtime has, and would silently turn every batch into one copy per descriptor.  Among several of that
    major, the one the loader resolves torch's soname to (:func:`_loader_path`) goes first, then the rest by path."""
    major = (torch.version.cuda or "").split(".")[0]
    if not major:
        return paths
    own = f"libcudart.so.{major}"
    resolved = _loader_path(own)
    return sorted(paths, key=lambda p: (not (os.path.basename(p) == own or os.path.basename(p).startswith(own + ".")),
                                        os.path.realpath(p) != resolved))


def _candidate_paths() -> list[str]:
    out = _torchs_first(loaded_cudart_paths())
    found = ctypes.util.find_library("cudart")
    if found:
        out.append(found)
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    out += sorted(glob.glob(os.path.join(torch_lib, "libcudart*.so*")))
    return out


class CudaRuntime:
    """Thin typed wrapper over the few runtime calls the copy engine path needs."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._lib = lib
        ver = ctypes.c_int(0)
        lib.cudaRuntimeGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cudaRuntimeGetVersion(ctypes.byref(ver))
        self.version = int(ver.value)
        drv = ctypes.c_int(0)
        lib.cudaDriverGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cudaDriverGetVersion(ctypes.byref(drv))
        self.driver_version = int(drv.value)
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetLastError.restype = ctypes.c_int
        lib.cudaGetLastError.argtypes = []
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.cudaMemcpyAsync.argtypes = [vp, vp, sz, ctypes.c_int, vp]
        lib.cudaMemcpyAsync.restype = ctypes.c_int
        # the batch entry point needs runtime *and* driver >= 12.8 (minor-version compatibility lets a
        # 12.8 runtime run on an older 12.x driver, where the call would fail)
        batch_ok = self.version >= 12080 and self.driver_version >= 12080
        self._batch = getattr(lib, "cudaMemcpyBatchAsync", None) if batch_ok else None
        if self._batch is not None:
            if self.version >= 13000:
                self._batch.argtypes = [vp, vp, vp, sz, ctypes.POINTER(_MemcpyAttributes), vp, sz, vp]
            else:  # 12.8/12.9: ..., size_t numAttrs, size_t* failIdx, cudaStream_t
                self._batch.argtypes = [vp, vp, vp, sz, ctypes.POINTER(_MemcpyAttributes), vp, sz, vp, vp]
            self._batch.restype = ctypes.c_int
        # cudaMemcpy3DBatchAsync(numOps, opList, flags, stream), CUDA 13.x.  It exists since 12.8 (with a
        # size_t* failIdx before flags), but its operation struct was only verified bit-exact on 13.0 runtimes
        # (benchmarks/ce2d_probe.py): 12.8/12.9 keep plain descriptors rather than risk misread operations.
        pitched_ok = self.version >= 13000 and self.driver_version >= 13000
        self._batch3d = getattr(lib, "cudaMemcpy3DBatchAsync", None) if pitched_ok else None
        if self._batch3d is not None:
            self._batch3d.argtypes = [sz, vp, ctypes.c_ulonglong, vp]
            self._batch3d.restype = ctypes.c_int
        self._attrs = _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM, _MemLocation(0, 0), _MemLocation(0, 0), 0)
        self._attr_idx = (ctypes.c_size_t * 1)(0)
        self._fail_idx = threading.local()

    @property
    def has_batch(self) -> bool:
        """Whether ``cudaMemcpyBatchAsync`` is available (CUDA runtime >= 12.8)."""
        return self._batch is not None

    @property
    def has_batch3d(self) -> bool:
        """Whether pitched copies go in one ``cudaMemcpy3DBatchAsync`` call (CUDA 13 runtime and driver)."""
        return getattr(self, "_batch3d", None) is not None

    def clear_error(self) -> None:
        """Reset the runtime's last error of this thread after a failed call this module reports itself
        (``cudaGetLastError``): torch checks that error after its own kernel launches and would raise it there."""
        lib = getattr(self, "_lib", None)
        if lib is not None:
            lib.cudaGetLastError()

    def error_string(self, code: int) -> str:
        msg = self._lib.cudaGetErrorString(code)
        return msg.decode() if msg else f"cudaError {code}"

    def copy_batch(self, dsts: torch.Tensor, srcs: torch.Tensor, sizes: torch.Tensor, stream: int,
                   eager: bool = True) -> None:
        """Enqueue ``sizes[i]`` bytes ``srcs[i] -> dsts[i]`` on ``stream`` in the calls of
        :func:`batch_schedule` ``(n, eager)``.

        :param dsts: contiguous CPU int64 tensor of destination addresses.
        :param srcs: same, source addresses.
        :param sizes: same, byte counts (all > 0).
        :param stream: a ``cudaStream_t`` value; the legacy stream (0) is
            replaced by the per-thread default stream, which the batch API
            accepts and which is ordered with the legacy stream.
        """
        _check_arrays(dsts, srcs, sizes)
        n = int(dsts.numel())
        if n == 0:
            return
        if self._batch is None:
            self._copy_each(dsts, srcs, sizes, stream)
            return
        stream = stream or STREAM_PER_THREAD
        d, s, z = dsts.data_ptr(), srcs.data_ptr(), sizes.data_ptr()
        submit_in_schedule(n, lambda start, count: self.submit_batch(d + 8 * start, s + 8 * start, z + 8 * start,
                                                                     count, stream), "cudaMemcpyBatchAsync", self, eager)

    def copy_3d_batch(self, ops: torch.Tensor, stream: int, eager: bool = True) -> None:
        """Enqueue the ``cudaMemcpy3DBatchOp`` array ``ops`` (a contiguous CPU int64 ``[n, 14]`` tensor,
        :func:`.pitched.ops_tensor`) on ``stream`` in the calls of :func:`batch_schedule`.  Needs :attr:`has_batch3d`."""
        if ops.dtype is not torch.int64 or ops.device.type != "cpu" or ops.dim() != 2 or ops.shape[1] != OP_WORDS \
                or not ops.is_contiguous():
            raise ValueError(f"copy_3d_batch: ops must be a contiguous CPU int64 [n, {OP_WORDS}] tensor "
                             f"(pitched.ops_tensor), got {ops.dtype} {tuple(ops.shape)} on {ops.device}"
                             f"{'' if ops.is_contiguous() else ', not contiguous'}")
        n = int(ops.shape[0])
        if n == 0:
            return
        stream = stream or STREAM_PER_THREAD
        base, op_bytes = ops.data_ptr(), ops.shape[1] * 8
        submit_in_schedule(n, lambda start, count: self.submit_3d(base + op_bytes * start, count, stream),
                           "cudaMemcpy3DBatchAsync", self, eager)

    def submit_3d(self, ops: int, count: int, stream: int) -> int:
        """One ``cudaMemcpy3DBatchAsync`` call of ``count`` operations starting at host address ``ops``;
        returns the cudaError."""
        fn = getattr(self, "_batch3d", None)
        if fn is None:
            raise RuntimeError("pitched copies need cudaMemcpy3DBatchAsync from a CUDA 13 runtime and driver")
        return int(fn(count, ops, 0, stream))

    def submit_batch(self, dsts: int, srcs: int, sizes: int, count: int, stream: int,
                     attrs: _MemcpyAttributes | None = None) -> int:
        """One ``cudaMemcpyBatchAsync`` call of ``count`` descriptors whose address and size arrays
        start at ``dsts``/``srcs``/``sizes`` (host addresses of int64 arrays); returns the cudaError.

        ``attrs`` replaces the default attributes (source access order ``stream``), e.g. for
        ``benchmarks/ce_probe.py``.  Needs :attr:`has_batch`.
        """
        batch = self._batch
        if batch is None:
            raise RuntimeError("cudaMemcpyBatchAsync needs CUDA runtime and driver >= 12.8; use copy_batch, which "
                               "falls back to one cudaMemcpyAsync per descriptor")
        a = ctypes.byref(self._attrs if attrs is None else attrs)
        if self.version >= 13000:
            return int(batch(dsts, srcs, sizes, count, a, self._attr_idx, 1, stream))
        fail = getattr(self._fail_idx, "v", None)
        if fail is None:
            fail = self._fail_idx.v = ctypes.c_size_t(0)
        return int(batch(dsts, srcs, sizes, count, a, self._attr_idx, 1, ctypes.byref(fail), stream))

    def _copy_each(self, dsts: torch.Tensor, srcs: torch.Tensor, sizes: torch.Tensor, stream: int) -> None:
        triples = list(zip(dsts.tolist(), srcs.tolist(), sizes.tolist()))
        for i, (dst, src, n) in enumerate(triples):
            err = self._lib.cudaMemcpyAsync(dst, src, n, _MEMCPY_DEFAULT, stream)
            if err:
                self.clear_error()
                raise BatchSubmitError(f"cudaMemcpyAsync failed: {self.error_string(err)} (cudaError {err}); {i} of "
                                       f"the {len(triples)} copies of this call were queued before it, the rest were not", i)


_lock = threading.Lock()
_runtime: Optional[CudaRuntime] = None
_failure: Optional[str] = None


def _load() -> None:
    global _runtime, _failure
    if not torch.cuda.is_available():
        _failure = "CUDA is not available to torch"
        return
    torch.cuda.init()  # make torch load its runtime so /proc/self/maps shows it
    errors = []
    for path in _candidate_paths():
        try:
            lib = ctypes.CDLL(path)
            rt = CudaRuntime(lib, path)
        except (OSError, AttributeError) as exc:
            errors.append(f"{path}: {exc}")
            continue
        _runtime = rt
        logger.debug("hicache copy engine: %s (runtime %d, batch=%s)", path, rt.version, rt.has_batch)
        if not rt.has_batch:  # said once: every copy-engine transfer then costs one runtime call per descriptor
            logger.info("hicache copy engine: %s is CUDA runtime %d on driver %d, without cudaMemcpyBatchAsync (both "
                        "need >= 12.8): copies go one cudaMemcpyAsync per descriptor, a slower submission; a torch "
                        "built for CUDA >= 12.8 and a driver of 12.8 or later batch them", path, rt.version,
                        rt.driver_version)
        return
    _failure = "no usable libcudart found in this process or next to torch" + (f" ({'; '.join(errors)})" if errors else "")


def runtime() -> CudaRuntime:
    """The process's CUDA runtime (loaded once); raises ``RuntimeError`` naming why not."""
    if _runtime is None and _failure is None:
        with _lock:
            if _runtime is None and _failure is None:
                _load()
    if _runtime is None:
        raise RuntimeError(f"the copy engine path needs the CUDA runtime: {_failure}")
    return _runtime


def runtime_unavailable_reason() -> str | None:
    """``None`` when :func:`runtime` works, else why not (one line)."""
    try:
        runtime()
    except RuntimeError as exc:
        return str(exc)
    return None
