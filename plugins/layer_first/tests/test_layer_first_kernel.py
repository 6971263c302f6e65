"""``layer_first.kernel``: conformance against the reference, word-size fallbacks, masking, SM budget, pinning."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess
import sys

import pytest

from hicache_core import (
    Addressing,
    BufferSpec,
    Component,
    HostBufferError,
    HostKVPool,
    HostPlan,
    LayerMap,
    PoolSpec,
    Segment,
    create_registry,
)
from hicache_core.kernel_support import ENV_PROGRAMS, Budget
from hicache_core.testing.conformance import CASES, check_load_all, check_strategy
from hicache_layer_first import kernels
from hicache_layer_first.layout import LAYOUT
from hicache_layer_first.strategy import LayerFirstKernelStrategy, Prepared

NAME = "layer_first.kernel"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PIN = DEVICE.type == "cuda"
CANARY = 0x5A


@pytest.fixture(scope="module")
def registry():
    return create_registry()


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


# --- conformance ----------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["shuffled-i64", "last-page-i32-dev"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_conformance_round_trip(registry, case, variant):
    pool = check_strategy(registry, case, "layer_first", "kernel", variant=variant, device=DEVICE, strategy=NAME)
    assert pool.strategy_name == NAME


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_conformance_load_all_layers(registry, case):
    check_load_all(registry, case, "layer_first", "kernel", device=DEVICE, strategy=NAME)


@pytest.mark.parametrize("case", [c for c in CASES if "sharded" in c.id or "drafts" in c.id],
                         ids=lambda c: c.id)
def test_conformance_per_layer_backup_sharded(registry, case):
    check_strategy(registry, case, "layer_first", "kernel", device=DEVICE, strategy=NAME, per_layer_backup=True)


@pytest.mark.parametrize("sharded", [False, True])
def test_resolves_for_both_sharded_keys(registry, sharded):
    lmap = LayerMap.sharded_cp(4, 2, 1) if sharded else LayerMap.unsharded(2)
    spec = PoolSpec.mha(layer_map=lmap, head_num=1, head_dim=8, dtype=torch.float16, page_size=1, capacity=4,
                        device=DEVICE)
    assert spec.sharded is sharded
    assert registry.resolve(spec, "layer_first", "kernel").info.name == NAME


# --- helpers for hand-built pools -------------------------------------------------------------

def _pools(registry, spec, dev, **kw):
    """A kernel pool on ``dev`` and a reference pool on a copy, host buffers canary-filled."""
    ref_dev = {k: [None if t is None else t.clone() for t in lst] for k, lst in dev.items()}
    pool = HostKVPool(spec, "layer_first", "kernel", dev, registry=registry, strategy=NAME, pin_memory=PIN, **kw)
    ref = HostKVPool(spec, "layer_first", "reference", ref_dev, registry=registry, pin_memory=False)
    for p in (pool, ref):
        for t in p.host_buffers.values():
            t.view(torch.uint8).fill_(CANARY)
    return pool, ref, ref_dev


def _round_trip(pool, ref, dev, ref_dev, host, src, dst):
    pool.backup_all_layers(host, src)
    ref.backup_all_layers(host.cpu().long(), src.cpu().long())
    _sync()
    for name, t in ref.host_buffers.items():
        assert torch.equal(pool.host_buffers[name].view(torch.uint8), t.view(torch.uint8)), name
    for layer in range(pool.spec.layer_map.num_device_layers):
        pool.load_layer(layer, host, dst)
        ref.load_layer(layer, host.cpu().long(), dst.cpu().long())
    _sync()
    for name in dev:
        for a, b in zip(dev[name], ref_dev[name]):
            if a is not None:
                assert torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8)), name
                rows = a.view(torch.uint8) if a.dim() > 1 else a
                assert torch.equal(rows[dst.to(a.device)], rows[src.to(a.device)]), name


def _prepared(pool) -> Prepared:
    return pool.binding.scratch[NAME]


def _rand(shape, dtype, gen):
    return torch.randint(0, 256, (*shape[:-1], shape[-1] * torch.empty((), dtype=dtype).element_size()),
                         dtype=torch.uint8, generator=gen).view(dtype).to(DEVICE)


# --- word-size fallback ---------------------------------------------------------------------

@pytest.mark.parametrize("row_bytes, want_word", [(3, 1), (6, 2), (12, 4), (24, 8), (656, 8)])
def test_word_follows_row_size(registry, row_bytes, want_word):
    gen = torch.Generator().manual_seed(row_bytes)
    spec = PoolSpec("mla", (Component("kv", row_bytes, torch.uint8),), LayerMap.unsharded(2), 4, 16, DEVICE)
    dev = {"kv": [_rand((40, row_bytes), torch.uint8, gen) for _ in range(2)]}
    pool, ref, ref_dev = _pools(registry, spec, dev)
    (group,) = _prepared(pool).groups
    assert group.word == want_word and group.width * group.word == row_bytes
    host = torch.tensor([12, 13, 14, 15, 0, 1, 2, 3])
    _round_trip(pool, ref, dev, ref_dev, host, torch.arange(8) + 4, torch.arange(8) + 20)


def test_odd_alignment_and_odd_stride(registry):
    """Device rows starting at an odd byte with an odd token stride force 1-byte words."""
    gen = torch.Generator().manual_seed(3)
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(2), head_num=2, head_dim=4, dtype=torch.uint8,
                        page_size=2, capacity=8, device=DEVICE)
    raw = [_rand((24, 11), torch.uint8, gen) for _ in range(4)]
    dev = {"k": [raw[0][:, 1:9], raw[1][:, 1:9]], "v": [raw[2][:, 3:11], raw[3][:, 3:11]]}
    pool, ref, ref_dev = _pools(registry, spec, dev)
    assert [(g.word, g.vec) for g in _prepared(pool).groups] == [(1, 1)]
    _round_trip(pool, ref, dev, ref_dev, torch.tensor([6, 7, 2, 3]), torch.tensor([1, 2, 5, 9]),
                torch.tensor([20, 21, 10, 11]))


def test_equal_width_components_share_one_launch(registry, monkeypatch):
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(3), head_num=2, head_dim=8, dtype=torch.float16,
                        page_size=4, capacity=16, device=DEVICE)
    gen = torch.Generator().manual_seed(5)
    dev = {n: [_rand((40, 16), torch.float16, gen) for _ in range(3)] for n in ("k", "v")}
    pool, ref, ref_dev = _pools(registry, spec, dev)
    (group,) = _prepared(pool).groups
    assert group.all_layers.count == 6 and {k: e.count for k, e in group.per_layer.items()} == {0: 2, 1: 2, 2: 2}
    calls = []
    real = kernels.copy_rows
    monkeypatch.setattr(kernels, "copy_rows", lambda **kw: calls.append(kw["n_ents"]) or real(**kw))
    _round_trip(pool, ref, dev, ref_dev, torch.arange(4, 12), torch.arange(8), torch.arange(8) + 16)
    assert calls == [6, 2, 2, 2]  # backup_all_layers: one launch; load_layer: one launch per layer


def test_component_absent_on_a_layer_is_not_launched(registry, monkeypatch):
    extra = (Component("index_k", 128, torch.uint8, layers=(0, 2)),)
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(3), kv_lora_rank=32, qk_rope_head_dim=16,
                        dtype=torch.bfloat16, page_size=2, capacity=8, device=DEVICE, extra=extra)
    gen = torch.Generator().manual_seed(9)
    dev = {"kv": [_rand((20, 48), torch.bfloat16, gen) for _ in range(3)],
           "index_k": [_rand((20, 128), torch.uint8, gen), None, _rand((20, 128), torch.uint8, gen)]}
    pool, ref, ref_dev = _pools(registry, spec, dev)
    calls = []
    real = kernels.copy_rows
    monkeypatch.setattr(kernels, "copy_rows", lambda **kw: calls.append((kw["width"] * kw["word"], kw["n_ents"]))
                        or real(**kw))
    _round_trip(pool, ref, dev, ref_dev, torch.tensor([2, 3, 6, 7]), torch.arange(4), torch.arange(4) + 8)
    assert calls == [(96, 3), (128, 2), (96, 1), (128, 1), (96, 1), (96, 1), (128, 1)]


# --- indices ----------------------------------------------------------------------------------

@pytest.mark.parametrize("host_dtype, dev_dtype", [(torch.int32, torch.int64), (torch.int64, torch.int32),
                                                   (torch.int32, torch.int32)])
@pytest.mark.parametrize("on_device", [False, True])
def test_int32_and_int64_indices(registry, host_dtype, dev_dtype, on_device):
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(2), head_num=1, head_dim=8, dtype=torch.bfloat16,
                        page_size=2, capacity=8, device=DEVICE)
    gen = torch.Generator().manual_seed(11)
    dev = {n: [_rand((24, 8), torch.bfloat16, gen) for _ in range(2)] for n in ("k", "v")}
    pool, ref, ref_dev = _pools(registry, spec, dev)
    place = DEVICE if on_device else torch.device("cpu")
    host = torch.tensor([4, 5, 0, 1], dtype=host_dtype, device=place)
    src = torch.tensor([3, 8, 1, 2], dtype=dev_dtype, device=place)
    dst = torch.tensor([12, 13, 20, 21], dtype=dev_dtype, device=place)
    _round_trip(pool, ref, dev, ref_dev, host, src, dst)


@pytest.mark.parametrize("page_size", [1, 16, 64, 128])
def test_page_sizes(registry, page_size):
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=64, qk_rope_head_dim=16,
                        dtype=torch.bfloat16, page_size=page_size, capacity=3 * page_size, device=DEVICE)
    gen = torch.Generator().manual_seed(page_size)
    dev = {"kv": [_rand((7 * page_size, 80), torch.bfloat16, gen) for _ in range(2)]}
    pool, ref, ref_dev = _pools(registry, spec, dev)
    host = torch.cat([torch.arange(2 * page_size, 3 * page_size), torch.arange(page_size)])
    src = torch.randperm(2 * page_size, generator=gen) + page_size
    _round_trip(pool, ref, dev, ref_dev, host, src, torch.arange(2 * page_size) + 4 * page_size)


# --- masking: out-of-range indices never touch memory out of bounds ---------------------------

GUARD = 64


def _guarded_pool(registry):
    """A pool whose host buffer and device layers are windows of larger canary-filled tensors."""
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(2), head_num=1, head_dim=8, dtype=torch.float16,
                        page_size=2, capacity=8, device=DEVICE)
    plan = LAYOUT.plan(spec)
    outer_host, host_bufs = {}, {}
    for b in plan.buffers:
        big = torch.full((b.nbytes + 2 * GUARD,), CANARY, dtype=torch.uint8, pin_memory=PIN)
        outer_host[b.name] = big
        host_bufs[b.name] = big[GUARD: GUARD + b.nbytes].view(b.dtype).view(b.shape)
    rows, row_bytes = 16, 16
    outer_dev, dev = {}, {}
    gen = torch.Generator().manual_seed(1)
    for name in ("k", "v"):
        bigs = [torch.full((row_bytes * rows + 2 * GUARD,), CANARY, dtype=torch.uint8, device=DEVICE) for _ in range(2)]
        for big in bigs:
            big[GUARD: GUARD + rows * row_bytes] = torch.randint(0, 256, (rows * row_bytes,), dtype=torch.uint8,
                                                                 generator=gen).to(DEVICE)
        outer_dev[name] = bigs
        dev[name] = [big[GUARD: GUARD + rows * row_bytes].view(torch.float16).view(rows, 8) for big in bigs]
    pool = HostKVPool(spec, "layer_first", "kernel", dev, host_buffers=host_bufs, registry=registry,
                      strategy=NAME, validate="shapes")
    return pool, outer_host, outer_dev, dev


def _transfer_unchecked(pool, op, host, device):
    """Out-of-range indices as a caller with validation off would pass them."""
    if DEVICE.type == "cuda":  # device-resident indices with validate='shapes' skip value checks
        host, device = host.to(DEVICE), device.to(DEVICE)
        getattr(pool, op)(host, device)
    else:  # CPU indices are always value-checked by the pool: call the strategy as it would
        getattr(pool.strategy, "backup" if op.startswith("backup") else "load")(pool.binding, host, device, None)
    _sync()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_out_of_range_indices_are_masked(registry, dtype):
    pool, outer_host, outer_dev, dev = _guarded_pool(registry)
    big = 2**31 - 1 if dtype == torch.int32 else 2**40
    host = torch.tensor([0, 1, 8, -1, 6, big], dtype=dtype)  # capacity 8: 8, -1, big are out of range
    device = torch.tensor([2, 3, 4, 5, -3, 7], dtype=dtype)  # pair (6, -3) has a bad device row
    host_before = {k: v.clone() for k, v in outer_host.items()}
    _transfer_unchecked(pool, "backup_all_layers", host, device)
    for name, big_t in outer_host.items():
        hb = pool.host_buffers[name].view(torch.uint8).reshape(2, 8, 16)
        for layer in range(2):
            want = dev[name][layer].cpu().view(torch.uint8)
            assert torch.equal(hb[layer, 0], want[2]) and torch.equal(hb[layer, 1], want[3])
        changed = (big_t != host_before[name]).nonzero().flatten()
        allowed = {GUARD + layer * 8 * 16 + s * 16 + b for layer in range(2) for s in (0, 1) for b in range(16)}
        assert set(changed.tolist()) <= allowed, name  # nothing else written: no slot 6, no guard bytes
    dev_before = {k: [t.clone() for t in v] for k, v in outer_dev.items()}
    bad_dev = torch.tensor([16, -1, 0, 1, 15, big], dtype=dtype)  # 16 rows: 16, -1, big are out of range
    good_host = torch.tensor([0, 1, 2, 3, 4, 5], dtype=dtype)
    _transfer_unchecked(pool, "load_all_layers", good_host, bad_dev)
    for name, bigs in outer_dev.items():
        for layer, (b, before) in enumerate(zip(bigs, dev_before[name])):
            changed = set((b != before).nonzero().flatten().tolist())
            assert all(GUARD + 0 <= i < GUARD + 2 * 16 or GUARD + 15 * 16 <= i < GUARD + 16 * 16 for i in changed)
            assert torch.equal(dev[name][layer][15].cpu().view(torch.uint8),
                               pool.host_buffers[name][layer, 4].view(torch.uint8))


# --- SM budget ----------------------------------------------------------------------------------

def _budget_pool(registry, programs):
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=32, qk_rope_head_dim=0,
                        dtype=torch.float32, page_size=1, capacity=64, device=DEVICE)
    gen = torch.Generator().manual_seed(2)
    dev = {"kv": [_rand((128, 32), torch.float32, gen) for _ in range(2)]}
    pool, ref, ref_dev = _pools(registry, spec, dev)
    strategy = LayerFirstKernelStrategy(programs=programs)
    strategy.prepare(pool.binding)
    pool.strategy = strategy
    return pool, ref, dev, ref_dev


@pytest.mark.parametrize("programs", [1, 3])
def test_sm_budget_bounds_the_grid(registry, monkeypatch, programs):
    monkeypatch.setattr(kernels, "MAX_TOKENS", 4)  # read when the pool is prepared
    pool, ref, dev, ref_dev = _budget_pool(registry, programs)
    grids = []
    real = kernels.copy_rows
    monkeypatch.setattr(kernels, "copy_rows", lambda **kw: grids.append(real(**kw)) or grids[-1])
    # 64 tokens of 128 bytes in tiles of 4 tokens: 16 work items per layer, several per program
    _round_trip(pool, ref, dev, ref_dev, torch.arange(64), torch.randperm(64) + 64, torch.arange(64))
    assert grids and all(g == programs for g in grids)


def test_default_budget_differs_by_direction(registry, monkeypatch):
    monkeypatch.delenv(ENV_PROGRAMS, raising=False)
    monkeypatch.setattr(kernels, "MAX_TOKENS", 4)
    monkeypatch.setattr(kernels, "BACKUP_PROGRAMS", 2)
    monkeypatch.setattr(kernels, "LOAD_PROGRAMS", 3)
    pool, ref, dev, ref_dev = _budget_pool(registry, None)
    grids = []
    real = kernels.copy_rows
    monkeypatch.setattr(kernels, "copy_rows", lambda **kw: grids.append((kw["to_host"], real(**kw))) or grids[-1][1])
    _round_trip(pool, ref, dev, ref_dev, torch.arange(64), torch.randperm(64) + 64, torch.arange(64))
    assert {g for to_host, g in grids if to_host} == {2} and {g for to_host, g in grids if not to_host} == {3}


def test_grid_shrinks_to_the_work():
    assert kernels.grid_size(64, 3) == 3 and kernels.grid_size(2, 3) == 2 and kernels.grid_size(8, 0) == 1


def test_sm_budget_env_and_argument(registry, monkeypatch):
    monkeypatch.setenv(ENV_PROGRAMS, "5")
    pool, *_ = _budget_pool(registry, None)
    assert pool.binding.scratch[NAME].programs == Budget(5, 5)
    pool, *_ = _budget_pool(registry, 7)  # an explicit budget beats the environment
    assert pool.binding.scratch[NAME].programs == Budget(7, 7)
    monkeypatch.delenv(ENV_PROGRAMS)
    pool, *_ = _budget_pool(registry, None)  # per-direction defaults
    assert pool.binding.scratch[NAME].programs == Budget(kernels.BACKUP_PROGRAMS, kernels.LOAD_PROGRAMS)
    assert kernels.BACKUP_PROGRAMS < kernels.LOAD_PROGRAMS


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_sm_budget_must_be_positive_int(bad):
    with pytest.raises(ValueError, match="programs must be a positive int"):
        LayerFirstKernelStrategy(programs=bad)


def test_tile_shape_follows_constants(monkeypatch):
    for name, value in [("LOAD_TILE_BYTES", 16384), ("BACKUP_TILE_BYTES", 4096), ("MAX_BLOCK_BYTES", 512),
                        ("MAX_TOKENS", 64), ("LOAD_NUM_WARPS", 8), ("BACKUP_NUM_WARPS", 2)]:
        monkeypatch.setattr(kernels, name, value)
    T = kernels.TileShape
    assert kernels.tile_shape(72, 8, False) == T(64, 32, 8)  # 576-byte MLA rows: 2 column blocks of 512 B
    assert kernels.tile_shape(72, 8, True) == T(64, 8, 2)
    assert kernels.tile_shape(41, 2, False) == T(64, 64, 8)  # 82 bytes: next power of two, capped tokens
    assert kernels.tile_shape(1, 4, True) == T(1, 64, 2)
    assert kernels.tile_shape(3, 1, True) == T(4, 64, 2)


# --- capability checks ----------------------------------------------------------------------------

class _ChunkedLayout:
    name = "layer_first"
    description = "rows split in chunks (not layer_first addressing)"

    def check(self, spec):
        return None

    def plan(self, spec):
        row = spec.components[0].row_bytes
        addr = Addressing(0, spec.capacity * row, spec.page_size * row, row, row // 2, row)
        seg = Segment("kv", "kv", None, 0, row, addr)
        return HostPlan((BufferSpec("kv", (1, spec.capacity, row), torch.uint8),), (seg,))


def test_supports_rejects_chunked_rows():
    spec = PoolSpec("mla", (Component("kv", 64, torch.uint8),), LayerMap.unsharded(1), 1, 4, DEVICE)
    why = LayerFirstKernelStrategy().supports(spec, _ChunkedLayout())
    assert why == "segment 'kv' splits rows into 32-byte chunks; layer_first.kernel copies whole contiguous rows"
    assert LayerFirstKernelStrategy().supports(spec, LAYOUT) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only: the kernel needs CUDA or the interpreter")
def test_supports_needs_cuda_or_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    spec = PoolSpec("mla", (Component("kv", 64, torch.uint8),), LayerMap.unsharded(1), 1, 4, "cpu")
    assert "need a CUDA device" in LayerFirstKernelStrategy().supports(spec, LAYOUT)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning is only required on CUDA")
def test_unpinned_host_memory_is_rejected_on_cuda(registry):
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(1), head_num=1, head_dim=8, dtype=torch.float16,
                        page_size=1, capacity=4, device=DEVICE)
    dev = {n: [torch.zeros(8, 8, dtype=torch.float16, device=DEVICE)] for n in ("k", "v")}
    with pytest.raises(HostBufferError, match="host buffers must be pinned"):
        HostKVPool(spec, "layer_first", "kernel", dev, registry=registry, strategy=NAME, pin_memory=False)


def test_plugin_module_imports_no_triton():
    code = ("import sys, hicache_layer_first.plugin, hicache_core; hicache_core.create_registry(); "
            "assert 'triton' not in sys.modules, 'plugin.py imported triton'; "
            "assert 'hicache_layer_first.strategy' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "TRITON_INTERPRET": "0"})
