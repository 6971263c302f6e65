"""CPU tests of ``hicache bench`` timing a layout's configurations in turns (hicache_core/bench/): how the timed calls
are split and ordered, that every pool of a layout is built over the same host buffers and checked before any is
timed, the rows' order, and the ``--rounds`` option.  The clocks are fakes: nothing here times anything."""

from __future__ import annotations

import pytest
import torch

from hicache_core import bench
from test_bench_review import fake_gpu  # noqa: F401  (the fixture: run_bench on the CPU with recording fakes)
from test_bench_review import CPU_KERNELS, PAGE, TOKENS, calling_samples_ms


def _recording_samples(monkeypatch):
    """``timing._samples_ms`` replaced: each call of it records (what the function returned, timed calls, warm-up
    calls) and gives its calls the number of the record as their milliseconds."""
    calls: list[tuple[str, int, int]] = []

    def samples(fn, reps, warmup=bench.WARMUP, idle=False, before=None):
        calls.append((fn(), reps, warmup))
        return [float(len(calls))] * reps
    monkeypatch.setattr(bench.timing, "_samples_ms", samples)
    return calls


def test_in_turns_splits_each_target_s_calls_over_the_rounds_each_round_in_its_own_order(monkeypatch):
    calls = _recording_samples(monkeypatch)
    times, made = bench._in_turns([lambda: "a", lambda: "b", lambda: "c"], 7, 3)
    # shares 3, 2, 2; orders abc, cba, bca; the first round after the full warm-up, the others after one call
    assert calls == [("a", 3, 3), ("b", 3, 3), ("c", 3, 3), ("c", 2, 1), ("b", 2, 1), ("a", 2, 1), ("b", 2, 1),
                     ("c", 2, 1), ("a", 2, 1)]
    assert times == [[1.0] * 3 + [6.0] * 2 + [9.0] * 2, [2.0] * 3 + [5.0] * 2 + [7.0] * 2,
                     [3.0] * 3 + [4.0] * 2 + [8.0] * 2]
    assert made == [3 + 3 + 1 + 2 + 1 + 2] * 3


def test_in_turns_with_fewer_calls_than_rounds_skips_the_empty_rounds(monkeypatch):
    calls = _recording_samples(monkeypatch)
    times, made = bench._in_turns([lambda: "a", lambda: "b"], 2, 4)
    assert calls == [("a", 1, 3), ("b", 1, 3), ("b", 1, 1), ("a", 1, 1)]
    assert [len(t) for t in times] == [2, 2] and made == [6, 6]


@pytest.mark.parametrize("reps, rounds", [(0, 3), (5, 0)])
def test_in_turns_refuses_no_calls_or_no_rounds(reps, rounds):
    with pytest.raises(ValueError, match=r"reps \(\d\) and rounds \(\d\) must be at least 1"):
        bench._in_turns([lambda: None], reps, rounds)
    with pytest.raises(ValueError, match="must be at least 1"):
        bench.run_bench(shapes=[next(iter(bench.SHAPES))], tokens=[64], page_sizes=[64], programs=[None], reps=reps,
                        rounds=rounds)


@CPU_KERNELS
def test_a_layout_s_pools_share_one_host_allocation_and_are_all_checked_before_any_is_timed(
        fake_gpu, monkeypatch):  # noqa: F811
    allocated, checked = [], []
    real_alloc, real_check = bench.run.allocate_host_buffers, bench.workload._check

    def alloc(plan, pin_memory):
        fake_gpu.append("alloc")
        allocated.append(real_alloc(plan, pin_memory))
        return allocated[-1]

    def check(pool, *a, **k):
        fake_gpu.append("check")
        checked.append(pool)
        return real_check(pool, *a, **k)
    monkeypatch.setattr(bench.run, "allocate_host_buffers", alloc)
    monkeypatch.setattr(bench.workload, "_check", check)
    rows = bench.run_bench(shapes=["cpu-tiny"], tokens=[TOKENS], page_sizes=[PAGE], programs=[None, 2],
                           layouts=["layer_first", "page_first"], backends=["reference", "kernel"],
                           ops=["backup_all_layers", "load_layer"], reps=3, rounds=3)
    assert len(allocated) == 2 and len(checked) == 6  # per layout: one allocation, three pools
    for layout, pools, host in (("layer_first", checked[:3], allocated[0]), ("page_first", checked[3:], allocated[1])):
        assert {p.layout for p in pools} == {layout}
        for p in pools:
            assert {k: v.data_ptr() for k, v in p.host_buffers.items()} == {k: v.data_ptr() for k, v in host.items()}
    # per layout: its allocation, its three checks, then its two operations' timed calls (three rounds each)
    steps = [x for x in fake_gpu if x in ("alloc", "check", "time")]
    per_layout = ["alloc"] + ["check"] * 3 + ["time"] * 18
    assert steps == per_layout * 2
    # rows: layout by layout, operation by operation, the pools in the order they were built
    assert [(r.layout, r.op, r.io_backend, r.programs) for r in rows] == [
        (layout, op, backend, budget) for layout in ("layer_first", "page_first")
        for op in ("backup_all_layers", "load_layer") for backend, budget in (("reference", None), ("kernel", None),
                                                                              ("kernel", 2))]


def test_a_target_s_speed_is_the_median_of_all_its_rounds(fake_gpu, monkeypatch):  # noqa: F811
    clock = iter(range(1, 100))

    def samples(fn, reps, warmup=bench.WARMUP, **kw):
        fn()
        return [float(next(clock)) for _ in range(reps)]
    monkeypatch.setattr(bench.timing, "_samples_ms", samples)
    (row,) = bench.run_bench(shapes=["cpu-tiny"], tokens=[TOKENS], page_sizes=[PAGE], programs=[None],
                             layouts=["layer_first"], backends=["reference"], ops=["load_layer"], reps=5, rounds=2)
    assert row.ms == 3.0  # rounds of 3 and 2 calls: 1, 2, 3 then 4, 5


def test_the_rounds_option_reaches_run_bench_and_must_be_positive(monkeypatch, tmp_path, capsys):
    seen = {}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake")
    monkeypatch.setattr(bench.command, "write_json", lambda path, data: seen.update(meta=data["meta"]))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: type("P", (), {"multi_processor_count": 1}))
    def run_bench(**kw):
        seen.update(kw)
        kw["sink"](bench.BenchRow("s", "layer_first", "reference", "r", 64, 64, None, "load_layer", 1, 1.0, 1.0, 1.0,
                                  1.0, 1.0))
        return []
    monkeypatch.setattr(bench.run, "run_bench", run_bench)
    monkeypatch.setattr(bench.command, "plot", lambda rows, path: True)
    args = ["--out", str(tmp_path), "--tokens", "64", "--page-sizes", "64", "--layouts", "layer_first",
            "--io-backends", "reference"]
    assert bench.main(args + ["--rounds", "5", "--reps", "7"]) == 0
    assert seen["rounds"] == 5 and (seen["meta"]["rounds"], seen["meta"]["reps"]) == (5, 7)  # the file says how
    seen.clear()
    assert bench.main(args) == 0
    assert seen["rounds"] == seen["meta"]["rounds"] == bench.DEFAULT_ROUNDS == 3
    with pytest.raises(SystemExit):
        bench.main(args + ["--rounds", "0"])
    assert "--rounds" in capsys.readouterr().err


def test_a_cell_s_device_buffers_are_dropped_before_the_next_cell_allocates_its_own(fake_gpu, monkeypatch):  # noqa: F811
    import weakref

    first: list[weakref.ref] = []
    alive_at_second: list[bool] = []
    real = bench.workload._device_buffers

    def device_buffers(spec, rows, placement=None):
        if first:  # the second cell: the first cell's buffers must be gone by now
            import gc
            gc.collect()
            alive_at_second.append(first[0]() is not None)
        out = real(spec, rows, placement)
        if not first:
            first.append(weakref.ref(next(t for ts in out.values() for t in ts if t is not None)))
        return out
    monkeypatch.setattr(bench.workload, "_device_buffers", device_buffers)
    bench.run_bench(shapes=["cpu-tiny"], tokens=[TOKENS, 2 * TOKENS], page_sizes=[PAGE], programs=[None],
                    layouts=["layer_first"], backends=["reference"], ops=["load_layer"], reps=1, rounds=1)
    assert alive_at_second == [False]


def test_the_lone_load_label_of_a_burst_counts_its_one_layer_loads(fake_gpu, monkeypatch):  # noqa: F811
    """lone_kernel_loads counts one-layer loads: a burst row compares them with the one-layer loads it made."""
    from hicache_core.backends.reference import ReferenceStrategy

    real_load = ReferenceStrategy.load
    seen: list[int] = []

    def load(self, binding, h, d, layer=None):  # the first layer of every burst counted as a lone load
        if layer == binding.spec.layer_map.device_layers[0]:
            self.lone_kernel_loads = getattr(self, "lone_kernel_loads", 0) + 1
        return real_load(self, binding, h, d, layer)

    monkeypatch.setattr(ReferenceStrategy, "load", load)
    monkeypatch.setattr(bench.timing, "_samples_ms", calling_samples_ms)
    monkeypatch.setattr(bench.run, "_served_by", lambda *a, lone=False, **k: seen.append(lone) or ("who", None))
    (row,) = bench.run_bench(shapes=["cpu-tiny"], tokens=[TOKENS], page_sizes=[PAGE], programs=[None],
                             layouts=["layer_first"], backends=["reference"], ops=["load_burst"], reps=4, rounds=1)
    bursts = 4 + bench.WARMUP
    layers = len(bench.SHAPES["cpu-tiny"](TOKENS, PAGE, torch.device("cpu")).layer_map.device_layers)
    assert row.served_by == f"who ({bursts} lone loads by the kernel in {bursts * layers} calls)"
    assert seen == [False]  # one load in 32 was lone: the row is not credited to the lone-load rule


@CPU_KERNELS
def test_one_pool_each_refuses_two_pools_of_one_layout_timed_together(fake_gpu):  # noqa: F811
    """The check pace_trace.py and knob_ab.py put on each run_bench call, which must build one pool per layout."""
    one = bench.run_bench(shapes=["cpu-tiny"], tokens=[TOKENS], page_sizes=[PAGE], programs=[None],
                          layouts=["layer_first", "page_first"], backends=["reference"], ops=["load_layer"], reps=1)
    assert bench._one_pool_each(one) == one and len(one) == 2
    two = bench.run_bench(shapes=["cpu-tiny"], tokens=[TOKENS], page_sizes=[PAGE], programs=[None, 2],
                          layouts=["layer_first"], backends=["kernel"], ops=["load_layer"], reps=1)
    with pytest.raises(RuntimeError, match="two pools timed together .*'layer_first', 'load_layer'.*P=default and .*P=2"):
        bench._one_pool_each(two)


def test_in_turns_takes_a_count_per_function_and_can_leave_out_one_that_fails(monkeypatch):
    calls = _recording_samples(monkeypatch)
    real = bench.timing._samples_ms
    at_once = [False]  # b raises from its first call, else from its second round

    def samples(fn, reps, warmup=bench.WARMUP, **kw):
        if fn() == "b" and (at_once[0] or len(calls) >= 3):
            raise RuntimeError("b broke")
        return real(fn, reps, warmup)
    monkeypatch.setattr(bench.timing, "_samples_ms", samples)
    failed: dict[int, Exception] = {}
    times, made = bench._in_turns([lambda: "a", lambda: "b", lambda: "c"], [4, 2, 1], 2, failed)
    # shares a: 2, 2; b: 1, 1 (its second round raises); c: 1, 0; round two in reverse order
    assert calls == [("a", 2, 3), ("b", 1, 3), ("c", 1, 3), ("a", 2, 1)]
    assert list(failed) == [1] and str(failed[1]) == "b broke"
    assert [len(t) for t in times] == [4, 1, 1] and made == [8, 4, 4]
    at_once[0] = True
    with pytest.raises(RuntimeError, match="b broke"):  # without ``failed`` the exception propagates
        bench._in_turns([lambda: "a", lambda: "b"], 2, 2)
    with pytest.raises(ValueError, match="reps gives 2 counts for 3 functions"):
        bench._in_turns([lambda: "a"] * 3, [1, 1], 2)


@CPU_KERNELS
def test_variants_builds_only_the_configurations_named(fake_gpu, monkeypatch):  # noqa: F811
    allocated = []
    real_alloc = bench.run.allocate_host_buffers
    monkeypatch.setattr(bench.run, "allocate_host_buffers",
                        lambda plan, pin_memory: allocated.append(plan) or real_alloc(plan, pin_memory))
    rows = bench.run_bench(shapes=["cpu-tiny"], tokens=[TOKENS], page_sizes=[PAGE], programs=[None, 2],
                           layouts=["layer_first"], backends=["reference", "kernel"], variants=["P=2"],
                           ops=["load_layer"], reps=1)
    assert [(r.io_backend, r.variant, r.programs) for r in bench._one_pool_each(rows)] == [("kernel", "P=2", 2)]
    assert len(allocated) == 1
    assert bench.run_bench(shapes=["cpu-tiny"], tokens=[TOKENS], page_sizes=[PAGE], programs=[None],
                           layouts=["layer_first"], backends=["reference"], variants=["none such"],
                           ops=["load_layer"], reps=1) == []
    assert len(allocated) == 1  # no pool to build: no host buffers either


def test_a_memcpy_reference_passed_in_serves_every_call_and_no_other_is_made(fake_gpu, monkeypatch):  # noqa: F811
    """pace_trace.py and knob_ab.py make one run_bench call per pool: one reference passed to each gives their ratios
    one baseline; without it each call makes its own."""
    made = []
    real = bench.timing._Memcpy
    monkeypatch.setattr(bench.timing, "_Memcpy", lambda: made.append(1) or real())

    class Reference:
        def __init__(self):
            self.asked = []

        def gbps(self, nbytes, to_host, reps):
            self.asked.append((nbytes, to_host))
            return 40.0 if to_host else 25.0
    ref = Reference()
    rows = []
    for layout in ("layer_first", "page_first"):
        rows += bench.run_bench(shapes=["cpu-tiny"], tokens=[TOKENS], page_sizes=[PAGE], programs=[None],
                                layouts=[layout], backends=["reference"], ops=["backup_all_layers", "load_layer"],
                                reps=1, memcpy=ref)
    assert made == [] and len(rows) == 4
    assert sorted({to_host for _, to_host in ref.asked}) == [False, True]
    assert all(r.memcpy_gbps == (40.0 if r.op.startswith("backup") else 25.0) for r in rows)
    bench.run_bench(shapes=["cpu-tiny"], tokens=[TOKENS], page_sizes=[PAGE], programs=[None], layouts=["layer_first"],
                    backends=["reference"], ops=["load_layer"], reps=1)
    assert made == [1]  # no reference passed: the call made its own


def test_pace_trace_and_knob_ab_hand_one_memcpy_reference_to_every_run_bench_call(monkeypatch, tmp_path):
    import sys

    from benchmarks import knob_ab, pace_trace
    from hicache_core.backends import auto as auto_mod
    from hicache_core.backends import memcpy
    from hicache_core.backends.pace import HostPace
    # what the probes replace for the whole process, put back after the test
    for owner, name in ((memcpy.QueueClock, "eager"), (memcpy.BatchCopier, "copy"), (HostPace, "record"),
                        (auto_mod.AutoStrategy, "_decide"), (bench.run.HostKVPool, "__init__"),
                        (bench.timing, "_samples_ms"), (bench.timing, "_gemm_slowdown"),
                        (bench.timing, "_burst_host_us"), (bench.timing, "_host_us"), (bench.workload, "_check"),
                        (bench.run, "_served_by"), (memcpy, "TIGHT_GAP_US")):
        monkeypatch.setattr(owner, name, getattr(owner, name))
    refs = []
    monkeypatch.setattr(bench, "run_bench", lambda **kw: refs.append(kw.get("memcpy")) or [])
    monkeypatch.setattr(bench, "_one_pool_each", lambda rows: rows)
    for probe, argv in ((knob_ab, ["--knob", "hicache_core.backends.memcpy:TIGHT_GAP_US", "--values", "20,50",
                                   "--rounds", "2", "--shapes", "cpu-tiny", "--backends", "direct,auto"]),
                        (pace_trace, ["--io-backends", "direct,auto"])):
        refs.clear()
        monkeypatch.setattr(probe, "require_cuda", lambda path: None)
        monkeypatch.setattr(sys, "argv", [probe.__name__, "--out", str(tmp_path / "out.json"), *argv])
        assert probe.main() == 0
        assert len(refs) > 2 and isinstance(refs[0], bench.timing._Memcpy) and all(r is refs[0] for r in refs)
