"""The strategies ``benchmarks/backup_place_probe.py`` times beside the plugins' own (the kernels as they were before
the page size became a constexpr, and ``page_first_kv_split`` walking layer-major): bit-exact against the reference,
canaries untouched, through the probe's own kernels.  A probe whose variant moved the wrong bytes would time a
kernel that is not the one it names; on the GPU the probe checks each variant again before timing it.  On CPU the
kernels run in Triton's interpreter.  The page-backup helpers here (:func:`pb_any_indices`, :data:`PB_CASES`) serve
``tests/test_page_backups.py``, which tests the plugins' own page backups through them: the probe's ``... page
backups`` variants run those since its own page-backup kernel was removed."""

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
])
@pytest.mark.parametrize("case", ["mla656-fp8-ps128", "mla576-fp8-ps16-sharded5of2r1"])
def test_probe_strategies_round_trip_through_their_own_kernels(monkeypatch, launches, strategy, layout, want, case):
    monkeypatch.setenv("HICACHE_KERNEL_TMA", "0")  # the rows here are narrower than automatic TMA takes anyway
    monkeypatch.setenv("HICACHE_KERNEL_PAGES", "1")  # page loads of these small pages too (automatic: >= 2 KiB)
    check_strategy(REGISTRY, CASE[case], layout, probe.BACKEND, strategy=strategy, device=DEVICE)
    from hicache_kv_split import kernels as kv
    from hicache_layer_first import kernels as lf
    names = {probe.KERNEL: "KERNEL", probe.PAGE_LOAD_KERNEL: "PAGE_LOAD_KERNEL", lf.KERNEL: "layer_first KERNEL",
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


#: The page-backup labels (``... page backups`` and its generated variants) and the options each adds.
PAGE_BACKUP_LABELS = [(f"{lab} layer_first page backups{what}", opts) for lab in ("fp8-656", "fp8-576", "bf16-576")
                      for what, opts in (("", {}), (" 4 programs", {"backup_programs": 4}),
                                         (" 2 programs", {"backup_programs": 2}),
                                         (" launches of 8 MiB", {"backup_launch_bytes": 8 << 20}),
                                         (" one launch", {"backup_launch_bytes": 0}))]


#: (label, the strategy options it builds its pool with) of the page-backup and row-backup variants.
BACKUP_OPTIONS = [("fp8-656 layer_first plugin page backups", {"page_backups": True}),
                  ("fp8-656 layer_first row backups", {"page_backups": False}),
                  ("fp8-656 page_first_direct plugin page backups", {"page_backups": True}),
                  ("fp8-656 layer_first plugin page backups one launch", {"page_backups": True, "backup_launch_bytes": 0}),
                  ("bf16-576 page_first row backups", {"page_backups": False})] + [
    (label, {"page_backups": True, "backup_programs": 8, **opts}) for label, opts in PAGE_BACKUP_LABELS]


@pytest.mark.parametrize("label,want", BACKUP_OPTIONS, ids=[label for label, _ in BACKUP_OPTIONS])
def test_plugin_page_backup_and_row_backup_variants_set_page_backups(monkeypatch, label, want):
    """``... plugin page backups`` builds ``layer_first``'s or ``page_first_direct``'s own pool with page backups
    forced on, ``... row backups`` with them off (every layout takes the option); both pass through the registry's
    option check.  The ``... layer_first page backups`` labels (their earlier records from a probe kernel since
    removed) build ``layer_first``'s own pool (io_backend ``kernel``, no strategy override) with page backups forced
    on plus their launch options, which the page backups' tuning takes."""
    seen = []
    monkeypatch.setattr(probe, "HostKVPool", lambda *a, **kw: seen.append((a[1:3], kw["strategy"],
                                                                           kw["strategy_options"])))
    monkeypatch.setattr(probe, "_workload", lambda shape, tokens, ps: (None, {}, None, None, None))
    probe._build(label, 64, 16, None)
    assert seen == [((probe.VARIANTS[label][1], "kernel"), None, want)]
    spec = CASE["mla656-fp8-ps128"].build(DEVICE)
    strategy = REGISTRY.resolve(spec, probe.VARIANTS[label][1], "kernel", options=want).strategy
    assert strategy.page_backups is want["page_backups"]
    page_backup = strategy.effective_tuning(DEVICE).page_backup
    assert page_backup.programs == want.get("backup_programs", page_backup.programs)
    assert page_backup.launch_bytes == want.get("backup_launch_bytes", page_backup.launch_bytes)


@pytest.mark.parametrize("label", ["fp8-656 layer_first page backups", "bf16-576 layer_first page backups one launch"])
def test_page_backup_variants_launch_the_plugin_kernel_with_pages(monkeypatch, label):
    """A ``... layer_first page backups`` pool (built with the label's options, on a conformance case's rows; automatic
    page backups off, so that the option alone takes them) backs up through ``layer_first``'s own ``KERNEL`` with
    ``PAGES`` on (``kernel_lib.page_backup``), its loads without: the name ``gpu_session.sh``'s Nsight Compute step
    selects (``regex:KERNEL$``)."""
    from hicache_core import rowcopy_pages
    from hicache_core.testing.conformance import make_device_buffers
    from hicache_layer_first import kernels as lf

    monkeypatch.setattr(rowcopy_pages, "AUTO_PAGE_BACKUPS", False)
    _, layout, _, override, options = probe.VARIANTS[label]
    case = CASE["mla656-fp8-ps128"]
    spec = case.build(DEVICE)
    dev = make_device_buffers(spec, case, torch.Generator().manual_seed(0))
    pool = probe.HostKVPool(spec, layout, "kernel", dev, strategy=override, strategy_options=options,
                            registry=REGISTRY, pin_memory=DEVICE.type == "cuda")
    prep = pool.binding.scratch[pool.strategy_name]
    assert prep.launcher.kernel is lf.KERNEL and lf.KERNEL.fn.__name__ == "KERNEL"
    for by_dir in prep.launches:
        values = {to_host: dict(zip(prep.launcher.arg_names, by_dir[to_host].args)) for to_host in (True, False)}
        assert values[True]["PAGES"] and not values[False]["PAGES"]


def _fake_pool(monkeypatch) -> list:
    """A stand-in pool of 4 layers x 64 bytes per token for ``_measure`` (built and checked without a GPU, each timing
    1 ms); returns the list its ``backup_all_layers`` calls go into."""
    import types

    calls: list = []
    spec = types.SimpleNamespace(layer_map=types.SimpleNamespace(num_device_layers=4), bytes_per_token=64)
    pool = types.SimpleNamespace(spec=spec, strategy_name="s", backup_layer=lambda *a: None,
                                 backup_all_layers=lambda h, s: calls.append((h, s)))
    monkeypatch.setattr(probe, "_build", lambda *a: (pool, None, "h", "s", None))
    monkeypatch.setattr(probe, "_check", lambda *a, **kw: None)
    monkeypatch.setattr(probe, "_median_ms", lambda fn, reps: 1.0)
    return calls


def test_a_row_gives_the_host_time_of_the_all_layer_backup_it_timed(monkeypatch):
    """Each row carries ``host_all_layers_us``: the host time of the same all-layer backup call the ratio times (so
    ``... pdl`` and ``... no pdl`` rows compare the caller's cost of dependent launches in one process)."""
    import argparse
    import types

    calls = _fake_pool(monkeypatch)
    monkeypatch.setattr(probe, "_host_us", lambda fn, reps: (fn(), reps, 12.5)[2])
    memcpy = types.SimpleNamespace(gbps=lambda nbytes, to_host, reps: 1.0)
    args = argparse.Namespace(tokens=64, page_size=16, reps=15, gemm=False, bursts=False, loads=False)
    row = probe._measure("fp8-656 layer_first pdl", args, None, memcpy)
    assert row["host_all_layers_us"] == 12.5 and calls == [("h", "s")]  # the backup itself was the timed call


def test_with_gemm_a_row_gives_the_backups_ratio_beside_the_gemm_from_the_same_call(monkeypatch):
    """``--gemm`` rows carry the GEMM's slowdown beside the all-layer backup and the backup's own ratio while GEMMs run
    (``backup_all_layers_beside_gemm``), both timing that same backup call, the ratio against memcpy like the others."""
    import argparse
    import types

    calls = _fake_pool(monkeypatch)
    monkeypatch.setattr(probe, "_host_us", lambda fn, reps: 12.5)
    monkeypatch.setattr(probe, "_gemm_slowdown", lambda fn: (fn(), 0.25)[1])
    monkeypatch.setattr(probe, "_ms_beside_gemm", lambda fn: (fn(), 4.0)[1])
    memcpy = types.SimpleNamespace(gbps=lambda nbytes, to_host, reps: 2e-6 if to_host else 1.0)
    args = argparse.Namespace(tokens=64, page_size=16, reps=15, gemm=True, bursts=False, loads=False)
    row = probe._measure("fp8-656 layer_first", args, None, memcpy)
    assert row["gemm_all_layers"] == 0.25
    assert row["backup_all_layers_beside_gemm"] == pytest.approx(64 * 64 / 4.0 / 1e6 / 2e-6)
    assert row["backup_all_layers"] == pytest.approx(64 * 64 / 1.0 / 1e6 / 2e-6)
    assert calls == [("h", "s"), ("h", "s")]  # the backup itself, once for each


def test_a_variant_that_raises_is_recorded_and_the_others_still_run(monkeypatch, tmp_path, capsys):
    """A variant that raises (a probe kernel this Triton cannot compile, say) prints an ``ERROR`` row and the run goes
    on with the next variant; the file keeps the rows measured, and the exit status says something failed."""
    import json
    import sys

    labels = ["fp8-656 layer_first page backups", "fp8-656 layer_first"]

    def measure(label, args, reg, memcpy):
        if label == labels[0]:
            raise RuntimeError("PassManager::run failed")
        return {"variant": label, "backup_all_layers": 0.9}

    monkeypatch.setattr(probe, "_measure", measure)
    monkeypatch.setattr(probe, "require_cuda", lambda path: None)
    monkeypatch.setattr(probe, "_Memcpy", lambda: None)
    out = tmp_path / "place.json"
    monkeypatch.setattr(sys, "argv", ["probe", "--out", str(out), "--variants", ",".join(labels)])
    assert probe.main() == 1
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed[0] == {"variant": labels[0], "ERROR": "RuntimeError: PassManager::run failed"}
    assert printed[1]["variant"] == labels[1]
    assert json.loads(out.read_text()) == [{"variant": labels[1], "backup_all_layers": 0.9}]


#: Rows of the page-backup tests: (dtype, kv_lora_rank, qk_rope_head_dim, row_bytes) - fp8 656 B (no parts), fp8 576 B,
#: bf16 576 B and bf16 1152 B (latent and rope parts).
PB_ROWS = {"fp8-656": (torch.uint8, 512, 64, 656), "fp8-576": (torch.uint8, 512, 64, None),
           "bf16-576": (torch.bfloat16, 256, 32, None), "bf16-1152": (torch.bfloat16, 512, 64, None)}
#: (page size, rows, device rows, layer map, index dtype, strategy options)
PB_CASES = [(ps, rows, "packed", "unsharded", torch.int64, {}) for ps in (1, 2, 3, 4, 16, 128) for rows in PB_ROWS] + [
    (3, "fp8-656", "packed", "unsharded", torch.int64, {"backup_launch_bytes": 1}),  # a launch per layer entry
    (16, "bf16-576", "packed", "sharded", torch.int64, {"backup_launch_bytes": 1}),
    (4, "fp8-576", "packed", "sharded", torch.int32, {}),
    (2, "fp8-656", "packed", "unsharded", torch.int32, {"backup_launch_bytes": 1}),
    (3, "fp8-656", "packed", "unsharded", torch.int64, {"tile_bytes": 256}),  # tiles of one token: TOKENS < PAGE_SIZE
    (16, "fp8-656", "packed", "sharded", torch.int64, {"tile_bytes": 256}),
    (128, "fp8-656", "packed", "unsharded", torch.int64, {"tile_bytes": 8192}),
    (4, "fp8-656", "strided", "unsharded", torch.int64, {}),  # device rows wider than a row: never flat
    (16, "bf16-576", "strided", "sharded", torch.int32, {}),
    (4, "bf16-576", "split", "unsharded", torch.int64, {}),  # host rows wider than a part: never flat
    (16, "fp8-576", "split", "sharded", torch.int64, {"backup_launch_bytes": 1}),
]

#: Test ids of :data:`PB_CASES`.
PB_IDS = [f"ps{c[0]}-{c[1]}-{c[2]}-{c[3]}-{str(c[4])[6:]}" + "".join(f"-{k}{v}" for k, v in c[5].items())
          for c in PB_CASES]

def _pb_pairs(ps: int, pages: int, dev_rows: int, huge: int) -> tuple[list, list, int]:
    """Host slots and device rows of a backup mixing every kind of page (not whole pages at the end), and how many of
    its valid pairs sit in pages that are not runs (the row path's).  Runs on both sides: host page 2 with device
    rows from 5 (not a page start), the second last host page with the last device rows.  Not runs: device rows
    scattered, host slots reversed, slots that start a page but go on elsewhere, a host run not starting a page,
    device rows running past the last, host slots running past the last, out-of-range slots and rows (negative,
    huge, capacity), and a part of a page last."""
    cap = ps * pages
    h: list[int] = []
    d: list[int] = []
    row_pairs = 0

    def page(hs: list[int], ds: list[int], flat: bool) -> None:
        nonlocal row_pairs
        h.extend(hs)
        d.extend(ds)
        if not flat:
            row_pairs += sum(0 <= a < cap and 0 <= b < dev_rows for a, b in zip(hs, ds))
    run = lambda start: list(range(start, start + ps))  # noqa: E731
    page(run(2 * ps), run(5), True)
    page(run((pages - 2) * ps), run(dev_rows - ps), True)  # the last device rows
    if ps > 1:
        page(run(0), [11 * j + 1 for j in range(ps)], False)  # rows 11 apart
        page(run(4 * ps)[::-1], run(ps), False)
        page([ps] + run(5 * ps + 1)[:ps - 1], run(11 * ps), False)  # starts a page, then slots of another
        page(run(6 * ps + 1), run(3 * ps), False)
        page(run(8 * ps), run(dev_rows - ps + 1), False)  # one row past the last
        page(run(11 * ps), run(12 * ps)[:ps - 1] + [dev_rows - 1], False)  # a run but for its last row
        page(run((pages - 1) * ps + 1), run(2 * ps), False)  # one slot past the last
    page([-1, huge, cap, -huge][:ps] + run(3 * ps)[4:], run(4 * ps), False)  # bad slots (none valid for ps <= 4)
    page(run(9 * ps), [-1, huge, dev_rows, -huge][:ps] + run(6 * ps)[4:], False)  # bad rows
    if ps > 1:
        page(run(10 * ps)[:ps - 1], run(7 * ps)[:ps - 1], False)  # n not a multiple of the page size
    return h, d, row_pairs


def pb_any_indices(monkeypatch, launches, make_pool, ps, rows, device_rows, layers, index_dtype, options,
                   layout="layer_first"):
    """Build a pool of ``rows`` (``make_pool(spec, dev, host, options)``) on guarded ``layout`` host buffers, back up
    :func:`_pb_pairs` through its strategy as a shapes-validated call would (device-resident indices), and check it
    byte for byte against the reference backend's backup of the valid pairs alone: host buffers equal, canaries, guard
    bytes and every device byte untouched; with ``backup_launch_bytes=1`` a launch per layer entry.  Returns
    ``(pool, moved, row_pairs, valid, entries)``: the rows the row path moved (counted under the interpreter, else
    ``None``), the valid pairs in pages that are not runs, the valid pairs, and the layer entries backed up."""
    from hicache_core import LayerMap, PoolSpec
    from hicache_core.testing.conformance import (Case, assert_device_guards_intact, assert_guards_intact,
                                                  fill_canary, guarded_host_buffers, make_device_buffers)

    dtype, lora, rope, row_bytes = PB_ROWS[rows]
    lmap = {"unsharded": lambda: LayerMap.unsharded(3),
            "sharded": lambda: LayerMap.sharded_cp(5, 2, 1, pad_to_largest=True),
            "one": lambda: LayerMap.unsharded(1),  # one host layer: token-major page_first rows are packed
            "sharded-one": lambda: LayerMap.sharded_cp(2, 2, 1),  # one layer owned, one host layer
            # one layer owned of a host sized for two (padded): token-major page_first rows strided by 2 layers
            "sharded-one-padded": lambda: LayerMap.sharded_cp(3, 2, 1, pad_to_largest=True)}[layers]()
    pages = 14
    spec = PoolSpec.mla(layer_map=lmap, kv_lora_rank=lora, qk_rope_head_dim=rope, dtype=dtype, page_size=ps,
                        capacity=ps * pages, row_bytes=row_bytes, device=DEVICE)
    gen = torch.Generator().manual_seed(ps)
    case = Case("rows", lambda device: spec, strided=device_rows == "strided", split_parts=device_rows == "split")
    dev = make_device_buffers(spec, case, gen)
    ref_dev = {k: [None if t is None else t.clone() for t in v] for k, v in dev.items()}
    host, guards = guarded_host_buffers(REGISTRY, spec, layout, pin_memory=DEVICE.type == "cuda")
    pool = make_pool(spec, dev, host, options)
    ref = probe.HostKVPool(spec, layout, "reference", ref_dev, registry=REGISTRY, strategy="core.reference",
                           pin_memory=False)
    fill_canary(pool)
    fill_canary(ref)
    dev_rows = pool.binding.device_rows
    huge = 2**31 - 1 if index_dtype == torch.int32 else 2**40
    h, d, row_pairs = _pb_pairs(ps, pages, dev_rows, huge)
    moved: list[int] = []
    interpreted = DEVICE.type == "cpu"
    if interpreted:  # the row path's rows, counted where the interpreter calls the helper
        real = kl.move_rows

        def counting(anchor, dev_row, host_row, ok, *rest):
            moved.append(int(ok.handle.data.sum()))
            return real(anchor, dev_row, host_row, ok, *rest)
        monkeypatch.setattr(kl, "move_rows", counting)
    launches.clear()
    pool.strategy.backup(pool.binding, torch.tensor(h, dtype=index_dtype).to(DEVICE),
                         torch.tensor(d, dtype=index_dtype).to(DEVICE), None)
    valid = [(a, b) for a, b in zip(h, d) if 0 <= a < spec.capacity and 0 <= b < dev_rows]
    ref.strategy.backup(ref.binding, torch.tensor([a for a, _ in valid]), torch.tensor([b for _, b in valid]), None)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    entries = sum(g.entries(None).numel() for g in pool.binding.scratch[pool.strategy_name].groups)
    if options.get("backup_launch_bytes") == 1 and layout != "page_first":  # (page_first: runs of tokens per launch)
        assert len(launches) == entries
    assert any(t.view(torch.uint8).ne(0xA5).any() for t in ref.host_buffers.values())
    for name, buf in pool.host_buffers.items():
        want = ref.host_buffers[name].view(torch.uint8).cpu()
        got = buf.view(torch.uint8).cpu()
        assert torch.equal(got, want), (name, (got != want).nonzero()[:4].tolist())
    assert_guards_intact("page backup", guards)
    assert_device_guards_intact("page backup", dev)
    for name in dev:  # a backup writes no device byte
        for mine, theirs in zip(dev[name], ref_dev[name]):
            if mine is not None:
                assert torch.equal(mine.view(torch.uint8).cpu(), theirs.view(torch.uint8).cpu()), name
    return pool, sum(moved) if interpreted else None, row_pairs, len(valid), entries
