"""Replays of backups split by runs of positions (``Step.span``).

The fake driver here does what the CUDA driver does with a replayed step's values: it takes the *addresses* and
counts that :func:`hicache_core.replay._resolve` computed, finds the storages they point into (asserting every view
lies inside one: an index run read past its tensor is an out-of-bounds read on a GPU), rebuilds the kernel's
arguments from them and runs the real kernel under Triton's interpreter.  So unlike tests/test_launch_split.py's
fake (whose relaunch always declines, so replays take ``_args``), a wrong start offset, element size, count or grid
in ``_resolve`` shows up here as wrong host bytes or a launch log that differs from the normal path's.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported


import pytest  # noqa: E402

from hicache_core import HostKVPool, replay  # noqa: E402
from hicache_core.launch import Launcher  # noqa: E402
from hicache_core.replay import Replays  # noqa: E402

from test_launch_split import _new_rows, _pages, _same, launches  # noqa: E402,F401
from test_launch_split import _pools as _split_pools  # noqa: E402

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="a fake driver launch, for CPU runs")

#: (layout, strategy options): one group (latent+rope fused, rows of 40 B) or two groups of other row bytes and tile
#: tokens (latent 32 B / 8 tokens, rope 8 B / 32 tokens), whose runs of positions differ in one call
CASES = {"page_first": ("page_first", {}),
         "kv_split": ("page_first_kv_split", {}),
         "kv_split_unfused": ("page_first_kv_split", {"fuse_parts": False})}
CAP = 3600  # bytes per launch: fused all-layer runs of 16; unfused: latent runs of 16, rope runs of 64


def _pools(layout: str, opts: dict):
    """test_launch_split's pools, launches of at most ``CAP`` bytes (and as many programs as work items)."""
    return _split_pools(layout, CAP, {"programs": 4096, **opts})[:3]


class _Packed:
    """What a launch packed: its first arguments (the static ones stay), the dynamic positions, the call options."""

    def __init__(self, launcher, args, kw):
        self.launcher, self.args, self.kw = launcher, list(args), kw
        self.setters = tuple((pos, None, isinstance(args[pos], torch.Tensor)) for pos in kw["dynamic"])


class _AddressKernel:
    """Relaunches from addresses and counts only, as cuLaunchKernel would."""

    def __init__(self, world):
        self.world = world

    def relaunch(self, grid, stream, packed, values):  # noqa: ARG002
        w = self.world
        if w.decline:
            return False
        names = packed.launcher.arg_names
        by_name = {names[pos]: v for (pos, _, _), v in zip(packed.setters, values)}
        args = list(packed.args)
        for (pos, _, is_ptr), v in zip(packed.setters, values):
            if is_ptr:
                length = by_name["n_ents" if names[pos] == "ents" else "n"]
                args[pos] = w.view(v, length, packed.args[pos].dtype, names[pos])
            else:
                args[pos] = v
        w.relaunches += 1
        w.real(packed.launcher, grid, args, **packed.kw)  # logged in ``launches`` as a normal launch is
        return True


class _World:
    def __init__(self, real):
        self.real, self.storages, self.relaunches, self.decline = real, {}, 0, False

    def keep(self, args, dynamic):
        for pos in dynamic:
            a = args[pos]
            if isinstance(a, torch.Tensor):
                s = a.untyped_storage()
                self.storages[s.data_ptr()] = s

    def view(self, addr, length, dtype, name):
        es = torch.empty(0, dtype=dtype).element_size()
        for base, s in self.storages.items():
            if base <= addr < base + s.nbytes() or (length == 0 and addr == base + s.nbytes()):
                assert (addr - base) % es == 0, (name, "misaligned address")
                off = (addr - base) // es
                assert addr + length * es <= base + s.nbytes(), (name, "reads past its tensor", off, length)
                return torch.empty(0, dtype=dtype).set_(s, off, (length,), (1,))
        raise AssertionError(f"{name}: address {addr:#x} lies in no tensor a launch was given")


@pytest.fixture
def driver(monkeypatch, launches):
    """Launches report a driver launch (so the strategy records them); replays relaunch from addresses."""
    real = Launcher.__call__  # the ``launches`` fixture's logging launch
    world = _World(real)

    def reporting(self, grid, args, **kw):
        real(self, grid, args, **kw)
        world.keep(args, kw.get("dynamic", ()))
        return _AddressKernel(world), _Packed(self, args, kw)
    monkeypatch.setattr(Launcher, "__call__", reporting)
    monkeypatch.setattr(Launcher, "driver_ready", lambda self: True)
    batch = Replays.batch

    def seen(self, *a, **kw):  # what a replay reads lies in the batch's tensors (as the kernels read them)
        b = batch(self, *a, **kw)
        if b is not None:
            world.keep([b.h, b.d], (0, 1))
        return b
    monkeypatch.setattr(Replays, "batch", seen)
    monkeypatch.setattr(replay, "current_device_index", lambda: 0)
    monkeypatch.setattr(replay, "current_stream_handle", lambda index: 0)

    from fakes import give_replays

    def give(pool: HostKVPool) -> Replays:
        return give_replays(pool)
    give.world = world
    return give


def _log(launches):
    return [(grid, c["ents"].tolist(), c["host_idx"].tolist(), c["dev_idx"].tolist(), int(c["n"]), int(c["n_ents"]))
            for grid, c in launches]


def _backup(pool, ref, layer, h, src):
    if layer is None:
        pool.backup_all_layers(h, src)
        ref.backup_all_layers(h, src)
    else:
        pool.backup_layer(layer, h, src)
        ref.backup_layer(layer, h, src)


@cpu_only
# the index dtypes matter on the address path (element sizes); the fallback (``_args``' views) once
@pytest.mark.parametrize("dtypes, decline", [((torch.int64, torch.int64), False), ((torch.int32, torch.int64), False),
                                             ((torch.int64, torch.int32), False), ((torch.int64, torch.int64), True)],
                         ids=["i64-relaunch", "i32-i64-relaunch", "i64-i32-relaunch", "i64-fallback"])
@pytest.mark.parametrize("case", CASES)
def test_position_runs_replayed_from_addresses_move_the_reference_bytes(case, dtypes, decline, driver, launches):
    """All-layer and per-layer backups split by runs of positions (the last run shorter; two groups with other runs
    where unfused), each repeated with fresh device rows: replays (driver relaunch from addresses, or the fallback
    launch with ``_args``' views) launch exactly what the normal path launched (grids, index runs, counts) and the
    host holds the reference's bytes, with no index read outside its tensor."""
    layout, opts = CASES[case]
    pool, ref, guards = _pools(layout, opts)
    rp = driver(pool)
    driver.world.decline = decline
    gen = torch.Generator().manual_seed(11)
    n = 120  # all layers: fused 16 x 7 + 8; unfused latent 16 x 7 + 8, rope 64 + 56; one layer: fused 80 + 40,
    #          unfused latent 112 + 8, rope one launch
    h, src = _pages(gen, n // 2).to(dtypes[0]), torch.arange(n, dtype=dtypes[1])
    for layer in (None, 0, 3):
        first = None
        for call in range(3):
            _new_rows(pool, ref, gen)
            launches.clear()
            hits = rp.hits
            _backup(pool, ref, layer, h, src)
            _same(pool, ref, guards, f"{case} layer {layer} call {call}")
            got = _log(launches)
            if first is None:
                first = got
                assert len({c[4] for c in got}) > 1 and any(c[4] < n for c in got), got  # split by positions
                assert rp.hits == hits
                continue
            assert rp.hits == hits + 1, (layer, call)
            assert got == first, (layer, call)
    assert (driver.world.relaunches > 0) != decline


@cpu_only
@pytest.mark.parametrize("case", CASES)
def test_counts_of_the_same_traits_never_share_position_steps(case, driver, launches):
    """40 and 56 positions have the same traits (both 8 mod 16, int32, not 1) but other runs (16+16+8 against
    16+16+16+8): each count records and replays its own steps; a count's new tensors replay its steps."""
    layout, opts = CASES[case]
    pool, ref, guards = _pools(layout, opts)
    rp = driver(pool)
    gen = torch.Generator().manual_seed(12)
    runs = {}
    for i, (n, want) in enumerate(((40, 1), (40, 2), (56, 1), (56, 2), (40, 2), (56, 2))):
        _new_rows(pool, ref, gen)
        launches.clear()
        h = _pages(gen, n // 2)
        hits = rp.hits
        _backup(pool, ref, None, h, torch.arange(n))
        _backup(pool, ref, None, h, torch.arange(n))  # same tensors again: replayed when recorded
        _same(pool, ref, guards, f"{case} n {n} ({i})")
        counts = [int(c["n"]) for _, c in launches]
        half = len(counts) // 2
        assert counts[:half] == counts[half:] and sum(counts[:half]) == n * len(pool.binding.scratch[
            pool.strategy_name].groups), (n, counts)
        runs.setdefault(n, counts[:half])
        assert counts[:half] == runs[n]
        assert rp.hits == hits + want, (i, n)  # a count's first tensors record, every later call replays
    assert runs[40] != runs[56]


@cpu_only
def test_steps_of_exact_counts_are_bounded_oldest_first(driver, launches, monkeypatch):
    """Structure and bytes: the steps of position runs are recorded per exact count (``split_shape`` gives
    ``("positions", n)``), and an engine's counts vary, so a pool keeps at most ``MAX_EXACT`` such keys, dropping the
    oldest recorded first; keys of calls in one launch are kept (few: layers, directions, traits).  A dropped count's
    next call records again and the one after replays, moving the reference's bytes."""
    monkeypatch.setattr(replay, "MAX_EXACT", 2)
    pool, ref, guards = _pools("page_first", {})
    rp = driver(pool)
    gen = torch.Generator().manual_seed(13)
    h16 = _pages(gen, 8)
    _backup(pool, ref, None, h16, torch.arange(16))  # fits one launch (18 positions of 5 x 40 B fit 3600 B)
    tensors = {n: _pages(gen, n // 2) for n in (34, 40, 46)}  # all split, into runs of 16
    for n in (34, 40, 46):
        _backup(pool, ref, None, tensors[n], torch.arange(n))
        _backup(pool, ref, None, tensors[n], torch.arange(n))
    _same(pool, ref, guards, "counts")
    shapes = [k[3] for k in rp._steps]
    assert shapes == [((None,),), ((("positions", 40),),), ((("positions", 46),),)]  # 34 dropped first
    hits = rp.hits
    _new_rows(pool, ref, gen)
    _backup(pool, ref, None, tensors[34], torch.arange(34))  # recorded again (46 stays, 40 goes)
    assert rp.hits == hits
    _backup(pool, ref, None, tensors[34], torch.arange(34))
    assert rp.hits == hits + 1
    _same(pool, ref, guards, "34 again")
    assert [k[3] for k in rp._steps] == [((None,),), ((("positions", 46),),), ((("positions", 34),),)]
    _backup(pool, ref, None, h16, torch.arange(16))  # the one-launch key was kept: replayed
    assert rp.hits == hits + 2


@cpu_only
def test_one_count_of_per_layer_backups_keeps_every_layer_recorded(driver, launches, monkeypatch):
    """The bound counts exact counts, not keys: per-layer backups of one count split by positions record one key per
    layer, and with more layers than ``MAX_EXACT`` (here 2, for 32 against a 61- or 80-layer model) the second round
    still replays every layer (a bound on keys evicted each layer's steps before its next call)."""
    monkeypatch.setattr(replay, "MAX_EXACT", 2)
    pool, ref, guards = _pools("page_first", {})
    rp = driver(pool)
    gen = torch.Generator().manual_seed(21)
    n = 120  # one layer: runs of positions (80 + 40)
    h, src = _pages(gen, n // 2), torch.arange(n)
    for rnd in range(2):
        _new_rows(pool, ref, gen)
        for layer in (0, 1, 2):
            _backup(pool, ref, layer, h, src)
        _same(pool, ref, guards, f"round {rnd}")
    assert rp.hits == 3 and list(rp._exact) == [n] and len(rp._exact[n]) == 3


@cpu_only
def test_a_new_count_past_the_bound_drops_every_key_of_the_count_recorded_longest_ago(driver, launches, monkeypatch):
    """With room for one count: per-layer backups of a second count drop the first count's keys of every layer
    together; the first count's next calls record again (no replay), the ones after replay; bytes right throughout."""
    monkeypatch.setattr(replay, "MAX_EXACT", 1)
    pool, ref, guards = _pools("page_first", {})
    rp = driver(pool)
    gen = torch.Generator().manual_seed(22)
    first, second = (_pages(gen, 60), torch.arange(120)), (_pages(gen, 52), torch.arange(104))
    for h, src in (first, second):
        for layer in (0, 1, 2):
            _backup(pool, ref, layer, h, src)
    assert list(rp._exact) == [104] and all(k in rp._steps for k in rp._exact[104])
    assert not [k for k in rp._steps if k[0] in (0, 1, 2) and ("positions", 120) in k[3][0]]
    hits = rp.hits
    for rnd in range(2):
        _new_rows(pool, ref, gen)
        for layer in (0, 1, 2):
            _backup(pool, ref, layer, *first)
        _same(pool, ref, guards, f"first count again, round {rnd}")
        assert rp.hits == hits + 3 * rnd, rnd
    assert list(rp._exact) == [120]
