"""The SGLang bridge decides who serves a call once per cell and environment (no SGLang needed): a repeated call
costs one lookup, and every input of the decision (mode, kernel mapping and table variables, SGLang's stock
kernels being bound, the host pool's JIT and packed rows, the registry) still changes it at once; under ``measured``
a broken takeover table is never memoised."""

from __future__ import annotations

import pytest

from hicache_core.integrations.sglang import adapter, hooks, mode


def _host(layout: str = "layer_first"):
    """An object of SGLang's MLA host-pool class name (what the bridge keys on), without SGLang."""
    module, qualname = next(k for k, v in adapter._KINDS.items() if v == "mla")
    cls = type(qualname, (), {"__module__": module, "__qualname__": qualname})
    host = cls()
    host.layout, host._layer_shard_enabled, host.can_use_jit = layout, False, True
    return host


@pytest.fixture
def counted(monkeypatch):
    """Fresh memos; counts how often the full decision runs."""
    monkeypatch.setattr(hooks, "_decided", {})
    for name in ("HICACHE_SGLANG", "HICACHE_SGLANG_KERNEL", "HICACHE_SGLANG_TABLE"):
        monkeypatch.delenv(name, raising=False)
    calls = []
    real = hooks.hicache_io_backend

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)
    monkeypatch.setattr(hooks, "hicache_io_backend", counting)
    return calls


def test_a_repeated_call_is_decided_once(counted, monkeypatch):
    monkeypatch.setattr(mode, "stock_kernels_available", lambda kind: True)
    host = _host()
    first = hooks._backend(host, "mla", "kernel", "load")
    assert [hooks._backend(host, "mla", "kernel", "load") for _ in range(5)] == [first] * 5
    assert len(counted) == 1
    assert first is None  # measured mode, shipped table: SGLang keeps its own layer_first loads


def test_every_input_of_the_decision_still_changes_it(counted, monkeypatch):
    host = _host()
    monkeypatch.setattr(mode, "stock_kernels_available", lambda kind: True)
    assert hooks._backend(host, "mla", "kernel", "load") is None
    monkeypatch.setenv("HICACHE_SGLANG", "all")
    assert hooks._backend(host, "mla", "kernel", "load") == "kernel"
    monkeypatch.setenv("HICACHE_SGLANG_KERNEL", "auto")
    assert hooks._backend(host, "mla", "kernel", "load") == "auto"
    monkeypatch.setenv("HICACHE_SGLANG", "off")
    assert hooks._backend(host, "mla", "kernel", "load") is None
    monkeypatch.setenv("HICACHE_SGLANG", "measured")
    monkeypatch.setattr(mode, "stock_kernels_available", lambda kind: False)  # SGLang cannot serve: a gap
    assert hooks._backend(host, "mla", "kernel", "load") == "auto"
    assert len(counted) == 5
    assert hooks._backend(host, "mla", "kernel", "backup") == "auto"  # another op: its own decision
    assert len(counted) == 6
    monkeypatch.setattr(mode, "stock_kernels_available", lambda kind: True)
    monkeypatch.setenv("HICACHE_SGLANG_KERNEL", "kernel")
    assert hooks._backend(host, "mla", "direct", "load") is None  # SGLang's direct layer_first
    host.device_rows_packed = False  # strided device rows: still SGLang's (tensor copies)
    assert hooks._backend(host, "mla", "direct", "load") is None
    host.can_use_jit = False  # its kernel io now needs packed rows: a gap
    assert hooks._backend(host, "mla", "kernel", "load") == "kernel"
    assert len(counted) == 9


def test_a_broken_table_is_read_again_on_every_call(counted, monkeypatch, tmp_path):
    monkeypatch.setattr(mode, "stock_kernels_available", lambda kind: True)
    table = tmp_path / "t.json"
    table.write_text("{not json")
    monkeypatch.setenv("HICACHE_SGLANG_TABLE", str(table))
    host = _host()
    for _ in range(3):
        assert hooks._backend(host, "mla", "kernel", "load") is None
    assert len(counted) == 3
    for value in ("all", "gaps", "off"):  # only "measured" reads the table: the others are memoised
        monkeypatch.setenv("HICACHE_SGLANG", value)
        for _ in range(3):
            hooks._backend(host, "mla", "kernel", "load")
    assert len(counted) == 6
