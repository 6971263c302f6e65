"""The ``sglang.srt.plugins`` entry point, idempotence and the HICACHE_SGLANG switch."""

from __future__ import annotations

import pkgutil

import pytest
import torch

from hicache_core.integrations.sglang import AFTER_TARGETS, HOOK_TARGETS, load_plugin
from hicache_core.integrations.sglang.mode import stock_serves
from sglang_helpers import same_bytes, settle
from test_transfers import make_pools, slots


def _attr(target: str):
    """The target as its owner holds it (a static method as such); an inherited method (before it is hooked on the
    subclass) as the owner finds it."""
    owner, attr = target.rsplit(".", 1)
    cls = pkgutil.resolve_name(owner)
    return cls.__dict__[attr] if attr in cls.__dict__ else getattr(cls, attr)


def _wraps(target: str, original) -> bool:
    """The hooked attribute wraps ``original`` (static methods: their functions)."""
    fn = lambda x: getattr(x, "__func__", x)  # noqa: E731
    return fn(_attr(target)).__wrapped__ is fn(original)


def _ours(registry, target: str) -> int:
    hook = {**HOOK_TARGETS, **AFTER_TARGETS}[target]
    return sum(1 for _, h, _ in registry._hooks.get(target, ()) if h is hook)


def test_load_plugins_discovers_entry_point(sglang_hooks, monkeypatch):
    import sglang.srt.plugins as plugins

    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.setenv("SGLANG_PLUGINS", "hicache")
    eps = plugins.load_plugins_by_group(plugins.GENERAL_PLUGINS_GROUP)
    assert eps["hicache"][0] is load_plugin
    originals = {t: _attr(t) for t in (*HOOK_TARGETS, *AFTER_TARGETS)}
    plugins.load_plugins()
    for target in originals:
        assert _ours(sglang_hooks, target) == 1, target
        assert target in sglang_hooks._patched
        assert _wraps(target, originals[target]), target
    dev, host = make_pools("mla", "page_first")  # a stock ValueError cell (direct + page_first) now served
    h, d1, _ = slots(host, dev)
    host.backup_from_device_all_layer(dev, h, d1, "direct")
    settle()
    assert same_bytes(host.kv_buffer[h, 0], dev.kv_buffer[0][d1])


def test_a_plugin_sglang_runs_after_ours_keeps_its_hooks_on_the_targets_we_hook(sglang_hooks, monkeypatch):
    """``load_plugins()`` runs every plugin, then applies the hooks once, skipping patched targets: ours must not patch
    mid-loading, or a later plugin's hook on one of our targets (``ServerArgs.add_cli_args``) would never apply."""
    import argparse

    import sglang.srt.plugins as plugins
    from sglang.srt.plugins.hook_registry import HookType

    seen: list[str] = []

    def later_plugin() -> None:
        sglang_hooks.register("sglang.srt.server_args.ServerArgs.add_cli_args",
                              lambda result, *a, **k: seen.append("later"), HookType.AFTER)

    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.setattr(plugins, "load_plugins_by_group", lambda *a, **k: {"hicache": (load_plugin, "hicache-core"),
                                                                         "later": (later_plugin, "later")})
    plugins.load_plugins()
    from sglang.srt.server_args import ServerArgs

    ServerArgs.add_cli_args(argparse.ArgumentParser())
    assert seen == ["later"]
    assert _ours(sglang_hooks, "sglang.srt.server_args.ServerArgs.add_cli_args") == 1


def test_load_plugin_is_idempotent(sglang_hooks):
    originals = {t: _attr(t) for t in HOOK_TARGETS}
    load_plugin()
    wrapped = {t: _attr(t) for t in HOOK_TARGETS}
    load_plugin()
    load_plugin()
    for target in HOOK_TARGETS:
        assert _ours(sglang_hooks, target) == 1
        assert _attr(target) is wrapped[target]
        assert _wraps(target, originals[target])


def test_gaps_serves_only_stock_gaps_where_stock_kernels_exist():
    gap = lambda *a, **k: not stock_serves(*a, kernels_available=True, **k)  # noqa: E731
    assert not gap("mla", "layer_first", "kernel", True, "backup_layer")
    assert gap("mla", "page_first", "kernel", True, "backup_layer")
    assert not gap("mla", "page_first", "kernel", True, "backup_layer", can_use_jit=True)
    assert not gap("mla", "page_first", "kernel", True, "load")
    assert gap("mla", "page_first", "direct", False, "backup")
    assert not gap("mla", "page_first_direct", "direct", False, "backup")
    assert gap("mla", "page_first_direct", "direct", True, "backup_layer")
    assert gap("mla", "page_first_kv_split", "kernel", True, "backup_layer")
    assert gap("mha", "page_first_direct", "kernel", False, "load")
    assert not gap("mha", "page_first", "kernel", False, "backup")
    assert gap("mha", "page_first_kv_split", "direct", False, "backup")
    assert gap("dsa_indexer", "page_first", "kernel", True, "backup_layer")
    assert not gap("dsa_indexer", "page_first", "kernel", False, "backup")
    assert gap("mla", "layer_first", "kernel_ascend", False, "backup")
    # No sgl_kernel here (CPU): every stock cell is a gap.
    if not torch.cuda.is_available():
        assert not stock_serves("mla", "layer_first", "direct", False, "backup")


def test_gaps_mode_serves_on_cpu(hooked, monkeypatch):
    """On CPU the stock kvcacheio ops are unbound, so ``gaps`` serves even SGLang's matrix cells."""
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    monkeypatch.setenv("HICACHE_SGLANG", "gaps")
    dev, host = make_pools("mla", "layer_first")
    h, d1, _ = slots(host, dev)
    host.backup_from_device_all_layer(dev, h, d1, "direct")
    settle()
    assert same_bytes(host.kv_buffer[1, h], dev.kv_buffer[1][d1])
    monkeypatch.setenv("HICACHE_SGLANG", "off")
    with pytest.raises(NameError, match="transfer_kv_direct"):
        host.backup_from_device_all_layer(dev, h, d1, "direct")


def test_calls_we_cannot_take_fall_back_to_sglang(hooked, stock_kernels):
    """HiSparse-style backups of single tokens (not whole pages) fail our argument checks before any
    byte moves; SGLang's original method then runs (on this CPU it raises its own NameError). (On a cell SGLang
    cannot serve, hicache's error is raised instead: test_bridge_settings.)"""
    dev, host = make_pools("mla", "layer_first")
    h, d1, _ = slots(host, dev)
    before = host.kv_buffer.clone()
    with pytest.raises(NameError, match="transfer_kv"):
        host.backup_from_device_all_layer(dev, h[:1], d1[:1], "direct")
    with pytest.raises(NameError, match="transfer_kv"):
        host.load_to_device_per_layer(dev, h[:1], d1[:1], 0, "direct")
    assert torch.equal(host.kv_buffer.view(torch.uint8), before.view(torch.uint8))
    host.backup_from_device_all_layer(dev, h, d1, "direct")  # whole pages: still ours
    settle()
    assert same_bytes(host.kv_buffer[1, h], dev.kv_buffer[1][d1])


@pytest.mark.parametrize("value, mode", [(None, "measured"), ("off", "off"), ("gaps", "gaps"), (" ALL ", "all"),
                                         ("bogus", "measured")])
def test_loading_says_the_bridge_is_active_and_its_mode(sglang_hooks, monkeypatch, caplog, value, mode):
    """An engine developer checks the log to see that hicache took effect: one INFO line per process names the bridge,
    the mode in force (every mode, ``off`` included: it says SGLang's methods serve) and the variable that sets it."""
    import logging

    if value is None:
        monkeypatch.delenv("HICACHE_SGLANG", raising=False)
    else:
        monkeypatch.setenv("HICACHE_SGLANG", value)
    with caplog.at_level(logging.INFO, logger="hicache_core"):
        load_plugin()
    lines = [r.getMessage() for r in caplog.records
             if r.levelno == logging.INFO and "SGLang bridge" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    assert f"HICACHE_SGLANG={mode}" in lines[0]
    assert ("SGLang's own methods serve every call" in lines[0]) == (mode == "off")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hicache_core"):
        load_plugin()  # a second call in the same process registers nothing and says nothing again
    assert not [r for r in caplog.records if "SGLang bridge" in r.getMessage()]
