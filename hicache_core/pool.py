"""The host KV pool: allocator, host buffers, and transfers through a resolved strategy."""

from __future__ import annotations

import logging
import operator
import os
from typing import Any, Mapping, Sequence

import torch

from .allocator import PageAllocator
from .binding import PoolBinding, bind, flat_bytes
from .envflags import env_on
from .errors import HostBufferError, SpecError, UnallocatedSlotError
from .kernel_support import IndexMemo
from .layout import HostPlan, page_blocks
from .registry import Registry, Resolution, default_registry
from .spec import PoolSpec
from .validate import (
    CheckedPair,
    check_device_buffers,
    check_host_apart_from_device,
    check_host_buffers_disjoint,
    check_indices,
    check_layer,
    pair_where,
    tensor_version,
)

__all__ = ["HostKVPool", "allocate_host_buffers", "validate_level", "ENV_VALIDATE", "ENV_LANES"]

logger = logging.getLogger(__name__)

#: ``shapes`` (default) checks the values of CPU-resident indices and only the
#: shapes of device-resident ones, whose values would cost a host
#: synchronisation per call; every strategy still keeps them in bounds (kernels
#: mask every access, ``direct`` and ``reference`` check after reading them), so a
#: bad index never touches memory out of bounds.  ``full`` checks device-resident
#: values up front too (one synchronisation per call) and memoises nothing (writes
#: through ``.data`` or a NumPy view do not bump torch's version counter, so a
#: memo could reuse a stale check or device copy).  ``strict`` is ``full`` plus a
#: check that every host slot is allocated in this pool's allocator (engines that
#: allocate host slots themselves must not use it).
ENV_VALIDATE = "HICACHE_VALIDATE"
#: ``0`` turns the strategies' fast paths off for pools built from then on (every call is checked and goes
#: through the strategy; for measurements and debugging).
ENV_LANES = "HICACHE_LANES"

VALIDATE_LEVELS = ("shapes", "full", "strict")


def validate_level(validate: str | None) -> str:
    """The validation level of a pool: ``validate`` if given, else ``$HICACHE_VALIDATE``, else ``shapes`` (any case,
    spaces ignored; an empty value is the default).  A value that is none of :data:`VALIDATE_LEVELS` raises
    :class:`~hicache_core.errors.SpecError` naming where it came from."""
    raw, where = (validate, "validate") if validate is not None else (os.environ.get(ENV_VALIDATE, ""), ENV_VALIDATE)
    level = str(raw).strip().lower() or "shapes"
    if level not in VALIDATE_LEVELS:
        raise SpecError(f"{where}={raw!r}: use 'shapes', 'full' or 'strict'")
    return level


def _check_host_arguments(plan: HostPlan, host_buffers: object, pin_memory: object) -> None:
    """``host_buffers`` and ``pin_memory`` as :class:`HostKVPool` takes them, else :class:`HostBufferError` naming the
    argument and the fix (a list, a buffer the layout does not plan, a pinning the machine or the buffers lack)."""
    names = [b.name for b in plan.buffers]
    if pin_memory is not None and not isinstance(pin_memory, bool):
        raise HostBufferError(f"pin_memory={pin_memory!r}: use True, False or leave it unset (pinned where CUDA is "
                              "available)")
    if host_buffers is None:
        if pin_memory and not torch.cuda.is_available():
            raise HostBufferError("pin_memory=True, but torch sees no CUDA device to pin host memory for; leave it "
                                  "unset (pinned where CUDA is available) or pass False")
        return
    if not isinstance(host_buffers, Mapping):
        raise HostBufferError(f"host_buffers must map each buffer name of the layout's plan ({names}) to its tensor, "
                              f"got a {type(host_buffers).__name__}")
    unknown = sorted(set(host_buffers) - set(names))
    if unknown:
        raise HostBufferError(f"host_buffers has {unknown}, which the layout's plan does not hold (it holds {names}); "
                              "leave them out")
    if pin_memory:
        # an empty tensor holds no byte to pin, so it is never "unpinned" (an engine may pass one for an empty part)
        unpinned = [n for n, t in host_buffers.items()
                    if isinstance(t, torch.Tensor) and t.numel() and not t.is_pinned()]
        if unpinned:
            raise HostBufferError(f"pin_memory=True, but host buffer(s) {unpinned} are not pinned: pin_memory applies "
                                  "to the buffers the pool allocates; pin yours (tensor.pin_memory()) or leave "
                                  "pin_memory unset")


def allocate_host_buffers(plan: HostPlan, *, pin_memory: bool) -> dict[str, torch.Tensor]:
    """Allocate ``plan``'s host buffers (uninitialised), pinned when asked."""
    return {b.name: torch.empty(b.shape, dtype=b.dtype, pin_memory=pin_memory) for b in plan.buffers}


class HostKVPool:
    """A host KV pool in one layout, moving rows through one resolved strategy.

    The strategy is resolved once, here, from ``(layout, io_backend,
    spec.sharded)``; a miss raises :class:`~hicache_core.errors.ResolutionError`.

    :param spec: what the pool holds.
    :param layout: host layout name (a registered layout).
    :param io_backend: ``kernel``, ``direct``, ``reference`` or a vendor backend.
    :param device_buffers: the device pool's buffers as the engine holds them:
        component (or part) name -> one tensor per device layer id
        (``[tokens, ...]``, any dtype, token axis may be strided; ``None`` for
        layers this rank does not hold).
    :param host_buffers: wrap buffers the engine already allocated (names and
        shapes as the layout plans them: ``layout.plan(spec).buffers``) instead of allocating.
        Allocated buffers are uninitialised (``torch.empty``).
    :param pin_memory: pin allocated host buffers (default: when CUDA is available); with
        ``host_buffers``, ``True`` requires them pinned.
    :param strategy: strategy name overriding the default pick for the key.
    :param strategy_options: keyword arguments for the strategy's factory (e.g.
        ``{"programs": 8}``, the SM budget of kernel strategies).
    :param registry: registry to resolve in (default: the process-wide one).
    :param validate: ``shapes`` (default, no host synchronisation), ``full`` or
        ``strict`` (see :data:`ENV_VALIDATE`).

    Transfers only enqueue work on the current stream of the pool's device;
    :meth:`get_page`, :meth:`set_page` and the bytes behind :meth:`page_pointers`
    are read and written by the host at once.  Synchronise the stream(s) the
    transfers were enqueued on before reading or writing a page, or pass
    ``synchronize=True``.
    """

    def __init__(
        self,
        spec: PoolSpec,
        layout: str,
        io_backend: str,
        device_buffers: Mapping[str, Sequence[torch.Tensor | None]],
        *,
        host_buffers: Mapping[str, torch.Tensor] | None = None,
        pin_memory: bool | None = None,
        strategy: str | None = None,
        strategy_options: Mapping[str, Any] | None = None,
        registry: Registry | None = None,
        validate: str | None = None,
    ) -> None:
        reg = registry if registry is not None else default_registry()
        self.spec = spec
        self.io_backend = io_backend
        self.resolution: Resolution = reg.resolve(spec, layout, io_backend, override=strategy, options=strategy_options)
        self.validate = validate_level(validate)
        # the last pair each direction checked (index: to_host): a backup between two loads of one batch (an engine's
        # backup and load threads share the pool) does not make the next load check its indices again
        self._checked: list[tuple[torch.Tensor, int | None, torch.Tensor, int | None, tuple, tuple] | None] = [None, None]
        plan: HostPlan = self.resolution.layout.plan(spec)
        check_device_buffers(spec, device_buffers)
        _check_host_arguments(plan, host_buffers, pin_memory)
        if host_buffers is None:
            pin = torch.cuda.is_available() if pin_memory is None else pin_memory
            host_buffers = allocate_host_buffers(plan, pin_memory=pin)
        else:
            check_host_buffers_disjoint(host_buffers)
            check_host_apart_from_device(host_buffers, device_buffers)
        self.binding: PoolBinding = bind(spec, self.resolution.layout, plan, host_buffers, device_buffers)
        if self.validate != "shapes":  # no memo may skip a check or reuse a copy (see ENV_VALIDATE)
            self.binding.scratch["core.index_memos"] = (IndexMemo(enabled=False), IndexMemo(enabled=False))
        self.strategy = self.resolution.strategy
        self.strategy.prepare(self.binding)
        # the optional fast path (see Strategy), by to_host; never where every call is checked
        on = self.validate == "shapes" and env_on(ENV_LANES)
        lane = getattr(self.strategy, "lane", None) if on else None
        self._lanes = (lane(self.binding, False), lane(self.binding, True)) if callable(lane) else (None, None)
        self.allocator = PageAllocator(spec.capacity, spec.page_size)
        # page views follow the host plan, not how the device happens to hold parts
        self._page_segments = [
            (flat_bytes(self.binding.host_buffers[s.buffer]), s.addressing.page,
             page_blocks(s, spec, spec.component_map(s.component).host_layer_num))
            for s in plan.segments
        ]
        logger.debug("HostKVPool %s via %s", spec.describe(), self.resolution.info.name)

    def __repr__(self) -> str:
        return (f"HostKVPool({self.spec.describe()}, layout={self.layout!r}, io_backend={self.io_backend!r}, "
                f"strategy={self.strategy_name!r}, device={self.spec.device}, "
                f"free={self.available_size()}/{self.spec.capacity} slots)")

    # -- properties ----------------------------------------------------------
    @property
    def layout(self) -> str:
        return self.resolution.layout.name

    @property
    def strategy_name(self) -> str:
        return self.resolution.info.name

    @property
    def host_buffers(self) -> dict[str, torch.Tensor]:
        return self.binding.host_buffers

    @property
    def page_size(self) -> int:
        return self.spec.page_size

    # -- allocator -------------------------------------------------------------
    def alloc(self, need_size: int) -> torch.Tensor:
        """Page-aligned host slots; see :meth:`PageAllocator.alloc`."""
        return self.allocator.alloc(need_size)

    def try_alloc(self, need_size: int) -> torch.Tensor | None:
        """Like :meth:`alloc`, but ``None`` when the pool is exhausted; see :meth:`PageAllocator.try_alloc`."""
        return self.allocator.try_alloc(need_size)

    def free(self, indices: torch.Tensor) -> int:
        """Return slots; see :meth:`PageAllocator.free`."""
        return self.allocator.free(indices)

    def available_size(self) -> int:
        return self.allocator.available_size()

    # -- transfers ---------------------------------------------------------------
    def _check(self, host_indices: torch.Tensor, device_indices: torch.Tensor, *, to_host: bool) -> None:
        """Validate the indices, unless they are the very tensors the previous call in the same
        direction validated, unchanged (calls in the other direction between them do not count).

        Per-layer calls of one batch pass the same tensors; checking the values
        of CPU indices once per batch instead of once per layer saves most of
        the host time of a ``load_layer`` with CPU indices.  A ``.data`` swap is seen (address, length and
        dtype are compared too); writes that bypass torch's version counter (in place through ``.data``, a
        NumPy view) are not, which is why
        ``validate="full"`` memoises nothing; every built-in strategy still
        keeps out-of-range indices away from memory (kernels mask them, the
        generic backends range-check what they read), so a stale check can never
        cause an out-of-bounds access.  What a check read serves its own call alone, in its own thread
        (:attr:`~hicache_core.binding.PoolBinding.checked`); index tensors rewritten behind the version counter
        by another thread *while a call using them runs* (between its check and its copies) are a race no check
        can see: do not write indices a transfer is using.  The rows a transfer writes (host pages of
        a backup, device rows of a load) must not repeat.
        """
        last = self._checked[to_host]  # one snapshot: another thread may replace it
        if (last is not None and last[0] is host_indices and last[2] is device_indices
                and last[1] == tensor_version(host_indices) and last[3] == tensor_version(device_indices)
                and last[4] == pair_where(host_indices, device_indices)):
            return  # nothing was read now: binding.checked is not set, the strategy reads what it needs itself
        full = self.validate != "shapes"
        def values(t: object) -> bool:
            return full or not isinstance(t, torch.Tensor) or t.device.type == "cpu"
        def version(t: object) -> int | None:
            return tensor_version(t) if isinstance(t, torch.Tensor) else None
        # read before the values are: a write landing during the check (another thread) then moves the counter
        # past what is recorded as checked, so neither the memo nor a plan takes the check for those values
        hv, dv = version(host_indices), version(device_indices)
        host_values = values(host_indices)
        facts = check_indices(self.spec, host_indices, device_indices, self.binding.device_rows,
                              host_values=host_values, device_values=values(device_indices),
                              unique_host=to_host, unique_device=not to_host)
        if self.validate == "strict":
            self._check_allocated(host_indices)
        memo = not full and hv is not None and dv is not None
        # the storages are held with the memo: a .data swap's freed storage cannot give its address to another
        # one while the memo compares addresses
        self._checked[to_host] = (host_indices, hv, device_indices, dv, pair_where(host_indices, device_indices),
                                  (host_indices.untyped_storage(), device_indices.untyped_storage())) if memo else None
        # for the strategy of this call (a copy plan need not read the values again)
        self.binding.checked = CheckedPair(host_indices, hv, device_indices, dv, facts)

    def _check_allocated(self, host_indices: torch.Tensor) -> None:
        pages = host_indices.reshape(-1, self.spec.page_size)[:, 0].to("cpu", torch.int64) // self.spec.page_size
        bad = pages[~self.allocator.allocated(pages)]
        if bad.numel():
            raise UnallocatedSlotError(
                f"host_indices name pages {bad.unique()[:4].tolist()} that this pool has not allocated (freed or never "
                "allocated; validate='strict'); use slots from alloc(), or validate='full' when the engine allocates "
                "host slots itself"
            )

    def backup_all_layers(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """D2H: every owned layer's rows ``device_indices`` -> host slots ``host_indices``."""
        lane = self._lanes[1]
        if lane is not None and lane(None, host_indices, device_indices):
            return
        self._transfer(host_indices, device_indices, None, to_host=True)

    def backup_layer(self, layer_id: int, host_indices: torch.Tensor, device_indices: torch.Tensor) -> bool:
        """D2H of one device layer.  Returns ``False`` (moving nothing) when this rank does not own it."""
        lane = self._lanes[1]
        if lane is not None and layer_id.__class__ is int and lane(layer_id, host_indices, device_indices):
            return True
        return self._transfer(host_indices, device_indices, check_layer(self.spec, layer_id), to_host=True)

    def load_layer(self, layer_id: int, host_indices: torch.Tensor, device_indices: torch.Tensor) -> bool:
        """H2D of one device layer.  Returns ``False`` (moving nothing) when this rank does not own it."""
        lane = self._lanes[0]
        if lane is not None and layer_id.__class__ is int and lane(layer_id, host_indices, device_indices):
            return True
        return self._transfer(host_indices, device_indices, check_layer(self.spec, layer_id), to_host=False)

    def load_all_layers(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """H2D: every owned layer."""
        lane = self._lanes[0]
        if lane is not None and lane(None, host_indices, device_indices):
            return
        self._transfer(host_indices, device_indices, None, to_host=False)

    def _transfer(self, host_indices: torch.Tensor, device_indices: torch.Tensor, layer: int | None, *,
                  to_host: bool) -> bool:
        """Check the indices, then move ``layer`` (``None``: every owned layer) in the direction ``to_host`` says;
        ``False`` (moving nothing) where this rank does not own ``layer``."""
        try:
            self._check(host_indices, device_indices, to_host=to_host)
            if layer is not None and not self.spec.layer_map.owns(layer):
                return False
            if not host_indices.numel():  # no pair: nothing to move (a strategy never sees an empty call)
                return True
            move = self.strategy.backup if to_host else self.strategy.load
            move(self.binding, host_indices, device_indices, layer)
            return True
        finally:
            self.binding.checked = None  # what the check read is for this call's strategy alone (a failed check too)

    # -- page views for storage tiers ---------------------------------------------
    def _check_page(self, page: int) -> int:
        """``page`` as a plain int, checked against the pool (any integer type: ``operator.index``)."""
        number = None
        if not isinstance(page, (bool, torch.Tensor)) and hasattr(page, "__index__"):
            try:
                number = operator.index(page)
            except TypeError:  # a numpy array of one element has __index__ but refuses it
                number = None
        if number is None or not 0 <= number < self.spec.num_pages:
            raise HostBufferError(f"page must be an int in 0..{self.spec.num_pages - 1} (a host slot // page_size), got "
                                  f"{type(page).__name__} {page!r}")
        page = number
        if self.validate == "strict" and not bool(self.allocator.allocated(torch.tensor([page]))[0]):
            raise UnallocatedSlotError(f"page {page} is not allocated in this pool (freed or never allocated; "
                                       "validate='strict'); use pages of slots from alloc()")
        return page

    def page_pointers(self, page: int) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of every contiguous host block of ``page``, segment by segment."""
        page = self._check_page(page)
        out = []
        for flat, stride, blocks in self._page_segments:
            base = flat.data_ptr() + page * stride
            out += [(base + off, n) for off, n in blocks]
        return out

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across every segment and host layer."""
        return sum(n for _, _, blocks in self._page_segments for _, n in blocks)

    def _synchronize(self) -> None:
        if self.spec.device.type == "cuda":
            torch.cuda.synchronize(self.spec.device)

    def get_page(self, page: int, *, synchronize: bool = False) -> torch.Tensor:
        """A copy of ``page``'s bytes, flat uint8 (blocks in :meth:`page_pointers` order).

        The host bytes are read now: a backup still queued on a stream is not seen.
        ``synchronize=True`` first waits for all work on the pool's device
        (``torch.cuda.synchronize``); otherwise synchronise the backup's stream yourself.
        """
        page = self._check_page(page)
        if synchronize:
            self._synchronize()
        parts = []
        for flat, stride, blocks in self._page_segments:
            base = page * stride
            parts += [flat[base + off : base + off + n] for off, n in blocks]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)

    def _overlaps_host(self, flat: torch.Tensor) -> bool:
        """Whether the contiguous byte tensor ``flat`` shares memory with a host buffer."""
        lo = flat.data_ptr()
        hi = lo + flat.numel()
        for t in self.binding.host_buffers.values():
            if t.numel():
                start = t.data_ptr()
                if lo < start + t.numel() * t.element_size() and start < hi:
                    return True
        return False

    def set_page(self, page: int, data: torch.Tensor, *, synchronize: bool = False) -> None:
        """Write a flat page (as :meth:`get_page` returns it) back into ``page``.

        The host bytes are written now: a load of this page still queued on a
        stream may read old or new bytes.  ``synchronize=True`` first waits for all
        work on the pool's device; otherwise synchronise the load's stream yourself.
        """
        page = self._check_page(page)
        if (not isinstance(data, torch.Tensor) or data.device.type != "cpu" or data.layout != torch.strided
                or data.is_quantized or data.numel() * data.element_size() != self.page_bytes):
            raise HostBufferError(f"data must be a dense (strided, not quantized) CPU tensor of {self.page_bytes} bytes "
                                  "(page_bytes)")
        if data.is_conj() or data.is_neg():
            data = data.resolve_conj().resolve_neg()  # a lazy view: its bytes are not yet what it reads as
        if synchronize:
            self._synchronize()
        flat = data.contiguous().view(-1).view(torch.uint8)  # a strided or expanded tensor: its bytes in order
        if self._overlaps_host(flat):  # a view of host memory: the blocks written first would change what is read
            flat = flat.clone()
        pos = 0
        for host, stride, blocks in self._page_segments:
            base = page * stride
            for off, n in blocks:
                host[base + off : base + off + n].copy_(flat[pos : pos + n])
                pos += n
