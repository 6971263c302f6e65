"""Targeted tests of the kv_split kernel strategy: grouping, access words, indices, page sizes,
masking of out-of-range indices, the SM budget, pinned memory."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from hicache_core import Component, HostBufferError, HostKVPool, LayerMap, PoolSpec, create_registry  # noqa: E402
from hicache_core.testing.conformance import CANARY  # noqa: E402
from hicache_kv_split.layout import LAYOUT  # noqa: E402
from hicache_kv_split.strategy import BACKUP_PROGRAMS, LOAD_PROGRAMS, NAME, KVSplitKernelStrategy  # noqa: E402
from hicache_core.kernel_support import Budget  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _rand(rows: int, nbytes: int, gen: torch.Generator, *, pad: int = 0, lead: int = 0) -> torch.Tensor:
    """``[rows, nbytes]`` random bytes on the device, token stride ``nbytes + pad``, starting ``lead`` bytes in."""
    flat = torch.randint(0, 256, (lead + rows * (nbytes + pad),), dtype=torch.uint8, generator=gen).to(DEVICE)
    return flat[lead:].view(rows, nbytes + pad)[:, :nbytes]


def _mla_spec(lmap, ps, pages, *, lora=16, rope=4, dtype=torch.bfloat16, row_bytes=None, extra=()):
    return PoolSpec.mla(layer_map=lmap, kv_lora_rank=lora, qk_rope_head_dim=rope, dtype=dtype, page_size=ps,
                        capacity=ps * pages, row_bytes=row_bytes, device=DEVICE, extra=extra)


def _mla_device(spec, gen, *, rows, pad=0, lead=0, split=False):
    comp = spec.component("kv")
    owned = set(spec.layer_map.device_layers)
    pieces = [(p.name, p.nbytes) for p in comp.parts] if split else [("kv", comp.row_bytes)]
    out = {}
    for name, nbytes in pieces:
        out[name] = [_rand(rows, nbytes, gen, pad=pad, lead=lead).view(comp.dtype) if d in owned else None
                     for d in range(spec.layer_map.num_device_layers)]
    return out


def _pages(spec, gen, k):
    """Host slots of ``k`` random pages and two disjoint device row sets (rows < page_size stay unused)."""
    ps = spec.page_size
    hp = torch.randperm(spec.num_pages, generator=gen)[:k]
    dp = torch.randperm(2 * spec.num_pages, generator=gen)[: 2 * k] + 1
    off = torch.arange(ps)
    expand = lambda p: (p.unsqueeze(1) * ps + off).reshape(-1)  # noqa: E731
    return expand(hp), expand(dp[:k]), expand(dp[k:])


def _groups(pool):
    return pool.binding.scratch["kv_split.kernel"].groups


# -- row groups --------------------------------------------------------------------------------------------
def test_mla_latent_and_rope_share_one_launch(kv):
    gen = torch.Generator().manual_seed(0)
    spec = _mla_spec(LayerMap.unsharded(2), 4, 3)
    pool = kv.round_trip(spec, _mla_device(spec, gen, rows=28), "kernel", create_registry(), *_pages(spec, gen, 2))
    [g] = _groups(pool)
    assert (g.names, g.row, g.split, g.word) == (("latent", "rope"), 5, 4, 8)  # 32 + 8 bytes in 8-byte words


def test_device_split_parts_launch_per_part(kv):
    gen = torch.Generator().manual_seed(1)
    spec = _mla_spec(LayerMap.sharded_cp(5, 2, 1), 4, 3)
    dev = _mla_device(spec, gen, rows=28, split=True)
    pool = kv.round_trip(spec, dev, "kernel", create_registry(), *_pages(spec, gen, 2))
    assert [g.names for g in _groups(pool)] == [("latent",), ("rope",)]


def test_packed_fp8_mla_row_is_one_buffer(kv):
    gen = torch.Generator().manual_seed(2)
    spec = _mla_spec(LayerMap.unsharded(2), 2, 3, dtype=torch.uint8, lora=512, rope=64, row_bytes=656)
    pool = kv.round_trip(spec, _mla_device(spec, gen, rows=14), "kernel", create_registry(), *_pages(spec, gen, 2))
    assert sorted(pool.host_buffers) == ["kv"]
    assert [(g.names, g.row) for g in _groups(pool)] == [(("kv",), 82)]


def test_mha_k_and_v_with_different_head_dims(kv):
    gen = torch.Generator().manual_seed(3)
    spec = PoolSpec.mha(layer_map=LayerMap.sharded_cp(3, 2, 1), head_num=2, head_dim=8, v_head_dim=4,
                        dtype=torch.float16, page_size=4, capacity=12, device=DEVICE)
    dev = {c: [_rand(28, spec.component(c).row_bytes, gen).view(torch.float16) for _ in range(3)] for c in ("k", "v")}
    pool = kv.round_trip(spec, dev, "kernel", create_registry(), *_pages(spec, gen, 2))
    assert [(g.names, g.row) for g in _groups(pool)] == [(("k",), 4), (("v",), 2)]
    assert pool.host_buffers["v"].shape == (3, 1, 4, 8)


def test_dsa_extras_on_layer_subsets_sharded(kv):
    """Indexer key and fp32 scale live on layers 0 and 2 only; rank 1 of 2 over 4 layers owns 2 and 3."""
    gen = torch.Generator().manual_seed(4)
    extra = (Component("index_k", 128, torch.uint8, layers=(0, 2)), Component("index_scale", 4, torch.float32, layers=(0, 2)))
    spec = _mla_spec(LayerMap.sharded_cp(4, 2, 1), 4, 3, extra=extra)
    dev = _mla_device(spec, gen, rows=28)
    for comp in extra:
        dev[comp.name] = [_rand(28, comp.row_bytes, gen).view(comp.dtype) if d == 2 else None for d in range(4)]
    pool = kv.round_trip(spec, dev, "kernel", create_registry(), *_pages(spec, gen, 2))
    assert pool.host_buffers["index_k"].shape == (3, 1, 4, 128)
    assert [g.names for g in _groups(pool)] == [("latent", "rope"), ("index_k",), ("index_scale",)]


# -- access words ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lora,rope,pad,lead,word", [
    (13, 5, 0, 0, 1),  # odd row and part sizes: byte accesses
    (16, 4, 0, 2, 2),  # device rows start 2 bytes off an 8-byte boundary
    (8, 4, 4, 0, 4),  # latent alone could use 8-byte words, rope only 4: the fused group narrows to 4
    (24, 8, 0, 0, 8),
], ids=["odd-sizes", "odd-alignment", "narrowed-pair", "aligned"])
def test_access_word_fallback(kv, lora, rope, pad, lead, word):
    gen = torch.Generator().manual_seed(5)
    spec = _mla_spec(LayerMap.unsharded(2), 3, 4, lora=lora, rope=rope, dtype=torch.uint8)
    dev = _mla_device(spec, gen, rows=27, pad=pad, lead=lead)
    pool = kv.round_trip(spec, dev, "kernel", create_registry(), *_pages(spec, gen, 3))
    [g] = _groups(pool)
    assert (g.names, g.word) == (("latent", "rope"), word)


def test_vector_hint_only_when_16_byte_aligned(kv):
    gen = torch.Generator().manual_seed(6)
    spec = _mla_spec(LayerMap.unsharded(1), 4, 2, lora=16, rope=16, dtype=torch.uint8)  # 16 + 16 bytes
    aligned = HostKVPool(spec, LAYOUT.name, "kernel", _mla_device(spec, gen, rows=20), registry=create_registry(),
                         pin_memory=DEVICE.type == "cuda")
    shifted = HostKVPool(spec, LAYOUT.name, "kernel", _mla_device(spec, gen, rows=20, lead=8),
                         registry=create_registry(), pin_memory=DEVICE.type == "cuda")
    assert [(g.word, g.vec) for g in _groups(aligned)] == [(8, 2)]
    assert [(g.word, g.vec) for g in _groups(shifted)] == [(8, 1)]


# -- indices and page sizes ----------------------------------------------------------------------------------
@pytest.mark.parametrize("hdt,ddt,place", [
    (torch.int32, torch.int64, "cpu"), (torch.int64, torch.int32, "cpu"),
    (torch.int32, torch.int32, "device"), (torch.int64, torch.int64, "device"),
])
def test_index_dtypes_and_placement(kv, hdt, ddt, place):
    gen = torch.Generator().manual_seed(7)
    spec = _mla_spec(LayerMap.sharded_cp(3, 2, 0), 4, 3)
    h, s, d = _pages(spec, gen, 2)
    dev_of = DEVICE if place == "device" else torch.device("cpu")
    kv.round_trip(spec, _mla_device(spec, gen, rows=28), "kernel", create_registry(),
                  h.to(hdt).to(dev_of), s.to(ddt).to(dev_of), d.to(ddt).to(dev_of))


@pytest.mark.parametrize("ps", [1, 3, 16, 64, 128])
def test_page_sizes(kv, ps):
    gen = torch.Generator().manual_seed(8)
    spec = _mla_spec(LayerMap.sharded_cp(5, 2, 1), ps, 3, lora=8, rope=4)
    kv.round_trip(spec, _mla_device(spec, gen, rows=7 * ps + 1), "kernel", create_registry(), *_pages(spec, gen, 2))


def test_empty_transfer_moves_nothing(kv):
    gen = torch.Generator().manual_seed(9)
    spec = _mla_spec(LayerMap.unsharded(2), 4, 2)
    dev = _mla_device(spec, gen, rows=12)
    pool = HostKVPool(spec, LAYOUT.name, "kernel", dev, registry=create_registry(), pin_memory=DEVICE.type == "cuda")
    kv.fill_canary(pool)
    before = kv.snapshot(dev)
    none = torch.empty(0, dtype=torch.int64)
    pool.backup_all_layers(none, none)
    assert pool.load_layer(1, none, none) is True
    kv.sync()
    assert all(bool((t.view(torch.uint8) == CANARY).all()) for t in pool.host_buffers.values())
    assert all(torch.equal(a, b) for k in before for a, b in zip(before[k], kv.snapshot(dev)[k]))


# -- masking -------------------------------------------------------------------------------------------------
GUARD = 64


def _guarded_host(plan):
    """Host buffers carved out of larger canary-filled tensors (``GUARD`` bytes each side)."""
    bigs, bufs = {}, {}
    for b in plan.buffers:
        big = torch.full((2 * GUARD + b.nbytes,), CANARY, dtype=torch.uint8,
                         pin_memory=DEVICE.type == "cuda")
        bigs[b.name] = big
        bufs[b.name] = big[GUARD : GUARD + b.nbytes].view(b.dtype).view(b.shape)
    return bigs, bufs


@pytest.mark.parametrize("to_host", [True, False], ids=["backup", "load"])
def test_out_of_range_indices_are_masked(kv, to_host):
    """Indices the pool would reject (checks skipped, as with validate='shapes' and device indices)
    neither read nor write out of bounds; the in-range tokens of the same call still move."""
    gen = torch.Generator().manual_seed(10)
    spec = _mla_spec(LayerMap.sharded_cp(4, 2, 1), 4, 2)
    rows, grows = 12, 4
    owned = spec.layer_map.device_layers
    bigdev = {d: _rand(rows + 2 * grows, 40, gen) for d in owned}
    dev = {"kv": [bigdev[d][grows : grows + rows].view(torch.bfloat16) if d in owned else None for d in range(4)]}
    bigs, host = _guarded_host(LAYOUT.plan(spec))
    pool = HostKVPool(spec, LAYOUT.name, "kernel", dev, host_buffers=host, registry=create_registry(), validate="shapes")
    host_before = {k: t.clone() for k, t in bigs.items()}
    dev_before = {d: t.clone() for d, t in bigdev.items()}
    cap = spec.capacity
    # page 0 valid (host 4..7 <- device 0..3); every other token has a bad host slot or a bad device row
    h = torch.tensor([4, 5, 6, 7, cap, cap + 3, -1, 1, 2, -5, 10**6, 3], dtype=torch.int64, device=DEVICE)
    d = torch.tensor([0, 1, 2, 3, 4, 5, 6, rows, -1, 7, 8, 10**6], dtype=torch.int32, device=DEVICE)
    strategy = pool.strategy
    (strategy.backup if to_host else strategy.load)(pool.binding, h, d, None)
    kv.sync()
    for k, big in bigs.items():
        assert torch.equal(big[:GUARD], host_before[k][:GUARD]) and torch.equal(big[-GUARD:], host_before[k][-GUARD:]), k
    for dl, big in bigdev.items():
        assert torch.equal(big[:grows].cpu(), dev_before[dl][:grows].cpu()), f"device guard rows before layer {dl}"
        assert torch.equal(big[-grows:].cpu(), dev_before[dl][-grows:].cpu()), f"device guard rows after layer {dl}"
    latent = host["latent"].view(torch.uint8)
    rope = host["rope"].view(torch.uint8)
    for slot, dl in enumerate(owned):
        rows_now = bigdev[dl][grows : grows + rows].cpu()
        rows_then = dev_before[dl][grows : grows + rows].cpu()
        if to_host:
            got = torch.cat([latent[1, slot], rope[1, slot]], dim=1)  # host page 1 = slots 4..7
            assert torch.equal(got, rows_then[:4]), f"layer {dl}: valid tokens not backed up"
            assert bool((latent[0, slot] == CANARY).all()) and bool((rope[0, slot] == CANARY).all())
            assert torch.equal(rows_now, rows_then)
        else:
            expect = rows_then.clone()
            expect[:4] = CANARY  # host slots 4..7 hold canary bytes; every other device row stays
            assert torch.equal(rows_now, expect), f"layer {dl}: wrong rows changed on load"


# -- SM budget -----------------------------------------------------------------------------------------------
def test_sm_budget_argument_and_environment(kv, monkeypatch):
    gen = torch.Generator().manual_seed(11)
    spec = _mla_spec(LayerMap.sharded_cp(5, 2, 0), 4, 4)
    monkeypatch.delenv("HICACHE_KERNEL_PROGRAMS", raising=False)
    pool = kv.round_trip(spec, _mla_device(spec, gen, rows=36), "kernel-p1", kv.registry_with("kernel-p1", programs=1),
                         *_pages(spec, gen, 3))
    assert pool.binding.scratch["kv_split.kernel"].programs == Budget(1, 1)
    default = HostKVPool(spec, LAYOUT.name, "kernel", _mla_device(spec, gen, rows=36), registry=create_registry(),
                         pin_memory=DEVICE.type == "cuda")
    assert default.binding.scratch["kv_split.kernel"].programs == Budget(BACKUP_PROGRAMS, LOAD_PROGRAMS)
    monkeypatch.setenv("HICACHE_KERNEL_PROGRAMS", "2")
    pool = kv.round_trip(spec, _mla_device(spec, gen, rows=36), "kernel-p5", kv.registry_with("kernel-p5", programs=5),
                         *_pages(spec, gen, 3))
    assert pool.binding.scratch["kv_split.kernel"].programs == Budget(5, 5)  # an explicit budget wins over the environment
    env_default = HostKVPool(spec, LAYOUT.name, "kernel", _mla_device(spec, gen, rows=36), registry=create_registry(),
                             pin_memory=DEVICE.type == "cuda")
    assert env_default.binding.scratch["kv_split.kernel"].programs == Budget(2, 2)  # the environment beats defaults


def test_sm_budget_must_be_positive():
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match=r"programs must be a positive int \(the SM budget\), got"):
            KVSplitKernelStrategy(programs=bad)


# -- pinned memory and support ----------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory is required on CUDA only")
def test_unpinned_host_memory_is_rejected_on_cuda():
    gen = torch.Generator().manual_seed(12)
    spec = _mla_spec(LayerMap.unsharded(2), 4, 2)
    with pytest.raises(HostBufferError, match=rf"{NAME} reads and writes host memory directly"):
        HostKVPool(spec, LAYOUT.name, "kernel", _mla_device(spec, gen, rows=12), registry=create_registry(),
                   pin_memory=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU without the interpreter only")
def test_cpu_without_interpreter_is_rejected(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(1), kv_lora_rank=8, qk_rope_head_dim=4, dtype=torch.bfloat16,
                        page_size=1, capacity=4)
    assert "need a CUDA device" in KVSplitKernelStrategy().supports(spec, LAYOUT)


def test_other_layouts_are_rejected():
    spec = _mla_spec(LayerMap.unsharded(1), 1, 4)

    class Other:
        name = "some_other_layout"

    assert KVSplitKernelStrategy().supports(spec, Other()) == (
        "page_first_kv_split.kernel serves layout 'page_first_kv_split' only, not 'some_other_layout'")
