"""LayerMap, shard_range, Component and PoolSpec: shapes, SGLang's sharding rule, errors."""

from __future__ import annotations

import math

import pytest
import torch

from hicache_core.errors import SpecError
from hicache_core.spec import MHA, MLA, Component, LayerMap, Part, PoolSpec, shard_range


# --- shard_range ------------------------------------------------------------


def sglang_shard_sizes(num_layers: int, shards: int) -> list[int]:
    """SGLang's rule stated as sizes: the first ``L % S`` ranks get one extra layer."""
    return [num_layers // shards + (1 if r < num_layers % shards else 0) for r in range(shards)]


@pytest.mark.parametrize("num_layers", [1, 2, 5, 7, 16, 61, 64, 95])
@pytest.mark.parametrize("shards", [1, 2, 3, 4, 5, 8])
def test_shard_range_matches_sglang_rule(num_layers: int, shards: int) -> None:
    ranges = [shard_range(num_layers, shards, r) for r in range(shards)]
    sizes = sglang_shard_sizes(num_layers, shards)
    assert [e - s for s, e in ranges] == sizes
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(ranges[r][1] == ranges[r + 1][0] for r in range(shards - 1))  # contiguous, in rank order


def test_shard_range_known_values() -> None:
    assert [shard_range(61, 4, r) for r in range(4)] == [(0, 16), (16, 31), (31, 46), (46, 61)]
    assert [shard_range(5, 2, r) for r in range(2)] == [(0, 3), (3, 5)]
    assert [shard_range(2, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]


@pytest.mark.parametrize("shards,rank", [(0, 0), (4, 4), (4, -1), (-2, 0)])
def test_shard_range_rejects_bad_rank(shards: int, rank: int) -> None:
    with pytest.raises(SpecError, match=rf"shard rank {rank} is outside .*pass 0 <= rank < shards"):
        shard_range(8, shards, rank)


# --- LayerMap -----------------------------------------------------------------


def test_unsharded() -> None:
    m = LayerMap.unsharded(4)
    assert (m.device_layers, m.host_layer_num, m.num_device_layers, m.sharded) == ((0, 1, 2, 3), 4, 4, False)
    assert [m.host_slot(d) for d in range(4)] == [0, 1, 2, 3]
    assert m.host_slot(4) is None and not m.owns(4) and m.owns(3)


def test_unsharded_with_draft_layers_appended() -> None:
    m = LayerMap.unsharded(3, draft_layers=2)
    assert (m.device_layers, m.host_layer_num, m.num_device_layers) == ((0, 1, 2, 3, 4), 5, 5)
    assert m.host_slot(4) == 4


@pytest.mark.parametrize("num_layers,shards", [(61, 4), (5, 2)])
def test_sharded_cp_every_rank(num_layers: int, shards: int) -> None:
    owned: list[int] = []
    for rank in range(shards):
        start, end = shard_range(num_layers, shards, rank)
        m = LayerMap.sharded_cp(num_layers, shards, rank)
        assert m.sharded and m.num_device_layers == num_layers
        assert m.device_layers == tuple(range(start, end))
        assert m.host_layer_num == end - start  # compacted
        assert [m.host_slot(d) for d in range(start, end)] == list(range(end - start))
        assert all(m.host_slot(d) is None for d in range(num_layers) if not start <= d < end)
        owned += m.device_layers
    assert owned == list(range(num_layers))  # every layer owned exactly once


def test_sharded_cp_61_over_4_sizes() -> None:
    assert [len(LayerMap.sharded_cp(61, 4, r).device_layers) for r in range(4)] == [16, 15, 15, 15]


@pytest.mark.parametrize("num_layers,shards", [(61, 4), (5, 2)])
def test_pad_to_largest(num_layers: int, shards: int) -> None:
    largest = math.ceil(num_layers / shards)
    for rank in range(shards):
        m = LayerMap.sharded_cp(num_layers, shards, rank, pad_to_largest=True)
        assert m.host_layer_num == largest
        assert len(m.device_layers) == sglang_shard_sizes(num_layers, shards)[rank]
        assert m.host_slot(m.device_layers[0]) == 0  # l - owned_start, as SGLang's _host_layer_index


def test_draft_layers_follow_target_layers_on_every_rank() -> None:
    for rank, (start, end) in enumerate([(0, 3), (3, 5)]):
        m = LayerMap.sharded_cp(5, 2, rank, draft_layers=2)
        assert m.num_device_layers == 7
        assert m.device_layers == tuple(range(start, end)) + (5, 6)
        assert m.host_layer_num == end - start + 2
        assert m.host_slot(5) == end - start and m.host_slot(6) == end - start + 1
    padded = LayerMap.sharded_cp(5, 2, 1, draft_layers=1, pad_to_largest=True)
    assert padded.device_layers == (3, 4, 5) and padded.host_layer_num == 4  # ceil(5/2) + 1


def test_single_shard_is_not_sharded() -> None:
    m = LayerMap.sharded_cp(6, 1, 0)
    assert not m.sharded and m.device_layers == tuple(range(6))


def test_restrict_compacts_host_slots() -> None:
    m = LayerMap.unsharded(4).restrict((0, 2))
    assert (m.device_layers, m.host_layer_num, m.num_device_layers, m.sharded) == ((0, 2), 2, 4, False)
    assert m.host_slot(2) == 1 and m.host_slot(1) is None


def test_restrict_on_a_shard_keeps_only_owned_layers() -> None:
    m = LayerMap.sharded_cp(5, 2, 1).restrict((0, 2, 4))  # rank 1 owns 3, 4
    assert (m.device_layers, m.host_layer_num, m.num_device_layers, m.sharded) == ((4,), 1, 5, True)


def test_component_map_restricts_components_on_some_layers() -> None:
    spec = PoolSpec.mla(
        layer_map=LayerMap.unsharded(4), kv_lora_rank=8, qk_rope_head_dim=4, dtype=torch.bfloat16,
        page_size=2, capacity=8, extra=(Component("index_k", 16, torch.uint8, layers=(1, 3)),),
    )
    assert spec.component_map("kv") is spec.layer_map
    idx = spec.component_map("index_k")
    assert idx.device_layers == (1, 3) and idx.host_slot(3) == 1
    assert spec.bytes_per_token == 24 * 4 + 16 * 2


def test_layer_map_errors() -> None:
    with pytest.raises(SpecError, match=r"device_layers has duplicates: \(0, 1, 1\); each device layer maps to one host slot"):
        LayerMap((0, 1, 1), 3, 4)
    with pytest.raises(SpecError, match=r"device_layers \(0, 4\) must lie in 0\.\.3 \(num_device_layers\)"):
        LayerMap((0, 4), 2, 4)
    with pytest.raises(SpecError, match=r"must lie in 0\.\.3"):
        LayerMap((-1,), 1, 4)
    with pytest.raises(SpecError, match=r"host_layer_num=1 is smaller than the 2 owned layers; pass host_layer_num >= len"):
        LayerMap((0, 1), 1, 4)
    with pytest.raises(SpecError, match="shard rank 2 is outside 0..1"):
        LayerMap.sharded_cp(5, 2, 2)


def test_layer_map_normalises_ids_and_compares_by_value() -> None:
    m = LayerMap([torch.tensor(2).item(), 0], 2, 3)  # type: ignore[arg-type]
    assert m.device_layers == (2, 0) and m.host_slot(2) == 0
    assert m == LayerMap((2, 0), 2, 3) and hash(m) == hash(LayerMap((2, 0), 2, 3))


# --- PoolSpec / Component -------------------------------------------------------


def test_mha_with_distinct_v_head_dim() -> None:
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(3), head_num=4, head_dim=128, v_head_dim=64,
                        dtype=torch.bfloat16, page_size=16, capacity=64)
    assert spec.kind == MHA and spec.head_num == 4
    k, v = spec.components
    assert (k.name, k.row_bytes, k.dtype, k.parts) == ("k", 4 * 128 * 2, torch.bfloat16, ())
    assert (v.name, v.row_bytes, v.dtype) == ("v", 4 * 64 * 2, torch.bfloat16)
    assert spec.bytes_per_token == 3 * (1024 + 512)
    assert spec.num_pages == 4 and not spec.sharded and spec.device == torch.device("cpu")
    same = PoolSpec.mha(layer_map=LayerMap.unsharded(3), head_num=4, head_dim=128, dtype=torch.bfloat16,
                        page_size=16, capacity=64)
    assert same.component("v").row_bytes == 1024


def test_mla_bf16_576_has_latent_and_rope_parts() -> None:
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64,
                        dtype=torch.bfloat16, page_size=64, capacity=128)
    assert spec.kind == MLA and len(spec.components) == 1
    kv = spec.component("kv")
    assert kv.row_bytes == 576 * 2 and kv.itemsize == 2
    assert kv.parts == (Part("latent", 0, 1024), Part("rope", 1024, 128))


def test_mla_fp8_656_packed_row_has_no_parts() -> None:
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64,
                        dtype=torch.uint8, page_size=64, capacity=128, row_bytes=656)
    kv = spec.component("kv")
    assert (kv.row_bytes, kv.dtype, kv.parts) == (656, torch.uint8, ())


def test_mla_fp8_unpacked_576_bytes() -> None:
    kv = PoolSpec.mla(layer_map=LayerMap.unsharded(1), kv_lora_rank=512, qk_rope_head_dim=64,
                      dtype=torch.uint8, page_size=1, capacity=4).component("kv")
    assert kv.row_bytes == 576 and kv.parts == (Part("latent", 0, 512), Part("rope", 512, 64))


def test_sharded_spec_and_describe() -> None:
    spec = PoolSpec.mla(layer_map=LayerMap.sharded_cp(61, 4, 1), kv_lora_rank=512, qk_rope_head_dim=64,
                        dtype=torch.bfloat16, page_size=64, capacity=128, device="meta")
    assert spec.sharded and spec.device == torch.device("meta")
    assert spec.describe() == "mla [kv:1152B] x 15 layers, page 64, sharded 15/61 layers"


@pytest.mark.parametrize("capacity,fix", [(30, "round it up to 32"), (2, "round it up to 4"), (0, "round it up to 4")])
def test_capacity_must_be_a_page_multiple(capacity: int, fix: str) -> None:
    with pytest.raises(SpecError, match=rf"capacity={capacity} must be a positive multiple of page_size=4; {fix}"):
        PoolSpec.mha(layer_map=LayerMap.unsharded(1), head_num=1, head_dim=8, dtype=torch.float16,
                     page_size=4, capacity=capacity)


@pytest.mark.parametrize("page_size", [0, -1])
def test_page_size_must_be_positive(page_size: int) -> None:
    with pytest.raises(SpecError, match=rf"page_size={page_size} must be >= 1"):
        PoolSpec.mha(layer_map=LayerMap.unsharded(1), head_num=1, head_dim=8, dtype=torch.float16,
                     page_size=page_size, capacity=8)


def test_duplicate_component_names() -> None:
    with pytest.raises(SpecError, match=r"names must be non-empty and unique, got \['k', 'v', 'k'\]"):
        PoolSpec.mha(layer_map=LayerMap.unsharded(1), head_num=1, head_dim=8, dtype=torch.float16,
                     page_size=1, capacity=8, extra=(Component("k", 16),))


def test_component_name_clashing_with_a_part_name() -> None:
    with pytest.raises(SpecError, match=r"unique, got \['kv', 'rope', 'latent', 'rope'\]"):
        PoolSpec.mla(layer_map=LayerMap.unsharded(1), kv_lora_rank=8, qk_rope_head_dim=4, dtype=torch.bfloat16,
                     page_size=1, capacity=8, extra=(Component("rope", 8),))


def test_no_components() -> None:
    with pytest.raises(SpecError, match="non-empty and unique, got \\[\\]"):
        PoolSpec(MHA, (), LayerMap.unsharded(1), 1, 8)


def test_component_layers_beyond_the_device_layers() -> None:
    with pytest.raises(SpecError, match=r"component 'idx' layers \(0, 3\) exceed the device layers"):
        PoolSpec.mla(layer_map=LayerMap.unsharded(3), kv_lora_rank=8, qk_rope_head_dim=4, dtype=torch.bfloat16,
                     page_size=1, capacity=8, extra=(Component("idx", 8, layers=(0, 3)),))


@pytest.mark.parametrize(
    "parts",
    [
        (Part("a", 0, 8), Part("b", 10, 6)),  # gap
        (Part("a", 0, 8), Part("b", 6, 10)),  # overlap
        (Part("b", 8, 8), Part("a", 0, 8)),  # out of order
        (Part("a", 0, 0), Part("b", 0, 16)),  # empty part
        (Part("a", 0, 7), Part("b", 7, 9)),  # splits a bf16 item
    ],
)
def test_parts_must_tile_the_row(parts: tuple[Part, ...]) -> None:
    with pytest.raises(SpecError, match="component 'kv': parts must tile the row in order with whole items"):
        Component("kv", 16, torch.bfloat16, parts)


def test_parts_must_cover_the_row() -> None:
    with pytest.raises(SpecError, match="component 'kv': parts cover 12 of 16 row bytes"):
        Component("kv", 16, torch.bfloat16, (Part("a", 0, 8), Part("b", 8, 4)))


@pytest.mark.parametrize("row_bytes", [0, -4, 6])
def test_row_bytes_must_be_positive_whole_items(row_bytes: int) -> None:
    with pytest.raises(SpecError, match=rf"row_bytes={row_bytes} must be a positive multiple of the torch.float32 item size 4"):
        Component("scale", row_bytes, torch.float32)


def test_unknown_component_lookup() -> None:
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(1), head_num=1, head_dim=8, dtype=torch.float16,
                        page_size=1, capacity=8)
    with pytest.raises(SpecError, match=r"no component 'kv'; the spec has \['k', 'v'\]"):
        spec.component("kv")


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Component("kv", 256, torch.bfloat16, (Part("latent", 0, 128.0), Part("rope", 128.0, 128))),
         r"part 'latent' nbytes must be an int, got float 128\.0"),
        (lambda: Component("kv", 256, torch.bfloat16, (("latent", 0, 128), ("rope", 128, 128))),  # type: ignore[arg-type]
         r"parts must be a tuple of Part\(name, offset, nbytes\)"),
        (lambda: Component("kv", 256, torch.bfloat16, layers=(0.5,)), r"layers entry must be an int, got float 0\.5"),
        (lambda: Component("kv", 256, torch.bfloat16, layers=5), r"layers must be a tuple of device layer ids or None"),  # type: ignore[arg-type]
        (lambda: PoolSpec.mha(layer_map=LayerMap.unsharded(2), head_num=-2, head_dim=-8, dtype=torch.bfloat16,
                              page_size=4, capacity=16), r"head_num=-2 must be >= 1"),
        (lambda: PoolSpec.mha(layer_map=LayerMap.unsharded(2), head_num=2, head_dim=8, v_head_dim=0,
                              dtype=torch.bfloat16, page_size=4, capacity=16), r"v_head_dim=0 must be >= 1"),
        (lambda: PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=72, qk_rope_head_dim=-8,
                              dtype=torch.bfloat16, page_size=4, capacity=16), r"qk_rope_head_dim=-8 must be >= 0"),
        (lambda: LayerMap.unsharded(4, draft_layers=-1), r"draft_layers=-1 must be >= 0"),
        (lambda: LayerMap.unsharded(-1), r"num_layers=-1 must be >= 0"),
        (lambda: LayerMap.sharded_cp(8, 2.0, 0), r"shards must be an int, got float 2\.0"),  # type: ignore[arg-type]
        (lambda: LayerMap.sharded_cp(8, 2, 0, draft_layers=-2), r"draft_layers=-2 must be >= 0"),
    ],
    ids=["float-part", "tuple-parts", "float-layer", "int-layers", "negative-heads", "zero-v-dim", "negative-rope",
         "negative-drafts", "negative-layers", "float-shards", "negative-sharded-drafts"],
)
def test_spec_inputs_that_would_multiply_out_or_truncate_are_refused(make, message) -> None:
    """Never accepted only to fail deep inside a layout (a float byte count in torch.empty) or quietly misread
    (negative dimensions whose product is positive, a negative draft count shrinking the map)."""
    with pytest.raises(SpecError, match=message):
        make()


def test_spec_parts_and_layers_take_any_integer_like_value() -> None:
    import numpy as np

    comp = Component("kv", 256, torch.bfloat16, [Part("latent", np.int64(0), np.int32(128)), Part("rope", 128, 128)],
                     layers=[np.int64(1), 0])
    assert comp.parts == (Part("latent", 0, 128), Part("rope", 128, 128)) and comp.layers == (1, 0)
    assert type(comp.parts[0].nbytes) is int and type(comp.layers[0]) is int


def test_component_lookups_name_the_fix_when_given_a_component() -> None:
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(2), head_num=2, head_dim=8, dtype=torch.float16, page_size=4,
                        capacity=16)
    with pytest.raises(SpecError, match="pass a component's name, not the Component: 'k'"):
        spec.component_map(spec.components[0])  # type: ignore[arg-type]
    assert spec.component_map("k") is spec.layer_map
