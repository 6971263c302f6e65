"""Programmatic dependent launches (Tuning.pdl / backup_pdl), on the CPU (a fake driver, Triton's compiler without a
GPU):

* the CUlaunchConfig / CUlaunchAttribute that both launch routes (ctypes and the compiled call) hand
  cuLaunchKernelEx, read back through an independent transcription of cuda.h's types (a union that holds pointers,
  as cuda.h's does), not through drvlaunch's own structs;
* Launcher(pdl=True): its own compiled kernel (launch_pdl passed to Triton only there), its own packed launch, the
  plain launch through cuLaunchKernel and the dependent one through cuLaunchKernelEx;
* the strategy: on the replay path (recorded and replayed through the fake driver's fallback) a split backup keeps
  its first launch plain and makes the rest dependent, group by group (a pool of several launch groups).
"""

from __future__ import annotations

import ctypes
import os
import types

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest  # noqa: E402

from hicache_core import HostKVPool, claunch, drvlaunch, replay, rowcopy_launch  # noqa: E402
from hicache_core.drvlaunch import DriverKernel  # noqa: E402
from hicache_core.testing.conformance import CASES, make_device_buffers  # noqa: E402
from test_drvlaunch import FakeLibEx, _compiled, _desc, driver_launcher  # noqa: E402
from test_launch_split import KERNELS, REGISTRY, _pages, _pools  # noqa: E402


# -- cuda.h's types, transcribed independently (CUDA 12.x / 13.x) ------------------------------------------
class _AccessPolicyWindow(ctypes.Structure):
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hitRatio", ctypes.c_float),
                ("hitProp", ctypes.c_int), ("missProp", ctypes.c_int)]


class _ProgrammaticEvent(ctypes.Structure):
    _fields_ = [("event", ctypes.c_void_p), ("flags", ctypes.c_int), ("triggerAtBlockStart", ctypes.c_int)]


class _CuValue(ctypes.Union):
    """``CUlaunchAttributeValue``: ``char pad[64]`` and members among which pointers (alignment 8)."""

    _fields_ = [("pad", ctypes.c_char * 64), ("accessPolicyWindow", _AccessPolicyWindow),
                ("programmaticStreamSerializationAllowed", ctypes.c_int), ("programmaticEvent", _ProgrammaticEvent)]


class _CuAttr(ctypes.Structure):
    """``CUlaunchAttribute``: ``CUlaunchAttributeID id; char pad[8 - sizeof(CUlaunchAttributeID)]; value``."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _CuValue)]


class _CuConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_CuAttr)),
                ("numAttrs", ctypes.c_uint)]


#: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION in cuda.h's CUlaunchAttributeID
_CU_PSS = 6


def test_the_ctypes_structs_have_cuda_h_sizes_and_offsets():
    """drvlaunch's structs against the transcription: every field drvlaunch writes at cuda.h's offset, the same
    sizes (an array of attributes would stride alike) and alignment (cuda.h's attribute is 8-aligned: its value union
    holds pointers)."""
    ours_c, ours_a = drvlaunch._LaunchConfig, drvlaunch._LaunchAttribute
    assert ctypes.sizeof(ours_c) == ctypes.sizeof(_CuConfig) == 56
    assert ctypes.sizeof(ours_a) == ctypes.sizeof(_CuAttr) == 72
    for ours, theirs in (("grid_x", "gridDimX"), ("grid_y", "gridDimY"), ("grid_z", "gridDimZ"),
                         ("block_x", "blockDimX"), ("block_y", "blockDimY"), ("block_z", "blockDimZ"),
                         ("shared", "sharedMemBytes"), ("stream", "hStream"), ("attrs", "attrs"),
                         ("n_attrs", "numAttrs")):
        assert getattr(ours_c, ours).offset == getattr(_CuConfig, theirs).offset, ours
    assert ours_a.id.offset == _CuAttr.id.offset == 0
    assert ours_a.value.offset == _CuAttr.value.offset + _CuValue.programmaticStreamSerializationAllowed.offset == 8
    assert ctypes.alignment(_CuAttr) == 8 and ctypes.alignment(_CuConfig) == 8
    assert ctypes.alignment(ours_a) == 8 and ctypes.alignment(ours_c) == 8


_EX_T = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                         ctypes.c_void_p)
_PLAIN_T = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                            ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)


class _Driver:
    """C entry points (ctypes callbacks) for cuLaunchKernel and cuLaunchKernelEx; the Ex one reads its configuration
    through the cuda.h transcription."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, []
        self.cuLaunchKernel = _PLAIN_T(self._plain)
        self.cuLaunchKernelEx = _EX_T(self._ex)

    def _params(self, params):
        return [ctypes.string_at(params[i], 8) for i in range(self.n)]

    def _plain(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        self.calls.append(("plain", fn, (gx, gy, gz), (bx, by, bz), shared, stream or 0, [], self._params(params),
                           extra))
        return 0

    def _ex(self, cfg_addr, fn, params, extra):
        c = _CuConfig.from_address(cfg_addr)
        attrs = [(c.attrs[i].id, c.attrs[i].value.programmaticStreamSerializationAllowed) for i in range(c.numAttrs)]
        self.calls.append(("ex", fn, (c.gridDimX, c.gridDimY, c.gridDimZ), (c.blockDimX, c.blockDimY, c.blockDimZ),
                           c.sharedMemBytes, c.hStream or 0, attrs, self._params(params), extra))
        return 0


class _T:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


@pytest.mark.skipif(claunch.module() is None, reason="no compiled launch call here")
@pytest.mark.parametrize("pdl", [False, True])
def test_both_routes_hand_the_driver_the_same_launch_as_cuda_h_reads_it(pdl):
    """A packed launch through the compiled call and through ctypes: the same entry point, grid, block, shared
    memory, stream, parameter bytes and (dependent) exactly one attribute, id 6, value 1, read as cuda.h lays them
    out; a plain launch never reaches cuLaunchKernelEx."""
    drv = _Driver(3)
    lib = types.SimpleNamespace(cuLaunchKernel=drv.cuLaunchKernel, cuLaunchKernelEx=drv.cuLaunchKernelEx)
    kernel = DriverKernel(lib, types.SimpleNamespace(function=0x77), [("ptr", 0, 0), ("i32", 1, 0)], 1, 4, 2048, (),
                          pdl)
    packed = kernel.pack([_T(0x1000), 5], dynamic=[0, 1])
    assert packed.fast is not None and (packed.config is not None) == pdl
    try:
        assert kernel.launch(9, 0x50, packed, [_T(0x2000), 7])
        claunch.set_c_launch(False)
        assert kernel.launch(9, 0x50, packed, [_T(0x2000), 7])
    finally:
        claunch.set_c_launch(None)
    compiled_call, through_ctypes = drv.calls
    assert compiled_call == through_ctypes
    kind, fn, grid, block, shared, stream, attrs, params, extra = compiled_call
    assert (kind, fn, grid, block, shared, stream, extra) == ("ex" if pdl else "plain", 0x77, (9, 1, 1), (128, 1, 1),
                                                            2048, 0x50, None)
    assert attrs == ([(_CU_PSS, 1)] if pdl else [])
    assert params[:2] == [(0x2000).to_bytes(8, "little"), (7).to_bytes(8, "little")]


# -- Launcher(pdl=): its own compiled kernel and packed launch ---------------------------------------------
class _PdlKernel:
    """A Triton-like kernel whose compiled handle reflects the ``launch_pdl`` option it was compiled with."""

    arg_names = ["anchor", "desc", "none", "n", "W"]
    constexprs = [4]

    def __init__(self) -> None:
        self.compiles: list[bool] = []

    def __getitem__(self, grid):
        def launch(*args, num_warps, **opts):
            self.compiles.append(bool(opts.get("launch_pdl", False)))
            c = _compiled(launch_pdl=bool(opts.get("launch_pdl", False)))
            c.run = lambda *a: None
            c.packed_metadata = object()
            return c
        return launch


@pytest.fixture
def ex_launcher(monkeypatch):
    lib = FakeLibEx()
    monkeypatch.setattr(drvlaunch, "_LIB", [lib])
    kernel = _PdlKernel()
    with driver_launcher(kernel) as launcher:
        yield lib, kernel, launcher


def test_a_dependent_launch_compiles_and_packs_apart_and_takes_cuLaunchKernelEx(ex_launcher):
    """One launch's packs, a plain and a dependent call alternating (as a split backup's first and later launches):
    two compiles (launch_pdl only in the second), two packed launches, the plain one through cuLaunchKernel, the
    dependent one through cuLaunchKernelEx with the programmatic attribute."""
    lib, kernel, launcher = ex_launcher
    args = [torch.zeros(4, dtype=torch.int32), _desc(torch.zeros(40 * 288, dtype=torch.int32)), None, 100, 288]
    key, packs = launcher.static_key(args, (3,)), {}
    for n, pdl in ((100, False), (101, True), (102, False), (103, True), (104, True)):
        args[3] = n
        used = launcher(2, args, num_warps=4, static_key=key, dynamic=(3,), packs=packs, pdl=pdl)
        assert (used is None) == (n < 102) and (used is None or used[0].pdl == pdl)
    assert kernel.compiles == [False, True]
    assert len(packs) == 2 and sorted(p.config is not None for p in packs.values()) == [False, True]
    assert [(x.get("ex", False), x["n"], x.get("attrs")) for x in lib.launches] == [
        (False, 102, None), (True, 103, [(6, 1)]), (True, 104, [(6, 1)])]


# -- the strategy: first launch plain, the rest dependent, per group, replays included ---------------------
@pytest.fixture
def pdl_log(monkeypatch):
    """PDL forced on (the CPU has none) and launches that run nothing but report a driver launch (so the strategy
    records steps): the log holds ``(group anchor address, PDL constexpr, pdl keyword)`` per launch."""
    from fakes import fake_pdl_driver

    log: list = []

    def spy(launcher, grid, args, kw):
        values = dict(zip(launcher.arg_names, args))
        log.append((values["anchor"].data_ptr(), values["PDL"], kw.get("pdl", False)))
    fake_pdl_driver(monkeypatch, spy)
    return log


def _with_replays(pool: HostKVPool) -> replay.Replays:
    from fakes import give_replays

    return give_replays(pool)


def _first_plain_rest_dependent(log) -> bool:
    """Whether, group by group (runs of one anchor), the first launch is plain and every later one dependent, every
    launch but the group's last passing PDL 2 (it lets the next begin) and the last 1 (it only waits); a group moved
    in one launch passes 0."""
    runs: list[list] = []
    for anchor, pdl, dep in log:
        if not runs or runs[-1][0][0] != anchor:
            runs.append([])
        runs[-1].append((anchor, pdl, dep))
    return bool(runs) and all(  # a group in one launch: a plain one, PDL 0
        [(pdl, dep) for _, pdl, dep in run] == ([(0, False)] if len(run) == 1 else
                                                 [(2, False)] + [(2, True)] * (len(run) - 2) + [(1, True)])
        for run in runs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a fake driver launch, for CPU runs")
@pytest.mark.parametrize("layout", KERNELS)
def test_replayed_split_backups_keep_the_first_launch_plain_and_the_rest_dependent(layout, pdl_log):
    """Recorded, then replayed (through each step's fallback: the launcher with the step's keywords): the replay
    makes exactly the recorded call's launches, the first plain, every later one dependent."""
    n = 48
    h, src = _pages(torch.Generator().manual_seed(21), n // 2), torch.arange(n)
    pool, _, _, row = _pools(layout, 0)
    k = pool.binding.scratch[pool.strategy_name].groups[0].entries(None).numel()
    inner = KERNELS[layout].entries_inner
    pool, *_ = _pools(layout, 16 * k * row if inner else n * row, {"backup_pdl": True})
    rp = _with_replays(pool)
    pool.backup_all_layers(h, src)
    recorded = list(pdl_log)
    assert len(recorded) > 2 and _first_plain_rest_dependent(recorded), recorded
    pdl_log.clear()
    pool.backup_all_layers(h, src)  # the same tensors: replayed
    assert rp.hits == 1 and pdl_log == recorded


@pytest.mark.skipif(torch.cuda.is_available(), reason="a fake driver launch, for CPU runs")
@pytest.mark.parametrize("case_id", ["mha-bf16-ps16-vdim-strided", "mla-dsa-extra-ps4"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_each_group_of_a_split_backup_starts_with_a_plain_launch(layout, case_id, pdl_log):
    """Pools of several launch groups (K and V rows of other widths; an extra component): each group's split starts
    with a plain launch (it waits for everything before it on the stream) and makes the rest dependent; a backup
    that fits one launch per group makes no dependent launch (PDL 0: a plain launch, as before PDL); replays keep
    both."""
    case = next(c for c in CASES if c.id == case_id)
    spec = case.build(torch.device("cpu"))
    dev = make_device_buffers(spec, case, torch.Generator().manual_seed(3))
    pool = HostKVPool(spec, layout, "kernel", dev, registry=REGISTRY, pin_memory=False,
                      strategy_options={"programs": 64, "tile_bytes": 256, "backup_launch_bytes": 1,
                                        "backup_pdl": True})
    prep = pool.binding.scratch[pool.strategy_name]
    assert len(prep.groups) > 1
    rp = _with_replays(pool)
    n = spec.page_size
    h, src = torch.arange(n) + n, torch.arange(n)
    pool.backup_all_layers(h, src)
    recorded = list(pdl_log)
    assert len({a for a, _, _ in recorded}) == len(prep.groups) and _first_plain_rest_dependent(recorded), recorded
    pdl_log.clear()
    pool.backup_all_layers(h, src)
    assert rp.hits == 1 and pdl_log == recorded
    pdl_log.clear()
    pool2 = HostKVPool(spec, layout, "kernel", dev, registry=REGISTRY, pin_memory=False,
                       strategy_options={"programs": 64, "tile_bytes": 256, "backup_pdl": True})
    pool2.backup_all_layers(h, src)  # the plugins' launch_bytes (32 MiB): one launch per group
    assert pdl_log and all(pdl == 0 and not dep for _, pdl, dep in pdl_log), pdl_log


_REAL_PDL = r"""
import json, sys, types
sys.path.insert(0, "dev")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hicache_core import drvlaunch
from hicache_core.drvlaunch import DriverKernel, ptx_params
from hicache_layer_first import kernels as lf

consts = dict(WIDTH=288, BLOCK=256, TOKENS=16, VEC=4, TO_HOST=True, STAGES=1, FENCE=True, PDL=2, PAGES=False,
              PAGE_SIZE=1, PAGE_TOKENS=1, PAGE_CHUNK=1)
names = lf.KERNEL.arg_names
ints = ("n", "n_ents", "capacity", "dev_rows")
sig = {a: "constexpr" if a in consts else ("i32" if a in ints else ("*i32" if a == "anchor" else "*i64")) for a in names}
out = {}
for pdl in (False, True):
    src = ASTSource(fn=lf.KERNEL, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "launch_pdl": pdl})
    c.function = 0
    ptx = c.asm["ptx"]
    res = {"meta": bool(getattr(c.metadata, "launch_pdl", None)), "signal": ptx.count("griddepcontrol.launch_dependents"),
           "wait": ptx.count("griddepcontrol.wait")}
    for name, lib in (("with_ex", types.SimpleNamespace(cuLaunchKernelEx=object())), ("no_ex", types.SimpleNamespace())):
        drvlaunch._LIB[:] = [lib]
        k = DriverKernel.build(c)
        res[name] = None if k is None else k.pdl
    out[str(pdl)] = res
print(json.dumps(out))
"""


def test_a_kernel_triton_compiles_with_launch_pdl_is_a_dependent_driver_launch():
    """This Triton's real metadata (sm_90, its ptxas, no GPU): a plugin kernel compiled with ``launch_pdl`` verifies
    as a dependent driver launch (cuLaunchKernelEx) where the driver has it and keeps Triton's launcher where not;
    compiled without, a plain one; PDL's signal and wait are in both (the constexpr PDL 2, not the option, puts them
    there: the call's first launch signals too)."""
    from fakes import compiled_json

    out = compiled_json(_REAL_PDL)
    assert out["False"] == {"meta": False, "signal": 1, "wait": 1, "with_ex": False, "no_ex": False}, out
    assert out["True"] == {"meta": True, "signal": 1, "wait": 1, "with_ex": True, "no_ex": None}, out


@pytest.mark.parametrize("cap, interp, expect", [((9, 0), "0", True), ((10, 0), "0", True), ((8, 9), "0", False),
                                                 ((9, 0), "1", False)])
def test_dependent_launches_need_compute_capability_9_outside_the_interpreter(monkeypatch, cap, interp, expect):
    """The gate of PDL (kernel_support.dependent_launches, rowcopy_launch.dependent): CUDA, capability >= 9.0, not
    Triton's interpreter; never a CPU tensor's device; a tuning without pdl never."""
    from hicache_core import kernel_support
    from hicache_core.rowcopy_tuning import Tuning

    monkeypatch.setenv("TRITON_INTERPRET", interp)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    assert kernel_support.dependent_launches(torch.device("cuda", 0)) is expect
    assert kernel_support.dependent_launches(torch.device("cpu")) is False
    g = types.SimpleNamespace(anchor=types.SimpleNamespace(device=torch.device("cuda", 0)))
    assert rowcopy_launch.dependent(Tuning(1, 1, 1, pdl=True), g) is expect
    assert rowcopy_launch.dependent(Tuning(1, 1, 1), g) is False
