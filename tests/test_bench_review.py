"""CPU tests of ``hicache bench``'s harness (hicache_core/bench/): the data check, argument checks, and the
order in which a row's fields are gathered.  Nothing here times anything; GPU parts are replaced by fakes (but for one
GPU test, skipped on the CPU, which times real copies and asserts only how the harness combines the timings)."""

from __future__ import annotations

import json
import types

import pytest
import torch

from hicache_core import bench
from hicache_core.kernel_support import kernel_unsupported_reason
from hicache_core.pool import HostKVPool, allocate_host_buffers
from hicache_core.registry import create_registry

from fakes import pool_device

SHAPE = "mha32x8x128-bf16"
TOKENS, PAGE = 64, 16


def _cpu_indices(spec, gen):
    """:func:`bench._indices` on the CPU (the original moves them to CUDA)."""
    ps, pages = spec.page_size, spec.num_pages
    offs = torch.arange(ps)
    hp = torch.randperm(pages, generator=gen)
    dp = torch.randperm(2 * pages, generator=gen)
    ex = lambda p: (p.unsqueeze(1) * ps + offs).reshape(-1)  # noqa: E731
    return ex(hp), ex(dp[:pages]), ex(dp[pages:])


@pytest.fixture
def cell(monkeypatch):
    """One grid cell as run_bench builds it, on the CPU: spec, device buffers, indices, shared host buffers."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    reg = create_registry()
    spec = bench.SHAPES[SHAPE](TOKENS, PAGE, torch.device("cpu"))
    dev = bench._device_buffers(spec, 2 * TOKENS + PAGE, "separate")
    h, s, d = _cpu_indices(spec, torch.Generator().manual_seed(0))
    host = allocate_host_buffers(reg.layout("layer_first").plan(spec), pin_memory=False)

    def pool():
        return HostKVPool(spec, "layer_first", "reference", dev, host_buffers=host, registry=reg, validate="shapes")
    return pool, dev, h, s, d


def test_check_catches_a_load_that_moves_nothing_after_an_earlier_pool_of_the_cell(cell):
    pool, dev, h, s, d = cell
    bench._check(pool(), dev, h, s, d)  # a good strategy: the load target rows now hold the source rows
    broken = pool()
    broken.load_layer = lambda layer, hi, di: None
    with pytest.raises(AssertionError, match="bench data check failed"):
        bench._check(broken, dev, h, s, d)


def test_check_catches_a_backup_that_moves_nothing_after_an_earlier_pool_of_the_cell(cell):
    pool, dev, h, s, d = cell
    bench._check(pool(), dev, h, s, d)  # the shared host buffers now hold the source rows
    broken = pool()
    broken.backup_all_layers = lambda hi, si: None
    with pytest.raises(AssertionError, match="bench data check failed"):
        bench._check(broken, dev, h, s, d)


@pytest.mark.parametrize("op,attr", [("load_all_layers", "load_all_layers"), ("backup_layer", "backup_layer")])
def test_check_covers_the_other_ops_it_will_time(cell, op, attr):
    pool, dev, h, s, d = cell
    broken = pool()
    setattr(broken, attr, lambda *a: None)
    bench._check(broken, dev, h, s, d)  # not timed: not checked
    with pytest.raises(AssertionError, match=f"bench data check failed: .*{op}"):
        bench._check(broken, dev, h, s, d, ["load_layer", op])


def test_check_covers_the_backup_burst_by_its_one_layer_backups(cell):
    pool, dev, h, s, d = cell
    broken = pool()
    broken.backup_layer = lambda *a: None
    bench._check(broken, dev, h, s, d, ["load_burst"])  # no one-layer backup timed: not checked
    with pytest.raises(AssertionError, match="bench data check failed: .*backup_layer"):
        bench._check(broken, dev, h, s, d, ["backup_burst"])


def test_check_passes_a_good_strategy_for_every_op(cell):
    pool, dev, h, s, d = cell
    for _ in range(2):  # twice on the same buffers, as successive pools of one cell
        bench._check(pool(), dev, h, s, d, bench.OPS)


def test_tokens_must_be_whole_pages_before_anything_is_measured(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench.run, "run_bench", lambda **kw: pytest.fail("measured a grid with a partial page"))
    rc = bench.main(["--out", str(tmp_path), "--tokens", "4096,100", "--page-sizes", "16,64"])
    err = capsys.readouterr().err
    assert rc == 2 and "100 tokens at page size 16, 100 tokens at page size 64" in err
    assert "4096" not in err.split(";")[1] and not (tmp_path / "bench.json").exists()
    rc = bench.main(["--out", str(tmp_path), "--tokens", "16", "--page-sizes", "64"])
    assert rc == 2 and "16 tokens at page size 64" in capsys.readouterr().err


def test_run_bench_refuses_partial_pages_up_front():
    with pytest.raises(ValueError, match="96 tokens at page size 64"):
        bench.run_bench(shapes=[SHAPE], tokens=[64, 96], page_sizes=[64], programs=[None])


def calling_samples_ms(fn, reps, warmup=bench.WARMUP, **kw):
    """A stand-in for ``timing._samples_ms`` that makes every call (warm-up ones included) and times each at 2 ms."""
    for _ in range(reps + warmup):
        fn()
    return [2.0] * reps


#: Why a kernel pool cannot be built on CPU tensors here (``None``: it can).  Such pools run in Triton's interpreter,
#: which pytest turns on only where there is no CUDA device (conftest.py): on a GPU host run_bench builds none, so a
#: test counting them cannot run there (nor where TRITON_INTERPRET=0 or Triton is missing).
_CPU_KERNEL_PROBLEM = kernel_unsupported_reason(bench.SHAPES[SHAPE](TOKENS, PAGE, torch.device("cpu")))
CPU_KERNELS = pytest.mark.skipif(_CPU_KERNEL_PROBLEM is not None,
                                 reason=f"kernel pools on CPU tensors: {_CPU_KERNEL_PROBLEM}")


@pytest.fixture
def fake_gpu(monkeypatch):
    """run_bench on the CPU: timing, memcpy, neighbours and the served-by probe replaced by recording fakes."""
    log: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setitem(bench.SHAPES, "cpu-tiny", lambda n, ps, device: bench.SHAPES[SHAPE](n, ps, torch.device("cpu")))
    monkeypatch.setattr(bench.workload, "_indices", _cpu_indices)
    monkeypatch.setattr(bench.run, "allocate_host_buffers", lambda plan, pin_memory: allocate_host_buffers(plan, pin_memory=False))
    monkeypatch.setattr(bench.timing, "_LinkWarmer", lambda: (lambda: log.append("warm")))

    class Memcpy:
        def gbps(self, nbytes, to_host, reps):
            log.append("memcpy")
            return 50.0

    monkeypatch.setattr(bench.timing, "_Memcpy", Memcpy)
    monkeypatch.setattr(bench.timing, "_samples_ms", lambda fn, reps, warmup=bench.WARMUP, **kw: log.append("time") or [2.0] * reps)
    monkeypatch.setattr(bench.timing, "_host_us", lambda fn, reps: log.append("host") or 30.0)
    monkeypatch.setattr(bench.timing, "_burst_host_us", lambda calls, reps: log.append("host") or 30.0)
    monkeypatch.setattr(bench.timing, "_gemm_slowdown", lambda fn: log.append("gemm") or 0.01)
    monkeypatch.setattr(bench.timing, "_hbm_reader", lambda: "reader")
    monkeypatch.setattr(bench.timing, "_neighbor_slowdown", lambda fn, work: log.append("hbm") or 0.02)
    monkeypatch.setattr(bench.timing, "_ms_beside", lambda fn, work, calls: log.append("beside") or 4.0)
    monkeypatch.setattr(bench.timing, "_ms_beside_gemm", lambda fn: log.append("beside") or 8.0)
    monkeypatch.setattr(bench.run, "_served_by", lambda *a, **k: log.append("served") or ("who", None))
    return log


@CPU_KERNELS
def test_served_by_is_asked_before_the_neighbours_run(fake_gpu):
    rows = bench.run_bench(shapes=["cpu-tiny"], tokens=[TOKENS], page_sizes=[PAGE], programs=[None, 2],
                           layouts=["layer_first"], backends=["reference", "kernel"],
                           ops=["backup_all_layers", "load_layer"], reps=4, gemm=True, hbm=True)
    assert [r.served_by for r in rows] == ["who"] * 6
    starts = [i for i, x in enumerate(fake_gpu) if x == "warm"]  # the link warmed once per operation, first
    assert len(starts) == 2
    for a, b in zip(starts, starts[1:] + [len(fake_gpu)]):
        op_log = fake_gpu[a:b]
        # every pool's timed calls (three pools, three rounds), then what served each, then each pool's host time
        # and neighbours
        assert op_log.count("time") == 9 and op_log.count("served") == 3
        served = [i for i, x in enumerate(op_log) if x == "served"]
        assert max(i for i, x in enumerate(op_log) if x == "time") < min(served)
        assert max(served) < min(i for i, x in enumerate(op_log) if x in ("memcpy", "host", "gemm", "hbm", "beside"))


def test_gemm_rows_carry_the_ops_own_ratio_beside_the_gemm(fake_gpu):
    """``--gemm``: the ops a GEMM slowdown is measured for also carry their own ratio while GEMMs run beside them
    (bytes over the median time beside the GEMM, against the same memcpy reference); the others neither."""
    rows = bench.run_bench(shapes=["cpu-tiny"], tokens=[TOKENS], page_sizes=[PAGE], programs=[None],
                           layouts=["layer_first"], backends=["reference"], ops=list(bench.OPS), reps=4, gemm=True)
    assert {r.op for r in rows} == set(bench.OPS)
    for r in rows:
        if r.op in bench.GEMM_OPS:
            assert r.gemm_slowdown == 0.01 and r.gemm_ratio == pytest.approx(r.bytes / 8e6 / 50.0)
            assert f"ratio beside gemm {r.gemm_ratio:.3f}" in bench.run._line(r)
        else:
            assert r.gemm_slowdown is None and r.gemm_ratio is None and "beside gemm" not in bench.run._line(r)


def test_row_fields_agree(fake_gpu):
    rows = bench.run_bench(shapes=["cpu-tiny"], tokens=[TOKENS], page_sizes=[PAGE], programs=[None],
                           layouts=["layer_first"], backends=["reference"], ops=list(bench.OPS), reps=4, hbm=True)
    spec = bench.SHAPES[SHAPE](TOKENS, PAGE, torch.device("cpu"))
    whole = spec.bytes_per_token * TOKENS
    assert {r.op: r.bytes for r in rows} == {"backup_all_layers": whole, "backup_layer": whole // 32,
                                             "load_layer": whole // 32, "load_all_layers": whole, "load_burst": whole,
                                             "backup_burst": whole}
    for r in rows:
        assert r.ms == 2.0 and r.gbps == pytest.approx(r.bytes / 2e6) and r.ratio == pytest.approx(r.gbps / 50.0)
        assert r.memcpy_gbps == 50.0 and r.host_us == 30.0 and r.gemm_slowdown is None and r.gemm_ratio is None
        if r.op in bench.GEMM_OPS + bench.HBM_LONE_OPS:
            assert r.hbm_ratio == pytest.approx(r.bytes / 4e6 / 50.0)
            assert r.hbm_slowdown == (None if r.op in bench.HBM_LONE_OPS else 0.02)
        else:
            assert r.hbm_ratio is None and r.hbm_slowdown is None


@pytest.mark.parametrize("backend,opts,want", [("kernel", None, "grid"), ("kernel", {"programs": 2}, 2),
                                                ("direct", None, None), ("reference", None, None)])
def test_served_by_names_the_programs_the_call_launched(cell, backend, opts, want):
    """A row at the default budget records what the default launched (rows stored programs=null), an explicit
    budget what it launched (capped by work), a strategy with no row kernel None."""
    _, dev, h, s, d = cell
    device = torch.device(pool_device(backend))
    spec = bench.SHAPES[SHAPE](TOKENS, PAGE, device)
    dev = {name: [t.to(device) for t in layers] for name, layers in dev.items()}
    h, s, d = h.to(device), s.to(device), d.to(device)
    reg = create_registry()
    host = allocate_host_buffers(reg.layout("layer_first").plan(spec), pin_memory=device.type == "cuda")
    p = HostKVPool(spec, "layer_first", backend, dev, host_buffers=host, registry=reg, validate="shapes",
                   strategy_options=opts)
    for layer, to_host, idx in ((None, True, s), (3, False, d)):
        name, launched = bench._served_by(p, h, idx, layer, to_host)
        assert name == p.strategy_name
        if want == "grid":
            assert launched == p.strategy.launch_grid(p.binding, h.numel(), layer, to_host=to_host) > 0
        else:
            assert launched == want


def test_served_by_names_auto_s_kernel_for_lone_loads():
    """Loads auto's lone-load rule gave its kernel are named for that candidate and its grid, not for the pair's
    memoised pick (the copy engine here); a strategy without candidates is named as before."""
    kernel = types.SimpleNamespace(launch_grid=lambda binding, n, layer, to_host: 4)
    direct = types.SimpleNamespace()
    auto = types.SimpleNamespace(pick=lambda *a, **k: direct, kernel=kernel, direct=direct, kernel_name="lf.kernel",
                                 paces=None, warm_paces=None)
    pool = types.SimpleNamespace(strategy=auto, binding=None, strategy_name="core.auto")
    h = torch.arange(8)
    assert bench._served_by(pool, h, h, 3, False) == ("direct", None)
    assert bench._served_by(pool, h, h, 3, False, lone=True) == ("lf.kernel", 4)
    plain = types.SimpleNamespace(strategy=types.SimpleNamespace(kernel=kernel), binding=None, strategy_name="x")
    assert bench._served_by(plain, h, h, 3, False, lone=True) == ("x", None)


def test_tables_keep_the_default_budget_beside_explicit_ones(tmp_path, capsys):
    """benchmarks/tables.py: rows of the strategy's default budget (programs null) get their own column next to
    explicit budgets (they were dropped whenever a file held both)."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "tables.py"
    spec = importlib.util.spec_from_file_location("hicache_bench_tables", path)
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    row = {"io_backend": "kernel", "shape": "mla61x576-bf16", "layout": "layer_first", "page_size": 64,
           "tokens": 4096, "op": "load_layer", "bytes": 4_718_592, "host_us": 9.0, "gemm_slowdown": 0.01}
    rows = [{**row, "programs": None, "ratio": 0.87}, {**row, "programs": 4, "ratio": 0.86}]
    f = tmp_path / "bench.json"
    f.write_text(json.dumps({"rows": rows}))
    assert tables.main([str(f)]) == 0
    out = capsys.readouterr().out
    assert "| P=default | P=4 |" in out and "| 0.87 (9 us, GEMM +1%) | 0.86 (9 us, GEMM +1%) |" in out
    rows[0]["launched_programs"] = 8
    rows[1]["launched_programs"] = 4
    f.write_text(json.dumps({"rows": rows}))
    assert tables.main([str(f)]) == 0
    assert "| 0.87 (9 us, GEMM +1%, 8 programs) | 0.86 (9 us, GEMM +1%) |" in capsys.readouterr().out


def test_the_lone_load_label_counts_the_calls_it_was_counted_over(fake_gpu, monkeypatch):
    """The lone-load count spans the warm-up calls too: the label says over how many calls it was counted."""
    from hicache_core.backends.reference import ReferenceStrategy

    real_load = ReferenceStrategy.load

    def load(self, *a, **k):
        self.lone_kernel_loads = getattr(self, "lone_kernel_loads", 0) + 1
        return real_load(self, *a, **k)

    monkeypatch.setattr(ReferenceStrategy, "load", load)
    monkeypatch.setattr(bench.timing, "_samples_ms", calling_samples_ms)
    (row,) = bench.run_bench(shapes=["cpu-tiny"], tokens=[TOKENS], page_sizes=[PAGE], programs=[None],
                             layouts=["layer_first"], backends=["reference"], ops=["load_layer"], reps=4)
    calls = 4 + bench.WARMUP + 2  # three rounds (2, 1, 1 timed calls), the later two after one warm-up call each
    assert row.served_by == f"who ({calls} lone loads by the kernel in {calls} calls)"


@pytest.mark.parametrize("host_ms, expect_calls", [(2.0, 5), (0.01, None)])
def test_keep_busy_keeps_the_transfer_stream_fed_through_the_window(host_ms, expect_calls):
    """GEMM windows beside a transfer: transfers queued before the window alone drain early where the host's time
    per call nears the GPU's (one-layer copy-engine loads), leaving part of the window alone.  _keep_busy issues
    more until the window ends, as fast as the host can when it is slow, and never more than a call ahead of the
    host's clock when it is fast (simulated clock, in seconds; window ends at 10 ms; 1 ms of GPU time per call)."""
    clock = [0.0]
    issued = []

    def transfer():
        clock[0] += host_ms * 1e-3
        issued.append(clock[0])

    def done():
        clock[0] += 0.1e-3  # polling takes host time too
        return clock[0] >= 10e-3

    head = 2
    calls = bench._keep_busy(transfer, done, head * 1.0, 1.0, 0.0, now=lambda: clock[0])
    assert calls == len(issued)
    queued_ms = head + calls
    elapsed_ms = clock[0] * 1e3
    if expect_calls is not None:  # the slow host: a call every time it can (the stream has run dry since 2 ms)
        assert calls == expect_calls
    else:  # the fast host: the queue keeps at most a call ahead of the clock, and never falls behind it by a call
        assert elapsed_ms - 1.0 <= queued_ms <= elapsed_ms + 2.0
        gaps = [b - a for a, b in zip(issued, issued[1:])]
        assert all(g >= 0.9e-3 for g in gaps)  # paced by the clock, not piled up


def test_timed_calls_move_the_bytes_each_row_says_they_move(cell):
    """Each op's call moves what its row reports: the burst loads every owned layer once, backups write the host rows
    ``h`` from the device rows ``s``, loads write the device rows ``d`` from ``h``; byte counts and layers match."""
    make, dev, h, s, d = cell
    pool = make()
    spec = pool.spec
    owned = spec.layer_map.device_layers
    bursts, calls = bench._timed_calls(pool, TOKENS, h, s, d)
    assert {op: len(b) for op, b in bursts.items()} == {"load_burst": len(owned), "backup_burst": len(owned)}
    per_layer = spec.bytes_per_token // len(owned) * TOKENS
    assert {op: (n, to_host, lay) for op, (_, n, to_host, lay) in calls.items()} == {
        "backup_all_layers": (spec.bytes_per_token * TOKENS, True, None),
        "backup_layer": (per_layer, True, owned[len(owned) // 2]),
        "load_layer": (per_layer, False, owned[len(owned) // 2]),
        "load_all_layers": (spec.bytes_per_token * TOKENS, False, None),
        "load_burst": (spec.bytes_per_token * TOKENS, False, owned[len(owned) // 2]),
        "backup_burst": (spec.bytes_per_token * TOKENS, True, owned[len(owned) // 2]),
    }
    calls["backup_all_layers"][0]()
    rest = torch.ones(len(next(iter(dev.values()))[0]), dtype=torch.bool)
    rest[s], rest[d] = False, False
    canaries = {}
    bits = {(name, lay): t.view(torch.int16) if t.element_size() == 2 else t.view(torch.uint8)  # random bf16 has NaNs
            for name, layers in dev.items() for lay, t in enumerate(layers)}
    for key, b in bits.items():
        b[d] = b[s].bitwise_not()  # the load targets differ from the sources everywhere
        canaries[key] = b[rest].clone()
    calls["load_burst"][0]()
    for key, b in bits.items():
        assert torch.equal(b[d], b[s]) and torch.equal(b[rest], canaries[key]), key
    assert int(rest.sum()) > 0
    # one layer, then all of them: load_layer restores the middle layer alone, load_all_layers every layer
    middle = calls["load_layer"][3]
    for b in bits.values():
        b[d] = b[s].bitwise_not()
    calls["load_layer"][0]()
    for (name, lay), b in bits.items():
        assert torch.equal(b[d], b[s] if lay == middle else b[s].bitwise_not()), (name, lay)
    calls["load_all_layers"][0]()
    for key, b in bits.items():
        assert torch.equal(b[d], b[s]) and torch.equal(b[rest], canaries[key]), key
    def through_host(backup: str) -> None:
        """Zero the host, run op ``backup``, then load every layer from the host into the scrambled rows ``d``."""
        for t in pool.binding.host_buffers.values():
            t.zero_()
        calls[backup][0]()
        for b in bits.values():
            b[d] = b[s].bitwise_not()
        calls["load_all_layers"][0]()

    # a backup of one layer writes that layer's host rows alone, the middle layer first; each later call backs up the
    # next owned layer, round the pool
    ring = list(owned)
    following = ring[ring.index(middle) + 1:] + ring[:ring.index(middle)] + [middle]
    for count, newest in enumerate([middle] + following, start=1):
        through_host("backup_layer")
        for (name, lay), b in bits.items():
            assert torch.equal(b[d], b[s] if lay == newest else torch.zeros_like(b[s])), (name, lay, count)
    # the backup burst writes every layer's host rows, one backup_layer each
    through_host("backup_burst")
    for key, b in bits.items():
        assert torch.equal(b[d], b[s]) and torch.equal(b[rest], canaries[key]), key


def test_pace_probe_profiles_are_written_per_candidate_both_ways(tmp_path):
    """benchmarks/pace_probe.py --profile: one file per cell, each candidate's profile by own and cumulative time."""
    import cProfile

    from benchmarks import pace_probe

    profs = {}
    for name in ("direct", "auto"):
        profs[name] = cProfile.Profile()
        profs[name].enable()
        sorted(range(100), key=lambda x: -x)
        profs[name].disable()
    path = tmp_path / "deep" / "pace-profile-x-y-reuse.txt"
    pace_probe._write_profiles(profs, path)
    text = path.read_text()
    heads = [line for line in text.splitlines() if line.startswith("=====")]
    assert heads == ["===== direct, by tottime =====", "===== direct, by cumtime =====",
                     "===== auto, by tottime =====", "===== auto, by cumtime ====="]
    assert text.count("<lambda>") >= 4  # the profiled function is listed in each table


def test_pace_probe_counts_what_the_load_lane_served_and_left_to_the_normal_path(cell):
    """benchmarks/pace_probe.py counts, per pool, the one-layer loads its lane served and those it declined; the counted
    lane passes each call's answer through, and a pool without a load lane counts nothing."""
    from benchmarks import pace_probe

    pool = cell[0]()
    answers = iter([False, True])
    seen = []

    def lane(layer, h, d):  # type: ignore[no-untyped-def]
        seen.append(layer)
        return next(answers)

    pool._lanes = (lane, pool._lanes[1])
    counts = pace_probe._count_lane(pool)
    h = torch.arange(2, dtype=torch.int64)
    assert pool._lanes[0](0, h, h) is False and pool._lanes[0](1, h, h) is True
    assert (counts["served"], counts["declined"]) == (1, 1) and counts["ns"] > 0 and seen == [0, 1]
    pool._lanes = (None, None)
    assert pace_probe._count_lane(pool) == dict.fromkeys(("served", "declined", "ns", "eager", "submits"), 0)
    assert pool._lanes == (None, None)


def test_pace_probe_lane_detail_counts_inside_an_auto_pools_lane_and_keeps_its_bytes(cell):
    """--lane-detail: an auto pool's lanes are rebuilt with counting candidate lanes inside; the normal path's picks are
    counted by candidate; loads still move the right bytes, and the counts add up to the calls made.  Backups through
    the pool (the probe backs up every cycle) reach no load counter; the copier's eager answers are counted."""
    from benchmarks import pace_probe

    _, dev, h, s, d = cell
    reg = create_registry()
    spec = bench.SHAPES[SHAPE](TOKENS, PAGE, torch.device("cpu"))
    host = allocate_host_buffers(reg.layout("layer_first").plan(spec), pin_memory=False)
    pool = HostKVPool(spec, "layer_first", "auto", dev, host_buffers=host, registry=reg, validate="shapes")
    pool.strategy.kernel = None  # direct alone: its lane serves a pair's later bursts (the kernel has no lane on CPU)
    inner = pace_probe._count_inner(pool)
    outer = pace_probe._count_lane(pool)
    for _ in range(2):
        pool.backup_all_layers(h, s)
    assert inner["direct_lane"] == 0 and outer["served"] + outer["declined"] == 0  # backups: no load counter moved
    picked = inner["picked_direct"] + inner["picked_kernel"]
    layers = list(spec.layer_map.device_layers)
    for _ in range(2):
        for layer in layers:
            pool.load_layer(layer, h, d)
    assert outer["served"] + outer["declined"] == 2 * len(layers)
    assert outer["served"] > 0 and inner["direct_lane"] + inner["kernel_lane"] > 0  # the lanes ran, through the counters
    assert inner["picked_direct"] + inner["picked_kernel"] - picked == outer["declined"]  # the normal path picks once
    assert inner["direct_lane"] + inner["kernel_lane"] <= 2 * len(layers)
    assert inner["direct_lane_declined"] <= inner["direct_lane"]
    assert outer["served"] == (inner["direct_lane"] - inner["direct_lane_declined"]
                               + inner["kernel_lane"] - inner["kernel_lane_declined"])
    bench._check(pool, dev, h, s, d)
    clock = pool.binding.scratch["direct.copier"].clock
    before = dict(outer)
    assert clock.eager(5, 1.0) is True and clock.eager(5, 1.0) is True  # nothing queued on stream 5: eager
    assert (outer["eager"] - before["eager"], outer["submits"] - before["submits"]) == (2, 2)


def test_pace_probe_lane_detail_puts_the_same_counting_layer_in_every_pools_lane(cell):
    """--lane-detail: a pool that is not auto's gets one counting layer around its own load lane, the one auto's
    candidates' lanes get inside auto's (so no pool alone pays its host time); it passes each answer and what auto
    would hand on through, and counts calls, declines and time; a pool without a load lane is left alone."""
    from benchmarks import pace_probe

    pool = cell[0]()
    answers = iter([False, True])
    seen = []

    def lane(layer, h, d, *rest):  # type: ignore[no-untyped-def]
        seen.append((layer, rest))
        return next(answers)

    setattr(lane, "takes_since", True)
    pool._lanes = (lane, pool._lanes[1])
    own = pace_probe._count_own(pool)
    outer = pace_probe._count_lane(pool)
    h = torch.arange(2, dtype=torch.int64)
    assert pool._lanes[0](0, h, h) is False and pool._lanes[0](1, h, h) is True
    assert (own["own_lane"], own["own_lane_declined"]) == (2, 1) and own["own_lane_ns"] > 0
    assert (outer["served"], outer["declined"]) == (1, 1) and seen == [(0, ()), (1, ())]
    counted = pace_probe._counting(lane, {"x_lane": 0, "x_lane_declined": 0, "x_lane_ns": 0}, "x")
    answers = iter([True])
    assert counted(2, h, h, 7.0, 0x55) is True and seen[-1] == (2, (7.0, 0x55))  # auto's since and stream pass on
    assert getattr(counted, "takes_since") is True
    pool._lanes = (None, None)
    assert pace_probe._count_own(pool) == dict.fromkeys(("own_lane", "own_lane_declined", "own_lane_ns"), 0)
    assert pool._lanes == (None, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_memcpy_reference_is_the_best_of_its_tries_and_cached(monkeypatch):
    """On a GPU (for the pinned and device buffers): the memcpy every ratio of a cell divides by is the fastest of
    ``_Memcpy.TRIES`` medians (the first 4x slower, as a passing disturbance would make it), measured once per size
    and direction.  The medians are scripted: nothing is timed."""
    medians, timed = iter([0.0625, 0.08, 0.1, 1.0, 1.0, 1.0]), []  # the fastest is neither the first nor the last

    def disturbed(fn, reps, *args, **kw):
        timed.append(next(medians))
        return timed[-1] * 4 if len(timed) == 1 else timed[-1]

    monkeypatch.setattr(bench.timing, "_median_ms", disturbed)
    memcpy, nbytes = bench._Memcpy(), 4 << 20
    first = memcpy.gbps(nbytes, True, 3)
    assert len(timed) == bench._Memcpy.TRIES and first == nbytes / min(4 * timed[0], *timed[1:]) / 1e6
    assert memcpy.gbps(nbytes, True, 3) == first and len(timed) == bench._Memcpy.TRIES  # cached
    memcpy.gbps(nbytes, False, 3)
    assert len(timed) == 2 * bench._Memcpy.TRIES  # the other direction is its own measure


def test_every_pace_probe_variant_is_a_valid_auto_and_every_optional_one_has_a_tag():
    """benchmarks/pace_probe.py's candidates: each label's options make an ``auto`` (a bad option would fail on the
    GPU, after the machine started), and each optional label has its summary tag."""
    from benchmarks import pace_probe

    from hicache_core.backends.auto import AutoStrategy

    for label, options in pace_probe.VARIANTS.items():
        AutoStrategy(**options)  # type: ignore[arg-type]
        assert label == "auto" or label in pace_probe.TAGS, label
    assert set(pace_probe.TAGS) <= set(pace_probe.VARIANTS)
    assert pace_probe.VARIANTS["auto reprobe"].get("reprobe") is True


def test_decision_cost_times_new_pairs_decided_for_the_kernel_without_a_plan(tmp_path):
    """benchmarks/decision_cost.py: both paths decide every new pair (for the kernel, no probe, no plan: checked by
    the script itself) and the figures are written (timings are not checked)."""
    from benchmarks import decision_cost

    out = tmp_path / "decision.json"
    assert decision_cost.main(["--calls", "3", "--rounds", "1", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert {"gpu_indices_us", "gpu_indices_tensor_us", "cpu_indices_us", "cpu_indices_tensor_us"} <= set(got)
    assert all(got[k] > 0 for k in ("gpu_indices_us", "cpu_indices_us"))
    with pytest.raises(SystemExit):
        decision_cost.main(["--rounds", "0"])


def test_lane_cost_times_the_lanes_through_direct_and_a_lone_load_and_restores_what_it_replaced(tmp_path):
    """benchmarks/lane_cost.py: each lane submits through direct once before it is timed (the lone load through the
    stand-in kernel's lane), the figures are written, and the copier's copy and auto's stream lookup are put back
    (timings are not checked)."""
    from benchmarks import lane_cost

    from hicache_core.backends import auto as auto_mod
    from hicache_core.backends.memcpy import BatchCopier

    copy, handle = BatchCopier.copy, auto_mod.current_stream_handle
    out = tmp_path / "lane.json"
    assert lane_cost.main(["--calls", "3", "--rounds", "1", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert {"direct_us", "auto_us", "auto clocked_us", "auto_extra_us", "auto_clocked_extra_us", "kernel_us",
            "auto_lone_us", "auto_lone_extra_us"} <= set(got)  # the lone load: checked to reach the kernel's lane
    assert all(got[k] > 0 for k in ("direct_us", "auto_us", "auto clocked_us", "kernel_us", "auto_lone_us"))
    assert BatchCopier.copy is copy and auto_mod.current_stream_handle is handle
    with pytest.raises(SystemExit):
        lane_cost.main(["--calls", "0"])
