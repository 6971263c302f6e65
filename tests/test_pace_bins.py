"""benchmarks/pace_bins.py: the report it makes of a pace probe's reused-index cycles (CPU, synthetic cycles)."""

from __future__ import annotations

import json

import pytest

from benchmarks import pace_bins as B
from hicache_core.backends import auto_rules, pace


def _cycle(direct: float, kernel: float, auto: float, host_us: float, probed: int = 0, est: float | None = None,
           by: str = "kernel") -> dict:
    return {"direct": direct, "kernel": kernel, "auto": auto, "direct_host_us": host_us, "auto_probed": probed,
            "h2d_us_reused": est, "auto_by": by}


def _cell(cycles: list[dict], reuse: bool = True) -> dict:
    return {"summary": {"shape": "mla61x656-fp8", "layout": "layer_first", "reuse": reuse}, "cycles": cycles}


def test_direct_is_bucketed_by_its_own_host_time() -> None:
    cycles = [_cycle(0.91, 0.85, 0.85, 49.0), _cycle(0.89, 0.85, 0.85, 51.9), _cycle(0.60, 0.85, 0.85, 80.5)]
    older = _cycle(0.70, 0.85, 0.85, 0.0)
    del older["direct_host_us"]  # an older probe's cycle: no host time recorded, left out
    cycles.append(older)
    assert B.host_buckets(cycles) == [{"host_us_from": 48.0, "cycles": 2, "direct": 0.9},
                                      {"host_us_from": 80.0, "cycles": 1, "direct": 0.6}]


def test_an_estimate_is_judged_by_the_cycles_after_its_probe() -> None:
    # a probe in cycle 0 leaves 0.82 us/descriptor (read in cycle 1's row); cycles 1-2 follow it.  A probe in cycle
    # 3 leaves 1.31; its two cycles follow.  The probe of cycle 6 has too few cycles after it: left out.
    cycles = [_cycle(0.90, 0.85, 0.85, 50, probed=1),
              _cycle(0.91, 0.84, 0.84, 50, est=0.82), _cycle(0.89, 0.86, 0.84, 50, est=0.82),
              _cycle(0.60, 0.85, 0.85, 90, probed=1),
              _cycle(0.55, 0.85, 0.85, 90, est=1.31), _cycle(0.57, 0.85, 0.85, 90, est=1.31),
              _cycle(0.90, 0.85, 0.85, 50, probed=1), _cycle(0.90, 0.85, 0.85, 50, est=0.6)]
    rows = B.estimate_bins(cycles, follow=2, width=0.05)
    assert [(r["estimate_from"], r["probes"], r["direct"], r["kernel"], r["auto_by_direct"]) for r in rows] == [
        (0.8, 1, 0.9, 0.85, 0), (1.3, 1, 0.56, 0.85, 0)]


def test_the_limit_is_the_one_fed_applies() -> None:
    """At the printed limit a measured reused-plan burst of one layer goes to the copy engine, just above it not."""
    nbytes, descs = B.layer_geometry("mla61x656-fp8", "layer_first")
    assert (nbytes, descs) == (4096 * 656, 64)
    limit = B.estimate_limit(nbytes, descs, 55.0)
    link_us = nbytes / 55.0e3
    assert descs * limit + pace.MODEL_CALL_US == pytest.approx(auto_rules.FED_SHARE * link_us)
    assert 0.5 < limit < 1.0


def test_main_reports_reused_cells_only_and_refuses_a_run_without_them(tmp_path, capsys) -> None:
    cycles = [_cycle(0.90, 0.85, 0.85, 50, probed=1), _cycle(0.91, 0.84, 0.84, 50, est=0.82, by="direct")]
    path = tmp_path / "pace.json"
    path.write_text(json.dumps([_cell(cycles), _cell(cycles, reuse=False)]))
    out = tmp_path / "bins.json"
    assert B.main([str(path), "--follow", "1", "--link-gbps", "55", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert len(report) == 1 and report[0]["by_estimate"][0]["auto_by_direct"] == 1
    assert "auto's limit" in capsys.readouterr().out
    path.write_text(json.dumps([_cell(cycles, reuse=False)]))
    assert B.main([str(path)]) == 1
    assert "--reuse" in capsys.readouterr().err


def test_the_share_sweep_scores_the_route_each_estimate_picks_against_the_better_one() -> None:
    # two probes: one reads 0.80 us/descriptor (direct 0.90 ahead of the kernel's 0.85 after it), one 1.30 (the
    # kernel ahead: direct 0.56); auto went to the kernel after both (0.84, 0.85)
    cycles = [_cycle(0.90, 0.85, 0.85, 50, probed=1),
              _cycle(0.91, 0.84, 0.84, 50, est=0.80), _cycle(0.89, 0.86, 0.84, 50, est=0.80),
              _cycle(0.60, 0.85, 0.85, 90, probed=1),
              _cycle(0.55, 0.85, 0.85, 90, est=1.30), _cycle(0.57, 0.85, 0.85, 90, est=1.30)]
    nbytes, descs = B.layer_geometry("mla61x656-fp8", "layer_first")
    low, high = (B.estimate_limit(nbytes, descs, 55.0, s) for s in (1.0, 1.3))
    assert low < 0.80 < high < 1.30  # the shares put the first probe's estimate on either side of the limit
    rows = B.share_sweep(cycles, 2, nbytes, descs, 55.0, [1.0, 1.3])
    assert [r["share"] for r in rows] == [None, 1.0, 1.3] and all(r["probes"] == 2 for r in rows)
    # as run: 0.84 against 0.90, 0.85 against 0.85; at 1.0 both on the kernel: 0.85 against 0.90 and 0.85; at 1.3 the
    # first on direct (0.90, the better) and the second on the kernel
    assert [r["gap_points"] for r in rows] == [-3.0, -2.5, 0.0]
    assert [r["within_3"] for r in rows] == [1, 1, 2]
    assert rows[2]["limit"] == pytest.approx(high, abs=1e-4) and rows[0]["limit"] is None
    assert B.share_sweep(cycles[:1], 2, nbytes, descs, 55.0, [1.0]) == []  # no probe with its cycles after it


def test_main_prints_the_sweep_and_refuses_bad_shares(tmp_path, capsys) -> None:
    cycles = [_cycle(0.90, 0.85, 0.85, 50, probed=1), _cycle(0.91, 0.84, 0.84, 50, est=0.82)]
    path = tmp_path / "pace.json"
    path.write_text(json.dumps([_cell(cycles)]))
    assert B.main([str(path), "--follow", "1", "--link-gbps", "55", "--shares", "1.1,1.3"]) == 0
    out = capsys.readouterr().out
    assert "counterfactual" in out and "share 1.30" in out and "auto as run" in out
    for bad in ("1.1,x", "1.1,0", "-1"):
        with pytest.raises(SystemExit):
            B.main([str(path), "--link-gbps", "55", "--shares", bad])
        assert "--shares" in capsys.readouterr().err


def test_the_kernel_pools_host_time_buckets_show_the_hosts_state_beside_directs() -> None:
    cycles = [_cycle(0.91, 0.85, 0.85, 50.0), _cycle(0.90, 0.84, 0.85, 52.0), _cycle(0.55, 0.85, 0.85, 90.0)]
    for c, k in zip(cycles, (12.4, 12.9, 17.2)):
        c["kernel_host_us"] = k
    older = _cycle(0.70, 0.85, 0.85, 60.0)  # no kernel host time recorded: left out
    assert B.kernel_buckets(cycles + [older]) == [
        {"kernel_host_us_from": 12, "cycles": 2, "direct_host_us": 51.0, "direct": 0.905, "kernel": 0.845},
        {"kernel_host_us_from": 17, "cycles": 1, "direct_host_us": 90.0, "direct": 0.55, "kernel": 0.85}]


def test_the_kernel_rule_routes_each_burst_by_the_previous_bursts_kernel_host_time(capsys, tmp_path) -> None:
    # a fast burst (kernel 10 us/layer), a slow one (15), a fast one: at 1.2x the least (12 us) the second burst goes
    # to direct (the first was fast: direct 0.55 there, a 30-point miss) and the third to the kernel (0.85 against
    # direct's 0.90: 5 points)
    cycles = [_cycle(0.90, 0.85, 0.85, 50.0), _cycle(0.55, 0.85, 0.85, 90.0), _cycle(0.90, 0.85, 0.88, 50.0)]
    for c, k in zip(cycles, (10.0, 15.0, 10.0)):
        c["kernel_host_us"] = k
    rows = B.kernel_rule(cycles, [1.2, 2.0])
    assert [r["factor"] for r in rows] == [None, 1.2, 2.0] and all(r["bursts"] == 2 for r in rows)
    # as run: 0 and -2; at 1.2x: -30 and -5; at 2.0x both bursts after a kernel time within 20 us: direct, -30 and 0
    assert [r["gap_mean"] for r in rows] == [-1.0, -17.5, -15.0]
    assert [r["within_3"] for r in rows] == [1.0, 0.0, 0.5]
    assert rows[2]["gap_median"] == -15.0 and B.kernel_rule(cycles[:1], [1.2]) == []
    path = tmp_path / "pace.json"
    path.write_text(json.dumps([_cell(cycles)]))
    assert B.main([str(path), "--kernel-factors", "1.2"]) == 0
    assert "previous one's kernel host time" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        B.main([str(path), "--kernel-factors", "0"])
    assert "--kernel-factors" in capsys.readouterr().err
