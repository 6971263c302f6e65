"""SGLang's real host pools, every layout x io_backend, served by hicache through the hooks.

``backup_from_device_all_layer`` then ``load_to_device_per_layer`` for every
layer id into other device slots; host rows are read back the way SGLang
indexes its own host tensors; canaries guard every untouched byte.
"""

from __future__ import annotations

import pytest
import torch

import sglang_harness as H
from sglang_helpers import kernel_available, placed, fill_canary, host_tensors, layer_views, same_bytes, write_rows, settle

LAYOUTS = H.LAYOUTS
SEED_ERROR = "Layer-sharded HiCache backup does not support layout: page_first_kv_split"


def _u8(ts):
    return [t.view(torch.uint8) for t in ts]


def make_pools(kind: str, layout: str):
    """(device pool, host pool) built by SGLang's own builder inside a published runtime."""
    with H.sglang_runtime(hicache_mem_layout=layout):
        if kind == "mla":
            dev = H.make_mla_device_pool(size=64, page_size=4, layer_num=3, kv_lora_rank=32, qk_rope_head_dim=16)
        elif kind == "mla_sharded":
            dev = H.make_layer_split_dsa_device_pool(size=192, page_size=64, layer_num=5, kv_lora_rank=64,
                                                     qk_rope_head_dim=32)
        else:
            dev = H.make_mha_device_pool(size=64, page_size=4, layer_num=3, head_num=2, head_dim=16)
        return dev, H.make_host_pool(dev)


def owned_layers(kind: str, host, dev) -> list[tuple[int, int]]:
    """(device layer id, host layer) pairs SGLang stores for this rank."""
    if kind == "mha":
        return [(i, i) for i in range(dev.layer_num)]
    return [(i, host._host_layer_by_controller[i]) for i in host._target_layer_indices]


def device_layer(kind: str, dev, layer: int) -> list[torch.Tensor]:
    return _u8([dev.k_buffer[layer], dev.v_buffer[layer]] if kind == "mha" else [dev.kv_buffer[layer]])


def slots(host, dev):
    """Host slots (pages out of order) and two disjoint sets of device slots."""
    ps = host.page_size
    n = 2 if ps < 16 else 1
    alloc = host.alloc((n + 1) * ps)
    h = torch.cat([alloc[(n - i) * ps : (n - i + 1) * ps] for i in range(n)])
    pages = torch.arange(ps)
    d1 = torch.cat([pages + ps * (2 * i + 3) for i in range(n)])
    d2 = torch.cat([pages + ps * (2 * (n - i)) for i in range(n)])
    assert int(max(d1.max(), d2.max())) < dev.size + ps
    return h, d1, d2


def random_pools(kind: str, layout: str):
    """Pools with random device bytes in every owned layer: ``(dev, host, layers, h, d1, d2)`` (see :func:`slots`)."""
    dev, host = make_pools(kind, layout)
    layers = owned_layers(kind, host, dev)
    for d, _ in layers:
        for t in device_layer(kind, dev, d):
            t.random_(0, 256)
    return (dev, host, layers, *slots(host, dev))


def roundtrip(kind: str, layout: str, io_backend: str) -> None:
    dev, host, layers, h, d1, d2 = random_pools(kind, layout)
    expected = _u8(fill_canary(host))
    view_kind = "mha" if kind == "mha" else "mla"
    for d, hl in layers:
        views, index = layer_views(view_kind, layout, expected, hl, h, host.page_size)
        write_rows(views, index, [t[d1] for t in device_layer(kind, dev, d)])

    host.backup_from_device_all_layer(dev, *placed(io_backend, h, d1, H.DEVICE), io_backend)
    settle()
    for got, want in zip(host_tensors(host), expected):
        assert same_bytes(got, want), f"host bytes differ from SGLang's layout after backup ({layout}, {io_backend})"

    before = {d: [t.clone() for t in device_layer(kind, dev, d)] for d, _ in layers}
    for d, _ in layers:
        for want, src in zip(before[d], device_layer(kind, dev, d)):
            want[d2] = src[d1]
    for layer_id in range(dev.layer_num):
        host.load_to_device_per_layer(dev, *placed(io_backend, h, d2, H.DEVICE), layer_id, io_backend)
    for d, _ in layers:
        for got, want in zip(device_layer(kind, dev, d), before[d]):
            assert same_bytes(got, want), f"device layer {d} differs after load ({layout}, {io_backend})"


@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mla", "mla_sharded", "mha"])
def test_roundtrip(hooked, kind, layout, io_backend):
    if io_backend == "kernel":
        why = kernel_available(layout, kind == "mla_sharded")
        if why:
            pytest.skip(why)
    roundtrip(kind, layout, io_backend)


def test_seed_mla_sharded_page_first_kv_split(hooked, monkeypatch):
    """The seed cell: layer-sharded MLA (LayerSplitDSATokenToKVPool rank 1 of 2), page_first_kv_split.

    Served by hicache; with the bridge off, SGLang's own error comes back.
    """
    roundtrip("mla_sharded", "page_first_kv_split", "direct")
    if kernel_available("page_first_kv_split", True) is None:
        roundtrip("mla_sharded", "page_first_kv_split", "kernel")
    dev, host = make_pools("mla_sharded", "page_first_kv_split")
    assert tuple(host.k_buffer.shape) == (host.page_num, host.layer_num, 64, 1, 64)
    assert tuple(host.v_buffer.shape) == (host.page_num, host.layer_num, 64, 1, 32)
    assert host.kv_buffer is host.k_buffer and host.token_stride_size == 96 * 2
    h, d1, _ = slots(host, dev)
    monkeypatch.setenv("HICACHE_SGLANG", "off")
    with pytest.raises(ValueError, match=SEED_ERROR):
        host.backup_from_device_all_layer(dev, h, d1, "kernel")
    with pytest.raises(ValueError, match=SEED_ERROR):
        host._backup_from_device_per_layer(h, d1, 3, "kernel")
    with pytest.raises(ValueError, match="Layer-sharded direct HiCache backup only supports layer_first"):
        host.backup_from_device_all_layer(dev, h, d1, "direct")


def test_draft_layer_appended(hooked):
    """A packed MTP draft pool: host layer ``target_layer_num``; loaded with ``is_draft`` and id ``L + 0``."""
    with H.sglang_runtime(hicache_mem_layout="page_first"):
        dev = H.make_mla_device_pool(size=64, page_size=4, layer_num=2, kv_lora_rank=32, qk_rope_head_dim=16)
        draft = H.make_mla_device_pool(size=64, page_size=4, layer_num=1, kv_lora_rank=32, qk_rope_head_dim=16)
        host = H.make_host_pool(dev, mtp_draft_device_pools=(draft,))
    assert host.layer_num == 3
    for t in (*dev.kv_buffer, *draft.kv_buffer):
        t.view(torch.uint8).random_(0, 256)
    h, d1, d2 = slots(host, dev)
    fill_canary(host)
    host.backup_from_device_all_layer(dev, h, d1, "direct")
    settle()
    assert same_bytes(host.kv_buffer[h, 2], draft.kv_buffer[0][d1])
    src = draft.kv_buffer[0][d1].clone()
    host.load_to_device_per_layer(draft, h, d2, 2, "direct", is_draft=True)
    assert same_bytes(draft.kv_buffer[0][d2], src)


@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
def test_draft_after_padding_on_a_sharded_rank(hooked, io_backend):
    """LayerSplitDSA rank 1 of 2 over 5 layers owns layers 3, 4 (host 0, 1); host layer 2 is SGLang's
    padding (ceil(5/2) = 3 target layers) and the packed MTP draft is host layer 3 (controller id 5)."""
    if io_backend == "kernel" and (why := kernel_available("page_first", True)):
        pytest.skip(why)
    with H.sglang_runtime(hicache_mem_layout="page_first"):
        dev = H.make_layer_split_dsa_device_pool(size=192, page_size=64, layer_num=5, kv_lora_rank=64,
                                                 qk_rope_head_dim=32)
        draft = H.make_mla_device_pool(size=192, page_size=64, layer_num=1, kv_lora_rank=64, qk_rope_head_dim=32)
        host = H.make_host_pool(dev, mtp_draft_device_pools=(draft,))
    assert host.layer_num == 4 and host._host_layer_by_controller == {3: 0, 4: 1, 5: 3}
    sources = {0: dev.kv_buffer[3], 1: dev.kv_buffer[4], 3: draft.kv_buffer[0]}
    for t in sources.values():
        t.view(torch.uint8).random_(0, 256)
    h, d1, d2 = slots(host, dev)
    (expected,) = _u8(fill_canary(host))
    for hl, src in sources.items():
        expected[h, hl] = src.view(torch.uint8)[d1].reshape(expected[h, hl].shape).to(expected.device)
    host.backup_from_device_all_layer(dev, *placed(io_backend, h, d1, H.DEVICE), io_backend)
    settle()
    assert same_bytes(host.kv_buffer, expected), "owned layers, padding and draft slot as SGLang lays them out"
    want = draft.kv_buffer[0].clone()
    want[d2] = want[d1]
    host.load_to_device_per_layer(draft, *placed(io_backend, h, d2, H.DEVICE), 5, io_backend, is_draft=True)
    assert same_bytes(draft.kv_buffer[0], want)


def test_off_runs_sglang_original(hooked, monkeypatch):
    """``off``: SGLang's stock dispatch (MLA page_first + direct is one of its ValueError cells)."""
    monkeypatch.setenv("HICACHE_SGLANG", "off")
    dev, host = make_pools("mla", "page_first")
    h, d1, _ = slots(host, dev)
    with pytest.raises(ValueError, match="Unsupported layout: page_first"):
        host.backup_from_device_all_layer(dev, h, d1, "direct")
    monkeypatch.setenv("HICACHE_SGLANG", "all")
    host.backup_from_device_all_layer(dev, h, d1, "direct")
    settle()


def test_off_leaves_kv_split_allocation_to_sglang(hooked, monkeypatch):
    monkeypatch.setenv("HICACHE_SGLANG", "off")
    with pytest.raises(ValueError, match="Unsupported layout: page_first_kv_split"):
        make_pools("mha", "page_first_kv_split")


def test_unknown_io_backend_runs_original(hooked):
    dev, host = make_pools("mla", "layer_first")
    h, d1, _ = slots(host, dev)
    with pytest.raises(ValueError, match="Unsupported IO backend: bogus"):
        host.backup_from_device_all_layer(dev, h, d1, "bogus")
