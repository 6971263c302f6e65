"""Layout descriptors: after a backup, host ``[s, l]`` (page_first) and ``[p, l, t]`` (page_first_direct)
hold device layer ``device_layers[l]``'s row of the slot's device index."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from hicache_core import HostKVPool, LayerMap, PoolSpec, create_registry
from hicache_core.layout import page_blocks
from hicache_page_first.layout import PAGE_FIRST, PAGE_FIRST_DIRECT

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = ["reference", "kernel"]
LAYER_MAPS = {
    "unsharded": LayerMap.unsharded(3),
    "sharded5of2r1-drafts": LayerMap.sharded_cp(5, 2, 1, draft_layers=1, pad_to_largest=True),
}


def _pool(layout: str, backend: str, lmap: LayerMap, ps: int) -> tuple[PoolSpec, dict, HostKVPool]:
    spec = PoolSpec.mla(layer_map=lmap, kv_lora_rank=256, qk_rope_head_dim=32, dtype=torch.bfloat16, page_size=ps,
                        capacity=4 * ps, device=DEVICE)
    gen = torch.Generator().manual_seed(ps)
    rows = [torch.randint(0, 256, (2 * spec.capacity, 576), dtype=torch.uint8, generator=gen).to(DEVICE)
            .view(torch.bfloat16) for _ in range(lmap.num_device_layers)]
    pool = HostKVPool(spec, layout, backend, {"kv": rows}, registry=create_registry(),
                      pin_memory=DEVICE.type == "cuda")
    return spec, {"kv": rows}, pool


def _backup(spec: PoolSpec, pool: HostKVPool) -> tuple[torch.Tensor, torch.Tensor]:
    host = torch.arange(spec.capacity)
    dev = torch.randperm(2 * spec.capacity, generator=torch.Generator().manual_seed(9))[: spec.capacity]
    pool.backup_all_layers(host, dev)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
    return host, dev


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("lmap", LAYER_MAPS.values(), ids=LAYER_MAPS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_page_first_host_is_slot_layer_row(backend, lmap, ps):
    spec, dev, pool = _pool("page_first", backend, lmap, ps)
    buf = pool.host_buffers["kv"]
    assert tuple(buf.shape) == (spec.capacity, lmap.host_layer_num, 288) and buf.dtype == torch.bfloat16
    host, rows = _backup(spec, pool)
    for s, d in zip(host.tolist(), rows.tolist()):
        for slot, layer in zip(lmap.host_slots, lmap.device_layers):
            assert torch.equal(buf[s, slot].view(torch.uint8), dev["kv"][layer][d].cpu().view(torch.uint8)), (s, slot)


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("lmap", LAYER_MAPS.values(), ids=LAYER_MAPS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_page_first_direct_host_is_page_layer_token_row(backend, lmap, ps):
    spec, dev, pool = _pool("page_first_direct", backend, lmap, ps)
    buf = pool.host_buffers["kv"]
    assert tuple(buf.shape) == (spec.num_pages, lmap.host_layer_num, ps, 288) and buf.dtype == torch.bfloat16
    host, rows = _backup(spec, pool)
    for s, d in zip(host.tolist(), rows.tolist()):
        p, t = divmod(s, ps)
        for slot, layer in zip(lmap.host_slots, lmap.device_layers):
            got = buf[p, slot, t].view(torch.uint8)
            assert torch.equal(got, dev["kv"][layer][d].cpu().view(torch.uint8)), (p, slot, t)


def test_page_blocks_are_contiguous_as_documented():
    """page_first: one page of all layers is one block; page_first_direct: one block per page too
    (``L`` layer blocks of ``page_size`` rows, adjacent)."""
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(3), kv_lora_rank=256, qk_rope_head_dim=32,
                        dtype=torch.bfloat16, page_size=4, capacity=16)
    for layout in (PAGE_FIRST, PAGE_FIRST_DIRECT):
        seg = layout.plan(spec).segments[0]
        assert page_blocks(seg, spec, 3) == [(0, 4 * 3 * 576)], layout.name
    direct = PAGE_FIRST_DIRECT.plan(spec).segments[0].addressing
    assert (direct.layer, direct.page, direct.token) == (4 * 576, 3 * 4 * 576, 576)
    first = PAGE_FIRST.plan(spec).segments[0].addressing
    assert (first.layer, first.page, first.token) == (576, 4 * 3 * 576, 3 * 576)
