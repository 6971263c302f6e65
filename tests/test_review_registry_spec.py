"""Review of registry.py, layout.py and spec.py: malformed plugin registrations, env lists, malformed plans and
spec inputs that used to be accepted, crash every other plugin, or fail later with an unrelated message."""

from __future__ import annotations

import types
from dataclasses import replace
from typing import Callable

import numpy as np
import pytest
import torch

from hicache_core import (Addressing, BufferSpec, Component, DuplicateRegistrationError, HostPlan, LayerMap, Part,
                          PoolSpec, Segment, SpecError, StrategyInfo,
                          create_registry, hookimpl)
from hicache_core.registry import discovery  # where the registry lists entry points: the name to replace
from hicache_core.backends.direct import DirectStrategy
from hicache_core.pool import HostKVPool
from hicache_core.testing import layouts_plugin
from hicache_core.testing import strategies_plugin as strategies

BASE = {"HICACHE_PLUGINS": "core,page_head,fake_vendor"}


def mha(sharded: bool = False) -> PoolSpec:
    lmap = LayerMap.sharded_cp(4, 2, 1) if sharded else LayerMap.unsharded(4)
    return PoolSpec.mha(layer_map=lmap, head_num=2, head_dim=8, dtype=torch.float16, page_size=4, capacity=16)


def record(reg, name: str):  # type: ignore[no-untyped-def]
    return next(p for p in reg.plugins if p.name == name)


layouts = layouts_plugin


class Lay:
    description = "test layout"

    def __init__(self, name: str = "lay") -> None:
        self.name = name

    def check(self, spec: PoolSpec) -> str | None:
        return None

    def plan(self, spec: PoolSpec) -> HostPlan:
        raise NotImplementedError


# -- malformed StrategyInfo: the plugin is broken alone ------------------------------------------------------------
@pytest.mark.parametrize("info, why", [
    (StrategyInfo("x.k", "kernel", ("page_head",), DirectStrategy, True), "sharded must be a non-empty tuple of bools"),
    (StrategyInfo("x.d", "direct", ("*",), DirectStrategy, True), "sharded must be a non-empty tuple of bools"),
    (StrategyInfo("x.k", "kernel", "page_head", DirectStrategy), "layouts must be a non-empty tuple of layout names"),
    (StrategyInfo(None, "direct", ("*",), DirectStrategy), "StrategyInfo name must be a non-empty str"),  # type: ignore[arg-type]
    (StrategyInfo("x.d", None, ("*",), DirectStrategy), "StrategyInfo io_backend must be a non-empty str"),  # type: ignore[arg-type]
    (StrategyInfo("x.k", "kernel", ("page_head",), None), "factory must be callable"),  # type: ignore[arg-type]
    (StrategyInfo("x.k", "kernel", ("page_head",), DirectStrategy, ("False",)), "sharded must be"),  # type: ignore[arg-type]
    (StrategyInfo(" x.d", "direct", ("*",), DirectStrategy), "must have no whitespace"),
])
def test_a_malformed_strategy_info_breaks_only_its_plugin(info: StrategyInfo, why: str) -> None:
    """``sharded=True`` raised TypeError out of create_registry (or out of every later resolution for its backend),
    ``layouts="page_head"`` registered one key per letter and crashed with KeyError, a name of None broke sorting."""
    reg = create_registry(env=BASE, plugins=[("x", strategies(info))])
    rec = record(reg, "x")
    assert rec.error is not None and rec.error.startswith("registration failed: TypeError: ") and why in rec.error
    assert rec.strategies == [] and all(n.startswith(("core.", "test_vendor.")) for n in reg.strategies)
    assert reg.resolve(mha(), "page_head", "direct").info.name == "core.direct"
    assert reg.resolve(mha(sharded=True), "page_head", "direct").info.name == "core.direct"
    assert "x" in reg.inventory()


@pytest.mark.parametrize("layouts_, sharded", [(("page_head", "page_head"), (False, True)),
                                                (("page_head",), (False, False, True))])
def test_a_key_listed_twice_by_one_strategy_is_one_registration(layouts_: tuple, sharded: tuple) -> None:
    """It raised KeyError out of create_registry (the strategy conflicted with itself before it was entered)."""
    info = StrategyInfo("x.k", "kernel", layouts_, DirectStrategy, sharded)
    reg = create_registry(env=BASE, plugins=[("x", strategies(info))])
    assert record(reg, "x").error is None and reg.conflicts == []
    assert reg.resolve(mha(), "page_head", "kernel").info.name == "x.k"


def test_layouts_and_sharded_given_as_lists_are_taken_as_tuples() -> None:
    info = StrategyInfo("x.k", "kernel", ["page_head"], DirectStrategy, [True])  # type: ignore[arg-type]
    reg = create_registry(env=BASE, plugins=[("x", strategies(info))])
    assert reg.strategies["x.k"][0].layouts == ("page_head",) and reg.strategies["x.k"][0].sharded == (True,)
    assert reg.resolve(mha(sharded=True), "page_head", "kernel").info.name == "x.k"


# -- malformed layouts -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lay, why", [
    (Lay, "register() was given the class Lay, not a layout: pass an instance (register(Lay()))"),
    (Lay("*"), "must not be '*'"),
    (Lay("page head"), "must have no whitespace"),
    (Lay("lay\n"), "must have no whitespace"),
    (Lay("a,b"), "commas"),
])
def test_a_malformed_layout_breaks_only_its_plugin(lay: object, why: str) -> None:
    reg = create_registry(env=BASE, plugins=[("x", layouts(lay))])
    rec = record(reg, "x")
    assert rec.error is not None and why in rec.error and rec.layouts == []
    assert sorted(reg.layouts) == ["page_head"]


def test_a_layout_whose_description_is_not_text_is_refused_at_registration() -> None:
    """``hicache plugins`` and ``explain`` print it; a None was accepted."""
    lay = Lay()
    lay.description = None  # type: ignore[assignment]
    reg = create_registry(env=BASE, plugins=[("x", layouts(lay))])
    assert "layout 'lay': description must be a str, got NoneType" in (record(reg, "x").error or "")


# -- hooks returning values, check()/supports() returning the wrong type -------------------------------------------
def test_a_hook_returning_its_layouts_instead_of_registering_them_is_reported() -> None:
    """A pluggy habit: ``return [LAYOUT]``.  Nothing was registered and nothing said so."""
    class Returns:
        @hookimpl
        def hicache_register_layouts(self, register: Callable[[object], None]) -> object:
            return [Lay()]

    reg = create_registry(env=BASE, plugins=[("ret", Returns())])
    err = record(reg, "ret").error or ""
    assert "hicache_register_layouts returned list" in err and "call register(x) once per layout" in err


def test_check_returning_a_bool_is_a_rejection_naming_the_plugin() -> None:
    class YesLay(Lay):
        def check(self, spec: PoolSpec) -> object:  # type: ignore[override]
            return True  # meant "fits"

    reg = create_registry(env=BASE, plugins=[("yes", layouts(YesLay()))])
    res, rejected = reg.try_resolve(mha(), "lay", "direct")
    assert res is None
    assert "its check() returned bool True; it must return None (supported) or a one-line reason" in rejected[0][1]
    assert "a bug of plugin 'yes'" in rejected[0][1]


def test_supports_returning_false_is_a_rejection_not_a_pick() -> None:
    class Falsy(DirectStrategy):
        def supports(self, spec, layout):  # type: ignore[no-untyped-def]
            return False

    reg = create_registry(env=BASE, plugins=[("f", strategies(StrategyInfo("a.falsy", "direct", ("*",), Falsy)))])
    res = reg.resolve(mha(), "page_head", "direct")
    assert res.info.name == "core.direct"
    assert res.rejected[0][0] == "a.falsy" and "supports() returned bool False" in res.rejected[0][1]


# -- one object or one name twice ---------------------------------------------------------------------------------------
def test_two_plugins_with_one_entry_point_name_both_load() -> None:
    """A third-party distribution picking an entry-point name already taken (even ``core``) made pluggy refuse the
    second plugin with its internal name table in the message."""
    a = strategies(StrategyInfo("a.k", "kernel", ("page_head",), DirectStrategy))
    b = strategies(StrategyInfo("b.k", "kernel2", ("page_head",), DirectStrategy))
    reg = create_registry(env=BASE, plugins=[("dup", a), ("dup", b)])
    assert [p.error for p in reg.plugins if p.name == "dup"] == [None, None]
    assert reg.resolve(mha(), "page_head", "kernel2").info.name == "b.k"


def test_one_plugin_object_under_two_names_is_named_and_the_first_keeps_working() -> None:
    p = strategies(StrategyInfo("a.k", "kernel", ("page_head",), DirectStrategy))
    reg = create_registry(env=BASE, plugins=[("a", p), ("b", p)])
    assert record(reg, "a").error is None
    err = record(reg, "b").error or ""
    assert "same plugin object as entry point 'a'" in err and "HICACHE_DISABLE_PLUGINS=b" in err
    assert "{" not in err  # not pluggy's table of every plugin
    assert reg.pm.is_registered(p)  # the first registration was withdrawn with the second's failure
    assert reg.resolve(mha(), "page_head", "kernel").info.name == "a.k"


@pytest.mark.parametrize("infos, error", [
    ((StrategyInfo("acme.dma", "acmedma", ("page_head",), DirectStrategy),) * 2,
     "strategy name 'acme.dma' is registered twice by this plugin; register each StrategyInfo once, and give each its "
     "own name"),
    ((StrategyInfo("acme.dma", "acmedma", ("page_head",), DirectStrategy, (False, True)),
      StrategyInfo("acme.dma2", "acmedma", ("page_head",), DirectStrategy, (True,))),
     "key (layout='page_head', io_backend='acmedma', sharded=True) is registered by two strategies of this plugin, "
     "'acme.dma' and 'acme.dma2'; a key takes one exact registration: take 'page_head' out of one's layouts, or True "
     "out of its sharded"),
], ids=["strategy-name", "key"])
def test_a_plugin_registering_a_name_or_key_twice_itself_is_named_broken(infos, error) -> None:
    """One plugin registering a strategy name or a key twice was a conflict "registered by acme-hicache (entry point
    'acme') and acme-hicache (entry point 'acme')" whose fix, "uninstall one distribution or set
    HICACHE_DISABLE_PLUGINS=acme (or acme)", would remove the plugin; it is that plugin's bug, named as such."""
    reg = create_registry(env=BASE, plugins=[("acme", strategies(*infos))])
    assert record(reg, "acme").error == f"registration failed: ValueError: {error}"
    assert reg.conflicts == [] and "acmedma" not in reg.io_backends
    assert reg.resolve(mha(), "page_head", "direct").info.name == "core.direct"


def test_a_plugin_registering_a_layout_twice_itself_is_named_broken() -> None:
    page_head = create_registry(env=BASE).layouts["page_head"][0]
    reg = create_registry(env={"HICACHE_PLUGINS": "core"}, plugins=[("twice", layouts_plugin(page_head, page_head))])
    assert record(reg, "twice").error == ("registration failed: ValueError: layout 'page_head' is registered twice by "
                                          "this plugin; call register() once per layout")
    assert reg.conflicts == []


def test_a_plugin_attribute_that_raises_when_read_breaks_only_that_plugin() -> None:
    class Weird:
        @property
        def hicache_register_layouts(self) -> object:
            raise RuntimeError("lazy import failed")

    reg = create_registry(env=BASE, plugins=[("weird", Weird())])
    assert "its attributes could not be read: RuntimeError: lazy import failed" in (record(reg, "weird").error or "")
    assert reg.resolve(mha(), "page_head", "direct").info.name == "core.direct"


# -- environment lists -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [",", " , ,", ""])
def test_an_allow_list_of_separators_only_is_no_allow_list(value: str) -> None:
    """``HICACHE_PLUGINS=","`` loaded no plugin at all (an empty allow-list), where a blank one loads all."""
    assert [p.name for p in create_registry(env={"HICACHE_PLUGINS": value}).plugins] == \
        [p.name for p in create_registry(env={}).plugins]


def test_strategy_variable_naming_a_contested_strategy_fails_only_its_keys() -> None:
    """A strategy name two plugins register is registered (twice): HICACHE_STRATEGY naming it made every resolution,
    of any backend, fail with "names no registered strategy"."""
    reg = create_registry(env={**BASE, "HICACHE_STRATEGY": "x.direct"}, plugins=[
        ("a", strategies(StrategyInfo("x.direct", "direct", ("*",), DirectStrategy))),
        ("b", strategies(StrategyInfo("x.direct", "direct", ("*",), DirectStrategy)))])
    assert reg.resolve(mha(), "page_head", "reference").info.name == "core.reference"
    with pytest.raises(DuplicateRegistrationError, match="strategy name 'x.direct' is registered by"):
        reg.resolve(mha(), "page_head", "direct")


def test_an_entry_point_whose_distribution_has_no_metadata_still_loads(monkeypatch) -> None:
    """A half-removed install (metadata without a name) raised out of the sort of entry points: no plugin loaded."""
    class NoMeta:
        @property
        def metadata(self) -> object:
            raise FileNotFoundError("METADATA")

        version = None

    plugin = layouts(Lay("lonely"))
    real = discovery.entry_points
    ep = types.SimpleNamespace(name="core", dist=NoMeta(), load=lambda: plugin)
    monkeypatch.setattr(discovery, "entry_points", lambda group: [ep, *real(group=group)])
    reg = create_registry(env=BASE)
    assert "lonely" in reg.layouts and "page_head" in reg.layouts and "core.direct" in reg.strategies
    assert reg.layouts["lonely"][1].label == "<unknown> ?"


# -- malformed plans: refused where they are made, naming the field ------------------------------------------------------
ROW = 8


def _plan(mutate: Callable[[list, list], HostPlan]) -> Callable[[PoolSpec], HostPlan]:
    def plan(spec: PoolSpec) -> HostPlan:
        bufs = [BufferSpec(c, (2, 4, ROW), torch.uint8) for c in ("k", "v")]
        segs = [Segment(c, c, None, 0, ROW, Addressing(0, 4 * ROW, 2 * ROW, ROW, ROW)) for c in ("k", "v")]
        return mutate(bufs, segs)
    return plan


def _pool(mutate: Callable[[list, list], HostPlan], host_buffers: dict | None = None) -> HostKVPool:
    lay = Lay()
    lay.plan = _plan(mutate)  # type: ignore[method-assign]
    reg = create_registry(env=BASE, plugins=[("p", layouts(lay))])
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(2), head_num=1, head_dim=4, dtype=torch.float16, page_size=2,
                        capacity=4)
    dev = {c: [torch.zeros(8, 4, dtype=torch.float16) for _ in range(2)] for c in ("k", "v")}
    return HostKVPool(spec, "lay", "reference", dev, registry=reg, pin_memory=False, host_buffers=host_buffers)


def _addr(**kw: object) -> Callable[[list, list], HostPlan]:
    return lambda b, s: HostPlan(tuple(b), (replace(s[0], addressing=replace(s[0].addressing, **kw)), s[1]))


@pytest.mark.parametrize("mutate, message", [
    (_addr(token=8.0), "Addressing token must be an int, got float 8.0"),
    (_addr(offset=0.0), "Addressing offset must be an int, got float 0.0"),
    (_addr(chunk_bytes=True, chunk_stride=True), "Addressing chunk_bytes must be an int, got bool True"),
    (_addr(chunk_bytes=0), "Addressing chunk_bytes=0 must be >= 1"),
    (lambda b, s: HostPlan((BufferSpec("k", (2, -4, ROW), torch.uint8), b[1]), tuple(s)),
     "host buffer 'k': shape (2, -4, 8) has a negative dimension"),
    (lambda b, s: HostPlan((BufferSpec("k", 64, torch.uint8), b[1]), tuple(s)),
     "host buffer 'k': shape must be a tuple of ints, got int 64"),
    (lambda b, s: HostPlan((BufferSpec("k", (2, 4, ROW), "uint8"), b[1]), tuple(s)),
     "host buffer 'k': dtype must be a torch.dtype"),
    (lambda b, s: HostPlan((b[0], b[0], b[1]), tuple(s)), "HostPlan plans host buffers ['k'] more than once"),
    (lambda b, s: HostPlan((b[0],), tuple(s)), "HostPlan segments live in host buffers ['v'] that it does not plan"),
    (lambda b, s: HostPlan(tuple(b), (replace(s[0], width=0), s[1])), "segment of 'k': width=0 must be >= 1"),
    (lambda b, s: HostPlan(tuple(b), (replace(s[0], width=-8), s[1])), "segment of 'k': width=-8 must be >= 1"),
    (lambda b, s: HostPlan(tuple(b), (replace(s[0], src_offset=-1), s[1])), "src_offset=-1 must be >= 0"),
    (lambda b, s: HostPlan(tuple(b), (replace(s[0], src_offset=4), s[1])),
     "segment of 'k' in host buffer 'k' holds row bytes 4..11, but the component's rows are 8 B"),
    (lambda b, s: HostPlan(tuple(b), (replace(s[0], buffer=None), s[1])), "Segment buffer must be a non-empty str"),
])
def test_a_malformed_plan_is_refused_naming_the_field(mutate: Callable, message: str) -> None:
    """These reached torch (as_strided, empty, a view) with its own message, or were accepted: a zero-width segment, a
    buffer planned twice (the second silently replaced the first)."""
    with pytest.raises(SpecError) as exc:
        _pool(mutate)
    assert message in str(exc.value)


def test_plan_pieces_take_numpy_ints_and_lists() -> None:
    a = Addressing(np.int64(0), np.int32(32), 16, 8, np.int64(8))
    assert type(a.layer) is int and type(a.chunk_bytes) is int
    b = BufferSpec("k", [np.int64(2), 4, 8], torch.uint8)  # type: ignore[arg-type]
    assert b.shape == (2, 4, 8) and b.nbytes == 64
    plan = HostPlan([b], [Segment("k", "k", None, 0, 8, a)])  # type: ignore[arg-type]
    assert isinstance(plan.buffers, tuple) and isinstance(plan.segments, tuple)


def test_a_buffer_shape_given_as_a_list_accepts_wrapped_host_buffers() -> None:
    """A list shape compared unequal to the wrapped tensor's shape tuple: the right buffer was refused."""
    def lists(b: list, s: list) -> HostPlan:
        return HostPlan(tuple(BufferSpec(x.name, list(x.shape), x.dtype) for x in b), tuple(s))  # type: ignore[arg-type]

    host = {c: torch.zeros(2, 4, ROW, dtype=torch.uint8) for c in ("k", "v")}
    pool = _pool(lists, host_buffers=host)
    assert pool.binding.host_buffers["k"].data_ptr() == host["k"].data_ptr()


# -- spec inputs ----------------------------------------------------------------------------------------------------------
LM = LayerMap.unsharded(2)
K, V = Component("k", 8), Component("v", 8)


@pytest.mark.parametrize("make, message", [
    (lambda: PoolSpec("mha", (K, V), LM, 2, 4, head_num=0), "head_num=0 must be >= 1"),
    (lambda: PoolSpec("mha", (K, V), LM, 2, 4, head_num=2.5), "head_num must be an int, got float 2.5"),
    (lambda: PoolSpec("mha", (K, V), LM, 2, 4, head_num=True), "head_num must be an int, got bool True"),
    (lambda: PoolSpec("mha", (c for c in (K, V)), LM, 2, 4), "components must be a tuple of Component"),
    (lambda: PoolSpec("mha", ("k", "v"), LM, 2, 4), "components must be a tuple of Component"),
    (lambda: PoolSpec("mha", K, LM, 2, 4), "components must be a tuple of Component"),
    (lambda: Component("", 8), "component name must be a non-empty str, got str ''"),
    (lambda: Component(None, 8), "component name must be a non-empty str, got NoneType None"),
    (lambda: Part(None, 0, 8), "part name must be a non-empty str"),
    (lambda: Component("k", 8, layers=(0, 0)), "component 'k': layers (0, 0) repeat a device layer"),
    (lambda: LayerMap((0,), 1, 1, sharded="False"), "LayerMap sharded must be True or False, got str 'False'"),
    (lambda: LayerMap((0,), 1, 1, sharded=1), "LayerMap sharded must be True or False, got int 1"),
    (lambda: LayerMap(3, 3, 3), "LayerMap device_layers must be a tuple of ints, got int 3"),
    (lambda: LayerMap((0,), 1, 1, host_slots=0), "LayerMap host_slots must be a tuple of ints, got int 0"),
    (lambda: LayerMap((), 0, -3), "LayerMap num_device_layers=-3 must be >= 0"),
    (lambda: PoolSpec("mha", (K, V), LM, 2, 2**70), "more than 64-bit byte offsets address"),
    (lambda: PoolSpec("mha", (Component("k", 2**62),), LM, 2, 4), "more than 64-bit byte offsets address"),
    (lambda: PoolSpec("mha", (K, V), LM, 2, 4, device="gpu"), "device must be a torch.device or a device string"),
    (lambda: PoolSpec("mha", (K, V), LM, 2, 4, device=None), "device must be a torch.device or a device string"),
    (lambda: PoolSpec.mha(layer_map=LM, head_num=1, head_dim=4, dtype=torch.float16, page_size=2, capacity=4,
                          device="gpu"), "device must be a torch.device or a device string"),
    (lambda: PoolSpec.mla(layer_map=LM, kv_lora_rank=0, qk_rope_head_dim=0, dtype=torch.float16, page_size=2,
                          capacity=4), "kv_lora_rank=0 and qk_rope_head_dim=0 leave an empty row"),
    (lambda: PoolSpec.mha(layer_map=LM, head_num=1, head_dim=4, dtype=torch.float16, page_size=2, capacity=4,
                          extra=Component("x", 4)), "extra must be a sequence of Component"),
])
def test_inconsistent_spec_inputs_are_refused_naming_the_argument(make: Callable[[], object], message: str) -> None:
    with pytest.raises(SpecError) as exc:
        make()
    assert message in str(exc.value)


def test_spec_normalises_numpy_and_list_inputs() -> None:
    spec = PoolSpec("mha", [K, V], LM, 2, 4, head_num=np.int64(2))  # type: ignore[arg-type]
    assert isinstance(spec.components, tuple) and type(spec.head_num) is int
    hash(spec)  # a list of components made the frozen spec unhashable
    lmap = LayerMap.sharded_cp(np.int64(5), np.int64(2), np.int64(1), pad_to_largest=True)
    assert lmap.sharded is True and lmap.host_layer_num == 3
    assert LayerMap((0,), 1, 1, sharded=np.bool_(True)).sharded is True
