"""The seed bug: SGLang raises ``Layer-sharded HiCache backup does not support layout:
page_first_kv_split`` for a layer-sharded device pool.  Here every io_backend serves it."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from hicache_core import HostKVPool, LayerMap, PoolSpec, create_registry  # noqa: E402
from hicache_kv_split.strategy import NAME  # noqa: E402

LORA, ROPE, PS, PAGES = 32, 8, 4, 3
ROWS = 2 * PS * PAGES + PS  # backup region, load region, a spare page
MAPS = {
    "8of2-rank1": lambda: LayerMap.sharded_cp(8, 2, 1),  # owns device layers 4..7
    "61of4-rank3": lambda: LayerMap.sharded_cp(61, 4, 3),  # uneven split: owns 46..60
}
EXPECTED_STRATEGY = {"kernel": NAME, "direct": "core.direct", "reference": "core.reference"}


def _spec(lmap: LayerMap, device: torch.device) -> PoolSpec:
    return PoolSpec.mla(layer_map=lmap, kv_lora_rank=LORA, qk_rope_head_dim=ROPE, dtype=torch.bfloat16,
                        page_size=PS, capacity=PS * PAGES, device=device)


def _device_buffers(spec: PoolSpec, split: bool, gen: torch.Generator, device: torch.device):
    """Random bf16 rows for the owned layers only (``None`` elsewhere: the rank holds no other layer)."""
    owned = set(spec.layer_map.device_layers)
    widths = {"latent": LORA, "rope": ROPE} if split else {"kv": LORA + ROPE}
    out = {name: [] for name in widths}
    for d in range(spec.layer_map.num_device_layers):
        for name, w in widths.items():
            raw = torch.randint(0, 256, (ROWS, 2 * w), dtype=torch.uint8, generator=gen)
            out[name].append(raw.view(torch.bfloat16).to(device) if d in owned else None)
    return out


def _whole_rows(dev, layer: int, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of ``layer`` as ``[n, (LORA+ROPE)*2]`` bytes, whether the device splits them or not."""
    if "kv" in dev:
        return dev["kv"][layer][rows].cpu().view(torch.uint8)
    return torch.cat([dev["latent"][layer][rows].cpu().view(torch.uint8),
                      dev["rope"][layer][rows].cpu().view(torch.uint8)], dim=1)


def _state(pool: HostKVPool, dev):
    host = {k: t.view(torch.uint8).clone() for k, t in pool.host_buffers.items()}
    return host, {k: [None if t is None else t.cpu().view(torch.uint8).clone() for t in lst] for k, lst in dev.items()}


def _same_state(a, b) -> bool:
    (ha, da), (hb, db) = a, b
    return all(torch.equal(ha[k], hb[k]) for k in ha) and all(
        (x is None and y is None) or torch.equal(x, y) for k in da for x, y in zip(da[k], db[k]))


@pytest.mark.parametrize("split_device", [False, True], ids=["device-whole-rows", "device-split-parts"])
@pytest.mark.parametrize("lmap_id", list(MAPS))
@pytest.mark.parametrize("io_backend", ["kernel", "direct", "reference"])
def test_seed_sharded_mla_kv_split_backup_then_load(io_backend, lmap_id, split_device, kv):
    device = kv.DEVICE
    registry = create_registry()
    spec = _spec(MAPS[lmap_id](), device)
    lmap = spec.layer_map
    assert spec.sharded and lmap.num_device_layers > len(lmap.device_layers)
    gen = torch.Generator().manual_seed(7)
    dev = _device_buffers(spec, split_device, gen, device)
    dev_ref = kv.clone_buffers(dev)
    pool = HostKVPool(spec, "page_first_kv_split", io_backend, dev, registry=registry,
                      pin_memory=device.type == "cuda")
    ref = HostKVPool(spec, "page_first_kv_split", "reference", dev_ref, registry=registry, strategy="core.reference")
    assert pool.strategy_name == EXPECTED_STRATEGY[io_backend]
    assert sorted(pool.host_buffers) == ["latent", "rope"]
    kv.fill_canary(pool)
    kv.fill_canary(ref)

    # host pages 2 and 0 (out of order); device rows from two disjoint regions
    h = torch.tensor([8, 9, 10, 11, 0, 1, 2, 3])
    src = torch.tensor([12, 13, 14, 15, 4, 5, 6, 7])
    dst = torch.tensor([20, 21, 22, 23, 16, 17, 18, 19])
    original = {d: _whole_rows(dev, d, src.to(device)) for d in lmap.device_layers}

    pool.backup_all_layers(h, src)
    ref.backup_all_layers(h, src)
    kv.sync()
    for name in ("latent", "rope"):
        assert torch.equal(pool.host_buffers[name].view(torch.uint8), ref.host_buffers[name].view(torch.uint8)), name
    # independent of the reference backend: latent/rope buffers hold the split device rows
    latent = pool.host_buffers["latent"].view(torch.uint8)  # [P, L_owned, PS, LORA*2]
    rope = pool.host_buffers["rope"].view(torch.uint8)
    assert latent.shape == (PAGES, len(lmap.device_layers), PS, LORA * 2)
    for slot, d in zip(lmap.host_slots, lmap.device_layers):
        got = torch.cat([latent[h // PS, slot, h % PS], rope[h // PS, slot, h % PS]], dim=1)
        assert torch.equal(got, original[d]), f"host rows of device layer {d}"
    assert bool((latent[1] == 0xA5).all()) and bool((rope[1] == 0xA5).all()), "host page 1 was not backed up"

    # unowned layer ids: False, and nothing moves
    state = _state(pool, dev)
    for layer in range(lmap.num_device_layers):
        if not lmap.owns(layer):
            assert pool.load_layer(layer, h, dst) is False
            assert pool.backup_layer(layer, h, src) is False
    kv.sync()
    assert _same_state(state, _state(pool, dev)), "an unowned layer id touched memory"

    # load each owned layer, layer by layer, into other device rows
    for d in lmap.device_layers:
        assert pool.load_layer(d, h, dst) is True
        ref.load_layer(d, h, dst)
    kv.sync()
    after = _state(pool, dev)[1]
    after_ref = _state(ref, dev_ref)[1]
    for name, lst in after.items():
        for d, rows in enumerate(lst):
            if rows is None:
                continue
            assert torch.equal(rows, after_ref[name][d]), f"{name}[{d}] differs from the reference backend"
            keep = torch.ones(ROWS, dtype=torch.bool)
            keep[dst] = False
            assert torch.equal(rows[keep], state[1][name][d][keep]), f"{name}[{d}]: rows outside dst changed"
    for d in lmap.device_layers:
        assert torch.equal(_whole_rows(dev, d, dst.to(device)), original[d]), f"device layer {d} round trip"
