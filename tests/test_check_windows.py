"""Writes that land while a call checks or copies its index tensors (another thread of the caller): the values a
check vouches for are never other than the values a plan uses, and the fast paths count calls as the normal path.

The other thread is stood in for by a hook that writes the host indices at the exact point the race would land, so
every test is deterministic.
"""

from __future__ import annotations

import pytest
import torch

import hicache_core.backends.plans_plan as plans_plan
import hicache_core.pool as pool_mod
from hicache_core import HostKVPool, LayerMap, PoolSpec, create_registry
from hicache_core.backends.auto_rules import pick_key
from hicache_core.errors import IndexRangeError

REG = create_registry()
CAP = 128


def _pool(lanes: str, monkeypatch: pytest.MonkeyPatch) -> tuple[HostKVPool, torch.Tensor]:
    """A ``direct`` pool whose host buffer is followed by a canary in the same allocation (an out-of-range host slot
    would land there)."""
    monkeypatch.setenv("HICACHE_LANES", lanes)
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                        page_size=16, capacity=CAP)
    big = torch.zeros(3 * CAP * 576, dtype=torch.bfloat16)
    host, canary = big[: 2 * CAP * 576].view(2, CAP, 576), big[2 * CAP * 576:]
    dev = {"kv": [torch.full((CAP, 1, 576), 1.0, dtype=torch.bfloat16) for _ in range(2)]}
    pool = HostKVPool(spec, "layer_first", "direct", dev, registry=REG, strategy="core.direct",
                      strategy_options={"staging": "never"}, host_buffers={"kv": host})
    return pool, canary


def _race_in_check(monkeypatch: pytest.MonkeyPatch, h: torch.Tensor) -> None:
    real = pool_mod.check_indices

    def racing(*args, **kwargs):  # type: ignore[no-untyped-def]
        facts = real(*args, **kwargs)
        h.add_(CAP)  # lands after the values were checked
        return facts

    monkeypatch.setattr(pool_mod, "check_indices", racing)


def _race_before_plan_copy(monkeypatch: pytest.MonkeyPatch, h: torch.Tensor) -> None:
    real, fired = plans_plan.as_long, []

    def racing(t, device, copy=False):  # type: ignore[no-untyped-def]
        if t is h and not fired:
            fired.append(True)
            h.add_(CAP)  # lands after the pool's check, before the plan copies the values
        return real(t, device, copy)

    monkeypatch.setattr(plans_plan, "as_long", racing)


@pytest.mark.parametrize("lanes", ["0", "1"])
@pytest.mark.parametrize("race", [_race_in_check, _race_before_plan_copy], ids=["in-check", "before-plan-copy"])
def test_a_write_during_the_check_is_never_taken_as_checked(monkeypatch, lanes, race):
    """Host slots rewritten out of range while the call checks them: the call (and a repeat of it, lane or not)
    raises :class:`IndexRangeError` and writes nothing, not past the host buffer either."""
    pool, canary = _pool(lanes, monkeypatch)
    h, d = torch.arange(0, 32), torch.arange(0, 32)
    host = pool.binding.segments[0].host_flat.clone()
    race(monkeypatch, h)
    with pytest.raises(IndexRangeError):
        pool.backup_layer(1, h, d)
    monkeypatch.undo()
    monkeypatch.setenv("HICACHE_LANES", lanes)
    with pytest.raises(IndexRangeError):
        pool.backup_layer(1, h, d)  # the same tensors again: nothing memoised vouches for them
    assert torch.equal(pool.binding.segments[0].host_flat, host)
    assert not canary.any()


@pytest.mark.parametrize("lanes", ["0", "1"])
def test_auto_counts_each_call_of_a_pair_once_with_or_without_lanes(monkeypatch, lanes):
    """``auto`` counts the calls of an index pair to tell its first burst from a reuse; a call its lane passes on to
    the normal path (the candidate's lane declined) is counted once, as with lanes off."""
    if torch.cuda.is_available():
        pytest.skip("a CPU pool's kernel needs Triton's interpreter, fixed when Triton was first imported here")
    monkeypatch.setenv("HICACHE_LANES", lanes)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(4), kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                        page_size=16, capacity=CAP)
    dev = {"kv": [torch.zeros(CAP, 1, 576, dtype=torch.bfloat16) for _ in range(4)]}
    pool = HostKVPool(spec, "layer_first", "auto", dev, registry=REG)
    auto = pool.strategy
    h, d = torch.arange(32, 64), torch.arange(0, 32)
    pool.backup_all_layers(h, d)
    counts = []
    for _ in range(2):  # the pair's first burst, then its reuse
        for layer in range(4):
            pool.load_layer(layer, h, d)
            counts.append(auto._uses[pick_key(h, d, 0, False)][0])  # type: ignore[attr-defined]
    assert counts == list(range(1, 9))


@pytest.mark.parametrize("lanes", ["0", "1"])
@pytest.mark.parametrize("swap,error", [
    (lambda h: h[:16].clone(), "IndexLengthMismatchError"),
    (lambda h: h + 10 ** 6, "IndexRangeError"),
    (lambda h: h.to(torch.int16), "IndexDtypeError"),
], ids=["shorter", "out-of-range", "int16"])
def test_a_data_swap_is_checked_again(monkeypatch, lanes, swap, error):
    """``t.data = other`` keeps the tensor's identity and version counter: neither the pool's check memo nor
    ``direct``'s plans (its lane) take the tensor for the one checked before; the call raises and writes nothing."""
    pool, canary = _pool(lanes, monkeypatch)
    h, d = torch.arange(0, 32), torch.arange(0, 32)
    pool.backup_layer(1, h, d)
    pool.backup_layer(1, h, d)  # the lane's turn
    host = pool.binding.segments[0].host_flat.clone()
    h.data = swap(h.data)
    with pytest.raises(Exception) as err:
        pool.backup_layer(1, h, d)
    assert type(err.value).__name__ == error
    assert torch.equal(pool.binding.segments[0].host_flat, host) and not canary.any()
