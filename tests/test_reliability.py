"""Inputs that used to succeed silently or escape as non-hicache exceptions: each now raises one
documented ``hicache_core.errors`` class naming the argument and the fix, and changes no byte."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch

from hicache_core import HostKVPool, LayerMap, PoolSpec, default_registry
from hicache_core import kernel_support
from hicache_core.allocator import PageAllocator
from hicache_core.errors import (
    AllocatorArgumentError,
    AllocatorError,
    AllocSizeError,
    ConfigError,
    DeviceBufferError,
    DoubleFreeError,
    DuplicateIndexError,
    FreePageError,
    HostBufferError,
    PageAlignmentError,
    PageMultipleError,
    SpecError,
    UnallocatedSlotError,
)
from hicache_core.kernel_support import ENV_PROGRAMS, IndexMemo, sm_budget
from hicache_core.validate import repeated_rows
from hicache_core.rowcopy import RowKernelStrategy

PS, CAP, LAYERS, ROWS = 4, 16, 3, 32
BACKENDS = ("direct", "reference")


def make_spec(dtype: torch.dtype = torch.float16, layer_map: LayerMap | None = None) -> PoolSpec:
    return PoolSpec.mha(layer_map=layer_map or LayerMap.unsharded(LAYERS), head_num=2, head_dim=4, v_head_dim=2,
                        dtype=dtype, page_size=PS, capacity=CAP)


def make_device(spec: PoolSpec, n: int | None = None, dtype: torch.dtype | None = None) -> dict[str, list]:
    gen = torch.Generator().manual_seed(0)
    n = spec.layer_map.num_device_layers if n is None else n
    dt = dtype or spec.components[0].dtype
    return {"k": [torch.randn(ROWS, 2, 4, generator=gen).to(dt) for _ in range(n)],
            "v": [torch.randn(ROWS, 2, 2, generator=gen).to(dt) for _ in range(n)]}


def all_bytes(pool: HostKVPool, dev: dict[str, list]) -> list[torch.Tensor]:
    return [t.clone().reshape(-1).view(torch.uint8) for t in pool.host_buffers.values()] + [
        t.clone().reshape(-1).view(torch.uint8) for lst in dev.values() for t in lst]


def assert_same_bytes(before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.fixture
def alloc() -> PageAllocator:
    return PageAllocator(CAP, PS)


# --- allocator --------------------------------------------------------------------------

@pytest.mark.parametrize("bad, shown", [(4.0, "float 4.0"), ("4", "str '4'"), (None, "NoneType None"),
                                        (True, "bool True")])
def test_alloc_refuses_non_int_sizes(alloc: PageAllocator, bad: object, shown: str) -> None:
    with pytest.raises(AllocatorArgumentError) as exc:
        alloc.alloc(bad)  # type: ignore[arg-type]
    assert str(exc.value) == f"alloc(need_size) must be an int, got {shown}; pass a whole number"
    assert isinstance(exc.value, TypeError) and alloc.available_size() == CAP


def test_alloc_accepts_numpy_ints(alloc: PageAllocator) -> None:
    assert alloc.alloc(np.int64(8)).tolist() == list(range(8))


@pytest.mark.parametrize("bad, msg", [
    (torch.tensor([0.5, 1.5, 2.5, 3.9]), r"free\(indices\) must hold integer slots, got torch\.float32; "
                                         r"pass the int64 tensor alloc returned"),
    (torch.tensor([True, True, True, True]), r"free\(indices\) must hold integer slots, got torch\.bool"),
    ([0, 1, 2, 3], r"free\(indices\) must be a torch\.Tensor of integer slots as alloc returned them, got list; "
                   r"wrap it with torch\.as_tensor\(\.\.\., dtype=torch\.int64\)"),
    (np.arange(4), r"free\(indices\) must be a torch\.Tensor .*, got ndarray"),
    (torch.arange(4, device="meta"), r"free\(indices\) is a meta tensor, whose values cannot be read"),
], ids=["float", "bool", "list", "ndarray", "meta"])
def test_free_refuses_what_it_would_truncate_or_guess(alloc: PageAllocator, bad: object, msg: str) -> None:
    alloc.alloc(8)
    with pytest.raises(AllocatorArgumentError, match=msg):
        alloc.free(bad)  # type: ignore[arg-type]
    assert alloc.available_size() == CAP - 8


def test_allocator_shape_errors_are_allocator_errors(alloc: PageAllocator) -> None:
    a = alloc.alloc(8)
    for call, cls, base in [(lambda: alloc.alloc(6), AllocSizeError, PageMultipleError),
                            (lambda: alloc.free(a[:6]), AllocSizeError, PageMultipleError),
                            (lambda: alloc.free(a[2:6]), FreePageError, PageAlignmentError)]:
        with pytest.raises(cls) as exc:
            call()
        assert isinstance(exc.value, AllocatorError) and isinstance(exc.value, base)
    assert alloc.available_size() == CAP - 8


def test_one_page_twice_in_one_free_says_so(alloc: PageAllocator) -> None:
    alloc.alloc(4)
    with pytest.raises(DoubleFreeError) as exc:
        alloc.free(torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]))
    assert str(exc.value) == "free(indices): pages [0] appear more than once in this call; pass each page once"
    assert alloc.available_size() == CAP - 4


@pytest.mark.parametrize("kw, msg", [(dict(capacity=16.0), "capacity must be an int, got float 16.0"),
                                     (dict(page_size=4.0), "page_size must be an int, got float 4.0")])
def test_float_capacity_and_page_size(kw: dict, msg: str) -> None:
    args = dict(capacity=CAP, page_size=PS) | kw
    with pytest.raises(SpecError, match="^" + msg):
        PageAllocator(**args)
    with pytest.raises(SpecError, match="^" + msg):
        PoolSpec.mha(layer_map=LayerMap.unsharded(2), head_num=2, head_dim=4, dtype=torch.float16, **args)


def test_pool_try_alloc() -> None:
    spec = make_spec()
    pool = HostKVPool(spec, "layer_first", "direct", make_device(spec))
    assert pool.try_alloc(CAP) is not None and pool.try_alloc(PS) is None


# --- specs ------------------------------------------------------------------------------

def test_mla_spec_arguments() -> None:
    kw = dict(layer_map=LayerMap.unsharded(2), kv_lora_rank=8, qk_rope_head_dim=4, page_size=4, capacity=16)
    with pytest.raises(SpecError) as exc:
        PoolSpec.mla(dtype="bf16", **kw)  # type: ignore[arg-type]
    assert str(exc.value) == "PoolSpec.mla: dtype must be a torch.dtype (e.g. torch.bfloat16), got str 'bf16'"
    with pytest.raises(SpecError) as exc:
        PoolSpec.mla(dtype=torch.bfloat16, **(kw | {"layer_map": 61}))  # type: ignore[arg-type]
    assert str(exc.value) == "layer_map must be a LayerMap, got int 61; pass e.g. LayerMap.unsharded(num_layers)"


def test_spec_without_layers() -> None:
    with pytest.raises(SpecError, match=r"^the layer map has no host layer slot for any component "
                                        r"\(host_layer_num=0\), so every page would be 0 bytes"):
        make_spec(layer_map=LayerMap((), 0, 0))


# --- device buffers -----------------------------------------------------------------------

def test_device_buffers_as_a_list_do_not_dump_tensors() -> None:
    spec = make_spec()
    dev = make_device(spec)
    with pytest.raises(DeviceBufferError) as exc:
        HostKVPool(spec, "layer_first", "direct", [dev["k"], dev["v"]])  # type: ignore[arg-type]
    assert str(exc.value) == (
        "device_buffers must be a mapping of component (or part) name -> per-layer tensor list, got a list of 2 "
        "items; pass e.g. {'k': k_layers, 'v': v_layers}")


def test_mla_device_buffers_as_a_list_do_not_dump_tensors() -> None:
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=8, qk_rope_head_dim=4, dtype=torch.bfloat16,
                        page_size=PS, capacity=CAP)
    layers = [torch.zeros(ROWS, 12, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(DeviceBufferError) as exc:
        HostKVPool(spec, "page_first", "direct", [layers])  # type: ignore[arg-type]
    assert str(exc.value) == (
        "device_buffers must be a mapping of component (or part) name -> per-layer tensor list, got a list of 1 "
        "items; pass e.g. {'kv': kv_layers}")


def test_device_buffer_entries() -> None:
    spec = make_spec()
    cases = [
        ({"k": make_device(spec)["k"][0], "v": make_device(spec)["v"]},
         "device_buffers['k'] must be a list with one tensor (or None) per device layer id, got Tensor"),
        ({"k": [t.numpy() for t in make_device(spec)["k"]], "v": make_device(spec)["v"]},
         "device_buffers['k'][0] must be a torch.Tensor (or None), got ndarray; wrap it with torch.from_numpy"),
        (make_device(spec, n=LAYERS + 2),
         "device_buffers['k'] has 5 layers but the spec has 3 device layers (layer_map.num_device_layers); "
         "pass one tensor per device layer id, or fix the layer map"),
        (make_device(spec, dtype=torch.bfloat16),
         "device_buffers['k'][0] is torch.bfloat16 but the spec's 'k' rows are torch.float16; pass tensors of the "
         "spec's dtype or build the spec with dtype=torch.bfloat16"),
    ]
    for dev, msg in cases:
        with pytest.raises(DeviceBufferError) as exc:
            HostKVPool(spec, "layer_first", "direct", dev)
        assert str(exc.value).startswith(msg)


def test_one_byte_device_tensors_are_byte_storage() -> None:
    """FP8 / packed rows are held as uint8 on the device: any 1-byte dtype pairs with the spec by row bytes."""
    spec = make_spec(dtype=torch.uint8)
    dev = {k: [t.view(torch.float8_e4m3fn) for t in lst] for k, lst in make_device(spec).items()}
    HostKVPool(spec, "layer_first", "direct", dev)


# --- host buffers ----------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_wrapped_host_buffers_must_not_share_memory(backend: str) -> None:
    spec = make_spec()
    plan = {b.name: b for b in default_registry().layout("page_first").plan(spec).buffers}
    nk, nv = (math.prod(plan[n].shape) for n in ("k", "v"))
    k = torch.zeros(plan["k"].shape, dtype=plan["k"].dtype)
    big = torch.zeros(nk + nv, dtype=k.dtype)
    same = {"k": k, "v": k.view(-1)[:nv].view(plan["v"].shape)}
    one_item = {"k": big[:nk].view(k.shape), "v": big[nk - 1: nk - 1 + nv].view(plan["v"].shape)}
    for hosts, overlap in ((same, nv * 2), (one_item, 2)):
        with pytest.raises(HostBufferError) as exc:
            HostKVPool(spec, "page_first", backend, make_device(spec), host_buffers=hosts)
        assert str(exc.value) == (f"host buffers 'k' and 'v' share memory ({overlap} bytes overlap); each buffer "
                                  "the layout plans needs its own memory: pass separate tensors")
    HostKVPool(spec, "page_first", backend, make_device(spec),
               host_buffers={"k": big[:nk].view(k.shape), "v": torch.zeros(plan["v"].shape, dtype=k.dtype)})


# --- duplicate and unallocated indices ------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("validate", ["shapes", "full"])
def test_rows_a_transfer_writes_must_not_repeat(backend: str, validate: str,
                                                index_check_path: str) -> None:
    spec = make_spec()
    dev = make_device(spec)
    pool = HostKVPool(spec, "layer_first", backend, dev, validate=validate)
    before = all_bytes(pool, dev)
    page = torch.arange(4)
    with pytest.raises(DuplicateIndexError, match=r"^host_indices repeat the pages starting at slots \[0\]; "
                                                  r"a backup would write them twice"):
        pool.backup_all_layers(torch.cat([page, page]), torch.arange(8))
    with pytest.raises(DuplicateIndexError, match=r"^device_indices repeat rows \[5\]; a load would write them "
                                                  r"twice .*pass each device row once$"):
        pool.load_layer(0, torch.arange(8), torch.tensor([5, 1, 2, 3, 4, 5, 6, 7]))
    assert_same_bytes(before, all_bytes(pool, dev))
    # the other direction may repeat: reading one row twice is well defined
    pool.backup_all_layers(torch.arange(8), torch.tensor([5, 1, 2, 3, 4, 5, 6, 7]))
    pool.load_layer(0, torch.cat([page, page]), torch.arange(8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_overlapping_device_page_runs_are_repeated_rows(backend: str, index_check_path: str) -> None:
    """Device rows in runs of page_size that overlap (starts 8 and 10 with pages of 4) repeat rows 10 and 11:
    the runs' fast check must see it as the full sort does, and nothing moves."""
    spec = make_spec()
    dev = make_device(spec)
    pool = HostKVPool(spec, "layer_first", backend, dev)
    before = all_bytes(pool, dev)
    with pytest.raises(DuplicateIndexError, match=r"^device_indices repeat rows \[10, 11\]; a load would write"):
        pool.load_layer(0, torch.arange(8), torch.tensor([8, 9, 10, 11, 10, 11, 12, 13]))
    assert_same_bytes(before, all_bytes(pool, dev))
    pool.load_layer(0, torch.arange(8), torch.tensor([8, 9, 10, 11, 12, 13, 14, 15]))  # adjacent runs: no repeat
    pool.load_layer(0, torch.arange(8), torch.tensor([13, 14, 15, 16, 9, 10, 11, 12]))  # unaligned, disjoint


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("run", [1, 4, 16])
def test_repeated_rows_matches_counting(dtype: torch.dtype, run: int) -> None:
    """Runs of consecutive rows (page runs, aligned or not, some overlapping) and arbitrary rows: the same
    repeated values as counting them."""
    gen = torch.Generator().manual_seed(run)
    for trial in range(300):
        pages = int(torch.randint(1, 9, (1,), generator=gen))
        if trial % 3:  # page runs at random starts: overlapping sometimes, adjacent sometimes
            starts = torch.randint(0, 8 * run, (pages,), generator=gen)
            rows = (starts.unsqueeze(1) + torch.arange(run)).reshape(-1)
        else:
            rows = torch.randint(0, 6 * run, (pages * run,), generator=gen)
        rows = rows.to(dtype)
        vals, counts = rows.unique(return_counts=True)
        assert repeated_rows(rows, run).unique().tolist() == vals[counts > 1].tolist()


def test_strict_validation_refuses_unallocated_slots() -> None:
    spec = make_spec()
    dev = make_device(spec)
    pool = HostKVPool(spec, "layer_first", "direct", dev, validate="strict")
    slots = pool.alloc(4)
    pool.backup_all_layers(slots, torch.arange(4))
    before = all_bytes(pool, dev)
    with pytest.raises(UnallocatedSlotError, match=r"^host_indices name pages \[1\] that this pool has not "
                                                   r"allocated \(freed or never allocated; validate='strict'\)"):
        pool.load_all_layers(torch.arange(4, 8), torch.arange(4))
    pool.free(slots)
    with pytest.raises(UnallocatedSlotError, match=r"pages \[0\]"):
        pool.backup_layer(1, slots, torch.arange(4))
    assert_same_bytes(before, all_bytes(pool, dev))
    # the page views too: an unallocated page is neither read, written nor handed out
    for call in (lambda: pool.get_page(0), lambda: pool.page_pointers(0),
                 lambda: pool.set_page(0, torch.zeros(pool.page_bytes, dtype=torch.uint8))):
        with pytest.raises(UnallocatedSlotError, match=r"^page 0 is not allocated in this pool"):
            call()
    assert_same_bytes(before, all_bytes(pool, dev))
    page = int(pool.alloc(4)[0]) // spec.page_size
    assert len(pool.get_page(page)) == pool.page_bytes


# --- kernel program count --------------------------------------------------------------------

@pytest.mark.parametrize("value", ["-3", "0", "abc", "2.5"])
def test_kernel_programs_environment(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(ENV_PROGRAMS, value)
    with pytest.raises(ConfigError) as exc:
        sm_budget(4, torch.device("cpu"))
    assert str(exc.value) == (f"HICACHE_KERNEL_PROGRAMS={value!r}: the number of kernel programs must be an "
                              "integer >= 1 (e.g. 8); fix or unset it")
    monkeypatch.setenv(ENV_PROGRAMS, " 12 ")
    assert sm_budget(4, torch.device("cpu")) == 12
    with pytest.raises(ConfigError, match=r"^programs=-1: "):
        RowKernelStrategy(-1)


# --- memo safety -------------------------------------------------------------------------------

def test_index_memo_lookup_is_atomic_under_a_racing_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """Thread A's lookup is paused inside its checks while thread B stores its own copy; A must get its
    own copy or a miss, never B's.  (Before the fix A's checks passed on A's entry and it returned B's copy.)"""
    memo = IndexMemo()
    a, b = torch.arange(4), torch.arange(4)
    out_a, out_b = torch.full((4,), 1), torch.full((4,), 2)
    memo.store(a, None, out_a)
    paused, resume = threading.Event(), threading.Event()
    real = kernel_support.tensor_version
    result: list[object] = []

    def version(t: torch.Tensor) -> int | None:
        if threading.current_thread().name == "A":
            paused.set()
            assert resume.wait(120)
        return real(t)

    monkeypatch.setattr(kernel_support, "tensor_version", version)
    ta = threading.Thread(target=lambda: result.append(memo.lookup(a, None)), name="A")
    tb = threading.Thread(target=lambda: (paused.wait(120), memo.store(b, None, out_b), resume.set()), name="B")
    ta.start(); tb.start(); ta.join(240); tb.join(240)  # deadlock guards only
    assert len(result) == 1 and result[0] is out_a
    assert memo.lookup(b, None) is out_b and memo.lookup(a, None) is None


def test_index_memo_threads_get_only_their_own_copies() -> None:
    memo = IndexMemo()
    wrong: list[int] = []

    def run(k: int) -> None:
        src, out = torch.arange(4), torch.full((4,), k)
        for _ in range(2000):
            memo.store(src, None, out)
            hit = memo.lookup(src, None)
            if hit is not None and hit is not out:
                wrong.append(k)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def test_full_validation_memoises_nothing() -> None:
    """A write through ``.data`` does not bump the version counter; under validate='full' it is still seen."""
    spec = make_spec()
    dev = make_device(spec)
    pool = HostKVPool(spec, "layer_first", "direct", dev, validate="full")
    host, rows = torch.arange(4), torch.arange(4)
    pool.backup_all_layers(host, rows)
    memo_h, memo_d = kernel_support.index_memos(pool.binding)
    assert not memo_h.enabled and not memo_d.enabled
    before = all_bytes(pool, dev)
    host.data[0] = 99  # invisible to torch's version counter
    with pytest.raises(Exception) as exc:
        pool.backup_all_layers(host, rows)
    assert type(exc.value).__name__ == "IndexRangeError"
    assert_same_bytes(before, all_bytes(pool, dev))


def test_get_page_synchronize_flag_reads_the_same_bytes_on_cpu() -> None:
    spec = make_spec()
    pool = HostKVPool(spec, "layer_first", "direct", make_device(spec))
    pool.backup_all_layers(torch.arange(4), torch.arange(4))
    page = pool.get_page(0, synchronize=True)
    assert torch.equal(page, pool.get_page(0))
    pool.set_page(1, page, synchronize=True)
    assert torch.equal(pool.get_page(1), page)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_first_kv_split"])
@pytest.mark.parametrize("backend", ["direct", "auto", "reference", "kernel"])
def test_a_dropped_pool_frees_its_buffers_without_the_garbage_collector(backend: str, layout: str) -> None:
    """Nothing a strategy keeps per pool (plans, replays, memos) refers back to the pool's binding strongly: the
    last reference to a pool frees its (often many GB of pinned) host buffers at once, not at the next collection."""
    import gc
    import weakref

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if backend == "kernel" and device.type == "cpu" and not kernel_support.interpreting():
        pytest.skip("kernel strategies need CUDA or TRITON_INTERPRET=1")
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(3), kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                        page_size=16, capacity=64, device=device)
    dev = [torch.randn(96, 576, device=device).to(torch.bfloat16) for _ in range(3)]
    pool = HostKVPool(spec, layout, backend, {"kv": dev}, registry=default_registry())
    h = torch.arange(32, device=device)
    d = torch.arange(32, device=device) + 64
    for _ in range(2):  # the second calls hit every memo and replay
        pool.backup_all_layers(h, d)
        for layer in range(3):
            pool.load_layer(layer, h, d)
    if device.type == "cuda":
        torch.cuda.synchronize()
    host = weakref.ref(next(iter(pool.host_buffers.values())))
    gc.collect()
    gc.disable()
    try:
        del pool
        assert host() is None
    finally:
        gc.enable()
