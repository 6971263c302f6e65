"""Mutation-test review of registry.py, spec.py and layout.py: each test kills a mutant the other suites let live."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hicache_core import (Addressing, BufferSpec, Component, DuplicateRegistrationError, LayerMap, PoolSpec,
                          ResolutionError, Segment, SpecError, StrategyInfo, create_registry)
from hicache_core.backends.direct import DirectStrategy
from hicache_core.errors import ConfigError
from hicache_core.layout import page_blocks, strided_host_view
from hicache_core.spec import MAX_POOL_BYTES
from hicache_core.testing import layouts_plugin
from hicache_core.testing import strategies_plugin as strategies

BASE = {"HICACHE_PLUGINS": "core,page_head,fake_vendor"}


def mha(sharded: bool = False) -> PoolSpec:
    lmap = LayerMap.sharded_cp(4, 2, 1) if sharded else LayerMap.unsharded(4)
    return PoolSpec.mha(layer_map=lmap, head_num=2, head_dim=8, dtype=torch.float16, page_size=4, capacity=16)


class Lay:
    description = "test layout"

    def __init__(self, name: str) -> None:
        self.name = name

    def check(self, spec: PoolSpec) -> str | None:
        return None

    def plan(self, spec: PoolSpec) -> Any:
        raise NotImplementedError


# -- registry ------------------------------------------------------------------------------------------------------
def test_a_layout_registered_by_three_plugins_stays_unusable_and_names_all_three() -> None:
    """Mutant: a third registration of a contested layout name (once the first was popped) entered the registry."""
    reg = create_registry(env=BASE, plugins=[(n, layouts_plugin(Lay("trio"))) for n in ("a", "b", "c")])
    assert "trio" not in reg.layouts
    assert not any("trio" in p.layouts for p in reg.plugins if p.name in ("b", "c"))
    (conflict,) = [c for c in reg.conflicts if c.name == "trio"]
    assert conflict.entry_points == ["a", "b", "c"]
    with pytest.raises(DuplicateRegistrationError, match="layout 'trio' is registered by"):
        reg.layout("trio")


def test_a_contested_strategy_name_blocks_the_keys_of_its_first_registration_too() -> None:
    """Mutant: the conflict kept only the later side's StrategyInfo, so the first side's keys stopped raising
    DuplicateRegistrationError and resolved to "nothing registered" instead."""
    reg = create_registry(env=BASE, plugins=[("a", strategies(StrategyInfo("dup.x", "alpha", ("*",), DirectStrategy))),
                                             ("b", strategies(StrategyInfo("dup.x", "beta", ("*",), DirectStrategy)))])
    for backend in ("alpha", "beta"):
        with pytest.raises(DuplicateRegistrationError, match="strategy name 'dup.x' is registered by"):
            reg.resolve(mha(), "page_head", backend)
    assert reg.resolve(mha(), "page_head", "direct").info.name == "core.direct"


def test_a_config_error_of_a_factory_is_the_cause_of_the_resolution_error() -> None:
    """Mutants: ``raise ... from None`` and a resolve that no longer collects the candidates' exceptions."""
    bad = ConfigError("num_warps must be a power of two (1, 2, 4, ...), got 3")

    def factory() -> object:
        raise bad

    reg = create_registry(env=BASE, plugins=[("cfg", strategies(StrategyInfo("cfg.only", "cfgonly", ("*",), factory)))])
    with pytest.raises(ResolutionError) as exc:
        reg.resolve(mha(), "page_head", "cfgonly")
    assert exc.value.__cause__ is bad
    assert "  cfg.only: failed to load: ConfigError: num_warps must be a power of two" in str(exc.value)
    errors: list[Exception] = []
    res, rejected = reg.try_resolve(mha(), "page_head", "cfgonly", errors=errors)
    assert res is None and errors == [bad] and rejected[0][0] == "cfg.only"


def test_alternatives_leave_out_the_key_asked_for() -> None:
    """Mutant: the same (layout, io_backend) was offered as its own alternative (after an override failed)."""
    reg = create_registry(env=BASE)
    alts = reg.alternatives(mha(), "page_head", "direct")
    assert alts and not any(a.startswith("layout='page_head', io_backend='direct' ") for a in alts)
    with pytest.raises(ResolutionError) as exc:
        reg.resolve(mha(), "page_head", "direct", override="core.reference")
    line = next(x for x in str(exc.value).splitlines() if x.startswith("nearest working alternatives: "))
    assert "layout='page_head', io_backend='direct' " not in line


def test_alternatives_to_a_key_refusing_its_options_are_those_that_work_without_them() -> None:
    """A misspelt strategy option fails every other key too: the alternatives were "(none)"; they are now the keys
    that work without the options, said so."""
    reg = create_registry(env=BASE)
    with pytest.raises(ResolutionError) as exc:
        reg.resolve(mha(), "page_head", "direct", options={"stagin": "never"})
    line = next(x for x in str(exc.value).splitlines() if x.startswith("nearest working alternatives"))
    assert line.startswith("nearest working alternatives (none takes strategy_options ['stagin']; without them): ")
    assert "layout='page_head', io_backend='reference' (core.reference)" in line
    with pytest.raises(ResolutionError) as exc:  # options another key does take: the plain line, with that key only
        reg.resolve(mha(), "page_head", "fakedma", override="core.reference", options={"staging": "never"})
    line = next(x for x in str(exc.value).splitlines() if x.startswith("nearest working alternatives"))
    assert line.startswith("nearest working alternatives: ") and "io_backend='direct' (core.direct)" in line


def test_a_composite_strategy_is_handed_the_registry_before_supports() -> None:
    """Mutant: ``use_registry`` was never called (the ``auto`` strategy resolves its parts through it)."""
    seen: list[object] = []

    class Composite(DirectStrategy):
        def use_registry(self, registry: object) -> None:
            seen.append(registry)

        def supports(self, spec: PoolSpec, layout: object) -> str | None:
            return None if seen else "use_registry() was not called first"

    reg = create_registry(env=BASE, plugins=[("comp", strategies(StrategyInfo("comp.x", "comp", ("*",), Composite)))])
    assert reg.resolve(mha(), "page_head", "comp").info.name == "comp.x"
    assert seen == [reg]


# -- spec ------------------------------------------------------------------------------------------------------------
def test_a_host_slot_equal_to_host_layer_num_is_refused() -> None:
    """Mutant: ``0 <= h <= host_layer_num`` let a slot one past the host layers in."""
    with pytest.raises(SpecError) as exc:
        LayerMap((0, 1), 2, 2, host_slots=(0, 2))
    assert str(exc.value) == ("layer map host_slots (0, 2) must give each of the 2 owned layers its own slot in 0..1 "
                              "(host_layer_num)")
    assert LayerMap((0, 1), 3, 2, host_slots=(0, 2)).host_slot(1) == 2


def test_a_pool_of_exactly_max_pool_bytes_is_accepted_and_one_byte_more_is_refused() -> None:
    """Mutant: ``host_bytes > MAX_POOL_BYTES + 1`` accepted a pool of 2**63 bytes."""
    assert MAX_POOL_BYTES == 2**63 - 1 and MAX_POOL_BYTES % 7 == 0
    ok = PoolSpec("raw", (Component("k", 7),), LayerMap.unsharded(1), 1, MAX_POOL_BYTES // 7)
    assert ok.capacity * 7 == MAX_POOL_BYTES
    with pytest.raises(SpecError, match=r"^the pool would span 9223372036854775808 host bytes \(capacity="):
        PoolSpec("raw", (Component("k", 2),), LayerMap.unsharded(2), 1, 2**61)


def test_an_mla_pool_without_latent_dims_has_no_parts() -> None:
    """Mutant: ``split`` without ``kv_lora_rank > 0`` planned an empty ``latent`` part and refused the spec."""
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=0, qk_rope_head_dim=64, dtype=torch.bfloat16,
                        page_size=4, capacity=16)
    assert spec.component("kv").row_bytes == 128 and spec.component("kv").parts == ()
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=0, dtype=torch.bfloat16,
                        page_size=4, capacity=16)
    assert spec.component("kv").row_bytes == 1024 and spec.component("kv").parts == ()


def test_a_layer_map_without_host_layers_is_refused_naming_host_layer_num() -> None:
    """Mutant: the check was dropped, and a pool of 0-byte pages was accepted."""
    with pytest.raises(SpecError, match=r"^the layer map has no host layer slot for any component "
                                        r"\(host_layer_num=0\), so every page would be 0 bytes"):
        PoolSpec.mha(layer_map=LayerMap((), 0, 4), head_num=2, head_dim=8, dtype=torch.float16, page_size=4,
                     capacity=16)
    with pytest.raises(SpecError, match=r"host_layer_num=0"):
        PoolSpec.mha(layer_map=LayerMap.unsharded(0), head_num=2, head_dim=8, dtype=torch.float16, page_size=4,
                     capacity=16)


def test_an_unindexed_cuda_device_is_pinned_to_the_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``"cuda"`` stayed unindexed, and never compared equal to the ``cuda:N`` that tensors report."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(2), head_num=2, head_dim=8, dtype=torch.float16, page_size=4,
                        capacity=16, device="cuda")
    assert spec.device == torch.device("cuda", 1)
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(2), head_num=2, head_dim=8, dtype=torch.float16, page_size=4,
                        capacity=16, device="cuda:0")
    assert spec.device == torch.device("cuda", 0)


# -- layout ----------------------------------------------------------------------------------------------------------
def test_a_chunk_stride_equal_to_chunk_bytes_is_row_contiguous() -> None:
    """Mutant: only ``chunk_stride == 0`` counted as contiguous."""
    assert Addressing(0, 64, 256, 16, 16, 16).row_contiguous
    assert Addressing(0, 64, 256, 16, 16, 0).row_contiguous
    assert not Addressing(0, 64, 256, 16, 8, 32).row_contiguous


def _k_segment(src_offset: int, width: int) -> Segment:
    return Segment("h", "k", None, src_offset, width, Addressing(0, 16 * 32, 4 * 32, 32, width))


def test_a_segment_one_byte_past_the_row_is_refused() -> None:
    """Mutant: ``src_offset + width > row + 1`` let a segment reach one byte past the component row."""
    spec = mha()  # k rows of 2 heads x 8 fp16 = 32 B, 4 layers, 16 slots
    flat = torch.empty(4 * 16 * 32, dtype=torch.uint8)
    assert strided_host_view(flat, _k_segment(0, 32), spec, 4).shape == (4, 4, 4, 1, 32)
    with pytest.raises(SpecError) as exc:
        strided_host_view(flat, _k_segment(1, 32), spec, 4)
    assert str(exc.value) == ("segment of 'k' in host buffer 'h' holds row bytes 1..32, but the component's rows are "
                              "32 B; fix the layout's plan")


def test_an_empty_host_view_reaches_no_byte_and_is_not_refused() -> None:
    """Mutant: the bounds check ran for a view with no host layer, and refused an empty buffer."""
    view = strided_host_view(torch.empty(0, dtype=torch.uint8), _k_segment(0, 32), mha(), 0)
    assert view.shape == (0, 4, 4, 1, 32) and view.numel() == 0


def test_a_negative_stride_reaching_before_the_buffer_is_refused() -> None:
    """Mutant: the lowest byte was taken as ``offset`` whatever the strides' signs."""
    seg = Segment("h", "k", None, 0, 32, Addressing(0, -16 * 32, 4 * 32, 32, 32))
    with pytest.raises(SpecError) as exc:
        strided_host_view(torch.empty(4 * 16 * 32, dtype=torch.uint8), seg, mha(), 4)
    assert str(exc.value).startswith("segment of 'k' reaches bytes -1536..511 of host buffer 'h', which holds 2048 B")
    assert str(exc.value).endswith("fix the layout's plan (it addresses 4 host layers of 4 pages of 4 slots: size the "
                                   "buffer and the strides by spec.component_map('k').host_layer_num and spec.capacity)")


def test_page_blocks_merge_adjacent_rows() -> None:
    """Mutant: adjacent rows were never merged (one block per row instead of one per layer)."""
    assert page_blocks(_k_segment(0, 32), mha(), 2) == [(0, 128), (512, 128)]
    split = Segment("h", "k", None, 0, 32, Addressing(0, 16 * 32, 4 * 32, 64, 16, 32))  # 2 chunks, 64 B token stride
    assert page_blocks(split, mha(), 1) == [(t * 64 + c * 32, 16) for t in range(4) for c in range(2)]


def test_a_buffer_dimension_of_minus_one_is_refused() -> None:
    """Mutant: ``d < -1`` let a ``-1`` (numpy's "infer" dimension) through."""
    with pytest.raises(SpecError) as exc:
        BufferSpec("h", (2, -1), torch.uint8)
    assert str(exc.value) == "host buffer 'h': shape (2, -1) has a negative dimension; fix the layout's plan"
    assert BufferSpec("h", [0, 3], torch.float16).shape == (0, 3) and BufferSpec("h", (2, 3), torch.float16).nbytes == 12


# -- found on a clean re-run (no bytecode cache) ---------------------------------------------------------------------
def _record(reg: Any, name: str) -> Any:
    return next(p for p in reg.plugins if p.name == name)


@pytest.mark.parametrize("info, why", [
    (StrategyInfo("x.k", "kernel", (), DirectStrategy), "strategy 'x.k': layouts must be a non-empty tuple of layout "
                                                         "names"),
    (StrategyInfo("x.k", "kernel", ("page_head",), DirectStrategy, (False, True), None),  # type: ignore[arg-type]
     "strategy 'x.k': description must be a str, got NoneType"),
])
def test_an_empty_layouts_tuple_or_a_non_str_description_breaks_only_its_plugin(info: StrategyInfo, why: str) -> None:
    """Mutants: ``layouts=()`` (a strategy serving no key) and ``description=None`` were accepted."""
    reg = create_registry(env=BASE, plugins=[("x", strategies(info))])
    rec = _record(reg, "x")
    assert rec.error is not None and rec.error.startswith(f"registration failed: TypeError: {why}")
    assert rec.strategies == [] and "x.k" not in reg.strategies


def test_a_contested_exact_strategy_frees_its_keys_for_a_third_plugin_and_blocks_them() -> None:
    """Mutants: the contested name's exact keys stayed in the key table (a third plugin registering one of them
    crashed create_registry with KeyError), and the conflict matched generic strategies only."""
    dup = StrategyInfo("dup.k", "kernel", ("page_head",), DirectStrategy)
    reg = create_registry(env=BASE, plugins=[("a", strategies(dup)), ("b", strategies(dup)),
                                             ("c", strategies(StrategyInfo("c.k", "kernel", ("page_head",),
                                                                           DirectStrategy)))])
    assert "c.k" in reg.strategies and _record(reg, "c").error is None
    assert [c.kind for c in reg.conflicts] == ["strategy"]
    with pytest.raises(DuplicateRegistrationError, match="strategy name 'dup.k' is registered by"):
        reg.resolve(mha(), "page_head", "kernel")


def test_a_contested_strategy_blocks_only_the_sharded_values_it_serves() -> None:
    """Mutant: the conflict also blocked keys of a ``sharded`` value neither side serves."""
    dup = StrategyInfo("dup.s", "direct", ("*",), DirectStrategy, (True,))
    reg = create_registry(env=BASE, plugins=[("a", strategies(dup)), ("b", strategies(dup))])
    assert reg.resolve(mha(), "page_head", "direct").info.name == "core.direct"
    with pytest.raises(DuplicateRegistrationError, match="strategy name 'dup.s' is registered by"):
        reg.resolve(mha(sharded=True), "page_head", "direct")
