"""The bridge's settings and fallbacks: ``HICACHE_VALIDATE`` as bridged pools read it, ``HICACHE_SGLANG``'s off
spellings, which ``page_first_kv_split`` pools hicache allocates, the generic fallback of cells SGLang cannot serve,
and a taken-over cell whose io_backend is not installed."""

from __future__ import annotations

import logging

import pytest

from hicache_core.integrations.sglang import hooks
from hicache_core.integrations.sglang.adapter import bridge_for
from hicache_core.integrations.sglang.buffers import wants_kv_split_takeover
from hicache_core.integrations.sglang.mode import parse_mode
from sglang_helpers import refuse_hicache_kernel, same_bytes, settle
from test_takeover import entry, write_table
from test_transfers import make_pools, roundtrip, slots


@pytest.mark.parametrize("value,level", [("Full", "full"), (" full ", "full"), ("", "shapes"), ("SHAPES", "shapes"),
                                         ("strict", "full")])
def test_bridged_pools_read_hicache_validate_leniently(hooked, monkeypatch, caplog, value, level):
    """Case and blanks are ignored, an empty value is the default, and ``strict`` counts as ``full`` (SGLang
    allocates the host slots itself: none is in hicache's allocator), with a warning; the transfer is served."""
    monkeypatch.setenv("HICACHE_VALIDATE", value)
    dev, host = make_pools("mha", "page_first_kv_split")
    h, d1, _ = slots(host, dev)
    with caplog.at_level(logging.WARNING, logger="hicache_core"):
        host.backup_from_device_all_layer(dev, h, d1, "direct")
    settle()
    bridge = bridge_for(host, dev, "direct")
    assert bridge.pool is not None and bridge.pool.validate == level
    assert ("strict" in caplog.text) == (value == "strict")


def test_a_bad_hicache_validate_is_an_error_naming_the_variable_and_the_default_serves(hooked, monkeypatch, caplog):
    """A value that is no level counts as the default, with an ERROR (once) that names the variable and the fix, as
    the bridge's other settings do: a cell SGLang cannot serve is still served (it raised SGLang's 'Unsupported
    layout' at every call), its bytes where they belong."""
    monkeypatch.setenv("HICACHE_VALIDATE", "bogus")
    with caplog.at_level(logging.WARNING, logger="hicache_core"):
        roundtrip("mha", "page_first_kv_split", "direct")  # the bytes in SGLang's layout, both ways
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and "HICACHE_VALIDATE='bogus'" in r.getMessage()]
    assert len(errors) == 1
    assert "use 'shapes', 'full' or 'strict'; bridged pools use 'shapes'" in errors[0].getMessage()


def test_a_bad_auto_forward_is_a_warning_and_a_gap_cell_falls_back_to_direct(hooked, monkeypatch, caplog):
    """``HICACHE_AUTO_FORWARD`` that is no mode makes ``auto`` fail to load: a WARNING names the variable (it came
    wrapped in the resolution's error, logged at INFO only); a cell SGLang cannot serve goes to ``direct``."""
    monkeypatch.setenv("HICACHE_SGLANG_KERNEL", "auto")
    monkeypatch.setenv("HICACHE_AUTO_FORWARD", "bogus")
    with caplog.at_level(logging.WARNING, logger="hicache_core"):
        roundtrip("mla", "page_first_kv_split", "kernel")  # the bytes in SGLang's layout, both ways
    warned = [r for r in caplog.records
              if r.levelno == logging.WARNING and "HICACHE_AUTO_FORWARD is 'bogus'" in r.getMessage()]
    assert warned


@pytest.mark.parametrize("value", ["0", "false", "No", " OFF "])
def test_off_spellings_of_hicache_sglang(value):
    assert parse_mode(value) == "off"


def test_kv_split_allocation_is_taken_only_for_pools_the_bridge_serves(monkeypatch):
    """hicache allocates ``page_first_kv_split`` buffers (which SGLang cannot on CUDA/CPU) only where the bridge will
    serve the pool's transfers: not for allocator-only (dummy) pools, not with decode context parallelism, and not
    without the layout installed; those keep SGLang's allocation (and its error)."""

    class Host:
        layout, dcp_size, _is_dummy, head_dim, v_head_dim = "page_first_kv_split", 1, False, 16, 16

    monkeypatch.setattr("hicache_core.integrations.sglang.buffers.pool_kind", lambda host: "mha")
    host = Host()
    assert wants_kv_split_takeover(host)
    host.dcp_size = 2
    assert not wants_kv_split_takeover(host)
    host.dcp_size, host._is_dummy = 1, True
    assert not wants_kv_split_takeover(host)
    host._is_dummy = False

    class Registry:
        layouts = {"layer_first": object()}

    monkeypatch.setattr("hicache_core.integrations.sglang.buffers.default_registry", lambda: Registry())
    assert not wants_kv_split_takeover(host)


def test_a_gap_cell_falls_back_to_direct_when_its_strategy_cannot_serve_the_pool(hooked, monkeypatch):
    """A cell SGLang cannot serve (MLA ``page_first_kv_split``) under ``gaps``, called with SGLang's ``kernel``: when the
    kernel strategy is registered but refuses this pool (stood in for by a factory that raises), the core's ``direct``
    serves it, byte for byte, instead of SGLang's certain error."""
    monkeypatch.setenv("HICACHE_SGLANG", "gaps")
    refuse_hicache_kernel(monkeypatch)
    dev, host = make_pools("mla", "page_first_kv_split")
    h, d1, d2 = slots(host, dev)
    host.backup_from_device_all_layer(dev, h, d1, "kernel")
    for layer in range(dev.layer_num):
        host.load_to_device_per_layer(dev, h, d2, layer, "kernel")
    settle()
    assert bridge_for(host, dev, "kernel").pool is None
    assert bridge_for(host, dev, "direct").pool is not None
    for layer in range(dev.layer_num):  # every layer's rows came back where they were loaded
        buf = dev.kv_buffer[layer]
        assert same_bytes(buf[d1.to(buf.device)], buf[d2.to(buf.device)])


def test_a_taken_over_cell_whose_io_backend_is_not_installed_stays_sglangs(hooked, monkeypatch, stock_kernels, tmp_path,
                                                                           caplog):
    """The table took the cell over for one hicache io_backend (measured for it alone); where that one has no strategy
    here (``vendorx``, or a misspelt ``dirct``), SGLang keeps the cell, with a warning that names the table file, the
    field and the io_backends installed for the layout, rather than an unmeasured hicache route serving it."""
    table = write_table(tmp_path, [entry(op="backup", hicache_io_backend="vendorx")])
    monkeypatch.setenv("HICACHE_SGLANG", "measured")
    monkeypatch.setenv("HICACHE_SGLANG_TABLE", str(table))
    hooks._decided.clear()
    hooks._resolved.clear()
    dev, host = make_pools("mla", "layer_first")
    h, d1, _ = slots(host, dev)
    with caplog.at_level(logging.WARNING, logger="hicache_core"), \
            pytest.raises(NameError, match="transfer_kv_all_layer_mla"):  # SGLang's stock kernel (absent on CPU)
        host.backup_from_device_all_layer(dev, h, d1, "kernel")
    assert "no 'vendorx' strategy for layout 'layer_first'" in caplog.text
    (warning,) = [r.getMessage() for r in caplog.records if "vendorx" in r.getMessage()]
    assert str(table) in warning and "hicache_io_backend" in warning
    assert "'direct'" in warning and "'kernel'" in warning  # installed for layer_first
    assert not getattr(host, "_hicache_bridges", {})


def test_strided_device_rows_are_gaps_where_sglang_needs_packed_rows():
    """With strided device rows (``device_rows_packed`` false, e.g. ``--enable-unified-memory``) SGLang 0.5.23 serves a
    cell only through its JIT kernels or ``direct``'s tensor copies of ``layer_first``; every other stock route raises
    ``NotImplementedError``, so those cells are gaps hicache serves."""
    from hicache_core.integrations.sglang.mode import stock_serves

    def serves(kind, layout, io, packed, jit=False):  # type: ignore[no-untyped-def]
        return stock_serves(kind, layout, io, False, "load", can_use_jit=jit, kernels_available=True,
                            rows_packed=packed)

    for kind in ("mla", "mha"):
        assert serves(kind, "layer_first", "kernel", True) and not serves(kind, "layer_first", "kernel", False)
        assert serves(kind, "layer_first", "kernel", False, jit=True) and serves(kind, "page_first", "kernel", False, True)
        assert serves(kind, "layer_first", "direct", False)
        assert serves(kind, "page_first_direct", "direct", True) and not serves(kind, "page_first_direct", "direct", False)
    assert serves("mha", "page_head", "kernel", True) and not serves("mha", "page_head", "kernel", False, jit=True)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_strided_device_rows_without_jit_are_served_by_hicache_bit_exact(hooked, monkeypatch, stock_kernels, layout):
    """SGLang's ``kernel`` calls on an MLA pool with strided device rows and no JIT kernel (its stock route would raise
    ``NotImplementedError``): under ``gaps`` hicache serves them, every layer byte for byte."""
    import sglang_harness as H
    import torch

    monkeypatch.setenv("HICACHE_SGLANG", "gaps")
    with H.sglang_runtime(hicache_mem_layout=layout):
        dev = H.make_mla_device_pool(size=64, page_size=4, layer_num=3, kv_lora_rank=32, qk_rope_head_dim=16)
        rows = dev.kv_buffer[0].shape[0]
        backing = torch.zeros(rows, 3, 1, 96, dtype=dev.kv_buffer[0].dtype)  # token-major: layers interleaved
        dev.kv_buffer = [backing[:, i, :, :48] for i in range(3)]
        host = H.make_host_pool(dev)
    assert not host.device_rows_packed and not host.can_use_jit
    for t in dev.kv_buffer:
        t.view(torch.uint8).random_(0, 256)
    h, d1, d2 = slots(host, dev)
    host.backup_from_device_all_layer(dev, h, d1, "kernel")
    for layer in range(3):
        host.load_to_device_per_layer(dev, h, d2, layer, "kernel")
    settle()
    for layer in range(3):
        buf = dev.kv_buffer[layer]
        assert same_bytes(buf[d1.to(buf.device)], buf[d2.to(buf.device)])


def test_an_indexer_page_stride_sglangs_kernels_refuse_is_a_gap():
    """SGLang 0.5.23's DSA indexer transfers use its kernels only for a page stride of a multiple of 8 elements; with
    another (ROCm's legacy DSA path, 1-token pages: 132) its ``kernel`` calls raise ``Unsupported IO backend``, so
    those cells are gaps hicache serves; its ``direct`` calls still serve."""
    from types import SimpleNamespace

    from hicache_core.integrations.sglang.hooks import _jit_packed
    from hicache_core.integrations.sglang.mode import stock_serves

    assert _jit_packed(SimpleNamespace(indexer_page_stride_size=132), "dsa_indexer") == (False, False)
    assert _jit_packed(SimpleNamespace(indexer_page_stride_size=136), "dsa_indexer") == (False, True)
    assert _jit_packed(SimpleNamespace(device_rows_packed=False), "mla") == (False, False)
    for layout in ("layer_first", "page_first"):
        for op in ("load", "backup"):
            assert stock_serves("dsa_indexer", layout, "kernel", False, op, kernels_available=True, rows_packed=True)
            assert not stock_serves("dsa_indexer", layout, "kernel", False, op, kernels_available=True,
                                    rows_packed=False)
    assert stock_serves("dsa_indexer", "layer_first", "direct", False, "load", kernels_available=True,
                        rows_packed=False)


def test_destroy_unregisters_the_mla_kv_split_rope_buffer_hicache_allocated(hooked, monkeypatch):
    """SGLang's ``destroy`` unregisters ``kv_buffer`` (for ``page_first_kv_split``: ``k_buffer``) alone; the rope buffer
    hicache allocated through SGLang's allocator is unregistered with it, once, on the same condition (pinned, CUDA or
    HIP; faked here); a pool of another layout unregisters what SGLang does and nothing more."""
    import sglang_harness as H
    from sglang.srt.mem_cache.pool_host import base

    seen: list[int] = []
    monkeypatch.setattr(base, "_cuda_host_unregister", lambda buf: seen.append(buf.data_ptr()))
    monkeypatch.setattr(base, "_is_cuda", True)
    with H.sglang_runtime(hicache_mem_layout="page_first_kv_split"):
        dev = H.make_mla_device_pool(page_size=4, layer_num=2, kv_lora_rank=32, qk_rope_head_dim=16)
        host = H.make_host_pool(dev, page_size=4)
    assert host.kv_buffer is host.k_buffer and host.v_buffer is not None
    k, v = host.k_buffer.data_ptr(), host.v_buffer.data_ptr()
    host.pin_memory = True
    host.destroy()
    host.destroy()  # idempotent
    assert seen == [k, v]
    seen.clear()
    with H.sglang_runtime(hicache_mem_layout="page_first"):
        dev = H.make_mla_device_pool(page_size=4, layer_num=2, kv_lora_rank=32, qk_rope_head_dim=16)
        other = H.make_host_pool(dev, page_size=4)
    other.pin_memory = True
    kv = other.kv_buffer.data_ptr()
    other.destroy()
    assert seen == [kv]


def test_a_hosts_decision_is_kept_on_it_and_made_again_when_what_it_read_changes(hooked, monkeypatch):
    """The bridge's decision per call is kept on the host pool object (a repeated call compares what it reads with
    what the decision read, without the global memo's lookup); a change of the environment or of the pool's layout
    decides again."""
    from test_transfers import make_pools

    from hicache_core.integrations.sglang import hooks

    looked: list[object] = []

    class Counting(dict):
        def __getitem__(self, key):  # type: ignore[no-untyped-def]
            looked.append(key)
            return super().__getitem__(key)

    monkeypatch.setattr(hooks, "_decided", Counting())
    dev, host = make_pools("mla", "page_first")
    first = hooks._decision(host, "mla", "kernel", "load")
    assert first[0] is not None and len(looked) == 1  # mode all: hicache serves; decided through the global memo
    assert hooks._decision(host, "mla", "kernel", "load") == first and len(looked) == 1  # kept on the host
    monkeypatch.setenv("HICACHE_SGLANG", "off")
    assert hooks._decision(host, "mla", "kernel", "load")[0] is None and len(looked) == 2  # decided again
    monkeypatch.setenv("HICACHE_SGLANG", "all")
    assert hooks._decision(host, "mla", "kernel", "load") == first and len(looked) == 3
    assert hooks._decision(host, "mla", "kernel", "load") == first and len(looked) == 3
    monkeypatch.setattr(host, "layout", "layer_first")
    assert hooks._decision(host, "mla", "kernel", "load")[0] is not None and len(looked) == 4


def test_bad_indices_on_a_cell_sglang_cannot_serve_raise_hicaches_error(hooked):
    """hicache hands a call it refuses to SGLang's own routine (e.g. HiSparse's one-token backups on a cell SGLang
    serves); on a cell SGLang raises on, the user saw SGLang's 'Unsupported layout' for what is an argument mistake.
    hicache's error is raised instead, naming the argument, with SGLang's refusal noted and chained; nothing moved."""
    from hicache_core.errors import TransferArgumentError

    dev, host = make_pools("mla", "page_first_kv_split")
    h, d1, _ = slots(host, dev)
    before = [t.clone() for t in host.kv_buffer] if isinstance(host.kv_buffer, list) else host.kv_buffer.clone()
    with pytest.raises(TransferArgumentError, match="host_indices") as exc:
        host.backup_from_device_all_layer(dev, h, d1[:-1], "direct")  # one device slot short
    assert isinstance(exc.value.__cause__, Exception) and not isinstance(exc.value.__cause__, TransferArgumentError)
    if hasattr(exc.value, "add_note"):
        assert any("hicache handed the call to SGLang's own routine, which cannot serve this cell" in n
                   for n in exc.value.__notes__)
    settle()
    after = [t for t in host.kv_buffer] if isinstance(host.kv_buffer, list) else host.kv_buffer
    assert same_bytes(after, before) if not isinstance(after, list) else all(
        same_bytes(a, b) for a, b in zip(after, before))


def test_a_gap_cells_fallback_is_logged_as_served_not_as_left_to_sglang(hooked, monkeypatch, caplog):
    """The strategy SGLang's io_backend maps to cannot serve the pool and hicache's direct serves the cell: the log says
    so, and not 'left to SGLang' (which it said first)."""
    monkeypatch.setenv("HICACHE_SGLANG", "gaps")
    refuse_hicache_kernel(monkeypatch)
    dev, host = make_pools("mla", "page_first_kv_split")
    h, d1, _ = slots(host, dev)
    with caplog.at_level(logging.INFO, logger="hicache_core"):
        host.backup_from_device_all_layer(dev, h, d1, "kernel")
        host.backup_from_device_all_layer(dev, h, d1, "kernel")
    settle()
    text = caplog.text
    assert text.count("serves them") == 1  # once per pool and operation, not per call
    assert "hicache io_backend 'kernel' cannot serve this pool" in text
    assert "SGLang cannot serve the cell: hicache 'direct' serves them" in text and "left to SGLang" not in text
    assert "installed layouts:" not in text  # the resolution report without its inventory


def test_the_logged_resolution_report_drops_only_the_inventory():
    """The 20-line inventory goes; the rejections and a near match of an unknown name after it stay."""
    from hicache_core.integrations.sglang.adapter import _without_inventory

    report = ("no strategy serves (layout='page_first', io_backend='kernl', sharded=False) for mla:\n  (none): no ...\n"
              "nearest working alternatives: (none)\ninstalled layouts:\n  page_first (hicache-page-first 0.1.0)\n"
              "installed io_backends:\n  kernel (hicache-page-first 0.1.0)\ndid you mean: kernel?")
    assert _without_inventory(report) == ("no strategy serves (layout='page_first', io_backend='kernl', sharded=False) "
                                          "for mla:\n  (none): no ...\nnearest working alternatives: (none)\n"
                                          "did you mean: kernel?")
    assert _without_inventory("SpecError: bad") == "SpecError: bad"
