"""A layer-sharded rank whose pool has a component on none of its layers (an extra component of other layers, e.g. a
DSA indexer's on a context-parallel rank): every backend builds the pool, and the kernels move the other components
byte for byte as the reference backend; and the kernels' index copies are never reused after a ``.data`` swap."""

from __future__ import annotations

import pytest
import torch

from hicache_core import HostKVPool, LayerMap, PoolSpec, create_registry
from hicache_core.kernel_support import IndexMemo, kernel_indices
from hicache_core.spec import Component

REG = create_registry()
ROWS = 8


#: A CPU pool's kernel needs Triton's interpreter, fixed when Triton was first imported: on a GPU machine, the GPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PINNED = DEVICE == "cuda"


def _spec() -> PoolSpec:
    # rank 1 of 2 owns device layers 2 and 3; component "e" lives on layer 0 only
    return PoolSpec.mha(layer_map=LayerMap.sharded_cp(4, 2, 1), head_num=1, head_dim=8, dtype=torch.float16, page_size=2,
                        capacity=8, extra=(Component("e", 16, torch.float16, layers=(0,)),), device=DEVICE)


def _device() -> dict[str, list[torch.Tensor | None]]:
    g = torch.Generator().manual_seed(0)
    dev: dict[str, list[torch.Tensor | None]] = {
        n: [torch.randint(0, 100, (ROWS, 8), generator=g).half().to(DEVICE) for _ in range(4)] for n in ("k", "v")}
    dev["e"] = [torch.randint(0, 100, (ROWS, 8), generator=g).half().to(DEVICE)] + [None] * 3
    return dev


def _sync() -> None:
    if PINNED:
        torch.cuda.synchronize()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_first_kv_split"])
@pytest.mark.parametrize("backend", ["reference", "direct", "kernel"])
def test_a_component_on_no_owned_layer_moves_nothing_and_stops_nothing(monkeypatch, layout, backend):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if backend == "kernel":
        pytest.importorskip("triton")
    spec, dev = _spec(), _device()
    if REG.try_resolve(spec, layout, backend)[0] is None:
        pytest.skip(f"{backend} does not serve {layout} for this spec")
    pool = HostKVPool(spec, layout, backend, dev, registry=REG, pin_memory=PINNED)
    ref = HostKVPool(spec, layout, "reference", dev, registry=REG, strategy="core.reference", pin_memory=PINNED)
    for p in (pool, ref):
        for t in p.host_buffers.values():
            t.view(torch.uint8).fill_(0xA5)
        p.backup_all_layers(torch.arange(4), torch.tensor([2, 3, 4, 5]))
    _sync()
    for page in range(spec.num_pages):
        assert torch.equal(pool.get_page(page).view(torch.uint8), ref.get_page(page).view(torch.uint8)), page
    assert not bool((pool.get_page(0).view(torch.uint8) == 0xA5).all())  # the owned layers' rows were backed up
    before = {n: [None if t is None else t.clone() for t in lst] for n, lst in dev.items()}
    pool.load_layer(2, torch.arange(2), torch.tensor([6, 7]))
    _sync()
    for n in ("k", "v"):
        assert torch.equal(dev[n][2][6:8], before[n][2][2:4])  # host slots 0, 1 hold rows 2, 3 of layer 2
        assert torch.equal(dev[n][2][:6], before[n][2][:6]) and torch.equal(dev[n][3], before[n][3])
    assert torch.equal(dev["e"][0], before["e"][0])


def test_an_engine_allocated_empty_host_buffer_for_such_a_component(monkeypatch):
    """The engine passes its own (empty) host buffer for the component: an empty view anywhere in an allocation."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    backing = torch.empty(64, dtype=torch.float16)  # unpinned: an empty view of it holds no byte to pin
    host = {"k": torch.empty(2, 8, 8, dtype=torch.float16, pin_memory=PINNED),
            "v": torch.empty(2, 8, 8, dtype=torch.float16, pin_memory=PINNED), "e": backing[8:8].view(0, 8, 8)}
    pool = HostKVPool(_spec(), "layer_first", "kernel", _device(), host_buffers=host, registry=REG, pin_memory=PINNED)
    pool.backup_all_layers(torch.arange(4), torch.tensor([2, 3, 4, 5]))
    _sync()


def test_an_index_copy_is_not_reused_after_a_data_swap():
    """``t.data = other`` keeps the tensor object and its version counter: the kernels' index memo compares address
    and length too, so the new values are copied (the old copy would move other rows, and read past its end)."""
    memo = IndexMemo()
    other = torch.device("meta")  # a device other than the tensor's takes the memo path (CUDA in real use)
    t = torch.arange(4, dtype=torch.int64)
    first = kernel_indices(t, other, memo)
    assert kernel_indices(t, other, memo) is first
    t.data = torch.arange(100, 108)
    again = kernel_indices(t, other, memo)
    assert again is not first and again.numel() == 8
