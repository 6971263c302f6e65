"""Fenced kernel backups (kernel_lib.tile_done, Tuning.fence / fence_min_row_bytes, rowcopy_launch.fenced, the
strategy option backup_fence) checked on CPU where tests/test_rowcopy.py can only check them on a GPU: there every
launch passes ``FENCE`` False off CUDA, so the row-bytes floor, the per-direction values and ``describe``'s wording
are asserted only as "not fenced".  Here a group's anchor is made to look like a CUDA tensor outside the
interpreter (nothing is launched with ``FENCE`` True), and the kernels' sources are read for where they fence."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import ast  # noqa: E402
import importlib  # noqa: E402
import inspect  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402

from hicache_core import (HostKVPool, LayerMap, PoolSpec, claunch, create_registry, kernel_lib,  # noqa: E402
                          kernel_support, rowcopy, rowcopy_launch)
from hicache_core.errors import ConfigError  # noqa: E402
from hicache_core.rowcopy import Tuning, build_groups  # noqa: E402
from hicache_core.testing.conformance import Case, make_device_buffers  # noqa: E402
from hicache_kv_split.strategy import KVSplitKernelStrategy  # noqa: E402
from hicache_layer_first.strategy import LayerFirstKernelStrategy  # noqa: E402
from hicache_page_first.strategy import PageFirstDirectKernelStrategy, PageFirstKernelStrategy  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PIN = DEVICE.type == "cuda"
REGISTRY = create_registry()
KERNELS = {"layer_first": LayerFirstKernelStrategy, "page_first": PageFirstKernelStrategy,
           "page_first_direct": PageFirstDirectKernelStrategy, "page_first_kv_split": KVSplitKernelStrategy}


class _CudaLike:
    """A group's anchor as ``fenced`` sees a CUDA tensor's (its element size kept)."""

    is_cuda = True

    def __init__(self, t: torch.Tensor) -> None:
        self._t = t

    def element_size(self) -> int:
        return self._t.element_size()


def _as_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every launch prepared from now on decides ``FENCE`` as on a CUDA device outside the interpreter."""
    real = rowcopy_launch.fenced
    monkeypatch.setattr(rowcopy_launch, "interpreting", lambda: False)
    monkeypatch.setattr(rowcopy_launch, "fenced", lambda t, g: real(t, replace(g, anchor=_CudaLike(g.anchor))))


def _mha(row: int, device=DEVICE) -> PoolSpec:
    """MHA bf16 ``k``/``v`` rows of ``row`` bytes (one head)."""
    return PoolSpec.mha(layer_map=LayerMap.unsharded(2), head_num=1, head_dim=row // 2, dtype=torch.bfloat16,
                        page_size=4, capacity=8, device=device)


def _mla(device=DEVICE) -> PoolSpec:
    """MLA bf16 rows of 1024 + 128 bytes (``latent`` + ``rope``)."""
    return PoolSpec.mla(layer_map=LayerMap.unsharded(2), kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                        page_size=4, capacity=8, device=device)


def _dev(spec: PoolSpec) -> dict:
    return make_device_buffers(spec, Case("rows", lambda device: spec), torch.Generator().manual_seed(0))


def _pool(spec: PoolSpec, layout: str, io: str = "kernel", **options) -> HostKVPool:
    return HostKVPool(spec, layout, io, _dev(spec), registry=REGISTRY, pin_memory=PIN, strategy_options=options)


# -- the floor is in bytes of the whole row ---------------------------------------------------------------------
@pytest.mark.parametrize("row", [576, 1152, 2048])
def test_the_floor_counts_row_bytes_not_access_words(monkeypatch, row):
    """``g.width`` is in access words of ``g.anchor``'s dtype: the floor compares ``width * element_size`` bytes."""
    pool = _pool(_mha(row), "layer_first", "reference")
    groups = build_groups(pool.binding, fuse_parts=False, strategy="test")
    assert groups and all(g.word > 1 for g in groups)  # else words and bytes would agree and this proved nothing
    monkeypatch.setattr(rowcopy_launch, "interpreting", lambda: False)
    t = Tuning(8, 4, 32768, fence=True, fence_min_row_bytes=row)
    for g in groups:
        cuda = replace(g, anchor=_CudaLike(g.anchor))
        assert g.width * g.word == row
        assert rowcopy_launch.fenced(t, cuda)  # at the floor
        assert not rowcopy_launch.fenced(replace(t, fence_min_row_bytes=row + 1), cuda)  # a byte under it
        assert not rowcopy_launch.fenced(replace(t, fence=False, fence_min_row_bytes=0), cuda)
        assert rowcopy_launch.fenced(replace(t, fence_min_row_bytes=0), cuda) is True
        assert not rowcopy_launch.fenced(replace(t, fence_min_row_bytes=0), replace(g, anchor=g.anchor.cpu()))
    monkeypatch.setattr(rowcopy_launch, "interpreting", lambda: True)  # the interpreter has no inline PTX
    for g in groups:
        assert not rowcopy_launch.fenced(replace(t, fence_min_row_bytes=0), replace(g, anchor=_CudaLike(g.anchor)))


def test_a_fused_rows_floor_counts_both_parts(monkeypatch):
    """MLA latent (1024 B) + rope (128 B) fused in one group (kv_split): the floor sees 1152 bytes."""
    pool = _pool(_mla(), "page_first_kv_split", "reference")
    (g,) = build_groups(pool.binding, fuse_parts=True, strategy="test")
    assert (g.width * g.word, g.split * g.word) == (1152, 1024)
    monkeypatch.setattr(rowcopy_launch, "interpreting", lambda: False)
    cuda = replace(g, anchor=_CudaLike(g.anchor))
    assert rowcopy_launch.fenced(Tuning(8, 4, 32768, fence=True, fence_min_row_bytes=1100), cuda)
    assert not rowcopy_launch.fenced(Tuning(8, 4, 32768, fence=True, fence_min_row_bytes=1153), cuda)


# -- what prepare passes each launch --------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", KERNELS)
def test_prepared_backups_alone_fence_by_the_plugins_floor_and_keys_follow(monkeypatch, layout):
    """On CUDA (simulated) the plugin's backups of rows at its floor launch with ``FENCE`` True, 16 bytes under it
    False, loads never; ``backup_fence`` True/False overrides the floor both ways; a fenced and an unfenced backup of
    the same group never share a static launch key (a compiled kernel or a replayed launch), loads always do."""
    _as_cuda(monkeypatch)
    floor = KERNELS[layout].tuning.backup.fence_min_row_bytes
    assert KERNELS[layout].tuning.backup.fence and floor > 16

    def fence_args(pool):
        prep = pool.binding.scratch[pool.strategy_name]
        at = prep.launcher.arg_names.index("FENCE")
        return prep, [{to_host: lv.args[at] for to_host, lv in launches.items()} for launches in prep.launches]

    for row, options, want in ((floor, {}, True), (floor - 16, {}, False), (floor - 16, {"backup_fence": True}, True),
                               (floor, {"backup_fence": False}, False)):
        _, by_group = fence_args(_pool(_mha(row), layout, **options))
        assert by_group and all(v == {True: want, False: False} for v in by_group), (row, options, by_group)
    fenced, unfenced = (fence_args(_pool(_mha(floor), layout, **o))[0] for o in ({}, {"backup_fence": False}))
    for a, b in zip(fenced.launches, unfenced.launches):
        assert a[True].key != b[True].key and a[False].key == b[False].key
    for parts in fenced.pages or ():  # page loads (when prepared) take no fence
        for lv, _ in parts or ():
            names = fenced.page_launcher.arg_names
            assert "FENCE" not in names or lv.args[names.index("FENCE")] is False


def test_backup_fence_leaves_loads_and_keeps_the_other_options():
    cpu = torch.device("cpu")
    for cls in KERNELS.values():
        base = cls().effective_tuning(cpu)
        for option in (True, False):
            t = cls(backup_fence=option, backup_programs=3, num_warps=2, num_stages=2).effective_tuning(cpu)
            assert (t.backup.fence, t.backup.fence_min_row_bytes) == (option, 0)
            assert (t.backup.programs, t.backup.num_warps, t.backup.stages) == (3, 2, 2)
            assert not t.load.fence and not t.load.fence_min_row_bytes
            assert t.load == replace(base.load, num_warps=2, stages=2)
        kept = cls(backup_programs=3, num_warps=2).effective_tuning(cpu).backup  # backup_fence unset: the tuning's
        assert (kept.fence, kept.fence_min_row_bytes) == (base.backup.fence, base.backup.fence_min_row_bytes)
    for bad in (True, 1.5, "1024", -1):
        with pytest.raises(ConfigError, match="fence_min_row_bytes must be an int >= 0"):
            Tuning(8, 4, 32768, fence=True, fence_min_row_bytes=bad)


# -- what explain says on CUDA ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", KERNELS)
def test_describe_on_cuda_names_the_fence_and_its_floor_for_backups_only(monkeypatch, layout):
    monkeypatch.setattr(rowcopy, "interpreting", lambda: False)
    monkeypatch.setattr(claunch, "module", lambda: None)  # no compiled launch module is built for the second line
    monkeypatch.delenv("HICACHE_KERNEL_PROGRAMS", raising=False)
    cls = KERNELS[layout]
    spec = _mha(2048, torch.device("cuda"))
    floor = cls.tuning.backup.fence_min_row_bytes

    def parts(**options):
        line = cls(**options).describe(spec, None)[0]
        backups, loads = line.split("; loads ", 1)
        return backups, loads

    per = "every layer of a run of whole pages" if cls.entries_inner else "some layers"  # the backups' launch_bytes
    split = f", launches of up to 32 MiB (a call of more: {per} per launch)"
    if kernel_support.dependent_launches(spec.device):  # a GPU of compute capability >= 9.0 (the default backup_pdl)
        split += ", each after the first a programmatic dependent launch"
    backups, loads = parts()
    assert backups.endswith(f"B tiles, each tile's writes awaited (fenced) for rows of >= {floor} B{split}"), backups
    assert "fenced" not in loads
    backups, loads = parts(backup_fence=True)
    assert backups.endswith(f"B tiles, each tile's writes awaited (fenced){split}") and "fenced" not in loads
    backups, loads = parts(backup_fence=True, backup_launch_bytes=0)
    assert backups.endswith("B tiles, each tile's writes awaited (fenced)") and "launches of" not in loads
    assert "fenced" not in "".join(parts(backup_fence=False))
    monkeypatch.setattr(rowcopy, "interpreting", lambda: True)  # under the interpreter nothing is fenced
    assert "fenced" not in "".join(parts())


# -- where the kernels fence ------------------------------------------------------------------------------------------
def _calls(node: ast.AST, name: str) -> list[ast.Call]:
    return [c for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
            and c.func.attr == name]


@pytest.mark.parametrize("layout", KERNELS)
def test_plugin_kernels_fence_once_at_the_end_of_each_work_item(layout):
    """``kl.tile_done(FENCE)`` is the last statement of the work-item loop and nowhere else: a fence after the loop
    (once per program) compiles to the same single ``fence.sc.gpu`` that tests/test_kernel_ptx.py counts."""
    kernel = importlib.import_module(KERNELS[layout].kernel_module).KERNEL
    fn = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn))).body[0]
    assert isinstance(fn, ast.FunctionDef)
    fence = next(a for a in fn.args.args if a.arg == "FENCE")
    assert "constexpr" in ast.unparse(fence.annotation)
    (loop,) = [s for s in fn.body if isinstance(s, ast.For)]
    last = loop.body[-1]
    assert isinstance(last, ast.Expr) and ast.unparse(last.value) == "kl.tile_done(FENCE)", ast.unparse(last)
    assert len(_calls(fn, "tile_done")) == 1


def test_tile_done_is_one_gpu_scope_fence_per_thread_kept_by_the_compiler():
    fn = ast.parse(textwrap.dedent(inspect.getsource(kernel_lib.tile_done.fn))).body[0]
    (asm,) = _calls(fn, "inline_asm_elementwise")
    kw = {k.arg: ast.unparse(k.value) for k in asm.keywords}
    assert kw["is_pure"] == "False" and kw["pack"] == "1"  # not removable, one element (thread) per asm
    assert ast.literal_eval(asm.args[0]).startswith("fence.sc.gpu;")
    assert ast.unparse(asm.args[2]) == "[tl.program_id(0)]"  # a scalar: one fence per thread, not per element


# -- a kernel without FENCE still works ----------------------------------------------------------------------------
def _no_fence_source() -> str:
    """``layer_first``'s kernel module without ``FENCE`` (its parameter and the ``tile_done`` call): a plugin kernel
    written before backups were fenced."""
    src = inspect.getsource(importlib.import_module(LayerFirstKernelStrategy.kernel_module))
    out = src.replace(", FENCE: tl.constexpr", "").replace("        kl.tile_done(FENCE)\n", "")
    assert "FENCE" not in out
    return out


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the CUDA fence simulation below would launch on a real GPU")
def test_a_kernel_without_fence_ignores_backup_fence(monkeypatch, tmp_path):
    (tmp_path / "review_no_fence_kernel.py").write_text(_no_fence_source())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "review_no_fence_kernel", raising=False)
    _as_cuda(monkeypatch)  # a kernel declaring FENCE would now get True (and fail in the interpreter)

    class NoFence(LayerFirstKernelStrategy):
        name, kernel_module = "test.no_fence", "review_no_fence_kernel"

    spec = _mha(2048)
    pool, ref = _pool(spec, "layer_first"), _pool(spec, "layer_first", "reference")
    s = NoFence(backup_fence=True)
    s.prepare(pool.binding)
    prep = pool.binding.scratch[s.name]
    assert "FENCE" not in prep.launcher.arg_names
    h, d = torch.tensor([4, 5, 6, 7, 0, 1, 2, 3]), torch.tensor([3, 9, 1, 12, 15, 0, 7, 19])  # whole pages
    s.transfer(pool.binding, h, d, None, to_host=True)
    ref.backup_all_layers(h, d)
    assert any(t.view(torch.uint8).any() for t in ref.host_buffers.values())  # the backup moved bytes
    for name, t in ref.host_buffers.items():
        assert torch.equal(pool.host_buffers[name].view(torch.uint8), t.view(torch.uint8)), name
    # explain does not claim a fence the kernel cannot take (its module is imported now), and still does for the
    # shipped kernel
    monkeypatch.setattr(rowcopy, "interpreting", lambda: False)
    monkeypatch.setattr(claunch, "module", lambda: None)
    cuda_spec = _mha(2048, torch.device("cuda"))
    assert "fenced" not in s.describe(cuda_spec, None)[0]
    assert "fenced" in LayerFirstKernelStrategy().describe(cuda_spec, None)[0]


def test_describe_reads_a_kernel_module_not_yet_imported(monkeypatch, tmp_path):
    """explain on CUDA before any transfer: the kernel module is imported to read its parameters, so a kernel without
    ``FENCE`` or ``PDL`` is not described as fenced or chained (it was assumed to declare both); a module that cannot
    be imported claims neither (the first transfer raises its error)."""
    src = _no_fence_source().replace(", PDL: tl.constexpr = 0", "")
    src = src.replace("kl.let_next_begin(item, n_items, nprog, PDL)", "pass").replace("kl.await_previous(PDL)", "pass")
    assert "PDL" not in src
    (tmp_path / "review_plain_kernel.py").write_text(src)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "review_plain_kernel", raising=False)
    monkeypatch.setattr(rowcopy, "interpreting", lambda: False)
    monkeypatch.setattr(claunch, "module", lambda: None)
    monkeypatch.setattr(rowcopy, "dependent_launches", lambda device: True)  # a Hopper-class GPU

    class Plain(LayerFirstKernelStrategy):
        name, kernel_module = "test.plain", "review_plain_kernel"

    class Missing(LayerFirstKernelStrategy):
        name, kernel_module = "test.missing", "review_no_such_kernel_module"

    spec = _mha(2048, torch.device("cuda"))
    for cls in (Plain, Missing):
        line = cls().describe(spec, None)[0]
        assert "fenced" not in line and "programmatic dependent" not in line, (cls.name, line)
    assert "review_plain_kernel" in sys.modules
    shipped = LayerFirstKernelStrategy().describe(spec, None)[0]
    assert "fenced" in shipped and "programmatic dependent" in shipped, shipped


def test_describe_reads_each_parameter_on_its_own_and_imports_nothing_off_cuda(monkeypatch, tmp_path):
    """A kernel declaring ``FENCE`` but not ``PDL`` is described as fenced, not chained (each claim reads its own
    parameter); off CUDA, or under Triton's interpreter, describe imports no kernel module (neither claim can apply)."""
    src = inspect.getsource(importlib.import_module(LayerFirstKernelStrategy.kernel_module))
    src = src.replace(", PDL: tl.constexpr = 0", "")
    src = src.replace("kl.let_next_begin(item, n_items, nprog, PDL)", "pass").replace("kl.await_previous(PDL)", "pass")
    assert "PDL" not in src and "FENCE" in src
    (tmp_path / "review_fence_only_kernel.py").write_text(src)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "review_fence_only_kernel", raising=False)
    monkeypatch.setattr(rowcopy, "interpreting", lambda: False)
    monkeypatch.setattr(claunch, "module", lambda: None)
    monkeypatch.setattr(rowcopy, "dependent_launches", lambda device: True)

    class FenceOnly(LayerFirstKernelStrategy):
        name, kernel_module = "test.fence_only", "review_fence_only_kernel"

    line = FenceOnly().describe(_mha(2048, torch.device("cuda")), None)[0]
    assert "fenced" in line and "programmatic dependent" not in line, line
    assert "review_fence_only_kernel" in sys.modules
    # a module whose import fails with any error (not only ImportError; here one that needs what this machine lacks)
    (tmp_path / "review_raising_kernel.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.delitem(sys.modules, "review_raising_kernel", raising=False)

    class Raising(LayerFirstKernelStrategy):
        name, kernel_module = "test.raising", "review_raising_kernel"

    line = Raising().describe(_mha(2048, torch.device("cuda")), None)[0]
    assert "fenced" not in line and "programmatic dependent" not in line, line

    monkeypatch.setattr(rowcopy.RowKernelStrategy, "_kernel_params",
                        lambda self: pytest.fail(f"describe imported {self.kernel_module} off CUDA"))
    cpu = _mha(2048, torch.device("cpu"))
    line = LayerFirstKernelStrategy().describe(cpu, None)[0]
    assert "fenced" not in line and "programmatic dependent" not in line, line
    monkeypatch.setattr(rowcopy, "interpreting", lambda: True)
    line = LayerFirstKernelStrategy().describe(_mha(2048, torch.device("cuda")), None)[0]
    assert "fenced" not in line and "programmatic dependent" not in line, line


# -- the peer record at the shipped defaults ------------------------------------------------------------------------
def test_the_peer_backups_at_the_fenced_defaults_take_over_no_cell():
    """docs/perf/peers-backups-h100-cb3dfb2-2026-12-07.json (the backups as shipped, fenced by the floor; the grid of
    tests/test_peer_table.py's f330333 run fenced every row): its four backup cells stay SGLang's."""
    import json
    from pathlib import Path

    from benchmarks import peer_table

    path = Path(__file__).resolve().parents[1] / "docs/perf/peers-backups-h100-cb3dfb2-2026-12-07.json"
    table = peer_table.build(json.loads(path.read_text(encoding="utf-8")), say=lambda _: None)
    assert len(table["entries"]) == 4 and all(e["op"] == "backup" and not e["take_over"] for e in table["entries"])


@pytest.mark.parametrize("name, cells", [
    ("peers-backups-split-h100-c273e56-2026-12-07.json", {("mha", "layer_first"), ("mha", "page_first"),
                                                           ("mla", "layer_first"), ("mla", "page_first")}),
    ("peers-backups-pagefirst-h100-01c7ba6-2026-12-07.json", {("mha", "page_first"), ("mla", "page_first")})])
def test_the_peer_backups_split_into_launches_cost_the_gemm_less_than_sglangs_kernel(name, cells):
    """The peers' backup cells with backups split into launches of <= 32 MiB (layer_first at c273e56, page_first at
    01c7ba6, the code as shipped): hicache's kernel costs the GEMM beside it less than SGLang's JIT kernel in every cell
    (and at most 2%), and no cell is taken over: the kernel stays behind SGLang's on the ratio."""
    import json
    from pathlib import Path

    from benchmarks import peer_table

    results = json.loads((Path(__file__).resolve().parents[1] / "docs/perf" / name).read_text(encoding="utf-8"))
    table = peer_table.build(results, say=lambda _: None)
    assert {(e["kind"], e["layout"]) for e in table["entries"]} == cells
    assert all(e["op"] == "backup" and not e["take_over"] for e in table["entries"])
    gemm = {(r["shape"][:3], r["layout"], r["peer"], r["variant"]): r["gemm_slowdown"] for r in results["rows"]
            if r["op"] == "backup_all_layers" and r["status"] == "ok" and r["gemm_slowdown"] is not None}
    for kind, layout in cells:
        ours = [v for (k, lay, peer, var), v in gemm.items()
                if (k, lay, peer) == (kind, layout, "hicache") and var.startswith("kernel ")]
        jit = gemm[(kind, layout, "sglang-jit", "q=2 (default)")]
        assert len(ours) == 1 and ours[0] <= 0.02 and ours[0] < jit, (kind, layout, ours, jit)
