"""Cheap repeated launches of a Triton kernel: dispatch once, then call the compiled handle.

``kernel[grid](*args)`` re-binds and re-specialises every argument and looks the
compiled kernel up on each call; on the H200 that bookkeeping is most of a
``load_layer``'s host time.  :class:`Launcher` does the public launch the first
time it sees a *specialisation key* and keeps the returned compiled kernel;
later calls with the same key go straight to the compiled kernel's launcher,
with the same positional arguments and the same stream and hooks as Triton's
own ``JITFunction.run``.

The key is never coarser than Triton's: the device, ``num_warps``, every
constexpr's value, each tensor's dtype and 16-byte alignment, each tensor
descriptor's dtype, rank and block shape, and for each integer whether it fits
int32, whether it fits int64, whether it equals 1 and whether it is a multiple of 16.
Anything unusual (the CPU interpreter, a launch hook set for profiling, a Triton
without the compiled-kernel API, ``HICACHE_FAST_LAUNCH=0``) takes the public
path, so behaviour never depends on the shortcut.  The environment is read at
import; :func:`set_fast_launch` changes the setting at run time.

A caller that also hands a launch its own ``packs`` dict (one per launch whose
non-dynamic arguments never change) gets the CUDA driver launch of
:mod:`hicache_core.drvlaunch` where that module verifies the kernel's
parameters: the launch's parameters are packed once, tensor maps included,
and each call rewrites the dynamic ones and calls ``cuLaunchKernel``.
``HICACHE_DRIVER_LAUNCH=0`` (or :func:`set_driver_launch`) keeps Triton's
compiled-kernel launcher instead.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from typing import Any, Iterable, Mapping, Sequence

import torch

from .envflags import check_switch, env_on

__all__ = ["Launcher", "ENV_FAST_LAUNCH", "ENV_DRIVER_LAUNCH", "fast_launch_enabled", "set_fast_launch",
           "set_driver_launch", "driver_launch_enabled", "launch_key"]

logger = logging.getLogger(__name__)

#: ``0`` turns the compiled-handle shortcut off (every launch goes through ``kernel[grid]``).
ENV_FAST_LAUNCH = "HICACHE_FAST_LAUNCH"
#: ``0`` keeps Triton's compiled-kernel launcher where the CUDA driver launch would apply.
ENV_DRIVER_LAUNCH = "HICACHE_DRIVER_LAUNCH"

_I32_MIN, _I32_MAX, _I64_MIN, _I64_MAX = -(2**31), 2**31 - 1, -(2**63), 2**63 - 1
#: Static-key tokens, unique across every Launcher of the process (a token never means another
#: launcher's key), handed out under a lock.
_TOKENS = itertools.count()
_TOKEN_LOCK = threading.Lock()


def fast_launch_enabled() -> bool:
    """Whether the environment allows compiled handles (not ``HICACHE_FAST_LAUNCH=0``, not interpreting)."""
    if not env_on(ENV_FAST_LAUNCH):
        return False
    return os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


_ENABLED = [fast_launch_enabled()]  # read once at import: no environment lookup per launch
#: Triton's CPU interpreter keeps a launch's grid in process-wide state: two threads launching at once fail
#: ("x >= grid_dim[0]") or move wrong bytes, so interpreted launches take turns (a GPU launch never waits on it).
_INTERPRETER_LOCK = threading.Lock()


def _driver_env() -> bool:
    return env_on(ENV_DRIVER_LAUNCH)


_DRIVER = [_driver_env()]


def driver_launch_enabled() -> bool:
    """Whether launches given ``packs`` may take the CUDA driver launch (fast launch and driver launch both on)."""
    return _ENABLED[0] and _DRIVER[0]


def set_driver_launch(enabled: bool | None = None) -> bool:
    """Turn the CUDA driver launch on or off for every :class:`Launcher`; ``None`` re-reads
    ``HICACHE_DRIVER_LAUNCH``.  Returns the new state (it applies only where the fast launch does)."""
    check_switch("set_driver_launch", ENV_DRIVER_LAUNCH, enabled)
    _DRIVER[0] = _driver_env() if enabled is None else bool(enabled)
    return _DRIVER[0]


def set_fast_launch(enabled: bool | None = None) -> bool:
    """Turn the shortcut on or off for every :class:`Launcher`; ``None`` re-reads the environment.

    Returns the new state.  The interpreter (``TRITON_INTERPRET=1``) always keeps it off.
    """
    check_switch("set_fast_launch", ENV_FAST_LAUNCH, enabled)
    _ENABLED[0] = fast_launch_enabled() if enabled is None else (bool(enabled) and fast_launch_enabled())
    return _ENABLED[0]


def _traits(arg: Any) -> Any:
    """What Triton specialises a runtime argument on (or finer)."""
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() & 15 == 0)
    if isinstance(arg, bool):
        return ("b", arg)
    if isinstance(arg, int):
        return (_I32_MIN <= arg <= _I32_MAX, _I64_MIN <= arg <= _I64_MAX, arg == 1, arg & 15 == 0)
    if hasattr(arg, "block_shape") and hasattr(arg, "base"):  # a host tensor descriptor (TMA)
        return ("desc", type(arg), arg.base.dtype, tuple(arg.block_shape), len(arg.shape),
                getattr(arg, "padding", None), getattr(arg, "round_f32_to_tf32", None), repr(getattr(arg, "layout", None)))
    return (type(arg), arg)


def launch_key(args: Sequence[Any], constexpr_positions: frozenset[int], num_warps: int, device: int) -> tuple:
    """The specialisation key of one launch: constexprs by value, runtime args by :func:`_traits`."""
    return (device, num_warps, *[a if i in constexpr_positions else _traits(a) for i, a in enumerate(args)])


def _hooked(runtime: Any) -> bool:
    """Whether a Triton launch hook is set (profilers hook the public path).  Triton < 3.4 keeps ``None`` when no
    hook is set; later versions keep an empty ``HookChain``."""
    for h in (runtime.launch_enter_hook, runtime.launch_exit_hook):  # a loop, not any(): called per transfer
        if h is not None and getattr(h, "calls", True):
            return True
    return False


class Launcher:
    """Launch ``kernel`` (a ``@triton.jit`` function) on a 1-D grid, cheaply after the first call per key.

    ``args`` are *all* the kernel's parameters, positionally in signature
    order, constexprs included.  Launches go to the current stream of the
    current device, exactly as ``kernel[(grid,)](*args, num_warps=...)``.

    Callers that launch many times with mostly fixed arguments (tables built
    once per pool) pass ``static_key=launcher.static_key(args, dynamic)`` computed
    once, and ``dynamic``: the positions that change between calls.  Only those
    are inspected per call; the caller guarantees every other position holds the
    same objects (or ones with the same traits) as when the static key was made.
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._constexprs = frozenset(getattr(kernel, "constexprs", ()))
        self._nargs = len(getattr(kernel, "arg_names", ()))
        self._compiled: dict[tuple, Any] = {}
        self._driver: dict[tuple, Any] = {}  # key -> DriverKernel, or False where not verified
        self._static_ids: dict[tuple, int] = {}
        self._api = self._handle_api()
        #: Launches that went through the CUDA driver launch (for tests and benchmarks).
        self.driver_launches = 0

    @staticmethod
    def _handle_api() -> tuple[Any, Any, Any] | None:
        """(get_current_device, get_current_stream, knobs.runtime) when this Triton has the compiled-kernel API."""
        try:
            import triton
            from triton.runtime import driver

            runtime = triton.knobs.runtime
            active = driver.active
            return active.get_current_device, active.get_current_stream, runtime
        except Exception as exc:  # older Triton, no driver: the public path only
            logger.debug("fast launch unavailable: %s", exc)
            return None

    @property
    def arg_names(self) -> tuple[str, ...]:
        """The kernel's parameter names, in signature order."""
        return tuple(getattr(self.kernel, "arg_names", ()))

    def bind(self, values: Mapping[str, Any]) -> tuple:
        """The positional arguments of a launch, taken by parameter name from ``values``.

        ``values`` may hold more names than the kernel declares (a kernel takes
        only what it uses); a parameter missing from it is a ``TypeError``
        naming the parameter.
        """
        try:
            return tuple(values[name] for name in self.arg_names)
        except KeyError as exc:
            raise TypeError(f"{self.kernel}: no value for kernel parameter {exc.args[0]!r}; "
                            f"values given: {sorted(values)}") from None

    def positions(self, names: Iterable[str]) -> tuple[int, ...]:
        """Positions of the parameters in ``names`` that the kernel declares (others are ignored)."""
        wanted = frozenset(names)
        return tuple(i for i, name in enumerate(self.arg_names) if name in wanted)

    def static_key(self, args: Sequence[Any], dynamic: Sequence[int]) -> int:
        """The part of the specialisation key contributed by every position not in ``dynamic``, as an int
        token (equal keys give equal tokens: calls then hash an int, not the whole key).  Tokens are unique
        across launchers; pass a token only to the launcher that issued it."""
        dyn = frozenset(dynamic)
        key = tuple(None if i in dyn else (a if i in self._constexprs else _traits(a)) for i, a in enumerate(args))
        token = self._static_ids.get(key)
        if token is None:
            with _TOKEN_LOCK:  # two threads never get one token for two keys
                token = self._static_ids.setdefault(key, next(_TOKENS))
        return token

    def __call__(self, grid: int, args: Sequence[Any], *, num_warps: int, static_key: int | None = None,
                 dynamic: Sequence[int] = (), maxnreg: int | None = None,
                 packs: dict | None = None, pdl: bool = False) -> tuple[Any, Any] | None:
        """Launch on ``grid`` programs.  ``maxnreg`` caps registers per thread (Triton's option; ``None``: no cap).
        ``pdl``: a programmatic dependent launch (Triton's ``launch_pdl``, a compile option: its own compiled kernel;
        the CUDA driver launch makes it through ``cuLaunchKernelEx``, as Triton's launcher does).

        ``packs``: a dict owned by one launch whose positions outside ``dynamic`` hold the same values on
        every call with it (needs ``static_key``); the driver launch keeps that launch's packed parameters
        there.  Tensors at dynamic positions must then live on the launch's device (the driver launch
        passes their addresses as they are; Triton's launcher would reject a CPU tensor).

        Returns ``(DriverKernel, Packed)`` when the launch went through the CUDA driver, else ``None``: a
        caller may repeat the same launch with other values at the dynamic positions *of the same traits*
        (same dtypes, alignment and integer classes, so the same key) through
        ``DriverKernel.launch(grid, stream, packed, args)`` while :meth:`driver_ready` holds.
        """
        if len(args) != self._nargs and self._nargs:
            raise TypeError(f"{self.kernel}: expected {self._nargs} arguments, got {len(args)}")
        opts: dict[str, Any] = {"num_warps": num_warps}
        if maxnreg is not None:
            opts["maxnreg"] = maxnreg
        if pdl:
            opts["launch_pdl"] = True
        api = self._api
        if api is None or not _ENABLED[0]:
            if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
                with _INTERPRETER_LOCK:
                    self.kernel[(grid,)](*args, **opts)
            else:
                self.kernel[(grid,)](*args, **opts)
            return None
        get_device, get_stream, runtime = api
        if _hooked(runtime):
            self.kernel[(grid,)](*args, **opts)  # profilers hook the public path
            return None
        device = get_device()
        if static_key is None:
            key = launch_key(args, self._constexprs, num_warps, device)
            if maxnreg is not None:
                key = (*key, "maxnreg", maxnreg)
            if pdl:
                key = (*key, "pdl")
            packs = None
        else:
            key = ("static", device, num_warps, static_key, maxnreg, pdl, *[_traits(args[i]) for i in dynamic])
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self.kernel[(grid,)](*args, **opts)
            if all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
                self._compiled[key] = compiled
            return None
        stream = get_stream(device)
        if packs is not None and _DRIVER[0]:
            drv = self._driver.get(key)
            if drv is None:
                drv = self._driver[key] = self._driver_kernel(compiled)
            if drv:
                packed = packs.get(key)
                if packed is None:
                    packed = packs[key] = self._pack(drv, args, dynamic)
                if packed and drv.launch(grid, stream, packed, args):
                    self.driver_launches += 1
                    return drv, packed
        compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)
        return None

    def driver_ready(self) -> bool:
        """Whether a launch this launcher made through the CUDA driver may be repeated directly now: fast and
        driver launches on, no Triton launch hook set (a profiler's hooks see only the public path)."""
        api = self._api
        if api is None or not (_ENABLED[0] and _DRIVER[0]):
            return False
        runtime = api[2]
        return not _hooked(runtime)

    @staticmethod
    def _driver_kernel(compiled: Any) -> Any:
        """The verified driver launch of ``compiled``, or ``False`` (Triton's launcher then)."""
        try:
            from .drvlaunch import DriverKernel

            return DriverKernel.build(compiled) or False
        except Exception as exc:  # anything this module cannot read keeps Triton's launcher
            logger.info("driver launch not used: %r", exc)
            return False

    @staticmethod
    def _pack(drv: Any, args: Sequence[Any], dynamic: Sequence[int]) -> Any:
        """``drv``'s packed parameters for this launch, or ``False`` when they cannot be packed (Triton's
        launcher then serves this launch)."""
        from .drvlaunch import DriverLaunchError

        try:
            return drv.pack(args, dynamic)
        except DriverLaunchError as exc:
            logger.info("driver launch not used for this launch: %s", exc)
            return False
