"""The strategies ``benchmarks/backup_place_probe.py`` times beside the plugins' own (the kernels as they were before
the page size became a constexpr, and ``page_first_kv_split`` walking layer-major): bit-exact against the reference,
canaries untouched, through the probe's own kernels.  A probe whose variant moved the wrong bytes would time a
kernel that is not the one it names; on the GPU the probe checks each variant again before timing it.  On CPU the
kernels run in Triton's interpreter."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest  # noqa: E402

from benchmarks import backup_place_probe as probe  # noqa: E402
from hicache_core import kernel_lib as kl  # noqa: E402
from hicache_core.registry import create_registry  # noqa: E402
from hicache_core.testing.conformance import CASES, check_strategy  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
REGISTRY = create_registry(plugins=[("probe", probe._Plugin())])
CASE = {c.id: c for c in CASES}


@pytest.mark.parametrize("strategy,layout,want", [
    ("probe.runtime_page", "page_first_direct", {"KERNEL", "PAGE_LOAD_KERNEL"}),
    ("probe.runtime_page_lf", "layer_first", {"layer_first KERNEL", "PAGE_LOAD_KERNEL"}),
    ("probe.kv_layer_major", "page_first_kv_split", {"kv_split KERNEL", "PAGE_LOAD (constexpr page size)"}),
    ("probe.page_backup_lf", "layer_first", {"PAGE_BACKUP_KERNEL", "PAGE_LOAD (constexpr page size)"}),
])
@pytest.mark.parametrize("case", ["mla656-fp8-ps128", "mla576-fp8-ps16-sharded5of2r1"])
def test_probe_strategies_round_trip_through_their_own_kernels(monkeypatch, launches, strategy, layout, want, case):
    monkeypatch.setenv("HICACHE_KERNEL_TMA", "0")  # the rows here are narrower than automatic TMA takes anyway
    monkeypatch.setenv("HICACHE_KERNEL_PAGES", "1")  # page loads of these small pages too (automatic: >= 2 KiB)
    check_strategy(REGISTRY, CASE[case], layout, probe.backend(strategy), strategy=strategy, device=DEVICE)
    from hicache_kv_split import kernels as kv
    from hicache_layer_first import kernels as lf
    names = {probe.KERNEL: "KERNEL", probe.PAGE_LOAD_KERNEL: "PAGE_LOAD_KERNEL", lf.KERNEL: "layer_first KERNEL",
             probe.PAGE_BACKUP_KERNEL: "PAGE_BACKUP_KERNEL",
             kv.KERNEL: "kv_split KERNEL", kl.PAGE_LOAD: "PAGE_LOAD (constexpr page size)"}
    assert {names.get(k, repr(k)) for k, _, _ in launches} == want


def test_grouped_and_one_page_per_item_variants_set_the_group_bytes_while_their_pools_are_built(monkeypatch):
    """``... page loads grouped`` builds its pool with ``rowcopy_pages.GROUP_BYTES`` at 8192 (small pages several per
    work item), ``... one page per item`` at 0, ``... page loads`` with the default; each hands the strategy only real
    options and puts the constant back."""
    from hicache_core import rowcopy_pages

    seen = []

    def pool(*args, **kw):
        seen.append((rowcopy_pages.GROUP_BYTES, kw["strategy_options"]))
        return "pool"
    monkeypatch.setattr(probe, "HostKVPool", pool)
    monkeypatch.setattr(probe, "_workload", lambda shape, tokens, ps: (None, {}, None, None, None))
    default = rowcopy_pages.GROUP_BYTES
    for what in ("page loads grouped", "page loads one page per item", "page loads"):
        probe._build(f"fp8-576 page_first_kv_split {what}", 64, 16, None)
    assert seen == [(8192, {"pages": True}), (0, {"pages": True}), (default, {"pages": True})]
    assert rowcopy_pages.GROUP_BYTES == default



@pytest.mark.parametrize("label", ["bf16-576 page_first_kv_split 2 programs 32 warps 128K",
                                   "fp8-656 layer_first 2 programs 32 warps 128K"])
def test_two_wide_programs_variants_tune_backups_only(monkeypatch, label):
    """``... 2 programs 32 warps 128K`` builds its pool with options that give fenced backups of 2 programs, 32 warps
    and 128 KiB tiles while loads keep their programs (the probe times backups; on the GPU it checks each variant's
    backups bit-exact before timing them)."""
    seen = []
    monkeypatch.setattr(probe, "HostKVPool", lambda *a, **kw: seen.append(kw["strategy_options"]))
    monkeypatch.setattr(probe, "_workload", lambda shape, tokens, ps: (None, {}, None, None, None))
    probe._build(label, 64, 16, None)
    spec = CASE["mla576-bf16-ps16-strided"].build(DEVICE)
    t = REGISTRY.resolve(spec, probe.VARIANTS[label][1], "kernel", options=seen[0]).strategy.effective_tuning(DEVICE)
    assert (t.backup.programs, t.backup.num_warps, t.backup.tile_bytes, t.backup.fence,
            t.backup.fence_min_row_bytes) == (2, 32, 131072, True, 0)
    assert t.load.programs != 2


def test_a_row_gives_the_host_time_of_the_all_layer_backup_it_timed(monkeypatch):
    """Each row carries ``host_all_layers_us``: the host time of the same all-layer backup call the ratio times (so
    ``... pdl`` and ``... no pdl`` rows compare the caller's cost of dependent launches in one process)."""
    import argparse
    import types

    calls = []
    spec = types.SimpleNamespace(layer_map=types.SimpleNamespace(num_device_layers=4), bytes_per_token=64)
    pool = types.SimpleNamespace(spec=spec, strategy_name="s", backup_layer=lambda *a: None,
                                 backup_all_layers=lambda h, s: calls.append((h, s)))
    monkeypatch.setattr(probe, "_build", lambda *a: (pool, None, "h", "s", None))
    monkeypatch.setattr(probe, "_check", lambda *a, **kw: None)
    monkeypatch.setattr(probe, "_median_ms", lambda fn, reps: 1.0)
    monkeypatch.setattr(probe, "_host_us", lambda fn, reps: (fn(), reps, 12.5)[2])
    memcpy = types.SimpleNamespace(gbps=lambda nbytes, to_host, reps: 1.0)
    args = argparse.Namespace(tokens=64, page_size=16, reps=15, gemm=False, bursts=False, loads=False)
    row = probe._measure("fp8-656 layer_first pdl", args, None, memcpy)
    assert row["host_all_layers_us"] == 12.5 and calls == [("h", "s")]  # the backup itself was the timed call


@pytest.mark.parametrize("scatter", ["none", "device rows of one page", "every page"])
def test_page_backups_copy_run_pages_flat_and_others_row_by_row(scatter):
    """``probe.page_backup_lf`` backs up pages whose slots and rows are runs as flat words and the others row by row:
    byte for byte what the reference backend writes, canaries untouched (656-byte rows, pages of 4); loads as the row
    kernel moves them."""
    from hicache_core import HostKVPool
    from hicache_core.testing.conformance import (Case, assert_guards_intact, fill_canary, guarded_host_buffers,
                                                  make_device_buffers)

    spec = CASE["mla656-fp8-ps128"].build(DEVICE)
    import dataclasses
    spec = dataclasses.replace(spec, page_size=4, capacity=48)
    gen = torch.Generator().manual_seed(7)
    dev = make_device_buffers(spec, Case("rows", lambda device: spec), gen)
    rows = min(t.shape[0] for ts in dev.values() for t in ts if t is not None)
    host, guards = guarded_host_buffers(REGISTRY, spec, "layer_first", pin_memory=DEVICE.type == "cuda")
    pool = HostKVPool(spec, "layer_first", probe.backend("probe.page_backup_lf"), dev, registry=REGISTRY,
                      strategy="probe.page_backup_lf", host_buffers=host)
    ref_dev = {k: [None if t is None else t.clone() for t in v] for k, v in dev.items()}
    ref = HostKVPool(spec, "layer_first", "reference", ref_dev, registry=REGISTRY, strategy="core.reference",
                     pin_memory=False)
    fill_canary(pool)
    fill_canary(ref)
    pages = torch.tensor([5, 0, 9, 2])  # host pages, as alloc hands them out
    h = (pages[:, None] * 4 + torch.arange(4)).reshape(-1)
    d = (torch.tensor([3, 7, 1, 10])[:, None] * 4 + torch.arange(4)).reshape(-1)
    if scatter == "device rows of one page":
        d[4:8] = torch.tensor([30, 2, 17, 9])
    elif scatter == "every page":
        d = torch.randperm(rows, generator=gen)[:16]
    pool.backup_all_layers(h.to(DEVICE), d.to(DEVICE))
    ref.backup_all_layers(h, d)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert any(t.view(torch.uint8).any() for t in ref.host_buffers.values())
    for name, buf in pool.host_buffers.items():
        assert torch.equal(buf.view(torch.uint8).cpu(), ref.host_buffers[name].view(torch.uint8).cpu()), (scatter, name)
    assert_guards_intact(scatter, guards)
    back = torch.randperm(rows, generator=gen)[:16]  # loads: the row kernel's, into other rows
    pool.load_all_layers(h.to(DEVICE), back.to(DEVICE))
    ref.load_all_layers(h, back)
    for name in dev:
        for mine, theirs in zip(pool.device_buffers[name] if hasattr(pool, "device_buffers") else dev[name],
                                ref_dev[name]):
            if mine is not None:
                assert torch.equal(mine.view(torch.uint8).cpu(), theirs.view(torch.uint8).cpu()), (scatter, name)
