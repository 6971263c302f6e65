"""PageAllocator: page-aligned runs, lowest pages first, clear errors, thread safety."""

from __future__ import annotations

import random
import sys
import threading

import pytest
import torch

from hicache_core.allocator import PageAllocator
from hicache_core.errors import (
    AllocatorArgumentError,
    AllocatorError,
    DoubleFreeError,
    ForeignSlotError,
    PageAlignmentError,
    PageMultipleError,
    PoolExhaustedError,
)

PS = 4
CAP = 32  # 8 pages


def pages_of(slots: torch.Tensor) -> list[int]:
    """Page ids of ``slots``, asserting they are whole, aligned, consecutive pages."""
    assert slots.dtype == torch.int64 and slots.device.type == "cpu" and slots.dim() == 1
    runs = slots.view(-1, PS)
    assert bool((runs[:, 0] % PS == 0).all()), f"runs not page-aligned: {slots.tolist()}"
    assert torch.equal(runs, runs[:, :1] + torch.arange(PS)), f"pages not consecutive: {slots.tolist()}"
    return (runs[:, 0] // PS).tolist()


def slots(*pages: int) -> torch.Tensor:
    return (torch.tensor(pages, dtype=torch.int64).unsqueeze(1) * PS + torch.arange(PS)).reshape(-1)


@pytest.fixture
def alloc() -> PageAllocator:
    return PageAllocator(CAP, PS)


def test_alloc_returns_page_aligned_runs_lowest_pages_first(alloc: PageAllocator) -> None:
    a = alloc.alloc(8)
    assert a.tolist() == list(range(8))
    b = alloc.alloc(4)
    assert pages_of(b) == [2]
    c = alloc.alloc(12)
    assert pages_of(c) == [3, 4, 5]
    assert alloc.available_size() == CAP - 24


def test_freed_low_pages_are_reused_first(alloc: PageAllocator) -> None:
    alloc.alloc(CAP)
    alloc.free(slots(5))
    alloc.free(slots(1, 6))
    alloc.free(slots(3))
    assert pages_of(alloc.alloc(8)) == [1, 3]
    assert pages_of(alloc.alloc(8)) == [5, 6]


def test_available_size_tracks_alloc_and_free(alloc: PageAllocator) -> None:
    assert alloc.available_size() == CAP
    a = alloc.alloc(12)
    assert alloc.available_size() == CAP - 12
    assert alloc.free(a[:8]) == 8
    assert alloc.available_size() == CAP - 4
    assert alloc.free(a[8:]) == 4
    assert alloc.available_size() == CAP


def test_free_then_realloc_gives_the_same_slots(alloc: PageAllocator) -> None:
    a = alloc.alloc(16)
    alloc.free(a)
    b = alloc.alloc(16)
    assert torch.equal(a, b)


def test_exhaustion_raises_and_try_alloc_returns_none(alloc: PageAllocator) -> None:
    alloc.alloc(CAP - PS)
    with pytest.raises(PoolExhaustedError, match=r"alloc\(need_size=8\): only 4 of 32 host slots are free; free some"):
        alloc.alloc(8)
    assert alloc.try_alloc(8) is None
    assert alloc.available_size() == PS  # a failed alloc takes nothing
    assert pages_of(alloc.try_alloc(4)) == [7]
    assert alloc.try_alloc(4) is None
    with pytest.raises(PoolExhaustedError, match="only 0 of 32"):
        alloc.alloc(4)


def test_try_alloc_still_raises_on_a_bad_size(alloc: PageAllocator) -> None:
    with pytest.raises(PageMultipleError):
        alloc.try_alloc(3)


@pytest.mark.parametrize("need", [0, -4, 3, 6, CAP + 1])
def test_non_page_multiple_alloc(alloc: PageAllocator, need: int) -> None:
    with pytest.raises(PageMultipleError, match=rf"alloc\(need_size={need}\): need_size must be a positive multiple of page_size=4"):
        alloc.alloc(need)
    assert alloc.available_size() == CAP


def test_double_free(alloc: PageAllocator) -> None:
    a = alloc.alloc(8)
    alloc.free(a[:4])
    with pytest.raises(DoubleFreeError, match=r"pages \[0\] are not allocated \(double free\?\)"):
        alloc.free(a[:4])
    with pytest.raises(DoubleFreeError, match=r"pages \[5\] are not allocated"):
        alloc.free(slots(5))  # never allocated
    assert alloc.available_size() == CAP - 4


def test_repeated_page_in_one_free_is_a_double_free(alloc: PageAllocator) -> None:
    alloc.alloc(8)
    with pytest.raises(DoubleFreeError, match=r"^free\(indices\): pages \[1\] appear more than once in this call; "
                                              r"pass each page once$"):
        alloc.free(slots(1, 1))
    assert alloc.available_size() == CAP - 8


def test_failed_free_frees_nothing(alloc: PageAllocator) -> None:
    alloc.alloc(8)  # pages 0, 1
    with pytest.raises(DoubleFreeError, match=r"pages \[2\]"):
        alloc.free(slots(0, 2))
    assert alloc.available_size() == CAP - 8
    alloc.free(slots(0, 1))  # both still allocated
    assert alloc.available_size() == CAP


@pytest.mark.parametrize("bad", [[-4, -3, -2, -1], [32, 33, 34, 35], [28, 29, 30, 31, 32, 33, 34, 35]])
def test_foreign_slots(alloc: PageAllocator, bad: list[int]) -> None:
    alloc.alloc(CAP)
    with pytest.raises(ForeignSlotError, match=r"free\(indices\): slots must lie in 0\.\.31, got .*do not belong to this pool"):
        alloc.free(torch.tensor(bad))
    assert alloc.available_size() == 0


def test_uint64_values_past_int64_are_named_not_wrapped(alloc: PageAllocator) -> None:
    """uint64 slots or page ids of 2**63 or more are reported as passed (a plain int64 conversion wraps them negative,
    and the range error then named values the caller never passed); smaller uint64 values are taken."""
    held = alloc.alloc(CAP)
    big = torch.tensor([1, 2, 2**64 - 5, 2**63], dtype=torch.uint64)
    with pytest.raises(ForeignSlotError, match=rf"free\(indices\): slots must be below 2\*\*63, got {2**64 - 5};"):
        alloc.free(big)
    with pytest.raises(ForeignSlotError, match=rf"allocated\(page_ids\): page ids must be below 2\*\*63, got {2**63};"):
        alloc.allocated(torch.tensor([0, 2**63], dtype=torch.uint64))
    assert alloc.available_size() == 0
    assert alloc.allocated(torch.tensor([0, 7], dtype=torch.uint64)).tolist() == [True, True]
    assert alloc.free(held[:PS].to(torch.uint64)) == PS and alloc.available_size() == PS


def test_partial_page_free(alloc: PageAllocator) -> None:
    alloc.alloc(8)
    with pytest.raises(PageMultipleError, match=r"free\(indices\): 2 slots is not a multiple of page_size=4; free "
                                                 r"whole pages as alloc returned them$"):
        alloc.free(torch.tensor([0, 1]))
    with pytest.raises(PageAlignmentError, match="slots must be whole pages as returned by alloc"):
        alloc.free(torch.tensor([1, 2, 3, 4]))  # misaligned run
    with pytest.raises(PageAlignmentError, match="whole pages"):
        alloc.free(torch.tensor([0, 1, 3, 2]))  # a page, out of order
    assert alloc.available_size() == CAP - 8


def test_free_accepts_int32_and_empty(alloc: PageAllocator) -> None:
    a = alloc.alloc(8)
    assert alloc.free(torch.empty(0, dtype=torch.int64)) == 0
    assert alloc.free(a.to(torch.int32)) == 8
    assert alloc.available_size() == CAP


def test_clear_frees_everything(alloc: PageAllocator) -> None:
    alloc.alloc(20)
    alloc.clear()
    assert alloc.available_size() == CAP
    assert alloc.alloc(CAP).tolist() == list(range(CAP))


def test_allocator_errors_are_value_errors() -> None:
    for cls in (PoolExhaustedError, DoubleFreeError, ForeignSlotError):
        assert issubclass(cls, AllocatorError) and issubclass(cls, ValueError)


def test_page_size_one() -> None:
    a = PageAllocator(5, 1)
    assert a.alloc(3).tolist() == [0, 1, 2]
    a.free(torch.tensor([1]))
    assert a.alloc(2).tolist() == [1, 3]


@pytest.fixture
def frequent_thread_switches():
    """Switch threads every microsecond so that an unlocked allocator races visibly."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def test_concurrent_alloc_free_never_hands_a_slot_out_twice(frequent_thread_switches: None) -> None:
    capacity, ps, threads, rounds = 256, 4, 8, 300
    alloc = PageAllocator(capacity, ps)
    outstanding: set[int] = set()
    guard = threading.Lock()
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        held: list[torch.Tensor] = []
        try:
            start.wait()
            for _ in range(rounds):
                if held and rng.random() < 0.45:
                    got = held.pop(rng.randrange(len(held)))
                    with guard:
                        outstanding.difference_update(got.tolist())
                    alloc.free(got)
                    continue
                got = alloc.try_alloc(ps * rng.randint(1, 4))
                if got is None:
                    continue
                pages_ok = torch.equal(got.view(-1, ps), got.view(-1, ps)[:, :1] + torch.arange(ps))
                with guard:
                    dup = outstanding.intersection(got.tolist())
                    outstanding.update(got.tolist())
                assert not dup, f"slots {sorted(dup)[:8]} handed out twice"
                assert pages_ok and bool((got[::ps] % ps == 0).all())
                held.append(got)
            for got in held:
                with guard:
                    outstanding.difference_update(got.tolist())
                alloc.free(got)
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not errors, errors[0]
    assert not outstanding
    assert alloc.available_size() == capacity
    assert alloc.alloc(capacity).tolist() == list(range(capacity))


def test_allocated_reports_pages_by_id(alloc: PageAllocator) -> None:
    alloc.alloc(8)  # pages 0, 1
    assert alloc.allocated(torch.tensor([1, 2, 0])).tolist() == [True, False, True]
    assert alloc.allocated(torch.tensor([[0], [7]], dtype=torch.int32)).tolist() == [[True], [False]]
    assert alloc.allocated(torch.empty(0, dtype=torch.int64)).tolist() == []


@pytest.mark.parametrize("bad,error,why", [
    (torch.tensor([-1]), ForeignSlotError, r"allocated\(page_ids\): page ids must lie in 0\.\.7, got -1\.\.-1; pass page ids"),
    (torch.tensor([0, 8]), ForeignSlotError, r"page ids must lie in 0\.\.7, got 0\.\.8"),
    (torch.tensor([True] * 8), AllocatorArgumentError, r"allocated\(page_ids\) must hold integer page ids, got torch\.bool"),
    (torch.tensor([0.0]), AllocatorArgumentError, r"must hold integer page ids, got torch\.float32"),
    ([0, 1], AllocatorArgumentError, r"allocated\(page_ids\) must be a torch\.Tensor of integer page ids, got list"),
])
def test_allocated_refuses_what_is_not_a_page_id(alloc: PageAllocator, bad, error, why) -> None:
    """A negative id would report the last page, a bool tensor select by mask: refused, naming the argument."""
    alloc.alloc(CAP - PS)  # pages 0..6: page 7 (what -1 would name) is free
    with pytest.raises(error, match=why):
        alloc.allocated(bad)
