"""Bad calls on a HostKVPool: each raises one specific error class whose message names the
argument and the fix, and leaves every host and device byte as it was."""

from __future__ import annotations

import re
from typing import Any, Callable

import pytest
import torch

from hicache_core import HostKVPool, LayerMap, PoolSpec
from hicache_core.errors import (
    DuplicateIndexError,
    DeviceBufferError,
    HostBufferError,
    IndexDeviceError,
    IndexDtypeError,
    IndexLengthMismatchError,
    IndexRangeError,
    IndexShapeError,
    LayerIdError,
    PageAlignmentError,
    PageMultipleError,
    ResolutionError,
    SpecError,
    TransferArgumentError,
    UnallocatedSlotError,
    UnknownLayoutError,
)

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
BACKENDS = ("direct", "reference")
PS, PAGES, LAYERS, HEADS, HD, VD = 4, 4, 3, 2, 4, 2
CAP = PS * PAGES  # 16 host slots
ROWS = 2 * CAP  # device rows


def make_spec(layer_map: LayerMap | None = None) -> PoolSpec:
    return PoolSpec.mha(layer_map=layer_map or LayerMap.unsharded(LAYERS), head_num=HEADS, head_dim=HD,
                        v_head_dim=VD, dtype=torch.float16, page_size=PS, capacity=CAP)


def make_device(spec: PoolSpec, seed: int = 0) -> dict[str, list[torch.Tensor | None]]:
    gen = torch.Generator().manual_seed(seed)
    n = spec.layer_map.num_device_layers
    return {
        "k": [torch.randn(ROWS, HEADS, HD, generator=gen).half() for _ in range(n)],
        "v": [torch.randn(ROWS, HEADS, VD, generator=gen).half() for _ in range(n)],
    }


def fill_random(host: dict[str, torch.Tensor], seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in host.values():
        flat = t.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))


def snapshot(*groups: Any) -> list[torch.Tensor]:
    """Clones of every tensor in dicts / lists of tensors, in a fixed order.

    ``None`` and meta tensors (which hold no bytes) are skipped.
    """
    out: list[torch.Tensor] = []
    for g in groups:
        items = g.values() if isinstance(g, dict) else g
        for x in items:
            for t in x if isinstance(x, (list, tuple)) else [x]:
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    out.append(t.clone())
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Every byte of ``t`` (any dtype, any strides), compared bit-exactly (NaN patterns included)."""
    return t.reshape(-1).contiguous().view(torch.uint8)


def assert_unchanged(before: list[torch.Tensor], *groups: Any) -> None:
    after = snapshot(*groups)
    assert len(after) == len(before)
    for i, (a, b) in enumerate(zip(after, before)):
        assert torch.equal(as_bytes(a), as_bytes(b)), f"tensor #{i} was written by a failed call"


@pytest.fixture(params=[(lay, be) for lay in LAYOUTS for be in BACKENDS], ids=lambda p: f"{p[0]}-{p[1]}")
def target(request: pytest.FixtureRequest) -> tuple[str, str]:
    return request.param


@pytest.fixture
def pool(target: tuple[str, str]) -> HostKVPool:
    layout, backend = target
    spec = make_spec()
    p = HostKVPool(spec, layout, backend, make_device(spec), pin_memory=False)
    fill_random(p.host_buffers)
    return p


def _device(pool: HostKVPool) -> list[torch.Tensor]:
    return [t for seg in pool.binding.segments for t in seg.device_rows]


# --- transfer arguments -------------------------------------------------------------

AR = torch.arange
GOOD_H, GOOD_D = AR(4, 12), AR(8, 16)

#: (id, host_indices, device_indices, error class, message pattern)
INDEX_CASES: list[tuple[str, Any, Any, type[Exception], str]] = [
    ("length-mismatch", AR(0, 8), AR(0, 4), IndexLengthMismatchError,
     r"host_indices has 8 entries but device_indices has 4; they must pair one to one"),
    ("not-page-multiple", AR(0, 6), AR(0, 6), PageMultipleError,
     r"host_indices has 6 entries, not a multiple of page_size=4; transfer whole pages"),
    ("misaligned-pages", AR(2, 6), AR(0, 4), PageAlignmentError,
     r"host_indices must be whole pages: runs of page_size=4 consecutive slots starting at a multiple of page_size"),
    ("non-consecutive-page", torch.tensor([4, 5, 7, 6]), AR(0, 4), PageAlignmentError,
     r"host_indices must be whole pages.*\(as alloc returns them\)"),
    ("host-slot-out-of-range", AR(CAP, CAP + 4), AR(0, 4), IndexRangeError,
     r"host_indices must lie in 0\.\.15 \(capacity\), got 16\.\.19"),
    ("negative-host-slot", AR(-4, 0), AR(0, 4), IndexRangeError,
     r"host_indices must lie in 0\.\.15 \(capacity\), got -4\.\.-1"),
    ("device-index-out-of-range", AR(0, 4), AR(ROWS - 2, ROWS + 2), IndexRangeError,
     r"device_indices must lie in 0\.\.31 \(rows of the device buffers, the shortest layer's\), got 30\.\.33"),
    ("device-index-one-past-the-rows", AR(0, 4), AR(ROWS - 3, ROWS + 1), IndexRangeError,
     r"device_indices must lie in 0\.\.31 \(rows of the device buffers, the shortest layer's\), got 29\.\.32"),  # exactly at the bound
    ("negative-device-index", AR(0, 4), torch.tensor([0, 1, -1, 2]), IndexRangeError,
     r"device_indices must lie in 0\.\.31 .*got -1\.\.2"),
    ("float-host-indices", AR(0, 4).float(), AR(0, 4), IndexDtypeError,
     r"host_indices must be int32 or int64, got torch\.float32; convert with \.long\(\)"),
    ("int16-device-indices", AR(0, 4), AR(0, 4).to(torch.int16), IndexDtypeError,
     r"device_indices must be int32 or int64, got torch\.int16; convert with \.long\(\)"),
    ("2d-host-indices", AR(0, 8).view(2, 4), AR(0, 8), IndexShapeError,
     r"host_indices must be one-dimensional, got shape \(2, 4\); flatten it"),
    ("0d-device-indices", AR(0, 1), torch.tensor(0), IndexShapeError,
     r"device_indices must be one-dimensional, got shape \(\)"),
    ("list-host-indices", [0, 1, 2, 3], AR(0, 4), IndexDtypeError,
     r"host_indices must be a torch\.Tensor of int32 or int64, got list"),
    ("numpy-device-indices", AR(0, 4), AR(0, 4).numpy(), IndexDtypeError,
     r"device_indices must be a torch\.Tensor of int32 or int64, got ndarray"),
    ("host-indices-on-other-device", AR(0, 4, device="meta"), AR(0, 4), IndexDeviceError,
     r"host_indices is on meta; pass it on the CPU or on the pool's device cpu"),
    ("device-indices-on-other-device", AR(0, 4), AR(0, 4, device="meta"), IndexDeviceError,
     r"device_indices is on meta; pass it on the CPU or on the pool's device cpu"),
    ("bool-device-indices", AR(0, 4), torch.ones(4, dtype=torch.bool), IndexDtypeError,
     r"device_indices must be int32 or int64, got torch\.bool; convert with \.long\(\)"),
    ("sparse-host-indices", AR(0, 4).to_sparse(), AR(0, 4), IndexDtypeError,
     r"host_indices must be a dense \(strided\) tensor of int32 or int64, got layout torch\.sparse_coo; convert it "
     r"with \.to_dense\(\)"),
    ("lazily-negated-device-indices", AR(0, 4), torch._neg_view(-AR(8, 12)), IndexDtypeError,
     r"device_indices is a lazily negated view \(is_neg\(\)\): its memory holds other values than it reads as; "
     r"pass device_indices\.resolve_neg\(\)"),
    ("zero-tensor-host-indices", torch._efficientzerotensor(PS, dtype=torch.int64), AR(0, 4), IndexDtypeError,
     r"host_indices is a zero tensor without memory of its own; pass a materialised tensor \(e\.g\. torch\.zeros\)"),
]

OPS: dict[str, Callable[[HostKVPool, Any, Any], Any]] = {
    "backup_all_layers": lambda p, h, d: p.backup_all_layers(h, d),
    "backup_layer": lambda p, h, d: p.backup_layer(1, h, d),
    "load_layer": lambda p, h, d: p.load_layer(1, h, d),
    "load_all_layers": lambda p, h, d: p.load_all_layers(h, d),
}


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("case", INDEX_CASES, ids=[c[0] for c in INDEX_CASES])
def test_bad_indices_raise_and_write_nothing(pool: HostKVPool, op: str, case: tuple,
                                             index_check_path: str) -> None:
    _, h, d, cls, pattern = case
    before = snapshot(pool.host_buffers, _device(pool))
    with pytest.raises(cls, match=pattern) as info:
        OPS[op](pool, h, d)
    assert type(info.value) is cls  # the specific class, not a sibling or a base
    assert isinstance(info.value, TransferArgumentError)
    assert_unchanged(before, pool.host_buffers, _device(pool))


@pytest.mark.parametrize("op", ["backup_layer", "load_layer"])
@pytest.mark.parametrize("layer_id", [-1, LAYERS, 100, True, False, "0", 1.0, None])
def test_bad_layer_id(pool: HostKVPool, op: str, layer_id: Any) -> None:
    before = snapshot(pool.host_buffers, _device(pool))
    with pytest.raises(LayerIdError, match=rf"layer_id must be an int in 0\.\.2 \(device layer ids\), got {layer_id!r}"):
        getattr(pool, op)(layer_id, GOOD_H, GOOD_D)
    assert_unchanged(before, pool.host_buffers, _device(pool))


@pytest.mark.parametrize("op", ["backup_layer", "load_layer"])
def test_layer_ids_are_taken_as_the_allocator_takes_ints(pool: HostKVPool, op: str) -> None:
    """NumPy ints are ints (the allocator took them, the layer check did not): the same bytes as a Python int; tensors
    are refused (a CUDA one would be read back from the device), as are NumPy bools and ids out of range."""
    import numpy as np

    bufs = [*pool.host_buffers.values(), *_device(pool)]
    start = [b.clone() for b in bufs]
    results = []
    for layer in (1, np.int64(1)):
        for b, s0 in zip(bufs, start):
            b.copy_(s0)
        getattr(pool, op)(layer, GOOD_H, GOOD_D)
        results.append([b.contiguous().view(torch.uint8).clone() for b in bufs])  # bytes: random floats hold NaNs
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert not all(torch.equal(a, b.contiguous().view(torch.uint8)) for a, b in zip(results[0], start))  # rows moved
    before = snapshot(pool.host_buffers, _device(pool))
    for bad in (torch.tensor(1), np.int64(LAYERS), np.True_):
        with pytest.raises(LayerIdError, match=r"layer_id must be an int in 0\.\.2"):
            getattr(pool, op)(bad, GOOD_H, GOOD_D)
    with pytest.raises(LayerIdError, match=r"pass int\(layer_id\)"):
        getattr(pool, op)(torch.tensor(1), GOOD_H, GOOD_D)
    assert_unchanged(before, pool.host_buffers, _device(pool))


@pytest.mark.parametrize("op", list(OPS))
def test_rows_a_transfer_writes_twice_are_refused_and_nothing_moves(pool: HostKVPool, op: str,
                                                                    index_check_path: str) -> None:
    """A backup naming one host page twice, a load naming one device row twice: DuplicateIndexError, no byte
    written. The same indices the other way round only read a row twice, and go through."""
    page = AR(4, 8)
    twice_host = (torch.cat([page, page]), AR(0, 8))
    twice_dev = (AR(0, 8), torch.tensor([0, 1, 1, 2, 3, 4, 5, 6]))
    backup = op.startswith("backup")
    h, d = twice_host if backup else twice_dev
    pattern = (r"^host_indices repeat the pages starting at slots \[4\]; a backup would write them twice \(the last "
               r"write would win, kernels would race\): pass each host page once$" if backup else
               r"^device_indices repeat rows \[1\]; a load would write them twice \(the last write would win, kernels "
               r"would race\): pass each device row once$")
    before = snapshot(pool.host_buffers, _device(pool))
    with pytest.raises(DuplicateIndexError, match=pattern) as info:
        OPS[op](pool, h, d)
    assert type(info.value) is DuplicateIndexError
    assert_unchanged(before, pool.host_buffers, _device(pool))
    OPS[op](pool, *(twice_dev if backup else twice_host))  # repeats where the transfer only reads


def test_strict_validation_refuses_unallocated_host_pages_and_writes_nothing(target: tuple[str, str]) -> None:
    layout, backend = target
    spec = make_spec()
    p = HostKVPool(spec, layout, backend, make_device(spec), pin_memory=False, validate="strict")
    fill_random(p.host_buffers)
    slots = p.alloc(PS)  # page 0
    before = snapshot(p.host_buffers, _device(p))
    for op in OPS.values():
        with pytest.raises(UnallocatedSlotError, match=r"^host_indices name pages \[1\] that this pool has not "
                                                       r"allocated \(freed or never allocated; validate='strict'\); "
                                                       r"use slots from alloc\(\), or validate='full' when the engine "
                                                       r"allocates host slots itself$"):
            op(p, torch.cat([slots, AR(4, 8)]), AR(0, 8))
    for call in (lambda: p.get_page(1), lambda: p.page_pointers(1),
                 lambda: p.set_page(1, torch.zeros(p.page_bytes, dtype=torch.uint8))):
        with pytest.raises(UnallocatedSlotError, match=r"^page 1 is not allocated in this pool \(freed or never "
                                                       r"allocated; validate='strict'\); use pages of slots from "
                                                       r"alloc\(\)$"):
            call()
    assert_unchanged(before, p.host_buffers, _device(p))
    p.backup_all_layers(slots, AR(0, PS))  # an allocated page goes through


def test_good_call_after_bad_ones_still_works(pool: HostKVPool) -> None:
    """The control: the same pool with valid arguments does write (so 'unchanged' above means something)."""
    before = snapshot(pool.host_buffers)
    pool.backup_all_layers(GOOD_H, GOOD_D)
    assert any(not torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(before, snapshot(pool.host_buffers)))


# --- construction: device buffers ---------------------------------------------------------


def _mutate(name: str) -> Callable[[dict[str, list[Any]]], dict[str, list[Any]]]:
    def wrong_row(dev):
        dev["k"][1] = torch.zeros(ROWS, HEADS, HD - 1, dtype=torch.float16)
        return dev

    def missing(dev):
        del dev["v"]
        return dev

    def none_layer(dev):
        dev["v"][2] = None
        return dev

    def wrong_device(dev):
        dev["k"][0] = torch.empty(ROWS, HEADS, HD, dtype=torch.float16, device="meta")
        return dev

    def non_contiguous_rows(dev):
        dev["k"][1] = torch.zeros(ROWS, HD, HEADS, dtype=torch.float16).transpose(1, 2)
        return dev

    def too_few_layers(dev):
        dev["k"] = dev["k"][:2]
        return dev

    def too_many_layers(dev):
        dev["k"].append(torch.zeros(ROWS, HEADS, HD, dtype=torch.float16))
        return dev

    def zero_dim(dev):
        dev["v"][0] = torch.tensor(1.0, dtype=torch.float16)
        return dev

    def expanded_rows(dev):
        dev["k"][1] = torch.zeros(1, HEADS, HD, dtype=torch.float16).expand(ROWS, HEADS, HD)
        return dev

    def overlapping_rows(dev):
        dev["v"][1] = torch.zeros(ROWS * HEADS * VD, dtype=torch.float16).as_strided((ROWS, HEADS, VD), (VD, VD, 1))
        return dev

    return locals()[name]


DEVICE_CASES = [
    ("wrong_row", r"device_buffers\['k'\]\[1\] rows are 12 bytes, the spec's 'k' rows are 16 bytes; pass tensors "
                  r"whose rows match the spec \(head count, head dim, dtype\) or fix the spec$"),
    ("missing", r"device_buffers has no entry for 'v'; it has \['k'\]\. Pass one per-layer tensor list per component"),
    ("none_layer", r"device_buffers\['v'\]\[2\] is None but the layer map owns device layer 2; pass that layer's "
                   r"tensor \(None only for layers the map does not own\)$"),
    ("wrong_device", r"device_buffers\['k'\]\[0\] is on meta, the pool spec says cpu; move it or fix the spec"),
    ("non_contiguous_rows", r"device_buffers\['k'\]\[1\]: each token's row must be contiguous .*Pass a view with contiguous rows"),
    ("too_few_layers", r"device_buffers\['k'\] has 2 layers but the layer map reads device layer 2; pass one tensor per device layer id"),
    ("too_many_layers", r"device_buffers\['k'\] has 4 layers but the spec has 3 device layers "
                        r"\(layer_map\.num_device_layers\); pass one tensor per device layer id, or fix the layer map"),
    ("zero_dim", r"device_buffers\['v'\]\[0\] must have a token axis, got a 0-d tensor; pass the layer's "
                 r"\[tokens, \.\.\.\] tensor$"),
    ("expanded_rows", r"device_buffers\['k'\]\[1\]: token rows overlap .*token stride 0 elements"),
    ("overlapping_rows", r"device_buffers\['v'\]\[1\]: token rows overlap .*not an expand\(\)ed or as_strided\(\) view"),
]


@pytest.mark.parametrize("name,pattern", DEVICE_CASES, ids=[c[0] for c in DEVICE_CASES])
def test_bad_device_buffers(target: tuple[str, str], name: str, pattern: str) -> None:
    spec = make_spec()
    dev = _mutate(name)(make_device(spec))
    before = snapshot(dev)
    with pytest.raises(DeviceBufferError, match=pattern) as info:
        HostKVPool(spec, *target, dev, pin_memory=False)
    assert type(info.value) is DeviceBufferError
    assert_unchanged(before, dev)


@pytest.mark.parametrize("backend", BACKENDS + ("auto",))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_device_pool_of_no_tokens_builds_and_refuses_every_row(layout: str, backend: str) -> None:
    """Device layers of zero tokens (any number of inner dims) make a pool (reshaping them must not guess the row
    size from no elements); every device index is then out of range, and nothing moves."""
    spec = make_spec()
    n = spec.layer_map.num_device_layers
    dev = {"k": [torch.zeros(0, HEADS, HD, dtype=torch.float16) for _ in range(n)],
           "v": [torch.zeros(0, HEADS, VD, dtype=torch.float16) for _ in range(n)]}
    pool = HostKVPool(spec, layout, backend, dev, pin_memory=False)
    fill_random(pool.host_buffers)
    before = snapshot(pool.host_buffers)
    for call in (lambda: pool.backup_all_layers(AR(0, PS), AR(0, PS)), lambda: pool.load_layer(1, AR(0, PS), AR(0, PS))):
        with pytest.raises(IndexRangeError, match="device_indices"):
            call()
    assert_unchanged(before, pool.host_buffers)


# --- construction: wrapped host buffers -------------------------------------------------


def _planned_host(spec: PoolSpec, layout: str) -> dict[str, torch.Tensor]:
    """Host buffers as ``layout`` plans them, random bytes."""
    probe = HostKVPool(spec, layout, "reference", make_device(spec), pin_memory=False)
    host = {k: torch.empty_like(v) for k, v in probe.host_buffers.items()}
    fill_random(host, seed=7)
    return host


@pytest.mark.parametrize("bad", ["shape", "dtype", "missing", "non_contiguous", "device"])
def test_bad_host_buffers(target: tuple[str, str], bad: str) -> None:
    layout, backend = target
    spec = make_spec()
    host = _planned_host(spec, layout)
    good_shape = tuple(host["k"].shape)
    if bad == "shape":
        host["k"] = host["k"].reshape(-1)[: host["k"].numel() // 2].clone()
        pattern = (rf"host buffer 'k' must be a contiguous CPU torch.float16 tensor of shape {re.escape(str(good_shape))} "
                   rf"\(trailing dims may be split\) for layout '{layout}'; got torch.float16 \({host['k'].numel()},\) on cpu")
    elif bad == "dtype":
        host["v"] = host["v"].view(torch.bfloat16)
        pattern = r"host buffer 'v' must be a contiguous CPU torch.float16 tensor of shape .*got torch.bfloat16"
    elif bad == "missing":
        del host["v"]
        pattern = rf"host buffer 'v' is missing; the layout '{layout}' needs \['k', 'v'\]"
    elif bad == "non_contiguous":
        host["k"] = host["k"].transpose(0, 1).contiguous().transpose(0, 1)
        pattern = r"host buffer 'k' must be a contiguous .*\(contiguous=False\)"
    else:
        host["k"] = torch.empty(good_shape, dtype=torch.float16, device="meta")
        pattern = r"host buffer 'k' must be a contiguous CPU .* on meta"
    dev = make_device(spec)
    before = snapshot(host, dev)
    with pytest.raises(HostBufferError, match=pattern) as info:
        HostKVPool(spec, layout, backend, dev, host_buffers=host)
    assert type(info.value) is HostBufferError
    assert_unchanged(before, host, dev)


def test_host_buffers_sharing_memory_with_device_rows_are_refused(target: tuple[str, str]) -> None:
    """A CPU pool whose host buffer lies inside a device layer's memory (a round trip would read rows it had just
    overwritten) is refused, naming both; a device layer right after the host buffer, in the same allocation, is not."""
    layout, backend = target
    spec = make_spec()
    host = _planned_host(spec, layout)
    dev = make_device(spec)
    k0 = dev["k"][0]
    big = torch.empty(host["k"].numel() + k0.numel(), dtype=torch.float16)
    big.random_(0, 100)
    dev["k"][0] = big[host["k"].numel():].view(k0.shape)  # apart from the host buffer: accepted
    host["k"] = big[: host["k"].numel()].view(host["k"].shape)
    HostKVPool(spec, layout, backend, dev, host_buffers=host)
    dev["k"][0] = big[host["k"].numel() - 1: host["k"].numel() - 1 + k0.numel()].view(k0.shape)  # one element shared
    before = snapshot(host, dev)
    with pytest.raises(HostBufferError, match=r"host buffer 'k' shares memory with device_buffers k\[0\]; .*separate "
                                              r"tensors") as info:
        HostKVPool(spec, layout, backend, dev, host_buffers=host)
    assert type(info.value) is HostBufferError
    assert_unchanged(before, host, dev)


# --- construction: resolution ---------------------------------------------------------


def test_unknown_layout_lists_installed_layouts() -> None:
    spec = make_spec()
    dev = make_device(spec)
    before = snapshot(dev)
    with pytest.raises(UnknownLayoutError, match=r"unknown layout 'page_last'\.\n\(plugins register through entry points of the 'hicache' group; `hicache plugins` lists them; a plugin whose entry points changed needs a reinstall\)\ninstalled layouts:\n") as info:
        HostKVPool(spec, "page_last", "direct", dev)
    msg = str(info.value)
    for layout in LAYOUTS:
        assert f"\n  {layout} (hicache-" in msg
    assert "installed io_backends:\n" in msg and "\n  direct (hicache-core " in msg
    assert_unchanged(before, dev)


def test_misspelt_names_get_near_matches() -> None:
    spec = make_spec()
    dev = make_device(spec)
    before = snapshot(dev)
    with pytest.raises(UnknownLayoutError) as info:
        HostKVPool(spec, "page_frist", "direct", dev)
    assert str(info.value).splitlines()[0] == "unknown layout 'page_frist'."
    assert str(info.value).splitlines()[-1].startswith("did you mean: page_first")
    with pytest.raises(ResolutionError) as info:
        HostKVPool(spec, "page_first", "dirct", dev)
    assert str(info.value).splitlines()[-1] == "did you mean: direct?"
    with pytest.raises(ResolutionError) as info:  # a known io_backend that cannot serve gets no guess
        HostKVPool(spec, "page_first", "direct", dev, strategy="core.reference")
    assert "did you mean" not in str(info.value)
    assert_unchanged(before, dev)


def test_unknown_io_backend() -> None:
    spec = make_spec()
    dev = make_device(spec)
    before = snapshot(dev)
    with pytest.raises(ResolutionError) as info:
        HostKVPool(spec, "page_first", "nvme_dma", dev)
    msg = str(info.value)
    assert type(info.value) is ResolutionError
    assert msg.startswith("no strategy serves (layout='page_first', io_backend='nvme_dma', sharded=False) for mha")
    assert "(none): no installed plugin provides io_backend 'nvme_dma' (plugins register through entry points" in msg
    alts = next(line for line in msg.splitlines() if line.startswith("nearest working alternatives: "))
    assert "layout='page_first', io_backend='direct' (" in alts  # auto may come first where it resolves
    assert "installed io_backends:" in msg
    assert_unchanged(before, dev)


def test_override_strategy_not_a_candidate() -> None:
    spec = make_spec()
    dev = make_device(spec)
    before = snapshot(dev)
    with pytest.raises(ResolutionError, match=r"core\.reference: not a candidate for this key; candidates: \[[^\]]*'core\.direct'[^\]]*\]"):
        HostKVPool(spec, "layer_first", "direct", dev, strategy="core.reference")
    assert_unchanged(before, dev)


def test_bad_validate_mode() -> None:
    spec = make_spec()
    with pytest.raises(SpecError, match=r"^validate='all': use 'shapes', 'full' or 'strict'$"):
        HostKVPool(spec, "layer_first", "direct", make_device(spec), validate="all")


# --- page views -------------------------------------------------------------------


@pytest.mark.parametrize("page", [-1, PAGES, 1000, True, "0", 1.0])
@pytest.mark.parametrize("method", ["get_page", "set_page", "page_pointers"])
def test_page_out_of_range(pool: HostKVPool, method: str, page: Any) -> None:
    before = snapshot(pool.host_buffers)
    args = (page, torch.zeros(pool.page_bytes, dtype=torch.uint8)) if method == "set_page" else (page,)
    with pytest.raises(HostBufferError, match=rf"page must be an int in 0\.\.3 \(a host slot // page_size\), got "
                                              rf"{type(page).__name__} {re.escape(repr(page))}$"):
        getattr(pool, method)(*args)
    assert_unchanged(before, pool.host_buffers)


def test_a_page_number_of_another_integer_type_is_taken(pool: HostKVPool) -> None:
    """A numpy integer (what an engine's page table may hold) addresses the page as the int would (layer ids took
    them; page numbers were refused)."""
    np = pytest.importorskip("numpy")
    for kind in (np.int64, np.int32, np.int16, np.uint8):
        pointers = pool.page_pointers(kind(2))
        assert pointers == pool.page_pointers(2)
        assert all(type(x) is int for block in pointers for x in block)  # addresses as ints, not numpy scalars
        assert torch.equal(pool.get_page(kind(1)), pool.get_page(1))
    page = pool.get_page(3).clone()
    pool.set_page(np.uint8(0), page)
    assert torch.equal(pool.get_page(0), page)
    before = snapshot(pool.host_buffers)
    with pytest.raises(HostBufferError, match=r"page must be an int in 0\.\.3 \(a host slot // page_size\), got "
                                              r"ndarray array\(\[2\]\)$"):
        pool.get_page(np.array([2]))
    with pytest.raises(HostBufferError, match=r"got uint8 np.uint8\(7\)$|got uint8 7$"):
        pool.set_page(np.uint8(7), page)
    assert_unchanged(before, pool.host_buffers)


@pytest.mark.parametrize(
    "data",
    [
        lambda n: torch.zeros(n - 1, dtype=torch.uint8),
        lambda n: torch.zeros(n + 2, dtype=torch.uint8),
        lambda n: torch.zeros(n, dtype=torch.float16),  # twice the bytes
        lambda n: torch.zeros(n, dtype=torch.uint8, device="meta"),
        lambda n: bytes(n),
        lambda n: torch.quantize_per_tensor(torch.zeros(n), 1.0, 0, torch.quint8),  # torch's own copy crashed on it
        lambda n: torch.zeros(n, dtype=torch.uint8).to_sparse(),
    ],
    ids=["short", "long", "fp16-count-not-bytes", "meta-device", "bytes-object", "quantized", "sparse"],
)
def test_set_page_wrong_bytes(pool: HostKVPool, data: Callable[[int], Any]) -> None:
    n = pool.page_bytes
    assert n == PS * LAYERS * HEADS * (HD + VD) * 2
    before = snapshot(pool.host_buffers)
    with pytest.raises(HostBufferError, match=rf"data must be a dense \(strided, not quantized\) CPU tensor of {n} "
                                              r"bytes \(page_bytes\)"):
        pool.set_page(1, data(n))
    assert_unchanged(before, pool.host_buffers)


# --- error hierarchy ------------------------------------------------------------------


def test_transfer_errors_keep_sglang_compatible_bases() -> None:
    for cls in (IndexLengthMismatchError, PageMultipleError, PageAlignmentError, IndexRangeError,
                IndexShapeError, IndexDeviceError, LayerIdError, DeviceBufferError, HostBufferError):
        assert issubclass(cls, TransferArgumentError) and issubclass(cls, ValueError)
    assert issubclass(IndexDtypeError, TypeError) and issubclass(IndexDtypeError, ValueError)
    assert issubclass(UnknownLayoutError, ValueError) and issubclass(ResolutionError, ValueError)


def test_set_page_writes_what_a_strided_or_expanded_tensor_reads_as(pool: HostKVPool) -> None:
    n = pool.page_bytes
    wide = torch.arange(n // 2, dtype=torch.float32) + 1
    pool.set_page(1, wide[::2])  # a 1-D strided float32 view: reshape(-1) keeps its stride
    assert torch.equal(pool.get_page(1).view(torch.float32), wide[::2])
    pool.set_page(2, torch.full((1,), 3.5).expand(n // 4))  # stride 0
    assert torch.equal(pool.get_page(2).view(torch.float32), torch.full((n // 4,), 3.5))


def test_set_page_writes_what_a_lazy_negated_view_reads_as(pool: HostKVPool) -> None:
    n = pool.page_bytes
    x = torch.arange(n // 4, dtype=torch.float32) + 1
    view = torch._neg_view(x)
    assert view.is_neg()
    pool.set_page(1, view)
    assert torch.equal(pool.get_page(1).view(torch.float32), -x)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_host_slot_at_capacity_is_out_of_range_with_pages_of_one(layout: str, backend: str,
                                                                    index_check_path: str) -> None:
    """With pages of one slot a host index can equal the capacity exactly (with larger pages a run past the end
    always passes it): still out of range, and nothing is written (not past the host buffer either)."""
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(LAYERS), head_num=HEADS, head_dim=HD, v_head_dim=VD,
                        dtype=torch.float16, page_size=1, capacity=CAP)
    p = HostKVPool(spec, layout, backend, make_device(spec), pin_memory=False)
    fill_random(p.host_buffers)
    before = snapshot(p.host_buffers, _device(p))
    for op in OPS.values():
        with pytest.raises(IndexRangeError, match=rf"host_indices must lie in 0\.\.{CAP - 1} \(capacity\), got 0\.\.{CAP}"):
            op(p, torch.tensor([0, CAP]), AR(0, 2))
    assert_unchanged(before, p.host_buffers, _device(p))


def test_device_runs_sharing_one_row_are_refused_for_loads(pool: HostKVPool, index_check_path: str) -> None:
    """Two device page runs that share exactly one row (rows 8..11 and 11..14): a load would write row 11 twice.
    Backups only read device rows: there it is allowed."""
    d = torch.cat([AR(8, 12), AR(11, 15)])
    before = snapshot(pool.host_buffers, _device(pool))
    for op in ("load_layer", "load_all_layers"):
        with pytest.raises(DuplicateIndexError, match=r"device_indices repeat rows \[11\]"):
            OPS[op](pool, AR(0, 8), d)
    assert_unchanged(before, pool.host_buffers, _device(pool))
    pool.backup_all_layers(AR(0, 8), d)
