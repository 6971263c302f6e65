"""The ``layer_first`` descriptor: buffer shapes, strides, and ``host[l, s]`` == device row after a reference backup."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from hicache_core import Component, HostKVPool, LayerMap, PoolSpec, create_registry
from hicache_core.testing.conformance import CASES, make_device_buffers
from hicache_layer_first.layout import LAYOUT

CASE_BY_ID = {c.id: c for c in CASES}


def test_plan_mha_shapes_and_strides():
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(3), head_num=2, head_dim=8, v_head_dim=4,
                        dtype=torch.float16, page_size=16, capacity=64)
    plan = LAYOUT.plan(spec)
    assert [(b.name, b.shape, b.dtype) for b in plan.buffers] == [
        ("k", (3, 64, 16), torch.float16), ("v", (3, 64, 8), torch.float16)]
    k, v = plan.segments
    assert (k.buffer, k.component, k.part, k.src_offset, k.width) == ("k", "k", None, 0, 32)
    assert (k.addressing.offset, k.addressing.layer, k.addressing.page, k.addressing.token,
            k.addressing.chunk_bytes) == (0, 64 * 32, 16 * 32, 32, 32)
    assert (v.addressing.layer, v.addressing.page, v.addressing.token, v.width) == (64 * 16, 16 * 16, 16, 16)


def test_plan_sharded_mla_compacts_host_layers():
    lmap = LayerMap.sharded_cp(5, 2, 1, draft_layers=1, pad_to_largest=True)  # owns 3, 4 and draft 5
    spec = PoolSpec.mla(layer_map=lmap, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                        page_size=4, capacity=8)
    (buf,) = LAYOUT.plan(spec).buffers
    assert (buf.name, buf.shape, buf.dtype) == ("kv", (lmap.host_layer_num, 8, 576), torch.bfloat16)
    assert lmap.host_layer_num == 4 and lmap.device_layers == (3, 4, 5)


def test_plan_extra_component_on_some_layers():
    extra = (Component("index_k", 128, torch.uint8, layers=(0, 2)),)
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(3), kv_lora_rank=256, qk_rope_head_dim=32,
                        dtype=torch.bfloat16, page_size=4, capacity=8, extra=extra)
    shapes = {b.name: b.shape for b in LAYOUT.plan(spec).buffers}
    assert shapes == {"kv": (3, 8, 288), "index_k": (2, 8, 128)}


@pytest.mark.parametrize("case_id", [
    "mla576-bf16-ps1", "mla576-bf16-ps16-strided", "mla576-bf16-ps64-splitdev",
    "mla576-fp8-ps16-sharded5of2r1", "mla-dsa-extra-ps4", "mha-bf16-ps16-vdim-strided",
    "mha-fp32-ps64-sharded3of2r0",
])
def test_host_row_equals_device_row_after_reference_backup(case_id):
    case = CASE_BY_ID[case_id]
    spec = case.build(torch.device("cpu"))
    dev = make_device_buffers(spec, case, torch.Generator().manual_seed(7))
    pool = HostKVPool(spec, "layer_first", "reference", dev, registry=create_registry(), pin_memory=False)
    for t in pool.host_buffers.values():
        t.view(torch.uint8).fill_(0)
    ps = spec.page_size
    host = torch.arange(spec.capacity - ps, spec.capacity)  # the last page
    device = torch.arange(ps) + 3 * ps
    pool.backup_all_layers(host, device)
    for comp in spec.components:
        lmap = spec.component_map(comp.name)
        hbuf = pool.host_buffers[comp.name]
        assert tuple(hbuf.shape) == (lmap.host_layer_num, spec.capacity, comp.row_bytes // comp.itemsize)
        for slot, layer in zip(lmap.host_slots, lmap.device_layers):
            if comp.name in dev:
                want = dev[comp.name][layer][device].reshape(ps, -1).view(torch.uint8)
            else:  # device keeps the parts in separate tensors: the host row is their concatenation
                want = torch.cat([dev[p.name][layer][device].reshape(ps, -1).view(torch.uint8) for p in comp.parts], 1)
            for i, s in enumerate(host.tolist()):
                assert torch.equal(hbuf[slot, s].view(torch.uint8), want[i]), (comp.name, slot, s)
        untouched = hbuf[:, : spec.capacity - ps].reshape(-1).view(torch.uint8)
        assert int(untouched.count_nonzero()) == 0
        if lmap.host_layer_num > len(lmap.device_layers):  # padded tail slot stays untouched
            assert int(hbuf[len(lmap.device_layers):].reshape(-1).view(torch.uint8).count_nonzero()) == 0
