"""benchmarks/auto_gaps.py: ``auto`` against the better of its candidates, from ``hicache bench`` rows (CPU, no timing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import auto_gaps as G

ROOT = Path(__file__).resolve().parents[1]
PERF = ROOT / "docs" / "perf"


def _row(backend, variant, ratio, op="load_burst", layout="layer_first", served_by="", gemm=None, host=10.0):
    programs = int(variant[2:]) if variant.startswith("P=") and variant != "P=default" else None
    return {"shape": "mla61x576-bf16", "layout": layout, "io_backend": backend, "variant": variant, "page_size": 64,
            "tokens": 4096, "op": op, "bytes": 1 << 20, "ratio": ratio, "host_us": host, "gemm_slowdown": gemm,
            "served_by": served_by, "programs": programs}


def _cell(kernel, direct, auto, served="direct", op="load_burst", layout="layer_first"):
    return [_row("kernel", "P=default", kernel, op, layout, "layer_first.kernel"),
            _row("kernel", "P=8", 0.99, op, layout, "layer_first.kernel"),  # not the default budget: never compared
            _row("direct", "staging=auto", direct, op, layout, "core.direct"),
            _row("direct", "staging=never", 0.99, op, layout, "core.direct"),
            _row("auto", "", auto, op, layout, served),
            _row("auto", "lone=off", 0.99, op, layout, served)]


def _write(tmp_path, rows, name="bench.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"meta": {}, "rows": rows}))
    return str(path)


def test_the_gap_is_to_the_better_default_candidate_and_a_miss_only_beyond_the_points():
    rows = (_cell(0.84, 0.92, 0.90) + _cell(0.90, 0.60, 0.86, served="layer_first.kernel", op="load_layer")
            + _cell(0.90, 0.60, 0.8701, served="layer_first.kernel", op="load_all_layers"))
    entries, incomplete = G.gaps(G.candidates(rows))
    got = {e["cell"][4]: (round(e["gap_points"], 2), e["route"], e["miss"]) for e in entries}
    assert got == {"load_burst": (-2.0, "copy engine", False), "load_layer": (-4.0, "kernel", True),
                   "load_all_layers": (-2.99, "kernel", False)}
    assert incomplete == []
    assert [e["miss"] for e in G.gaps(G.candidates(rows), points=1.5)[0]] == [True, True, True]


def test_a_cell_without_a_default_candidate_is_listed_not_compared(tmp_path, capsys):
    rows = _cell(0.84, 0.92, 0.90) + [r for r in _cell(0.8, 0.9, 0.7, op="load_layer") if r["io_backend"] != "direct"
                                      or r["variant"] != "staging=auto"]
    assert G.main([_write(tmp_path, rows)]) == 0
    out = capsys.readouterr().out
    assert "in 0 of 1 cells" in out
    assert "load_layer: skipped, no default row of direct" in out


def test_misses_are_printed_and_written(tmp_path, capsys):
    out_json = tmp_path / "gaps.json"
    path = _write(tmp_path, _cell(0.90, 0.60, 0.80, served="layer_first.kernel (13 lone loads)", op="load_layer"))
    assert G.main([path, "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "in 1 of 1 cells:" in out and "load_layer: -10.0 (kernel)" in out and "| **-10.0** |" in out
    assert json.loads(out_json.read_text()) == [{"file": path, "cell": ["mla61x576-bf16", "layer_first", 64, 4096,
                                                                         "load_layer"],
                                                 "route": "kernel", "gap_points": -10.0, "miss": True}]


@pytest.mark.parametrize("content", ["not json", json.dumps({"rows": [{"shape": "x"}]}), json.dumps([1, 2])])
def test_a_file_that_is_not_bench_json_is_refused_in_one_line(tmp_path, capsys, content):
    path = tmp_path / "x.json"
    path.write_text(content)
    assert G.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{G.PROG}: {path}") and err.count("\n") == 1


def test_the_recorded_h200_run_has_the_misses_the_run_log_names(capsys):
    """docs/perf/runs.md, "Latest run": seven lone one-layer backups (the backup rule) and five loads."""
    backups = PERF / "bench-backup-burst-h200-90c3ae0-2026-12-06.json"
    loads = PERF / "bench-loads-h200-998754e-2026-12-06.json"
    missed = {}
    for path in (backups, loads):
        entries, incomplete = G.gaps(G.candidates(G.load_rows(str(path))))
        assert incomplete == []
        missed[path] = sorted((e["cell"][0], e["cell"][1], e["cell"][4], round(e["gap_points"], 1))
                              for e in entries if e["miss"])
    assert {op for *_, op, _ in missed[backups]} == {"backup_layer"} and len(missed[backups]) == 7
    assert min(g for *_, g in missed[backups]) == -16.9
    assert missed[loads] == sorted([("mla61x576-bf16", "layer_first", "load_layer", -3.1),
                                    ("mla61x656-fp8", "layer_first", "load_burst", -7.1),
                                    ("mla61x656-fp8", "layer_first", "load_all_layers", -3.6),
                                    ("mla61x656-fp8", "page_first_direct", "load_layer", -3.0),
                                    ("mla61x656-fp8", "page_first_kv_split", "load_burst", -7.5)])
