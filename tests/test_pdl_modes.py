"""The PDL modes (PDL_OFF / PDL_LAST / PDL_CHAIN, ``_Launch.split_launch``, ``_bound``), on the CPU:

* every launch the strategy makes (and every replay of it) passes a ``static_key`` that is exactly the key of its own
  arguments (the PDL constexpr included), and the ``pdl`` option exactly where the launch is not its call's first;
  (the existing tests log the PDL value and the ``pdl`` keyword only: a launch keyed with another mode's static key,
  hence another mode's compiled kernel, passed them);
* ``_bound``: one static key per PDL value, each the key of the arguments with that value;
* through the real :class:`~hicache_core.launch.Launcher` and a fake driver: every driver launch runs a kernel
  compiled with its own PDL constexpr and ``launch_pdl`` option, and its packed launch is its own (``packs`` holds one
  per (mode, dependent) pair, never shared by two compiled kernels);
* several launch groups with a kernel that splits by runs of positions (page_first, ``entries_inner``): each group's
  chain really splits (tests/test_pdl_launch.py's multi-group test moves ``page_size`` positions, which page_first
  never splits: it checks one-launch groups only there);
* ``drvlaunch._LaunchAttribute`` is 8-byte aligned, as cuda.h's (the change's alignment fix; nothing else checks it).
"""

from __future__ import annotations

import ctypes
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest  # noqa: E402

from hicache_core import HostKVPool, LayerMap, PoolSpec, drvlaunch  # noqa: E402
from hicache_core.launch import Launcher  # noqa: E402
from hicache_core.rowcopy_launch import PDL_CHAIN, PDL_LAST, PDL_OFF, _bound, _fill  # noqa: E402
from hicache_core.rowcopy_tuning import Tuning  # noqa: E402
from hicache_core.testing.conformance import Case, make_device_buffers  # noqa: E402
from test_drvlaunch import FakeLibEx, _compiled, _desc, driver_launcher  # noqa: E402
from test_launch_split import KERNELS, REGISTRY, _pages, _pools  # noqa: E402

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="a fake driver launch, for CPU runs")


@pytest.fixture
def checked(monkeypatch):
    """PDL forced on; every launch checked (its static key is its arguments' key) and logged as
    ``(anchor address, PDL value, pdl keyword, static key)``; each reports a driver launch, so calls record steps."""
    from fakes import fake_pdl_driver

    log: list = []

    def spy(launcher, grid, args, kw):
        values = dict(zip(launcher.arg_names, args))
        own = launcher.static_key(args, kw.get("dynamic", ()))
        assert kw["static_key"] == own, ("a launch keyed with another launch's static key", values["PDL"], kw)
        log.append((values["anchor"].data_ptr(), values["PDL"], kw.get("pdl", False), kw["static_key"]))
    fake_pdl_driver(monkeypatch, spy)
    return log


def _runs(log):
    runs: list[list] = []
    for entry in log:
        if not runs or runs[-1][0][0] != entry[0]:
            runs.append([])
        runs[-1].append(entry)
    return runs


def _chains_ok(log) -> bool:
    return all([(pdl, dep) for _, pdl, dep, _ in run] == ([(PDL_OFF, False)] if len(run) == 1 else
                                                          [(PDL_CHAIN, False)] + [(PDL_CHAIN, True)] * (len(run) - 2)
                                                          + [(PDL_LAST, True)])
               for run in _runs(log))


def _one_kernel_per_key(log) -> bool:
    """No (static key, pdl) pair is used with two PDL values (the Launcher would serve both one compiled kernel)."""
    seen: dict = {}
    return all(seen.setdefault((key, dep), pdl) == pdl for _, pdl, dep, key in log)


@CPU_ONLY
@pytest.mark.parametrize("layout", KERNELS)
def test_every_launch_is_keyed_by_its_own_pdl_value_recorded_and_replayed(layout, checked):
    from fakes import give_replays

    n = 48
    h, src = _pages(torch.Generator().manual_seed(31), n // 2), torch.arange(n)
    pool, *_ = _pools(layout, 2 * n * 8, {"backup_pdl": True})
    rp = give_replays(pool)
    pool.backup_all_layers(h, src)
    recorded = list(checked)
    assert max(len(r) for r in _runs(recorded)) > 2 and _chains_ok(recorded), recorded
    checked.clear()
    pool.backup_all_layers(h, src)  # replayed through the steps' fallbacks: the same keys
    assert rp.hits == 1 and checked == recorded
    pool.backup_all_layers(h[:2], src[:2])  # one launch: PDL_OFF, the launch's own key
    pool.load_layer(0, h, src)
    assert _one_kernel_per_key(checked), checked
    keys = {(pdl, dep): key for _, pdl, dep, key in checked}
    assert len({keys[(PDL_CHAIN, False)], keys[(PDL_LAST, True)], keys[(PDL_OFF, False)]}) == 3, keys


def _mha_groups(layout: str, ps: int):
    """An MHA pool of two launch groups (K rows of 8 halves, V rows of 4) whose backups split into many launches."""
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(3), head_num=2, head_dim=8, v_head_dim=4, dtype=torch.bfloat16,
                        page_size=ps, capacity=ps * 32, device=torch.device("cpu"))
    dev = make_device_buffers(spec, Case("groups", lambda device: spec), torch.Generator().manual_seed(5))
    return spec, HostKVPool(spec, layout, "kernel", dev, registry=REGISTRY, pin_memory=False,
                            strategy_options={"programs": 64, "tile_bytes": 256, "backup_launch_bytes": 1,
                                              "backup_pdl": True})


@CPU_ONLY
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_each_group_of_a_really_split_backup_chains_apart(layout, checked):
    """Several launch groups, each split into several launches (page_first by runs of positions, the others by runs
    of entries): every group's chain starts plain (PDL_CHAIN, no pdl) and ends with PDL_LAST; replays keep it."""
    from fakes import give_replays

    spec, pool = _mha_groups(layout, 4)
    prep = pool.binding.scratch[pool.strategy_name]
    assert len(prep.groups) > 1
    rp = give_replays(pool)
    n = spec.capacity // 2
    h, src = torch.arange(n) + n, torch.arange(n)
    pool.backup_all_layers(h, src)
    recorded = list(checked)
    runs = _runs(recorded)
    assert len(runs) == len(prep.groups) and all(len(r) > 2 for r in runs), [len(r) for r in runs]
    assert _chains_ok(recorded) and _one_kernel_per_key(recorded), recorded
    checked.clear()
    pool.backup_all_layers(h, src)
    assert rp.hits == 1 and checked == recorded


def test_bound_gives_each_pdl_value_the_key_of_its_arguments():
    """``_bound`` with PDL on: three distinct keys, keys[m] the static key of the arguments holding m, the launch's
    own key and arguments those of PDL_OFF; with PDL off (PDL_OFF, as ``_fixed_values`` passes it) the launch keeps
    the int PDL_OFF and no PDL keys."""

    class K:
        arg_names = ["anchor", "n", "W", "PDL"]
        constexprs = [2, 3]

    launcher = Launcher(K())
    values = {"anchor": torch.zeros(4), "n": None, "W": 8, "PDL": PDL_CHAIN}  # as _fixed_values passes PDL on
    lv = _bound(launcher, (1,), Tuning(1, 1, 1, pdl=True), 16, values)
    assert lv.pdl and lv.pdl_at == 3 and lv.args[3] == PDL_OFF and lv.key == lv.pdl_keys[PDL_OFF]
    assert len(set(lv.pdl_keys)) == 3
    for mode in (PDL_OFF, PDL_LAST, PDL_CHAIN):
        args = _fill(lv.args, lv.slots, {"n": 5})
        assert lv.pdl_keys[mode] == launcher.static_key(args[:3] + [mode], (1,))
    for i, last, mode, dep in ((0, 0, PDL_OFF, False), (0, 1, PDL_CHAIN, False), (1, 1, PDL_LAST, True),
                               (0, 3, PDL_CHAIN, False), (2, 3, PDL_CHAIN, True), (3, 3, PDL_LAST, True)):
        args = _fill(lv.args, lv.slots, {"n": 5})
        kw = lv.split_launch(args, i, last, {"static_key": lv.key})
        assert args[3] == mode and kw["static_key"] == launcher.static_key(args, (1,)) and kw.get("pdl", False) == dep
    off = _bound(launcher, (1,), Tuning(1, 1, 1), 16, {**values, "PDL": PDL_OFF})
    assert not off.pdl and type(off.args[3]) is int and off.args[3] == PDL_OFF and off.key == lv.key


# -- the real Launcher, a fake driver: each driver launch's compiled kernel and packed launch ------------------
class _ModeKernel:
    """A Triton-like kernel whose every compile has its own function handle, remembering the PDL constexpr and
    ``launch_pdl`` option it was compiled with."""

    arg_names = ["anchor", "desc", "none", "n", "PDL"]
    constexprs = [4]

    def __init__(self) -> None:
        self.compiles: dict[int, tuple] = {}

    def __getitem__(self, grid):
        def launch(*args, num_warps, **opts):
            fn = 0xF00 + 16 * len(self.compiles)
            self.compiles[fn] = (args[4], bool(opts.get("launch_pdl", False)))
            c = _compiled(sig={"anchor": "*i32", "desc": "tensordesc<i32[16, 32]>", "none": "constexpr", "n": "i32",
                               "PDL": "constexpr"}, launch_pdl=bool(opts.get("launch_pdl", False)))
            c.function = fn
            c.run = lambda *a: None
            c.packed_metadata = object()
            return c
        return launch


def test_driver_launches_run_the_kernel_of_their_own_mode_with_their_own_packs(monkeypatch):
    lib = FakeLibEx()
    monkeypatch.setattr(drvlaunch, "_LIB", [lib])
    kernel = _ModeKernel()
    with driver_launcher(kernel) as launcher:
        values = {"anchor": torch.zeros(4, dtype=torch.int32), "desc": _desc(torch.zeros(40 * 288, dtype=torch.int32)),
                  "none": None, "n": None, "PDL": PDL_CHAIN}
        lv = _bound(launcher, (3,), Tuning(1, 4, 1, pdl=True), 16, values)
        kw = dict(num_warps=4, static_key=lv.key, dynamic=(3,), maxnreg=None, packs=lv.packs)
        intended: dict[int, tuple] = {}
        n = 100
        for _ in range(3):  # a split of four launches, of two, and a plain call, three times (compiles first)
            for last in (3, 1, 0):
                for i in range(last + 1):
                    args = _fill(lv.args, lv.slots, {"n": n})
                    kw_i = lv.split_launch(args, i, last, kw)
                    launcher(2, args, **kw_i)
                    intended[n] = (args[4], kw_i.get("pdl", False))
                    n += 1
        assert sorted(set(kernel.compiles.values())) == [(PDL_OFF, False), (PDL_LAST, True), (PDL_CHAIN, False),
                                                         (PDL_CHAIN, True)]
        assert len(lib.launches) > 8
        for x in lib.launches:  # each driver launch: its own mode's compiled kernel, through Ex exactly when dependent
            mode, dep = intended[x["n"]]
            assert kernel.compiles[x["fn"]] == (mode, dep) and x.get("ex", False) == dep, (x, mode, dep)
        assert len(lv.packs) == 4 and len({id(p) for p in lv.packs.values()}) == 4
        for key, packed in lv.packs.items():  # key = ("static", device, warps, static key, maxnreg, pdl, ...)
            assert (packed.config is not None) == key[5]


def test_the_ctypes_launch_attribute_is_8_byte_aligned_as_cuda_h():
    attr = drvlaunch._LaunchAttribute
    assert ctypes.sizeof(attr) == 72 and ctypes.alignment(attr) == 8 and attr.value.offset == 8
    assert ctypes.sizeof(attr * 2) == 144
