"""The DSA indexer sidecar (DSAIndexerPoolHost) of a layer-sharded DSA pool, rank 1 of 2.

Its rows are whole index pages (one row per page); SGLang's sharded backup
raises for page_first (kernel) and for everything but layer_first (direct).
"""

from __future__ import annotations

import pytest
import torch

import sglang_harness as H
from sglang_helpers import kernel_available, placed, fill_canary, layer_views, same_bytes, write_rows, settle

LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def make_indexer(layout: str):
    with H.sglang_runtime(hicache_mem_layout=layout):
        dev = H.make_layer_split_dsa_device_pool(size=192, page_size=64, layer_num=5, kv_lora_rank=64,
                                                 qk_rope_head_dim=32)
        kv_host = H.make_host_pool(dev)
        return dev, kv_host, H.make_dsa_indexer_host_pool(dev, kv_host)


@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_indexer_sharded_roundtrip(hooked, layout, io_backend):
    if io_backend == "kernel" and (why := kernel_available(layout, True)):
        pytest.skip(why)
    dev, kv_host, host = make_indexer(layout)
    ps = host.page_size
    layers = [(d, host._host_layer_index(d)) for d in host._live_target_layers]
    buf = dev.index_k_with_scale_buffer
    for d, _ in layers:
        buf[d].random_(0, 256)
    h = kv_host.alloc(2 * ps)[ps:]  # host page 1
    d1, d2 = torch.arange(2 * ps, 3 * ps), torch.arange(ps, 2 * ps)  # device pages 2 and 1
    hp, p1, p2 = h[:1] // ps, d1[:1] // ps, d2[:1] // ps
    expected = fill_canary(host)
    for d, hl in layers:
        views, index = layer_views("dsa_indexer", layout, expected, hl, hp, 1)
        write_rows(views, index, [buf[d][p1]])
    host.backup_from_device_all_layer(dev, *placed(io_backend, h, d1, H.DEVICE), io_backend)
    settle()
    assert same_bytes(host.index_k_with_scale_buffer, expected[0])
    before = {d: buf[d].clone() for d, _ in layers}
    for d, _ in layers:
        before[d][p2] = buf[d][p1]
    for layer_id in range(dev.layer_num):
        host.load_to_device_per_layer(dev, *placed(io_backend, h, d2, H.DEVICE), layer_id, io_backend)
    for d, _ in layers:
        assert same_bytes(buf[d], before[d])


def test_indexer_sharded_page_first_error_without_bridge(hooked, monkeypatch):
    dev, kv_host, host = make_indexer("page_first")
    h = kv_host.alloc(host.page_size)
    monkeypatch.setenv("HICACHE_SGLANG", "off")
    with pytest.raises(ValueError, match="Layer-sharded DSA indexer HiCache backup with page_first"):
        host.backup_from_device_all_layer(dev, h, torch.arange(64, 128), "kernel")
