"""benchmarks/peer_table.py: a takeover table for the SGLang bridge from the peer benchmark's rows (CPU, no timing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import peer_table as T
from hicache_core.errors import TakeoverTableError
from hicache_core.integrations.sglang.takeover import Cell, load_table

ROOT = Path(__file__).resolve().parents[1]
SHAPE, FP8, MHA = "mla61x576-bf16", "mla61x656-fp8", "mha80x8x128-bf16"


def _row(peer, variant, op, ratio, host, gemm=None, layout="layer_first", shape=SHAPE, tokens=4096, status="ok"):
    kind = {"mla": "mla 61x1152B", "mha": "mha 80x2048B"}[shape[:3]]
    return {"peer": peer, "variant": variant, "layout": layout, "shape": shape, "kind": kind, "tokens": tokens,
            "page_size": 64, "op": op, "status": status, "ratio": ratio, "host_us": host,
            "gemm_slowdown": None if gemm is None else gemm / 100}


def _cell(layout="layer_first", shape=SHAPE, tokens=4096, kernel=(0.90, 9, 0.5), staged=False):
    """Rows of one layout: SGLang's JIT and TMA kernels (and staged backup), hicache's kernel (default and P=8),
    auto (and a forward mode), direct; ``kernel``: the kernel's load ratio, host us and burst GEMM slowdown %."""
    kr, kh, kg = kernel
    at = dict(layout=layout, shape=shape, tokens=tokens)
    rows = [
        _row("sglang-jit", "q=2 (default)", "backup_all_layers", 0.85, 10, 50, **at),
        _row("sglang-jit", "q=2 (default)", "load_layer", 0.65, 7, **at),
        _row("sglang-jit", "q=2 (default)", "load_burst", 0.66, 7, 0.5, **at),
        _row("sglang-tma", "q=4 (default)", "load_layer", 0.85, 6, **at),
        _row("sglang-tma", "q=4 (default)", "load_burst", 0.86, 6, 1.0, **at),
        _row("sglang-tma", "q=8", "load_layer", 0.99, 1, **at),
        _row("hicache", f"kernel {layout}.kernel default", "backup_all_layers", 0.90, 20, 40, **at),
        _row("hicache", f"kernel {layout}.kernel default", "load_layer", kr, kh, **at),
        _row("hicache", f"kernel {layout}.kernel default", "load_burst", kr, kh, kg, **at),
        _row("hicache", f"kernel {layout}.kernel P=8", "load_layer", 0.99, 1, **at),
        _row("hicache", f"kernel {layout}.kernel P=8", "load_burst", 0.99, 1, 0.0, **at),
        _row("hicache", "auto core.auto", "backup_all_layers", 0.97, 2000, 0.5, **at),
        _row("hicache", "auto core.auto forward=memory", "backup_all_layers", 0.99, 5, -1, **at),
        _row("hicache", "direct core.direct", "backup_all_layers", 0.98, 1900, 0.6, **at),
        _row("hicache", "direct core.direct", "load_layer", 0.04, 2000, **at),
    ]
    if staged:
        rows.append(_row("sglang-staged", "default", "backup_all_layers", 0.93, 300, 1.0, **at))
    return rows


def _data(rows):
    return {"meta": {"gpu": "NVIDIA H100 80GB HBM3", "date": "2026-12-06 17:43"}, "rows": rows}


def _entries(table):
    return {(e["kind"], e["layout"], e["op"]): e for e in table["entries"]}


def test_a_cell_is_taken_over_only_where_hicache_is_no_worse_on_every_metric():
    table = T.build(_data(_cell(kernel=(0.90, 6, 0.5)) + _cell("page_first", staged=True)), say=lambda _: None)
    e = _entries(table)
    load = e["mla", "layer_first", "load"]
    # SGLang's loads: its TMA kernel at its default CTAs (not its JIT kernel, nor a quota of the benchmark's choosing)
    assert load["sglang"] == {"copy_ratio": 0.85, "host_us": 6, "burst_copy_ratio": 0.86,
                              "burst_gemm_slowdown_pct": 1.0}
    assert (load["take_over"], load["hicache_io_backend"]) == (True, "kernel")  # the default programs, not P=8's
    assert load["hicache"] == {"copy_ratio": 0.9, "host_us": 6, "burst_copy_ratio": 0.9, "burst_gemm_slowdown_pct": 0.5}
    assert load["note"] == "no worse on every metric"
    backup = e["mla", "layer_first", "backup"]
    # the copy engine is faster and leaves the GEMM alone, but holds the host: SGLang keeps it; auto's other forward
    # modes are not its default and do not count
    assert (backup["take_over"], backup["hicache_io_backend"]) == (False, "direct")
    assert backup["note"] == "hicache direct is worse on host_us 1900 vs SGLang 10"
    assert e["mla", "page_first", "backup"]["sglang"]["copy_ratio"] == 0.93  # its staged write-back
    assert "sglang-staged default" in e["mla", "page_first", "backup"]["source"]


def test_one_metric_worse_keeps_the_cell_sglangs():
    e = _entries(T.build(_data(_cell(kernel=(0.90, 6, 1.5))), say=lambda _: None))
    load = e["mla", "layer_first", "load"]
    assert load["take_over"] is False
    assert load["note"] == "hicache kernel is worse on burst_gemm_slowdown_pct 1.5 vs SGLang 1"


def test_each_side_of_an_operation_is_one_target():
    """SGLang's load_layer row from its TMA kernel: its load_burst row too, never its JIT kernel's."""
    rows = [r for r in _cell(kernel=(0.90, 6, 0.5)) if not (r["peer"] == "sglang-tma" and r["op"] == "load_burst")]
    load = _entries(T.build(_data(rows)))["mla", "layer_first", "load"]
    assert load["sglang"] == {"copy_ratio": 0.85, "host_us": 6}  # the burst metrics dropped on both sides
    assert load["hicache"] == {"copy_ratio": 0.9, "host_us": 6} and load["take_over"] is True


def test_the_table_holds_one_shape_per_kind_and_says_which_operations_it_left_out():
    rows = _cell() + _cell(shape=FP8) + _cell(shape=MHA)
    heard: list[str] = []
    e = _entries(T.build(_data(rows), say=heard.append))
    assert {k[0] for k in e} == {"mla", "mha"} and SHAPE in e["mla", "layer_first", "load"]["source"]
    fp8_only = [r for r in _cell(shape=FP8) if not (r["peer"] == "sglang-jit" and r["op"] == "backup_all_layers")]
    e = _entries(T.build(_data(fp8_only), [FP8], say=heard.append))
    assert ("mla", "layer_first", "backup") not in e and ("mla", "layer_first", "load") in e
    assert heard == ["mla layer_first backup: no row of SGLang's default in the results (mla61x656-fp8 at 4096 "
                     "tokens): no entry"]
    with pytest.raises(T.Refused, match="a mla shape is named already"):
        T.build(_data(rows), [SHAPE, FP8])
    with pytest.raises(T.Refused, match="shape 'nope' has no timed rows"):
        T.build(_data(rows), ["nope"])


def test_the_fewest_tokens_are_the_default_and_others_can_be_named():
    rows = _cell(tokens=32768, kernel=(0.99, 1, 0.0)) + _cell()
    assert _entries(T.build(_data(rows)))["mla", "layer_first", "load"]["take_over"] is False
    assert _entries(T.build(_data(rows), tokens=32768))["mla", "layer_first", "load"]["take_over"] is True
    with pytest.raises(T.Refused, match="--tokens 8: mla61x576-bf16 was measured at 4096, 32768 tokens"):
        T.build(_data(rows), tokens=8)


def test_written_tables_load_in_the_bridge_and_a_table_it_refuses_is_not_written(tmp_path, monkeypatch):
    out = tmp_path / "table.json"
    T.write(T.build(_data(_cell(kernel=(0.90, 6, 0.5)))), str(out))
    table = load_table(out)
    assert table.serving(Cell("mla", "layer_first", "kernel", False, "load")) == "kernel"
    assert table.serving(Cell("mla", "layer_first", "kernel", False, "backup")) is None
    bad = T.build(_data(_cell()))
    bad["entries"][0]["take_over"] = True  # a backup the numbers do not justify
    with pytest.raises(TakeoverTableError, match="take_over is true but hicache is worse"):
        T.write(bad, str(tmp_path / "bad.json"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table.json"]  # no file, no leftover


def test_main_writes_the_table_and_refuses_what_is_not_a_result(tmp_path, capsys):
    src, out = tmp_path / "peers.json", tmp_path / "t.json"
    src.write_text(json.dumps(_data(_cell(kernel=(0.90, 6, 0.5)))))
    assert T.main([str(src), "--out", str(out)]) == 0
    assert "mla layer_first load: taken over by kernel" in capsys.readouterr().err
    assert len(load_table(out).entries) == 2
    (tmp_path / "x.json").write_text(json.dumps({"rows": "nope"}))
    assert T.main([str(tmp_path / "x.json")]) == 2
    assert "not a peers.json result" in capsys.readouterr().err
    assert T.main([str(tmp_path / "missing.json")]) == 2
    undated = _data(_cell())
    del undated["meta"]["date"]
    (tmp_path / "undated.json").write_text(json.dumps(undated))
    assert T.main([str(tmp_path / "undated.json")]) == 2
    assert "undated.json: the results' meta.date is None, not a date a table entry can carry" in capsys.readouterr().err
    (tmp_path / "none.json").write_text(json.dumps(_data([r for r in _cell() if r["peer"] != "hicache"])))
    assert T.main([str(tmp_path / "none.json")]) == 2
    assert "nothing to put in a table" in capsys.readouterr().err


def test_a_printed_table_is_checked_as_a_written_one_is(tmp_path, monkeypatch, capsys):
    bad = T.build(_data(_cell()))
    bad["entries"][0]["take_over"] = True
    monkeypatch.setattr(T, "build", lambda *a, **k: bad)
    (tmp_path / "p.json").write_text(json.dumps(_data(_cell())))
    assert T.main([str(tmp_path / "p.json")]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "take_over is true but hicache is worse" in out.err


@pytest.mark.parametrize("name", ["peers-h200-turns-cal-998754e-2026-12-06.json",
                                  "peers-h100-turns-7d510d9-2026-12-06.json", "peers-h100-turns-cal-7d510d9-2026-12-06.json",
                                  "peers-h100-turns-24ce7d8-2026-12-06.json", "peers-h100-b6e0065-2026-12-06.json",
                                  "peers-572506d-2026-12-02.json", "peers-h100-f330333-2026-12-07.json"])
def test_the_recorded_peer_runs_take_over_no_cell_as_the_shipped_table_says(name):
    """docs/sglang.md: no measured cell has hicache ahead of SGLang's default on every metric."""
    with open(ROOT / "docs" / "perf" / name, encoding="utf-8") as fh:
        table = T.build(json.load(fh), say=lambda _: None)
    assert len(table["entries"]) == 8 and not any(e["take_over"] for e in table["entries"])
    assert not any(e.take_over for e in load_table(ROOT / "hicache_core/integrations/sglang/takeover.json")
                   .entries.values())


def test_the_mla_peer_cells_with_dependent_launches_take_over_no_cell():
    """docs/perf/peers-mla-h100-9fa7edf-2026-12-07.json (record call 66: MLA bf16 backups and lone loads with the
    backups' dependent launches on, as shipped): SGLang keeps its four cells, each for a named reason."""
    with open(ROOT / "docs" / "perf" / "peers-mla-h100-9fa7edf-2026-12-07.json", encoding="utf-8") as fh:
        table = T.build(json.load(fh), say=lambda _: None)
    cells = {(e["kind"], e["layout"], e["op"]) for e in table["entries"]}
    assert cells == {("mla", lay, op) for lay in ("layer_first", "page_first") for op in ("backup", "load")}
    assert not any(e["take_over"] for e in table["entries"])
    assert all("is worse on" in e["note"] for e in table["entries"])
