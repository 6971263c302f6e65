"""Backups of whole pages as flat words in a plugin's own kernel (``layer_first``'s and ``page_first``'s ``KERNEL``
with ``PAGES``, ``page_first_direct`` where a layer's page is one run;
``kernel_lib.page_backup``; ``rowcopy_pages.backup_reason``): which groups take them, and byte for byte what the
reference backend writes, canaries and guard bytes untouched, with any indices a shapes-validated call may pass.
On CPU the kernels run in Triton's interpreter."""

import dataclasses
import importlib
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest  # noqa: E402

from hicache_core import HostKVPool, LayerMap, PoolSpec, rowcopy_pages  # noqa: E402
from hicache_core.errors import ConfigError  # noqa: E402
from hicache_core.registry import create_registry  # noqa: E402
from hicache_core.rowcopy import PAGE_BACKUP_TUNING, KernelTuning  # noqa: E402
from hicache_core.testing.conformance import CASES, Case, check_strategy, make_device_buffers  # noqa: E402
from test_place_probe import PB_CASES, PB_IDS, PB_ROWS, pb_any_indices  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
REGISTRY = create_registry()
CASE = {c.id: c for c in CASES}
LF = "layer_first.kernel"


def _lf():  # the plugin's modules (imported once the interpreter is set)
    from hicache_layer_first import kernels, strategy

    return kernels, strategy


def _mla(ps: int, rows: str, cap_pages: int = 8, layers: int = 2) -> PoolSpec:
    dtype, lora, rope, row_bytes = PB_ROWS[rows]
    return PoolSpec.mla(layer_map=LayerMap.unsharded(layers), kv_lora_rank=lora, qk_rope_head_dim=rope, dtype=dtype,
                        page_size=ps, capacity=ps * cap_pages, row_bytes=row_bytes, device=DEVICE)


def _pool(spec: PoolSpec, options: dict | None = None, case: Case | None = None, host=None,
          layout: str = "layer_first") -> HostKVPool:
    dev = make_device_buffers(spec, case or Case("rows", lambda device: spec), torch.Generator().manual_seed(3))
    return HostKVPool(spec, layout, "kernel", dev, registry=REGISTRY, host_buffers=host,
                      pin_memory=DEVICE.type == "cuda" and host is None, strategy_options=options or {})


def _pages_by_group(pool: HostKVPool) -> list[bool]:
    """Per group, whether its backups launch with ``PAGES`` (and its loads never)."""
    prep = pool.binding.scratch[pool.strategy_name]
    names = prep.launcher.arg_names
    out = []
    for by_dir in prep.launches:
        values = {to_host: dict(zip(names, by_dir[to_host].args)) for to_host in (True, False)}
        assert not values[False]["PAGES"]
        out.append(bool(values[True]["PAGES"]))
    return out


# -- which groups --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ps,rows,want", [
    (64, "fp8-656", True), (64, "fp8-576", True), (32, "bf16-1152", True),  # 656, 576, 1152 B rows: measured
    (64, "bf16-576", True),  # 576 B bf16 rows (256 + 32 elements)
    (16, "fp8-656", False), (16, "bf16-1152", False),  # pages of 10.5 and 18 KiB: under PAGE_BACKUP_MIN_PAGE_BYTES
    (1, "fp8-656", False)])
@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_automatic_page_backups_take_narrow_rows_in_large_pages(monkeypatch, ps, rows, want, layout):
    """Automatic: rows of at most 1152 bytes in pages of at least 36 KiB (what was measured ahead of the row kernel);
    loads never; ``page_backups=True`` takes every packed group of pages of 2 tokens or more, ``False`` none."""
    spec = _mla(ps, rows, cap_pages=2, layers=2)
    monkeypatch.setattr(rowcopy_pages, "AUTO_PAGE_BACKUPS", True)  # (whatever the shipped switches)
    monkeypatch.setattr(type(REGISTRY.resolve(spec, layout, "kernel").strategy), "auto_page_backups", True)
    assert _pages_by_group(_pool(spec, layout=layout)) == [want]
    assert _pages_by_group(_pool(spec, {"page_backups": True}, layout=layout)) == [ps > 1]
    assert _pages_by_group(_pool(spec, {"page_backups": False}, layout=layout)) == [False]


def test_token_major_page_first_keeps_row_backups(monkeypatch):
    """``page_first`` (``[S, L, row]``): a token's rows of every layer are contiguous, so a layer's page is no run of
    words: its backups stay on rows even with ``page_backups=True``, and say why."""
    monkeypatch.setattr(rowcopy_pages, "AUTO_PAGE_BACKUPS", True)
    spec = _mla(64, "fp8-656", cap_pages=2, layers=2)
    for options in ({}, {"page_backups": True}):
        pool = _pool(spec, options, layout="page_first")
        assert _pages_by_group(pool) == [False]
        group = pool.binding.scratch["page_first.kernel"].groups[0]
        assert "host token stride" in rowcopy_pages.backup_reason(group, 64)


def test_automatic_page_backups_can_be_switched_off(monkeypatch):
    """``AUTO_PAGE_BACKUPS`` off: unset ``page_backups`` backs up by rows (and says why), ``True`` still by pages."""
    monkeypatch.setattr(rowcopy_pages, "AUTO_PAGE_BACKUPS", False)
    spec = _mla(64, "fp8-656", cap_pages=2, layers=1)
    pool = _pool(spec)
    assert _pages_by_group(pool) == [False] and _pages_by_group(_pool(spec, {"page_backups": True})) == [True]
    assert "AUTO_PAGE_BACKUPS" in rowcopy_pages.backup_reason(pool.binding.scratch[LF].groups[0], 64, automatic=True)
    _, strat = _lf()
    layout = REGISTRY.layout("layer_first")
    assert "backups of whole pages" not in " ".join(strat.LayerFirstKernelStrategy().describe(spec, layout))
    assert "backups of whole pages where" in " ".join(
        strat.LayerFirstKernelStrategy(page_backups=True).describe(spec, layout))


def test_mha_rows_keep_row_backups_unless_asked(monkeypatch):
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(1), head_num=8, head_dim=128, dtype=torch.bfloat16,
                        page_size=64, capacity=128, device=DEVICE)
    monkeypatch.setattr(rowcopy_pages, "AUTO_PAGE_BACKUPS", True)
    pool = _pool(spec)
    assert _pages_by_group(pool) == [False]  # 2048-byte rows: not measured, the row kernel's 0.95-0.97
    assert "2048-byte rows" in rowcopy_pages.backup_reason(pool.binding.scratch[LF].groups[0], 64, automatic=True)
    assert _pages_by_group(_pool(spec, {"page_backups": True})) == [True]


def test_page_backups_take_their_own_tuning_and_the_backup_options(monkeypatch):
    """Page backups launch with ``KernelTuning.page_backup`` (4 programs, no fence, no dependent launches), which takes
    ``backup_programs``, ``programs``, ``backup_launch_bytes`` and the shared overrides as row backups do."""
    _, strat = _lf()
    cpu = torch.device("cpu")
    cls = strat.LayerFirstKernelStrategy
    t = cls().effective_tuning(cpu).page_backup
    assert t == dataclasses.replace(PAGE_BACKUP_TUNING, programs=t.programs) and not t.fence and not t.pdl
    assert cls(backup_programs=6, num_warps=8, backup_launch_bytes=0).effective_tuning(cpu).page_backup == \
        dataclasses.replace(PAGE_BACKUP_TUNING, programs=6, num_warps=8, launch_bytes=0)
    assert cls(3).effective_tuning(cpu).page_backup.programs == 3
    monkeypatch.setattr(rowcopy_pages, "AUTO_PAGE_BACKUPS", True)
    spec = _mla(64, "fp8-656", cap_pages=2, layers=1)
    pool = _pool(spec, {"backup_programs": 5})
    prep = pool.binding.scratch[pool.strategy_name]
    lv = prep.launches[0][True]
    values = dict(zip(prep.launcher.arg_names, lv.args))
    assert lv.tuning == dataclasses.replace(PAGE_BACKUP_TUNING, programs=5)
    assert values["FENCE"] is False and values["PDL"] == 0 and values["PAGE_SIZE"] == 64
    assert values["PAGE_TOKENS"] == 64 and values["PAGE_CHUNK"] == PAGE_BACKUP_TUNING.tile_bytes // pool.binding.scratch[
        pool.strategy_name].groups[0].word
    assert pool.strategy.launch_grid(pool.binding, 128, None, to_host=True) <= 5


@pytest.mark.parametrize("bad", [1, "yes", 0.0])
def test_page_backups_option_is_checked(bad):
    _, strat = _lf()
    with pytest.raises(ConfigError, match="page_backups must be True, False or None"):
        strat.LayerFirstKernelStrategy(page_backups=bad)


def test_page_backups_true_on_a_plugin_without_them_is_a_config_error():
    """``page_backups=True`` where the tuning has no ``page_backup`` (or the kernel no ``PAGES``) fails at pool set-up,
    naming the option; unset, the same pool backs up by rows."""
    spec = _mla(64, "fp8-656", cap_pages=2, layers=1)
    dev = make_device_buffers(spec, Case("rows", lambda device: spec), torch.Generator().manual_seed(3))
    with pytest.raises(ConfigError, match="page_backups"):
        HostKVPool(spec, "page_first_kv_split", "kernel", dev, registry=REGISTRY, pin_memory=DEVICE.type == "cuda",
                   strategy_options={"page_backups": True})
    _, strat = _lf()
    no_tuning = type("NoPageBackups", (strat.LayerFirstKernelStrategy,),
                     {"tuning": KernelTuning(strat.TUNING.backup, strat.TUNING.load)})
    with pytest.raises(ConfigError, match="page_backups"):
        no_tuning(page_backups=True).prepare(_pool(spec).binding)


@pytest.mark.parametrize("ps,rows,why", [
    (1, "fp8-656", "one token"), (2048, "fp8-656", "more than 1024"), (16, "fp8-656", "automatic page backups"),
    (16, "bf16-1152", "automatic page backups")])
def test_backup_reason_names_what_keeps_a_group_on_rows(monkeypatch, ps, rows, why):
    monkeypatch.setattr(rowcopy_pages, "AUTO_PAGE_BACKUPS", True)
    spec = _mla(ps, rows, cap_pages=1, layers=1)
    g = _pool(spec, {"page_backups": False}).binding.scratch[LF].groups[0]
    assert why in rowcopy_pages.backup_reason(g, ps, automatic=True)


@pytest.mark.parametrize("kind", ["strided", "split"])
def test_backup_reason_refuses_rows_not_packed_on_either_side(kind):
    """Device rows wider than the row (a part of them in this host buffer) or host rows of two parts: never flat."""
    spec = _mla(64, "bf16-576", cap_pages=1, layers=1)
    case = Case("rows", lambda device: spec, strided=kind == "strided", split_parts=kind == "split")
    pool = _pool(spec, {"page_backups": True}, case)
    groups = pool.binding.scratch[LF].groups
    assert _pages_by_group(pool) == [False] * len(groups)
    assert all("packed" in rowcopy_pages.backup_reason(g, 64) for g in groups)


def test_explain_states_page_backups(monkeypatch):
    monkeypatch.setattr(rowcopy_pages, "AUTO_PAGE_BACKUPS", True)
    _, strat = _lf()
    spec = _mla(64, "fp8-656", cap_pages=1, layers=1)
    layout = REGISTRY.layout("layer_first")
    text = " ".join(strat.LayerFirstKernelStrategy().describe(spec, layout))
    assert "backups of whole pages of rows of <= 1152 B in pages of >= 36 KiB" in text and "page_backups" in text
    assert "(here: rows of 656 B (pages of 41 KiB)) where" in text, text  # this pool's rows meet them
    assert "backups of whole pages" not in " ".join(
        strat.LayerFirstKernelStrategy(page_backups=False).describe(spec, layout))


@pytest.mark.parametrize("shape,ps,want", [("fp8-656", 16, "here: none (rows of 656 B in pages of 10.25 KiB)"),
                                           ("bf16-576", 64, "here: rows of 576 B (pages of 36 KiB)"),
                                           ("bf16-1152", 32, "here: rows of 1152 B (pages of 36 KiB)")])
def test_explain_states_whether_this_pools_rows_meet_the_automatic_bounds(monkeypatch, shape, ps, want):
    """The automatic clause names this pool's packed host rows and whether they meet its bounds, pages in KiB as the
    bound is (10.25 KiB pages of 656 B rows do not; 36 KiB pages of 576 B rows, the page bound itself, do; so do 36
    KiB pages of 1152 B rows, both bounds); MHA's 2 KiB rows never do."""
    monkeypatch.setattr(rowcopy_pages, "AUTO_PAGE_BACKUPS", True)
    _, strat = _lf()
    spec = _mla(ps, shape, cap_pages=1, layers=1)
    layout = REGISTRY.layout("layer_first")
    assert f"({want}) where" in " ".join(strat.LayerFirstKernelStrategy().describe(spec, layout))
    mha = PoolSpec.mha(layer_map=LayerMap.unsharded(1), head_num=8, head_dim=128, dtype=torch.bfloat16, page_size=64,
                       capacity=128, device=DEVICE)
    want_mha = "here: none (rows of 2048 B in pages of 128 KiB)"
    assert rowcopy_pages.automatic_backup_fit(layout.plan(mha), 64) == want_mha


@pytest.mark.parametrize("ps,want", [(1, "here: none (pages of one token are single rows)"),
                                     (2048, "here: none (pages of more than 1024 tokens)"),
                                     (64, "here: rows of 656 B (pages of 41 KiB)")])
def test_automatic_backup_fit_refuses_the_page_sizes_backup_reason_does(monkeypatch, ps, want):
    """Pages of one token, or of more than ``MAX_PAGE_TOKENS``: the clause takes no rows, as :func:`backup_reason`
    takes no group (``describe`` names no page backups there at all), whatever the pages' bytes."""
    monkeypatch.setattr(rowcopy_pages, "AUTO_PAGE_BACKUPS", True)
    spec = _mla(ps, "fp8-656", cap_pages=1, layers=1)
    assert rowcopy_pages.automatic_backup_fit(REGISTRY.layout("page_first_direct").plan(spec), ps) == want
    g = _pool(spec, {"page_backups": False}).binding.scratch[LF].groups[0]
    assert (rowcopy_pages.backup_reason(g, ps, automatic=True) is None) is want.startswith("here: rows")


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_explain_names_no_rows_of_a_component_on_no_layer_of_this_rank(monkeypatch, layout):
    """A layer-sharded rank whose pool has a component of other layers only (576-byte rows, which the bounds would
    take): its rows move nothing here, so the clause names the owned component's rows alone."""
    from hicache_core.spec import Component

    monkeypatch.setattr(rowcopy_pages, "AUTO_PAGE_BACKUPS", True)
    spec = PoolSpec.mla(layer_map=LayerMap.sharded_cp(4, 2, 1), kv_lora_rank=512, qk_rope_head_dim=64,
                        dtype=torch.bfloat16, page_size=64, capacity=128, device=DEVICE,
                        extra=(Component("e", 576, torch.uint8, layers=(0,)),))
    assert not spec.component_map("e").device_layers
    strategy = REGISTRY.resolve(spec, layout, "kernel").strategy
    monkeypatch.setattr(type(strategy), "auto_page_backups", True)
    text = " ".join(strategy.describe(spec, REGISTRY.layout(layout)))
    assert "(here: rows of 1152 B (pages of 72 KiB)) where" in text, text
    plan = REGISTRY.layout(layout).plan(spec)
    assert rowcopy_pages.automatic_backup_fit(plan, 64) == "here: rows of 576, 1152 B (pages of 36, 72 KiB)"


def test_shipped_switches_take_page_backups_on_layer_first_and_page_first_direct_alone():
    """As shipped (no switch patched): ``layer_first`` and ``page_first_direct`` back up MLA fp8 656-byte rows in pages
    of 64 as whole pages and ``hicache explain`` says so; token-major ``page_first`` keeps them opt-in."""
    from hicache_layer_first.strategy import LayerFirstKernelStrategy
    from hicache_page_first.strategy import PageFirstDirectKernelStrategy, PageFirstKernelStrategy

    assert rowcopy_pages.AUTO_PAGE_BACKUPS
    assert LayerFirstKernelStrategy.auto_page_backups and PageFirstDirectKernelStrategy.auto_page_backups
    assert not PageFirstKernelStrategy.auto_page_backups
    spec = _mla(64, "fp8-656", cap_pages=2, layers=2)
    for layout in ("layer_first", "page_first_direct"):
        assert _pages_by_group(_pool(spec, layout=layout)) == [True], layout
        text = " ".join(REGISTRY.resolve(spec, layout, "kernel").strategy.describe(spec, REGISTRY.layout(layout)))
        assert "(here: rows of 656 B (pages of 41 KiB)) where" in text, text
    one = _mla(64, "fp8-656", cap_pages=2, layers=1)  # one host layer: its rows packed, yet opt-in
    assert _pages_by_group(_pool(one, layout="page_first")) == [False]
    assert _pages_by_group(_pool(one, {"page_backups": True}, layout="page_first")) == [True]


@pytest.mark.parametrize("layout,layers,ps,want", [("page_first_direct", 3, 64, True), ("page_first", 3, 64, False),
                                                   ("page_first", 1, 64, True), ("layer_first", 1, 1, False),
                                                   ("layer_first", 1, 2048, False)])
def test_explain_states_page_backups_only_where_host_rows_are_packed(monkeypatch, layout, layers, ps, want):
    """``hicache explain`` names page backups for ``page_first_direct`` (a layer's page one run) and not for
    token-major ``page_first`` of several layers, whose host rows are strided by every layer, nor for pages of one
    token or of more than ``MAX_PAGE_TOKENS`` (never taken)."""
    from hicache_core.rowcopy import RowKernelStrategy

    monkeypatch.setattr(rowcopy_pages, "AUTO_PAGE_BACKUPS", True)
    spec = _mla(ps, "fp8-656", cap_pages=1, layers=layers)
    strategy = REGISTRY.resolve(spec, layout, "kernel").strategy
    assert isinstance(strategy, RowKernelStrategy)
    monkeypatch.setattr(type(strategy), "auto_page_backups", True)
    text = " ".join(strategy.describe(spec, REGISTRY.layout(layout))) + " ".join(
        type(strategy)(page_backups=True).describe(spec, REGISTRY.layout(layout)))
    assert ("backups of whole pages" in text) is want, text


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_a_strategy_may_keep_its_page_backups_opt_in(monkeypatch, caplog, layout):
    """``auto_page_backups = False`` on a strategy class (a plugin whose page backups have not run on a GPU):
    ``page_backups`` unset backs up by rows, logs why and ``hicache explain`` names no page backups; ``True`` still
    takes them."""
    monkeypatch.setattr(rowcopy_pages, "AUTO_PAGE_BACKUPS", True)
    spec = _mla(64, "fp8-656", cap_pages=2, layers=2)
    cls = type(REGISTRY.resolve(spec, layout, "kernel").strategy)
    monkeypatch.setattr(cls, "auto_page_backups", False)
    with caplog.at_level("INFO", logger="hicache_core.rowcopy"):
        assert _pages_by_group(_pool(spec, layout=layout)) == [False]
    assert "opt-in (page_backups=True)" in caplog.text
    assert _pages_by_group(_pool(spec, {"page_backups": True}, layout=layout)) == [True]
    assert "backups of whole pages" not in " ".join(cls().describe(spec, REGISTRY.layout(layout)))
    assert "backups of whole pages" in " ".join(cls(page_backups=True).describe(spec, REGISTRY.layout(layout)))


# -- bytes ---------------------------------------------------------------------------------------------------------
KERNELS = {"layer_first": "hicache_layer_first.kernels", "page_first_direct": "hicache_page_first.kernels",
           "page_first": "hicache_page_first.kernels"}


@pytest.mark.parametrize("ps,rows,device_rows,layers,index_dtype,options", PB_CASES, ids=PB_IDS)
@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_page_backups_with_any_indices_write_the_valid_pairs_alone(monkeypatch, launches, layout, ps, rows,
                                                                    device_rows, layers, index_dtype, options):
    """``layer_first.kernel`` and ``page_first_direct.kernel`` with ``page_backups=True`` called as with validation off
    (device-resident indices under ``validate="shapes"``): every pair in range moves byte for byte as the reference
    backend moves it, nothing else changes (canaries, guard bytes around host buffers and device allocations),
    whatever the page size, rows, layer map, index dtype and launch split (``test_place_probe.pb_any_indices``);
    pages whose slots and rows are runs go flat (under the interpreter the row path moves exactly the other pages'
    valid pairs, each once), groups refused go by rows."""
    kernels = importlib.import_module(KERNELS[layout])

    def make(spec, dev, host, opts):
        return HostKVPool(spec, layout, "kernel", dev, registry=REGISTRY, host_buffers=host,
                          strategy_options={"page_backups": True, **opts})
    pool, moved, row_pairs, valid, entries = pb_any_indices(monkeypatch, launches, make, ps, rows, device_rows,
                                                            layers, index_dtype, options, layout=layout)
    flat = _pages_by_group(pool)
    assert flat == [device_rows == "packed" and ps > 1] * len(flat)
    assert {k for k, _, _ in launches} == {kernels.KERNEL}
    assert {bool(c["PAGES"]) for _, _, c in launches} == set(flat)
    if moved is not None:
        assert moved == (row_pairs if all(flat) else valid) * entries, (moved, row_pairs, entries)


@pytest.mark.parametrize("ps,rows,layers,index_dtype,options", [
    (64, "fp8-656", "one", torch.int64, {}), (64, "fp8-656", "one", torch.int32, {"backup_launch_bytes": 1}),
    (3, "fp8-656", "one", torch.int64, {"tile_bytes": 256}), (16, "bf16-576", "sharded-one", torch.int32, {}),
    (4, "fp8-576", "sharded-one-padded", torch.int64, {}), (16, "fp8-656", "unsharded", torch.int64, {})],
    ids=["ps64-one", "ps64-one-i32-launch-per-page", "ps3-one-tile256", "ps16-sharded-one-i32",
         "ps4-sharded-one-padded", "ps16-three-layers"])
def test_token_major_page_first_backs_up_pages_of_one_host_layer_alone(monkeypatch, launches, ps, rows, layers,
                                                                       index_dtype, options):
    """Token-major ``page_first`` (``[S, L, row]``) with ``page_backups=True``: where the component has one host layer
    (one layer, or a shard owning one unpadded) its rows are packed and a page is one run, so pages go flat (and, in
    launches of runs of tokens, every run holds whole pages); a padded shard of one owned layer (host layers 2) or
    several layers stay on rows.  Byte for byte as the reference backend, whatever the indices."""
    kernels = importlib.import_module(KERNELS["page_first"])

    def make(spec, dev, host, opts):
        return HostKVPool(spec, "page_first", "kernel", dev, registry=REGISTRY, host_buffers=host,
                          strategy_options={"page_backups": True, **opts})
    pool, moved, row_pairs, valid, entries = pb_any_indices(monkeypatch, launches, make, ps, rows, "packed", layers,
                                                            index_dtype, options, layout="page_first")
    one = pool.binding.spec.layer_map.host_layer_num == 1
    assert _pages_by_group(pool) == [one and ps > 1]
    assert {k for k, _, _ in launches} == {kernels.KERNEL} and {bool(c["PAGES"]) for _, _, c in launches} == {one}
    if options.get("backup_launch_bytes") == 1:
        assert len(launches) > 1 and all(c["n"] % ps == 0 for _, _, c in launches[:-1])
    if moved is not None:
        assert moved == (row_pairs if one else valid) * entries, (moved, row_pairs, entries)


@pytest.mark.parametrize("split", [False, True], ids=["default launches", "a launch per entry"])
@pytest.mark.parametrize("case", [c.id for c in CASES])
@pytest.mark.parametrize("layout", list(KERNELS))
def test_page_backups_conform_on_every_case(monkeypatch, launches, layout, case, split):
    """The conformance round trip of every case through the ``layout``'s kernel strategy with ``page_backups=True``:
    all-layer backups in the default launches or a launch per layer entry, then per-layer backups with 32-bit indices
    of the last host page (token-major ``page_first``: every group on rows, its pages being no runs)."""
    from hicache_core.testing import conformance

    options = {"page_backups": True, **({"backup_launch_bytes": 1} if split else {})}
    real = conformance.HostKVPool

    def pool(*args, **kw):
        if args[2] == "kernel" or kw.get("io_backend") == "kernel":
            kw["strategy_options"] = options
        return real(*args, **kw)
    monkeypatch.setattr(conformance, "HostKVPool", pool)
    flat = _pages_by_group(check_strategy(REGISTRY, CASE[case], layout, "kernel", device=DEVICE))
    check_strategy(REGISTRY, CASE[case], layout, "kernel", device=DEVICE, variant="last-page-i32-dev",
                   per_layer_backup=True, seed=1)
    if layout == "page_first" and CASE[case].build(DEVICE).layer_map.host_layer_num > 1:
        assert not any(flat)
    backups = [c for _, _, c in launches if c.get("TO_HOST")]
    assert backups and not any(c.get("PAGES") for _, _, c in launches if not c.get("TO_HOST"))
    assert {bool(c["PAGES"]) for c in backups} == set(flat)  # every group as its launch says, each taken
    if split and layout != "page_first":  # (token-major page_first splits by runs of tokens, every layer in each)
        assert {c["n_ents"] for c in backups} == {1}


_PTX = r"""
import json, sys
sys.path.insert(0, "dev")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hicache_layer_first import kernels as lf
from hicache_page_first import kernels as pf

INT32 = ("n", "n_ents", "capacity", "dev_rows")
out = {}
# (kernel, PAGES, TO_HOST, PAGE_SIZE, TOKENS, WIDTH, VEC): 656-byte rows in 8-byte words in pages of 64 and 3,
# 1152-byte rows and 16 KiB rows in pages of 1024 (a page of 1024 steps: a loop, not unrolled, or this compiles for
# minutes); page_first's kernel (page_first_direct) with and without PAGES, and with PAGES for token-major page_first
# ("pfi", ENTRIES_INNER: a component of one host layer, its rows packed)
for name, pages, to_host, ps, tokens, width, vec in (
        ("lf", True, True, 64, 16, 82, 2), ("lf", True, True, 3, 32, 82, 2), ("lf", True, True, 32, 16, 144, 2),
        ("lf", False, True, 64, 16, 82, 2), ("lf", True, False, 64, 16, 82, 2), ("lf", True, True, 1024, 1, 2048, 2),
        ("pf", True, True, 64, 16, 82, 2), ("pf", False, True, 64, 16, 82, 2), ("pfi", True, True, 64, 16, 82, 2)):
    fn = lf.KERNEL if name == "lf" else pf.KERNEL
    consts = dict(WIDTH=width, BLOCK=min(512, 1 << (width - 1).bit_length()), TOKENS=tokens, VEC=vec, TO_HOST=to_host,
                  STAGES=1, FENCE=False, PDL=0, PAGES=pages, PAGE_SIZE=ps, PAGE_TOKENS=1 << (ps - 1).bit_length(),
                  PAGE_CHUNK=2048 if pages else 1, **({} if name == "lf" else {"ENTRIES_INNER": name == "pfi"}))
    names = fn.arg_names
    sig = {a: "constexpr" if a in consts else "i32" if a in INT32 else "*i64" for a in names}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in names if sig[a].startswith("*")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    out[f"pages{int(pages)} to_host{int(to_host)} ps{ps} width{width} {name}"] = sorted(
        {w for line in ptx.splitlines() for w in line.split()[:2] if w.startswith(("ld.global.v", "st.global.v"))})
print(json.dumps(out))
"""


def test_the_kernels_compile_for_sm90_with_page_backups_in_wide_words(tmp_path):
    """``layer_first``'s ``KERNEL`` (and ``page_first``'s, pages of 64) compiles for sm_90 outside the interpreter with
    ``PAGES`` (pages of 64 and of 3 tokens, 656- and 1152-byte rows; 16 KiB rows in pages of 1024, within the test's
    time) and without: with the pointers aligned as a launch has them, page backups move their flat pages in 16-byte
    vectors; row backups of 656-byte rows (82 words, VEC 2) move 16-byte vectors too, and ``PAGES`` on a load is the
    row kernel's load (the same accesses)."""
    from fakes import compiled_json

    ops = compiled_json(_PTX, tmp_path, timeout=900)
    assert len(ops) == 9, ops
    for key, found in ops.items():
        want = ["ld.global.v2.b64", "st.global.v2.b64"] if key.startswith("pages1 to_host1") else []
        assert found == want, (key, found)
