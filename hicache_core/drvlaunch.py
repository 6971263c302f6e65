"""Launch a compiled Triton kernel straight through the CUDA driver, its parameters packed once.

A compiled Triton kernel's own launcher re-reads every argument on every call
and, for each host tensor descriptor, encodes a new CUDA tensor map; on the
H200 that costs 4-6 us for an empty kernel and 12-16 us for the TMA load kernel
(``benchmarks/launch_cost.py``).  A transfer launches the same kernel with the
same pool-fixed arguments on every call, and only the index tensors and their
count change.  :class:`DriverKernel` therefore packs a launch's parameters
once (:meth:`DriverKernel.pack`: tensor maps encoded once per launch), and a
call passes the changing parameters and calls ``cuLaunchKernel`` of the process's
``libcuda``: through a compiled call (:mod:`hicache_core.claunch`, which copies the
parameter pointers per call) where it could be built, else through :mod:`ctypes`
(the changing parameters rewritten in place, under the launch's lock).

The parameter layout is never guessed.  It is derived from the compiled
kernel's Triton signature (constexprs dropped; a tensor descriptor is a
128-byte tensor map, then its shape as 32-bit and its strides as 64-bit
integers; pointers 64-bit) and checked against the ``.entry`` parameter list
of the kernel's PTX, size by size; trailing parameters must be the global and
profile scratch pointers of a kernel that uses no scratch.  A kernel compiled
for programmatic dependent launch (Triton's ``launch_pdl``) is launched through
``cuLaunchKernelEx`` with that one attribute, as Triton's launcher does.  Any
difference, any other launch attribute Triton would set (clusters, cooperative
grids, oversized shared memory), a driver without ``cuLaunchKernelEx`` for a
dependent launch, an argument type
this module does not pack, or a missing driver symbol gives ``None``, and the
caller keeps Triton's launcher (:class:`hicache_core.launch.Launcher` does, also
for a launch whose descriptors :meth:`DriverKernel.pack` cannot encode).
Nothing here imports Triton.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import re
import threading
from typing import Any, Sequence

from . import claunch

__all__ = ["DriverKernel", "Packed", "ptx_params", "expected_params", "driver_available", "DriverLaunchError"]

logger = logging.getLogger(__name__)

#: Bytes of a CUDA tensor map (``CUtensorMap``) and its alignment.
TENSOR_MAP_BYTES, TENSOR_MAP_ALIGN = 128, 64
#: ``CUtensorMapDataType`` by element size.  Bulk tensor copies move bits, so an unsigned type of the
#: width suffices; kernels that reduce through a tensor map (``cp.reduce.async.bulk``) are refused.
_TMA_DTYPE = {1: 0, 2: 1, 4: 2, 8: 4}
_L2_PROMOTION_128B = 2
_CUDA_ERROR_INVALID_CONTEXT = 201
#: Shared memory above which Triton's launcher adds a launch attribute.
_MAX_PLAIN_SHARED = 228 * 1024


class DriverLaunchError(RuntimeError):
    """The CUDA driver refused a launch or a tensor-map encoding (the message names the call and the error)."""


#: ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``: the launch may begin before the one before it on the
#: stream ends, once every program of that one has signalled (``griddepcontrol.launch_dependents``) or ended.
_PDL_ATTRIBUTE = 6


class _LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, padding to 8 bytes, a 64-byte value union (here one int; 8-byte aligned, as the
    union's pointers make it)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("pad2", ctypes.c_int),
                ("rest", ctypes.c_uint64 * 7)]


class _LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` (``cuLaunchKernelEx``'s grid, block, shared memory, stream and attributes)."""

    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("n_attrs", ctypes.c_uint)]


_LIB: list[Any] = []
_C_ON = claunch._ON  # the compiled call's switch (claunch.set_c_launch), read per launch


def _launch_address(lib: Any, name: str = "cuLaunchKernel") -> int | None:
    """The C address of ``lib.<name>`` when it is a C function (``None`` for a stand-in object or a driver without
    it)."""
    f = getattr(lib, name, None)
    if not isinstance(f, ctypes._CFuncPtr):  # type: ignore[attr-defined]
        return None
    return ctypes.cast(f, ctypes.c_void_p).value


def _cuda() -> Any:
    """The driver library with the three entry points typed, or ``None``."""
    if _LIB:
        return _LIB[0]
    lib = None
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so.1")
        c_uint, c_void_p = ctypes.c_uint, ctypes.c_void_p
        # cuLaunchKernel has no argtypes: every call passes the ctypes objects a Packed prebuilt with the
        # exact C types (no per-call conversion; a plain int would be passed as a C int, so nothing else
        # may call it).
        lib.cuLaunchKernel.restype = ctypes.c_int
        try:  # dependent launches (drivers of CUDA 12.0 and later; else those keep Triton's launcher)
            lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), c_void_p, c_void_p, c_void_p]
            lib.cuLaunchKernelEx.restype = ctypes.c_int
        except AttributeError:
            pass
        u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
        lib.cuTensorMapEncodeTiled.argtypes = [c_void_p, ctypes.c_int, c_uint, c_void_p, u64p, u64p, u32p, u32p,
                                               ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.cuTensorMapEncodeTiled.restype = ctypes.c_int
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuGetErrorName.restype = ctypes.c_int
    except (OSError, AttributeError) as exc:
        logger.info("CUDA driver launch unavailable (%s); Triton's launcher is used", exc)
        lib = None
    _LIB.append(lib)
    return lib


def driver_available() -> bool:
    """Whether ``libcuda`` with ``cuLaunchKernel`` and ``cuTensorMapEncodeTiled`` could be loaded."""
    return _cuda() is not None


def _error(lib: Any, res: int, call: str) -> DriverLaunchError:
    name = ctypes.c_char_p()
    lib.cuGetErrorName(res, ctypes.byref(name))
    return DriverLaunchError(f"{call} failed: {(name.value or b'?').decode()} ({res})")


_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\((.*?)\)", re.S)
_PARAM = re.compile(r"\.param\s+(?:\.align\s+\d+\s+)?\.[a-z]+(\d+)\b[^,]*?\w+(?:\[(\d+)\])?\s*$")


def ptx_params(ptx: str, name: str | None = None) -> list[int] | None:
    """Byte sizes of the parameters of the ``.entry`` named ``name`` (the first entry when ``None``), or
    ``None`` when the PTX has no such entry or a parameter this parser does not read."""
    for m in _ENTRY.finditer(ptx):
        if name is not None and m.group(1) != name:
            continue
        sizes = []
        for p in filter(None, (s.strip() for s in m.group(2).split(","))):
            pm = _PARAM.search(p)
            if pm is None:
                return None
            bits, count = int(pm.group(1)), int(pm.group(2) or 1)
            sizes.append(bits // 8 * count)
        return sizes
    return None


#: Packed kinds: (bytes, ctypes type) of scalar parameters.
_SCALARS = {"ptr": (8, ctypes.c_uint64), "i32": (4, ctypes.c_int32), "u32": (4, ctypes.c_uint32),
            "i64": (8, ctypes.c_int64), "u64": (8, ctypes.c_uint64)}


def expected_params(signature: dict[str, str],
                    tensordesc_meta: Sequence[Any] | None) -> list[tuple[str, int, int]] | None:
    """``(kind, argument position, part)`` of each kernel parameter Triton passes for ``signature`` (a compiled
    kernel's argument types by name, in order), or ``None`` for an argument this module does not pack.

    Kinds: ``ptr``, ``i32``/``u32``/``i64``/``u64`` (the argument itself), ``map`` (a descriptor's tensor map;
    ``part``: which descriptor, the index into ``tensordesc_meta``), ``shape``/``stride`` (its ``part``-th
    dimension).
    """
    out: list[tuple[str, int, int]] = []
    k = 0
    for pos, ty in enumerate(signature.values()):
        if not isinstance(ty, str):  # a tuple argument
            return None
        if ty == "constexpr":
            continue
        if ty.startswith("tensordesc"):
            meta = tensordesc_meta[k] if tensordesc_meta is not None and k < len(tensordesc_meta) else None
            k += 1
            if not isinstance(meta, dict) or meta.get("is_im2col") or meta.get("fp4_padded") or \
                    not {"swizzle", "elem_size", "block_size"} <= set(meta):
                return None
            rank = len(meta["block_size"])
            out += [("map", pos, k - 1)] + [("shape", pos, i) for i in range(rank)] + \
                   [("stride", pos, i) for i in range(rank)]
        elif ty.startswith("*"):
            out.append(("ptr", pos, 0))
        elif ty in _SCALARS:
            out.append((ty, pos, 0))
        else:
            return None
    return out


def _size(kind: str) -> int:
    return {"map": TENSOR_MAP_BYTES, "shape": 4, "stride": 8}.get(kind) or _SCALARS[kind][0]


class Packed:
    """One launch's parameter storage: ``cuLaunchKernel``'s pointer array and the objects it points to, and
    the call's own arguments as C objects (``call``: function, grid, block, shared bytes, stream, parameters).

    A call rewrites the grid, the stream and the dynamic values in place, so ``lock`` is held from the first
    write to the launch (the driver copies the values at launch): threads sharing a launch never mix
    arguments.
    """

    __slots__ = ("array", "keep", "setters", "objs", "lock", "grid", "stream", "call", "fast", "config")

    def __init__(self, array: Any, keep: list, setters: tuple[tuple[int, Any, bool], ...], function: int,
                 block: int, shared: int, fast: tuple[Any, Any] | None = None, pdl: bool = False) -> None:
        self.array, self.keep, self.setters = array, keep, setters
        self.objs = tuple(obj for _, obj, _ in setters)  # the dynamic values' C objects, in ``setters`` order
        self.lock = threading.Lock()
        self.grid, self.stream, one = ctypes.c_uint(1), ctypes.c_void_p(0), ctypes.c_uint(1)
        #: ``cuLaunchKernelEx``'s configuration (grid and stream rewritten per call) for a dependent launch, else
        #: ``None`` (``call`` is then ``cuLaunchKernel``'s arguments)
        self.config: _LaunchConfig | None = None
        self.call: tuple[Any, ...]
        if pdl:
            attr = _LaunchAttribute(id=_PDL_ATTRIBUTE, value=1)
            self.config = _LaunchConfig(1, 1, 1, block, 1, 1, shared, None, ctypes.pointer(attr), 1)
            keep.append(attr)
            self.call = (ctypes.byref(self.config), ctypes.c_void_p(function), array, None)
        else:
            self.call = (ctypes.c_void_p(function), self.grid, one, one, ctypes.c_uint(block), one, one,
                         ctypes.c_uint(shared), self.stream, array, None)
        #: ``(launch, handle)`` of the compiled call (:mod:`hicache_core.claunch`), or ``None`` (ctypes only).
        self.fast = fast

    def values(self, args: Sequence[Any]) -> tuple[int, ...]:
        """The dynamic parameters' values taken from a launch's positional ``args`` (a pointer as its address),
        in ``setters`` order: what :meth:`DriverKernel.relaunch` takes."""
        return tuple(args[pos].data_ptr() if is_ptr else args[pos] for pos, _, is_ptr in self.setters)


class DriverKernel:
    """A compiled Triton kernel as ``cuLaunchKernel`` sees it; :meth:`build` returns ``None`` where not verified."""

    def __init__(self, lib: Any, compiled: Any, plan: list[tuple[str, int, int]], scratch: int, num_warps: int,
                 shared: int, metas: Sequence[dict], pdl: bool = False) -> None:
        self.lib, self.compiled, self.plan, self.scratch = lib, compiled, plan, scratch
        self.block, self.shared, self.metas = 32 * num_warps, shared, metas
        #: compiled for programmatic dependent launch: launched through ``cuLaunchKernelEx`` with that attribute
        self.pdl = pdl

    @classmethod
    def build(cls, compiled: Any) -> DriverKernel | None:
        """The driver launch of ``compiled`` (a Triton ``CompiledKernel`` after its first launch), or ``None``
        (logged at DEBUG) when its parameters or launch attributes cannot be verified."""
        why, made = cls._verify(compiled)
        if made is None:
            logger.debug("driver launch not used for %s: %s", getattr(getattr(compiled, "metadata", None), "name", "?"),
                         why)
        return made

    @classmethod
    def _verify(cls, compiled: Any) -> tuple[str, DriverKernel | None]:
        lib = _cuda()
        if lib is None:
            return "no libcuda", None
        md, src = getattr(compiled, "metadata", None), getattr(compiled, "src", None)
        signature = getattr(src, "signature", None)
        ptx = getattr(compiled, "asm", {}).get("ptx") if isinstance(getattr(compiled, "asm", None), dict) else None
        if md is None or not isinstance(signature, dict) or not isinstance(ptx, str) or \
                not isinstance(getattr(compiled, "function", None), int):
            return "no metadata, signature, PTX or function handle", None
        if getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_cooperative_grid", False) or \
                getattr(md, "shared", 0) > _MAX_PLAIN_SHARED:
            return "launch attributes", None
        pdl = bool(getattr(md, "launch_pdl", False))
        if pdl and getattr(lib, "cuLaunchKernelEx", None) is None:
            return "a dependent launch and no cuLaunchKernelEx", None
        if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
            return "scratch memory", None
        metas = getattr(md, "tensordesc_meta", None)
        plan = expected_params(signature, metas)
        if plan is None:
            return "argument types", None
        if "cp.reduce.async.bulk" in ptx:
            return "tensor-map reductions (the map's data type would matter)", None
        sizes = ptx_params(ptx, getattr(md, "name", None))
        if sizes is None:
            return "PTX entry", None
        head, tail = sizes[:len(plan)], sizes[len(plan):]
        # Trailing parameters: Triton's global and profile scratch pointers (null here: the sizes are 0); a
        # build that appends anything else (instrumentation) gives more than two and is refused.
        if head != [_size(kind) for kind, _, _ in plan] or any(s != 8 for s in tail) or len(tail) > 2:
            return f"parameter sizes {sizes} vs {[_size(kind) for kind, _, _ in plan]}", None
        return "", cls(lib, compiled, plan, len(tail), md.num_warps, md.shared, metas or (), pdl)

    def _encode(self, desc: Any, meta: dict) -> Any:
        """A tensor map for host descriptor ``desc`` (``base``, ``shape``, ``strides``), as Triton encodes it."""
        elem = int(meta["elem_size"])
        dtype = _TMA_DTYPE.get(elem)
        shape, strides, box = list(desc.shape), list(desc.strides), list(meta["block_size"])
        if dtype is None or strides[-1] != 1 or getattr(desc, "padding", "zero") == "nan" or \
                getattr(desc, "round_f32_to_tf32", False) or desc.base.element_size() != elem:
            raise DriverLaunchError("descriptor not encodable here")
        rank = len(shape)
        raw = (ctypes.c_ubyte * (TENSOR_MAP_BYTES + TENSOR_MAP_ALIGN))()
        addr = ctypes.addressof(raw)
        addr += -addr % TENSOR_MAP_ALIGN
        dims = (ctypes.c_uint64 * rank)(*reversed(shape))
        gstrides = (ctypes.c_uint64 * rank)(*[s * elem for s in reversed(strides[:-1])], 0)
        boxes = (ctypes.c_uint32 * rank)(*reversed(box))
        ones = (ctypes.c_uint32 * rank)(*([1] * rank))
        res = self.lib.cuTensorMapEncodeTiled(addr, dtype, rank, desc.base.data_ptr(), dims, gstrides, boxes, ones, 0,
                                              int(meta["swizzle"]), _L2_PROMOTION_128B, 0)
        if res:
            raise _error(self.lib, res, "cuTensorMapEncodeTiled")
        return raw, addr

    def pack(self, args: Sequence[Any], dynamic: Sequence[int]) -> Packed:
        """Parameters for ``args`` (all the kernel's arguments, in order); the positions in ``dynamic`` are
        rewritten by :meth:`launch` from each call's arguments.

        :raises DriverLaunchError: a dynamic position holds a descriptor, or a descriptor cannot be encoded.
        """
        dyn = frozenset(dynamic)
        n = len(self.plan) + self.scratch
        array = (ctypes.c_void_p * n)()
        keep: list = [array, [a for i, a in enumerate(args) if i not in dyn]]  # static tensors stay alive with it
        setters, dyn_params = [], []
        for i, (kind, pos, part) in enumerate(self.plan):
            value = args[pos]
            if kind == "map":
                if pos in dyn:
                    raise DriverLaunchError("a tensor descriptor cannot change per call")
                raw, addr = self._encode(value, self.metas[part])
                keep.append(raw)
                array[i] = addr
                continue
            if kind in ("shape", "stride"):
                obj: Any = (ctypes.c_int32 if kind == "shape" else ctypes.c_int64)(
                    (value.shape if kind == "shape" else value.strides)[part])
            else:
                ctype = _SCALARS[kind][1]
                obj = ctype(value.data_ptr() if kind == "ptr" else value)
                if pos in dyn:
                    setters.append((pos, obj, kind == "ptr"))
                    dyn_params.append(i)
            keep.append(obj)
            array[i] = ctypes.addressof(obj)
        for j in range(self.scratch):  # the kernel uses no scratch: null pointers
            obj = ctypes.c_uint64(0)
            keep.append(obj)
            array[len(self.plan) + j] = ctypes.addressof(obj)
        return Packed(array, keep, tuple(setters), self.compiled.function, self.block, self.shared,
                      self._fast(array, keep, n, tuple(dyn_params)), self.pdl)

    def _fast(self, array: Any, keep: list, n: int, dyn_params: tuple[int, ...]) -> tuple[Any, Any] | None:
        """The compiled call's ``(launch, handle)`` for a packed launch, or ``None`` (ctypes) where it is
        unavailable: no compiled module, a driver without a C entry point (a stand-in), too many parameters."""
        addr = _launch_address(self.lib)
        ex = _launch_address(self.lib, "cuLaunchKernelEx") if self.pdl else 0
        mod = claunch.module() if addr is not None and ex is not None else None
        if mod is None or n > claunch.MAX_PARAMS or len(dyn_params) > claunch.MAX_DYNAMIC:
            return None
        # the handle keeps ``keep`` (the array and every static parameter's storage) alive itself; a dependent
        # launch goes through cuLaunchKernelEx (ex) with the programmatic-serialization attribute
        return mod.launch, mod.make(addr, self.compiled.function, self.block, self.shared, ctypes.addressof(array),
                                    n, dyn_params, keep, ex)

    def launch(self, grid: int, stream: int, packed: Packed, args: Sequence[Any]) -> bool:
        """Launch on ``grid`` programs with ``packed`` updated from ``args``' dynamic positions.

        Returns ``False`` (nothing launched) when this thread has no current CUDA context, so the caller can
        take Triton's launcher, which sets one up.

        :raises DriverLaunchError: the driver refused the launch.
        """
        if grid <= 0:  # as Triton's launcher: nothing to launch
            return True
        return self.relaunch(grid, stream, packed, packed.values(args))

    def relaunch(self, grid: int, stream: int, packed: Packed, values: tuple[int, ...]) -> bool:
        """:meth:`launch` with the dynamic parameters already resolved: ``values`` holds one int per entry of
        ``packed.setters``, in order (a pointer as its address).  Same result and errors as :meth:`launch`.

        Through the compiled call where ``packed`` has one (:mod:`hicache_core.claunch`: the parameters are
        copied per call, nothing shared is written), else through :mod:`ctypes` under ``packed.lock``."""
        if grid <= 0:
            return True
        fast = packed.fast
        if fast is not None and _C_ON[0]:
            res = fast[0](fast[1], grid, stream, *values)
        else:
            with packed.lock:
                for obj, v in zip(packed.objs, values):
                    obj.value = v
                cfg = packed.config
                if cfg is None:
                    packed.grid.value, packed.stream.value = grid, stream
                    res = self.lib.cuLaunchKernel(*packed.call)
                else:
                    cfg.grid_x, cfg.stream = grid, stream
                    res = self.lib.cuLaunchKernelEx(*packed.call)
        if res == _CUDA_ERROR_INVALID_CONTEXT:
            return False
        if res:
            err = _error(self.lib, res, "cuLaunchKernelEx" if self.pdl else "cuLaunchKernel")
            raise DriverLaunchError(f"{err}; HICACHE_DRIVER_LAUNCH=0 launches through Triton's launcher instead (an "
                                    "error that persists there too, such as an illegal address, came from an earlier "
                                    "kernel)")
        return True
