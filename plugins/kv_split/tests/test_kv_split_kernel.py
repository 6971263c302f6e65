"""``page_first_kv_split.kernel``: one device row split over two host buffers (``fuse_parts``), and which
segments form a launch group, each checked bit-exact against the reference (``kv.round_trip``).

What every row-copy kernel shares (tiles, tuning, words, masking, launches, pinning) is tested
once in ``tests/test_rowcopy.py``; the conformance cases in ``test_kv_split_conformance.py``.
"""

import torch
import pytest

from hicache_core import Component, HostKVPool, LayerMap, PoolSpec, StrategyInfo, create_registry, hookimpl
from hicache_kv_split.strategy import NAME, KVSplitKernelStrategy

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
REGISTRY = create_registry()


def _rand(rows: int, nbytes: int, gen: torch.Generator, *, pad: int = 0, lead: int = 0) -> torch.Tensor:
    """``[rows, nbytes]`` random bytes on the device, token stride ``nbytes + pad``, starting ``lead`` bytes in."""
    flat = torch.randint(0, 256, (lead + rows * (nbytes + pad),), dtype=torch.uint8, generator=gen).to(DEVICE)
    return flat[lead:].view(rows, nbytes + pad)[:, :nbytes]


def _mla_spec(lmap, ps=4, pages=3, *, lora=16, rope=4, dtype=torch.bfloat16, row_bytes=None, extra=()):
    return PoolSpec.mla(layer_map=lmap, kv_lora_rank=lora, qk_rope_head_dim=rope, dtype=dtype, page_size=ps,
                        capacity=ps * pages, row_bytes=row_bytes, device=DEVICE, extra=extra)


def _device(spec, gen, *, rows=28, pad=0, lead=0, split=False):
    """Random device rows of every component (or of each part with ``split``) on the layers that hold it."""
    out, owned = {}, set(spec.layer_map.device_layers)
    for comp in spec.components:
        pieces = [(p.name, p.nbytes) for p in comp.parts] if split and comp.parts else [(comp.name, comp.row_bytes)]
        for name, nbytes in pieces:
            out[name] = [_rand(rows, nbytes, gen, pad=pad, lead=lead).view(comp.dtype)
                         if d in owned and (comp.layers is None or d in comp.layers) else None
                         for d in range(spec.layer_map.num_device_layers)]
    return out


def _round_trip(kv, spec, dev, gen, *, pages=2, backend="kernel", registry=REGISTRY):
    """Host slots of ``pages`` random pages, backed up from and loaded into disjoint device pages (not page 0)."""
    ps = spec.page_size
    hp = torch.randperm(spec.num_pages, generator=gen)[:pages]
    dp = torch.randperm(2 * spec.num_pages, generator=gen)[: 2 * pages] + 1
    expand = lambda p: (p.unsqueeze(1) * ps + torch.arange(ps)).reshape(-1)  # noqa: E731
    pool = kv.round_trip(spec, dev, backend, registry, expand(hp), expand(dp[:pages]), expand(dp[pages:]))
    return [(g.names, g.width, g.split, g.word) for g in pool.binding.scratch[NAME].groups], pool


def test_mla_latent_and_rope_are_one_group_by_default(kv):
    gen = torch.Generator().manual_seed(0)
    spec = _mla_spec(LayerMap.unsharded(2))
    assert KVSplitKernelStrategy.fuse_parts and KVSplitKernelStrategy().fuse
    groups, pool = _round_trip(kv, spec, _device(spec, gen), gen)
    assert groups == [(("latent", "rope"), 5, 4, 8)]  # 32 + 8 bytes in 8-byte words: split after word 4
    assert sorted(pool.host_buffers) == ["latent", "rope"]


@pytest.mark.parametrize("lmap", [LayerMap.unsharded(2), LayerMap.sharded_cp(5, 2, 1)], ids=["unsharded", "sharded"])
def test_unfused_parts_are_a_group_each(kv, lmap):
    gen = torch.Generator().manual_seed(1)
    spec = _mla_spec(lmap)
    unfused = kv.registry_with("kernel-unfused", programs=1, fuse_parts=False)
    groups, _ = _round_trip(kv, spec, _device(spec, gen), gen, backend="kernel-unfused", registry=unfused)
    assert groups == [(("latent",), 4, 4, 8), (("rope",), 1, 1, 8)]


def test_parts_the_device_keeps_apart_are_not_fused(kv):
    gen = torch.Generator().manual_seed(2)
    spec = _mla_spec(LayerMap.sharded_cp(5, 2, 1))
    groups, _ = _round_trip(kv, spec, _device(spec, gen, split=True), gen)
    assert [g[0] for g in groups] == [("latent",), ("rope",)]


def test_packed_fp8_row_is_one_buffer(kv):
    gen = torch.Generator().manual_seed(3)
    spec = _mla_spec(LayerMap.unsharded(2), 2, dtype=torch.uint8, lora=512, rope=64, row_bytes=656)
    groups, pool = _round_trip(kv, spec, _device(spec, gen, rows=14), gen)
    assert sorted(pool.host_buffers) == ["kv"] and groups == [(("kv",), 82, 82, 8)]


def test_mha_k_and_v_of_different_widths(kv):
    gen = torch.Generator().manual_seed(4)
    spec = PoolSpec.mha(layer_map=LayerMap.sharded_cp(3, 2, 1), head_num=2, head_dim=8, v_head_dim=4,
                        dtype=torch.float16, page_size=4, capacity=12, device=DEVICE)
    groups, pool = _round_trip(kv, spec, _device(spec, gen), gen)
    assert [g[:2] for g in groups] == [(("k",), 4), (("v",), 2)] and pool.host_buffers["v"].shape == (3, 1, 4, 8)


def test_dsa_extras_on_layer_subsets_sharded(kv):
    """Indexer key and fp32 scale live on layers 0 and 2 only; rank 1 of 2 over 4 layers owns 2 and 3."""
    gen = torch.Generator().manual_seed(5)
    extra = (Component("index_k", 128, torch.uint8, layers=(0, 2)),
             Component("index_scale", 4, torch.float32, layers=(0, 2)))
    spec = _mla_spec(LayerMap.sharded_cp(4, 2, 1), extra=extra)
    groups, pool = _round_trip(kv, spec, _device(spec, gen), gen)
    assert [g[0] for g in groups] == [("latent", "rope"), ("index_k",), ("index_scale",)]
    assert pool.host_buffers["index_k"].shape == (3, 1, 4, 128)


@pytest.mark.parametrize("lora, rope, pad, lead, word, vec", [
    (13, 5, 0, 0, 1, 1),  # odd row and part sizes: byte accesses
    (16, 4, 0, 2, 2, 1),  # device rows start 2 bytes off an 8-byte boundary
    (8, 4, 4, 0, 4, 1),  # latent alone could use 8-byte words, rope only 4: the fused group narrows to 4
    (24, 8, 0, 0, 8, 1),  # 24-byte host rows: no 16-byte vector hint
    (16, 16, 0, 0, 8, 2),  # every row base of both parts 16-byte aligned: 2-word vectors
    (16, 16, 0, 8, 8, 1),  # device rows 8 bytes off
], ids=["odd-sizes", "odd-alignment", "narrowed-pair", "aligned", "vector", "vector-shifted"])
def test_fused_group_takes_one_access_word(kv, lora, rope, pad, lead, word, vec):
    gen = torch.Generator().manual_seed(6)
    spec = _mla_spec(LayerMap.unsharded(2), 3, 4, lora=lora, rope=rope, dtype=torch.uint8)
    groups, pool = _round_trip(kv, spec, _device(spec, gen, rows=27, pad=pad, lead=lead), gen, pages=3)
    assert groups == [(("latent", "rope"), (lora + rope) // word, lora // word, word)]
    assert pool.binding.scratch[NAME].groups[0].vec == vec


class _LayerMajor(KVSplitKernelStrategy):
    name = "test.kv_layer_major"
    entries_inner = False


class _LayerMajorPlugin:
    """``_LayerMajor`` under an io_backend of its own (the shipped strategy keeps ``kernel``)."""

    @staticmethod
    @hookimpl
    def hicache_register_strategies(register):
        register(StrategyInfo(_LayerMajor.name, "layer_major", ("page_first_kv_split",), _LayerMajor))


@pytest.mark.parametrize("io_backend, entries_inner", [("kernel", True), ("layer_major", False)])
def test_work_item_order_is_the_strategy_s(io_backend, entries_inner):
    """The kernel walks work items in its strategy's order (``ENTRIES_INNER``): by default the layers of one token
    before the next token.  Seen on one program, one token per tile, row loads (no page loads, no TMA), device
    layer 1 a view of layer 0 one row on: device row 2 is written by (token 0, layer 1) and by (token 1, layer 0);
    the later item wins."""
    registry = create_registry(plugins=[("layer_major", _LayerMajorPlugin())])
    spec = PoolSpec("mla", (Component("kv", 16, torch.uint8),), LayerMap.unsharded(2), 1, 8, DEVICE)
    rows = torch.zeros(9, 16, dtype=torch.uint8, device=DEVICE)
    pool = HostKVPool(spec, "page_first_kv_split", io_backend, {"kv": [rows[:8], rows[1:]]}, registry=registry,
                      pin_memory=DEVICE.type == "cuda",
                      strategy_options={"programs": 1, "tile_bytes": 1, "pages": False, "tma": False})
    filler = {"kv": [torch.full((8, 16), v, dtype=torch.uint8, device=DEVICE) for v in (10, 11)]}
    HostKVPool(spec, "page_first_kv_split", "reference", filler, host_buffers=pool.host_buffers,
               registry=registry).backup_all_layers(torch.arange(8), torch.arange(8))  # host layer l holds 10 + l
    pool.load_all_layers(torch.tensor([3, 4]), torch.tensor([1, 2]))
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert pool.strategy_name == (NAME if entries_inner else _LayerMajor.name)
    assert rows[:, 0].tolist() == [0, 10, 10 if entries_inner else 11, 11, 0, 0, 0, 0, 0]
