"""What every row-copy kernel strategy shares (hicache_core.rowcopy, kernel_lib, launch by name), tested once,
on every plugin strategy built on it where kernels run.  Layout specifics: plugins/*/tests/test_*_kernel.py."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import importlib, inspect, itertools, subprocess, sys, types  # noqa: E401,E402
from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from hicache_core import (Addressing, BufferSpec, Component, HostBufferError, HostKVPool, HostPlan, LayerMap,  # noqa
                          PoolSpec, Segment, StrategyInfo, create_registry, kernel_lib as kl, rowcopy_launch)
from hicache_core.errors import ConfigError  # noqa: E402
from hicache_core.kernel_support import ENV_PROGRAMS  # noqa: E402
from hicache_core.launch import Launcher  # noqa: E402
from hicache_core.rowcopy import (DYNAMIC_VALUES, LAUNCH_VALUES, MAX_BLOCK_BYTES, MAX_TOKENS, KernelTuning,  # noqa
                                  RowKernelStrategy, Tuning, build_groups, tile)
from hicache_core.testing.conformance import (CANARY, Case, assert_guards_intact, check_strategy, fill_canary,  # noqa
                                              guarded_host_buffers, make_device_buffers)
from hicache_kv_split.strategy import KVSplitKernelStrategy  # noqa: E402
from hicache_layer_first.strategy import LayerFirstKernelStrategy  # noqa: E402
from hicache_page_first.strategy import PageFirstDirectKernelStrategy, PageFirstKernelStrategy  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PIN = DEVICE.type == "cuda"
REGISTRY = create_registry()
#: layout -> the row-copy kernel strategy serving it
KERNELS = {"layer_first": LayerFirstKernelStrategy, "page_first": PageFirstKernelStrategy,
           "page_first_direct": PageFirstDirectKernelStrategy, "page_first_kv_split": KVSplitKernelStrategy}
_sync = torch.cuda.synchronize if PIN else (lambda: None)


def _rand(rows: int, nbytes: int, gen: torch.Generator, *, lead: int = 0) -> torch.Tensor:
    """``[rows, nbytes]`` random device bytes starting ``lead`` bytes into their storage."""
    flat = torch.randint(0, 256, (lead + rows * nbytes,), dtype=torch.uint8, generator=gen).to(DEVICE)
    return flat[lead:].view(rows, nbytes)


def _mla(lmap=LayerMap.unsharded(3), ps=2, cap=8, extra=()) -> PoolSpec:
    """MLA rows of 32 + 8 bytes (``latent`` + ``rope``, bf16)."""
    return PoolSpec.mla(layer_map=lmap, kv_lora_rank=16, qk_rope_head_dim=4, dtype=torch.bfloat16, page_size=ps,
                        capacity=cap, device=DEVICE, extra=extra)


def _kv(row: int, lmap=LayerMap.unsharded(2), ps=4, cap=8, device=DEVICE) -> PoolSpec:
    """One ``kv`` row of ``row`` bytes (uint8)."""
    return PoolSpec("mla", (Component("kv", row, torch.uint8),), lmap, ps, cap, device)


def _device(spec: PoolSpec, gen: torch.Generator) -> dict:
    """Random rows ``0 .. 2 * capacity + page_size - 1`` of every layer holding a component."""
    return make_device_buffers(spec, Case("rows", lambda device: spec), gen)


def _bytes(bufs: dict) -> dict:
    return {k: [None if t is None else t.view(torch.uint8).cpu().clone() for t in v] for k, v in bufs.items()}


# -- host side: tiles, tuning, groups, words ----------------------------------------------------------------
@pytest.mark.parametrize("width, split, word, tile_bytes, want", [
    (72, 72, 8, 32768, (128, 1, 32)),  # a 576-byte row: one 1 KiB column step, 32 tokens fill 32 KiB
    (5, 4, 8, 32768, (4, 1, 256)),  # fused latent + rope: both parts' steps count, tokens capped
    (600, 512, 8, 4096, (512, 128, 1)),  # a tile smaller than one row step still moves one token
    (8192, 8192, 1, 1 << 20, (4096, 1, 256)),  # column steps capped at MAX_BLOCK_BYTES
])
def test_tile(width, split, word, tile_bytes, want):
    assert tile(width, split, word, tile_bytes) == want


def test_tile_invariants():
    pow2 = lambda x: x & (x - 1) == 0  # noqa: E731
    for width, half, word, tile_bytes in itertools.product((1, 2, 3, 5, 72, 82, 513, 4097), (False, True),
                                                           (1, 2, 4, 8), (1, 4096, 65536)):
        split = max(1, width // 2) if half else width
        block, block_b, tokens = tile(width, split, word, tile_bytes)
        step = block + (block_b if split < width else 0)
        assert all(map(pow2, (block, block_b, tokens))) and 1 <= tokens <= MAX_TOKENS
        assert block * word <= MAX_BLOCK_BYTES and block >= min(split, MAX_BLOCK_BYTES // word)
        assert tokens == 1 or tokens * step * word <= tile_bytes


@pytest.mark.parametrize("make, kw, match", [
    (Tuning, {"programs": 0}, "programs"), (Tuning, {"num_warps": 3}, "power of two"),
    (Tuning, {"tile_bytes": True}, "tile_bytes"), (Tuning, {"programs": 2.0}, "programs"),
    *[(LayerFirstKernelStrategy, {"programs": bad}, "programs") for bad in (0, -1, 2.5, True, "x")],
    *[(LayerFirstKernelStrategy, {"backup_programs": bad}, "backup_programs") for bad in (0, 2.5, "x")],
    (LayerFirstKernelStrategy, {"num_warps": 6}, "power of two"),
    (LayerFirstKernelStrategy, {"tile_bytes": 0}, "tile_bytes"),
    (LayerFirstKernelStrategy, {"tile_bytes": 1 << 24}, "at most 1048576"),  # Triton's largest tensor
    (Tuning, {"tile_bytes": (1 << 20) + 1}, "tile_bytes must be at most"),
    *[(LayerFirstKernelStrategy, {"num_stages": bad}, rf"^num_stages must be a positive int, got {bad!r}$")
      for bad in (0, True, 2.5)],
    *[(LayerFirstKernelStrategy, {"maxnreg": bad}, "maxnreg") for bad in (0, True, 32.0)],
    *[(Tuning, {"launch_bytes": bad}, rf"^launch_bytes must be an int >= 0, got {bad!r}$") for bad in (-1, True, 1.5)],
    *[(LayerFirstKernelStrategy, {"backup_launch_bytes": bad}, "^backup_launch_bytes must be an int >= 0")
      for bad in (-1, True, 2.5, "x")]])
def test_tuning_and_options_are_validated(make, kw, match):
    with pytest.raises(ConfigError, match=match):  # a ValueError too
        make(**{**({"programs": 1, "num_warps": 4, "tile_bytes": 1024} if make is Tuning else {}), **kw})


@pytest.mark.parametrize("cls", KERNELS.values(), ids=list(KERNELS))
def test_effective_tuning_option_beats_environment_beats_default(monkeypatch, cls):
    cpu, t = torch.device("cpu"), cls.tuning
    monkeypatch.delenv(ENV_PROGRAMS, raising=False)
    assert cls().effective_tuning(cpu) == t
    assert t.backup.programs < t.load.programs  # loads are latency-bound: more programs in flight
    assert t.tma_load is not None and t.tma_load.programs <= 4  # TMA loads: a few programs, bulk copies in flight
    assert t.page_load is not None  # every in-tree plugin offers page loads (its groups decide where they apply)
    every = lambda **kw: KernelTuning(*(None if x is None else replace(x, **kw)  # noqa: E731
                                        for x in (t.backup, t.load, t.tma_load, t.page_load, t.page_backup)))
    monkeypatch.setenv(ENV_PROGRAMS, "5")
    assert cls().effective_tuning(cpu) == every(programs=5)
    opts = {"num_warps": 2, "tile_bytes": 1024, "maxnreg": 96}
    assert cls(7, **opts).effective_tuning(cpu) == every(programs=7, **opts)
    # backup_programs bounds backups alone (page backups too), over the option and the environment
    pb = lambda p: None if t.page_backup is None else replace(t.page_backup, programs=p)  # noqa: E731
    assert cls(7, backup_programs=3).effective_tuning(cpu) == replace(every(programs=7),
                                                                       backup=replace(t.backup, programs=3),
                                                                       page_backup=pb(3))
    assert cls(backup_programs=2).effective_tuning(cpu) == replace(every(programs=5),
                                                                    backup=replace(t.backup, programs=2),
                                                                    page_backup=pb(2))
    # on CUDA the environment and the defaults are capped at 4x the SMs; an explicit option is taken as given
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(multi_processor_count=1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the cap applies where CUDA is there to ask
    cuda, cap = torch.device("cuda", 0), lambda x: replace(x, programs=min(x.programs, 4))  # noqa: E731
    assert cls(100).effective_tuning(cuda).load.programs == 100
    assert cls().effective_tuning(cuda) == every(programs=4)
    monkeypatch.delenv(ENV_PROGRAMS)
    assert cls().effective_tuning(cuda) == KernelTuning(cap(t.backup), cap(t.load), cap(t.tma_load), cap(t.page_load),
                                                        None if t.page_backup is None else cap(t.page_backup))
    for bad in ("abc", "+-5", "--3", "\u00b2", "2.5", "0", "-3"):  # never a raw ValueError from int()
        monkeypatch.setenv(ENV_PROGRAMS, bad)
        with pytest.raises(ConfigError, match=ENV_PROGRAMS):
            cls().effective_tuning(cpu)
    monkeypatch.setenv(ENV_PROGRAMS, " +7 ")
    assert cls().effective_tuning(cpu).load.programs == 7


def _groups(spec, layout, dev):
    pool = HostKVPool(spec, layout, "reference", dev, registry=REGISTRY)
    return build_groups(pool.binding, fuse_parts=False, strategy="test")


def test_groups_merge_rows_of_one_word_and_width():
    gen = torch.Generator().manual_seed(0)
    mha = lambda vd=None: PoolSpec.mha(layer_map=LayerMap.unsharded(3), head_num=2, head_dim=8, v_head_dim=vd,  # noqa
                                       dtype=torch.float16, page_size=2, capacity=8, device=DEVICE)
    (g,) = _groups(mha(), "layer_first", _device(mha(), gen))
    assert (g.names, g.width, g.split, g.all_layers.tolist()) == (("k", "v"), 4, 4, list(range(6)))
    assert {d: e.tolist() for d, e in g.per_layer.items()} == {0: [0, 3], 1: [1, 4], 2: [2, 5]}
    assert [(g.names, g.width) for g in _groups(mha(4), "layer_first", _device(mha(4), gen))] == [(("k",), 4),
                                                                                                  (("v",), 2)]
    dsa = _mla(extra=(Component("index_k", 16, torch.uint8, layers=(0, 2)),))
    kv, idx = _groups(dsa, "layer_first", _device(dsa, gen))
    assert (kv.names, idx.names, sorted(idx.per_layer), idx.entries(1)) == (("kv",), ("index_k",), [0, 2], None)
    assert idx.entries(None).tolist() == [0, 1] and idx.entries(2).tolist() == [1]


@pytest.mark.parametrize("row, lead, word, vec", [(32, 0, 8, 2), (32, 8, 8, 1), (24, 0, 8, 1), (64, 4, 4, 1),
                                                  (576, 2, 2, 1), (576, 1, 1, 1), (6, 0, 2, 1)])
def test_access_word_and_vector_width(row, lead, word, vec):
    """The widest word dividing every size, stride and address; VEC only when every row base is 16-byte aligned."""
    gen = torch.Generator()
    (g,) = _groups(_kv(row), "layer_first", {"kv": [_rand(16, row, gen, lead=lead) for _ in range(2)]})
    assert (g.word, g.width * g.word, g.vec) == (word, row, vec)


def test_vector_width_looks_at_every_layer_not_only_the_anchor():
    """The anchor layer's rows are 16-byte aligned, the other layer's start 8 bytes off: one misaligned base takes
    the vector hint away from the whole group (a wide access there would be misaligned on the GPU)."""
    gen = torch.Generator()
    (g,) = _groups(_kv(32), "layer_first", {"kv": [_rand(16, 32, gen, lead=0), _rand(16, 32, gen, lead=8)]})
    assert (g.word, g.vec) == (8, 1)


# -- launch values by name -----------------------------------------------------------------------------------
class _FakeKernel:
    def __init__(self, *names: str) -> None:
        self.arg_names = list(names)


def test_launch_values_are_bound_by_parameter_name(monkeypatch):
    launcher = Launcher(_FakeKernel("anchor", "n", "WIDTH"))
    assert launcher.bind({"WIDTH": 4, "n": 3, "anchor": "a", "unused": 0}) == ("a", 3, 4)
    assert launcher.positions(["WIDTH", "n", "not_declared"]) == (1, 2)
    with pytest.raises(TypeError, match="no value for kernel parameter 'n'"):
        launcher.bind({"anchor": "a", "WIDTH": 4})
    for cls in KERNELS.values():  # every plugin kernel takes only launch values, and all the dynamic ones
        names = set(Launcher(importlib.import_module(cls.kernel_module).KERNEL).arg_names)
        assert names <= set(LAUNCH_VALUES) and set(DYNAMIC_VALUES) <= names, cls.name
    # RowKernelStrategy.prepare refuses a kernel declaring a parameter the launch does not provide
    monkeypatch.setitem(sys.modules, "fake_row_kernels", types.SimpleNamespace(KERNEL=_FakeKernel("anchor", "bogus")))
    monkeypatch.setattr(rowcopy_launch, "_LAUNCHERS", {})  # the launcher cache, where _launcher looks it up

    class Bogus(LayerFirstKernelStrategy):
        name, kernel_module = "test.bogus", "fake_row_kernels"

    spec = _mla()
    pool = HostKVPool(spec, "layer_first", "reference", _device(spec, torch.Generator()), registry=REGISTRY,
                      pin_memory=PIN)
    with pytest.raises(ConfigError, match=r"fake_row_kernels.KERNEL declares \['bogus'\]"):
        Bogus().prepare(pool.binding)
    monkeypatch.setitem(sys.modules, "fake_row_kernels", types.SimpleNamespace(KERNEL=_FakeKernel("anchor", "host_pages")))
    with pytest.raises(ConfigError, match=r"declares \['host_pages'\].*\(did you mean: host_page[,?]"):
        Bogus().prepare(pool.binding)


def test_paged_kernels_split_pages_by_the_constexpr_page_size():
    """A row kernel that pages its host rows takes ``PAGE_SIZE`` (a constant: shifts), never the runtime ``page_size``
    (every thread dividing each of its tile's rows in 64 bits held page_first_direct's fp8 656-byte backups to half
    the link: benchmarks/backup_place_probe.py); the launch passes the pool's page size for it."""
    paged = 0
    for cls in KERNELS.values():
        kernel = importlib.import_module(cls.kernel_module).KERNEL
        names = Launcher(kernel).arg_names
        if "host_page" in names:
            paged += 1
            assert "PAGE_SIZE" in names and "page_size" not in names, cls.name
            assert "constexpr" in str(inspect.signature(kernel.fn).parameters["PAGE_SIZE"].annotation), cls.name
    assert paged >= 3  # page_first, page_first_direct, page_first_kv_split
    spec = _mla()
    assert rowcopy_launch._fixed_values(spec, types.SimpleNamespace(anchor=None, rows=1, vec=1), {},
                                        Tuning(1, 1, 1))["PAGE_SIZE"] == spec.page_size


# -- supports, and no Triton before a pool is prepared ------------------------------------------------------
def test_supports_explains_rejections(monkeypatch):
    class Rows(RowKernelStrategy):
        name, layouts, kernel_module, tuning = "test.rows", ("chunked",), "unused", LayerFirstKernelStrategy.tuning

    spec, row = _kv(64, LayerMap.unsharded(1), 1, 4), 64
    a = Addressing(0, 4 * row, row, row, row // 2, row)  # rows in two chunks
    plan = HostPlan((BufferSpec("kv", (1, 4, row), torch.uint8),), (Segment("kv", "kv", None, 0, row, a),))
    chunked = types.SimpleNamespace(name="chunked", description="", check=lambda s: None, plan=lambda s: plan)
    why = ("segment 'kv' stores its 64-byte rows in 32-byte chunks 64 bytes apart (start to start); test.rows moves "
           "whole contiguous rows: a Segment per chunk (its src_offset and width) makes each chunk such a row")
    assert Rows().supports(spec, chunked) == why
    # a row of one chunk is whole and contiguous whatever its chunk_stride (a plan written for H heads, used with 1)
    one = HostPlan(plan.buffers, (Segment("kv", "kv", None, 0, row, Addressing(0, 4 * row, row, row, row, 4 * row)),))
    single = types.SimpleNamespace(name="chunked", description="", check=lambda s: None, plan=lambda s: one)
    assert Rows().supports(spec, single) is None
    assert Rows().supports(spec, REGISTRY.layout("page_first")) == "test.rows serves layout(s) 'chunked', not " \
                                                                   "'page_first'"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cpu = _kv(64, LayerMap.unsharded(1), 1, 4, "cpu")
    assert "need a CUDA device (or TRITON_INTERPRET=1 on CPU)" in Rows().supports(cpu, chunked)


def test_registration_and_resolution_import_no_triton():
    # resolution, not a kernel run: Triton 3.6's interpreter (refused by interpreter_problem) does not matter here
    code = ("import sys, torch, hicache_core as h, hicache_core.kernel_support as ks; "
            "ks.interpreter_problem = lambda: None; reg = h.create_registry(); "
            "plugins = ('hicache_layer_first', 'hicache_page_first', 'hicache_kv_split'); "
            "assert not [m for m in sys.modules if m.startswith(plugins) and m.endswith('.strategy')]; "
            "spec = h.PoolSpec.mla(layer_map=h.LayerMap.unsharded(2), kv_lora_rank=16, qk_rope_head_dim=4, "
            "dtype=torch.bfloat16, page_size=2, capacity=8); "
            f"assert all(reg.try_resolve(spec, layout, 'kernel')[0] for layout in {list(KERNELS)}); "
            "assert 'hicache_kv_split.strategy' in sys.modules and 'triton' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "TRITON_INTERPRET": "1"})


# -- device side --------------------------------------------------------------------------------------------
@triton.jit
def _walk(ents, n, n_ents, out, TOKENS: tl.constexpr, ENTRIES_INNER: tl.constexpr):
    pid, nprog = kl.programs()
    n_tiles, n_items = kl.work_size(n, n_ents, TOKENS)
    for item in range(pid, n_items, nprog):
        e, t = kl.work_item(item, ents, n_tiles, n_ents, ENTRIES_INNER)
        tl.store(out + 2 * item, e)
        tl.store(out + 2 * item + 1, t)


@pytest.mark.parametrize("inner", [True, False], ids=["entries-inner", "entries-outer"])
def test_work_items_walk_entries_inner_or_outer(inner):
    ents, out = [7, 3, 5], torch.full((9, 2), -1, dtype=torch.int64, device=DEVICE)
    _walk[(2,)](torch.tensor(ents, device=DEVICE), 10, 3, out, TOKENS=4, ENTRIES_INNER=inner)  # 3 tiles, 1 partial
    want = [(e, t) for t in range(3) for e in ents] if inner else [(e, t) for e in ents for t in range(3)]
    assert [tuple(p) for p in out.tolist()] == want


def _rows_case(row: int, lmap=LayerMap.unsharded(2), strided=False) -> Case:
    return Case(f"{row}B" + "-sharded-strided" * strided, lambda device: _kv(row, lmap, 3, 12, device), strided)


@pytest.mark.parametrize("case, word", [(_rows_case(3), 1), (_rows_case(6), 2), (_rows_case(12), 4),
                                        (_rows_case(40), 8),
                                        (_rows_case(24, LayerMap.sharded_cp(5, 2, 0, pad_to_largest=True), True), 1)],
                         ids=lambda x: x.id if isinstance(x, Case) else f"word{x}")
@pytest.mark.parametrize("layout", KERNELS)
def test_every_access_word_round_trips(layout, case, word):
    """Bit-exact against the reference with 1-, 2-, 4- and 8-byte words and 3-token pages (odd strides: word 1)."""
    pool = check_strategy(REGISTRY, case, layout, "kernel", variant="offset-view-i32-dev", device=DEVICE,
                          strategy=KERNELS[layout].name)
    assert {g.word for g in pool.binding.scratch[pool.strategy_name].groups} == {word}


def test_a_row_of_one_chunk_ignores_its_chunk_stride():
    """A plan that gives one-chunk rows an odd chunk_stride (written for several heads, used with one) is served by the
    kernel bit-exact, with the access word its other sizes allow (the stride is never stepped)."""
    from fakes import odd_stride_layout
    from hicache_core import hookimpl

    class Kernel(LayerFirstKernelStrategy):
        name, layouts = "test.odd_stride", ("layer_first_odd_stride",)

    class Plugin:
        @hookimpl
        def hicache_register_layouts(self, register):  # type: ignore[no-untyped-def]
            register(odd_stride_layout())

        @hookimpl
        def hicache_register_strategies(self, register):  # type: ignore[no-untyped-def]
            register(StrategyInfo("test.odd_stride", "kernel", ("layer_first_odd_stride",), Kernel, (False, True)))

    reg = create_registry(plugins=[("odd", Plugin())])
    pool = check_strategy(reg, _rows_case(40), "layer_first_odd_stride", "kernel", variant="shuffled-i64",
                          device=DEVICE, strategy="test.odd_stride")
    assert {g.word for g in pool.binding.scratch[pool.strategy_name].groups} == {8}


@pytest.mark.parametrize("stride_zero", [False, True], ids=["stride=chunk", "stride=0"])
def test_a_row_in_chunks_that_follow_each_other_is_a_whole_row(stride_zero):
    """A plan describing each contiguous row as several chunks that follow each other (chunk_stride equal to
    chunk_bytes, or 0) is served by the kernel bit-exact with the access word of the whole row (the kernels refused
    it, although the copy engine took such rows whole)."""
    from fakes import chunked_rows_layout
    from hicache_core import hookimpl

    class Kernel(LayerFirstKernelStrategy):
        name, layouts = "test.chunked", ("layer_first_chunked",)

    class Plugin:
        @hookimpl
        def hicache_register_layouts(self, register):  # type: ignore[no-untyped-def]
            register(chunked_rows_layout(4, stride_zero))

        @hookimpl
        def hicache_register_strategies(self, register):  # type: ignore[no-untyped-def]
            register(StrategyInfo("test.chunked", "kernel", ("layer_first_chunked",), Kernel, (False, True)))

    reg = create_registry(plugins=[("chunked", Plugin())])
    (seg,) = reg.layout("layer_first_chunked").plan(_rows_case(40).build(torch.device(DEVICE))).segments
    assert (seg.addressing.chunk_bytes, seg.addressing.chunk_stride) == (10, 0 if stride_zero else 10)
    pool = check_strategy(reg, _rows_case(40), "layer_first_chunked", "kernel", variant="shuffled-i64",
                          device=DEVICE, strategy="test.chunked")
    assert {g.word for g in pool.binding.scratch[pool.strategy_name].groups} == {8}  # 10-byte chunks would give 2


@pytest.fixture
def launches(monkeypatch):
    """Every kernel launch (``Launcher.__call__`` wrapped): ``(grid, {parameter: value})``, with loads on the row
    kernel (TMA loads, automatic on Hopper-class GPUs, are tested in tests/test_tma.py; page loads in
    tests/test_page_loads.py)."""
    monkeypatch.setenv("HICACHE_KERNEL_TMA", "0")
    monkeypatch.setenv("HICACHE_KERNEL_PAGES", "0")
    log, real = [], Launcher.__call__

    def counting(self, grid, args, **kw):
        log.append((grid, dict(zip(self.arg_names, args))))
        real(self, grid, args, **kw)  # returns None: no replay is recorded, every call is logged here
    monkeypatch.setattr(Launcher, "__call__", counting)
    return log


@pytest.mark.parametrize("per", [1, 2, 4, None])
@pytest.mark.parametrize("layout", KERNELS)
def test_backups_split_into_launches_of_at_most_launch_bytes(layout, launches, per):
    """With ``backup_launch_bytes`` (here the bytes of ``per`` entries' rows of the call) an all-layer backup goes out
    in launches back to back: of at most ``per`` entries each, in entry order, where the kernel walks entries apart;
    of every entry at a run of positions (a multiple of 16 and of the tile's tokens, as many as the bytes allow) where
    it walks a tile's entries together (``entries_inner``).  Each grid is bounded by its own work; loads keep one
    launch per group; every byte lands as the reference puts it, canaries and guards untouched; entry runs are made
    once and reused by the next call.  ``None``: the option at 0, one launch per group."""
    spec = _mla(LayerMap.unsharded(5), ps=2, cap=64)
    gen = torch.Generator().manual_seed(4)
    dev = _device(spec, gen)
    n = 48
    h = (torch.randperm(32, generator=gen)[:n // 2, None] * 2 + torch.arange(2)).reshape(-1)  # whole pages of 2
    src, dst = torch.arange(n), torch.arange(n) + 64
    opts = {"programs": 64, "tile_bytes": 256}  # tiles of a few tokens: runs of 16 positions are whole tiles
    probe = HostKVPool(spec, layout, "kernel", {k: [t.clone() for t in v] for k, v in dev.items()}, registry=REGISTRY,
                       pin_memory=PIN, strategy_options={**opts, "backup_launch_bytes": 0})
    groups = probe.binding.scratch[probe.strategy_name].groups
    row = {g.width * g.word for g in groups}
    if per is not None and len(row) > 1:
        pytest.skip("groups of several row widths: one launch_bytes gives each its own entries per launch")
    cap = 0 if per is None else per * n * row.pop()
    inner = KERNELS[layout].entries_inner
    host, guards = guarded_host_buffers(REGISTRY, spec, layout, pin_memory=PIN)
    pool = HostKVPool(spec, layout, "kernel", dev, registry=REGISTRY, host_buffers=host,
                      strategy_options={**opts, "backup_launch_bytes": cap})
    ref = HostKVPool(spec, layout, "reference", {k: [t.clone() for t in v] for k, v in dev.items()}, registry=REGISTRY,
                     strategy="core.reference", pin_memory=False)
    prep = pool.binding.scratch[pool.strategy_name]
    fill_canary(pool)
    fill_canary(ref)
    want = []  # (entries, host slots) of each launch
    for g in groups:
        ents = g.entries(None).tolist()
        if per is None:
            want.append((ents, h.tolist()))
        elif inner:
            step = max(16, per * n // len(ents) // 16 * 16)
            want += [(ents, h[i:i + step].tolist()) for i in range(0, n, step)]
        else:
            want += [(ents[i:i + per], h.tolist()) for i in range(0, len(ents), per)]
    assert per is None or len(want) > len(groups), "the call is split"
    for call in range(2):
        launches.clear()
        pool.backup_all_layers(h, src)
        ref.backup_all_layers(h, src)
        _sync()
        assert [(c["ents"].tolist(), c["host_idx"].tolist()) for _, c in launches] == want
        assert all(c["TO_HOST"] and c["n_ents"] == c["ents"].numel() and c["n"] == c["host_idx"].numel()
                   == c["dev_idx"].numel() for _, c in launches)
        assert [grid for grid, _ in launches] == [min(64, -(-c["n"] // c["TOKENS"]) * c["n_ents"]) for _, c in launches]
        assert len(prep.slices) == (0 if per is None or inner else len(groups)), "entry runs made once, reused"
        for name, buf in pool.host_buffers.items():
            assert torch.equal(buf.view(torch.uint8).cpu(), ref.host_buffers[name].view(torch.uint8).cpu()), name
        assert_guards_intact(f"backup {call}", guards)
    launches.clear()
    pool.load_all_layers(h, dst)
    assert [c["TO_HOST"] for _, c in launches] == [False] * len(groups)  # loads: one launch per group
    _sync()
    for name, ts in dev.items():
        for t in ts:
            if t is not None:
                assert torch.equal(t[dst.to(t.device)].view(torch.uint8), t[src.to(t.device)].view(torch.uint8)), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="calls are replayed on CUDA only")
@pytest.mark.parametrize("dtypes", [(torch.int64, torch.int64), (torch.int32, torch.int64)], ids=["i64", "i32-i64"])
@pytest.mark.parametrize("layout", KERNELS)
def test_split_backups_replay_exactly(layout, dtypes):
    """A backup split into launches of one entry each, or into runs of 16 positions (``entries_inner`` kernels),
    repeated with the same index tensors, is replayed (every launch of the split recorded; a run's index addresses
    moved by its start in each tensor's own element size) and still moves the rows the device holds at each call,
    as the reference does.  A kernel's first launch after it compiles goes through Triton, not the driver, and is not
    recorded: the first call may compile (int32 indices take another specialisation), the next records, and every
    later one replays."""
    spec = _mla(LayerMap.unsharded(5), ps=2, cap=64)
    gen = torch.Generator().manual_seed(5)
    dev = _device(spec, gen)
    pool = HostKVPool(spec, layout, "kernel", dev, registry=REGISTRY, pin_memory=True,
                      strategy_options={"backup_launch_bytes": 1, "tile_bytes": 256})
    ref_dev = {k: [None if t is None else t.clone() for t in v] for k, v in dev.items()}
    ref = HostKVPool(spec, layout, "reference", ref_dev, registry=REGISTRY, strategy="core.reference",
                     pin_memory=False)
    h = (torch.randperm(32, generator=gen)[:24, None] * 2 + torch.arange(2)).reshape(-1).to(DEVICE, dtypes[0])
    src = torch.arange(48, device=DEVICE, dtype=dtypes[1])
    fill_canary(pool)
    fill_canary(ref)
    for call in range(4):
        for name, ts in dev.items():  # new rows each call: a replay must read what the device holds now
            for t, r in zip(ts, ref_dev[name]):
                if t is not None:
                    t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen))
                    r.copy_(t)
        pool.backup_all_layers(h, src)
        ref.backup_all_layers(h, src)
        torch.cuda.synchronize()
        for name, buf in pool.host_buffers.items():
            assert torch.equal(buf.view(torch.uint8), ref.host_buffers[name].view(torch.uint8).cpu()), (call, name)
    prep = pool.binding.scratch[pool.strategy_name]
    assert prep.replays is not None and prep.replays.hits >= 2  # calls 2 and 3 at least (call 0 may compile)


@pytest.mark.parametrize("layout", KERNELS)
def test_one_launch_per_group_and_per_layer_loads_move_only_their_layer(layout, launches):
    spec = _mla(extra=(Component("index_k", 16, torch.uint8, layers=(0, 2)),))
    dev = _device(spec, torch.Generator().manual_seed(1))
    pool = HostKVPool(spec, layout, "kernel", dev, registry=REGISTRY, pin_memory=PIN)
    prep = pool.binding.scratch[pool.strategy_name]
    h, src, dst = torch.tensor([6, 7, 0, 1, 2, 3]), torch.arange(6), torch.arange(6) + 10
    pool.backup_all_layers(h, src)
    assert [(c["n_ents"], c["TO_HOST"]) for _, c in launches] == [(g.all_layers.numel(), True) for g in prep.groups]
    assert all(grid == min(prep.tuning.backup.programs, -(-6 // c["TOKENS"]) * c["n_ents"]) for grid, c in launches)
    for layer in range(3):
        launches.clear()
        before = _bytes(dev)
        pool.load_layer(layer, h, dst)
        _sync()
        want = [(g.per_layer[layer].numel(), False) for g in prep.groups if g.entries(layer) is not None]
        assert [(c["n_ents"], c["TO_HOST"]) for _, c in launches] == want and len(want) == (1 if layer == 1 else 2)
        for name, now in _bytes(dev).items():  # only layer ``layer`` changed, and there only rows dst
            for d, (t, old) in [(d, x) for d, x in enumerate(zip(now, before[name])) if x[0] is not None]:
                old[dst] = old[src] if d == layer else old[dst]
                assert torch.equal(t, old), f"{name}[{d}] after load_layer({layer})"
    launches.clear()
    every = lambda: _bytes({**dev, "host": list(pool.host_buffers.values())})  # noqa: E731
    before, none = every(), torch.empty(0, dtype=torch.int64)
    pool.backup_all_layers(none, none)
    assert pool.load_layer(1, none, none) is True
    pool.load_all_layers(none, none)
    _sync()  # an empty transfer launches nothing and changes nothing
    assert launches == [] and all(torch.equal(x, y) for k, now in every().items() for x, y in zip(now, before[k])
                                  if x is not None)


@pytest.mark.parametrize("option, env, backup_option", [(None, None, None), (None, "5", None), (3, "5", None),
                                                        (None, None, 2), (3, "5", 2)])
def test_programs_bound_the_grid(monkeypatch, launches, option, env, backup_option):
    monkeypatch.setenv(ENV_PROGRAMS, env) if env else monkeypatch.delenv(ENV_PROGRAMS, raising=False)
    tuning = LayerFirstKernelStrategy.tuning
    backup = backup_option or option or int(env or tuning.backup.programs)
    load = option or int(env or tuning.load.programs)
    spec = _kv(16, ps=1, cap=32)
    dev = _device(spec, torch.Generator().manual_seed(2))
    opts = {"tile_bytes": 16, **({} if option is None else {"programs": option}),  # one token per tile
            **({} if backup_option is None else {"backup_programs": backup_option})}
    pool = HostKVPool(spec, "layer_first", "kernel", dev, registry=REGISTRY, pin_memory=PIN, strategy_options=opts)
    pool.backup_all_layers(torch.arange(32), torch.arange(32))  # 64 work items
    pool.load_all_layers(torch.arange(32), torch.arange(32) + 32)
    pool.load_layer(1, torch.tensor([31]), torch.tensor([63]))  # one work item: one program
    assert [(grid, c["TO_HOST"]) for grid, c in launches] == [(backup, True), (load, False), (1, False)]
    _sync()
    assert all(torch.equal(t[32:64], t[:32]) for t in dev["kv"])


@pytest.mark.parametrize("hdt, ddt", [(torch.int64,) * 2, (torch.int32, torch.int64), (torch.int64, torch.int32)],
                         ids=["i64", "i32-host", "i32-dev"])
@pytest.mark.parametrize("layout", KERNELS)
def test_out_of_range_indices_never_touch_memory(layout, hdt, ddt):
    """Indices the pool would reject (the strategy is called as with validation off) move nothing, in or out of
    bounds; the valid pairs of the same call move as through the reference.  Buffers sit inside guard bytes."""
    gen, guard, rows = torch.Generator().manual_seed(3), 256, 12
    spec = _mla(LayerMap.sharded_cp(4, 2, 1))
    owned = spec.layer_map.device_layers
    big_dev = {d: _rand(rows + 8, 40, gen) for d in owned}
    ref_big_dev = {d: t.clone() for d, t in big_dev.items()}
    view = lambda big, d: big[d][4:4 + rows].view(torch.bfloat16) if d in owned else None  # noqa: E731
    big_host, host = {}, {}
    for b in REGISTRY.layout(layout).plan(spec).buffers:
        big_host[b.name] = torch.full((b.nbytes + 2 * guard,), CANARY, dtype=torch.uint8, pin_memory=PIN)
        host[b.name] = big_host[b.name][guard:-guard].view(b.dtype).view(b.shape)
    pool = HostKVPool(spec, layout, "kernel", {"kv": [view(big_dev, d) for d in range(4)]}, host_buffers=host,
                      registry=REGISTRY)
    ref = HostKVPool(spec, layout, "reference", {"kv": [view(ref_big_dev, d) for d in range(4)]}, registry=REGISTRY)
    fill_canary(ref)
    huge = lambda dt: 2**31 - 1 if dt == torch.int32 else 2**40  # noqa: E731
    h = torch.tensor([0, 1, spec.capacity, -1, 2, huge(hdt), 3, 5], dtype=hdt)
    d = torch.tensor([2, 3, 4, 5, -3, 7, rows, huge(ddt)], dtype=ddt)  # only (0, 2) and (1, 3) are valid
    for to_host in (True, False):
        if not to_host:  # fresh host bytes, so that the load shows
            for name, t in ref.host_buffers.items():
                t.view(torch.uint8).random_(0, 256, generator=gen)
                host[name].view(torch.uint8).copy_(t.view(torch.uint8))
        (pool.strategy.backup if to_host else pool.strategy.load)(pool.binding, h.to(DEVICE), d.to(DEVICE), None)
        (ref.backup_all_layers if to_host else ref.load_all_layers)(h[:2].long(), d[:2].long())
        _sync()
        for name, big in big_host.items():
            assert bool((big[:guard] == CANARY).all()) and bool((big[-guard:] == CANARY).all()), f"{name} guards"
            assert torch.equal(host[name].view(torch.uint8), ref.host_buffers[name].view(torch.uint8)), name
        for dl in owned:
            assert torch.equal(big_dev[dl].cpu(), ref_big_dev[dl].cpu()), f"device layer {dl} (guard rows included)"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host memory must be pinned on CUDA only")
@pytest.mark.parametrize("layout", KERNELS)
def test_unpinned_host_memory_is_rejected_on_cuda(layout):
    spec = _mla()
    with pytest.raises(HostBufferError, match=f"{KERNELS[layout].name} reads and writes host memory directly.*pinned"):
        HostKVPool(spec, layout, "kernel", _device(spec, torch.Generator()), registry=REGISTRY, pin_memory=False)


def test_describe_states_the_launch_shape_explain_prints(monkeypatch):
    from hicache_core import LayerMap, PoolSpec
    from hicache_layer_first.strategy import TUNING, LayerFirstKernelStrategy

    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(2), head_num=1, head_dim=8, dtype=torch.float16, page_size=4,
                        capacity=16, device=torch.device("cpu"))
    monkeypatch.delenv("HICACHE_KERNEL_PROGRAMS", raising=False)
    s = LayerFirstKernelStrategy(num_warps=2, num_stages=3)
    (line,) = s.describe(spec, None)
    b, ld = TUNING.backup, TUNING.load
    assert line.startswith(f"layer_first.kernel: backups {b.programs} programs x 2 warps, {b.tile_bytes} B tiles, "
                           f"3 stages, launches of up to 32 MiB (a call of more: some layers per launch); "
                           f"loads {ld.programs} programs x 2 warps, {ld.tile_bytes} B tiles, 3 stages")
    assert b.launch_bytes == 32 << 20 and not ld.launch_bytes
    assert "fenced" not in line  # the launch fences on CUDA only
    assert b.pdl and "dependent" not in line  # and makes dependent launches on compute capability >= 9.0 only
    monkeypatch.setenv("HICACHE_KERNEL_PROGRAMS", "5")
    assert "backups 5 programs" in LayerFirstKernelStrategy().describe(spec, None)[0]


@pytest.mark.parametrize("layout", KERNELS)
def test_backup_fence_is_the_backups_alone_and_reaches_cuda_launches_only(layout):
    """The plugins fence the backups of rows of at least their ``fence_min_row_bytes`` (kernel_lib.tile_done), never
    their loads; the option ``backup_fence`` fences every group (``True``) or none (``False``); a launch passes
    ``FENCE`` True on CUDA only (the interpreter has no inline PTX)."""
    cls, cpu = KERNELS[layout], torch.device("cpu")
    t = cls().effective_tuning(cpu)
    assert t.backup.fence and t.backup.fence_min_row_bytes >= 1024 and not t.load.fence
    assert not cls(backup_fence=False).effective_tuning(cpu).backup.fence
    assert cls(backup_fence=True).effective_tuning(cpu).backup == replace(t.backup, fence_min_row_bytes=0)
    with pytest.raises(ConfigError, match="backup_fence must be True, False or None"):
        cls(backup_fence="yes")
    with pytest.raises(ConfigError, match="fence must be True or False"):
        replace(t.backup, fence=1)
    with pytest.raises(ConfigError, match="fence_min_row_bytes must be an int >= 0"):
        replace(t.backup, fence_min_row_bytes=-1)
    cuda = DEVICE.type == "cuda"
    for shape, options, fenced in ((_mla(), {}, False),  # 40-byte rows: under every plugin's floor
                                   (_kv(t.backup.fence_min_row_bytes), {}, cuda),  # at the floor
                                   (_kv(t.backup.fence_min_row_bytes - 16), {}, False),
                                   (_mla(), {"backup_fence": True}, cuda), (_kv(4096), {"backup_fence": False}, False)):
        if layout == "page_first_kv_split" and "rope" not in {c.name for c in shape.components}:
            continue  # the layout splits MLA rows only
        pool = HostKVPool(shape, layout, "kernel", _device(shape, torch.Generator()), registry=REGISTRY,
                          strategy_options=options)
        prep = pool.binding.scratch[pool.strategy_name]
        at = prep.launcher.arg_names.index("FENCE")
        for launches in prep.launches:
            for to_host, launch in launches.items():
                assert launch.args[at] is (fenced and to_host), (shape, options, to_host)


@pytest.mark.skipif("page_first_kv_split" not in REGISTRY.layouts, reason="needs the kv_split layout plugin")
@pytest.mark.parametrize("gap", [0, 8, -576])
def test_split_parts_fuse_only_where_rope_follows_latent_in_the_same_rows(gap: int) -> None:
    """MLA parts held apart as views of one padded tensor, equal row strides: rope right after latent (``gap`` 0: one
    fused launch may move both), 8 elements after it, or before it (never fused): every backup is the reference's."""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (a CPU pool's kernel needs the interpreter)
    spec = PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                        page_size=4, capacity=16, device=device)
    gen = torch.Generator().manual_seed(9)
    bufs = [torch.randn(32, 1, 1200, generator=gen).to(torch.bfloat16).to(device) for _ in range(2)]
    lat0 = 600 if gap < 0 else 0
    rope0 = 0 if gap < 0 else 512 + gap
    dev = {"latent": [b[:, :, lat0:lat0 + 512] for b in bufs], "rope": [b[:, :, rope0:rope0 + 64] for b in bufs]}
    pinned = device == "cuda"
    pool = HostKVPool(spec, "page_first_kv_split", "kernel", dev, registry=REGISTRY, pin_memory=pinned)
    ref = HostKVPool(spec, "page_first_kv_split", "reference", {k: [t.clone() for t in v] for k, v in dev.items()},
                     registry=REGISTRY, pin_memory=pinned)
    h, d = torch.cat([torch.arange(8, 12), torch.arange(0, 4)]), torch.tensor([3, 7, 11, 2, 30, 31, 12, 5])
    for p in (pool, ref):
        for t in p.host_buffers.values():
            t.view(torch.uint8).fill_(0xA5)
        p.backup_all_layers(h, d)
    if pinned:
        torch.cuda.synchronize()
    for name, t in ref.host_buffers.items():
        assert torch.equal(pool.host_buffers[name].view(torch.uint8), t.view(torch.uint8)), name
