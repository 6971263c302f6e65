"""Backups split into launches of at most ``Tuning.launch_bytes`` (rowcopy_launch._splits, RowKernelStrategy.transfer
and launch_grid): the edges tests/test_rowcopy.py leaves open: a call that fits exactly, a cap below one entry's rows,
runs of positions as long as the tile's tokens, entry runs kept per entries tensor and run length (per-layer and
all-layer backups of several counts on one pool), ``launch_grid`` naming the first (largest) launch of a split, and
the replay path, driven on the CPU through a fake driver launch (every replayed step falls back to the launcher, so
the kernels still run under Triton's interpreter and the log shows what a replay launches)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402

from hicache_core import HostKVPool, LayerMap, PoolSpec, create_registry, replay, rowcopy, rowcopy_launch  # noqa: E402
from hicache_core.launch import Launcher  # noqa: E402
from hicache_core.rowcopy_launch import entry_run, entry_tails, exact_shape  # noqa: E402
from hicache_core.testing.conformance import (Case, assert_guards_intact, fill_canary, guarded_host_buffers,  # noqa
                                              make_device_buffers)
from hicache_kv_split.strategy import KVSplitKernelStrategy  # noqa: E402
from hicache_layer_first.strategy import LayerFirstKernelStrategy  # noqa: E402
from hicache_page_first.strategy import PageFirstDirectKernelStrategy, PageFirstKernelStrategy  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PIN = DEVICE.type == "cuda"
REGISTRY = create_registry()
KERNELS = {"layer_first": LayerFirstKernelStrategy, "page_first": PageFirstKernelStrategy,
           "page_first_direct": PageFirstDirectKernelStrategy, "page_first_kv_split": KVSplitKernelStrategy}
#: one layout whose kernel walks entries apart, one whose kernel walks a tile's entries together
TWO = ["layer_first", "page_first"]
_sync = torch.cuda.synchronize if PIN else (lambda: None)


def _mla(layers: int = 5, ps: int = 2, cap: int = 128) -> PoolSpec:
    """MLA rows of 32 + 8 bytes (``latent`` + ``rope``, bf16)."""
    return PoolSpec.mla(layer_map=LayerMap.unsharded(layers), kv_lora_rank=16, qk_rope_head_dim=4,
                        dtype=torch.bfloat16, page_size=ps, capacity=cap, device=DEVICE)


def _pages(gen: torch.Generator, pages: int, ps: int = 2, of: int = 64) -> torch.Tensor:
    """Host slots of ``pages`` whole pages (of ``of``) in random order."""
    return (torch.randperm(of, generator=gen)[:pages, None] * ps + torch.arange(ps)).reshape(-1)


def _pools(layout: str, cap: int | None, opts: dict | None = None, seed: int = 4):
    """(kernel pool with guarded host buffers and ``backup_launch_bytes=cap``, reference pool, guards, row bytes, or
    ``None`` where its groups' rows differ); each pool's device buffers in ``pool.test_dev``."""
    spec = _mla()
    gen = torch.Generator().manual_seed(seed)
    dev = make_device_buffers(spec, Case("rows", lambda device: spec), gen)
    host, guards = guarded_host_buffers(REGISTRY, spec, layout, pin_memory=PIN)
    pool = HostKVPool(spec, layout, "kernel", dev, registry=REGISTRY, host_buffers=host,
                      strategy_options={"programs": 64, "tile_bytes": 256, **(opts or {}),
                                        "backup_launch_bytes": cap})
    ref_dev = {k: [None if t is None else t.clone() for t in v] for k, v in dev.items()}
    ref = HostKVPool(spec, layout, "reference", ref_dev, registry=REGISTRY, strategy="core.reference",
                     pin_memory=False)
    pool.test_dev, ref.test_dev = dev, ref_dev
    fill_canary(pool)
    fill_canary(ref)
    prep = pool.binding.scratch[pool.strategy_name]
    rows = {g.width * g.word for g in prep.groups}
    return pool, ref, guards, rows.pop() if len(rows) == 1 else None


def _same(pool: HostKVPool, ref: HostKVPool, guards: dict, what: str) -> None:
    _sync()
    for name, buf in pool.host_buffers.items():
        assert torch.equal(buf.view(torch.uint8).cpu(), ref.host_buffers[name].view(torch.uint8).cpu()), (what, name)
    assert_guards_intact(what, guards)


@pytest.fixture
def launches(monkeypatch):
    """Every kernel launch: ``(grid, {parameter: value})`` (row kernel only: TMA and page loads off).  The launch's
    result is dropped on purpose: on a GPU nothing is recorded to replay, so every launch of a repeated call comes
    through ``Launcher.__call__`` and is logged (a test of replays returns it, as the PDL GPU test does)."""
    monkeypatch.setenv("HICACHE_KERNEL_TMA", "0")
    monkeypatch.setenv("HICACHE_KERNEL_PAGES", "0")
    log, real = [], Launcher.__call__

    def counting(self, grid, args, **kw):
        log.append((grid, dict(zip(self.arg_names, args))))
        real(self, grid, args, **kw)
    monkeypatch.setattr(Launcher, "__call__", counting)
    return log


def _runs(log) -> list[tuple[list[int], int]]:
    """(entries, positions) of each logged launch."""
    return [(c["ents"].tolist(), int(c["n"])) for _, c in log]


# -- where a call splits ----------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", KERNELS)
def test_a_call_of_exactly_launch_bytes_is_one_launch_and_one_byte_more_splits(layout, launches):
    """``launch_bytes`` is the most one launch moves: a call of exactly that many bytes is one launch per group, a
    byte less of cap splits it."""
    n = 40  # not a multiple of 16: a run of positions cut to 16s would split it
    h = _pages(torch.Generator().manual_seed(1), n // 2)
    src = torch.arange(n)
    pool, ref, guards, row = _pools(layout, 0)
    k = pool.binding.scratch[pool.strategy_name].groups[0].entries(None).numel()
    for cap, split in ((n * k * row, False), (n * k * row - 1, True)):
        pool, ref, guards, _ = _pools(layout, cap)
        launches.clear()
        pool.backup_all_layers(h, src)
        ref.backup_all_layers(h, src)
        assert (len(launches) > 1) is split, (cap, _runs(launches))
        assert split or not pool.binding.scratch[pool.strategy_name].slices, "a call that fits takes no entry runs"
        _same(pool, ref, guards, f"cap {cap}")


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("layout", KERNELS)
def test_a_cap_below_one_entry_moves_one_entry_or_one_aligned_run_per_launch(layout, launches, dtype):
    """A cap smaller than one entry's rows of the call (1 byte) still makes progress: one entry at every position
    per launch, or (``entries_inner``) every entry of one run of positions as long as the alignment asks; every byte
    lands as the reference puts it, with int64 or int32 indices (runs of positions are views of the call's)."""
    n = 48
    gen = torch.Generator().manual_seed(2)
    h, src = _pages(gen, n // 2).to(dtype), torch.arange(n, dtype=dtype)
    pool, ref, guards, _ = _pools(layout, 1)
    prep = pool.binding.scratch[pool.strategy_name]
    want = []
    for g in prep.groups:
        ents = g.entries(None).tolist()
        if KERNELS[layout].entries_inner:
            align = max(16, prep.launches[prep.groups.index(g)][True].tokens)
            want += [(ents, min(align, n - i)) for i in range(0, n, align)]
        else:
            want += [([e], n) for e in ents]
    pool.backup_all_layers(h, src)
    ref.backup_all_layers(h, src)
    assert _runs(launches) == want
    assert all(c["host_idx"].dtype == dtype and c["dev_idx"].dtype == dtype for _, c in launches)
    _same(pool, ref, guards, "cap 1")


@pytest.mark.parametrize("layout", ["page_first", "page_first_kv_split"])
def test_position_runs_are_whole_tiles_where_a_tile_holds_more_than_16_positions(layout, launches):
    """Runs of positions are multiples of the tile's tokens, not only of 16: with tiles of 32 positions and a cap of
    56 positions' rows of every entry, runs of 32 (not 48)."""
    n = 96
    gen = torch.Generator().manual_seed(3)
    h, src = _pages(gen, n // 2), torch.arange(n)
    pool, *_ = _pools(layout, 0, {"tile_bytes": 2048})
    prep = pool.binding.scratch[pool.strategy_name]
    (g,) = prep.groups
    lv = prep.launches[0][True]
    assert lv.tokens == 32, lv.tokens  # the case needs a tile of more than 16 positions
    k = g.entries(None).numel()
    pool, ref, guards, row = _pools(layout, 56 * k * (g.width * g.word), {"tile_bytes": 2048})
    pool.backup_all_layers(h, src)
    ref.backup_all_layers(h, src)
    assert [m for _, m in _runs(launches)] == [32, 32, 32]
    _same(pool, ref, guards, "tiles of 32")


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_entry_runs_are_kept_per_entries_tensor_and_run_length(layout, launches):
    """Entry runs are cached per (entries tensor, run length): all-layer backups of two counts (runs of 2 entries,
    then of 1) each launch their own entries, and a per-layer backup past the cap (one entry: no run is smaller)
    launches that layer's entry alone; the host holds what the reference writes (a per-layer backup to other slots
    must not write the other layers' rows there)."""
    gen = torch.Generator().manual_seed(6)
    pool, ref, guards, row = _pools(layout, 0)
    prep = pool.binding.scratch[pool.strategy_name]
    (g,) = prep.groups
    cap = 40 * row  # all layers: 16 positions in runs of 2 entries, 32 in runs of 1; one layer of 48 positions split
    pool, ref, guards, _ = _pools(layout, cap)
    prep = pool.binding.scratch[pool.strategy_name]
    h_all = _pages(gen, 24, of=32)  # slots 0..63
    layer = 3
    for n, which in ((16, None), (32, None), (48, layer), (16, None), (48, layer)):
        launches.clear()
        src = torch.arange(n)
        if which is None:
            h = h_all[:n]
            pool.backup_all_layers(h, src)
            ref.backup_all_layers(h, src)
        else:
            h = torch.arange(64, 64 + n)  # slots no all-layer backup wrote
            pool.backup_layer(which, h, src)
            ref.backup_layer(which, h, src)
        ents = g.entries(which).tolist()
        assert n * len(ents) * row > cap, "the call is split"
        per = max(1, cap // (n * row))
        assert [e for e, _ in _runs(launches)] == [ents[i:i + per] for i in range(0, len(ents), per)], (n, which)
        _same(pool, ref, guards, f"{n} positions of layer {which}")
    # all layers in runs of 2 and of 1, made once each; the layer's one entry is one launch whatever its bytes
    assert len(prep.slices) == 2


@pytest.mark.parametrize("layout", KERNELS)
def test_launch_grid_is_the_first_launch_of_a_split(layout, launches):
    """``launch_grid`` of a split backup is the largest grid the call launches (its first launch: the last of a
    split may hold fewer entries or positions), with a budget above every launch's work."""
    n = 48
    h, src = _pages(torch.Generator().manual_seed(7), n // 2), torch.arange(n)
    pool, _, _, row = _pools(layout, 0, {"programs": 4096})
    k = pool.binding.scratch[pool.strategy_name].groups[0].entries(None).numel()
    inner = KERNELS[layout].entries_inner
    # entries apart: runs of 2, 2, 1 entries; entries together: runs of 32 and 16 positions
    cap = 32 * k * row if inner else 2 * n * row
    pool, *_ = _pools(layout, cap, {"programs": 4096})
    pool.backup_all_layers(h, src)
    grids = [grid for grid, _ in launches]
    assert len(grids) > 1 and grids[0] > grids[-1], grids
    assert pool.strategy.launch_grid(pool.binding, n, None, to_host=True) == max(grids)


# -- replays (a fake driver launch on the CPU) -------------------------------------------------------------
#: the fake driver stands in for CUDA's (on CUDA, tests/test_rowcopy.py's replay test runs the real one)
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="a fake driver launch, for CPU runs")

class _Kernel:
    """A driver kernel that never relaunches: a replay then takes the step's fallback, the launcher itself."""

    def relaunch(self, grid, stream, packed, values):  # noqa: ARG002
        return False


class _Packed:
    setters = ()


@pytest.fixture
def driver(monkeypatch, launches):
    """Launches that report a driver launch (so the strategy records them) and a current device and stream on the
    CPU; ``driver(pool)`` gives the pool replays and lanes.  Launches (the fallback of replayed ones too) are logged
    in ``launches``."""
    real = Launcher.__call__

    def reporting(self, grid, args, **kw):
        real(self, grid, args, **kw)
        return _Kernel(), _Packed()
    monkeypatch.setattr(Launcher, "__call__", reporting)
    monkeypatch.setattr(Launcher, "driver_ready", lambda self: True)
    monkeypatch.setattr(replay, "current_device_index", lambda: 0)
    monkeypatch.setattr(replay, "current_stream_handle", lambda index: 0)

    from fakes import give_replays

    return give_replays


def _new_rows(pool: HostKVPool, ref: HostKVPool, gen: torch.Generator) -> None:
    """Fresh device bytes in both pools (a replay must read what the device holds now)."""
    for name, ts in pool.test_dev.items():
        for t, r in zip(ts, ref.test_dev[name]):
            if t is not None:
                t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen))
                r.copy_(t)


@cpu_only
@pytest.mark.parametrize("layout", KERNELS)
def test_split_backups_on_the_replay_path(layout, driver, launches):
    """Through the replay path: a backup split is recorded and replayed launch for launch: by entries, the call's
    whole index tensors with each run's entries; by positions, each run's views of the index tensors (the same
    starts, lengths and grids as the normal path's).  The host holds what the reference writes after each call,
    device rows changed in between."""
    n = 48
    gen = torch.Generator().manual_seed(8)
    h, src = _pages(gen, n // 2), torch.arange(n)
    pool, _, _, row = _pools(layout, 0)
    k = pool.binding.scratch[pool.strategy_name].groups[0].entries(None).numel()
    inner = KERNELS[layout].entries_inner
    pool, ref, guards, _ = _pools(layout, 32 * k * row if inner else 2 * n * row)
    rp = driver(pool)
    first = None
    for call in range(3):
        _new_rows(pool, ref, gen)
        launches.clear()
        pool.backup_all_layers(h, src)
        ref.backup_all_layers(h, src)
        _same(pool, ref, guards, f"call {call}")
        got = [(grid, c["ents"].tolist(), c["host_idx"].tolist(), int(c["n"]), int(c["n_ents"]))
               for grid, c in launches]
        if first is None:
            first = got
            assert len(got) > 1
            continue
        assert rp.hits == call and got == first  # replayed: the same launches, entry or position runs included
        if inner:  # runs of positions (32, the cap): views of the call's index tensors, in order, covering them once
            assert [c["host_idx"].tolist() for _, c in launches] == [h[i:i + 32].tolist() for i in range(0, n, 32)]


@cpu_only
@pytest.mark.parametrize("layout", TWO)
def test_a_count_that_splits_never_replays_a_smaller_counts_launch(layout, driver, launches):
    """Steps recorded for a backup that fits one launch are not replayed for a later backup (new index tensors, a
    count of the same traits) that must be split: that one goes out in launches of at most ``launch_bytes``; nor are
    entry runs recorded for one count replayed for a count that takes runs of another length."""
    gen = torch.Generator().manual_seed(9)
    pool, _, _, row = _pools(layout, 0)
    k = pool.binding.scratch[pool.strategy_name].groups[0].entries(None).numel()
    pool, ref, guards, _ = _pools(layout, 16 * k * row)  # 16 positions fit one launch, 48 do not
    rp = driver(pool)
    h = _pages(gen, 24)
    inner = KERNELS[layout].entries_inner
    # fits; splits (runs of 1 entry / of 16 positions); splits otherwise (runs of 2 entries / of 16); each count
    # again with new tensors of the same traits: replayed only from steps of its own shape
    for n in (16, 48, 32, 16, 48, 32):
        launches.clear()
        pool.backup_all_layers(h[:n].clone(), torch.arange(n))
        ref.backup_all_layers(h[:n].clone(), torch.arange(n))
        _same(pool, ref, guards, f"{n}")
        limit = 16 * k * row
        moved = [int(c["n"]) * int(c["n_ents"]) * row for _, c in launches]
        assert max(moved) <= limit, (n, moved)
        per = k if n == 16 or inner else max(1, limit // (n * row))
        step = 16 if inner else n
        assert [(int(c["n_ents"]), int(c["n"])) for _, c in launches] == [
            (min(per, k - e), min(step, n - i)) for e in range(0, k, per) for i in range(0, n, step)], n
    assert rp.hits == 3  # each count's second call: replayed from its own steps


@pytest.mark.parametrize("layout", ["page_first", "page_first_kv_split"])
def test_position_runs_hold_whole_pages_of_a_size_that_is_not_a_power_of_two(layout, launches):
    """Pages of 24 tokens: runs of positions are multiples of lcm(16, the tile's tokens, 24) = 48, so each launch holds
    whole pages (its host writes sweep whole pages of every layer); a cap of 70 positions' rows gives runs of 48, and
    every byte lands as the reference puts it."""
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(3), kv_lora_rank=16, qk_rope_head_dim=4, dtype=torch.bfloat16,
                        page_size=24, capacity=96, device=DEVICE)
    gen = torch.Generator().manual_seed(12)
    dev = make_device_buffers(spec, Case("rows", lambda device: spec), gen)
    n = 96
    h = (torch.randperm(4, generator=gen)[:, None] * 24 + torch.arange(24)).reshape(-1)
    src = torch.arange(n)
    probe = HostKVPool(spec, layout, "kernel", {k: [t.clone() for t in v] for k, v in dev.items()}, registry=REGISTRY,
                       pin_memory=PIN, strategy_options={"tile_bytes": 256, "backup_launch_bytes": 0})
    (g,) = probe.binding.scratch[probe.strategy_name].groups
    k, row = g.entries(None).numel(), g.width * g.word
    host, guards = guarded_host_buffers(REGISTRY, spec, layout, pin_memory=PIN)
    pool = HostKVPool(spec, layout, "kernel", dev, registry=REGISTRY, host_buffers=host,
                      strategy_options={"tile_bytes": 256, "backup_launch_bytes": 70 * k * row})
    ref = HostKVPool(spec, layout, "reference", {k_: [t.clone() for t in v] for k_, v in dev.items()},
                     registry=REGISTRY, strategy="core.reference", pin_memory=False)
    fill_canary(pool)
    fill_canary(ref)
    launches.clear()
    pool.backup_all_layers(h, src)
    ref.backup_all_layers(h, src)
    assert [(c["host_idx"].tolist(), int(c["n_ents"])) for _, c in launches] == [
        (h[:48].tolist(), k), (h[48:].tolist(), k)]
    _same(pool, ref, guards, "pages of 24")


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_entry_runs_are_aligned_views_of_a_table_made_with_the_pool(layout, launches):
    """Entry runs come from a table built when the pool is (not made lazily on whatever stream runs the first split
    call, where another stream's call could read it before its copy lands): one per entries tensor of every group
    (all layers, each layer), none where no tuning splits; each run starts 16-byte aligned, as the whole tensor does."""
    pool, _, _, row = _pools(layout, 0)
    assert pool.binding.scratch[pool.strategy_name].tails == {}  # backup_launch_bytes=0: no tuning splits
    pool, ref, guards, _ = _pools(layout, 40 * row)
    prep = pool.binding.scratch[pool.strategy_name]
    want = {e.data_ptr() for g in prep.groups for e in [g.all_layers, *g.per_layer.values()] if e.numel()}
    assert set(prep.tails) == want
    assert not prep.slices  # nothing made lazily yet
    n = 32
    h = _pages(torch.Generator().manual_seed(13), n // 2)
    pool.backup_all_layers(h, torch.arange(n))
    ref.backup_all_layers(h, torch.arange(n))
    runs = [c["ents"] for _, c in launches]
    assert len(runs) > 1 and all(r.data_ptr() % 16 == 0 for r in runs)
    assert all(r.untyped_storage().data_ptr() == prep.tails[prep.groups[0].all_layers.data_ptr()]
               .untyped_storage().data_ptr() for r in runs)
    _same(pool, ref, guards, "runs of the table")


def test_a_run_of_positions_replays_views_of_the_batch_from_its_start():
    """A recorded step of a run of positions (``Step.span``) takes the batch's index addresses ``start`` elements on
    (each tensor's own element size) and the run's count, and its grid follows the count, not the call's; the
    fallback arguments are the same views; a step of the whole call takes the batch's values as they are."""
    h, d = torch.arange(100, dtype=torch.int32), torch.arange(100, dtype=torch.int64)
    b = replay.Batch(h, 0, (), d, 0, (), 0, h, d, 100, (), (h.data_ptr(), d.data_ptr(), 100))
    whole = replay.Step(None, None, (None, None, None, "x"), (0, 1, 2), 64, 4, 2, None, {}, (0, 0, 0, 7),
                        ((0, 0), (1, 1), (2, 2)))
    run = replace(whole, span=(32, 16))
    assert replay._resolve(whole, b)[1:] == (50, (h.data_ptr(), d.data_ptr(), 100, 7))
    assert replay._resolve(run, b)[1:] == (8, (h.data_ptr() + 32 * 4, d.data_ptr() + 32 * 8, 16, 7))
    shuffled = replace(run, where=((2, 0), (0, 1), (3, 2)), base=(0, 5, 0, 0))  # the batch values at other places
    assert replay._resolve(shuffled, b)[2] == (d.data_ptr() + 32 * 8, 5, h.data_ptr() + 32 * 4, 16)
    args = replay._args(run, b)
    assert args[0].data_ptr() == h.data_ptr() + 32 * 4 and args[0].tolist() == list(range(32, 48))
    assert args[1].tolist() == list(range(32, 48)) and args[2] == 16 and args[3] == "x"
    assert replay._args(whole, b)[:3] == [h, d, 100]


class _G:
    """A group whose entries tensor for every layer (``None``) and each layer are given."""

    def __init__(self, ents, per_layer=None):
        self.ents, self.per_layer = ents, per_layer or {}

    def entries(self, layer):
        return self.ents if layer is None else self.per_layer[layer]


@pytest.mark.parametrize("k", list(range(1, 12)) + [61, 64, 80, 160])
def test_entry_run_every_start_and_length(k):
    """Every run of every start: exactly the entries, 16-byte aligned, inside one row (never the padding, never
    crossing into the other row), a view of the table."""
    ents = (torch.randperm(4 * k)[:k] + 1).to(DEVICE)  # no zero entries: a padding zero read as an entry would show
    (table,) = entry_tails((_G(ents),), DEVICE).values()
    width = k + k % 2
    assert table.shape == (2, width) and table.is_contiguous()
    assert table[0, :k].tolist() == ents.tolist() and table[1, :k - 1].tolist() == ents[1:].tolist()
    assert not table[0, k:].any() and not table[1, k - 1:].any()  # padding zeros only past the entries
    base = table.data_ptr()
    for i in range(k):
        for length in range(1, k - i + 1):
            run = entry_run(table, i, length)
            assert run.numel() == length and run.is_contiguous()
            assert run.tolist() == ents[i:i + length].tolist(), (k, i, length)
            off = (run.data_ptr() - base) // 8
            row, col = divmod(off, width)
            assert run.data_ptr() % 16 == 0 and row == i % 2 and col + length <= width - (row == 1) * (k % 2 == 0)
            assert run.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()


def test_entry_tails_one_table_per_entries_tensor_all_layers_and_each():
    a, b = torch.tensor([3, 4, 5], device=DEVICE), torch.tensor([6], device=DEVICE)
    out = entry_tails((_G(a, {0: b}),), DEVICE)
    assert set(out) == {a.data_ptr(), b.data_ptr()}
    assert out[b.data_ptr()].shape == (2, 2) and out[b.data_ptr()][0, 0] == 6


def test_exact_shape_only_for_position_runs():
    assert not exact_shape(()) and not exact_shape(None)
    assert not exact_shape((None,)) and not exact_shape(((None,),)) and not exact_shape(((3, None),))
    assert exact_shape(((("positions", 40),),)) and exact_shape((None, (2, ("positions", 7))))


@pytest.mark.parametrize("layout", KERNELS)
def test_a_direction_that_never_splits_keys_its_steps_without_a_split(layout, monkeypatch):
    """The shipped tunings split backups only: a load's replay key carries no split shape (``None``, worked out with the
    pool, not per call), a backup's does; a pool whose backups never split works out none."""
    monkeypatch.setattr(replay, "current_device_index", lambda: 0)  # Replays of a CPU pool (made on CUDA only)
    pool, _, _, _ = _pools(layout, None)  # the plugin's tuning: backups in launches of at most 32 MiB
    prep = pool.binding.scratch[pool.strategy_name]
    assert rowcopy._splitting(prep.tuning) == (False, True)
    rp = pool.strategy._replays(pool.binding, prep, rowcopy._splitting(prep.tuning))
    assert rp.shape(48, 2, False) is None and rp.shape(48, None, False) is None
    assert rp.shape(48, None, True) == rowcopy.split_shape(prep, KERNELS[layout].entries_inner, 2, 48, None, True)
    pool, _, _, _ = _pools(layout, 0)
    prep = pool.binding.scratch[pool.strategy_name]
    assert rowcopy._splitting(prep.tuning) == (False, False)
    assert pool.strategy._replays(pool.binding, prep, (False, False)).shape is None


# -- programmatic dependent launches (backup_pdl) ----------------------------------------------------------
def test_pdl_options_are_checked_and_reach_the_backup_tuning():
    """``backup_pdl`` must be a bool (or ``None``: the tuning's, on in the shipped plugins); it sets the backups'
    ``Tuning.pdl`` only."""
    with pytest.raises(rowcopy.ConfigError, match="backup_pdl must be True, False or None"):
        LayerFirstKernelStrategy(backup_pdl=1)
    with pytest.raises(rowcopy.ConfigError, match="pdl must be True or False"):
        rowcopy.Tuning(1, 1, 1, pdl="yes")
    for cls in KERNELS.values():  # on by default, in backups only; backup_pdl=False turns it off
        t = cls().effective_tuning(torch.device("cpu"))
        assert t.backup.pdl and not t.load.pdl
        assert not cls(backup_pdl=False).effective_tuning(torch.device("cpu")).backup.pdl


@pytest.mark.parametrize("layout", TWO)
def test_pdl_is_off_on_the_cpu_and_for_kernels_that_do_not_declare_it(layout, launches):
    """On the CPU (Triton's interpreter, no griddepcontrol) a backup asked for PDL passes ``PDL`` 0 and makes
    plain launches, bit-exact (``PDL`` 0, an int as in a call in one launch, not ``False``: one compiled kernel for
    both); a kernel without a ``PDL`` parameter never gets dependent launches."""
    if DEVICE.type == "cuda":
        pytest.skip("the CPU's launches")
    n = 48
    h, src = _pages(torch.Generator().manual_seed(12), n // 2), torch.arange(n)
    pool, ref, guards, row = _pools(layout, 2 * n * 8, {"backup_pdl": True})
    pool.backup_all_layers(h, src)
    ref.backup_all_layers(h, src)
    _same(pool, ref, guards, "pdl asked on the CPU")
    assert len(launches) > 1 and all(type(c["PDL"]) is int and c["PDL"] == 0 for _, c in launches)
    prep = pool.binding.scratch[pool.strategy_name]
    assert not any(lv.pdl for per in prep.launches for lv in per.values())
    values = {"PDL": rowcopy_launch.PDL_CHAIN, **{name: 0 for name in rowcopy.LAUNCH_VALUES if name != "PDL"}}

    class NoPdl:  # a launcher of a kernel that declares no PDL
        arg_names = ("anchor", "n")

        def bind(self, v):
            return (v["anchor"], v["n"])

        def static_key(self, args, dynamic):
            return 0
    assert not rowcopy_launch._bound(NoPdl(), (), rowcopy.Tuning(1, 1, 1, pdl=True), 1, values).pdl


@pytest.mark.parametrize("layout", KERNELS)
def test_with_pdl_every_launch_after_a_calls_first_is_dependent(layout, monkeypatch):
    """Where PDL is on (forced here: the CPU has none), a split backup's launches pass ``PDL`` 2 (PDL_CHAIN: the next
    may begin) but the last, which passes 1 (PDL_LAST: it waits, never signals), and every one after the call's first
    is made with ``pdl=True``; a call in one launch is a plain one (``PDL`` 0); loads never take part."""
    monkeypatch.setenv("HICACHE_KERNEL_TMA", "0")
    monkeypatch.setenv("HICACHE_KERNEL_PAGES", "0")
    monkeypatch.setattr(rowcopy_launch, "dependent", lambda t, g: t.pdl)
    log = []
    monkeypatch.setattr(Launcher, "__call__", lambda self, grid, args, **kw: log.append(
        (dict(zip(self.arg_names, args))["PDL"], kw.get("pdl", False))))  # nothing runs: PDL has no interpreter
    n = 48
    h, src = _pages(torch.Generator().manual_seed(13), n // 2), torch.arange(n)
    pool, *_ = _pools(layout, 2 * n * 8, {"backup_pdl": True})
    pool.backup_all_layers(h, src)
    assert len(log) > 2 and log == [(2, False)] + [(2, True)] * (len(log) - 2) + [(1, True)], log
    log.clear()
    pool.backup_all_layers(h[:2], src[:2])  # fits one launch
    assert log == [(0, False)] * len(log) and log
    log.clear()
    pool.load_layer(0, h, src)
    assert log and all(not pdl and not dep for pdl, dep in log), log


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launches: CUDA, compute capability 9.0 and later")
@pytest.mark.parametrize("layout", KERNELS)
def test_pdl_split_backups_are_bit_exact_on_the_gpu(layout, monkeypatch):
    """Split backups with dependent launches move exactly the reference's bytes, call after call, canaries intact;
    with the same index tensors a call after the first is recorded from driver launches, the first plain and the
    rest through ``cuLaunchKernelEx`` with the programmatic attribute, and later calls replay those steps."""
    log, real = [], Launcher.__call__

    def spying(self, grid, args, **kw):  # returns what the launch returned: the strategy records driver launches
        log.append((dict(zip(self.arg_names, args))["PDL"], kw.get("pdl", False)))
        return real(self, grid, args, **kw)
    monkeypatch.setattr(Launcher, "__call__", spying)
    monkeypatch.setenv("HICACHE_KERNEL_TMA", "0")
    monkeypatch.setenv("HICACHE_KERNEL_PAGES", "0")
    n = 48
    gen = torch.Generator().manual_seed(14)
    h, src = _pages(gen, n // 2), torch.arange(n)
    hd, sd = h.to(DEVICE), src.to(DEVICE)
    pool, _, _, row = _pools(layout, 0)
    k = pool.binding.scratch[pool.strategy_name].groups[0].entries(None).numel()
    inner = KERNELS[layout].entries_inner
    pool, ref, guards, _ = _pools(layout, 16 * k * row if inner else n * row, {"backup_pdl": True})
    prep = pool.binding.scratch[pool.strategy_name]
    assert any(lv.pdl for per in prep.launches for lv in per.values())
    for call in range(4):
        _new_rows(pool, ref, gen)
        log.clear()
        pool.backup_all_layers(hd, sd)
        ref.backup_all_layers(h, src)
        _same(pool, ref, guards, f"call {call}")
        if call == 0:
            assert len(log) > 2 and log == [(2, False)] + [(2, True)] * (len(log) - 2) + [(1, True)], log
    if prep.replays is None or not replay.replay_enabled():
        return
    assert prep.replays.hits >= 1  # replayed the recorded driver launches
    (steps,) = prep.replays._steps.values()
    assert [st.kernel.pdl for st in steps] == [False] + [True] * (len(steps) - 1)
    assert [st.packed.config is not None for st in steps] == [False] + [True] * (len(steps) - 1)
