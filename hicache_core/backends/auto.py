"""``auto``: the copy engine where its blocks are large enough, else the layout's kernel.

Per pool, both candidates are prepared on the pool's buffers: the core's
``direct`` (copy engine, plain or staged) and whatever serves
``(layout, "kernel", sharded)`` in the registry that resolved ``auto``.  Per call, ``auto``
asks ``direct`` which copy blocks it would submit for these indices and layer
(memoised with the plan) and compares the smallest with the calibrated threshold
of the direction (:mod:`hicache_core.calibration`), and whether the host can
feed it: the estimated host time of the call (per descriptor, per runtime call,
and per relayout launch of a staged route) must fit in the call's transfer time
at link speed (backups: ``backup_room`` times it, 1.2 by default), at the calibration's
costs with a margin, or, where the pool has measured its host (:mod:`.pace`), at the host's current pace.  Then the copy engine serves the call (no SM held, so the forward pass
keeps the GPU); otherwise the kernel does.  With only one candidate available, that one serves.

One exception, for loads of one layer: when the kernel candidate loads that layer through its fast load paths
only (its optional ``fast_load(binding, layer, n)`` says so: TMA or whole-page loads of the row-copy kernels,
which reach the link within microseconds at no measurable cost to a GEMM beside them)
and nothing ``auto`` queued on the stream may still be running nor did its last call end within
:data:`~.memcpy.TIGHT_GAP_US` (50 us; a lone load, such as the first layer a forward pass waits for, not one of a loop
of calls),
the kernel serves it: it reaches the link within microseconds, where the copy
engine's lone loads start slower (H200: 0.88-0.91 of memcpy against 0.68-0.90).  The loads that follow while
it runs (the rest of a burst) go as above, to the copy engine where its blocks are large.

What the forward pass beside the loads is bound by (option ``forward``, or ``$HICACHE_AUTO_FORWARD``) moves the line
for loads.  ``compute`` (the default: a prefill's GEMMs, where a kernel's loads run at their idle speed and cost the
model next to nothing) weighs the two routes at their idle speeds.  ``memory`` (decode-heavy forward passes, e.g.
chunked prefill mixing decode steps into the batch, whose attention reads the KV cache at the memory's speed): there
SM-driven loads keep only about :data:`MEMORY_KERNEL_SHARE` of their idle speed while the copy engine's keep nearly
all of theirs, so the copy engine takes a load while the host submits it within ``1 / MEMORY_KERNEL_SHARE`` times
the time that suffices with ``compute``, and lone loads follow the same rule (no lone-load exception).  ``watch``
decides between the two as it goes, from the speed of its lone kernel loads (:class:`~.forward.ForwardWatch`:
``memory`` from a timing under :data:`~.forward.SLOW_SHARE` of the link until one at :data:`~.forward.FAST_SHARE` or
more, with the room that slowdown gives (:meth:`~.forward.ForwardWatch.room`), at least ``memory``'s fixed one; then
one lone load per :data:`~.forward.RENEW_S` goes to the kernel to renew that verdict; while it says compute every
lone kernel load is timed); it needs the lone-load rule (a CUDA pool whose kernel has fast load paths), and
elsewhere acts as ``compute``.  Backups are decided alike in every mode (the copy engine is the quiet route beside
either kind of work).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, cast

import torch

from ..binding import PoolBinding
from ..calibration import DEFAULT, Calibration, load_calibration
from ..errors import ConfigError, HicacheError
from ..kernel_support import current_device_index, current_stream_handle, index_memos
from ..layout import Layout
from ..replay import Lane
from ..spec import PoolSpec
from ..strategy import Strategy
from .auto_lane import make_lane
from .auto_rules import (ENV_FORWARD, FED_SHARE, FORWARD_MODES, MEMORY_KERNEL_SHARE, SLOW_KERNEL_ROOM, allowed_us,
                         backup_room_option, fed, kernel_room, pick_key, worth_measuring)
from .cudart import batch_calls, schedule_calls
from .direct import DirectStrategy
from .forward import ForwardWatch
from .memcpy import BatchCopier, QueueClock
from .pace import MIN_OPS, MODEL_CALL_US, STALE_S, HostPace
from .plans import PlanCache
from .reprobe import Reprobe
from .staging import page_image

if TYPE_CHECKING:
    from ..registry import Registry

__all__ = ["AutoStrategy", "FORWARD_MODES", "ENV_FORWARD", "MEMORY_KERNEL_SHARE", "FED_SHARE", "host_measures"]

logger = logging.getLogger(__name__)


def _kernel_for(registry: Registry | None, spec: PoolSpec, layout: Layout,
                options: dict[str, Any]) -> tuple[Strategy | None, str]:
    from ..registry import default_registry

    reg = registry if registry is not None else default_registry()
    errors: list[Exception] = []
    try:
        res, rejected = reg.try_resolve(spec, layout.name, "kernel", options=options or None, errors=errors)
        if res is None and options and errors:
            # a kernel factory that takes no such keyword, or a kernel that loads without the options and fails with
            # them: the options are wrong (a misspelt auto option lands here too, whether or not a kernel could serve
            # this pool); never serve such a pool without its kernel, silently
            bad: Exception | None = next((e for e in errors if isinstance(e, TypeError) and "keyword argument" in str(e)),
                                         None)
            plain = None
            if bad is None:
                plain, _ = reg.try_resolve(spec, layout.name, "kernel")
                bad = errors[0] if plain is not None else None
            if bad is not None:
                raise ConfigError(
                    f"auto's option(s) {sorted(options)} (not auto's own: {', '.join(AUTO_OPTIONS)}) go to the kernel "
                    f"strategy{'' if plain is None else ' ' + repr(plain.info.name)}, which refused them "
                    f"({type(bad).__name__}: {str(bad).splitlines()[0]}); fix the name or the value")
        if res is None and options:
            if not reg.candidates(layout.name, "kernel", spec.sharded):  # nothing could ever take them: a mistake
                raise ConfigError(
                    f"auto's option(s) {sorted(options)} are not auto's own ({', '.join(AUTO_OPTIONS)}), and no kernel "
                    f"strategy is registered for layout {layout.name!r} to take them; fix the name or drop them")
            # a kernel that takes them but cannot serve this pool (e.g. a CPU pool outside Triton's interpreter)
            logger.info("hicache auto: no kernel serves this pool; its options %s are not used", sorted(options))
    except HicacheError as exc:  # e.g. that registry does not know this layout
        if isinstance(exc, ConfigError):
            raise
        return None, f"no kernel resolves: {str(exc).splitlines()[0]}"
    if res is None:
        why = "; ".join(f"{n}: {w}" for n, w in rejected) or f"no kernel strategy is registered for {layout.name!r}"
        return None, why
    return res.strategy, res.info.name


#: :class:`AutoStrategy`'s own options (every other keyword goes to the kernel strategy's factory).
AUTO_OPTIONS = ("staging", "staging_bytes", "pitched", "lone", "pace", "forward", "prefetch", "backup_room", "reprobe")

#: Recent decisions kept per pool.  A decision only chooses between two correct strategies, so a
#: stale one (an index tensor freed and another made at the same address) costs speed, never bytes;
#: per-layer calls of a batch (same index tensors, one layer each) share the decision of the first.
_PICKS = 16
#: (layer, count) answers of the kernel's ``fast_load`` kept per pool.
_FAST_MEMO = 256
#: Index pairs whose calls are counted per pool (:meth:`AutoStrategy._use`).
_USES = 32
#: Stands for an absent measure in :meth:`AutoStrategy.lane` (never sampled: generation 0, never aged).


def host_measures(binding: PoolBinding, copier: BatchCopier | None) -> tuple[tuple[HostPace, HostPace] | None,
                                                                             tuple[HostPace, HostPace] | None]:
    """The copier's measures of the host that ``auto`` reads on ``binding``: of calls that planned their descriptors
    and of calls that reused a plan (``None``: not measured; see :attr:`AutoStrategy.paces`).  Where the pool makes a
    plan per call (``validate="full"``/``"strict"``: its index memos are off, so no plan outlives its call) no call
    reuses a plan and the second measure never gets a sample: the planning calls' measure then judges every pair
    (a reused pair judged at a measure that never forms would stay on the copy engine, the route of its probe,
    however slow the host)."""
    if copier is None:
        return None, None
    return copier.paces, (copier.warm_paces if index_memos(binding)[0].enabled else None)


class AutoStrategy:
    """Picks ``direct`` or the layout's ``kernel`` per call (see the module docstring).

    :param staging, staging_bytes, pitched: passed to :class:`DirectStrategy`.
    :param lone: send a lone one-layer load to a kernel whose fast load paths take the layer (the module docstring);
        ``False`` keeps the block-size rule for every call (default: ``True`` unless ``forward="memory"``; a
        calibration that measured this machine's kernel loads slow turns the default off, but for ``forward="watch"``:
        :meth:`drops_lone`).
    :param pace: on CUDA pools, let the host's measured submission speed (the copier's :class:`~.pace.HostPace` of
        the call's direction) send calls to the copy engine that the calibrated margin alone would give the kernel
        (:func:`~.auto_rules.fed`), measuring it where no recent measure exists (:meth:`pick`); ``False``: the calibration
        alone decides.
    :param forward: what the forward pass beside the loads is bound by, ``compute`` or ``memory``, or ``watch`` to
        tell from timed lone loads (the module docstring; default: ``$HICACHE_AUTO_FORWARD`` or ``compute``).
    :param prefetch: on CUDA pools, start reading a new index pair's GPU-resident device indices back at its first
        decided load, before that load is queued (:meth:`~.plans.PlanCache.read_early`), so that a copy plan made
        later in the burst waits for that read only, not for the loads queued since; costs a small device copy and
        a host copy per new pair.  Off by default (measured on an H100 host: no effect, no stalls to remove).
    :param reprobe: where a burst of one-layer loads with reused indices goes to the kernel because the host was
        measured too slow for the copy engine, watch the kernel's own calls and measure the host again as soon as they
        show it sped up, instead of when that measure ages (:mod:`.reprobe`).  The kernel's calls are timed in the
        pool's lane only (none with ``HICACHE_LANES=0``, nor for a kernel without a lane: there the measure ages as
        without the option).  No effect where nothing measures the host: with ``pace=False``, on a CPU pool, or with
        ``validate="full"``/``"strict"`` (no plan is reused there).  Off by default: on an H200 host it measured no
        effect beyond noise.
    :param backup_room: how many times its transfer time at link speed a backup's submission may take and still go
        to the copy engine (default: ``$HICACHE_AUTO_BACKUP_ROOM`` or :data:`~.auto_rules.BACKUP_ROOM`, 1.2: the
        forward pass first; 1.0: the backup's speed first, where a host-bound copy engine falls behind the kernel).
    :param kernel_options: other keywords (e.g. ``programs``) go to the kernel strategy's factory.
    """

    def __init__(self, staging: str | None = None, staging_bytes: int | None = None, pitched: str | None = None,
                 lone: bool | None = None, pace: bool = True, forward: str | None = None, prefetch: bool = False,
                 backup_room: float | None = None, reprobe: bool = False, **kernel_options: Any) -> None:
        raw, where = (forward, "auto's forward option") if forward is not None else \
            (os.environ.get(ENV_FORWARD, ""), ENV_FORWARD)
        mode = str(raw).strip().lower() or "compute"
        if mode not in FORWARD_MODES:
            raise ConfigError(f"{where} is {raw!r}: use one of {', '.join(FORWARD_MODES)} (what the forward pass "
                              "beside the loads is bound by)")
        #: What the forward pass beside the loads is bound by (``compute`` or ``memory``), or ``watch``.
        self.forward = mode
        #: How many times its transfer time a backup's submission may take and still go to the copy engine.
        self.backup_room = backup_room_option(backup_room)
        #: Whether the lone-load rule is on by default here (``lone`` not passed, ``forward`` other than ``memory``):
        #: only then may a calibration that measured slow kernel loads drop it (:meth:`drops_lone`).
        self._lone_by_default = lone is None and mode != "memory"
        if lone is None:
            lone = mode != "memory"
        for name, value in (("lone", lone), ("pace", pace), ("prefetch", prefetch), ("reprobe", reprobe)):
            if not isinstance(value, bool):
                raise ConfigError(f"auto's {name} option must be True or False, got {value!r}")
        if mode == "watch" and not lone:
            raise ConfigError("auto's forward='watch' times lone loads through the kernel: it needs lone=True")
        #: With ``forward="watch"`` on a pool that keeps the lone-load rule: the verdict from timed lone loads.
        self.watch: ForwardWatch | None = None
        self._watch_gen = 0
        self.lone, self.use_pace, self.prefetch, self.reprobe = lone, pace, prefetch, reprobe
        #: With ``reprobe``, on a pool that measures the host: the watch on the kernel route's calls.
        self.reprobe_watch: Reprobe | None = None
        #: Early reads started for new index pairs (``prefetch``; for tests and benchmarks).
        self.early_reads = 0
        self._direct_factory = lambda: DirectStrategy(staging=staging, staging_bytes=staging_bytes, pitched=pitched)
        self._kernel_options = kernel_options
        self.direct: DirectStrategy | None = None
        self.kernel: Strategy | None = None
        self.kernel_name = ""
        self.calibration: Calibration | None = None
        #: The room the calibration's measure of the kernels' load bursts gives loads (:func:`~.auto_rules.kernel_room`;
        #: 1 until :meth:`prepare`, and where the pool has no kernel).
        self.kernel_room = 1.0
        self._registry: Registry | None = None
        # (host id, version, device id, version, length, all layers?, to_host) -> pick, a few recent ones
        self._picks: dict[tuple, Strategy] = {}
        #: What this strategy queued per stream (both candidates' transfers), to tell a lone load from a burst.
        self.clock = QueueClock()
        #: Loads of one layer sent to the kernel because the stream was idle (for tests and benchmarks).
        self.lone_kernel_loads = 0
        self._token_bytes = self._layer_token_bytes = 0
        self._clocked = False
        self._index = 0  # the pool's CUDA device (when clocked)
        self._fast_memo: dict[tuple[int, int], bool] = {}
        #: The direct candidate's measures of the host by direction (index: ``to_host``; ``None``: not used): of calls
        #: that planned their descriptors (``paces``) and of calls that reused a plan (``warm_paces``; ``None``: the
        #: former serve for both, as on a pool that plans every call: :func:`host_measures`).
        self.paces: tuple[HostPace, HostPace] | None = None
        self.warm_paces: tuple[HostPace, HostPace] | None = None
        #: By direction (index: ``to_host``): the sum of that direction's measures' generations the memoised picks of
        #: that direction were decided at (a backup measure that moved decides no load again, nor the reverse).
        self._pace_gen = [0, 0]
        #: Pick key -> [calls, host indices, device indices]: how often an index pair was used (the tensors are held,
        #: so no other tensor takes their ids while they are counted).
        self._uses: dict[tuple, list[Any]] = {}
        self._layers = 1  # the pool's owned layers: one-layer calls of one pair in a burst
        #: Calls sent to the copy engine to measure the host (for tests and benchmarks).
        self.pace_probes = 0
        #: Decisions made (calls not served by a memoised pick; for tests and benchmarks).
        self.decisions = 0
        #: Positions -> (copy blocks, bytes, when: the clock's time) of the last one-layer load planned for that many
        #: positions.
        self._load_blocks: dict[int, tuple[int, int, float]] = {}

    @property
    def room(self) -> float:
        """How many times the transfer time at link speed a load's submission may take now (:func:`~.auto_rules.fed`'s ``room``):
        1 beside compute, ``1 / MEMORY_KERNEL_SHARE`` with ``forward="memory"``, and with ``"watch"`` what the
        watch measured (:meth:`ForwardWatch.room <.forward.ForwardWatch.room>`); at least :attr:`kernel_room`, what
        the calibration's measure of this machine's kernel loads gives (:func:`~.auto_rules.kernel_room`)."""
        if self.forward == "memory":
            base = 1.0 / MEMORY_KERNEL_SHARE
        else:
            base = self.watch.room() if self.watch is not None else 1.0
        return max(base, self.kernel_room)

    def kernel_room_of(self, cal: Calibration) -> float:
        """The room ``cal``'s measure of the kernels' load bursts gives this pool's loads
        (:func:`~.auto_rules.kernel_room`): 1 where there is no decision to make (no kernel, or no copy engine)."""
        return kernel_room(cal) if self.kernel is not None and self.direct is not None else 1.0

    def drops_lone(self, room: float) -> bool:
        """Whether a kernel room of ``room`` drops the lone-load rule: from :data:`~.auto_rules.SLOW_KERNEL_ROOM`, where
        the rule is on by default (an explicit ``lone=True`` keeps it; ``forward="watch"`` times lone loads itself)."""
        return room >= SLOW_KERNEL_ROOM and self._lone_by_default and self.forward != "watch"

    def use_registry(self, registry: Registry) -> None:
        """Resolve the kernel candidate in ``registry`` (the one resolving this strategy), not the default."""
        self._registry = registry

    def supports(self, spec: PoolSpec, layout: Layout) -> str | None:
        direct = self._direct_factory()
        why_direct = direct.supports(spec, layout)
        kernel, why_kernel = _kernel_for(self._registry, spec, layout, self._kernel_options)
        if why_direct is not None and kernel is None:
            return f"neither candidate serves: direct: {why_direct}; kernel: {why_kernel}"
        self.direct = direct if why_direct is None else None
        self.kernel = kernel
        self.kernel_name = why_kernel if kernel is not None else ""
        return None

    def prepare(self, binding: PoolBinding) -> None:
        if self.direct is None and self.kernel is None:
            self.supports(binding.spec, binding.layout)
        if self.direct is not None:
            self.direct.prepare(binding)
        if self.kernel is not None:
            try:
                self.kernel.prepare(binding)
            except Exception as exc:  # e.g. unpinned host buffers, a Triton that fails to import: direct still serves
                if self.direct is None or getattr(exc, "setting", None):
                    raise  # a setting's bad value (HICACHE_KERNEL_PROGRAMS='-3'): fixed, not silently routed around
                logger.warning("hicache auto: the kernel cannot serve this pool (%s); using direct only",
                               str(exc).splitlines()[0])
                self.kernel, self.kernel_name = None, ""
        self.calibration = load_calibration(binding.device)
        self.kernel_room = self.kernel_room_of(self.calibration)
        if self.lone and self.drops_lone(self.kernel_room):
            # the kernel's lone loads win only at its usual speed; watch times them itself
            logger.info("hicache auto: the calibration measured this machine's kernel loads at %.2f of memcpy: loads "
                        "take the copy engine with %.2fx room, lone loads included", self.calibration.kernel_load_ratio,
                        self.kernel_room)
            self.lone = False
        copier = binding.scratch.get("direct.copier") if self.direct is not None else None
        if not (self.use_pace and binding.device.type == "cuda" and isinstance(copier, BatchCopier)):
            copier = None  # nothing measured: the calibration alone decides
        self.paces, self.warm_paces = host_measures(binding, copier)
        self.reprobe_watch = Reprobe(now=self.clock.now) if self.reprobe and self.warm_paces is not None else None
        self._arm(binding)
        logger.debug("auto for %s: direct=%s kernel=%s calibration=%s", binding.layout.name,
                     self.direct is not None, self.kernel_name or None, self.calibration)

    def pick(self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor,
             layer: int | None, *, to_host: bool) -> Strategy:
        """The candidate that serves this call.

        Decided once per index pair, direction and kind of call (one layer or all): the per-layer
        calls of a batch reuse the first decision instead of sizing a copy plan each
        (:data:`_PICKS`); an in-place change of an index tensor decides again, and so does every call after the
        host's measured pace in the call's direction moved (a new :attr:`HostPace.generation
        <.pace.HostPace.generation>`; the other direction's picks stay).  Where the
        calibrated margin refuses the copy engine but a host at the calibration's per-descriptor cost would feed a
        burst of the call, and no recent measure of the host exists in that direction, the copy engine serves the
        call so that its submissions measure the host (its first few: a new measure then decides again).  Where the layout
        alone bounds the call's smallest copy block below the calibrated size (:meth:`_block_bound`:
        one layer of a token-major page, or the rope rows of a split page), the kernel is picked
        without looking at index values, so device-resident indices are never read back for it; so it is
        where the host indices alone show a one-layer call too many copy blocks for the host to feed
        (:meth:`_least_blocks`: a new batch's copy plan would cost the burst a device read and the host
        hundreds of microseconds, only to be refused).

        The measure that judges a call: for a new index pair, the host's pace of calls that planned their
        descriptors (a serving loop's new batches); for a pair used beyond one burst (more calls than the pool owns
        layers, or a second all-layer call), that of calls that reused a plan (:attr:`warm_paces`).  A pair memoised
        to the kernel is decided again at its first reuse, so indices reused batch after batch are not held to the
        pace of their first burst (which planned every layer).
        """
        if self.kernel is None:
            assert self.direct is not None
            return self.direct
        if self.direct is None:
            return self.kernel
        paced, watched = self._pace_moved(to_host), self._watch_moved()
        if paced or watched:  # the host's speed moved, a measure aged, or the forward pass changed: decide again
            held = self._held(binding)
            # a measure decides its own direction's picks: the other direction's stay, unless the verdict moved.
            # Dropped in place (lanes hold this dict), never copied back: another thread's drop meanwhile (its own
            # measure, or _use forgetting the tensors) is not undone
            for old in list(self._picks):
                if (watched or old[6] == to_host) and old not in held:
                    self._picks.pop(old, None)
        key = pick_key(host_indices, device_indices, layer, to_host)
        early = self.prefetch and not to_host and layer is not None and key is not None and key not in self._uses
        reused, crossed = self._use(key, host_indices, device_indices, layer)
        hit = self._picks.get(key) if key is not None else None
        if hit is not None and not (crossed and hit is self.kernel):
            return hit
        gens = (self._pace_gen[to_host], self._watch_gen)
        if self.reprobe_watch is not None and not to_host:
            self.reprobe_watch.disarm()  # a load decided again: armed anew below only where a slow host gives it the kernel
        pick = self._decide(binding, host_indices, device_indices, layer, to_host, reused, early)
        # memoised only if nothing another thread did while deciding made it stale: dropped the picks because a
        # measure or the watch moved (this pick read the old one), or dropped the use counts (its tensors with them)
        if key is not None and (self._pace_gen[to_host], self._watch_gen) == gens and key in self._uses:
            if len(self._picks) >= _PICKS:
                self._picks.clear()
            self._picks[key] = pick
        return pick

    def _pace_moved(self, to_host: bool) -> bool:
        """Restart a measure of ``to_host``'s direction that aged (a new one starts with the next calls); whether that
        direction's measures' generations moved since its memoised picks were decided (then they are decided again)."""
        gen = 0
        for group in (self.paces, self.warm_paces):
            if group is not None:
                if group[to_host].aged():
                    group[to_host].reset()
                gen += group[to_host].generation
        if gen == self._pace_gen[to_host]:
            return False
        self._pace_gen[to_host] = gen
        return True

    def _held(self, binding: PoolBinding) -> dict[tuple, Strategy]:
        """The memoised picks that stay when the rest are decided again, beside a forward pass that may be bound by
        memory (``forward`` other than ``compute``): the kernel's, for index pairs within their first burst that live
        on the GPU and have no copy plan yet.  Moving such a pair to the copy engine mid-burst would plan it, and
        reading its indices back waits for every load queued before (H200, fp8 rows with new indices every batch
        beside a memory-bound reduction: one such call took 22-33 ms, while the rest of the burst ran on the kernel at
        0.09 of memcpy)."""
        if not (self.forward == "memory" or self.watch is not None) or not self._picks:
            return {}
        plans, stream = self._plans(binding)
        held = {}
        for key, pick in list(self._picks.items()):  # a snapshot: another thread's pick() may add to it
            entry = self._uses.get(key)
            if pick is not self.kernel or entry is None or entry[0] >= (1 if key[5] else self._layers):
                continue  # not the kernel's, or its first burst is over
            _, h, d = entry
            if h.device.type == "cpu" and d.device.type == "cpu":
                continue  # planning reads nothing back from the GPU
            if plans is not None and plans.peek(h, d, stream) is not None:
                continue  # planned already: nothing to read back
            if plans is not None and h.device.type == "cpu" and (early := plans.early_of(d, stream)) is not None \
                    and early.ready():
                continue  # its early read has landed: planning waits for nothing
            held[key] = pick
        return held

    @staticmethod
    def _plans(binding: PoolBinding) -> tuple[PlanCache | None, int]:
        """The ``direct`` candidate's plan cache on ``binding`` (``None`` before it prepared one) and the stream its
        plans are keyed by."""
        copier = binding.scratch.get("direct.copier")
        return binding.scratch.get("direct.plans"), copier.stream() if copier is not None else 0

    def _read_early(self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """``prefetch``: start reading a new pair's GPU-resident device indices back (:meth:`.plans.PlanCache.read_early`)
        where its host indices live on the CPU (else planning waits for the stream to read those anyway) and it has
        no plan yet."""
        if host_indices.device.type != "cpu" or self.direct is None:
            return
        plans, stream = self._plans(binding)
        if plans is None or plans.peek(host_indices, device_indices, stream) is not None:
            return
        if plans.read_early(device_indices, stream) is not None:
            self.early_reads += 1

    def _watch_moved(self) -> bool:
        """Whether the watch's verdict changed since the memoised picks were decided."""
        if self.watch is None:
            return False
        gen = self.watch.generation
        if gen == self._watch_gen:
            return False
        self._watch_gen = gen
        return True

    def _use(self, key: tuple | None, host_indices: torch.Tensor, device_indices: torch.Tensor,
             layer: int | None) -> tuple[bool, bool]:
        """Count a call of ``key``: whether its index pair is reused (more calls than one burst makes: one per owned
        layer for one-layer calls, one for all-layer calls) and whether this call is the first such."""
        if key is None:
            return False, False
        entry = self._uses.get(key)
        if entry is None:
            if len(self._uses) >= _USES:
                self._uses.clear()
                self._picks.clear()  # in place (lanes hold it): no pick outlives the count of its tensors
            entry = self._uses[key] = [0, host_indices, device_indices]
        entry[0] += 1
        limit = 1 if layer is None else self._layers
        return entry[0] > limit, entry[0] == limit + 1

    def _decide(self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor,
                layer: int | None, to_host: bool, reused: bool, early: bool = False) -> Strategy:
        """The candidate for a call not memoised (:meth:`pick`); ``reused``: judged at the host's pace of calls that
        reuse their plans (:attr:`warm_paces`), else at that of calls that plan; ``early``: a new pair's first load
        with ``prefetch`` (its device indices start back unless the layout alone gives the call to the kernel)."""
        assert self.direct is not None and self.kernel is not None
        self.decisions += 1
        paces = self.warm_paces if reused and self.warm_paces is not None else self.paces
        pace = paces[to_host] if paces is not None else None
        desc_us = pace.fresh() if pace is not None else None
        # reprobe: the measure to watch where it refuses the copy engine a reused pair's one-layer load (_slow)
        watch = pace if (self.reprobe_watch is not None and desc_us is not None and paces is self.warm_paces
                         and layer is not None and not to_host) else None
        cal = self.calibration
        assert cal is not None
        if self._block_bound(binding, layer) < cal.min_block(to_host):
            return self.kernel  # some copy block is certainly too small: decided without the index values (no sync)
        if early:  # a plan may come (now or later in the burst): its device read need not wait for the queued loads
            self._read_early(binding, host_indices, device_indices)
        least = self._least_blocks(binding, host_indices, layer) if layer is not None else None
        if least is not None and not self._may_feed(*least, cal, to_host, pace):
            return self._slow(watch)  # too many blocks for the host whatever the device indices: no plan, no read
        if layer is not None and not to_host and host_indices.device.type != "cpu" and \
                self._refuse_unread(host_indices.numel(), cal, pace) and not self._planned(binding, host_indices,
                                                                                               device_indices):
            return self._slow(watch)  # GPU-resident indices, too many blocks lately for the host: no device read
        sub = self.direct.submission(binding, host_indices, device_indices, layer)
        if layer is not None and not to_host:
            if len(self._load_blocks) >= _PICKS:
                self._load_blocks.clear()
            self._load_blocks[host_indices.numel()] = (sub.count, sub.nbytes, self.clock.now())
        if sub.smallest_block < cal.min_block(to_host):
            return self.kernel
        if fed(sub, cal, desc_us, to_host, self.room, self.backup_room):
            return self.direct
        if pace is not None and desc_us is None and worth_measuring(sub, cal, to_host, self.room, self.backup_room):
            self.pace_probes += 1  # the copy engine serves it to measure the host
            return self.direct
        # a staged or pitched plan is judged at the calibration's costs alone (auto_rules.fed): no measure refused it
        return self._slow(watch if sub.staged is None and sub.pitched is None else None)

    def _slow(self, watch: HostPace | None) -> Strategy:
        """The kernel, for a call the host's pace refused the copy engine; where that was ``watch`` (``reprobe``: a
        fresh measure of reused plans, for a one-layer load), the kernel's calls are watched for a faster host
        (:class:`~.reprobe.Reprobe`).  Where the copy engine could not win at any pace, measuring again after a
        re-probe costs a decision: one with no measure probes only where a host at the calibration's cost would
        feed the call (:func:`~.auto_rules.worth_measuring`)."""
        if watch is not None and self.reprobe_watch is not None:
            self.reprobe_watch.arm(watch)
        return cast(Strategy, self.kernel)  # _decide runs with both candidates

    def _block_bound(self, binding: PoolBinding, layer: int | None) -> float:
        """An upper bound on the *smallest* copy block of any call on ``layer`` (``None``: all layers).

        A copy block is a contiguous host range of one segment: within a page at most the largest
        block of the segment's page image over the selected layers; it can only grow across pages
        where a block ends exactly where a block of the next page starts (then that segment has no
        bound, e.g. one layer of ``[L, S, row]`` over consecutive pages).  Every call copies blocks
        of every selected segment, so its smallest block is at most the least of the segments'
        bounds (a split layout's 64-byte rope rows bound it whatever the indices).  Computed once
        per layer selection, from the layout alone.
        """
        parts = self._parts(binding, layer)
        return min(p[0] for p in parts) if parts else 0.0

    def _parts(self, binding: PoolBinding, layer: int | None) -> tuple[tuple[float, int, bool, int], ...]:
        """Per segment with entries in ``layer``: its block bound (:meth:`_block_bound`), its page image's blocks,
        whether its blocks may continue across pages, and its bytes per token over those entries (memoised)."""
        memo = binding.scratch.setdefault("auto.parts", {})
        key = layer if layer is None else int(layer)
        parts = memo.get(key)
        if parts is None:
            out = []
            for seg in binding.segments:
                entries = seg.entries(layer)
                if not entries:
                    continue
                starts, lens = page_image(seg, [seg.host_layers[e] for e in entries], binding.spec.page_size)
                spans = bool(torch.isin(starts + lens - seg.segment.addressing.page, starts).any())
                out.append((float("inf") if spans else float(lens.max()), int(lens.numel()), spans,
                            seg.width * len(entries)))
            parts = memo[key] = tuple(out)
        return parts

    def _least_blocks(self, binding: PoolBinding, host_indices: torch.Tensor, layer: int) -> tuple[int, int]:
        """For a one-layer call: a lower bound on the plain copy blocks ``direct`` would submit, and the call's bytes,
        with no device index read.

        A segment whose blocks stay in their page submits at least its page image's blocks per page touched (the
        count alone tells how many pages that is at least); one whose blocks may continue into the next page at least
        one block per run of consecutive host slots where the host indices live on the CPU, else at least one (its
        values would have to be read back from the GPU, what this bound is there to spare)."""
        n = host_indices.numel()
        pages = -(-n // binding.spec.page_size)
        runs = -1
        blocks = nbytes = 0
        for _, image_blocks, spans, token_bytes in self._parts(binding, layer):
            if spans:
                if runs < 0:
                    runs = (1 + int((host_indices[1:] - host_indices[:-1] != 1).sum()) if n > 1 else n) \
                        if host_indices.device.type == "cpu" else min(n, 1)
                blocks += runs
            else:
                blocks += pages * image_blocks
            nbytes += token_bytes * n
        return blocks, nbytes

    def _refuse_unread(self, n: int, cal: Calibration, pace: HostPace | None) -> bool:
        """For a one-layer load of ``n`` positions whose host indices live on the GPU: whether the last plan of a load
        of ``n`` positions (its copy blocks and bytes), made within :data:`~.pace.STALE_S`, is too many blocks for the
        host (:meth:`_may_feed` at ``pace``, the measure that judges the call: at its recent pace, or without one at
        the calibration's cost where no measure would start).  Reading the indices back would wait for the work queued
        before the call, and planning a new batch costs the host hundreds of microseconds, only to be refused (H200:
        bursts of MLA loads with new GPU-resident indices every batch went 0.87 of memcpy by the kernel, 0.54-0.59
        through the copy engine; H100 with its own calibration, where no measure starts for 656-byte rows: 0.66 of
        memcpy by ``auto``, a plan each batch, against the kernel's 0.81).  ``False`` where no load of ``n`` positions
        was planned within that time: a refused call plans nothing, so an older verdict (another batch's blocks, maybe
        a host since measured faster) is made again from a plan."""
        last = self._load_blocks.get(n)
        if last is None or self.clock.now() - last[2] > STALE_S:
            return False
        return not self._may_feed(last[0], last[1], cal, False, pace, least=False)

    def _planned(self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor) -> bool:
        """Whether ``direct`` holds a copy plan of this index pair already (deciding it again reads nothing back)."""
        plans, stream = self._plans(binding)
        return plans is not None and plans.peek(host_indices, device_indices, stream) is not None

    def _may_feed(self, blocks: int, nbytes: int, cal: Calibration, to_host: bool, pace: HostPace | None,
                  least: bool = True) -> bool:
        """Whether a plain submission of at least ``blocks`` copy blocks and ``nbytes`` could go to the copy engine
        (:func:`~.auto_rules.fed` at that count at ``pace``, the measure that judges the call, or a measure of the host
        :meth:`pick` would start for it).  The bound holds for a staged route too: it submits the host's page-image
        blocks (at least ``blocks``) after a relayout, so a host measured too slow for ``blocks`` plain descriptors is
        too slow for it (:func:`~.auto_rules.fed` judges a staged submission at the calibration's cost only because
        no measure times it).  ``least``: ``blocks`` is a lower bound (:meth:`_least_blocks`), so a measure may start
        for a plan of :data:`~.pace.MIN_OPS` blocks where the bound is fewer; else a plan's own count."""
        link_us = allowed_us(nbytes, cal, to_host, self.room, self.backup_room)
        desc_us = pace.fresh() if pace is not None else None
        burst_us = schedule_calls(blocks, eager=False) * MODEL_CALL_US
        if desc_us is not None:
            if blocks * desc_us + burst_us <= FED_SHARE * link_us:
                return True
            if not to_host:
                return False  # a recent measure decides loads alone (auto_rules.fed)
        if blocks * cal.submit_us + batch_calls(blocks) * cal.call_us <= link_us:
            return True
        # no measure: one may start (pick) where a host at the calibration's cost would feed a burst, in a call the
        # copier samples (MIN_OPS); a bound below that count stands for a plan that may reach it (least)
        if pace is None or desc_us is not None:
            return False
        m = max(blocks, MIN_OPS) if least else blocks
        return m >= MIN_OPS and m * cal.submit_us + schedule_calls(m, eager=False) * MODEL_CALL_US <= \
            FED_SHARE * link_us

    def describe(self, spec: PoolSpec, layout: Layout) -> list[str]:
        """How ``auto`` decides for ``spec`` in ``layout``, and what it would pick for a call moving every slot of such
        a pool (:func:`.auto_explain.describe`).  For ``hicache explain``."""
        from .auto_explain import describe

        return describe(self, spec, layout)

    def _arm(self, binding: PoolBinding) -> None:
        """Whether this pool keeps the clock (a CUDA pool with both candidates, the kernel with fast load paths), and
        the bytes a call books on it."""
        self._clocked = (self.lone and binding.device.type == "cuda" and self.direct is not None
                         and callable(getattr(self.kernel, "fast_load", None)))
        index = binding.device.index
        self._index = (index if index is not None else current_device_index()) if self._clocked else 0
        self._token_bytes = binding.spec.bytes_per_token  # every owned layer; one layer's on average
        self._layers = max(1, len(binding.spec.layer_map.device_layers))
        self._layer_token_bytes = self._token_bytes // self._layers
        cal = self.calibration or DEFAULT
        self.watch = (ForwardWatch(cal.link_gbps, now=self.clock.now, min_room=1.0 / MEMORY_KERNEL_SHARE)
                      if self.forward == "watch" and self._clocked else None)

    def _serve(self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor,
               layer: int | None, to_host: bool) -> None:
        """The picked candidate's transfer.  Where ``direct`` serves it, its host-pace sample starts when this call
        began: a new pair's plan is made while deciding (:meth:`_decide`), and the planning calls' pace must count
        it as ``direct``'s own calls do."""
        copier = binding.scratch.get("direct.copier")
        since = copier.clock.now() if copier is not None else None
        pick = self.pick(binding, host_indices, device_indices, layer, to_host=to_host)
        if pick is self.direct and since is not None:
            pick.transfer(binding, host_indices, device_indices, layer, to_host=to_host, since=since)
        elif to_host:
            pick.backup(binding, host_indices, device_indices, layer)
        else:
            pick.load(binding, host_indices, device_indices, layer)

    def backup(self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor,
               layer: int | None) -> None:
        clocked = self._clocked
        now = self.clock.now() if clocked else 0.0  # the call's start, as the lane books it: copies start with its
        self._serve(binding, host_indices, device_indices, layer, True)  # first runtime call
        if clocked:  # a backup on the loads' stream delays them too
            self._book(current_stream_handle(self._index), host_indices.numel(), layer, now)

    def load(self, binding: PoolBinding, host_indices: torch.Tensor, device_indices: torch.Tensor,
             layer: int | None) -> None:
        if not self._clocked:
            self._serve(binding, host_indices, device_indices, layer, False)
            return
        now, stream, n = self.clock.now(), current_stream_handle(self._index), host_indices.numel()
        lone, timing = self._lone(binding, layer, n, stream, now)
        if lone:
            self.lone_kernel_loads += 1
            kernel = cast(Strategy, self.kernel)
            if timing:  # the watch times this load (the lane does the same)
                cast(ForwardWatch, self.watch).timed(lambda: kernel.load(binding, host_indices, device_indices, layer),
                                                     n * self._layer_token_bytes, self._index)
            else:
                kernel.load(binding, host_indices, device_indices, layer)
        else:
            self._serve(binding, host_indices, device_indices, layer, False)
        self._book(stream, n, layer, now)

    def _lone(self, binding: PoolBinding, layer: int | None, n: int, stream: int, now: float) -> tuple[bool, bool]:
        """Whether a load of ``layer`` (``None``: all) moving ``n`` positions is a lone one the kernel serves (the
        module docstring), and whether the watch times it; only on a clocked pool.  The lane (:mod:`.auto_lane`) holds
        an inlined copy of this rule (a lone load's launch waits on it): change both together.  With a watch, a lone
        load beside memory-bound work goes by the rule of the rest, but for one whose timing would renew the
        verdict."""
        if not (layer is not None and self.clock.lone(stream, now) and self._fast(binding, layer, n)):
            return False, False
        watch = self.watch
        # due() first: it lands a finished timing before the verdict is read
        timing = watch is not None and watch.due(n * self._layer_token_bytes)
        return timing or watch is None or not watch.memory_bound(), timing

    def _book(self, stream: int, n: int, layer: int | None, now: float) -> None:
        """Put a call of ``n`` positions (one layer, or all) that started at ``now`` on the clock (the lane,
        :mod:`.auto_lane`, inlines it: change both together)."""
        self.clock.queued(stream, n * (self._layer_token_bytes if layer is not None else self._token_bytes), now)

    def lane(self, binding: PoolBinding, to_host: bool) -> Lane | None:
        """The fast path of a repeated call (see :class:`~hicache_core.strategy.Strategy`): the lane of the
        candidate :meth:`load` / :meth:`backup` would send the call to (the kernel for a lone load, else the
        candidate memoised for these index tensors); ``False`` where that candidate has no lane, declines, or no
        decision is memoised.  ``None`` where neither candidate has a lane (:func:`.auto_lane.make_lane`)."""
        return make_lane(self, binding, to_host, current_stream_handle)

    def _fast(self, binding: PoolBinding, layer: int, n: int) -> bool:
        """The kernel's ``fast_load(binding, layer, n)``, memoised per layer and count."""
        key = (layer, n)
        hit = self._fast_memo.get(key)
        if hit is None:
            if len(self._fast_memo) >= _FAST_MEMO:
                self._fast_memo.clear()
            hit = self._fast_memo[key] = bool(getattr(self.kernel, "fast_load")(binding, layer, n))
        return hit
