"""Pitched (2D) copy operations: the packed cudaMemcpy3DBatchOp layout, row expansion and layer grouping."""

from __future__ import annotations

import ctypes

import pytest
import torch

from hicache_core.backends.pitched import MIN_HEIGHT, OP_WORDS, Pitched, expand, group_bases, ops_tensor


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _PtrOperand(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("rowLength", ctypes.c_size_t), ("layerHeight", ctypes.c_size_t),
                ("locHint", _MemLocation)]


class _Offset3D(ctypes.Structure):
    _fields_ = [("x", ctypes.c_size_t), ("y", ctypes.c_size_t), ("z", ctypes.c_size_t)]


class _ArrayOperand(ctypes.Structure):
    _fields_ = [("array", ctypes.c_void_p), ("offset", _Offset3D)]


class _OperandUnion(ctypes.Union):
    _fields_ = [("ptr", _PtrOperand), ("array", _ArrayOperand)]


class _Operand(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("op", _OperandUnion)]


class _Extent(ctypes.Structure):
    _fields_ = [("width", ctypes.c_size_t), ("height", ctypes.c_size_t), ("depth", ctypes.c_size_t)]


class _BatchOp(ctypes.Structure):
    """``struct cudaMemcpy3DBatchOp`` as the CUDA 12.8-13.x headers declare it."""

    _fields_ = [("src", _Operand), ("dst", _Operand), ("extent", _Extent), ("srcAccessOrder", ctypes.c_int),
                ("flags", ctypes.c_uint)]


def _sample(n: int = 3) -> Pitched:
    k = torch.arange(n, dtype=torch.int64)
    return Pitched(host=1000 + k * 7, dev=5000 + k * 11, width=64 + k, height=2 + k, host_pitch=100 + k,
                   dev_pitch=300 + k)


@pytest.mark.parametrize("to_host", [True, False])
def test_ops_tensor_matches_the_header_struct(to_host):
    assert ctypes.sizeof(_BatchOp) == OP_WORDS * 8
    p = _sample()
    ops = ops_tensor(p, to_host=to_host)
    assert ops.is_contiguous() and ops.shape == (3, OP_WORDS)
    parsed = (_BatchOp * 3).from_buffer_copy(ops.numpy().tobytes())
    for k, op in enumerate(parsed):
        src, dst = (p.dev, p.host) if to_host else (p.host, p.dev)
        sp, dp = (p.dev_pitch, p.host_pitch) if to_host else (p.host_pitch, p.dev_pitch)
        assert (op.src.type, op.dst.type) == (1, 1)  # cudaMemcpyOperandTypePointer
        assert op.src.op.ptr.ptr == int(src[k]) and op.dst.op.ptr.ptr == int(dst[k])
        assert op.src.op.ptr.rowLength == int(sp[k]) and op.dst.op.ptr.rowLength == int(dp[k])
        assert op.src.op.ptr.layerHeight == op.dst.op.ptr.layerHeight == int(p.height[k])
        assert (op.src.op.ptr.locHint.type, op.dst.op.ptr.locHint.type) == (0, 0)
        assert (op.extent.width, op.extent.height, op.extent.depth) == (int(p.width[k]), int(p.height[k]), 1)
        assert (op.srcAccessOrder, op.flags) == (1, 0)  # stream order, no flags


def test_expand_lists_every_row_in_order():
    p = _sample()
    h, d, z = expand(p)
    want = [(int(p.host[k]) + r * int(p.host_pitch[k]), int(p.dev[k]) + r * int(p.dev_pitch[k]), int(p.width[k]))
            for k in range(p.count) for r in range(int(p.height[k]))]
    assert list(zip(h.tolist(), d.tolist(), z.tolist())) == want
    assert int(z.sum()) == p.nbytes


def test_pitched_copy_moves_the_same_bytes_as_its_rows():
    """Executed row by row on the CPU: a pitched copy equals copying each row, and touches nothing else."""
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=gen)
    dst = torch.full((4096,), 0xA5, dtype=torch.uint8)
    p = Pitched(torch.tensor([dst.data_ptr(), dst.data_ptr() + 2048]), torch.tensor([src.data_ptr() + 16, src.data_ptr() + 1000]),
                torch.tensor([40, 24]), torch.tensor([3, 5]), torch.tensor([100, 200]), torch.tensor([300, 60]))
    for a, b, n in zip(*expand(p)):
        ctypes.memmove(int(a), int(b), int(n))
    want = torch.full((4096,), 0xA5, dtype=torch.uint8)
    for r in range(3):
        want[r * 100: r * 100 + 40] = src[16 + r * 300: 16 + r * 300 + 40]
    for r in range(5):
        want[2048 + r * 200: 2048 + r * 200 + 24] = src[1000 + r * 60: 1000 + r * 60 + 24]
    assert torch.equal(dst, want)


@pytest.mark.parametrize("host, dev, width, max_pitch, want", [
    # evenly spaced on both sides: one group
    ([0, 100, 200, 300], [0, 1000, 2000, 3000], 64, 2**31, [[0, 1, 2, 3]]),
    # taken in host order; the device steps with them
    ([200, 0, 100], [2000, 0, 1000], 64, 2**31, [[1, 2, 0]]),
    # the device progression breaks after two layers: two groups
    ([0, 100, 200, 300], [0, 1000, 2500, 3500], 64, 2**31, [[0, 1], [2, 3]]),
    # pitch below the row width (rows would overlap): all singletons
    ([0, 50, 100], [0, 50, 100], 64, 2**31, [[0], [1], [2]]),
    # device layers descending: negative pitches are not used (slow on the H200)
    ([0, 100, 200], [2000, 1000, 0], 64, 2**31, [[0], [1], [2]]),
    # pitch above the limit
    ([0, 100, 200], [0, 2**32, 2**33], 64, 2**31, [[0], [1], [2]]),
    # one layer
    ([0], [0], 64, 2**31, [[0]]),
])
def test_group_bases(host, dev, width, max_pitch, want):
    groups = group_bases(host, dev, width, max_pitch)
    assert groups == want
    assert sorted(i for g in groups for i in g) == list(range(len(host)))
    assert all(len(g) >= MIN_HEIGHT or len(g) == 1 for g in groups)


@pytest.mark.parametrize("placement", ["separate", "one-allocation", "one-allocation-descending"])
def test_benchmark_device_placements(monkeypatch, placement):
    """``HICACHE_BENCH_PLACEMENT`` decides how the benchmarks allocate device layers: one tensor each, or
    views of one allocation at ascending / descending addresses; every layer is its own rows either way."""
    from hicache_core.bench import SHAPES, _device_buffers

    monkeypatch.setenv("HICACHE_BENCH_PLACEMENT", placement)
    spec = SHAPES["mla61x576-bf16"](64, 16, torch.device("cpu"))
    layers = _device_buffers(spec, 80)["kv"]
    assert len(layers) == 61 and all(t.shape == (80, 576) and t.dtype == torch.bfloat16 for t in layers)
    ptrs = [t.data_ptr() for t in layers]
    assert len(set(ptrs)) == 61
    storages = {t.untyped_storage().data_ptr() for t in layers}
    steps = {b - a for a, b in zip(ptrs, ptrs[1:])}
    if placement == "separate":
        assert len(storages) == 61
    else:
        assert len(storages) == 1 and steps == {80 * 1152 if placement == "one-allocation" else -80 * 1152}


def test_benchmark_placement_is_validated(monkeypatch):
    from hicache_core.bench import SHAPES, _device_buffers

    monkeypatch.setenv("HICACHE_BENCH_PLACEMENT", "interleaved")
    with pytest.raises(ValueError, match="HICACHE_BENCH_PLACEMENT='interleaved': use one of separate, one-allocation"):
        _device_buffers(SHAPES["mla61x576-bf16"](64, 16, torch.device("cpu")), 80)


def test_kit_placement_is_validated():
    from hicache_core.testing.conformance import CASES, make_device_buffers

    case = CASES[0]
    with pytest.raises(ValueError, match="placement='strided': use one of separate, one-allocation, one-allocation-descending"):
        make_device_buffers(case.build(torch.device("cpu")), case, torch.Generator(), "strided")
