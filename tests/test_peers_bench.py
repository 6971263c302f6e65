"""CPU tests of the peer benchmark (benchmarks/peers.py): options, grid order, the bit-exact
pre-check (hicache's reference backend standing in for a peer), the JSON rows and the table.
The timing itself needs CUDA and runs on the GPU machine (dev/gpu_peers.sh)."""

from __future__ import annotations

import json
import types
from dataclasses import asdict

import pytest
import torch

from benchmarks import peer_lmcache, peer_sglang
from benchmarks import peers as P
from benchmarks.peer_check import PeerMismatch, check_bit_exact
from hicache_core.bench import timing as bench_timing
from hicache_core.pool import HostKVPool, allocate_host_buffers
from hicache_core.registry import create_registry
from hicache_core.spec import LayerMap, PoolSpec

from fakes import pool_device

PS, CAP, LAYERS = 4, 16, 3


def _mla(device: str = "cpu") -> PoolSpec:
    return PoolSpec.mla(layer_map=LayerMap.unsharded(LAYERS), kv_lora_rank=8, qk_rope_head_dim=4,
                        dtype=torch.bfloat16, page_size=PS, capacity=CAP, device=device)


def _mha() -> PoolSpec:
    return PoolSpec.mha(layer_map=LayerMap.unsharded(LAYERS), head_num=2, head_dim=4, dtype=torch.bfloat16,
                        page_size=PS, capacity=CAP, device="cpu")


def _dev(spec: PoolSpec, rows: int = 2 * CAP + PS) -> dict[str, list[torch.Tensor | None]]:
    g = torch.Generator().manual_seed(1)
    return {c.name: [torch.randint(0, 256, (rows, c.row_bytes), dtype=torch.uint8, generator=g).view(c.dtype)
                     .to(spec.device) for _ in range(LAYERS)] for c in spec.components}


def _idx() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random host pages; device backup source and load target pages disjoint."""
    g = torch.Generator().manual_seed(2)
    ex = lambda p: (p.unsqueeze(1) * PS + torch.arange(PS)).reshape(-1)  # noqa: E731
    hp, dp = torch.randperm(CAP // PS, generator=g), torch.randperm(2 * CAP // PS, generator=g)
    return ex(hp), ex(dp[: CAP // PS]), ex(dp[CAP // PS :])


def _ref(spec: PoolSpec, layout: str, dev, host=None) -> HostKVPool:
    reg = create_registry()
    host = host if host is not None else allocate_host_buffers(reg.layout(layout).plan(spec), pin_memory=False)
    return HostKVPool(spec, layout, "reference", dev, host_buffers=host, registry=reg)


# -- options and grid ---------------------------------------------------------------
def test_defaults_run_key_cells_first():
    args = P.parse_args([])
    assert args.cells == [("mla61x576-bf16", 4096), ("mla61x656-fp8", 4096), ("mha80x8x128-bf16", 4096),
                          ("mla61x576-bf16", 32768)]
    assert (args.layouts, args.programs, args.sglang_quotas, args.sglang_tma_quotas) == (
        ["layer_first", "page_first"], [0, 8], [2, 8], [4, 8])
    assert args.ops == ["backup_all_layers", "load_layer", "load_burst", "load_burst_new", "backup_new"]
    assert (args.page_size, args.time_budget, args.io_backends) == (64, 400.0, ["kernel", "auto", "direct"])
    grid = P.plan_grid(args.cells, args.layouts)
    assert grid[:2] == [("mla61x576-bf16", 4096, "layer_first"), ("mla61x576-bf16", 4096, "page_first")]
    assert grid[-1] == ("mla61x576-bf16", 32768, "page_first") and len(grid) == 8


def test_options_parse():
    args = P.parse_args(["--cells", "mha80x8x128-bf16@1024", "--programs", "2,4", "--sglang-quotas", "2",
                         "--ops", "load_layer", "--time-budget", "5", "--peers", "hicache"])
    assert (args.cells, args.programs, args.sglang_quotas, args.ops, args.time_budget, args.peers) == (
        [("mha80x8x128-bf16", 1024)], [2, 4], [2], ["load_layer"], 5.0, ["hicache"])


def test_auto_forward_modes_become_targets_of_their_own(capsys):
    """``--auto-forward compute,memory``: one hicache ``auto`` target per mode, each pool built with that option."""
    assert P.parse_args([]).auto_forward == ["compute"]
    args = P.parse_args(["--io-backends", "auto", "--auto-forward", "compute,memory"])
    reg, spec = create_registry(), _mla()
    targets = P._our_targets(args, reg, spec, "layer_first")
    assert [t.variant for t in targets] == ["auto core.auto", "auto core.auto forward=memory"]
    ctx = P.Ctx(spec, "layer_first", _dev(spec), allocate_host_buffers(reg.layout("layer_first").plan(spec),
                                                                      pin_memory=False), reg)
    assert [t.build(ctx).pool.strategy.forward for t in targets] == ["compute", "memory"]
    with pytest.raises(SystemExit):
        P.parse_args(["--auto-forward", "decode"])
    assert "--auto-forward ['decode']: choose from compute, memory, watch" in capsys.readouterr().err


@pytest.mark.parametrize("cell", ["mla61x576-bf16", "nope@4096", "mla61x576-bf16@many"])
def test_bad_cell_is_refused(cell, capsys):
    with pytest.raises(SystemExit):
        P.parse_args(["--cells", cell])
    assert f"cell {cell!r}: use SHAPE@TOKENS with SHAPE in [" in capsys.readouterr().err


def test_bad_op_is_refused(capsys):
    with pytest.raises(SystemExit):
        P.parse_args(["--ops", "load_layer,copy"])
    assert ("--ops ['copy']: choose from ['backup_all_layers', 'load_layer', 'load_burst', 'load_burst_new', 'backup_new']"
            in capsys.readouterr().err)


# -- bit-exact pre-check ----------------------------------------------------------------
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("make", [_mla, _mha])
def test_reference_as_peer_passes(layout, make):
    spec = make()
    dev = _dev(spec)
    h, s, d = _idx()
    reg = create_registry()
    host = allocate_host_buffers(reg.layout(layout).plan(spec), pin_memory=False)
    target = P.Ours(P.Ctx(spec, layout, dev, host, reg), "reference", "core.reference", None)
    check_bit_exact(target, _ref(spec, layout, dev), dev, h, s, d, label="ref")
    for name, buf in target.host_buffers.items():  # the peer really wrote the rows, where the layout says
        rows = buf[:, h] if layout == "layer_first" else buf[h].transpose(0, 1)
        want = torch.stack([t[s] for t in dev[name]])
        assert torch.equal(rows.contiguous().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("backend,strategy,programs", [("kernel", None, None), ("kernel", None, 2),
                                                        ("direct", None, None), ("reference", "core.reference", None)])
def test_our_ctas_are_the_programs_the_last_call_launched(backend, strategy, programs):
    """A hicache row's CTAs: the kernel's largest grid in the op's last call (the default budget included: it read
    None there), 0 where the copy engine served it, None for a strategy with no row kernel."""
    spec = _mla(pool_device(backend))
    dev = _dev(spec)
    h, s, d = (t.to(spec.device) for t in _idx())
    reg = create_registry()
    host = allocate_host_buffers(reg.layout("layer_first").plan(spec), pin_memory=spec.device.type == "cuda")
    name = strategy or reg.resolve(spec, "layer_first", backend).info.name
    target = P.Ours(P.Ctx(spec, "layer_first", dev, host, reg), backend, name, programs)
    assert target.ctas("backup_all_layers") is None  # nothing ran yet
    target.backup_all_layers(h, s)
    target.load_layer(1, h, d)
    for op, layer, to_host in (("backup_all_layers", None, True), ("load_layer", 1, False), ("load_burst", 1, False)):
        got = target.ctas(op)
        if backend == "kernel":
            assert got == target.pool.strategy.launch_grid(target.pool.binding, h.numel(), layer, to_host=to_host)
            assert 0 < got <= (programs or got)
        else:
            assert got == (0 if backend == "direct" else None)


def test_our_ctas_name_the_kernel_for_a_load_auto_gave_it_as_a_lone_load(monkeypatch):
    """auto's lone-load rule serves a single load with its kernel whatever pick() memoised for the pair (here the
    copy engine): the row's CTAs are the kernel's grid for such a load, the pick's (0: the copy engine) otherwise."""
    spec = _mla(pool_device("kernel"))  # where auto's kernel candidate serves the pool (the GPU, where there is one)
    dev = _dev(spec)
    h, s, d = (t.to(spec.device) for t in _idx())
    reg = create_registry()
    host = allocate_host_buffers(reg.layout("layer_first").plan(spec), pin_memory=spec.device.type == "cuda")
    # lone=False: auto's own lone-load rule stays out (on a GPU it would take the first load); lone_load stands in
    target = P.Ours(P.Ctx(spec, "layer_first", dev, host, reg), "auto", "core.auto", None, {"lone": False})
    auto = target.pool.strategy
    monkeypatch.setattr(auto, "pick", lambda *a, **k: auto.direct)
    load = target.pool.load_layer

    def lone_load(layer, hi, di):  # what the lone-load rule counts on a CUDA pool
        load(layer, hi, di)
        auto.lone_kernel_loads += 1
    target.load_layer(1, h, d)
    assert target.ctas("load_layer") == 0
    monkeypatch.setattr(target.pool, "load_layer", lone_load)
    target.load_layer(1, h, d)
    grid = auto.kernel.launch_grid(target.pool.binding, h.numel(), 1, to_host=False)
    assert target.ctas("load_layer") == grid > 0
    target.backup_all_layers(h, s)
    assert target.ctas("backup_all_layers") == 0  # backups never go by the lone-load rule


class _Corrupt:
    """The reference backend, plus one wrong byte: after backups (host) or after the load of layer 2 (device)."""

    ops_supported = ("backup_all_layers", "load_layer")

    def __init__(self, pool: HostKVPool, where: str, dev) -> None:
        self.pool, self.where, self.dev, self.host_buffers = pool, where, dev, pool.host_buffers

    def backup_all_layers(self, h, s):
        self.pool.backup_all_layers(h, s)
        if self.where == "backup":
            self.host_buffers["kv"].view(-1).view(torch.uint8)[7] ^= 1

    def load_layer(self, layer, h, d):
        self.pool.load_layer(layer, h, d)
        if self.where == "load" and layer == 2:
            self.dev["kv"][layer][int(d[0])].view(torch.uint8)[3] ^= 1


def test_backup_mismatch_raises():
    spec = _mla()
    dev = _dev(spec)
    h, s, d = _idx()
    peer = _Corrupt(_ref(spec, "page_first", dev), "backup", dev)
    with pytest.raises(PeerMismatch) as e:
        check_bit_exact(peer, _ref(spec, "page_first", dev), dev, h, s, d, label="bad peer")
    nbytes = CAP * LAYERS * spec.components[0].row_bytes
    assert str(e.value) == ("bad peer: backup_all_layers wrote host buffer 'kv' differently from the reference "
                            f"backend: 1 of {nbytes} bytes differ (first at byte 7)")


def test_load_mismatch_raises():
    spec = _mla()
    dev = _dev(spec)
    h, s, d = _idx()
    peer = _Corrupt(_ref(spec, "layer_first", dev), "load", dev)
    with pytest.raises(PeerMismatch) as e:
        check_bit_exact(peer, _ref(spec, "layer_first", dev), dev, h, s, d, label="bad peer")
    row = spec.components[0].row_bytes
    assert str(e.value) == ("bad peer: load_layer(2) wrote device 'kv' differently from the reference backend: "
                            f"1 of {(2 * CAP + PS) * row} bytes differ (first at byte {int(d[0]) * row + 3})")


def test_only_supported_ops_are_checked():
    spec = _mla()
    dev = _dev(spec)
    h, s, d = _idx()
    ref = _ref(spec, "page_first", dev)
    peer = types.SimpleNamespace(ops_supported=("backup_all_layers",), host_buffers=ref.host_buffers,
                                 backup_all_layers=ref.backup_all_layers, load_layer=None)
    check_bit_exact(peer, _ref(spec, "page_first", dev), dev, h, s, d, label="backup only")  # load_layer not called


# -- peer adapters on CPU (pointer plumbing; the kernels need CUDA) ------------------------------
class _FakeLmcacheOps:
    """LMCache's ``multi_layer_kv_transfer_unilateral`` semantics in torch, resolving pointers to our tensors."""

    EngineKVFormat = types.SimpleNamespace(NL_X_NBBS_ONE_HS="mla", TWO_X_NL_X_NBBS_NH_HS="mha")
    TransferDirection = types.SimpleNamespace(D2H="d2h", H2D="h2d")

    def __init__(self, dev):
        self.by_ptr = {t.data_ptr(): t for ts in dev.values() for t in ts}

    def multi_layer_kv_transfer_unilateral(self, kv, ptrs, slots, device, rows, direction, fmt):
        kvs, layers = kv.shape[0], kv.shape[1]
        assert (fmt, len(ptrs)) == ("mla" if kvs == 1 else "mha", kvs * layers)
        for i, p in enumerate(ptrs.tolist()):
            t = self.by_ptr[p]
            assert t.shape[0] == rows
            if direction == "d2h":
                kv[i // layers, i % layers] = t[slots]
            else:
                t[slots] = kv[i // layers, i % layers]


@pytest.mark.parametrize("make", [_mla, _mha])
def test_lmcache_adapter_moves_our_rows(make):
    spec = make()
    dev = _dev(spec)
    _, s, d = _idx()
    host = peer_lmcache.fused_host(spec, pin=False)
    peer = peer_lmcache.LmcacheMultiLayer(_FakeLmcacheOps(dev), spec, "layer_first", dev, host)
    check_bit_exact(peer, _ref(spec, "layer_first", dev), dev, torch.arange(CAP), s, d, label="lmcache")
    assert peer.ops_supported == (P.ALL_OPS if spec.kind == "mla" else ("backup_all_layers",))


def test_lmcache_adapter_needs_one_mha_object():
    spec = _mha()
    dev = _dev(spec)
    host = allocate_host_buffers(create_registry().layout("layer_first").plan(spec), pin_memory=False)
    with pytest.raises(ValueError, match=r"MHA host k and v must be the halves of one \[2, L, S, row\] tensor"):
        peer_lmcache.LmcacheMultiLayer(_FakeLmcacheOps(dev), spec, "layer_first", dev, host)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_sglang_pointer_tables_follow_sglang_host_views(layout):
    spec = _mha()
    dev = _dev(spec)
    host = allocate_host_buffers(create_registry().layout(layout).plan(spec), pin_memory=False)
    sides = peer_sglang._Sides(spec, layout, dev, host)
    row = spec.components[0].row_bytes
    for i, name in enumerate(("k", "v")):
        # SGLang's host pool: kv_buffer[i] (layer_first) or kv_buffer.transpose(0, 1)[i] (page_first)
        views = host[name] if layout == "layer_first" else host[name].transpose(0, 1)
        assert sides.host_ptrs[i].tolist() == [views[j].data_ptr() for j in range(LAYERS)]
        assert sides.dev_ptrs[i].tolist() == [t.data_ptr() for t in dev[name]]
    assert sides.host_stride == (row if layout == "layer_first" else row * LAYERS)


def test_sglang_targets_per_layout():
    ops = types.SimpleNamespace(DEFAULT_BLOCK_QUOTA=2, TMA_BLOCK_QUOTA=4)
    kit = peer_sglang.SglangKit(ops=ops, direct_error="no sgl_kernel")
    args = P.parse_args([])
    names = lambda layout: [(t.peer, t.variant) for t in P._sglang_targets(args, kit, layout)]  # noqa: E731
    jit = [("sglang-jit", "q=2 (default)"), ("sglang-jit", "q=8"), ("sglang-tma", "q=4 (default)"),
           ("sglang-tma", "q=8")]
    assert names("layer_first") == jit + [("sglang-direct", "transfer_kv_direct")]
    assert names("page_first") == jit + [("sglang-staged", "default")]
    assert names("page_first_direct") == []
    failed = P._sglang_targets(args, peer_sglang.SglangKit(import_error="boom"), "layer_first")
    with pytest.raises(RuntimeError, match="^boom$"):
        failed[0].build(None)


def test_fp8_656_rows_are_refused_by_sglangs_generic_kernel_rule():
    ops = types.SimpleNamespace(_default_unroll=lambda row: 2, _tiles_across_lanes=lambda row, u: row % 128 == 0,
                                GROUP_BYTES=(128,))
    with pytest.raises(ValueError, match=r"does not take 656-byte rows on CUDA: its copy groups are \(128,\) bytes"):
        peer_sglang._builder(ops, ("jit", 656, 2))
    assert callable(peer_sglang._builder(ops, ("jit", 1152, 2)))


# -- output -----------------------------------------------------------------------------
def _row(**kw) -> P.PeerRow:
    base = dict(peer="sglang-jit", variant="q=2 (default)", layout="layer_first", shape="mla61x576-bf16",
                kind="mla 61x1152B", tokens=4096, page_size=64)
    return P.PeerRow(**{**base, **kw})


def test_json_rows_have_the_schema(tmp_path):
    lines: list[str] = []
    w = P._Writer(str(tmp_path), {"gpu": "x"}, lines.append)
    w.add(_row(op="load_layer", status="ok", ctas=2, bytes=4_718_592, ms=0.1, gbps=47.2, memcpy_gbps=55.0,
               ratio=0.858, host_us=12.5, bit_exact=True))
    w.add(_row(op="-", status="error", error="RuntimeError: nvcc failed"))
    data = json.loads((tmp_path / "peers.json").read_text())
    assert data["meta"] == {"gpu": "x"}
    assert [tuple(r) for r in data["rows"]] == [P.ROW_FIELDS, P.ROW_FIELDS]
    assert data["rows"][1]["status"] == "error" and data["rows"][1]["bit_exact"] is None
    assert lines == [
        "sglang-jit q=2 (default) layer_first mla61x576-bf16 n=4096 load_layer: 47.2 GB/s ratio 0.858 CTAs 2 host 12us",
        "sglang-jit q=2 (default) layer_first mla61x576-bf16 n=4096 -: ERROR RuntimeError: nvcc failed",
    ]


def test_markdown_table():
    rows = [asdict(_row(op="backup_all_layers", status="ok", ctas=2, gbps=51.84, ratio=0.9412, gemm_slowdown=0.142,
                          host_us=20.04, bit_exact=True)),
            asdict(_row(peer="lmcache", variant="multi", op="-", status="error", error="ImportError: a | b"))]
    assert P.markdown(rows).splitlines() == [
        "| peer | layout | kind/rows | tokens | op | CTAs/programs | GB/s | ratio to memcpy | GEMM slowdown % "
        "| host µs/call | bit-exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        "| sglang-jit q=2 (default) | layer_first | mla 61x1152B | 4096 | backup_all_layers | 2 | 51.8 | 0.941 | +14.2 "
        "| 20.0 | yes |",
        "| lmcache multi | layer_first | mla 61x1152B | 4096 | - | error: ImportError: a / b |  |  |  |  |  |",
    ]


#: (extra fields of the first row, extra header columns, the first two rows' ends, the first row's line end, a word the
#: second row's line lacks): the memory-bound neighbour's two columns (--hbm), the ratio beside the GEMM's one
NEIGHBOUR_COLUMNS = [
    (dict(hbm_slowdown=0.031, hbm_ratio=0.8812), "| HBM-reader slowdown % | ratio beside it ",
     "| 2 | 51.8 | 0.941 | +14.2 | +3.1 | 0.881 | 20.0 | yes |", "| 2 | 47.2 | 0.858 |  |  |  | 12.0 | yes |",
     "host 20us gemm +14.2% hbm-reader +3.1%, ratio beside it 0.881", "hbm"),
    (dict(gemm_ratio=0.3512), "| ratio beside the GEMM ",
     "| 2 | 51.8 | 0.941 | +14.2 | 0.351 | 20.0 | yes |", "| 2 | 47.2 | 0.858 |  |  | 12.0 | yes |",
     "host 20us gemm +14.2%, ratio beside it 0.351", "beside"),
]


@pytest.mark.parametrize("extra,head,first,second,line,absent", NEIGHBOUR_COLUMNS, ids=["hbm", "beside gemm"])
def test_markdown_table_and_lines_show_a_neighbours_columns_where_measured(extra, head, first, second, line, absent):
    rows = [asdict(_row(op="backup_all_layers", status="ok", ctas=2, gbps=51.84, ratio=0.9412, gemm_slowdown=0.142,
                        host_us=20.04, bit_exact=True, **extra)),
            asdict(_row(op="load_layer", status="ok", ctas=2, gbps=47.2, ratio=0.858, host_us=12.0, bit_exact=True)),
            asdict(_row(peer="lmcache", variant="multi", op="-", status="error", error="ImportError: x"))]
    lines = P.markdown(rows).splitlines()
    columns = 11 + head.count("| ")
    assert lines[0] == ("| peer | layout | kind/rows | tokens | op | CTAs/programs | GB/s | ratio to memcpy | GEMM slowdown % "
                        + head + "| host µs/call | bit-exact |")
    assert lines[1] == "|" + "---|" * columns
    assert lines[2].endswith(first)
    assert lines[3].endswith(second)
    assert lines[4].endswith("| error: ImportError: x |" + "  |" * (columns - 6))
    assert all(line_.count("|") == columns + 1 for line_ in lines)
    assert P._line(rows[0]).endswith(line)
    assert absent not in P._line(rows[1])


# -- the runner's bookkeeping (timing replaced: it needs CUDA) ------------------------------
class _Clocks:
    """The runner's CUDA clocks replaced: every call runs (on CPU tensors) and takes 1 ms; ``log`` holds each timed
    share as (operation call, calls, warm-up calls)."""

    def __init__(self, monkeypatch, fail=None):
        self.log = []
        self.fail = fail  # a call (an OpCall's first item) that raises when timed in its second round

        def samples(fn, reps, warmup):
            if fn is self.fail and any(f is fn for f, _, _ in self.log):
                raise RuntimeError("second round failed")
            self.log.append((fn, reps, warmup))
            for _ in range(reps + warmup):
                fn()
            return [1.0] * reps

        def probe(fn):
            fn()
            return 1.0

        monkeypatch.setattr(P, "_probe_ms", probe)
        monkeypatch.setattr(bench_timing, "_samples_ms", samples)  # what _in_turns calls
        monkeypatch.setattr(P, "_host_us", lambda fn, reps: 3.0)
        monkeypatch.setattr(P, "_gemm_slowdown", lambda fn: 0.1)
        monkeypatch.setattr(P, "_ms_beside_gemm", lambda fn: 4.0)

    @staticmethod
    def gbps(nbytes, to_host, reps):  # the memcpy reference
        return 50.0


def _run_layout(tmp_path, monkeypatch, argv, layout, *, kit=None, lm=None, deadline=float("inf"), clocks=None):
    clocks = clocks or _Clocks(monkeypatch)
    args = P.parse_args(["--out", str(tmp_path), *argv])
    spec = _mla()
    dev = _dev(spec)
    h, s, d = _idx()
    idx = {"h": h, "s": s, "d": d, "h_contig": torch.arange(CAP)}
    writer = P._Writer(str(tmp_path), {}, lambda _: None)
    lm = lm(dev) if callable(lm) else lm  # LMCache's fake ops resolve pointers to the device tensors made here
    P._run_layout(args, create_registry(), kit, lm, spec, "mla-test", layout, dev, idx, clocks, writer, deadline)
    return [(r["peer"], r["variant"], r["op"], r["status"], r["bit_exact"], r["error"] or r["note"]) for r in writer.rows]


def test_runner_checks_then_times_every_op(tmp_path, monkeypatch):
    rows = _run_layout(tmp_path, monkeypatch, ["--io-backends", "reference,nope", "--peers", "hicache"], "page_first")
    assert rows == [("hicache", "reference core.reference", op, "ok", True, None) for op in P.ALL_OPS]


def test_measure_op_gives_every_target_its_share_of_each_round_in_turn(monkeypatch):
    clocks = _Clocks(monkeypatch)
    calls = {name: (lambda: None) for name in "abc"}
    names = {id(fn): name for name, fn in calls.items()}
    slow = lambda: None  # noqa: E731
    monkeypatch.setattr(P, "_probe_ms", lambda fn: 2000.0 if fn is slow else 1.0)
    args = P.parse_args(["--reps", "4", "--rounds", "3"])
    out = P._measure_op(args, [(calls["a"], 2, 1000, True), (slow, 1, 1000, True), (calls["b"], 1, 1000, True),
                               (calls["c"], 1, 1000, True)], clocks, gemm=True,
                        served=[lambda n=n: n for n in range(4)])
    assert [r["ctas"] for r in out] == [0, 1, 2, 3]  # the skipped target's too
    # 4 calls over 3 rounds (2, 1, 1), each round in its own order; the first round warms up as a lone call would
    assert [(names[id(fn)], n, w) for fn, n, w in clocks.log] == [
        ("a", 2, 3), ("b", 2, 3), ("c", 2, 3), ("c", 1, 1), ("b", 1, 1), ("a", 1, 1), ("b", 1, 1), ("c", 1, 1),
        ("a", 1, 1)]
    assert out[1]["status"] == "skipped" and out[1]["note"].startswith("one call took 2000 ms (> --slow-ms)")
    a, b = out[0], out[2]
    assert (a["status"], a["ms"], a["ratio"], a["host_us"], a["gemm_slowdown"], a["note"]) == \
        ("ok", 1.0, 1000 / 1.0 / 1e6 / 50.0, 1.5, 0.1, None)  # host time per layer call of the burst
    assert a["gemm_ratio"] == pytest.approx(1000 / 4.0 / 1e6 / 50.0)  # bytes over the time beside the GEMM
    assert b["host_us"] == 3.0


def test_measure_op_records_a_target_that_fails_in_a_later_round_and_times_the_others(monkeypatch):
    bad, good = (lambda: None), (lambda: None)
    clocks = _Clocks(monkeypatch, fail=bad)
    out = P._measure_op(P.parse_args(["--rounds", "2", "--reps", "4"]),
                        [(bad, 1, 8, False), (good, 1, 8, False)], clocks, gemm=False)
    assert isinstance(out[0], RuntimeError) and str(out[0]) == "second round failed"
    assert out[1]["status"] == "ok" and out[1]["gemm_slowdown"] is None and "gemm_ratio" not in out[1]
    assert [n for fn, n, _ in clocks.log if fn is good] == [2, 2]


def test_each_round_has_its_own_order_and_every_target_goes_first_in_turn():
    assert [bench_timing._turn([0, 1, 2], r) for r in range(4)] == [[0, 1, 2], [2, 1, 0], [1, 2, 0], [0, 2, 1]]
    assert [bench_timing._turn([0, 1], r) for r in range(4)] == [[0, 1], [1, 0], [1, 0], [0, 1]]
    assert bench_timing._turn([], 3) == []


def test_measure_op_skips_a_target_in_rounds_without_a_share_of_its_calls(monkeypatch):
    clocks = _Clocks(monkeypatch)
    a, b = (lambda: None), (lambda: None)
    out = P._measure_op(P.parse_args(["--reps", "3", "--rounds", "5"]), [(a, 1, 8, False), (b, 1, 8, False)], clocks,
                        gemm=False)
    assert [r["status"] for r in out] == ["ok", "ok"]
    assert [(fn is a, n) for fn, n, _ in clocks.log] == [(True, 1), (False, 1), (False, 1), (True, 1), (False, 1),
                                                         (True, 1)]  # rounds 0-2; rounds 3 and 4 hold no call


def test_measure_op_records_a_probe_or_a_measure_that_raises_and_times_the_others(monkeypatch):
    clocks = _Clocks(monkeypatch)
    broken, unmeasurable, good = (lambda: 1 / 0), (lambda: None), (lambda: None)
    monkeypatch.setattr(P, "_host_us", lambda fn, reps: 1 / 0 if fn is unmeasurable else 3.0)
    out = P._measure_op(P.parse_args(["--rounds", "2"]),
                        [(broken, 1, 8, False), (unmeasurable, 1, 8, False), (good, 1, 8, False)], clocks, gemm=False)
    assert isinstance(out[0], ZeroDivisionError) and isinstance(out[1], ZeroDivisionError)
    assert out[2]["status"] == "ok"
    assert all(fn is not broken for fn, _, _ in clocks.log)  # never timed after its probe failed


def test_runner_gives_a_target_whose_cta_count_fails_an_error_row_and_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(P.Ours, "ctas", lambda self, op: 1 / 0 if op == "load_layer" else 0)
    rows = _run_layout(tmp_path, monkeypatch, ["--io-backends", "reference", "--peers", "hicache,lmcache", "--ops",
                                               "load_layer,load_burst"], "layer_first",
                       lm=lambda dev: (_FakeLmcacheOps(dev), None))
    assert [r[2:4] for r in rows] == [("load_layer", "error"), ("load_burst", "ok"), ("load_layer", "ok"),
                                      ("load_burst", "ok")]
    assert rows[0][:2] == ("hicache", "reference core.reference")
    assert rows[0][5] == "ZeroDivisionError: division by zero"


def test_runner_asks_what_served_the_timed_calls_before_the_host_time_calls_run(tmp_path, monkeypatch):
    """auto may route a pair anew during the host-time and GEMM calls: the CTA column is read before them."""
    route = [4]
    monkeypatch.setattr(P.Ours, "ctas", lambda self, op: route[0])
    clocks = _Clocks(monkeypatch)
    monkeypatch.setattr(P, "_host_us", lambda fn, reps: (route.__setitem__(0, 0), 3.0)[1])
    args = ["--io-backends", "reference", "--peers", "hicache", "--ops", "load_layer,load_burst"]
    _run_layout(tmp_path, monkeypatch, args, "layer_first", clocks=clocks)
    rows = json.loads((tmp_path / "peers.json").read_text())["rows"]
    assert [(r["op"], r["ctas"]) for r in rows] == [("load_layer", 4), ("load_burst", 0)]  # the second op: after


def test_runner_skips_the_operations_not_begun_when_the_time_budget_ends(tmp_path, monkeypatch):
    now = [0.0]
    monkeypatch.setattr(P, "time", types.SimpleNamespace(monotonic=lambda: now[0]))  # the runner's budget clock
    clocks = _Clocks(monkeypatch)
    real = bench_timing._samples_ms
    monkeypatch.setattr(bench_timing, "_samples_ms",
                        lambda fn, reps, warmup: (now.__setitem__(0, 2.0), real(fn, reps, warmup))[1])
    rows = _run_layout(tmp_path, monkeypatch, ["--io-backends", "reference", "--peers", "hicache,lmcache", "--ops",
                                               "load_layer,load_burst"], "layer_first",
                       lm=lambda dev: (_FakeLmcacheOps(dev), None), deadline=1.0, clocks=clocks)
    assert [(r[0], r[2], r[3]) for r in rows] == [
        ("hicache", "load_layer", "ok"), ("hicache", "load_burst", "skipped"),
        ("lmcache", "load_layer", "ok"), ("lmcache", "load_burst", "skipped")]
    assert rows[1][5] == rows[3][5] == "time budget"


def test_writer_regroups_rows_by_target_even_where_two_targets_share_a_name(tmp_path):
    w = P._Writer(str(tmp_path), {}, lambda _: None)
    w.add(_row(op="x", status="unsupported"))
    for op in ("load_layer", "load_burst"):
        for group in (0, 1):
            w.add(_row(op=op, status="unsupported", note=f"target {group}"), group)
    w.regroup(1)
    assert [(r["op"], r["note"]) for r in w.rows] == [
        ("x", None), ("load_layer", "target 0"), ("load_burst", "target 0"), ("load_layer", "target 1"),
        ("load_burst", "target 1")]
    assert json.loads((tmp_path / "peers.json").read_text())["rows"] == w.rows


def test_one_round_times_each_target_alone():
    assert bench_timing._shares(10, 1) == [10] and bench_timing._shares(10, 3) == [4, 3, 3] and bench_timing._shares(3, 5) == [1, 1, 1, 0, 0]


@pytest.mark.parametrize("bad", ["--rounds=0", "--reps=0"])
def test_rounds_and_reps_must_be_positive(bad, capsys):
    with pytest.raises(SystemExit):
        P.parse_args([bad])
    assert "must be at least 1" in capsys.readouterr().err


def test_runner_lets_a_layouts_targets_take_turns_and_writes_each_targets_rows_together(tmp_path, monkeypatch):
    clocks = _Clocks(monkeypatch)
    rows = _run_layout(tmp_path, monkeypatch, ["--io-backends", "reference", "--peers", "hicache,lmcache", "--ops",
                                               "backup_all_layers,load_layer", "--rounds", "2"], "layer_first",
                       lm=lambda dev: (_FakeLmcacheOps(dev), None), clocks=clocks)
    ours, theirs = ("hicache", "reference core.reference"), ("lmcache", "multi_layer_kv_transfer_unilateral")
    assert [r[:4] for r in rows] == [(*ours, "backup_all_layers", "ok"), (*ours, "load_layer", "ok"),
                                     (*theirs, "backup_all_layers", "ok"), (*theirs, "load_layer", "ok")]
    # per operation, two rounds of both targets (the second starting with lmcache): 4 shares per operation
    assert len(clocks.log) == 8 and [n for _, n, _ in clocks.log] == [5] * 8
    firsts = [fn for fn, _, _ in clocks.log]
    assert firsts[0] is not firsts[1] and firsts[2] is firsts[1] and firsts[3] is firsts[0]
    data = json.loads((tmp_path / "peers.json").read_text())
    assert [(r["peer"], r["op"]) for r in data["rows"]] == [(p, op) for p, _, op, *_ in rows]  # the file regrouped too


def test_runner_records_peers_that_cannot_run(tmp_path, monkeypatch):
    rows = _run_layout(tmp_path, monkeypatch, ["--peers", "sglang,lmcache", "--ops", "load_layer"], "layer_first",
                       kit=peer_sglang.SglangKit(import_error="no tvm_ffi"), lm=(None, "import lmcache.c_ops: nope"))
    assert rows == [("sglang", "jit/tma", "-", "error", None, "RuntimeError: no tvm_ffi"),
                    ("lmcache", "multi_layer_kv_transfer_unilateral", "-", "error", None,
                     "RuntimeError: LMCache's CUDA ops do not import: import lmcache.c_ops: nope")]


def test_runner_records_a_mismatching_peer_untimed(tmp_path, monkeypatch):
    ops = _FakeLmcacheOps({})
    ops.multi_layer_kv_transfer_unilateral = lambda *a: None  # moves nothing
    rows = _run_layout(tmp_path, monkeypatch, ["--peers", "lmcache"], "layer_first", lm=(ops, None))
    assert len(rows) == 1 and rows[0][:5] == ("lmcache", "multi_layer_kv_transfer_unilateral", "-", "mismatch", False)
    assert rows[0][5].startswith("lmcache multi_layer_kv_transfer_unilateral: backup_all_layers wrote host buffer 'kv' "
                                 "differently from the reference backend: ")


def test_runner_skips_targets_past_the_time_budget(tmp_path, monkeypatch):
    rows = _run_layout(tmp_path, monkeypatch, ["--io-backends", "reference", "--peers", "hicache,lmcache"],
                       "layer_first", lm=(None, "x"), deadline=0.0)
    assert rows == [("hicache", "reference core.reference", "-", "skipped", None, "time budget"),
                    ("lmcache", "multi_layer_kv_transfer_unilateral", "-", "skipped", None, "time budget")]


def test_runner_names_a_missing_layout(tmp_path, monkeypatch):
    rows = _run_layout(tmp_path, monkeypatch, ["--peers", "hicache"], "no_such_layout")
    assert rows[0][3] == "error" and rows[0][5].startswith("layout 'no_such_layout' is not installed; installed: [")


class _FakeSglangModule:
    """SGLang's JIT launchers' contract (sglang/kernels/ops/kvcache/hicache.py) in torch: pointer tables are
    resolved to the tensors they were built from, strides are checked, rows copied."""

    def __init__(self, tensors, tma: bool):
        self.by_ptr = {t.data_ptr(): t for t in tensors}
        self.tma = tma

    def _all(self, dsts, idx_d, srcs, idx_s, src_stride, dst_stride, *row):
        assert len(row) == (1 if self.tma else 0)
        for ptr_d, ptr_s in zip(dsts, srcs):
            for p_d, p_s in zip(ptr_d.tolist(), ptr_s.tolist()):
                d, s = self.by_ptr[p_d], self.by_ptr[p_s]
                assert (s.stride(0) * s.element_size(), d.stride(0) * d.element_size()) == (src_stride, dst_stride)
                d[idx_d] = s[idx_s]

    def launch_all_mla(self, ptr_dst, idx_d, ptr_src, idx_s, src_stride, dst_stride, *row):
        self._all([ptr_dst], idx_d, [ptr_src], idx_s, src_stride, dst_stride, *row)

    def launch_all(self, k_dst, v_dst, idx_d, k_src, v_src, idx_s, src_stride, dst_stride, *row):
        self._all([k_dst, v_dst], idx_d, [k_src, v_src], idx_s, src_stride, dst_stride, *row)

    def launch_one_mla(self, dst, idx_d, src, idx_s):
        dst[idx_d] = src[idx_s]

    def launch_one(self, k_dst, v_dst, idx_d, k_src, v_src, idx_s):
        k_dst[idx_d], v_dst[idx_d] = k_src[idx_s], v_src[idx_s]

    def fits_device(self, device):
        return True


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("make", [_mla, _mha])
def test_sglang_adapter_passes_sglangs_arguments(make, layout, tma, monkeypatch):
    spec = make()
    dev = _dev(spec)
    h, s, d = _idx()
    host = allocate_host_buffers(create_registry().layout(layout).plan(spec), pin_memory=False)
    views = peer_sglang._Sides(spec, layout, dev, host).host_layers
    module = _FakeSglangModule([t for ts in dev.values() for t in ts] + [v for vs in views.values() for v in vs], tma)
    row = spec.components[0].row_bytes
    kit = peer_sglang.SglangKit(ops=types.SimpleNamespace(hicache_tma_rows_per_chunk=lambda r: 2),
                                modules={("tma", 4) if tma else ("jit", row, 4): module})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    peer = peer_sglang.SglangJit(kit, tma, 4, spec, layout, dev, host)
    check_bit_exact(peer, _ref(spec, layout, dev), dev, h, s, d, label="sglang")
    assert peer.ctas("load_layer") == 4


def test_sglang_tma_needs_pages_that_tile_its_chunks():
    spec = _mla()
    kit = peer_sglang.SglangKit(ops=types.SimpleNamespace(hicache_tma_rows_per_chunk=lambda r: 8),
                                modules={("tma", 4): _FakeSglangModule([], True)})
    host = allocate_host_buffers(create_registry().layout("page_first").plan(spec), pin_memory=False)
    with pytest.raises(ValueError, match="only when pages tile its 8-row chunks; page_size 4 does not"):
        peer_sglang.SglangJit(kit, True, 4, spec, "page_first", _dev(spec), host)


def test_run_peers_writes_every_cell_in_order(tmp_path, monkeypatch):
    """The whole loop with the CUDA-only parts replaced: a CPU shape, CPU indices, fake timing."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(P, "_meta", lambda args, notes: {"notes": notes})
    _Clocks(monkeypatch)
    monkeypatch.setattr(P, "_Memcpy", lambda: types.SimpleNamespace(gbps=_Clocks.gbps))
    monkeypatch.setattr(P, "_indices", lambda spec, gen: _idx())
    monkeypatch.setitem(P.SHAPES, "tiny-mla", lambda n, ps, device: _mla())
    monkeypatch.setitem(P.SHAPES, "tiny-huge", lambda n, ps, device: _mla())
    real = P._device_buffers
    monkeypatch.setattr(P, "_device_buffers", lambda spec, rows: real(spec, rows) if rows < 100 else 1 / 0)
    args = P.parse_args(["--out", str(tmp_path), "--cells", f"tiny-mla@{CAP},tiny-huge@1000", "--page-size", str(PS),
                         "--io-backends", "reference,nope", "--peers", "hicache", "--ops", "load_layer"])
    rows = P.run_peers(args, progress=lambda _: None)
    assert [(r["shape"], r["layout"], r["peer"], r["op"], r["status"]) for r in rows] == [
        ("tiny-mla", "layer_first", "hicache", "load_layer", "ok"),
        ("tiny-mla", "page_first", "hicache", "load_layer", "ok"),
        ("tiny-huge", "layer_first", "*", "-", "error"),
        ("tiny-huge", "page_first", "*", "-", "error"),
    ]
    assert rows[2]["error"] == "ZeroDivisionError: division by zero"
    data = json.loads((tmp_path / "peers.json").read_text())
    assert data["rows"] == rows
    assert data["meta"]["notes"] == ["io_backend 'nope' is not registered here; its rows are skipped"]


def test_hicache_bench_peers_runs_the_peer_benchmark_with_its_arguments(monkeypatch, tmp_path):
    import argparse

    from hicache_core import bench

    real = bench.peers_module()
    assert callable(real.main) and callable(real.run_peers)  # the checkout's benchmarks/peers.py
    seen = []

    class Fake:
        @staticmethod
        def main(argv):
            seen.append(argv)
            return 0

    monkeypatch.setattr(bench.command, "peers_module", lambda: Fake)
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--out", str(tmp_path), "--peers", "--peers-args", "--time-budget 60 --cells mla"])
    assert args.func(args) == 0
    assert seen == [["--out", str(tmp_path), "--time-budget", "60", "--cells", "mla"]]
    seen.clear()  # without --out none is passed: the peer benchmark picks its own folder (a None there crashed it)
    args = parser.parse_args(["bench", "--peers", "--peers-args", "--time-budget 60"])
    assert args.func(args) == 0 and seen == [["--time-budget", "60"]]
