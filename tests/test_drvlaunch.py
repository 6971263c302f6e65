"""hicache_core.drvlaunch: the CUDA driver launch packs exactly the parameters Triton would pass, refuses what it
cannot verify, and (on a GPU) moves the same bytes as Triton's launcher."""

from __future__ import annotations

import contextlib
import ctypes
import os
import types

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest  # noqa: E402

from hicache_core import drvlaunch, launch as launch_mod  # noqa: E402
from hicache_core.drvlaunch import DriverKernel, DriverLaunchError, expected_params, ptx_params  # noqa: E402
from hicache_core.launch import Launcher, set_driver_launch, set_fast_launch  # noqa: E402

GPU = torch.cuda.is_available()

PTX = """
.visible .entry K(
	.param .u64 .ptr .global .align 1 K_param_0,
	.param .align 64 .b8 K_param_1[128],
	.param .u32 K_param_2,
	.param .u32 K_param_3,
	.param .u64 K_param_4,
	.param .u64 K_param_5,
	.param .u32 K_param_6,
	.param .u64 .ptr .global .align 1 K_param_7,
	.param .u64 .ptr .global .align 1 K_param_8
)
.maxntid 128, 1, 1
{
"""
SIG = {"anchor": "*i32", "desc": "tensordesc<i32[16, 32]>", "none": "constexpr", "n": "i32", "W": "constexpr"}
META = [{"swizzle": 3, "elem_size": 4, "elem_type": 3, "block_size": [16, 32], "fp4_padded": False}]


class FakeLib:
    """Records driver calls; ``launch_result`` / ``encode_result`` are returned by the next calls."""

    def __init__(self) -> None:
        self.launches: list = []
        self.encodes: list = []
        self.launch_result = 0
        self.encode_result = 0
        self.locks: list = []  # the Packed locks that must be held during a launch

    def cuLaunchKernel(self, *call):
        assert all(lock.locked() for lock in self.locks)  # values written and launched under the launch's lock
        # the real function has no argtypes: every argument must already be a C object of the C type
        kinds = (ctypes.c_void_p,) + (ctypes.c_uint,) * 7 + (ctypes.c_void_p,)
        assert len(call) == 11 and all(type(a) is k for a, k in zip(call, kinds)) and call[10] is None, call
        fn, gx, gy, gz, bx, by, bz, shared, stream = (a.value or 0 for a in call[:9])
        params = call[9]
        read = lambda i, t: t.from_address(params[i]).value  # noqa: E731
        self.launches.append(dict(fn=fn, grid=(gx, gy, gz), block=(bx, by, bz), shared=shared, stream=stream,
                                  anchor=read(0, ctypes.c_uint64),
                                  map=bytes((ctypes.c_ubyte * 8).from_address(params[1])),
                                  shape=(read(2, ctypes.c_int32), read(3, ctypes.c_int32)),
                                  strides=(read(4, ctypes.c_int64), read(5, ctypes.c_int64)),
                                  n=read(6, ctypes.c_int32),
                                  scratch=(read(7, ctypes.c_uint64), read(8, ctypes.c_uint64))))
        return self.launch_result

    def cuTensorMapEncodeTiled(self, out, dtype, rank, addr, dims, strides, box, elem, interleave, swizzle, l2, fill):
        ctypes.memmove(out, b"TMAPTMAP", 8)
        self.encodes.append(dict(aligned=out % 64 == 0, dtype=dtype, rank=rank, addr=addr, dims=list(dims[:rank]),
                                 strides=list(strides[:rank - 1]), box=list(box[:rank]), elem=list(elem[:rank]),
                                 interleave=interleave, swizzle=swizzle, l2=l2, fill=fill))
        return self.encode_result

    def cuGetErrorName(self, res, out):
        return 0


class FakeLibEx(FakeLib):
    """:class:`FakeLib` with ``cuLaunchKernelEx``: records each dependent launch's configuration and attributes."""

    def cuLaunchKernelEx(self, config, fn, params, extra):
        assert all(lock.locked() for lock in self.locks)
        cfg = config._obj  # ctypes.byref's object: the packed launch's CUlaunchConfig
        read = lambda i, t: t.from_address(params[i]).value  # noqa: E731
        self.launches.append(dict(ex=True, fn=fn.value, grid=(cfg.grid_x, cfg.grid_y, cfg.grid_z),
                                  block=(cfg.block_x, cfg.block_y, cfg.block_z), shared=cfg.shared,
                                  stream=cfg.stream or 0, attrs=[(cfg.attrs[i].id, cfg.attrs[i].value)
                                                                 for i in range(cfg.n_attrs)],
                                  anchor=read(0, ctypes.c_uint64), n=read(6, ctypes.c_int32), extra=extra))
        return self.launch_result


def _compiled(ptx=PTX, sig=SIG, meta=META, **md):
    fields = dict(name="K", num_warps=4, num_ctas=1, shared=1024, global_scratch_size=0, profile_scratch_size=0,
                  launch_cooperative_grid=False, launch_pdl=False, tensordesc_meta=meta)
    fields.update(md)
    return types.SimpleNamespace(function=0xF00, asm={"ptx": ptx}, src=types.SimpleNamespace(signature=sig),
                                 metadata=types.SimpleNamespace(**fields))


@pytest.fixture
def lib(monkeypatch):
    fake = FakeLib()
    monkeypatch.setattr(drvlaunch, "_LIB", [fake])
    return fake


def _desc(base: torch.Tensor):
    return types.SimpleNamespace(base=base, shape=[40, 288], strides=[288, 1], block_shape=[16, 256], padding="zero")


def test_ptx_params_reads_sizes_of_the_named_entry():
    assert ptx_params(PTX) == [8, 128, 4, 4, 8, 8, 4, 8, 8]
    assert ptx_params(PTX, "K") == [8, 128, 4, 4, 8, 8, 4, 8, 8]
    assert ptx_params(PTX, "other") is None
    assert ptx_params(".entry K(\n .param .weird K_param_0\n)") is None


def test_expected_params_expand_descriptors_and_drop_constexprs():
    assert expected_params(SIG, META) == [("ptr", 0, 0), ("map", 1, 0), ("shape", 1, 0), ("shape", 1, 1),
                                          ("stride", 1, 0), ("stride", 1, 1), ("i32", 3, 0)]
    assert expected_params({"flag": "i1"}, None) is None  # not packed: Triton's launcher keeps it
    assert expected_params(SIG, [None]) is None  # a descriptor without TMA metadata
    assert expected_params(SIG, [dict(META[0], is_im2col=True)]) is None


@pytest.mark.parametrize("change", [
    dict(ptx=PTX.replace(".param .u32 K_param_6,", ".param .u64 K_param_6,")),  # an i64 where i32 was expected
    dict(ptx=PTX.replace("\t.param .u64 .ptr .global .align 1 K_param_8\n", "").replace("K_param_7,", "K_param_7")
         .replace(".param .u32 K_param_3,", "")),  # a parameter missing
    dict(ptx=PTX.replace("K_param_8\n", "K_param_8,\n .param .u64 K_param_9,\n .param .u64 K_param_10\n")),
    dict(global_scratch_size=128), dict(profile_scratch_size=64), dict(num_ctas=2), dict(launch_pdl=True),
    dict(launch_cooperative_grid=True), dict(shared=229 * 1024), dict(name="L"),
    dict(sig={**SIG, "n": "fp16"}),
], ids=["size", "missing", "extra-trailing", "scratch", "profile", "cluster", "pdl-no-ex", "coop", "oversized", "name",
        "type"])
def test_anything_unverified_keeps_tritons_launcher(lib, change):
    assert DriverKernel.build(_compiled(**change)) is None


def test_no_driver_library_keeps_tritons_launcher(monkeypatch):
    monkeypatch.setattr(drvlaunch, "_LIB", [None])
    assert DriverKernel.build(_compiled()) is None and not drvlaunch.driver_available()


def test_pack_encodes_maps_once_and_launch_rewrites_dynamic_values(lib):
    k = DriverKernel.build(_compiled())
    assert k is not None
    anchor, other = torch.zeros(64, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)
    host = torch.zeros(40 * 288, dtype=torch.int32)
    args = [anchor, _desc(host), None, 100, 288]
    packed = k.pack(args, dynamic=(0, 3))
    lib.locks.append(packed.lock)
    assert lib.encodes == [dict(aligned=True, dtype=2, rank=2, addr=host.data_ptr(), dims=[288, 40], strides=[288 * 4],
                                box=[32, 16], elem=[1, 1], interleave=0, swizzle=3, l2=2, fill=0)]
    assert k.launch(3, 0x5, packed, args)
    assert k.launch(7, 0x6, packed, [other, args[1], None, 4096, 288])
    assert len(lib.encodes) == 1 and not packed.lock.locked()  # encoded at pack time only; lock released
    a, b = lib.launches
    assert (a["fn"], a["grid"], a["block"], a["shared"], a["stream"]) == (0xF00, (3, 1, 1), (128, 1, 1), 1024, 0x5)
    assert (a["anchor"], a["n"], a["map"], a["shape"], a["strides"], a["scratch"]) == (
        anchor.data_ptr(), 100, b"TMAPTMAP", (40, 288), (288, 1), (0, 0))
    assert (b["anchor"], b["n"], b["grid"], b["stream"]) == (other.data_ptr(), 4096, (7, 1, 1), 0x6)


def test_static_values_are_packed_once_and_never_rewritten(lib):
    k = DriverKernel.build(_compiled())
    anchor, other = torch.zeros(64, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)
    args = [anchor, _desc(torch.zeros(40 * 288, dtype=torch.int32)), None, 100, 288]
    packed = k.pack(args, dynamic=(3,))
    assert k.launch(1, 0, packed, [other, args[1], None, 7, 288])  # a static position changed: not read
    assert (lib.launches[0]["anchor"], lib.launches[0]["n"]) == (anchor.data_ptr(), 7)
    assert anchor in packed.keep[1]  # the static tensors live as long as the packed parameters


def test_grid_zero_launches_nothing(lib):
    k = DriverKernel.build(_compiled())
    args = [torch.zeros(4, dtype=torch.int32), _desc(torch.zeros(40 * 288, dtype=torch.int32)), None, 1, 8]
    assert k.launch(0, 0, k.pack(args, dynamic=(3,)), args) and lib.launches == []


def test_tuple_arguments_and_tensor_map_reductions_keep_tritons_launcher(lib):
    assert expected_params({"pair": ("*i32", "i32")}, None) is None
    assert DriverKernel.build(_compiled(ptx=PTX + "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add")) is None


def test_driver_errors(lib):
    k = DriverKernel.build(_compiled())
    args = [torch.zeros(4, dtype=torch.int32), _desc(torch.zeros(40 * 288, dtype=torch.int32)), None, 1, 8]
    with pytest.raises(DriverLaunchError, match="descriptor cannot change"):
        k.pack(args, dynamic=(1,))
    with pytest.raises(DriverLaunchError, match="not encodable"):  # element size differs from the kernel's
        k.pack([args[0], _desc(torch.zeros(40 * 288, dtype=torch.int16)), None, 1, 8], dynamic=())
    lib.encode_result = 1
    with pytest.raises(DriverLaunchError, match=r"cuTensorMapEncodeTiled failed: \? \(1\)"):
        k.pack(args, dynamic=())
    lib.encode_result = 0
    packed = k.pack(args, dynamic=(3,))
    lib.launch_result = 201  # no current context: the caller takes Triton's launcher
    assert not k.launch(1, 0, packed, args)
    lib.launch_result = 700
    with pytest.raises(DriverLaunchError, match=r"cuLaunchKernel failed: \? \(700\)"):
        k.launch(1, 0, packed, args)


def test_a_dependent_launch_goes_through_cuLaunchKernelEx_with_the_programmatic_attribute(monkeypatch):
    """A kernel compiled with ``launch_pdl`` is launched through ``cuLaunchKernelEx``: the same function, grid, block,
    shared memory, stream and parameters as a plain launch, one attribute (programmatic stream serialization, 6, on);
    a driver without ``cuLaunchKernelEx`` keeps Triton's launcher for it."""
    monkeypatch.setattr(drvlaunch, "_LIB", [FakeLib()])
    assert DriverKernel.build(_compiled(launch_pdl=True)) is None
    lib = FakeLibEx()
    monkeypatch.setattr(drvlaunch, "_LIB", [lib])
    k = DriverKernel.build(_compiled(launch_pdl=True))
    assert k is not None and k.pdl and not DriverKernel.build(_compiled()).pdl
    anchor, other = torch.zeros(64, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)
    args = [anchor, _desc(torch.zeros(40 * 288, dtype=torch.int32)), None, 100, 288]
    packed = k.pack(args, dynamic=(0, 3))
    lib.locks.append(packed.lock)
    assert k.launch(3, 0x5, packed, args) and k.launch(7, 0x6, packed, [other, args[1], None, 4096, 288])
    a, b = lib.launches
    assert a == dict(ex=True, fn=0xF00, grid=(3, 1, 1), block=(128, 1, 1), shared=1024, stream=0x5, attrs=[(6, 1)],
                     anchor=anchor.data_ptr(), n=100, extra=None)
    assert (b["grid"], b["stream"], b["anchor"], b["n"], b["attrs"]) == ((7, 1, 1), 0x6, other.data_ptr(), 4096,
                                                                         [(6, 1)])
    assert ctypes.sizeof(drvlaunch._LaunchConfig) == 56 and ctypes.sizeof(drvlaunch._LaunchAttribute) == 72
    assert drvlaunch._LaunchConfig.stream.offset == 32 and drvlaunch._LaunchAttribute.value.offset == 8
    lib.launch_result = 700
    with pytest.raises(DriverLaunchError, match=r"cuLaunchKernelEx failed: \? \(700\)"):
        k.launch(1, 0, packed, args)


class _Kernel:
    """A Triton-like kernel whose public launch returns a compiled handle the driver launch can verify."""

    arg_names = ["anchor", "desc", "none", "n", "W"]
    constexprs = [4]

    def __init__(self) -> None:
        self.public, self.runs = 0, 0

    def __getitem__(self, grid):
        def launch(*args, num_warps, **opts):
            self.public += 1
            c = _compiled()
            c.run = lambda *a: setattr(self, "runs", self.runs + 1)
            c.packed_metadata = object()
            return c
        return launch


@contextlib.contextmanager
def driver_launcher(kernel):
    """A :class:`Launcher` of ``kernel`` on a fake device 0 and stream 9, with fast and driver launches on while it is
    used (restored after)."""
    launcher = Launcher(kernel)
    launcher._api = (lambda: 0, lambda device: 9, types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None))
    saved = launch_mod._ENABLED[0], launch_mod._DRIVER[0]
    launch_mod._ENABLED[0] = True
    set_driver_launch(True)
    try:
        yield launcher
    finally:
        launch_mod._ENABLED[0], launch_mod._DRIVER[0] = saved


@pytest.fixture
def fast_launcher(monkeypatch, lib):
    kernel = _Kernel()
    with driver_launcher(kernel) as launcher:
        yield kernel, launcher


def test_launcher_takes_the_driver_launch_only_with_packs(fast_launcher, lib, monkeypatch):
    kernel, launcher = fast_launcher
    host = torch.zeros(40 * 288, dtype=torch.int32)
    args = [torch.zeros(4, dtype=torch.int32), _desc(host), None, 100, 288]
    key = launcher.static_key(args, (3,))
    packs: dict = {}
    for n in (100, 101, 102):
        args[3] = n
        launcher(2, args, num_warps=4, static_key=key, dynamic=(3,), packs=packs)
    assert (kernel.public, kernel.runs, launcher.driver_launches) == (1, 0, 2)
    assert [x["n"] for x in lib.launches] == [101, 102] and len(packs) == 1 and len(lib.encodes) == 1
    launcher(2, args, num_warps=4, static_key=key, dynamic=(3,))  # no packs: Triton's compiled handle
    assert (kernel.runs, launcher.driver_launches) == (1, 2)
    monkeypatch.setenv("HICACHE_DRIVER_LAUNCH", "0")
    assert not set_driver_launch(None)
    launcher(2, args, num_warps=4, static_key=key, dynamic=(3,), packs=packs)
    assert (kernel.runs, launcher.driver_launches) == (2, 2)
    set_driver_launch(True)
    lib.launch_result = 201
    launcher(2, args, num_warps=4, static_key=key, dynamic=(3,), packs=packs)  # no context: Triton's launcher
    assert (kernel.runs, launcher.driver_launches) == (3, 2)


def test_a_launch_whose_descriptor_cannot_be_packed_keeps_tritons_launcher(fast_launcher, lib):
    kernel, launcher = fast_launcher
    desc = _desc(torch.zeros(40 * 288, dtype=torch.int32))
    desc.padding = "nan"  # Triton encodes it with NaN fill; the driver launch does not
    args = [torch.zeros(4, dtype=torch.int32), desc, None, 100, 288]
    key, packs = launcher.static_key(args, (3,)), {}
    for _ in range(3):
        launcher(2, args, num_warps=4, static_key=key, dynamic=(3,), packs=packs)
    assert (kernel.public, kernel.runs, launcher.driver_launches, lib.launches) == (1, 2, 0, [])
    assert list(packs.values()) == [False]  # refused once, not retried per call


def test_launches_sharing_a_static_key_keep_their_own_values(fast_launcher, lib):
    """Two pools' launches: same traits, other static values, each its own packs."""
    _, launcher = fast_launcher
    a, b = torch.zeros(64, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)
    desc = _desc(torch.zeros(40 * 288, dtype=torch.int32))
    args_a, args_b = [a, desc, None, 100, 288], [b, desc, None, 100, 288]
    key = launcher.static_key(args_a, (3,))
    assert key == launcher.static_key(args_b, (3,))
    packs_a: dict = {}
    packs_b: dict = {}
    launcher(1, args_a, num_warps=4, static_key=key, dynamic=(3,), packs=packs_a)  # compiles (public)
    for args, packs in ((args_a, packs_a), (args_b, packs_b), (args_a, packs_a)):
        launcher(1, args, num_warps=4, static_key=key, dynamic=(3,), packs=packs)
    assert [x["anchor"] for x in lib.launches] == [a.data_ptr(), b.data_ptr(), a.data_ptr()]


def test_static_and_plain_keys_never_meet(fast_launcher):
    """A plain call whose arguments spell out another launch's static key gets its own kernel."""
    kernel, launcher = fast_launcher
    launcher._constexprs, launcher._nargs = frozenset({0, 1}), 3
    buf = torch.zeros(64, dtype=torch.int32)
    token = launcher.static_key((5, 7, buf), (2,))
    launcher(1, (5, 7, buf), num_warps=4, static_key=token, dynamic=(2,))
    launcher(1, (token, None, buf), num_warps=4)  # no static key: compiled for these constexprs
    assert kernel.public == 2


def test_static_keys_are_small_ints_equal_for_equal_traits(fast_launcher):
    _, launcher = fast_launcher
    a = torch.zeros(64, dtype=torch.int32)
    k1 = launcher.static_key((a, None, 1, 8), (1,))
    assert isinstance(k1, int) and k1 == launcher.static_key((a.clone(), None, 1, 8), (1,))
    k2, k3 = launcher.static_key((a, None, 1, 16), (1,)), launcher.static_key((a[1:], None, 1, 8), (1,))
    assert len({k1, k2, k3}) == 3  # a constexpr, an alignment: other keys
    assert Launcher(_Kernel()).static_key((a, None, 1, 8), (1,)) not in (k1, k2, k3)  # tokens are per launcher


_REAL_KERNELS = r"""
import json, sys, types
sys.path.insert(0, "dev")
from ptx_diff import compile_kernel
from hicache_core import drvlaunch, kernel_lib as kl
from hicache_core.drvlaunch import DriverKernel, ptx_params
from hicache_layer_first import kernels as lf

drvlaunch._LIB[:] = [types.SimpleNamespace()]  # verification only: no driver call is made

ptr64 = {n: "*i64" for n in ("host_idx", "dev_idx", "ents", "dev_off", "dev_stride", "host_off", "host_page",
                             "host_tok")}
row = compile_kernel(lf.KERNEL, dict(WIDTH=288, BLOCK=256, TOKENS=16, VEC=4, TO_HOST=False, STAGES=1,
                                     FENCE=False),
                     types={"anchor": "*i32", **ptr64, "n": "i32", "n_ents": "i32", "capacity": "i32", "dev_rows": "i32"})
ints = {n: "i32" for n in kl.PAGED_TMA_LOAD.arg_names if n.islower()}
tma = compile_kernel(kl.PAGED_TMA_LOAD, dict(host_desc_b=None, host_tail_b=None, WIDTH=288, BOX=256, TAIL=32, TOKENS=16,
                                             VEC=4, STAGES=4, FLAT=True, ENTRIES=1, PAGE_SIZE=64),
                     types={**ints, "anchor": "*i32", "host_idx": "*i64", "dev_idx": "*i64",
                            "host_desc": "tensordesc<i32[16, 256]>", "host_tail": "tensordesc<i32[16, 32]>"})
out = {}
for c in (row, tma):
    c.function = 0  # what loading on a GPU sets (the CUfunction handle)
    k = DriverKernel.build(c)
    out[c.metadata.name] = None if k is None else dict(
        kinds=[kind for kind, _, _ in k.plan], scratch=k.scratch, sizes=ptx_params(c.asm["ptx"], c.metadata.name))
print(json.dumps(out))
"""


def test_real_kernels_verify_against_their_ptx():
    """The shared TMA load kernel and a row kernel, compiled by this Triton for sm_90 (its bundled ptxas, no GPU
    needed; a separate process, outside the interpreter): the parameter plan matches each PTX entry."""
    from fakes import compiled_json

    out = compiled_json(_REAL_KERNELS)
    row, tma = out["KERNEL"], out["PAGED_TMA_LOAD"]
    assert row is not None and tma is not None, out
    # Written out by hand from the kernels' signatures: anchor, two 2-D descriptors (map, 2 x i32 shape,
    # 2 x i64 stride), host_idx, dev_idx, then the 13 int arguments (the _b descriptors are None: constexprs).
    assert tma["sizes"][:26] == [8, 128, 4, 4, 8, 8, 128, 4, 4, 8, 8, 8, 8] + [4] * 13
    assert row["sizes"][:13] == [8, 8, 8, 4, 8, 4, 8, 8, 8, 8, 8, 4, 4]
    for k, n in ((row, 13), (tma, 26)):
        assert len(k["kinds"]) == n and k["scratch"] in (1, 2) and k["sizes"][n:] == [8] * k["scratch"]


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_first_kv_split"])
@pytest.mark.parametrize("case_id", ["mha-bf16-ps16-vdim-strided", "mla576-bf16-ps16-strided"])
def test_gpu_driver_launch_is_bit_exact_and_used(layout, case_id):
    """Conformance (bit-exact against the reference, canaries) with the driver launch on, and it really ran (after a
    warm-up round, so the result does not depend on which tests compiled these launch keys before)."""
    from hicache_core import create_registry, rowcopy
    from hicache_core.testing.conformance import CASES, check_strategy

    case = next(c for c in CASES if c.id == case_id)
    try:
        assert set_fast_launch(True) and set_driver_launch(True)
        for per_layer_backup in (False, True):  # warm-up: a launch key's first call compiles through Triton
            check_strategy(create_registry(), case, layout, "kernel", device=torch.device("cuda"),
                           per_layer_backup=per_layer_backup)
        before = {id(lch): lch.driver_launches for lch in rowcopy._LAUNCHERS.values()}
        for per_layer_backup in (False, True):
            pool = check_strategy(create_registry(), case, layout, "kernel", device=torch.device("cuda"),
                                  per_layer_backup=per_layer_backup)
            prep = pool.binding.scratch[pool.strategy_name]
            used = [prep.launcher] + ([prep.tma_launcher] if any(p is not None for p in prep.tma) else [])
            for lch in used:  # the row kernel (backups) and, where a group loads through TMA, the TMA kernel
                assert lch.driver_launches > before.get(id(lch), 0), lch.kernel
                before[id(lch)] = lch.driver_launches
    finally:
        set_fast_launch(None)
        set_driver_launch(None)


def test_driver_launch_enabled_needs_both_switches(monkeypatch):
    saved = launch_mod._ENABLED[0], launch_mod._DRIVER[0]
    try:
        launch_mod._ENABLED[0] = True
        assert set_driver_launch(True) and launch_mod.driver_launch_enabled()
        assert not set_driver_launch(False) and not launch_mod.driver_launch_enabled()
        monkeypatch.setenv("HICACHE_DRIVER_LAUNCH", "off")
        assert not set_driver_launch(None)
        monkeypatch.delenv("HICACHE_DRIVER_LAUNCH")
        assert set_driver_launch(None)
        launch_mod._ENABLED[0] = False  # fast launch off (or the interpreter): no driver launch either
        assert not launch_mod.driver_launch_enabled()
    finally:
        launch_mod._ENABLED[0], launch_mod._DRIVER[0] = saved


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_gpu_explain_names_the_launch_path():
    from hicache_core import create_registry
    from hicache_core.testing.conformance import CASES

    spec = next(c for c in CASES if c.id == "mla576-bf16-ps16-strided").build(torch.device("cuda"))
    reg = create_registry()
    strategy = reg.resolve(spec, "layer_first", "kernel").strategy
    saved = launch_mod._DRIVER[0]
    try:
        set_driver_launch(True)
        assert any("through cuLaunchKernel" in line for line in strategy.describe(spec, reg.layout("layer_first")))
        set_driver_launch(False)
        assert any("through Triton's launcher" in line for line in strategy.describe(spec, reg.layout("layer_first")))
    finally:
        launch_mod._DRIVER[0] = saved
