"""Bad inputs to HostKVPool's transfers and page views that used to be accepted, or refused with an unclear error:
each is now refused with an error naming the argument and the fix (and writes nothing), or handled as documented."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from hicache_core import HostKVPool, LayerMap, PoolSpec
from hicache_core.errors import HostBufferError, IndexDtypeError

from fakes import pool_device

PS, PAGES, LAYERS, HEADS, HD, VD = 4, 4, 3, 2, 4, 2
CAP = PS * PAGES  # 16 host slots
ROWS = 2 * CAP  # device rows
AR = torch.arange

TARGETS = [(lay, be) for lay in ("layer_first", "page_first") for be in ("direct", "reference", "kernel")]

OPS: dict[str, Callable[[HostKVPool, Any, Any], Any]] = {
    "backup_all_layers": lambda p, h, d: p.backup_all_layers(h, d),
    "backup_layer": lambda p, h, d: p.backup_layer(1, h, d),
    "load_layer": lambda p, h, d: p.load_layer(1, h, d),
    "load_all_layers": lambda p, h, d: p.load_all_layers(h, d),
}


def make_spec(device: str = "cpu") -> PoolSpec:
    return PoolSpec.mha(layer_map=LayerMap.unsharded(LAYERS), head_num=HEADS, head_dim=HD, v_head_dim=VD,
                        dtype=torch.float16, page_size=PS, capacity=CAP, device=device)


def make_device(seed: int = 0, device: str = "cpu") -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return {"k": [torch.randn(ROWS, HEADS, HD, generator=gen).half().to(device) for _ in range(LAYERS)],
            "v": [torch.randn(ROWS, HEADS, VD, generator=gen).half().to(device) for _ in range(LAYERS)]}


def make_pool(layout: str, backend: str) -> HostKVPool:
    device = pool_device(backend)
    p = HostKVPool(make_spec(device), layout, backend, make_device(device=device), pin_memory=device == "cuda")
    gen = torch.Generator().manual_seed(1)
    for t in p.host_buffers.values():
        flat = t.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))
    return p


def every_byte(p: HostKVPool) -> list[torch.Tensor]:
    if p.spec.device.type == "cuda":
        torch.cuda.synchronize(p.spec.device)
    tensors = list(p.host_buffers.values()) + [t for seg in p.binding.segments for t in seg.device_rows]
    return [t.reshape(-1).contiguous().view(torch.uint8).clone() for t in tensors]


def assert_refused(p: HostKVPool, h: Any, d: Any, pattern: str) -> None:
    before = every_byte(p)
    for name, op in OPS.items():
        with pytest.raises(IndexDtypeError, match=pattern):
            op(p, h, d)
        after = every_byte(p)
        assert all(torch.equal(a, b) for a, b in zip(after, before)), f"{name} wrote bytes before raising"


def _sparse(values: torch.Tensor) -> torch.Tensor:
    return torch.sparse_coo_tensor(AR(values.numel()).unsqueeze(0), values, (values.numel(),),
                                   check_invariants=True)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"{t[0]}-{t[1]}")
@pytest.mark.parametrize("side", ["host_indices", "device_indices"])
def test_sparse_index_tensors_are_refused_clearly(target: tuple[str, str], side: str) -> None:
    """A sparse (COO) index tensor is 1-D int64 on the CPU; it used to pass the shape/dtype/device checks and fail
    inside the value check with torch's NotImplementedError ('aten::view' ... 'SparseCPU')."""
    p = make_pool(*target)
    h, d = AR(4, 8), AR(8, 12)
    h, d = (_sparse(h), d) if side == "host_indices" else (h, _sparse(d))
    assert_refused(p, h, d, rf"{side} must be a dense \(strided\) tensor of int32 or int64, got layout "
                            r"torch\.sparse_coo; convert it with \.to_dense\(\)")


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"{t[0]}-{t[1]}")
@pytest.mark.parametrize("side", ["host_indices", "device_indices"])
def test_lazily_negated_index_views_are_refused(target: tuple[str, str], side: str) -> None:
    """A lazily negated view reads as valid indices (the check passed) while its memory holds their negation, which
    the strategies read: the reference backend moved other rows than asked (negative rows wrap around), kernels
    moved nothing, silently."""
    p = make_pool(*target)
    h, d = AR(4, 8), AR(8, 12)
    if side == "host_indices":
        h = torch._neg_view(-h)
    else:
        d = torch._neg_view(-d)
    assert torch.equal(h, AR(4, 8)) and torch.equal(d, AR(8, 12))  # it reads as a valid pair
    assert_refused(p, h, d, rf"{side} is a lazily negated view \(is_neg\(\)\).*pass {side}\.resolve_neg\(\)")


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"{t[0]}-{t[1]}")
@pytest.mark.parametrize("side", ["host_indices", "device_indices"])
def test_zero_tensors_without_memory_are_refused(target: tuple[str, str], side: str) -> None:
    """A zero tensor (no storage, data_ptr 0) passed the checks where its values needed no Python list (device
    indices of a backup, which may repeat rows): the reference backend then read its null pointer and crashed the
    process (segfault); elsewhere it failed with torch's 'tolist() shouldn't be called on a tensor with unallocated
    storage'."""
    p = make_pool(*target)
    z = torch._efficientzerotensor(PS, dtype=torch.int64)
    h, d = (z, AR(8, 12)) if side == "host_indices" else (AR(0, 4), z)
    assert_refused(p, h, d, rf"{side} is a zero tensor without memory of its own; pass a materialised tensor")


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_set_page_from_a_view_of_host_memory_writes_what_it_read_as(layout: str) -> None:
    """``data`` viewing the pool's own host bytes (overlapping the page it writes): blocks written first used to change
    what later blocks read, so the page did not get what ``data`` read as at the call."""
    p = make_pool(layout, "reference")
    data = p.host_buffers["k"].view(-1).view(torch.uint8)[: p.page_bytes]  # overlaps page 1's 'k' bytes
    want = data.clone()
    p.set_page(1, data)
    assert torch.equal(p.get_page(1), want)


def test_interleaved_non_contiguous_host_buffers_are_named_non_contiguous() -> None:
    """Wrapped host buffers that are strided views (every other element of one allocation) share no byte, yet were
    reported as sharing memory ('pass separate tensors'); the real fault, non-contiguity, is now named."""
    spec = make_spec()
    planned = HostKVPool(spec, "layer_first", "reference", make_device(), pin_memory=False).host_buffers
    k_shape, v_shape = planned["k"].shape, planned["v"].shape
    both = torch.zeros(2 * planned["k"].numel(), dtype=torch.float16)
    host = {"k": both[0::2].view(k_shape), "v": both[1::2][: planned["v"].numel()].view(v_shape)}
    assert not host["k"].is_contiguous()
    with pytest.raises(HostBufferError, match=r"host buffer 'k' must be a contiguous CPU .*\(contiguous=False\)"):
        HostKVPool(spec, "layer_first", "reference", make_device(), host_buffers=host)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"{t[0]}-{t[1]}")
def test_valid_pairs_still_move_after_the_new_checks(target: tuple[str, str]) -> None:
    """The control: plain, strided and int32 index tensors still pass and move bytes."""
    p = make_pool(*target)
    before = every_byte(p)
    p.backup_all_layers(AR(0, 8), AR(0, 32)[::4].to(torch.int32))  # device rows 0, 4, ..., 28
    assert not all(torch.equal(a, b) for a, b in zip(every_byte(p), before))
