"""The two-GPU benchmark's host-side parts (runs on CPU): topology parsing, ratios, aggregates, tables."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "two_gpu.py"
_spec = importlib.util.spec_from_file_location("two_gpu_bench", _PATH)
two_gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(two_gpu)

TOPO = ("\x1b[4m\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
        "GPU0\t X \tNV18\tSYS\t0-3,96-97\t0\t\tN/A\n"
        "GPU1\tNV18\t X \tSYS\t48-49\t1\t\tN/A\n"
        "NIC0\tSYS\tSYS\t X \t\t\t\t\n\nLegend:\n\n  X    = Self\n")


def test_cpu_affinity_from_topology():
    assert two_gpu.cpu_affinity(TOPO, [0, 1]) == {0: [0, 1, 2, 3, 96, 97], 1: [48, 49]}
    assert two_gpu.cpu_affinity(TOPO, [1]) == {1: [48, 49]}
    assert two_gpu.cpu_affinity("(nvidia-smi topo -m failed: no such file)", [0, 1]) == {}


def _row(gpu, strategy, alone_s, both, reps=10, nbytes=10**9, op="backup_all_layers"):
    return dict(gpu=gpu, tokens=4096, layout="-" if strategy == "memcpy" else "layer_first",
                io_backend="memcpy" if strategy == "memcpy" else "kernel", strategy=strategy, op=op,
                to_host=True, bytes=nbytes, reps=reps, error=None, alone=[alone_s, 0.0, alone_s], both=list(both))


def test_ratios_are_per_gpu_and_the_aggregate_spans_both_windows():
    rows = [
        _row(0, "memcpy", 0.2, (0.25, 100.0, 100.25)),  # 50 GB/s alone, 40 both
        _row(1, "memcpy", 0.25, (0.25, 100.0, 100.25)),  # 40 alone, 40 both
        _row(0, "layer_first.kernel", 0.25, (0.5, 200.0, 200.5)),  # 40 alone, 20 both
        _row(1, "layer_first.kernel", 0.5, (0.5, 200.25, 200.75)),  # 20 alone, 20 both, starts 0.25 s later
    ]
    per_gpu, agg = two_gpu.summarise(rows)
    k0 = next(r for r in per_gpu if r["gpu"] == 0 and r["strategy"] == "layer_first.kernel")
    assert (k0["alone_gbps"], k0["memcpy_alone_gbps"], k0["ratio_alone"]) == pytest.approx((40.0, 50.0, 0.8))
    assert (k0["both_gbps"], k0["memcpy_both_gbps"], k0["ratio_both"]) == pytest.approx((20.0, 40.0, 0.5))
    k1 = next(r for r in per_gpu if r["gpu"] == 1 and r["strategy"] == "layer_first.kernel")
    assert k1["ratio_alone"] == pytest.approx(20.0 / 40.0)
    a = next(a for a in agg if a["strategy"] == "layer_first.kernel")
    # 2 x 10 GB over the union 200.0 .. 200.75; both ran during 200.25 .. 200.5
    assert (a["aggregate_gbps"], a["sum_alone_gbps"], a["overlap"]) == pytest.approx((20 / 0.75, 60.0, 0.25 / 0.75))
    assert [r["strategy"] for r in per_gpu] == ["memcpy", "memcpy", "layer_first.kernel", "layer_first.kernel"]


def test_markdown_tables():
    rows = [_row(0, "memcpy", 0.2, (0.25, 0.0, 0.25)), _row(1, "memcpy", 0.25, (0.25, 0.0, 0.25))]
    rows.append(dict(_row(0, "core.direct", 0.2, (0.25, 0.0, 0.25)), error="RuntimeError: boom", both=None))
    rows.append(_row(1, "core.direct", 0.2, (0.25, 0.0, 0.25)))
    per_gpu, agg = two_gpu.summarise(rows)
    md = two_gpu.markdown(per_gpu, agg, dict(shape="mla61x576-bf16", page_size=64, gpus_desc="2 x H200"))
    lines = md.splitlines()
    assert lines[0] == "### Two GPUs at once: mla61x576-bf16, page 64, 2 x H200"
    assert "| 4096 | backup_all_layers | - | memcpy | 0 | 50.0 | 40.0 | 50.0 | 40.0 | 1.00 | 1.00 |" in lines
    assert ("| 4096 | backup_all_layers | layer_first | core.direct (RuntimeError: boom) | 0 | 50.0 | — | 50.0 | 40.0 "
            "| 1.00 | — |") in lines
    assert "| 4096 | backup_all_layers | - | memcpy | 2 | 80.0 | 90.0 | 0.89 | 1.00 |" in lines
    assert "| 4096 | backup_all_layers | layer_first | core.direct | 2 | — | — | — | — |" in lines
