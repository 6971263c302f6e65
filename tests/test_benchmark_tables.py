"""benchmarks/tables.py (CPU, synthetic bench JSON): one column per variant of a backend, the default as the bare
backend name; one clear line and exit 2 for a file that is not a ``hicache bench`` result or a backend it lacks;
signed GEMM slowdowns; copy-engine tables without an SM budget."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "tables.py"


@pytest.fixture(scope="module")
def tables():
    spec = importlib.util.spec_from_file_location("hicache_bench_tables_t", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(**kw):
    row = {"shape": "mla61x656-fp8", "layout": "page_first_direct", "io_backend": "auto", "strategy": "auto",
           "page_size": 64, "tokens": 4096, "programs": None, "op": "load_burst", "bytes": 163_774_464,
           "ms": 1.0, "gbps": 1.0, "memcpy_gbps": 1.0, "ratio": 0.838, "host_us": 16.0, "gemm_slowdown": 0.02,
           "variant": "", "served_by": "x"}
    row.update(kw)
    return row


def _write(path: Path, rows: list[dict], meta: bool = True) -> str:
    path.write_text(json.dumps({"meta": {"gpu": "test"}, "rows": rows} if meta else {"rows": rows}))
    return str(path)


def _cells(out: str, shape_layout: str) -> list[str]:
    """The cells of the table line of ``shape | layout`` (after shape, layout, page, tokens, MB/layer)."""
    line = next(x for x in out.splitlines() if x.startswith(f"| {shape_layout} |"))
    return [c.strip() for c in line.strip("|").split("|")][5:]


def test_each_auto_variant_is_its_own_column_and_the_default_keeps_its_numbers(tables, tmp_path, capsys):
    """Rows of one backend that differ only by variant used to share one cell (keyed by programs alone): the last
    variant in the file overwrote the default's figures."""
    rows = [_row(variant="", ratio=0.838, host_us=16.0, gemm_slowdown=0.02),
            _row(variant="lone=off", ratio=0.821, host_us=14.0, gemm_slowdown=0.01),
            _row(variant="pace=off", ratio=0.804, host_us=17.0, gemm_slowdown=-0.001),
            _row(variant="", op="backup_all_layers", ratio=0.899, host_us=785.0),
            _row(variant="pace=off", op="backup_all_layers", ratio=0.848, host_us=973.0)]
    f = _write(tmp_path / "bench.json", rows)
    assert tables.main(["--backend", "auto", f]) == 0
    out = capsys.readouterr().out
    assert "| auto | auto lone=off | auto pace=off |" in out
    burst, backup = out.split("#### `backup_all_layers`")
    assert _cells(burst, "mla61x656-fp8 | page_first_direct") == [
        "0.84 (16 us, GEMM +2%)", "0.82 (14 us, GEMM +1%)", "0.80 (17 us, GEMM -0.1%)"]
    assert _cells(backup, "mla61x656-fp8 | page_first_direct") == [
        "0.90 (785 us, GEMM +2%)", "-", "0.85 (973 us, GEMM +2%)"]
    assert "SM budget" not in out and "by variant" in out


def test_budgets_and_variants_together_and_the_direct_default(tables, tmp_path, capsys):
    """The kernel's budgets keep their P= columns (default first); ``direct``'s default staging is the bare name, its
    other variants are named, and a copy-engine table says it has no SM budget."""
    kernel = [_row(io_backend="kernel", variant="P=default", programs=None, ratio=0.87, launched_programs=8),
              _row(io_backend="kernel", variant="P=4", programs=4, ratio=0.86)]
    direct = [_row(io_backend="direct", variant="staging=auto", ratio=0.95, gemm_slowdown=0.0),
              _row(io_backend="direct", variant="staging=never", ratio=0.70, gemm_slowdown=None)]
    f = _write(tmp_path / "bench.json", kernel + direct)
    assert tables.main([f]) == 0
    out = capsys.readouterr().out
    assert "| P=default | P=4 |" in out and "by SM budget" in out
    assert _cells(out, "mla61x656-fp8 | page_first_direct") == ["0.87 (16 us, GEMM +2%, 8 programs)",
                                                                "0.86 (16 us, GEMM +2%)"]
    assert tables.main(["--backend", "direct", f]) == 0
    out = capsys.readouterr().out
    assert "| direct | direct staging=never |" in out
    assert "SM budget" not in out.replace("no SM budget", "") and "copy engine" in out
    assert _cells(out, "mla61x656-fp8 | page_first_direct") == ["0.95 (16 us, GEMM ±0%)", "0.70 (16 us)"]


@pytest.mark.parametrize("fraction, text", [(0.0, "±0%"), (0.01, "+1%"), (-0.01, "-1%"), (0.4531, "+45%"),
                                            (-0.003177, "-0.3%"), (0.012, "+1%"), (0.0049, "+0.5%"),
                                            (-0.0004, "-0.04%"), (-0.0001, "-0.01%"), (0.00001, "±0%"),
                                            (-0.00004, "±0%")])  # (the last two round to zero: no sign before it)
def test_gemm_slowdowns_are_signed_once(tables, fraction, text):
    assert tables.signed_pct(fraction) == text


def test_no_cell_prints_a_doubled_sign(tables, tmp_path, capsys):
    """Negative slowdowns printed as '+-0%' / '+-1%'."""
    rows = [_row(shape=f"mla61x{576 + i}-bf16", gemm_slowdown=s) for i, s in enumerate((-0.003, -0.012, 0.0, 0.3))]
    assert tables.main(["--backend", "auto", _write(tmp_path / "b.json", rows)]) == 0
    out = capsys.readouterr().out
    assert "+-" not in out and "GEMM -0.3%" in out and "GEMM -1%" in out and "GEMM ±0%" in out and "GEMM +30%" in out


@pytest.mark.parametrize("data, says", [
    ({"meta": {}, "rows": [{"peer": "sglang", "shape": "mla61x576-bf16", "layout": "layer_first", "op": "load_layer",
                            "ratio": 0.9, "host_us": 9.0, "bytes": 1, "page_size": 64, "tokens": 4096}]},
     "it looks like a peer benchmark result (benchmarks/peers.py"),
    ({"NVIDIA H100 80GB HBM3": {"link_gbps": 54.3, "submit_us": 0.84, "measurements": []}},
     "it looks like a calibration file (hicache calibrate); no 'rows' list"),
    ([{"summary": {}, "cycles": []}], "it looks like a pace probe result (benchmarks/pace_probe.py"),
    ({"gpu": "x", "rows": [{"case": "control"}]}, "row 0 lacks 'shape'"),
])
def test_a_file_that_is_not_a_bench_result_is_refused_in_one_line(tables, tmp_path, capsys, data, says):
    f = tmp_path / "other.json"
    f.write_text(json.dumps(data))
    assert tables.main([str(f)]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    assert cap.err.count("\n") == 1
    assert cap.err.startswith(f"tables.py: {f} is not a `hicache bench` result: ")
    assert says in cap.err and "expected a JSON object whose 'rows' each have shape, layout, io_backend" in cap.err


def test_a_file_that_is_not_json_or_missing_is_refused_in_one_line(tables, tmp_path, capsys):
    md = tmp_path / "peers.md"
    md.write_text("| peer | op |\n")
    assert tables.main([str(md)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tables.py: {md} is not JSON, so not a `hicache bench` result") and err.count("\n") == 1
    assert tables.main([str(tmp_path / "nope.json")]) == 2
    assert capsys.readouterr().err == f"tables.py: {tmp_path / 'nope.json'} cannot be read (No such file or directory)\n"


def test_an_unknown_backend_names_those_the_files_hold(tables, tmp_path, capsys):
    """An unknown --backend printed nothing and exited 0."""
    f = _write(tmp_path / "bench.json", [_row(io_backend="kernel", variant="P=default"), _row(io_backend="auto")],
               meta=False)
    assert tables.main(["--backend", "nope", f]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    assert cap.err == f"tables.py: no 'nope' rows in {f} (these hold kernel, auto); pick one with --backend\n"


def test_the_script_exits_2_without_a_traceback(tmp_path):
    """As the docs run it: ``python benchmarks/tables.py FILE``."""
    f = tmp_path / "calibration.json"
    f.write_text(json.dumps({"NVIDIA H100 80GB HBM3": {"link_gbps": 54.3}}))
    res = subprocess.run([sys.executable, str(SCRIPT), str(f)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == "" and "Traceback" not in res.stderr
    assert res.stderr.count("\n") == 1 and "is not a `hicache bench` result" in res.stderr
