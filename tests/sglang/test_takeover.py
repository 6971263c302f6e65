"""The default takeover policy: ``measured`` mode, the takeover table and its validation."""

from __future__ import annotations

import copy
import json
import logging

import pytest

from hicache_core.errors import ConfigError, TakeoverTableError
from hicache_core.integrations.sglang import load_plugin, mode
from hicache_core.logonce import forget_logged
from hicache_core.integrations.sglang.mode import hicache_io_backend, parse_mode
from hicache_core.integrations.sglang.takeover import SHIPPED_TABLE, Cell, load_table
from sglang_helpers import placed, same_bytes, settle
from test_transfers import make_pools, slots

ENTRY = {
    "kind": "mla", "layout": "layer_first", "sglang_io_backend": "kernel", "sharded": False, "op": "load",
    "take_over": True, "hicache_io_backend": "direct",
    "sglang": {"copy_ratio": 0.69, "gemm_slowdown_pct": 1}, "hicache": {"copy_ratio": 0.80, "gemm_slowdown_pct": 1},
    "source": "test", "date": "2026-11-30",
}


def write_table(tmp_path, entries, name="table.json", **top):
    path = tmp_path / name
    path.write_text(json.dumps({"format": "hicache-sglang-takeover/1", "entries": entries, **top}))
    return path


def entry(**changes):
    out = copy.deepcopy(ENTRY)
    out.update(changes)
    return out


def decide(mode_, *cell, **kw):
    return hicache_io_backend(mode_, *cell, kernels_available=True, **kw)


# --- the shipped table ------------------------------------------------------------------


def test_shipped_table_is_valid_and_takes_over_only_measured_wins():
    table = load_table(SHIPPED_TABLE)
    cells = {(c.kind, c.layout, c.op) for c in table.entries}
    assert cells == {(kind, layout, op) for kind in ("mla", "mha") for layout in ("layer_first", "page_first")
                     for op in ("backup", "load")}
    assert all(c.sglang_io_backend == "kernel" and not c.sharded for c in table.entries)
    taken = {(c.kind, c.layout, c.op): e.hicache_io_backend for c, e in table.entries.items() if e.take_over}
    assert taken == {}
    # every entry records the host time per call beside throughput and interference
    assert all("host_us" in e.sglang and "host_us" in e.hicache for e in table.entries.values())
    # page_first backups: hicache moves more, but its GEMM slowdown was higher: kept SGLang's
    pf_backup = table.entries[Cell("mha", "page_first", "kernel", False, "backup")]
    assert pf_backup.hicache["copy_ratio"] > pf_backup.sglang["copy_ratio"] and not pf_backup.take_over
    # layer_first backups: the copy engine moves more and spares the GEMM, but costs the scheduler thread
    # milliseconds (and a wait on GPU-resident indices): kept SGLang's
    lf_backup = table.entries[Cell("mla", "layer_first", "kernel", False, "backup")]
    assert (lf_backup.sglang, lf_backup.hicache) == ({"copy_ratio": 0.946, "gemm_slowdown_pct": 21.0, "host_us": 14.4},
                                                     {"copy_ratio": 0.987, "gemm_slowdown_pct": 0.7, "host_us": 2116.7})
    assert not lf_backup.take_over and "GPU-resident indices" in (lf_backup.note or "")


@pytest.mark.parametrize("cell,want", [
    (("mla", "layer_first", "kernel", False, "backup"), None),  # measured: more host time than SGLang's kernel
    (("mha", "layer_first", "kernel", False, "backup"), None),
    (("mla", "layer_first", "kernel", False, "load"), None),  # stock serves, hicache measured worse on one metric
    (("mla", "page_first", "kernel", False, "backup"), None),
    (("mla", "page_first", "kernel", False, "load"), None),
    (("mla", "layer_first", "direct", True, "backup_layer"), None),  # stock, not measured
    (("mla", "page_first", "direct", False, "backup"), "direct"),  # SGLang ValueError: a gap
    (("mla", "page_first", "kernel", True, "backup_layer"), "kernel"),  # gap without the JIT kernel
    (("mla", "page_first_kv_split", "kernel", True, "load"), "kernel"),
    (("mha", "page_first_direct", "kernel", False, "load"), "kernel"),
    (("dsa_indexer", "page_first", "direct", True, "backup_layer"), "direct"),
    (("mla", "layer_first", "kernel_ascend", False, "backup"), None),
])
def test_measured_default_with_the_shipped_table(monkeypatch, cell, want):
    monkeypatch.delenv("HICACHE_SGLANG_TABLE", raising=False)
    assert decide("measured", *cell) == want


def test_other_modes():
    stock = ("mla", "layer_first", "kernel", False, "load")
    gap = ("mla", "page_first", "direct", False, "backup")
    assert [decide(m, *stock) for m in ("all", "gaps", "off")] == ["kernel", None, None]
    assert [decide(m, *gap) for m in ("all", "gaps", "off")] == ["direct", "direct", None]
    assert decide("all", "mla", "layer_first", "kernel_ascend", False, "backup") is None
    measured = ("mla", "layer_first", "kernel", False, "backup")  # in the table, not taken over: SGLang's own
    assert [decide(m, *measured) for m in ("measured", "all", "gaps", "off")] == [None, "kernel", None, None]
    # No stock kernels on this platform: every cell is a gap, served with the exact io_backend.
    assert hicache_io_backend("measured", *stock, kernels_available=False) == "kernel"


# --- a user table -----------------------------------------------------------------------


def test_user_table_takes_over_one_op_with_another_io_backend(tmp_path, monkeypatch):
    monkeypatch.setenv("HICACHE_SGLANG_TABLE", str(write_table(tmp_path, [entry()])))
    assert decide("measured", "mla", "layer_first", "kernel", False, "load") == "direct"
    assert decide("measured", "mla", "layer_first", "kernel", False, "backup") is None  # the other op stays
    assert decide("measured", "mla", "layer_first", "kernel", True, "load") is None  # sharded is another cell
    assert decide("all", "mla", "layer_first", "kernel", False, "load") == "kernel"  # all ignores the table


def test_backup_entries_cover_sharded_per_layer_backups(tmp_path, monkeypatch):
    table = write_table(tmp_path, [entry(op="backup", sharded=True, hicache_io_backend="auto")])
    monkeypatch.setenv("HICACHE_SGLANG_TABLE", str(table))
    assert decide("measured", "mla", "layer_first", "kernel", True, "backup_layer") == "auto"
    assert decide("measured", "mla", "layer_first", "kernel", True, "backup") == "auto"


def test_a_gap_cell_may_be_remapped_by_the_table(tmp_path, monkeypatch):
    table = write_table(tmp_path, [entry(layout="page_first_direct", op="backup", hicache_io_backend="direct")])
    monkeypatch.setenv("HICACHE_SGLANG_TABLE", str(table))
    assert decide("measured", "mla", "page_first_direct", "kernel", False, "backup") == "direct"


# --- validation: every error names the file -----------------------------------------------


@pytest.mark.parametrize("entries,message", [
    ([entry(take_over=True, hicache={"copy_ratio": 0.95, "gemm_slowdown_pct": 5})],
     "entries[0] mla/layer_first/kernel/sharded=False/load: take_over is true but hicache is worse on "
     "gemm_slowdown_pct 5 vs SGLang 1; set take_over to false"),
    ([entry(), entry()], "entries[1]: duplicates the cell"),
    ([{k: v for k, v in ENTRY.items() if k != "source"}], "entries[0]: missing 'source'"),
    ([entry(take_ovr=True)], "entries[0]: unknown key(s) 'take_ovr'"),
    ([entry(op="restore")], "entries[0]: 'op' must be one of backup, load, got 'restore'"),
    ([entry(sglang_io_backend="kernel_ascend")], "'sglang_io_backend' must be one of kernel, direct"),
    ([entry(sharded="no")], "'sharded' must be true or false, got 'no'"),
    ([entry(take_over=1)], "'take_over' must be true or false, got 1"),
    ([entry(date="30/11/2026")], "'date' must be YYYY-MM-DD, got '30/11/2026'"),
    ([entry(hicache={"copy_ratio": "fast"})], "hicache.copy_ratio must be a finite number, got 'fast'"),
    ([entry(hicache={"copy_ratio": float("nan"), "gemm_slowdown_pct": 1})], "hicache.copy_ratio must be a finite number"),
    ([entry(sglang={"copy_ratio": 0.5, "gemm_slowdown_pct": float("inf")})],
     "sglang.gemm_slowdown_pct must be a finite number, got inf"),
    ([entry(sglang={"speed": 1})], "unknown metric 'speed' in 'sglang'"),
    ([entry(hicache={"copy_ratio": 0.8})], "'sglang' and 'hicache' must hold the same metrics"),
    ([entry(sglang={})], "'sglang' must be a non-empty object of metrics"),
    (["mla"], "entries[0]: must be an object, got str"),
])
def test_bad_entries(tmp_path, entries, message):
    path = write_table(tmp_path, entries)
    with pytest.raises(TakeoverTableError, match="takeover table ") as err:
        load_table(path)
    assert str(err.value).startswith(f"takeover table {path}: ")
    assert message in str(err.value)


def test_bad_files(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(TakeoverTableError) as err:
        load_table(missing)
    assert str(err.value).startswith(f"takeover table {missing}: cannot read it")
    assert "HICACHE_SGLANG_TABLE" in str(err.value)
    broken = tmp_path / "broken.json"
    broken.write_text('{"format": "hicache-sglang-takeover/1",\n "entries": [}')
    with pytest.raises(TakeoverTableError, match=f"takeover table {broken}: line 2 column 14: not valid JSON"):
        load_table(broken)
    with pytest.raises(TakeoverTableError, match="must be an object with \"format\": 'hicache-sglang-takeover/1', "
                                                 "got 'v0'"):
        load_table(write_table(tmp_path, [], "v0.json", format="v0"))
    with pytest.raises(TakeoverTableError, match=r"needs a list 'entries' .* \(unknown: cells\)"):
        load_table(write_table(tmp_path, [], "extra.json", cells=[]))


def test_a_bad_table_serves_only_gaps_and_is_an_error_of_the_loaded_plugin(tmp_path, monkeypatch, sglang_hooks,
                                                                            caplog):
    """Logged at ERROR with the file, the entry and that the plugin is loaded; not raised (SGLang then logged
    "Failed to execute general plugin: hicache" with a traceback, although every hook was in place)."""
    path = write_table(tmp_path, [entry(op="restore")])
    monkeypatch.setenv("HICACHE_SGLANG_TABLE", str(path))
    monkeypatch.delenv("HICACHE_SGLANG", raising=False)
    with caplog.at_level(logging.ERROR, logger="hicache_core"):
        load_plugin()
    error = next(r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    assert error.startswith(f"hicache: takeover table {path}: entries[0]")
    assert error.endswith("The plugin is loaded: until the table is fixed it serves only the cells SGLang cannot")
    assert decide("measured", "mla", "layer_first", "kernel", False, "load") is None
    assert decide("measured", "mla", "page_first", "direct", False, "backup") == "direct"
    assert f"takeover table {path}" in caplog.text
    path.write_text(json.dumps({"format": "hicache-sglang-takeover/1", "entries": [ENTRY]}))  # fixed: picked up
    assert decide("measured", "mla", "layer_first", "kernel", False, "load") == "direct"


# --- the mode ---------------------------------------------------------------------------


def test_unknown_mode():
    with pytest.raises(ConfigError, match="HICACHE_SGLANG='everything' is not a mode; use one of measured, all, "
                                          "gaps, off"):
        parse_mode("everything")
    assert [parse_mode(v) for v in (None, "", " ALL ", "Measured")] == ["measured", "measured", "all", "measured"]
    # the on/off spellings every hicache switch takes: on is the default mode (they were refused, and measured ran
    # after an ERROR; a user writing HICACHE_SGLANG=1 meant hicache on)
    assert [parse_mode(v) for v in ("1", "true", " Yes", "ON")] == ["measured"] * 4
    assert [parse_mode(v) for v in ("0", "false", "No", "off")] == ["off"] * 4


@pytest.mark.parametrize("value,want", [(None, "measured"), ("gaps", "gaps"), ("OFF", "off"), ("bogus", "measured")])
def test_current_mode(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv("HICACHE_SGLANG", raising=False)
    else:
        monkeypatch.setenv("HICACHE_SGLANG", value)
    assert mode.current_mode() == want


# --- through SGLang's classes -----------------------------------------------------------


def test_measured_leaves_stock_cells_to_sglang_and_serves_gaps(hooked, monkeypatch, stock_kernels):
    monkeypatch.setenv("HICACHE_SGLANG", "measured")
    monkeypatch.delenv("HICACHE_SGLANG_TABLE", raising=False)
    dev, host = make_pools("mla", "layer_first")
    h, d1, _ = slots(host, dev)
    with pytest.raises(NameError, match="transfer_kv_direct"):
        host.backup_from_device_all_layer(dev, h, d1, "direct")
    dev, host = make_pools("mla", "page_first")  # direct + page_first: SGLang's ValueError cell
    h, d1, _ = slots(host, dev)
    host.backup_from_device_all_layer(dev, h, d1, "direct")
    settle()
    assert same_bytes(host.kv_buffer[h, 1], dev.kv_buffer[1][d1])


@pytest.mark.parametrize("table_backend,served_by", [("direct", "direct"), ("auto", "auto")])
def test_table_maps_sglang_kernel_to_another_hicache_backend(hooked, monkeypatch, stock_kernels, tmp_path,
                                                             table_backend, served_by):
    """SGLang ``kernel`` served by the table's hicache io_backend."""
    table = write_table(tmp_path, [entry(op="backup", hicache_io_backend=table_backend)])
    monkeypatch.setenv("HICACHE_SGLANG", "measured")
    monkeypatch.setenv("HICACHE_SGLANG_TABLE", str(table))
    dev, host = make_pools("mla", "layer_first")
    for t in dev.kv_buffer:
        t.random_(0, 256)
    h, d1, _ = slots(host, dev)
    host.backup_from_device_all_layer(dev, h, d1, "kernel")
    settle()
    for layer in range(dev.layer_num):
        assert same_bytes(host.kv_buffer[layer, h], dev.kv_buffer[layer][d1])
    assert [k[1] for k in host._hicache_bridges] == [served_by]
    with pytest.raises(NameError, match="transfer_kv_per_layer_mla"):  # load: not in the table, stock
        host.load_to_device_per_layer(dev, h, d1, 0, "kernel")


# --- HICACHE_SGLANG_KERNEL: what serves SGLang kernel calls the table does not assign ------------------


def test_kernel_switch_maps_unassigned_kernel_cells_to_auto(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("HICACHE_SGLANG_TABLE", str(write_table(tmp_path, [entry(op="backup")])))
    gap = ("mla", "page_first", "kernel", True, "backup_layer")  # SGLang cannot (no JIT kernel)
    stock = ("mla", "page_first", "kernel", False, "load")
    taken = ("mla", "layer_first", "kernel", False, "backup")  # the table assigns direct
    direct_gap = ("mla", "page_first", "direct", False, "backup")
    monkeypatch.delenv(mode.ENV_KERNEL, raising=False)
    assert [decide("measured", *c) for c in (gap, stock, taken, direct_gap)] == ["kernel", None, "direct", "direct"]
    monkeypatch.setenv(mode.ENV_KERNEL, " Auto ")
    assert [decide("measured", *c) for c in (gap, stock, taken, direct_gap)] == ["auto", None, "direct", "direct"]
    assert [decide(m, *stock) for m in ("all", "gaps", "off")] == ["auto", None, None]
    monkeypatch.setenv(mode.ENV_KERNEL, "triton")
    forget_logged()  # logged once per process: start from none
    with caplog.at_level("ERROR", logger=mode.__name__):
        assert decide("measured", *gap) == "kernel" and decide("all", *stock) == "kernel"
        assert decide("off", *stock) is None  # off reads no switch
    assert [r.getMessage() for r in caplog.records] == [
        "HICACHE_SGLANG_KERNEL='triton': use one of kernel, auto; using 'kernel'"]


def test_kernel_switch_serves_sglang_kernel_calls_through_auto(hooked, monkeypatch):
    monkeypatch.setenv("HICACHE_SGLANG", "all")
    monkeypatch.setenv(mode.ENV_KERNEL, "auto")
    dev, host = make_pools("mla", "layer_first")
    for t in dev.kv_buffer:
        t.random_(0, 256)
    h, d1, d2 = slots(host, dev)
    host.backup_from_device_all_layer(dev, *placed("kernel", h, d1, dev.kv_buffer[0].device), "kernel")
    settle()
    for layer in range(dev.layer_num):
        assert same_bytes(host.kv_buffer[layer, h], dev.kv_buffer[layer][d1])
    for layer in range(dev.layer_num):
        host.load_to_device_per_layer(dev, *placed("kernel", h, d2, dev.kv_buffer[0].device), layer, "kernel")
    for layer in range(dev.layer_num):
        assert same_bytes(dev.kv_buffer[layer][d2], dev.kv_buffer[layer][d1])
    assert {k[1] for k in host._hicache_bridges} == {"auto"}


def test_docs_table_example_and_its_error_agree(tmp_path):
    """docs/sglang.md shows an example entry and the error a take-over the numbers do not justify gives: the example
    loads as written, and with ``take_over`` set to true it fails with exactly the documented message."""
    import pathlib
    import re

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "sglang.md").read_text()
    example = json.loads(re.search(r"```json\n(.*?)```", doc, re.S).group(1))
    path = tmp_path / "t.json"
    path.write_text(json.dumps(example))
    assert not load_table(path).entries[Cell("mla", "layer_first", "kernel", False, "load")].take_over
    example["entries"][0]["take_over"] = True
    path.write_text(json.dumps(example))
    documented = re.search(r"`(takeover table /etc/t\.json: .*?)`", doc, re.S).group(1)
    with pytest.raises(TakeoverTableError) as err:
        load_table(path)
    assert str(err.value) == " ".join(documented.split()).replace("/etc/t.json", str(path))
