"""The registry: loading order, duplicates, broken plugins, allow/block lists, overrides, tracing, error text.

Every test builds a fresh registry with ``create_registry(entry_points=..., plugins=[...], env={...})``.
Entry points come from the installed test distributions (tests/plugins); broken
ones are added by wrapping the real entry-point query.
"""

from __future__ import annotations

import ast
import logging
import sys
import types
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Callable

import pytest
import torch

import hicache_core
from hicache_core import (
    DuplicateRegistrationError,
    LayerMap,
    PluginLoadError,
    RegistryError,
    PoolSpec,
    ResolutionError,
    StrategyInfo,
    UnknownLayoutError,
    create_registry,
    hookimpl,
)
from hicache_core import registry as registry_module
from hicache_core.registry import discovery  # where the registry lists entry points: the name to replace
from hicache_core.backends.direct import DirectStrategy
from hicache_core.backends.reference import ReferenceStrategy
from hicache_core.testing import layouts_plugin
from hicache_core.testing import strategies_plugin as strategies

BASE = {"HICACHE_PLUGINS": "core,page_head,fake_vendor"}


def mha(sharded: bool = False, dtype: torch.dtype = torch.float16) -> PoolSpec:
    lmap = LayerMap.sharded_cp(4, 2, 1) if sharded else LayerMap.unsharded(4)
    return PoolSpec.mha(layer_map=lmap, head_num=2, head_dim=8, dtype=dtype, page_size=4, capacity=16)


layouts = layouts_plugin


class Raising:
    @hookimpl
    def hicache_register_strategies(self, register: Callable[[StrategyInfo], None]) -> None:
        register(StrategyInfo("raising.half", "half", ("*",), DirectStrategy))
        raise RuntimeError("hook exploded")


class Misspelled:
    @hookimpl
    def hicache_register_layout(self, register: Callable[[object], None]) -> None:  # missing "s"
        raise AssertionError("never called")


def generic(name: str, backend: str, factory: Callable[[], object] = DirectStrategy) -> StrategyInfo:
    return StrategyInfo(name, backend, ("*",), factory)


# -- fake entry points for broken plugins ------------------------------------------
@pytest.fixture
def extra_entry_points(monkeypatch):
    """Add entry points (name -> plugin object or exception to raise on import) next to the installed ones."""

    def install(**plugins: object) -> None:
        real = discovery.entry_points
        eps = []
        for name, plugin in plugins.items():
            mod = types.ModuleType(f"hicache_test_ep_{name}")
            if isinstance(plugin, BaseException):
                def fail(attr: str, exc: BaseException = plugin) -> object:
                    raise exc
                mod.__getattr__ = fail  # type: ignore[attr-defined]
            else:
                mod.plugin = plugin  # type: ignore[attr-defined]
            monkeypatch.setitem(sys.modules, mod.__name__, mod)
            eps.append(EntryPoint(name, f"{mod.__name__}:plugin", "hicache"))
        monkeypatch.setattr(discovery, "entry_points", lambda group: [*eps, *real(group=group)])

    return install


# -- order ---------------------------------------------------------------------------
def test_entry_points_load_in_name_order_whatever_the_install_order(monkeypatch):
    real = discovery.entry_points
    orders = []
    for flip in (False, True):
        monkeypatch.setattr(discovery, "entry_points",
                            lambda group, flip=flip: sorted(real(group=group), key=lambda e: e.name, reverse=flip))
        reg = create_registry(env=BASE)
        orders.append(([p.name for p in reg.plugins], reg.inventory(), reg.io_backends))
    assert orders[0] == orders[1]
    assert orders[0][0] == ["core", "fake_vendor", "page_head"]


def test_candidates_and_inventory_do_not_depend_on_registration_order():
    a = strategies(generic("b.direct", "direct"), generic("a.direct", "direct"))
    b = strategies(generic("c.direct", "direct"))
    one = create_registry(env=BASE, plugins=[("a", a), ("b", b)])
    two = create_registry(env=BASE, plugins=[("b", b), ("a", a)])
    for reg in (one, two):
        assert [c.name for c in reg.candidates("page_head", "direct", False)] == [
            "a.direct", "b.direct", "c.direct", "core.direct"]
        assert reg.resolve(mha(), "page_head", "direct").info.name == "a.direct"
    assert one.inventory() == two.inventory()


def test_exact_registration_beats_generic_ones():
    reg = create_registry(env=BASE, plugins=[("x", strategies(
        StrategyInfo("x.exact", "direct", ("page_head",), DirectStrategy, (True,))))])
    assert [c.name for c in reg.candidates("page_head", "direct", True)] == ["x.exact", "core.direct"]
    assert [c.name for c in reg.candidates("page_head", "direct", False)] == ["core.direct"]
    assert reg.resolve(mha(sharded=True), "page_head", "direct").info.name == "x.exact"


# -- duplicates ------------------------------------------------------------------------
def test_duplicate_layout_fails_only_that_layout_and_names_both_entry_points():
    from hicache_test_page_head.layout import PageHeadLayout

    env = {"HICACHE_PLUGINS": BASE["HICACHE_PLUGINS"] + ",page_first"}
    reg = create_registry(env=env, plugins=[("copycat", layouts(PageHeadLayout()))])
    msg = ("layout 'page_head' is registered by hicache-test-page-head 0.1.0 (entry point 'page_head') and "
           "<local> - (entry point 'copycat'); it cannot be used until all but one are removed: uninstall one "
           "distribution or set HICACHE_DISABLE_PLUGINS=copycat (or page_head)")
    with pytest.raises(DuplicateRegistrationError) as exc:
        reg.resolve(mha(), "page_head", "direct")
    assert str(exc.value) == msg
    [conflict] = reg.conflicts
    assert (conflict.kind, conflict.name, conflict.entry_points) == ("layout", "page_head", ["page_head", "copycat"])
    assert conflict.message == msg
    assert reg.resolve(mha(), "page_first", "direct").info.name == "core.direct"  # unrelated layouts still work
    assert reg.resolve(mha(), "page_first_direct", "fakedma").info.name == "test_vendor.fakedma"
    assert "conflicting registrations (unusable until one side is removed):\n  " + msg in reg.inventory()


def test_duplicate_exact_key_fails_only_that_key():
    clash = StrategyInfo("other.dma", "fakedma", ("page_head",), DirectStrategy, (False,))
    reg = create_registry(env=BASE, plugins=[("clash", strategies(clash))])
    with pytest.raises(DuplicateRegistrationError) as exc:
        reg.resolve(mha(), "page_head", "fakedma")
    assert str(exc.value) == (
        "key (layout='page_head', io_backend='fakedma', sharded=False) is registered by hicache-test-vendor 0.1.0 "
        "(entry point 'fake_vendor', strategy 'test_vendor.fakedma') and <local> - (entry point 'clash', strategy "
        "'other.dma'); it cannot be used until all but one are removed: uninstall one distribution or set "
        "HICACHE_DISABLE_PLUGINS=clash (or fake_vendor)")
    assert reg.conflicts[0].entry_points == ["fake_vendor", "clash"]
    assert reg.resolve(mha(sharded=True), "page_head", "fakedma").info.name == "test_vendor.fakedma"  # other key
    assert reg.resolve(mha(), "page_head", "direct").info.name == "core.direct"
    assert reg.resolve(mha(sharded=True), "page_head", "direct").info.name == "core.direct"


def test_duplicate_strategy_name_fails_only_the_keys_it_serves():
    reg = create_registry(env=BASE, plugins=[("again", strategies(generic("core.direct", "direct")))])
    with pytest.raises(DuplicateRegistrationError, match=r"^strategy name 'core.direct' is registered by "
                                                         r"hicache-core 0.1.0 \(entry point 'core'\) and <local> - "
                                                         r"\(entry point 'again'\); .* HICACHE_DISABLE_PLUGINS=again"):
        reg.resolve(mha(), "page_head", "direct")
    assert reg.resolve(mha(), "page_head", "reference").info.name == "core.reference"
    assert [(c.kind, c.name) for c in reg.conflicts] == [("strategy", "core.direct")]


def test_bogus_strategy_environment_variable_is_an_error():
    reg = create_registry(env={**BASE, "HICACHE_STRATEGY": "bogus"})
    with pytest.raises(ResolutionError, match=r"  bogus: HICACHE_STRATEGY='bogus' names no registered strategy; "
                                              r"registered: \[.*'core.direct'.*\]\. Fix or unset HICACHE_STRATEGY"):
        reg.resolve(mha(), "page_head", "direct")


def test_blocking_one_side_of_a_duplicate_resolves_it():
    clash = StrategyInfo("other.dma", "fakedma", ("page_head",), DirectStrategy, (False,))
    reg = create_registry(env={**BASE, "HICACHE_PLUGINS": "core,page_head"}, plugins=[("clash", strategies(clash))])
    assert reg.resolve(mha(), "page_head", "fakedma").info.name == "other.dma"


def test_a_block_list_naming_no_installed_plugin_is_warned_about(caplog):
    """A typo (or a distribution's name) in HICACHE_DISABLE_PLUGINS would leave on the plugin it meant to switch
    off: said once, with the entry-point names it takes; the names that match still block."""
    from hicache_core.logonce import forget_logged

    forget_logged()
    caplog.set_level(logging.WARNING, logger="hicache_core.registry")
    reg = create_registry(env={**BASE, "HICACHE_DISABLE_PLUGINS": "fake_vendor,hicache-test-page-head"})
    assert "fakedma" not in reg.io_backends and "page_head" in reg.layouts
    warned = [r.getMessage() for r in caplog.records if "HICACHE_DISABLE_PLUGINS" in r.getMessage()]
    assert len(warned) == 1 and "not installed: ['hicache-test-page-head']" in warned[0]
    assert "'page_head'" in warned[0]  # the names it takes
    caplog.clear()
    create_registry(env={**BASE, "HICACHE_DISABLE_PLUGINS": "fake_vendor"})
    assert not [r for r in caplog.records if "HICACHE_DISABLE_PLUGINS" in r.getMessage()]


# -- broken plugins ----------------------------------------------------------------------
def test_raising_hook_is_reported_and_skipped_others_still_work(caplog):
    caplog.set_level(logging.WARNING, logger="hicache_core.registry")
    reg = create_registry(env=BASE, plugins=[("raising", Raising())])
    rec = next(p for p in reg.plugins if p.name == "raising")
    assert rec.error == "registration failed: RuntimeError: hook exploded"
    assert "raising.half" not in reg.strategies and "half" not in reg.io_backends  # withdrawn
    assert reg.resolve(mha(), "page_head", "direct").info.name == "core.direct"
    assert [r.getMessage() for r in caplog.records] == [
        "hicache plugin 'raising' (<local> -) skipped: registration failed: RuntimeError: hook exploded"]
    assert "broken plugins (skipped):\n  raising (<local> -): registration failed: RuntimeError: hook exploded" \
        in reg.inventory()


def test_misspelled_hook_is_reported_and_skipped():
    reg = create_registry(env=BASE, plugins=[("typo", Misspelled())])
    rec = next(p for p in reg.plugins if p.name == "typo")
    assert rec.error == "implements unknown hooks ['hicache_register_layout'] (did you mean 'hicache_register_layouts' for 'hicache_register_layout'?)"
    assert sorted(reg.layouts) == ["page_head"]


def _module(name: str, hook: Callable[..., None]) -> types.ModuleType:
    """A plugin module whose one hook is ``hook`` (as a plugin's ``plugin.py`` defines it: a function, no self)."""
    mod = types.ModuleType(name)
    setattr(mod, hook.__name__, hookimpl(hook))
    return mod


def _misnamed():
    def hicache_register_strategies(reg):  # a misnamed parameter (pluggy matches hooks' parameters by name)
        reg(StrategyInfo("sig.x", "sig", ("*",), DirectStrategy))
    return hicache_register_strategies


def _no_parameter():
    def hicache_register_strategies():  # the register callback forgotten
        pass
    return hicache_register_strategies


def _keyword_only():
    def hicache_register_layouts(*, register, extra=None):  # keyword-only, and an optional extra: fine
        pass
    return hicache_register_layouts


@pytest.mark.parametrize("hook, shown", [(_misnamed(), "(reg)"), (_no_parameter(), "()")],
                         ids=["misnamed", "missing"])
def test_a_hook_with_the_wrong_parameters_names_the_signature_to_write(hook, shown):
    """pluggy's refusal ("Argument(s) {'reg'} are declared in the hookimpl but can not be found in the hookspec", or
    a TypeError when the hook is called) named neither the parameter nor the fix; the plugin's error now does."""
    reg = create_registry(env=BASE, plugins=[("sig", _module("sig_plugin", hook))])
    rec = next(p for p in reg.plugins if p.name == "sig")
    assert rec.error == (f"hook hicache_register_strategies{shown} does not match its specification "
                         "hicache_register_strategies(register): the core calls it with one keyword argument, register; "
                         "write `def hicache_register_strategies(register):` and call register(x) once per strategy")
    assert "sig.x" not in reg.strategies and "page_head" in reg.layouts
    ok = create_registry(env=BASE, plugins=[("kw", _module("kw_plugin", _keyword_only()))])
    assert next(p for p in ok.plugins if p.name == "kw").error is None


@pytest.mark.parametrize("plugin, error", [
    (Raising(), "registration failed: RuntimeError: hook exploded"),
    (Misspelled(), "implements unknown hooks ['hicache_register_layout'] (did you mean 'hicache_register_layouts' for 'hicache_register_layout'?)"),
    (ImportError("no module named vendor_sdk"), "import failed: ImportError: no module named vendor_sdk (entry point "
     "broken = hicache_test_ep_broken:plugin: if the plugin's code moved, reinstall its distribution: entry points are "
     "read when it is installed, -e installs too)"),
    # a module calling sys.exit() on import (e.g. a missing SDK) must not stop the others loading
    (SystemExit("vendor SDK missing"), "import failed: SystemExit: vendor SDK missing"),
])
def test_broken_entry_point_skipped_unless_allowed(extra_entry_points, plugin, error):
    extra_entry_points(broken=plugin)
    reg = create_registry(env={})
    rec = next(p for p in reg.plugins if p.name == "broken")
    assert (rec.dist, rec.error) == ("<unknown>", error)
    assert "page_head" in reg.layouts and "core.direct" in reg.strategies
    with pytest.raises(PluginLoadError) as exc:
        create_registry(env={"HICACHE_PLUGINS": "core,broken"})
    assert str(exc.value) == f"hicache plugin 'broken' (<unknown> ?) was requested but {error}"


def test_allow_list_names_a_missing_plugin():
    with pytest.raises(PluginLoadError, match=r"HICACHE_PLUGINS names plugins that are not installed: \['nope'\]"):
        create_registry(env={"HICACHE_PLUGINS": "core,nope"})
    with pytest.raises(PluginLoadError) as exc:  # a misspelt name gets its near match and where names come from
        create_registry(env={"HICACHE_PLUGINS": "core,page_haed"})
    assert "; did you mean: page_head, " in str(exc.value)
    assert str(exc.value).endswith("(plugins register through entry points of the 'hicache' group; `hicache plugins` "
                                   "lists them; a plugin whose entry points changed needs a reinstall)")


def test_a_misspelt_block_list_name_warns_with_its_near_match(caplog):
    """A typo leaves on the plugin it meant to switch off: the warning names the installed near match."""
    from hicache_core.logonce import forget_logged

    forget_logged()
    with caplog.at_level(logging.WARNING, logger="hicache_core.registry"):
        reg = create_registry(env={"HICACHE_DISABLE_PLUGINS": "page_haed"})
    assert "page_head" in reg.layouts
    warning = next(r.getMessage() for r in caplog.records if "HICACHE_DISABLE_PLUGINS" in r.getMessage())
    assert warning.startswith("HICACHE_DISABLE_PLUGINS names plugins that are not installed: ['page_haed'] (nothing "
                              "switched off for them)") and "; 'page_haed': did you mean: page_head" in warning


def test_leaving_out_the_core_plugin_warns_and_names_the_fix(caplog):
    from hicache_core.logonce import forget_logged

    for env, fix in (({"HICACHE_PLUGINS": "page_head"}, "add core to HICACHE_PLUGINS='page_head'"),
                     ({"HICACHE_PLUGINS": "core,page_head", "HICACHE_DISABLE_PLUGINS": "core"},
                      "take core off HICACHE_DISABLE_PLUGINS='core'")):
        forget_logged()
        with caplog.at_level(logging.WARNING, logger="hicache_core.registry"):
            caplog.clear()
            reg = create_registry(env=env)
        assert "reference" not in reg.io_backends
        assert "hicache's 'core' plugin is not loaded: its reference, direct and auto io_backends are missing" in \
            caplog.text and caplog.text.rstrip().endswith(fix)
    forget_logged()
    with caplog.at_level(logging.WARNING, logger="hicache_core.registry"):
        caplog.clear()
        create_registry(env={"HICACHE_PLUGINS": "core,page_head"})
    assert "core" not in caplog.text


# -- allow / block lists -------------------------------------------------------------------
def test_allow_list():
    reg = create_registry(env={"HICACHE_PLUGINS": "core, page_head"})
    assert [p.name for p in reg.plugins] == ["core", "page_head"]
    assert reg.io_backends == ["auto", "direct", "reference"]


def test_block_list():
    reg = create_registry(env={"HICACHE_DISABLE_PLUGINS": "fake_vendor"})
    assert "fake_vendor" not in [p.name for p in reg.plugins] and "page_head" in reg.layouts
    assert "fakedma" not in reg.io_backends
    reg = create_registry(env={"HICACHE_DISABLE_PLUGINS": "page_head,fake_vendor"})
    assert {"page_head", "fake_vendor"}.isdisjoint(p.name for p in reg.plugins)
    assert "core" in [p.name for p in reg.plugins]


def test_no_entry_points():
    reg = create_registry(entry_points=False, plugins=[("only", strategies(generic("only.ref", "reference",
                                                                                  ReferenceStrategy)))])
    assert [p.name for p in reg.plugins] == ["only"] and reg.layouts == {}
    with pytest.raises(UnknownLayoutError, match="unknown layout 'page_head'"):
        reg.layout("page_head")


# -- overrides ------------------------------------------------------------------------------
def second_direct() -> object:
    return strategies(generic("zz.direct", "direct"))


def test_override_argument_picks_a_candidate():
    reg = create_registry(env=BASE, plugins=[("zz", second_direct())])
    assert reg.resolve(mha(), "page_head", "direct").info.name == "core.direct"
    res = reg.resolve(mha(), "page_head", "direct", override="zz.direct")
    assert (res.info.name, res.provider.name) == ("zz.direct", "zz")
    with pytest.raises(ResolutionError) as exc:
        reg.resolve(mha(), "page_head", "direct", override="core.reference")
    assert str(exc.value).splitlines()[1] == (
        "  core.reference: not a candidate for this key; candidates: ['core.direct', 'zz.direct']")


def test_strategy_environment_variable():
    reg = create_registry(env={**BASE, "HICACHE_STRATEGY": "zz.direct"}, plugins=[("zz", second_direct())])
    assert reg.resolve(mha(), "page_head", "direct").info.name == "zz.direct"
    # where it names no candidate it is ignored
    assert reg.resolve(mha(), "page_head", "reference").info.name == "core.reference"
    # the argument wins over the environment
    assert reg.resolve(mha(), "page_head", "direct", override="core.direct").info.name == "core.direct"


def test_rejected_candidate_falls_through_to_the_next():
    class Picky(DirectStrategy):
        def supports(self, spec, layout):
            return "picky wants sharded pools" if not spec.sharded else None

    reg = create_registry(env=BASE, plugins=[("p", strategies(generic("a.picky", "direct", Picky)))])
    res = reg.resolve(mha(), "page_head", "direct")
    assert res.info.name == "core.direct" and res.rejected == (("a.picky", "picky wants sharded pools"),)
    assert reg.resolve(mha(sharded=True), "page_head", "direct").info.name == "a.picky"


def test_a_failing_factory_rejects_only_its_strategy():
    def explode() -> object:
        raise ImportError("vendor runtime missing")

    reg = create_registry(env=BASE, plugins=[("e", strategies(generic("a.broken", "direct", explode)))])
    res = reg.resolve(mha(), "page_head", "direct")
    assert res.rejected == (("a.broken", "failed to load: ImportError: vendor runtime missing"),)


# -- tracing and error text -------------------------------------------------------------------
def test_trace_logs_every_resolution(caplog):
    caplog.set_level(logging.INFO, logger="hicache_core.registry")
    reg = create_registry(env={**BASE, "HICACHE_TRACE": "1"})
    caplog.clear()
    reg.resolve(mha(sharded=True), "page_head", "fakedma")
    msgs = [r.getMessage() for r in caplog.records if r.name == "hicache_core.registry"]
    assert msgs == ["hicache: (page_head, fakedma, sharded=True) mha [k:32B+v:32B] x 2 layers, page 4, sharded 2/4 "
                    "layers -> test_vendor.fakedma from hicache-test-vendor 0.1.0"]


def test_no_trace_by_default(caplog):
    caplog.set_level(logging.INFO, logger="hicache_core.registry")
    reg = create_registry(env=BASE)
    caplog.clear()
    reg.resolve(mha(), "page_head", "direct")
    assert [r for r in caplog.records if r.name == "hicache_core.registry"] == []


def test_resolution_error_lists_rejections_plugins_and_alternatives():
    reg = create_registry(env=BASE)
    with pytest.raises(ResolutionError) as exc:
        reg.resolve(mha(dtype=torch.float32), "page_head", "fakedma")
    assert str(exc.value) == """\
no strategy serves (layout='page_head', io_backend='fakedma', sharded=False) for mha [k:64B+v:64B] x 4 layers, page 4:
  test_vendor.fakedma: fakedma moves 1- and 2-byte element pools only; components ['k', 'v'] are float32
nearest working alternatives: layout='page_head', io_backend='auto' (core.auto); layout='page_head', io_backend='direct' (core.direct); layout='page_head', io_backend='reference' (core.reference)
installed layouts:
  page_head (hicache-test-page-head 0.1.0)
installed io_backends:
  auto (hicache-core 0.1.0)
  direct (hicache-core 0.1.0)
  fakedma (hicache-test-vendor 0.1.0)
  reference (hicache-core 0.1.0)"""


# -- the core names no layout ----------------------------------------------------------------
LAYOUT_NAMES = ("layer_first", "page_first", "kv_split")
EXEMPT = {"cli", "integrations", "testing"}


def _code_words(path: Path) -> list[tuple[int, str]]:
    """Identifiers and string constants of ``path``, docstrings excluded (docs may name layouts)."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            out.append((node.lineno, node.value))
        elif isinstance(node, ast.Name):
            out.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            out.append((node.lineno, node.attr))
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            out.append((node.lineno, node.name))
    return out


def test_core_has_no_layout_name_dispatch():
    root = Path(hicache_core.__file__).parent
    files = [p for p in root.rglob("*.py") if not EXEMPT & set(p.relative_to(root).parts)]
    assert len(files) >= 10
    hits = [f"{p.relative_to(root)}:{line}: {word!r}" for p in files for line, word in _code_words(p)
            if any(name in word for name in LAYOUT_NAMES)]
    assert hits == []


def test_layout_name_check_catches_dispatch(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('"""Docs may say page_first."""\ndef f(layout):\n    if layout == "page_first":\n        return 1\n')
    assert [w for _, w in _code_words(bad) if "page_first" in w] == ["page_first"]


# -- plugins failing half-way, plugin modules, re-entry ---------------------------------------
def test_a_plugin_failing_half_way_leaves_no_conflict_behind():
    """Its registrations are collected and enter the registry only when every hook succeeded: a plugin registering a
    name another plugin holds, then raising, takes nothing from it (no conflict outlives it)."""
    from hicache_test_page_head.layout import PageHeadLayout

    class Copycat:
        @hookimpl
        def hicache_register_layouts(self, register: Callable[[object], None]) -> None:
            register(PageHeadLayout())
            raise RuntimeError("hook exploded")

    reg = create_registry(env=BASE, plugins=[("copycat", Copycat())])
    assert "page_head" in reg.layouts and reg.conflicts == []
    assert reg.resolve(mha(), "page_head", "direct").info.name == "core.direct"
    assert next(p for p in reg.plugins if p.name == "copycat").error == "registration failed: RuntimeError: hook exploded"


def test_a_plugin_module_may_import_hicache_core_and_name_helpers_alike(caplog):
    """Only functions marked with ``hookimpl`` are hooks: a module attribute ``hicache_core`` (the import) or a helper
    named ``hicache_*`` is no unknown hook; a hook function left unmarked is never called, with a warning."""
    from hicache_test_page_head.layout import PageHeadLayout

    module = types.ModuleType("vendor_plugin")
    module.hicache_core = hicache_core  # type: ignore[attr-defined]
    module.hicache_helper = lambda: None  # type: ignore[attr-defined]

    def hicache_register_layouts(register: Callable[[object], None]) -> None:
        register(PageHeadLayout())

    module.hicache_register_layouts = hicache_register_layouts  # type: ignore[attr-defined]
    caplog.set_level(logging.WARNING, logger="hicache_core.registry")
    reg = create_registry(env={"HICACHE_PLUGINS": "core"}, plugins=[("vendor", module)])
    assert next(p for p in reg.plugins if p.name == "vendor").error is None
    assert "page_head" not in reg.layouts  # unmarked: not called
    assert "['hicache_register_layouts'] not marked with @hicache_core.hookimpl" in caplog.text
    module.hicache_register_layouts = hookimpl(hicache_register_layouts)  # type: ignore[attr-defined]
    reg = create_registry(env={"HICACHE_PLUGINS": "core"}, plugins=[("vendor", module)])
    assert "page_head" in reg.layouts


def test_a_layout_whose_check_raises_is_a_rejection_naming_its_plugin():
    """A layout plugin's ``check()`` raising is that plugin's bug: resolving with it is a rejection naming the plugin,
    and resolution errors about other layouts still list their alternatives."""
    from hicache_test_page_head.layout import PageHeadLayout

    class Broken(PageHeadLayout):
        name = "broken_check"

        def check(self, spec):  # type: ignore[no-untyped-def]
            raise KeyError("head_num")

    reg = create_registry(env=BASE, plugins=[("brittle", layouts(Broken()))])
    res, rejected = reg.try_resolve(mha(), "broken_check", "direct")
    assert res is None and "check() raised KeyError: 'head_num' (a bug of plugin 'brittle'" in rejected[0][1]
    with pytest.raises(ResolutionError, match="nearest working alternatives"):
        reg.resolve(mha(), "page_head", "no_such_backend")


def test_a_hook_calling_default_registry_fails_its_plugin_not_the_process(monkeypatch):
    """``default_registry()`` from a plugin hook (while the default registry is being created it would wait for
    itself; in any registry it would run the hook again): it raises instead, and that plugin is reported broken."""
    class Reentrant:
        @hookimpl
        def hicache_register_layouts(self, register: Callable[[object], None]) -> None:
            registry_module.default_registry()

    real = registry_module.create_registry
    monkeypatch.setattr(registry_module, "create_registry", lambda: real(env=BASE, plugins=[("reentrant", Reentrant())]))
    monkeypatch.setattr(registry_module, "_default", None)
    reg = registry_module.default_registry()
    rec = next(p for p in reg.plugins if p.name == "reentrant")
    assert rec.error is not None and "default_registry() was called from a plugin's registration hook" in rec.error
    reg = create_registry(env=BASE, plugins=[("reentrant", Reentrant())])  # a registry of its own: the same
    assert "was called from a plugin's registration hook" in (next(p for p in reg.plugins if p.name == "reentrant").error
                                                              or "")


def test_default_registry_called_while_it_is_created_fails_that_call_and_makes_one_registry(monkeypatch):
    """A plugin module that calls ``default_registry()`` when imported (inside the creation's entry-point loading):
    that call raises, naming the fix, and the process keeps one default registry (it neither waits for itself nor
    builds a second one that the first then replaces)."""
    real = registry_module.create_registry
    seen: list[object] = []

    def creating():
        try:
            seen.append(registry_module.default_registry())  # what an importing plugin module would do
        except RegistryError as exc:
            seen.append(exc)
        return real(env=BASE, plugins=[])

    monkeypatch.setattr(registry_module, "create_registry", creating)
    monkeypatch.setattr(registry_module, "_default", None)
    reg = registry_module.default_registry()
    assert len(seen) == 1 and isinstance(seen[0], RegistryError)
    assert "called while the default registry was being created" in str(seen[0])
    assert registry_module.default_registry() is reg and registry_module._default is reg
    assert not getattr(registry_module._CREATING, "on", False)  # a later call (after creation) is fine


@pytest.mark.parametrize("value,on", [("1", True), ("yes", True), ("0", False), ("off", False), ("False", False),
                                      ("", False)])
def test_trace_switch_reads_off_values_as_off(value, on):
    assert create_registry(env={**BASE, "HICACHE_TRACE": value}).trace is on


def test_a_plugin_registering_a_malformed_object_is_broken_alone():
    """``register(object())``: that plugin is reported broken; the registry and every other plugin stay."""
    class Malformed:
        @hookimpl
        def hicache_register_layouts(self, register: Callable[[object], None]) -> None:
            register(object())

    reg = create_registry(env=BASE, plugins=[("malformed", Malformed())])
    rec = next(p for p in reg.plugins if p.name == "malformed")
    assert rec.error is not None and rec.error.startswith("registration failed: TypeError: register() was given")
    assert "page_head" in reg.layouts and reg.resolve(mha(), "page_head", "direct").info.name == "core.direct"


def test_an_allow_list_without_core_is_named_where_a_generic_backend_is_missing():
    from hicache_core.errors import ResolutionError

    reg = create_registry(env={"HICACHE_PLUGINS": "page_head"})
    with pytest.raises(ResolutionError, match=r"note: 'core', the plugin of the generic backends \(reference, direct, "
                                              r"auto\), is left out: add core to HICACHE_PLUGINS='page_head'"):
        reg.resolve(mha(), "page_head", "reference")
    reg = create_registry(env={"HICACHE_PLUGINS": "core,page_head", "HICACHE_DISABLE_PLUGINS": "core"})
    with pytest.raises(ResolutionError, match=r"is left out: take core off HICACHE_DISABLE_PLUGINS='core'"):
        reg.resolve(mha(), "page_head", "reference")  # the block list wins: adding core to the allow list does nothing
    with pytest.raises(ResolutionError) as info:
        create_registry(env=BASE).resolve(mha(), "page_head", "kernel")
    assert "left out" not in str(info.value)


def test_a_strategy_for_the_other_kind_of_pool_is_named_where_nothing_serves_the_key() -> None:
    """A layout's strategy registered for unsharded pools only (sharded=(False,)) is named, with the fix, where a sharded
    pool finds no candidate, not 'no strategy is registered for io_backend ... and this layout'."""
    reg = create_registry(env=BASE, plugins=[("u", strategies(
        StrategyInfo("u.dma", "udma", ("page_head",), DirectStrategy, (False,))))])
    assert reg.try_resolve(mha(), "page_head", "udma")[0] is not None
    _, rejected = reg.try_resolve(mha(sharded=True), "page_head", "udma")
    assert rejected == [("(none)", "u.dma serves unsharded pools only (registered with sharded=(False,)); add True to "
                                   "its registration's sharded to serve these")]
    _, rejected = reg.try_resolve(mha(sharded=True), "page_head", "udma", override="u.dma")  # as the kit asks
    assert rejected == [("u.dma", "not a candidate for this key; candidates: [] (u.dma serves unsharded pools only "
                                  "(registered with sharded=(False,)); add True to its registration's sharded to serve "
                                  "these)")]
    _, rejected = reg.try_resolve(mha(), "page_head", "fakedma_nope")
    assert rejected[0][1].startswith("no installed plugin provides io_backend 'fakedma_nope' (plugins register")
