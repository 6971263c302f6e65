"""The conformance checks, usable from pytest and from ``hicache verify``.

Each check builds the pool under test and a ``reference`` pool on the same
spec and layout, fills host buffers with the same canary bytes and device
buffers with fresh random bytes, then

1. backs up (all layers, or layer by layer) the same slots through both and
   requires the host buffers to be byte-identical (stray writes hit canaries),
   and every row byte of the reference's backup to sit where the plan's
   addressing formula puts it (the binding every backend shares is checked too);
2. loads every device layer id back into *other* device slots (canary-filled)
   through both and requires identical device buffers, with the loaded rows
   equal to the rows originally backed up.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from ..binding import BoundSegment
from ..kernel_support import kernel_unsupported_reason
from ..layout import strided_reach
from ..pool import HostKVPool
from ..registry import LOAD_FAILED, NOT_A_CANDIDATE, Registry
from ..spec import Component, LayerMap, PoolSpec

__all__ = ["Case", "CASES", "INDEX_VARIANTS", "DEVICE_PLACEMENTS", "make_device_buffers", "check_strategy",
           "random_bytes_like"]

CANARY = 0xA5


@dataclass(frozen=True)
class Case:
    """A pool spec factory plus how to shape the device buffers."""

    id: str
    build: Callable[[torch.device], PoolSpec]
    strided: bool = False  # device token axis padded (strided views)
    split_parts: bool = False  # device keeps component parts in separate tensors


def _mla(lmap: LayerMap, ps: int, pages: int, *, dtype=torch.bfloat16, lora=256, rope=32, row_bytes=None, extra=()):
    def build(device: torch.device) -> PoolSpec:
        return PoolSpec.mla(layer_map=lmap, kv_lora_rank=lora, qk_rope_head_dim=rope, dtype=dtype, page_size=ps,
                            capacity=ps * pages, row_bytes=row_bytes, device=device, extra=extra)
    return build


def _mha(lmap: LayerMap, ps: int, pages: int, *, heads=2, hd=8, vd=None, dtype=torch.float16):
    def build(device: torch.device) -> PoolSpec:
        return PoolSpec.mha(layer_map=lmap, head_num=heads, head_dim=hd, v_head_dim=vd, dtype=dtype,
                            page_size=ps, capacity=ps * pages, device=device)
    return build


_IDX = (Component("index_k", 128, torch.uint8, layers=(0, 2)), Component("index_scale", 4, torch.float32, layers=(0, 2)))
#: An extra component of the rows' own width (one launch group with them) on layers 0 and 1 only.
_IDX_LOW = (Component("extra_low", 576, torch.bfloat16, layers=(0, 1)),)

#: Small specs covering kinds, row sizes, dtypes, page sizes and layer maps.
CASES: tuple[Case, ...] = (
    Case("mla576-bf16-ps1", _mla(LayerMap.unsharded(3), 1, 24)),
    Case("mla576-bf16-ps16-strided", _mla(LayerMap.unsharded(2), 16, 4), strided=True),
    Case("mla576-bf16-ps64-splitdev", _mla(LayerMap.unsharded(2), 64, 3), split_parts=True),
    Case("mla656-fp8-ps128", _mla(LayerMap.unsharded(2), 128, 2, dtype=torch.uint8, row_bytes=656)),
    Case("mla576-fp8-ps16-sharded5of2r1", _mla(LayerMap.sharded_cp(5, 2, 1, pad_to_largest=True), 16, 3,
                                               dtype=torch.uint8, lora=512, rope=64)),
    Case("mla576-bf16-ps4-sharded-drafts", _mla(LayerMap.sharded_cp(8, 2, 1, draft_layers=1), 4, 6)),
    Case("mla576-bf16-ps4-sharded5of2r1-padded-drafts",
         _mla(LayerMap.sharded_cp(5, 2, 1, draft_layers=1, pad_to_largest=True), 4, 4)),
    Case("mla-dsa-extra-ps4", _mla(LayerMap.unsharded(3), 4, 5, extra=_IDX)),
    # a context-parallel rank owning none of the layers that hold the extra components (rank 1 of 2 owns 2, 3)
    Case("mla-extra-ps4-sharded4of2r1-none-here", _mla(LayerMap.sharded_cp(4, 2, 1), 4, 5, extra=_IDX_LOW)),
    Case("mha-fp16-ps1", _mha(LayerMap.unsharded(3), 1, 20)),
    Case("mha-bf16-ps16-vdim-strided", _mha(LayerMap.unsharded(2), 16, 3, vd=4, dtype=torch.bfloat16), strided=True),
    Case("mha-fp32-ps64-sharded3of2r0", _mha(LayerMap.sharded_cp(3, 2, 0), 64, 2, hd=4, dtype=torch.float32)),
    Case("mha-fp16-ps128-drafts", _mha(LayerMap.unsharded(2, draft_layers=1), 128, 2, heads=1)),
    # more MHA shapes, so that MHA-only layouts get as much coverage as MLA ones
    Case("mha-bf16-ps8-heads4-strided", _mha(LayerMap.unsharded(2), 8, 3, heads=4, dtype=torch.bfloat16), strided=True),
    Case("mha-fp8-ps16-heads4", _mha(LayerMap.unsharded(2), 16, 2, heads=4, hd=16, dtype=torch.uint8)),
    Case("mha-fp16-ps4-sharded4of2r0-drafts", _mha(LayerMap.sharded_cp(4, 2, 0, draft_layers=1), 4, 4)),
    Case("mha-bf16-ps2-sharded5of2r1-padded-drafts",
         _mha(LayerMap.sharded_cp(5, 2, 1, draft_layers=1, pad_to_largest=True), 2, 6, vd=4, dtype=torch.bfloat16)),
)

#: (id, picks host pages and device slots, index dtype, indices on the pool's device?)
INDEX_VARIANTS: tuple[str, ...] = (
    "shuffled-i64", "one-page-i32", "reversed-i64-dev", "last-page-i32-dev", "strided-view-i64-dev",
    "offset-view-i32-dev",
)


def random_bytes_like(rows: int, nbytes: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (rows, nbytes), dtype=torch.uint8, generator=gen).to(device)


def _device_rows_needed(spec: PoolSpec) -> int:
    # two disjoint device regions (backup source, load target) plus a canary page
    return 2 * spec.capacity + spec.page_size


#: How :func:`make_device_buffers` places a component's layers: one allocation each (``separate``,
#: as SGLang's pools do), or views of one allocation at ascending or descending addresses (evenly
#: spaced layers: the copy engine's pitched copies apply).
DEVICE_PLACEMENTS = ("separate", "one-allocation", "one-allocation-descending")


#: Bytes of :data:`GUARD` before and after each host buffer and device allocation the kit's pools use: a strategy
#: writing past their ends is caught (and, under Triton's CPU interpreter, does not corrupt the test process's memory).
GUARD_BYTES = 4096
GUARD = 0x5A


def _guarded_device_bytes(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (random device bytes) copied into the middle of an allocation with :data:`GUARD_BYTES` of
    :data:`GUARD` on either side (the offset keeps the rows' alignment); the view of the copy."""
    whole = torch.full((rows.numel() + 2 * GUARD_BYTES,), GUARD, dtype=torch.uint8, device=rows.device)
    inner = whole[GUARD_BYTES:GUARD_BYTES + rows.numel()].view(rows.shape)
    inner.copy_(rows)
    return inner


def make_device_buffers(spec: PoolSpec, case: Case, gen: torch.Generator,
                        placement: str = "separate") -> dict[str, list[torch.Tensor | None]]:
    """Random per-layer device tensors for ``spec`` (strided views / split parts as ``case`` asks,
    layers placed as ``placement`` says, one of :data:`DEVICE_PLACEMENTS`).

    Each allocation has :data:`GUARD_BYTES` of :data:`GUARD` before and after its rows, and the padding of a strided
    case's rows holds :data:`GUARD` too: :func:`assert_device_guards_intact` finds a write outside the tensors."""
    if placement not in DEVICE_PLACEMENTS:
        raise ValueError(f"placement={placement!r}: use one of {', '.join(DEVICE_PLACEMENTS)}")
    n = _device_rows_needed(spec)
    out: dict[str, list[torch.Tensor | None]] = {}
    for comp in spec.components:
        layers = set(range(spec.layer_map.num_device_layers) if comp.layers is None else comp.layers)
        pieces = [(p.name, p.nbytes) for p in comp.parts] if case.split_parts and comp.parts else [(comp.name, comp.row_bytes)]
        for name, nbytes in pieces:
            items = nbytes // comp.itemsize
            pad = 3 if case.strided else 0
            width = (items + pad) * comp.itemsize
            owned = sorted(layers)
            if placement == "separate":
                raws = [_guarded_device_bytes(random_bytes_like(n, width, spec.device, gen)) for _ in owned]
            else:
                one = _guarded_device_bytes(random_bytes_like(len(owned) * n, width, spec.device, gen))
                one = one.view(len(owned), n, width)
                order = range(len(owned)) if placement == "one-allocation" else reversed(range(len(owned)))
                raws = [one[k] for k in order]
            for raw in raws:
                raw[:, items * comp.itemsize:] = GUARD  # a strided case's padding: no row byte lives there
            by_layer = dict(zip(owned, raws))
            out[name] = [by_layer[d].view(comp.dtype)[:, :items] if d in by_layer else None
                         for d in range(spec.layer_map.num_device_layers)]
    return out


def clone_buffers(bufs: dict[str, list[torch.Tensor | None]]) -> dict[str, list[torch.Tensor | None]]:
    """Copies of per-layer device tensors with the same strides (``None`` kept)."""
    out: dict[str, list[torch.Tensor | None]] = {}
    for k, lst in bufs.items():
        new: list[torch.Tensor | None] = []
        for t in lst:
            if t is None:
                new.append(None)
                continue
            base = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            base.copy_(t)
            new.append(base)
        out[k] = new
    return out


def _pick_indices(spec: PoolSpec, variant: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host slots, backup device rows, load device rows (disjoint from the backup rows)."""
    ps, pages = spec.page_size, spec.num_pages
    perm = torch.randperm(pages, generator=gen)
    if variant.startswith("one-page"):
        hp = perm[:1]
    elif variant.startswith("last-page"):
        hp = torch.tensor([pages - 1])
    elif variant.startswith("reversed"):
        hp = torch.arange(pages - 1, -1, -1)[: max(1, pages - 1)]
    else:
        hp = perm[: max(1, (pages * 3) // 4)]
    k = hp.numel()
    dev_pages = torch.randperm(2 * pages, generator=gen)
    src_p, dst_p = dev_pages[:k], dev_pages[k : 2 * k]
    offs = torch.arange(ps)
    def expand(p: torch.Tensor) -> torch.Tensor:
        return (p.unsqueeze(1) * ps + offs).reshape(-1)
    return expand(hp), expand(src_p) + ps, expand(dst_p) + ps  # device row < ps is the canary page


def _place(t: torch.Tensor, variant: str, spec: PoolSpec) -> torch.Tensor:
    t = t.to(torch.int32) if "i32" in variant else t.to(torch.int64)
    t = t.to(spec.device) if variant.endswith("-dev") else t
    if "strided-view" in variant:  # a non-contiguous 1-D view, as slicing an engine's index tensor gives
        t = torch.stack([t, torch.full_like(t, -1)], dim=1).reshape(-1)[::2]
        assert not t.is_contiguous()
    if "offset-view" in variant:  # contiguous, but 4 bytes past a 16-byte boundary (kernels specialise on alignment)
        t = torch.cat([torch.full_like(t[:1], -1), t])[1:]
        assert t.data_ptr() % 16
    return t


def guarded_host_buffers(registry: Registry, spec: PoolSpec, layout: str, *, pin_memory: bool
                         ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, int]]]:
    """The layout's host buffers for ``spec``, each a view into a larger allocation with :data:`GUARD_BYTES` of
    :data:`GUARD` on either side, and per buffer ``(the allocation, the buffer's bytes)`` for
    :func:`assert_guards_intact` (a dtype a byte allocation cannot be viewed as gets a plain, unguarded buffer)."""
    buffers: dict[str, torch.Tensor] = {}
    backing: dict[str, tuple[torch.Tensor, int]] = {}
    for b in registry.layout(layout).plan(spec).buffers:
        n = torch.Size(b.shape).numel() * torch.empty((), dtype=b.dtype).element_size()
        whole = torch.empty(n + 2 * GUARD_BYTES, dtype=torch.uint8, pin_memory=pin_memory).fill_(GUARD)
        try:
            buffers[b.name] = whole[GUARD_BYTES:GUARD_BYTES + n].view(b.dtype).view(b.shape)
        except RuntimeError:  # e.g. a quantized dtype
            buffers[b.name] = torch.empty(b.shape, dtype=b.dtype, pin_memory=pin_memory)
            continue
        backing[b.name] = (whole, n)
    return buffers, backing


def assert_guards_intact(what: str, backing: dict[str, tuple[torch.Tensor, int]]) -> None:
    """Raise ``AssertionError`` where a byte before or after a host buffer of :func:`guarded_host_buffers` changed."""
    for name, (whole, n) in backing.items():
        for side, part in (("before", whole[:GUARD_BYTES]), ("after", whole[GUARD_BYTES + n:])):
            bad = (part != GUARD).nonzero().flatten()
            if bad.numel():
                first = GUARD_BYTES - int(bad[-1]) if side == "before" else int(bad[0]) + 1
                raise AssertionError(
                    f"{what}: {bad.numel()} bytes {side} host buffer {name!r} changed (the nearest {first} byte(s) "
                    f"{'before its start' if side == 'before' else 'past its end'}): the strategy wrote out of bounds")


def assert_device_guards_intact(what: str, bufs: dict[str, list[torch.Tensor | None]]) -> None:
    """Raise ``AssertionError`` where a byte of a device allocation of :func:`make_device_buffers` that none of its
    tensors covers (the guard bytes around the rows, a strided row's padding) no longer holds :data:`GUARD`."""
    # per allocation: its bytes, and per tensor on it (name, layer, its bytes as a view or None, their byte span)
    by_storage: dict[int, tuple[torch.Tensor, list[tuple[str, int, torch.Tensor | None, int, int]]]] = {}
    for name, lst in bufs.items():
        for layer, t in enumerate(lst):
            if t is None or not t.numel():
                continue
            storage = t.untyped_storage()
            whole, views = by_storage.setdefault(
                storage.data_ptr(), (torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage), []))
            try:
                u = t.view(torch.uint8)  # rows with a unit last stride (the kit's): their bytes in the allocation
            except RuntimeError:  # not the kit's tensors: no claim about this allocation
                views.append((name, layer, None, 0, whole.numel()))
                continue
            lo, hi = strided_reach(u.shape, u.stride())
            views.append((name, layer, u, int(u.storage_offset()) + lo, int(u.storage_offset()) + hi))
    for whole, views in by_storage.values():
        covered = torch.zeros(whole.numel(), dtype=torch.bool)
        for _, _, rows, _, _ in views:
            if rows is None:
                covered[:] = True
                break
            at = torch.arange(whole.numel(), dtype=torch.int64).as_strided(rows.shape, rows.stride(),
                                                                           rows.storage_offset())
            covered[at.reshape(-1)] = True
        bad = ((whole.cpu() != GUARD) & ~covered).nonzero().flatten()
        if bad.numel():
            first = int(bad[0])
            # the tensor whose rows span the byte (a row's padding), else the nearest one
            name, layer, _, lo, hi = min(views, key=lambda v: max(v[3] - first, first - (v[4] - 1), 0))
            where = (f"{lo - first} byte(s) before its first row" if first < lo else
                     f"{first - hi + 1} byte(s) past its last row's end" if first >= hi else
                     f"byte {first - lo} from its first row's start, in a row's padding")
            raise AssertionError(f"{what}: {bad.numel()} bytes around or between the device rows changed (the first "
                                 f"{where}, of {name}[layer {layer}]): the strategy wrote out of bounds")


def fill_canary(pool: HostKVPool) -> None:
    """Fill every host buffer of ``pool`` with :data:`CANARY` bytes."""
    for t in pool.host_buffers.values():
        t.view(torch.uint8).fill_(CANARY)


def _rows(bufs: dict[str, list[torch.Tensor | None]], idx: torch.Tensor) -> dict[str, list[torch.Tensor | None]]:
    return {k: [None if t is None else t[idx.to(t.device)].clone() for t in lst] for k, lst in bufs.items()}


def _owned_rows(spec: PoolSpec, bufs: dict[str, list[torch.Tensor | None]], idx: torch.Tensor) -> dict[str, list[torch.Tensor | None]]:
    """Rows ``idx`` of the layers this rank owns (``None`` for the others)."""
    owned = set(spec.layer_map.device_layers)
    rows = _rows(bufs, idx)
    return {k: [t if i in owned else None for i, t in enumerate(lst)] for k, lst in rows.items()}


def _byte_offsets(seg: BoundSegment) -> torch.Tensor:
    """For every byte of ``seg``'s host view (``[host layer, page, slot, chunk, byte]``), its offset in the host
    buffer."""
    flat, view = seg.host_flat, seg.host_view
    return torch.arange(flat.numel(), dtype=torch.int64).as_strided(view.shape, view.stride(),
                                                                    view.storage_offset() - flat.storage_offset())


def _where_in_plan(pool: HostKVPool, got: torch.Tensor, want: torch.Tensor) -> str:
    """What the first byte where ``got`` and ``want`` (one host buffer) differ holds in the layout's plan: a segment's
    host layer, page, slot and byte, or no row byte (a canary the transfer should have left alone)."""
    flat_got, flat_want = got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)
    first = int((flat_got != flat_want).nonzero()[0])
    g, w = int(flat_got[first]), int(flat_want[first])
    values = f": 0x{g:02x} where the reference has 0x{w:02x}" + (
        " (the canary: likely never written)" if g == CANARY else
        " (the reference left the canary there: likely a host slot the call did not name was written)"
        if w == CANARY else "")
    places = _row_bytes_at(pool, flat_got.data_ptr(), first)
    if places:
        return f"byte {first} is {places[0]}{values}"
    return f"byte {first} holds no row byte in the plan (a canary a transfer must leave alone){values}"


def _row_bytes_at(pool: HostKVPool, buffer_ptr: int, byte: int) -> list[str]:
    """Every row byte of the layout's plan at ``byte`` of the host buffer at ``buffer_ptr``: its component, host
    layer, page, slot and byte in the component's row."""
    out = []
    for seg in pool.binding.segments:
        if seg.host_flat.data_ptr() != buffer_ptr or not seg.host_view.numel():
            continue
        for layer, page, slot, chunk, b in (_byte_offsets(seg) == byte).nonzero().tolist():
            b += seg.segment.src_offset + chunk * seg.segment.addressing.chunk_bytes
            out.append(f"{seg.segment.component!r} of host layer {layer}, page {page}, slot {slot}, row byte {b}")
    return out


def _assert_plan_disjoint(pool: HostKVPool, layout: str) -> None:
    """No host byte is addressed by two row bytes of the layout's plan (segments, layers, pages, slots, chunks)."""
    counts: dict[int, tuple[torch.Tensor, str]] = {}
    for seg in pool.binding.segments:
        flat, view = seg.host_flat, seg.host_view
        key = flat.data_ptr()
        total, name = counts.get(key, (torch.zeros(flat.numel(), dtype=torch.int64), seg.segment.buffer))
        if view.numel():
            total += torch.bincount(_byte_offsets(seg).reshape(-1), minlength=flat.numel())
        counts[key] = (total, name)
    for key, (total, name) in counts.items():
        twice = (total > 1).nonzero().flatten()
        if twice.numel():
            first = int(twice[0])
            raise AssertionError(f"layout {layout!r} plan: {twice.numel()} bytes of host buffer {name!r} are addressed "
                                 f"by two row bytes (first at byte {first}: "
                                 f"{' and '.join(_row_bytes_at(pool, key, first)[:2])}); give every row byte its own "
                                 f"place")


def _component_rows(spec: PoolSpec, dev: dict[str, list[torch.Tensor | None]], name: str, layer: int) -> torch.Tensor:
    """Device layer ``layer``'s rows of component ``name`` as ``[rows, row_bytes]`` bytes (parts held apart joined)."""
    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(t.shape[0], -1).contiguous().view(torch.uint8).cpu()
    comp = spec.component(name)
    held = dev.get(name)
    if held is not None and held[layer] is not None:
        return flat(held[layer])  # type: ignore[arg-type]
    return torch.cat([flat(dev[p.name][layer]) for p in comp.parts], dim=1)  # type: ignore[arg-type]


def _assert_plan_bytes(pool: HostKVPool, dev: dict[str, list[torch.Tensor | None]], h: torch.Tensor,
                       src: torch.Tensor, layout: str) -> None:
    """After a backup of device rows ``src`` into host slots ``h``: every row byte sits where the layout's plan puts it,
    by the documented address formula applied to the plan's own segments (not to the binding every backend shares,
    so a binding that misplaces bytes consistently for all of them is caught too)."""
    spec, ps = pool.spec, pool.spec.page_size
    slots = h.to("cpu", torch.int64)
    for seg in pool.binding.plan.segments:
        a = seg.addressing
        host = pool.host_buffers[seg.buffer].reshape(-1).view(torch.uint8)
        byte = torch.arange(seg.width, dtype=torch.int64)
        within = (byte // a.chunk_bytes) * (a.chunk_stride or a.chunk_bytes) + byte % a.chunk_bytes
        lmap = spec.component_map(seg.component)
        for layer, slot in zip(lmap.device_layers, lmap.host_slots or ()):
            rows = _component_rows(spec, dev, seg.component, layer)[src.to("cpu", torch.int64)]
            want = rows[:, seg.src_offset : seg.src_offset + seg.width]
            base = a.offset + slot * a.layer + (slots // ps) * a.page + (slots % ps) * a.token
            got = host[base[:, None] + within[None, :]]
            if not torch.equal(got, want):
                bad = int((got != want).any(1).nonzero()[0])
                raise AssertionError(f"layout {layout!r}: after a backup, host slot {int(slots[bad])} of "
                                     f"{seg.component!r} (device layer {layer}, bytes {seg.src_offset}.."
                                     f"{seg.src_offset + seg.width - 1}) is not where the plan's addressing puts it")


def _assert_returned(call: str, layer: int, got: object, owned: bool) -> None:
    """``backup_layer``/``load_layer`` answer ``True`` for a layer this rank owns, ``False`` for another."""
    if got is not owned:
        why = ("this rank owns it" if owned else
               "this rank does not own it, and the pool answers False for it unless the strategy's lane() returned True "
               "(a lane must return False for a layer no earlier backup/load call received)")
        raise AssertionError(f"{call}(layer {layer}) returned {got!r}, expected {owned} ({why})")


def _assert_same(what: str, got: dict[str, list[torch.Tensor | None]], want: dict[str, list[torch.Tensor | None]],
                 against: str = "the reference", named: torch.Tensor | None = None) -> None:
    """``named``: the device rows the call was given; differing rows outside it are said to be so."""
    for k in want:
        for i, (g, w) in enumerate(zip(got[k], want[k])):
            if g is None or w is None:
                continue
            if not torch.equal(g.view(torch.uint8) if g.dim() else g, w.view(torch.uint8) if w.dim() else w):
                bad = (g.reshape(g.shape[0], -1).view(torch.uint8) != w.reshape(w.shape[0], -1).view(torch.uint8))
                rows = bad.any(1).nonzero().flatten()[:5].tolist()
                given = set() if named is None else set(named.tolist())
                stray = [r for r in rows if r not in given] if named is not None else []
                hint = (f" ({'rows' if len(stray) > 1 else 'row'} {stray} not among the call's device_indices: the "
                        "strategy wrote device rows it was not given)") if stray else ""
                raise AssertionError(f"{what}: {k}[layer {i}] differs from {against} at rows {rows}{hint}")


def check_strategy(
    registry: Registry,
    case: Case,
    layout: str,
    io_backend: str,
    *,
    variant: str = "shuffled-i64",
    device: torch.device | str = "cpu",
    strategy: str | None = None,
    per_layer_backup: bool = False,
    seed: int = 0,
    placement: str = "separate",
) -> HostKVPool:
    """Run the round trip described in the module docstring; raise ``AssertionError`` on any difference.

    ``placement``: how the device layers are allocated (:data:`DEVICE_PLACEMENTS`)."""
    gen = torch.Generator().manual_seed(seed)
    spec = case.build(torch.device(device))
    dev = make_device_buffers(spec, case, gen, placement)
    dev_ref = clone_buffers(dev)
    host, guards = guarded_host_buffers(registry, spec, layout, pin_memory=spec.device.type == "cuda")
    pool = HostKVPool(spec, layout, io_backend, dev, registry=registry, strategy=strategy, host_buffers=host)
    ref = HostKVPool(spec, layout, "reference", dev_ref, registry=registry, strategy="core.reference", pin_memory=False)
    _assert_plan_disjoint(pool, layout)
    fill_canary(pool)
    fill_canary(ref)
    h, src, dst = _pick_indices(spec, variant, gen)
    hi, si, di = (_place(t, variant, spec) for t in (h, src, dst))
    original = _owned_rows(spec, dev, src)
    owned = spec.layer_map.device_layers
    if per_layer_backup:
        for layer in range(spec.layer_map.num_device_layers):
            _assert_returned("backup_layer", layer, pool.backup_layer(layer, hi, si), layer in owned)
            ref.backup_layer(layer, h, src)
    else:
        pool.backup_all_layers(hi, si)
        ref.backup_all_layers(h, src)
    if spec.device.type == "cuda":
        torch.cuda.synchronize(spec.device)
    _assert_plan_bytes(ref, dev_ref, h, src, layout)
    assert_guards_intact("backup", guards)
    for name, t in ref.host_buffers.items():
        if not torch.equal(pool.host_buffers[name].view(torch.uint8), t.view(torch.uint8)):
            diff = (pool.host_buffers[name].view(torch.uint8) != t.view(torch.uint8)).nonzero()[:3].tolist()
            raise AssertionError(f"backup: host buffer {name!r} differs from the reference at {diff}: "
                                 f"{_where_in_plan(pool, pool.host_buffers[name], t)}")
    for bufs in (dev, dev_ref):  # poison the load targets
        for lst in bufs.values():
            for dt in lst:
                if dt is not None:
                    dt[dst.to(dt.device)] = dt[:1].expand(dst.numel(), *dt.shape[1:]).clone().view(dt.dtype)
    for layer in range(spec.layer_map.num_device_layers):
        _assert_returned("load_layer", layer, pool.load_layer(layer, hi, di), layer in owned)
        ref.load_layer(layer, h, dst)
    if spec.device.type == "cuda":
        torch.cuda.synchronize(spec.device)
    assert_guards_intact("load_layer", guards)
    assert_device_guards_intact("backup and load_layer", dev)
    _assert_same("load_layer", dev, dev_ref, named=dst)
    _assert_same("round trip", _rows(dev, dst), original,
                 "the rows backed up (the reference backend agreeing, look at the layout's plan: a row byte it leaves "
                 "out comes back wrong)")
    return pool


def check_load_all(registry: Registry, case: Case, layout: str, io_backend: str, *,
                   device: torch.device | str = "cpu", strategy: str | None = None, seed: int = 1) -> None:
    """``backup_all_layers`` then ``load_all_layers`` into other slots: rows come back bit-exact."""
    gen = torch.Generator().manual_seed(seed)
    spec = case.build(torch.device(device))
    dev = make_device_buffers(spec, case, gen)
    host, guards = guarded_host_buffers(registry, spec, layout, pin_memory=spec.device.type == "cuda")
    pool = HostKVPool(spec, layout, io_backend, dev, registry=registry, strategy=strategy, host_buffers=host)
    h, src, dst = _pick_indices(spec, "shuffled-i64", gen)
    before = _rows(dev, torch.arange(spec.page_size))
    original = _owned_rows(spec, dev, src)
    pool.backup_all_layers(h, src)
    pool.load_all_layers(h, dst)
    if spec.device.type == "cuda":
        torch.cuda.synchronize(spec.device)
    assert_guards_intact("backup_all_layers and load_all_layers", guards)
    assert_device_guards_intact("backup_all_layers and load_all_layers", dev)
    _assert_same("load_all_layers", _rows(dev, dst), original)
    _assert_same("canary page", _rows(dev, torch.arange(spec.page_size)), before)
    _check_empty_calls(pool, dev)


def _check_empty_calls(pool: HostKVPool, dev: dict) -> None:
    """Every transfer with empty index tensors (on the CPU and on the pool's device) moves nothing and raises
    nothing (the README's promise: a no-op)."""
    spec = pool.spec
    hosts = {n: t.clone() for n, t in pool.host_buffers.items()}
    devs = clone_buffers(dev)
    layer = spec.layer_map.device_layers[0] if spec.layer_map.device_layers else 0
    owned = spec.layer_map.owns(layer)
    for device in dict.fromkeys([torch.device("cpu"), spec.device]):
        e = torch.empty(0, dtype=torch.int64, device=device)
        pool.backup_all_layers(e, e)
        assert pool.backup_layer(layer, e, e) == owned, "backup_layer with empty index tensors: True where owned"
        pool.load_all_layers(e, e)
        assert pool.load_layer(layer, e, e) == owned, "load_layer with empty index tensors: True where owned"
    if spec.device.type == "cuda":
        torch.cuda.synchronize(spec.device)
    for name, t in hosts.items():
        assert torch.equal(pool.host_buffers[name].view(torch.uint8), t.view(torch.uint8)), \
            f"a call with empty index tensors changed host buffer {name!r}"
    _assert_same("calls with empty index tensors", dev, devs)


#: Attribute a strategy class may set: regular expressions matching the ``supports()``
#: reasons it deliberately gives.  The kit fails any other rejection of a built-in case.
DECLARED_REJECTIONS = "conformance_rejects"


@dataclass(frozen=True)
class Rejection:
    """Why a target does not serve a case: ``kind`` is ``declared`` (the layout's check, the
    registration, or a pattern the strategy declares), ``environment`` (the strategy cannot run
    here, e.g. no GPU and no Triton interpreter) or ``undeclared`` (a failure)."""

    kind: str
    reason: str
    #: The layout's own check refused the case (its pools), before any strategy was asked.
    by_layout: bool = False
    #: ``"sharded"`` / ``"unsharded"`` where the strategy's registration has no key for the case's pool (declared).
    unregistered: str | None = None


def classify_rejection(registry: Registry, case: Case, layout: str, io_backend: str, strategy: str,
                       device: torch.device | str = "cpu") -> Rejection | None:
    """``None`` when ``strategy`` serves ``case`` in ``layout``, else why not and whether that was declared."""
    spec = case.build(torch.device(device))
    res, rejected = registry.try_resolve(spec, layout, io_backend, override=strategy)
    if res is not None:
        return None
    for name, why in rejected:
        if name.startswith("layout "):  # the layout's check
            return Rejection("declared", why, by_layout=True)
        if NOT_A_CANDIDATE in why:  # the strategy's registration
            return Rejection("declared", why, unregistered="sharded" if spec.sharded else "unsharded")
        if name != strategy:
            continue
        if why == kernel_unsupported_reason(spec):
            return Rejection("environment", why)
        if why.startswith(LOAD_FAILED):  # the factory or supports() raised: no declaration covers a crash
            return Rejection("undeclared", f"{strategy} {why} (for {case.id}); `hicache -vv explain --layout {layout} "
                                           f"--io-backend {io_backend}` shows the traceback")
        info = registry.strategies[strategy][0]
        patterns = getattr(info.factory, DECLARED_REJECTIONS, None)
        if patterns is None:  # a factory function: ask what it builds
            try:
                patterns = getattr(info.factory(), DECLARED_REJECTIONS, ())
            except Exception:  # the rejection itself already tells why it cannot be built
                patterns = ()
        if any(re.search(p, why) for p in patterns or ()):
            return Rejection("declared", why)
        return Rejection("undeclared", f"{strategy} rejected {case.id} with a reason it does not declare: {why!r} "
                                       f"(list the reasons it may give in {DECLARED_REJECTIONS} on its class)")
    return Rejection("undeclared", f"{strategy} did not resolve for {case.id}: {rejected}")


def assert_page_loads_taken(pool: HostKVPool) -> None:
    """For a pool of a row-copy kernel strategy with a page load kernel, built with page loads for every group
    (strategy option ``pages=True`` or ``HICACHE_KERNEL_PAGES=1``): every launch group whose host pages allow it
    (:func:`hicache_core.rowcopy_pages.group_reason`) loads through page loads.  Automatic page loads leave pages of
    under :data:`~hicache_core.rowcopy_pages.AUTO_MIN_PART_BYTES` per host part to the row kernel, as the kit's small
    test pages mostly are: a plugin test that forces page loads calls this after :func:`check_strategy` to know its
    page kernel ran."""
    from ..rowcopy_pages import group_reason

    prep = pool.binding.scratch[pool.strategy_name]
    assert prep.pages, f"{pool.strategy_name}: no page loads prepared (pages off, or no PAGE_LOAD_KERNEL)"
    for g, pages in zip(prep.groups, prep.pages):
        why = group_reason(g, pool.spec.page_size)
        assert (pages is not None) == (why is None), (f"{pool.strategy_name}, group {'/'.join(g.names)}: page loads "
                                                      f"{'prepared' if pages is not None else 'not prepared'}; "
                                                      f"its host pages: {why or 'allow them'}")


__all__ += ["check_load_all", "CANARY", "clone_buffers", "fill_canary", "classify_rejection", "Rejection",
            "DECLARED_REJECTIONS", "GUARD", "GUARD_BYTES", "guarded_host_buffers", "assert_guards_intact",
            "assert_device_guards_intact", "assert_page_loads_taken"]
