"""``auto``'s lane: the fast path of a repeated call through :class:`~.auto.AutoStrategy` (its ``lane``).

The lane sends a call to the lane of the candidate ``AutoStrategy.load`` / ``backup`` would pick, with what those
methods decide inlined (the lone-load rule, the measures' check, the memoised pick, the clock's booking): a lone load's
launch waits on every instruction before it.  Any rule changed in :mod:`.auto` changes here too (each inlined piece
names the method it copies); tests/test_direct.py and tests/test_pace.py drive calls through both paths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, cast

import torch

from ..binding import PoolBinding
from ..replay import Lane
from .forward import ForwardWatch
from .memcpy import BatchCopier
from .pace import HostPace

if TYPE_CHECKING:
    from .auto import AutoStrategy

__all__ = ["make_lane"]

#: The measures of a direction with none: a group that never changes.
_STILL = HostPace()


def make_lane(auto: AutoStrategy, binding: PoolBinding, to_host: bool,
              stream_of: Callable[[int], int]) -> Lane | None:
    """``auto.lane(binding, to_host)`` (:meth:`.auto.AutoStrategy.lane`); ``stream_of(device_index)`` reads the
    current stream's handle (``auto`` hands its module's ``current_stream_handle``, looked up per lane made)."""

    def inner(cand: Any) -> Lane | None:
        make = getattr(cand, "lane", None)
        return make(binding, to_host) if callable(make) else None
    k_lane, d_lane = inner(auto.kernel), inner(auto.direct)
    if k_lane is None and d_lane is None:
        return None
    clock, index, picks, clocked, uses = auto.clock, auto._index, auto._picks, auto._clocked, auto._uses
    # this direction's measures, unrolled (an absent group reads as one that never changes): what pick() checks
    # first, at a few attribute reads per call
    measured = auto.paces is not None or auto.warm_paces is not None
    here_c = auto.paces[to_host] if auto.paces is not None else _STILL
    here_w = auto.warm_paces[to_host] if auto.warm_paces is not None else _STILL
    pace_gen, side = auto._pace_gen, int(to_host)
    pace_now = here_c.now if auto.paces is not None else here_w.now  # a copier's measures share its clock
    # where that clock is this strategy's own (both time.perf_counter by default), a clocked lane's reading of it
    # serves the measures' check too: one clock read less per call
    pace_same = clocked and pace_now is clock.now
    direct, kernel, layers = auto.direct, auto.kernel, auto._layers
    queued, layer_bytes, token_bytes = clock.queued, auto._layer_token_bytes, auto._token_bytes
    only = d_lane if kernel is None else k_lane if direct is None else None  # one candidate: no decision
    rp = auto.reprobe_watch if not to_host else None  # reprobe: the kernel route's one-layer loads time the host
    # a lone load's launch waits on everything before it (a lone load is timed from the call): what _lone
    # decides, inlined, with the fast-load answer from its memo
    lone_loads, now_of, lone_at, fast_memo = clocked and not to_host, clock.now, clock.lone, auto._fast_memo
    watch = auto.watch  # with one, lone loads follow its verdict, and those due for timing are timed here too
    # direct's submissions are sampled from this lane's start, as the normal path samples them from the call's
    # (_serve): the host's measured pace through auto holds auto's own time per call
    # (a lane that says it takes them: DirectStrategy's, not a wrapper of the plain three-argument kind)
    copier = binding.scratch.get("direct.copier")
    began = copier.clock.now if getattr(d_lane, "takes_since", False) and isinstance(copier, BatchCopier) \
        else None
    same = began is not None and began is now_of  # one clock: auto's own reading of it serves as the start
    d_since = cast(Callable[..., bool], d_lane)

    def lane(layer: Any, host_indices: torch.Tensor, device_indices: torch.Tensor) -> bool:
        since = began() if began is not None and not (clocked and same) else None
        stream, handed = 0, None  # the stream, read once where clocked, and handed to direct's lane
        if not (isinstance(host_indices, torch.Tensor) and isinstance(device_indices, torch.Tensor)):
            return False
        n = host_indices.numel()
        if clocked:
            now, stream = now_of(), stream_of(index)
            handed = stream
            if same:
                since = now
            if lone_loads and layer is not None and lone_at(stream, now) and (
                    fast if (fast := fast_memo.get((layer, n))) is not None else auto._fast(binding, layer, n)):
                timing = watch is not None and watch.due(n * layer_bytes)
                if timing or watch is None or not watch.memory_bound():
                    if k_lane is None:
                        return False  # load() would send it to the kernel: its normal path
                    if timing:  # the watch times this load (load() does the same)
                        go = cast(ForwardWatch, watch).timed(
                            lambda: k_lane(layer, host_indices, device_indices), n * layer_bytes, index)
                    else:
                        go = k_lane(layer, host_indices, device_indices)
                    if not go:
                        return False  # the kernel's lane declined: the normal path
                    auto.lone_kernel_loads += 1
                    auto._book(stream, n, layer, now)
                    return True
                # beside memory-bound work (the watch's verdict) a lone load goes by the rule of the rest, below
        entry = None
        if direct is None or kernel is None:
            route = only
        elif measured and (here_c.generation + here_w.generation != pace_gen[side]  # aged(), inlined:
                           or ((t := now if pace_same else pace_now()) > here_c.ages_at
                               and here_c.desc_us is not None)
                           or (t > here_w.ages_at and here_w.desc_us is not None)):
            return False  # the host's speed moved, or its measure aged: the normal path decides again
        elif watch is not None and watch.generation != auto._watch_gen:
            return False  # the verdict on the forward pass changed: the normal path decides again
        else:
            try:  # pick_key(), inlined
                key = (id(host_indices), host_indices._version, id(device_indices), device_indices._version, n,
                       layer is None, to_host)
            except RuntimeError:  # a tensor without a version counter: never memoised
                return False
            pick = picks.get(key)
            entry = None if pick is None else uses.get(key)  # type: ignore[arg-type]
            if entry is not None and pick is kernel and entry[0] == (1 if layer is None else layers):
                return False  # the pair's first reuse: pick() decides again at the pace of reused plans
            route = d_lane if pick is direct else k_lane if pick is kernel else None
        if rp is not None and route is not None and route is k_lane and layer is not None:
            t0 = now if clocked else now_of()  # (clocked: read at the lane's start)
            if not route(layer, host_indices, device_indices):
                return False  # the normal path serves (and counts) the call
            rp.record((now_of() - t0) * 1e6)
        elif route is None or not (d_since(layer, host_indices, device_indices, since, handed) if route is d_lane
                                   and since is not None else route(layer, host_indices, device_indices)):
            return False  # the normal path serves (and counts) the call
        if entry is not None:  # counted as pick() counts (_use), once served here
            entry[0] += 1
        if clocked:  # _book, inlined
            queued(stream, n * (layer_bytes if layer is not None else token_bytes), now)
        return True

    return lane
