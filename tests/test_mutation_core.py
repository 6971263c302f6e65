"""Tests that kill mutants of hicache_core/validate.py, allocator.py and pool.py that the other suites let live.

Each test names the behaviour it pins down; small sizes, exact bytes, exact error classes and messages."""

from __future__ import annotations

import pytest
import torch

from hicache_core import HostKVPool, LayerMap, PoolSpec, default_registry
from hicache_core.allocator import PageAllocator
from hicache_core.errors import (
    AllocatorArgumentError,
    ConfigError,
    DoubleFreeError,
    DuplicateIndexError,
    ForeignSlotError,
    HostBufferError,
    SpecError,
)
from hicache_core.pool import validate_level
from hicache_core.validate import CheckedPair, check_host_buffers_disjoint, check_indices, page_starts, parse_programs

PS, CAP, LAYERS, ROWS = 4, 16, 3, 32


def make_spec(dtype: torch.dtype = torch.float16) -> PoolSpec:
    return PoolSpec.mha(layer_map=LayerMap.unsharded(LAYERS), head_num=2, head_dim=4, v_head_dim=2,
                        dtype=dtype, page_size=PS, capacity=CAP)


def random_bytes(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def make_device(spec: PoolSpec, seed: int = 0) -> dict[str, list[torch.Tensor]]:
    """Random float16 device rows (from random bytes: every bit pattern, NaNs included)."""
    return {"k": [random_bytes((ROWS, 2, 8), seed + i).view(torch.float16) for i in range(LAYERS)],
            "v": [random_bytes((ROWS, 2, 4), seed + 10 + i).view(torch.float16) for i in range(LAYERS)]}


def snapshot(pool: HostKVPool, dev: dict[str, list[torch.Tensor]]) -> list[torch.Tensor]:
    """Copies of every host and device byte."""
    return [as_bytes(t).clone() for t in pool.host_buffers.values()] + [
        as_bytes(t).clone() for lst in dev.values() for t in lst]


# --- validate.page_starts -------------------------------------------------------------------------

def test_page_starts_of_a_length_not_a_multiple_of_the_run_is_none() -> None:
    """A tensor that is not whole runs has no run starts (and does not raise reshaping it)."""
    assert page_starts(torch.arange(5), 4) is None
    assert page_starts(torch.arange(6, dtype=torch.int32), 4) is None


def test_page_starts_of_int32_runs_does_not_wrap_around() -> None:
    """int32 values 2**31-1, -2**31 are not a run of two (they are one only modulo 2**32); int32 runs that are whole
    give int64 starts."""
    top = torch.tensor([2**31 - 1, -(2**31)], dtype=torch.int32)
    assert page_starts(top, 2) is None
    starts = page_starts(torch.tensor([8, 9, 10, 11, 0, 1, 2, 3], dtype=torch.int32), 4)
    assert starts is not None and starts.dtype == torch.int64 and starts.tolist() == [8, 0]


# --- validate.check_device_buffers: one-byte storage on either side ------------------------------

def _round_trip(spec: PoolSpec, dev: dict[str, list[torch.Tensor]]) -> None:
    pool = HostKVPool(spec, "layer_first", "direct", dev, pin_memory=False)
    h, d = torch.arange(4, 12), torch.arange(16, 24)
    pool.backup_all_layers(h, d)
    back = {k: [torch.zeros_like(t) for t in lst] for k, lst in dev.items()}
    pool2 = HostKVPool(spec, "layer_first", "direct", back, host_buffers=pool.host_buffers)
    pool2.load_all_layers(h, d)
    for k in dev:
        for a, b in zip(dev[k], back[k]):
            assert torch.equal(as_bytes(a[d]), as_bytes(b[d]))
            assert torch.equal(as_bytes(b[:16]), torch.zeros(16 * as_bytes(b[0]).numel(), dtype=torch.uint8))


def test_uint8_device_tensors_pair_with_a_float16_spec_by_row_bytes() -> None:
    """Device rows held as bytes (uint8) of a float16 spec: accepted, and they move bit-exactly."""
    spec = make_spec(torch.float16)
    dev = {"k": [random_bytes((ROWS, 2, 8), i) for i in range(LAYERS)],
           "v": [random_bytes((ROWS, 2, 4), 10 + i) for i in range(LAYERS)]}
    _round_trip(spec, dev)


def test_float16_device_tensors_pair_with_a_uint8_spec_by_row_bytes() -> None:
    """A byte (uint8) spec with float16 device tensors of the same row bytes: accepted, and they move bit-exactly."""
    spec = make_spec(torch.uint8)  # k rows 2*4 bytes, v rows 2*2 bytes
    dev = {"k": [random_bytes((ROWS, 2, 4), i).view(torch.float16) for i in range(LAYERS)],
           "v": [random_bytes((ROWS, 2, 2), 10 + i).view(torch.float16) for i in range(LAYERS)]}
    _round_trip(spec, dev)


# --- validate.check_host_buffers_disjoint -----------------------------------------------------------

def test_host_buffers_sharing_a_single_byte_are_refused() -> None:
    """One byte in common is an overlap (exactly 1 byte); buffers that merely touch are not."""
    store = torch.zeros(32, dtype=torch.uint8)
    with pytest.raises(HostBufferError) as exc:
        check_host_buffers_disjoint({"k": store[:10], "v": store[9:20]})
    assert str(exc.value).startswith("host buffers 'k' and 'v' share memory (1 bytes overlap)")
    check_host_buffers_disjoint({"k": store[:10], "v": store[10:20]})


def test_a_pool_refuses_wrapped_byte_host_buffers_sharing_one_byte() -> None:
    """Through the pool: uint8 host buffers one byte apart from touching raise before anything is allocated."""
    spec = make_spec(torch.uint8)
    plan = {b.name: b for b in default_registry().layout("layer_first").plan(spec).buffers}
    nk = torch.Size(plan["k"].shape).numel()
    nv = torch.Size(plan["v"].shape).numel()
    store = torch.zeros(nk + nv, dtype=torch.uint8)
    dev = {"k": [random_bytes((ROWS, 2, 4), i) for i in range(LAYERS)],
           "v": [random_bytes((ROWS, 2, 2), 10 + i) for i in range(LAYERS)]}
    with pytest.raises(HostBufferError, match=r"^host buffers 'k' and 'v' share memory \(1 bytes overlap\)"):
        HostKVPool(spec, "layer_first", "direct", dev, host_buffers={
            "k": store[:nk].view(plan["k"].shape), "v": store[nk - 1: nk - 1 + nv].view(plan["v"].shape)})
    pool = HostKVPool(spec, "layer_first", "direct", dev, host_buffers={
        "k": store[:nk].view(plan["k"].shape), "v": store[nk:].view(plan["v"].shape)})
    assert pool.host_buffers["v"].data_ptr() == store.data_ptr() + nk


# --- validate.parse_programs -----------------------------------------------------------------------

@pytest.mark.parametrize("value", [True, False])
def test_parse_programs_refuses_bools(value: bool) -> None:
    """``True`` is an int to Python but not a program count: refused, naming the source."""
    with pytest.raises(ConfigError) as exc:
        parse_programs(value, "programs")
    assert str(exc.value).startswith(f"programs={value!r}: the number of kernel programs must be an integer >= 1")
    assert parse_programs(1, "programs") == 1 and parse_programs(" 3 ", "ENV") == 3


# --- validate.check_indices: what the facts say was read -------------------------------------------

@pytest.mark.parametrize("n", [0, 8])
def test_facts_name_no_host_starts_where_host_values_were_not_read(n: int) -> None:
    """With ``host_values=False`` nothing was learnt of the host slots: ``host_starts`` is ``None`` (never the device
    rows, whose starts are another thing)."""
    spec = make_spec()
    h, d = torch.arange(n), torch.arange(20, 20 + n)
    facts = check_indices(spec, h, d, ROWS, host_values=False)
    assert facts.host_starts is None and facts.device_read
    if n:
        assert facts.device_starts.tolist() == [20, 24]
    facts = check_indices(spec, h, d, ROWS, host_values=False, device_values=False)
    assert facts.host_starts is None and facts.device_starts is None and not facts.device_read
    facts = check_indices(spec, h, d, ROWS)
    assert facts.host_starts.tolist() == ([0, 4] if n else [])


# --- allocator: construction -----------------------------------------------------------------------

@pytest.mark.parametrize("capacity, page_size", [(10, 4), (16, 0), (16, -4), (-16, -4), (2, 4)])
def test_allocator_refuses_a_capacity_that_is_not_whole_positive_pages(capacity: int, page_size: int) -> None:
    """Not whole pages (10 of 4), no page size (0: not a ZeroDivisionError), negative sizes: a SpecError naming both."""
    with pytest.raises(SpecError) as exc:
        PageAllocator(capacity, page_size)
    assert type(exc.value) is SpecError
    assert str(exc.value) == f"capacity={capacity} must be a positive multiple of page_size={page_size} (>= 1)"


# --- allocator: free / clear ---------------------------------------------------------------------------

def test_free_of_the_slot_at_capacity_is_foreign_with_pages_of_one() -> None:
    """With pages of one slot a slot can equal the capacity exactly: outside the pool, and nothing is freed."""
    alloc = PageAllocator(8, 1)
    alloc.alloc(8)
    with pytest.raises(ForeignSlotError) as exc:
        alloc.free(torch.tensor([7, 8]))
    assert str(exc.value).startswith("free(indices): slots must lie in 0..7, got 7..8")
    assert alloc.available_size() == 0
    assert alloc.free(torch.tensor([7])) == 1 and alloc.available_size() == 1


def test_clear_marks_every_page_free() -> None:
    """After clear() no page is allocated: allocated() says so and freeing an old allocation is a double free."""
    alloc = PageAllocator(16, 4)
    slots = alloc.alloc(8)
    alloc.clear()
    assert torch.equal(alloc.allocated(torch.arange(4)), torch.zeros(4, dtype=torch.bool))
    with pytest.raises(DoubleFreeError, match=r"^free\(indices\): pages \[0, 1\] are not allocated"):
        alloc.free(slots)
    assert alloc.available_size() == 16
    assert torch.equal(alloc.alloc(16), torch.arange(16))


@pytest.mark.parametrize("call", ["free", "allocated"])
def test_complex_index_tensors_are_refused(call: str) -> None:
    """Complex values would lose their imaginary part converting to int64: refused like floats."""
    alloc = PageAllocator(16, 4)
    alloc.alloc(4)
    bad = torch.arange(4).to(torch.complex64)
    with pytest.raises(AllocatorArgumentError) as exc:
        getattr(alloc, call)(bad)
    what = {"free": "free(indices) must hold integer slots",
            "allocated": "allocated(page_ids) must hold integer page ids"}[call]
    assert str(exc.value).startswith(f"{what}, got torch.complex64; ")
    assert alloc.available_size() == 12


# --- pool: the validate level ------------------------------------------------------------------------

@pytest.mark.parametrize("raw, level", [(" Full ", "full"), ("STRICT", "strict"), ("\tshapes\n", "shapes"),
                                        ("", "shapes"), ("  ", "shapes")])
def test_validate_level_ignores_case_and_spaces(raw: str, level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """As an argument or from $HICACHE_VALIDATE: any case, surrounding spaces ignored, blank is the default."""
    assert validate_level(raw) == level
    monkeypatch.setenv("HICACHE_VALIDATE", raw)
    assert validate_level(None) == level


# --- pool: the per-batch check memo --------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["direct", "reference"])
def test_a_backup_check_does_not_stand_for_a_load_of_the_same_tensors(backend: str) -> None:
    """Device rows may repeat in a backup (read twice) but not in a load (written twice): the same unchanged tensors
    checked for a backup are checked again, for the load, and nothing moves."""
    spec = make_spec()
    dev = make_device(spec)
    pool = HostKVPool(spec, "layer_first", backend, dev, pin_memory=False)
    h, d = torch.arange(8), torch.tensor([5, 1, 2, 3, 4, 5, 6, 7])
    pool.backup_all_layers(h, d)
    before = snapshot(pool, dev)
    for load in (lambda: pool.load_layer(0, h, d), lambda: pool.load_all_layers(h, d)):
        with pytest.raises(DuplicateIndexError, match=r"^device_indices repeat rows \[5\]"):
            load()
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(pool, dev)))


@pytest.mark.parametrize("backend", ["reference", "direct"])
def test_a_load_check_does_not_stand_for_a_backup_of_the_same_tensors(backend: str) -> None:
    """The reverse: host slots may repeat in a load (read twice) but not in a backup (written twice); the same unchanged
    tensors checked for a load (each direction keeps its own memo) are checked again for the backup, and nothing
    moves."""
    spec = make_spec()
    dev = make_device(spec)
    pool = HostKVPool(spec, "layer_first", backend, dev, pin_memory=False)
    h, d = torch.tensor([4, 5, 6, 7, 4, 5, 6, 7]), torch.arange(8)
    pool.load_layer(0, h, d)
    before = snapshot(pool, dev)
    for backup in (lambda: pool.backup_all_layers(h, d), lambda: pool.backup_layer(0, h, d)):
        with pytest.raises(DuplicateIndexError, match=r"^host_indices repeat"):
            backup()
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(pool, dev)))


@pytest.mark.parametrize("validate", ["full", "strict"])
def test_full_validation_checks_a_repeat_written_behind_the_version_counter(validate: str) -> None:
    """``full``/``strict`` memoise no check: device rows made to repeat through ``.data`` (no version bump, no range
    error for a strategy to find) are refused on the next load, and nothing moves."""
    spec = make_spec()
    dev = make_device(spec)
    pool = HostKVPool(spec, "layer_first", "direct", dev, pin_memory=False, validate=validate)
    h, d = pool.alloc(8), torch.arange(8, 16)
    pool.load_layer(0, h, d)
    assert pool._checked == [None, None]
    version = d._version
    d.data[0] = 9
    assert d._version == version
    before = snapshot(pool, dev)
    with pytest.raises(DuplicateIndexError, match=r"^device_indices repeat rows \[9\]"):
        pool.load_layer(1, h, d)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(pool, dev)))


def test_each_direction_keeps_its_own_check_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backup between two loads of one batch (an engine's backup and load threads share a pool) does not make the
    next load check its indices again, nor a load the next backup; each call still moves the right bytes, and a pair
    changed in place is checked again in its direction."""
    import hicache_core.pool as pool_mod

    calls: list[bool] = []
    real = pool_mod.check_indices

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(kwargs["unique_host"])  # True: a backup's check
        return real(*args, **kwargs)

    monkeypatch.setattr(pool_mod, "check_indices", counted)
    spec = make_spec()
    dev = make_device(spec)
    pool = HostKVPool(spec, "layer_first", "reference", dev, pin_memory=False)
    h, s, d = pool.alloc(8), torch.arange(0, 8), torch.arange(8, 16)
    pool.backup_all_layers(h, s)
    pool.load_layer(0, h, d)
    pool.backup_all_layers(h, s)
    pool.load_layer(1, h, d)
    pool.load_layer(2, h, d)
    assert calls == [True, False]  # one check per direction
    for layer in range(LAYERS):
        for name in ("k", "v"):
            assert torch.equal(as_bytes(dev[name][layer][d]), as_bytes(dev[name][layer][s]))  # (NaN bit patterns too)
    d.add_(0)  # in place: a new version
    pool.load_layer(0, h, d)
    pool.backup_all_layers(h, s)
    assert calls == [True, False, False]


def test_no_checked_pair_outlives_its_call() -> None:
    """What a call's check learnt is for that call's strategy alone: after a call (moved, refused or memo hit) the
    binding holds none."""
    spec = make_spec()
    dev = make_device(spec)
    pool = HostKVPool(spec, "layer_first", "direct", dev, pin_memory=False)
    h, d = torch.arange(8), torch.arange(8, 16)
    pool.backup_all_layers(h, d)
    assert pool.binding.checked is None
    pool.load_layer(0, h, d)
    assert pool.binding.checked is None
    pool.load_layer(1, h, d)  # the memo's hit
    assert pool.binding.checked is None
    with pytest.raises(DuplicateIndexError):
        pool.load_layer(0, h, torch.tensor([8, 9, 10, 11, 8, 9, 10, 11]))
    assert pool.binding.checked is None


# --- pool.set_page from a view of host memory ------------------------------------------------------------

@pytest.mark.parametrize("page", range(CAP // PS))
def test_set_page_from_the_far_half_of_a_wide_host_buffer_writes_what_it_read_as(page: int) -> None:
    """``data`` viewing bytes in the second half of a float16 host buffer (past its element count, counted as bytes):
    still seen as host memory, so every block gets what ``data`` read as at the call."""
    spec = make_spec()
    pool = HostKVPool(spec, "layer_first", "reference", make_device(spec), pin_memory=False)
    for i, t in enumerate(pool.host_buffers.values()):
        as_bytes(t).copy_(random_bytes((t.numel() * t.element_size(),), 50 + i))
    k = pool.host_buffers["k"]
    kb = k.view(-1).view(torch.uint8)
    half = k.numel()  # elements: the byte offset where the buffer's second half starts
    assert half + pool.page_bytes <= kb.numel()
    data = kb[half: half + pool.page_bytes]
    want = data.clone()
    pool.set_page(page, data)
    assert torch.equal(pool.get_page(page), want)


# --- allocator.allocated ------------------------------------------------------------------------------

def test_allocated_of_a_zero_dim_page_id_is_a_copy() -> None:
    """A 0-d page id indexes like an int (a view): the mask handed out must be a copy, writing it changes nothing."""
    alloc = PageAllocator(16, 4)
    alloc.alloc(4)
    mask = alloc.allocated(torch.tensor(0))
    assert mask.shape == () and bool(mask)
    mask.fill_(False)
    assert bool(alloc.allocated(torch.tensor(0)))
    with pytest.raises(DoubleFreeError):
        alloc.free(torch.arange(4, 8))
    assert alloc.free(torch.arange(4)) == 4


# --- pool: repeats and empty calls ------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["direct", "reference"])
def test_a_host_page_repeated_apart_is_refused_for_backups(backend: str, index_check_path: str) -> None:
    """Host pages 0, 1, 0: the repeat is not next to its first occurrence; a backup would still write page 0 twice."""
    spec = make_spec()
    dev = make_device(spec)
    pool = HostKVPool(spec, "layer_first", backend, dev, pin_memory=False)
    before = snapshot(pool, dev)
    h = torch.cat([torch.arange(0, 4), torch.arange(4, 8), torch.arange(0, 4)])
    with pytest.raises(DuplicateIndexError, match=r"^host_indices repeat the pages starting at slots \[0\]; "):
        pool.backup_all_layers(h, torch.arange(12))
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(pool, dev)))
    pool.load_all_layers(h, torch.arange(12))  # a load only reads host pages: a repeat is allowed


@pytest.mark.parametrize("op", ["backup_all_layers", "load_all_layers", "backup_layer", "load_layer"])
def test_empty_index_tensors_move_nothing(op: str, index_check_path: str) -> None:
    """Zero pages is a valid call (both index paths): it moves nothing and raises nothing."""
    spec = make_spec()
    dev = make_device(spec)
    pool = HostKVPool(spec, "layer_first", "direct", dev, pin_memory=False)
    before = snapshot(pool, dev)
    empty = torch.empty(0, dtype=torch.int64)
    args = (empty, empty.clone()) if op.endswith("all_layers") else (1, empty, empty.clone())
    getattr(pool, op)(*args)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(pool, dev)))


# --- pool.set_page from a lazily conjugated view -------------------------------------------------------

def test_set_page_writes_what_a_lazily_conjugated_view_reads_as() -> None:
    """A ``.conj()`` view's memory holds the unconjugated values: the page gets the bytes it reads as."""
    spec = make_spec()
    pool = HostKVPool(spec, "layer_first", "reference", make_device(spec), pin_memory=False)
    src = random_bytes((pool.page_bytes,), 7).view(torch.complex64)
    src = torch.where(torch.isfinite(src), src, torch.zeros_like(src))
    data = src.conj()
    assert data.is_conj()
    pool.set_page(2, data)
    assert torch.equal(pool.get_page(2), data.resolve_conj().view(torch.uint8))


# --- validate.CheckedPair.facts_of ---------------------------------------------------------------------

def test_checked_facts_hold_only_for_the_same_unchanged_tensors() -> None:
    """A strategy may reuse a check's facts only for the very tensors checked, with version counters unmoved."""
    spec = make_spec()
    h, d = torch.arange(8), torch.arange(8, 16)
    facts = check_indices(spec, h, d, ROWS)
    pair = CheckedPair(h, h._version, d, d._version, facts)
    assert pair.facts_of(h, d) is facts
    assert pair.facts_of(h.clone(), d) is None and pair.facts_of(h, d.clone()) is None
    d[0] = 8  # in place: the version moves
    assert pair.facts_of(h, d) is None
    h2, d2 = torch.arange(8), torch.arange(8)
    assert CheckedPair(h2, h2._version, d2, d2._version, facts).facts_of(h2, d2) is facts
    h2.add_(0)
    assert CheckedPair(h2, h2._version - 1, d2, d2._version, facts).facts_of(h2, d2) is None
    # no version counter (inference tensors): nothing says they are unchanged
    with torch.inference_mode():
        hi, di = torch.arange(8), torch.arange(8, 16)
    assert CheckedPair(hi, None, di, None, facts).facts_of(hi, di) is None
    assert CheckedPair(hi, None, d2, d2._version, facts).facts_of(hi, d2) is None
    assert CheckedPair(h2, h2._version, di, None, facts).facts_of(h2, di) is None
