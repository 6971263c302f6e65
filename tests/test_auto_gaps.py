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
    """docs/perf/runs.md, "Earlier run: the first H200 run since the fourteenth": seven lone one-layer backups (the backup rule) and five loads."""
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


def test_a_cell_with_two_default_rows_of_a_candidate_is_skipped_with_both_named(tmp_path, capsys):
    rows = _cell(0.90, 0.60, 0.80, served="layer_first.kernel", op="load_layer")
    other = dict(rows[0], strategy="other.kernel", ratio=0.85)
    rows[0]["strategy"] = "layer_first.kernel"
    assert G.main([_write(tmp_path, rows + [other])]) == 0
    out = capsys.readouterr().out
    assert "no cell with `auto` and both candidates" in out
    assert "load_layer: skipped, 2 default rows of kernel (layer_first.kernel, other.kernel)" in out


def test_rows_from_before_variants_count_as_their_backend_s_default():
    rows = [{k: v for k, v in r.items() if k != "variant"} for r in _cell(0.84, 0.92, 0.90)
            if r["variant"] in ("P=default", "staging=auto", "")]
    entries, skipped = G.gaps(G.candidates(rows))
    assert skipped == [] and [round(e["gap_points"], 2) for e in entries] == [-2.0]


def test_a_refused_file_does_not_stop_the_others_and_the_status_says_so(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    good = _write(tmp_path, _cell(0.84, 0.92, 0.90))
    assert G.main([str(bad), good]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"{G.PROG}: {bad}") and f"## {good}" in captured.out


def test_unknown_route_and_rows_without_numbers():
    rows = _cell(0.84, 0.92, 0.90, served="")
    assert G.gaps(G.candidates(rows))[0][0]["route"] == "?"
    rows[2]["ratio"] = None  # direct's default row without a ratio: no candidate, the cell is skipped
    assert G.gaps(G.candidates(rows))[1] == [(("mla61x576-bf16", "layer_first", 64, 4096, "load_burst"),
                                              "no default row of direct")]


@pytest.mark.parametrize("points", ["nan", "-1", "inf"])
def test_points_must_be_a_finite_number_of_zero_or_more(tmp_path, capsys, points):
    with pytest.raises(SystemExit) as exc:
        G.main([_write(tmp_path, _cell(0.84, 0.92, 0.90)), "--points", points])
    assert exc.value.code == 2 and "finite number of points" in capsys.readouterr().err
