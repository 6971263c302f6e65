"""Repeat a transfer's CUDA driver launches for the next call of the same batch, without re-deriving them.

An engine moves a batch layer by layer: ``load_layer(layer, host_indices, device_indices)`` once per layer,
every call with the same two index tensors.  Everything a row-copy strategy derives from those tensors
(their device copies, the kernel specialisation they select, the grid) is the same for every layer of the
batch, and everything it derives from the layer (the launch's packed parameters, its entry table) is the
same for every batch.  :class:`Replays` keeps both halves:

* a **batch** per direction: the index tensors as the caller passed them (identity and version counter,
  as the pool's own check memo), the stream, and what the kernels read (device copies, count, traits);
* **steps** per (layer, direction, traits): each launch's :class:`~hicache_core.drvlaunch.DriverKernel`,
  its packed parameters and how its grid follows the count, recorded from a call that launched every
  one of them through the driver.

A call whose batch matches and whose layer has steps launches them straight through ``cuLaunchKernel``; the pool
makes that match first, before its own checks, through the direction's :meth:`Replays.lane` (one function between
the public call and the launch: the checks it skips were made for these very tensors by an earlier call);
anything else (a new tensor, an in-place change, another stream or device, the driver launch off, a
Triton launch hook set, no steps yet, ``HICACHE_REPLAY=0``) takes the strategy's normal path, which records
the steps.  As with the pool's own memos, writes that bypass torch's version counter (``.data``, a NumPy view)
are not seen: a CPU index tensor changed that way keeps its earlier device copy (pools built with
``validate="full"`` or ``"strict"`` never replay); a same-device index tensor is read where it lies, and a
non-contiguous one is never replayed.  A replay moves exactly what the normal path moves: the same kernels, parameters and grids,
only the derivation is skipped.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Hashable, NamedTuple

import torch

from .envflags import check_switch, env_on
from .kernel_support import current_device_index, current_stream_handle, index_memos, kernel_indices
from .launch import _traits
from .validate import tensor_where

__all__ = ["Replays", "Step", "Batch", "Lane", "ENV_REPLAY", "DEVICE_TYPES", "MAX_EXACT", "set_replay",
           "replay_enabled"]

logger = logging.getLogger(__name__)

#: ``0`` turns replays off (every call takes the strategy's normal path).
ENV_REPLAY = "HICACHE_REPLAY"
#: Most exact counts (:attr:`Replays.exact`) whose steps one pool keeps recorded (every layer and direction of each).
MAX_EXACT = 32


def _env() -> bool:
    return env_on(ENV_REPLAY)


_ON = [_env()]  # read once at import: no environment lookup per call
#: Device types whose pools replay (the CUDA driver launch exists there only).
DEVICE_TYPES: tuple[str, ...] = ("cuda",)


def replay_enabled() -> bool:
    """Whether calls may be replayed (``HICACHE_REPLAY`` not ``0``, or :func:`set_replay`)."""
    return _ON[0]


def set_replay(enabled: bool | None = None) -> bool:
    """Turn replays on or off for every pool; ``None`` re-reads ``HICACHE_REPLAY``.  Returns the new state.

    :raises TypeError: ``enabled`` is not a bool, an int or ``None`` (a string such as ``"0"`` or ``"off"`` would
        otherwise be truthy and turn replays on); nothing changes then."""
    check_switch("set_replay", ENV_REPLAY, enabled)
    _ON[0] = _env() if enabled is None else bool(enabled)
    return _ON[0]


class Batch(NamedTuple):
    """One direction's last index pair, as passed and as the kernels read it."""

    host_indices: torch.Tensor
    host_version: int
    #: :func:`~hicache_core.validate.tensor_where` of the tensors as passed: a ``.data`` swap keeps identity and
    #: version, not these
    host_where: tuple
    device_indices: torch.Tensor
    device_version: int
    device_where: tuple
    stream: int
    h: torch.Tensor  # what kernels read (device copies of CPU indices, contiguous)
    d: torch.Tensor
    n: int
    traits: tuple  # the launch-key traits of h, d and n, and which side of each split n lies
    values: tuple[int, int, int]  # what a launch's batch parameters take: h's and d's addresses, n
    #: the storages of the tensors as passed, held so that no other storage takes their addresses while this batch
    #: compares them (after a ``.data`` swap frees one)
    held: tuple = ()


#: ``lane(layer, host_indices, device_indices) -> bool`` (:meth:`Replays.lane`).
Lane = Callable[[Any, torch.Tensor, torch.Tensor], bool]


@dataclass(frozen=True)
class Step:
    """One launch of a recorded call: its driver launch and how a batch's values fill it.

    ``template`` is the launch's positional arguments with the batch's positions (``slots``: host indices,
    device indices, count) unset; the grid is ``max(1, min(programs, ceil(n / tokens) * per_tile))``.
    ``fallback`` holds the keyword arguments of the normal ``launcher`` call, taken when the driver
    declines (no CUDA context on this thread).  ``base`` is the launch's dynamic parameter values
    (:meth:`~hicache_core.drvlaunch.Packed.values`) with the batch's unset, and ``where`` says which of them
    take a batch's :attr:`Batch.values`: ``(index in base, index in Batch.values)`` pairs.  ``span`` is
    ``(start, count)`` for a launch that moves a run of the batch's positions (a call split by positions: views of
    its index tensors from ``start``, ``count`` long; ``n`` above is then ``count``), ``None`` for one that moves them
    all; such steps are recorded under the call's exact count (the strategy's ``shape``), which fixes every run.
    """

    kernel: Any  # hicache_core.drvlaunch.DriverKernel
    packed: Any  # hicache_core.drvlaunch.Packed
    template: tuple
    slots: tuple[int, int, int]
    programs: int
    tokens: int
    per_tile: int
    launcher: Any  # hicache_core.launch.Launcher
    fallback: dict
    base: tuple[int, ...]
    where: tuple[tuple[int, int], ...]
    span: tuple[int, int] | None = None


class Replays:
    """The batches and recorded steps of one pool binding (see the module docstring).

    Thread-safe as the memos it mirrors: a batch is one immutable tuple replaced whole, steps are
    immutable tuples, each driver launch holds its packed parameters' lock, and a recording holds this object's
    lock while it drops the oldest count's steps (:attr:`exact`).
    """

    def __init__(self, binding: Any, *, splits: tuple[int, ...] = (),
                 shape: Callable[[int, int | None, bool], Hashable] | None = None,
                 exact: Callable[[Hashable], bool] | None = None) -> None:
        # not the binding itself: it holds this object (scratch), and a cycle would keep a dropped pool's
        # buffers alive until the garbage collector runs
        self.memos = index_memos(binding)
        self.device = binding.device
        #: Counts at which the strategy's launches change (e.g. a TMA row limit): a batch's traits record which
        #: side of each its count lies, so steps recorded on one side are never replayed on the other.
        self.splits = splits
        #: How the strategy's launches of a call depend on its count beyond :attr:`splits` (e.g. a split into launches
        #: of some bytes each): ``shape(n, layer, to_host)`` joins the key steps are recorded under, so steps of one
        #: shape are never replayed for a call of another.
        self.shape = shape
        #: Whether a shape names one exact count (e.g. a split into runs of positions, whose starts and lengths follow
        #: the count): an engine's counts vary, so the steps of at most :data:`MAX_EXACT` such counts are kept (every
        #: layer and direction of each), the count recorded longest ago dropped first (recorded again when its calls
        #: come again); other keys are few (layers, directions, traits).
        self.exact = exact
        self._exact: dict[int, dict[tuple, None]] = {}  # count -> its keys, counts recorded longest ago first
        self._record_lock = threading.Lock()
        self.device_index = binding.device.index if binding.device.index is not None else current_device_index()
        self._batches: list[Batch | None] = [None, None]  # by to_host
        self._steps: dict[tuple, tuple[Step, ...]] = {}
        #: By direction, then layer: ``(batch, ((step, grid, values), ...))``, the steps of the layer resolved for
        #: one batch (grids and dynamic parameter values computed once per batch and layer, not per call).  A new
        #: batch of the direction starts a new dict (an old batch's tensors are not kept alive by it).
        self._ready: list[dict[int | None, tuple]] = [{}, {}]
        #: Calls served by a replay (for tests and benchmarks).
        self.hits = 0

    @staticmethod
    def usable(binding: Any) -> bool:
        """Whether ``binding``'s transfers may be replayed: a pool on a device of :data:`DEVICE_TYPES` (CUDA)
        whose index memos are on (``validate="full"``/``"strict"`` pools check and copy every call)."""
        return binding.device.type in DEVICE_TYPES and index_memos(binding)[0].enabled

    def batch(self, host_indices: torch.Tensor, device_indices: torch.Tensor, n: int, to_host: bool,
              launcher: Any) -> Batch | None:
        """The batch of these index tensors (``n`` positions each) on the current stream, resolved now when
        new, or ``None`` when this call cannot replay: another current device, tensors without a version
        counter, a same-device index tensor that is not contiguous (its copy could go stale through writes
        torch does not count), or the driver launch of ``launcher`` not ready."""
        if not _ON[0] or current_device_index() != self.device_index or not launcher.driver_ready():
            return None
        stream = current_stream_handle(self.device_index)
        b = self._batches[to_host]
        try:  # tensor_version's reading, inline (this runs per transfer call)
            hv, dv = host_indices._version, device_indices._version
        except RuntimeError:  # an inference tensor keeps no version counter: never replayed
            return None
        if b is not None and _matches(b, host_indices, device_indices, n, stream):
            return b
        memo_h, memo_d = self.memos
        h, d = kernel_indices(host_indices, self.device, memo_h), kernel_indices(device_indices, self.device, memo_d)
        if (h is not host_indices and host_indices.device == h.device) or \
                (d is not device_indices and device_indices.device == d.device):
            return None  # a contiguous copy of a same-device view: made anew by every call (normal path)
        traits = (_traits(h), _traits(d), _traits(n), *[n > cut for cut in self.splits])
        b = Batch(host_indices, hv, tensor_where(host_indices), device_indices, dv, tensor_where(device_indices), stream,
                  h, d, n, traits, (h.data_ptr(), d.data_ptr(), n),
                  (host_indices.untyped_storage(), device_indices.untyped_storage()))
        self._batches[to_host] = b
        self._ready[to_host] = {}
        return b

    def run(self, b: Batch, layer: int | None, to_host: bool) -> bool:
        """Launch the steps recorded for ``layer`` with batch ``b``; ``False`` (nothing launched) when none."""
        r = self._resolved(b, layer, to_host)
        if r is None:
            return False
        for st, grid, values in r[1]:
            if st.kernel.relaunch(grid, b.stream, st.packed, values):
                st.launcher.driver_launches += 1
            else:  # no CUDA context on this thread: the normal launch sets one up
                st.launcher(grid, _args(st, b), **st.fallback)
        self.hits += 1
        return True

    def lane(self, to_host: bool, launcher: Any) -> Lane:
        """The direction's fast path: ``lane(layer, host_indices, device_indices)`` replays ``layer``'s launches
        and returns ``True`` when :meth:`batch` would match these tensors as they are now and steps of the layer
        are recorded, else returns ``False`` having launched nothing (the normal path then).  The caller passes
        ``layer`` as an ``int`` (exactly, not a subclass) or ``None``; it must not use a lane for tensors its own
        checks have not passed: only tensors of a batch, which only :meth:`batch` makes, are replayed.

        One call, no frames between the caller and the launch: the checks of :meth:`batch` (identity, version
        counters, addresses, length, device, stream, the driver launch of ``launcher``) then :meth:`run`'s."""
        batches, device_index, driver_ready = self._batches, self.device_index, launcher.driver_ready

        def lane(layer: Any, host_indices: torch.Tensor, device_indices: torch.Tensor) -> bool:
            b = batches[to_host]
            if b is None or b.host_indices is not host_indices:  # identity first: no other argument is read
                return False
            if (not _ON[0] or current_device_index() != device_index or not driver_ready()
                    or not _matches(b, host_indices, device_indices, host_indices.numel(),
                                    current_stream_handle(device_index))):
                return False
            return self.run(b, layer, to_host)

        return lane

    def _resolved(self, b: Batch, layer: int | None, to_host: bool) -> tuple | None:
        """``(b, ((step, grid, values), ...))`` for ``layer``'s recorded steps, or ``None`` when none."""
        ready = self._ready[to_host]
        r = ready.get(layer)
        if r is None or r[0] is not b:  # another thread's batch may have replaced it: identity, not the key
            steps = self._steps.get(self._key(b, layer, to_host))
            if steps is None:
                return None
            r = (b, tuple([_resolve(st, b) for st in steps]))
            if self._ready[to_host] is ready and self._batches[to_host] is b:  # not an old batch's, kept alive
                ready[layer] = r
        return r

    def record(self, b: Batch, layer: int | None, to_host: bool, steps: list[Step]) -> None:
        """Keep ``steps`` (every launch of one call of ``layer`` with batch ``b``, in order)."""
        key = self._key(b, layer, to_host)
        with self._record_lock:
            if self.exact is not None and self.exact(key[3]):
                keys = self._exact.pop(b.n, None)  # re-inserted last: the count recorded most lately
                if keys is None:
                    keys = {}
                    while len(self._exact) >= MAX_EXACT:
                        for old in self._exact.pop(next(iter(self._exact))):
                            self._steps.pop(old, None)
                keys[key] = None
                self._exact[b.n] = keys
            self._steps[key] = tuple(steps)
        self._ready[to_host].pop(layer, None)

    def _key(self, b: Batch, layer: int | None, to_host: bool) -> tuple:
        """What steps are recorded under: the layer, the direction, the batch's traits and the call's shape."""
        return layer, to_host, b.traits, None if self.shape is None else self.shape(b.n, layer, to_host)


def _matches(b: Batch, host_indices: torch.Tensor, device_indices: torch.Tensor, n: int, stream: int) -> bool:
    """Whether ``b`` is these index tensors (``n`` positions) as they are now, on ``stream``: the same objects, their
    version counters, addresses, lengths, dtypes and strides unchanged (a ``.data`` swap keeps identity and version;
    a swap to another view of the same storage may keep the address too, not all the rest)."""
    return (b.host_indices is host_indices and b.device_indices is device_indices
            and host_indices._version == b.host_version and device_indices._version == b.device_version
            and b.n == n and b.stream == stream
            and tensor_where(host_indices) == b.host_where and tensor_where(device_indices) == b.device_where)


def _args(st: Step, b: Batch) -> list:
    """``st``'s positional arguments with batch ``b``'s values in place (its run's views where ``st.span`` says)."""
    args = list(st.template)
    ih, idv, i_n = st.slots
    if st.span is None:
        args[ih], args[idv], args[i_n] = b.h, b.d, b.n
    else:
        start, count = st.span
        args[ih], args[idv], args[i_n] = b.h[start:start + count], b.d[start:start + count], count
    return args


_IN_ORDER = ((0, 0), (1, 1), (2, 2))  # Step.where when the batch values are a launch's first three


def _resolve(st: Step, b: Batch) -> tuple[Step, int, tuple[int, ...]]:
    """``(st, grid, values)``: the grid of ``st`` for batch ``b`` and the value of each of its packed dynamic
    parameters (:meth:`~hicache_core.drvlaunch.DriverKernel.relaunch`), as :meth:`DriverKernel.launch` would
    set them from :func:`_args` (``st.base`` with ``b``'s values at ``st.where``; for a run of positions,
    ``st.span``, the addresses of :func:`_args`' views, ``start`` elements on, and its ``count``)."""
    ours, n = b.values, b.n
    if st.span is not None:
        start, n = st.span
        ours = (ours[0] + start * b.h.element_size(), ours[1] + start * b.d.element_size(), n)
    grid = max(1, min(st.programs, -(-n // st.tokens) * st.per_tile))
    if st.where == _IN_ORDER:  # the usual case
        return st, grid, ours + st.base[3:]
    values = list(st.base)
    for i, k in st.where:
        values[i] = ours[k]
    return st, grid, tuple(values)


def step(used: tuple[Any, Any], launcher: Any, args: list, slots: tuple[int, int, int], *, programs: int,
         tokens: int, per_tile: int, fallback: dict, span: tuple[int, int] | None = None) -> Step:
    """The :class:`Step` of a launch that ``launcher`` made through the driver (``used``: what it returned);
    ``span``: ``(start, count)`` of the batch's positions it moved, ``None`` for all of them."""
    template = list(args)
    for i in slots:
        template[i] = None  # the batch's values: never kept alive by a recording
    packed = used[1]
    kind = {pos: k for k, pos in enumerate(slots)}  # argument position -> index in Batch.values
    base = tuple(0 if pos in kind else (template[pos].data_ptr() if is_ptr else template[pos])
                 for pos, _, is_ptr in packed.setters)  # the template keeps those tensors alive
    where = tuple((i, kind[pos]) for i, (pos, _, _) in enumerate(packed.setters) if pos in kind)
    return Step(used[0], packed, tuple(template), slots, programs, tokens, per_tile, launcher, fallback, base, where,
                span)
