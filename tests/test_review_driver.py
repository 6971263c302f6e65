"""Review of the host-side driver bindings (cudart, launch, drvlaunch, claunch, replay), on CPU with fakes.

The runtime's entry points are ctypes callbacks with the CUDA headers' own C prototypes, so what is checked is what
a real ``libcudart`` would receive through the argtypes this module sets: each argument at its position, of its
width (a missing or extra argument shifts the stream into another slot)."""

from __future__ import annotations

import ctypes
import os
import types

import pytest
import torch

from hicache_core.backends import cudart

# --------------------------------------------------------------------------------------------------------- cudart

_vp, _sz, _int = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
_ATTRS_P = ctypes.POINTER(cudart._MemcpyAttributes)
#: cudaMemcpyBatchAsync as CUDA 12.8/12.9 declare it (size_t *failIdx before the stream) and as CUDA 13 does.
_BATCH_12 = ctypes.CFUNCTYPE(_int, _vp, _vp, _vp, _sz, _ATTRS_P, _vp, _sz, _vp, _vp)
_BATCH_13 = ctypes.CFUNCTYPE(_int, _vp, _vp, _vp, _sz, _ATTRS_P, _vp, _sz, _vp)
#: cudaMemcpy3DBatchAsync of CUDA 13: (size_t numOps, cudaMemcpy3DBatchOp *opList, unsigned long long flags, stream).
_BATCH3D_13 = ctypes.CFUNCTYPE(_int, _sz, _vp, ctypes.c_ulonglong, _vp)
#: cudaMemcpyAsync(void *dst, const void *src, size_t count, cudaMemcpyKind kind, cudaStream_t stream).
_MEMCPY = ctypes.CFUNCTYPE(_int, _vp, _vp, _sz, _int, _vp)
_VERSION = ctypes.CFUNCTYPE(_int, ctypes.POINTER(_int))


class CLib:
    """The libcudart symbols CudaRuntime binds, as C functions of the headers' prototypes, recording each call."""

    def __init__(self, runtime: int, driver: int, memcpy_error_at: int | None = None) -> None:
        self.batches: list[dict] = []
        self.batches3d: list[tuple] = []
        self.memcpys: list[tuple] = []
        self.last_error_resets = 0

        def version(value):
            def get(out):
                out[0] = value
                return 0
            return _VERSION(get)

        self.cudaRuntimeGetVersion, self.cudaDriverGetVersion = version(runtime), version(driver)

        def batch(dsts, srcs, sizes, count, attrs, idx, n_attrs, *rest):
            a = attrs.contents
            self.batches.append(dict(
                dsts=dsts, srcs=srcs, sizes=sizes, count=count, n_attrs=n_attrs,
                attrs=(a.srcAccessOrder, a.srcLocHint.type, a.srcLocHint.id, a.dstLocHint.type, a.dstLocHint.id,
                       a.flags),
                idx=ctypes.c_size_t.from_address(idx).value, fail=rest[0] if len(rest) == 2 else "absent",
                stream=rest[-1] or 0))
            return 0
        self.cudaMemcpyBatchAsync = (_BATCH_13 if runtime >= 13000 else _BATCH_12)(batch)

        def batch3d(count, ops, flags, stream):
            self.batches3d.append((count, ops, flags, stream or 0))
            return 0
        self.cudaMemcpy3DBatchAsync = _BATCH3D_13(batch3d)

        def memcpy(dst, src, count, kind, stream):
            self.memcpys.append((dst, src, count, kind, stream or 0))
            return 700 if memcpy_error_at is not None and len(self.memcpys) - 1 == memcpy_error_at else 0
        self.cudaMemcpyAsync = _MEMCPY(memcpy)

        def last_error():
            self.last_error_resets += 1
            return 0
        self.cudaGetLastError = ctypes.CFUNCTYPE(_int)(last_error)
        self._message = ctypes.create_string_buffer(b"fake error")  # returned by address: no callback-owned string
        self.cudaGetErrorString = ctypes.CFUNCTYPE(_vp, _int)(lambda code: ctypes.addressof(self._message))


def _descriptors(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k = torch.arange(n, dtype=torch.int64)
    return 0x10000 + 4096 * k, 0x90000000 + 4096 * k, 64 + k


@pytest.mark.parametrize("version", [12080, 12090, 13000, 13020])
@pytest.mark.parametrize("stream, want", [(0x77, 0x77), (0, cudart.STREAM_PER_THREAD)])
def test_the_batch_call_gets_the_headers_arguments_for_each_runtime(version, stream, want):
    """Through the argtypes CudaRuntime sets, each runtime's cudaMemcpyBatchAsync receives the arrays, the count, one
    attribute (source access order ``stream``, no hints, no flags) for every copy, a failIdx pointer on 12.x only,
    and the stream in the last slot (the per-thread stream for the legacy one, which the call refuses)."""
    lib = CLib(version, version)
    rt = cudart.CudaRuntime(lib, "fake")
    assert rt.has_batch
    d, s, z = _descriptors(20)
    rt.copy_batch(d, s, z, stream)
    assert [c["count"] for c in lib.batches] == [16, 4]
    first, second = lib.batches
    assert (first["dsts"], first["srcs"], first["sizes"]) == (d.data_ptr(), s.data_ptr(), z.data_ptr())
    assert (second["dsts"], second["srcs"], second["sizes"]) == (d.data_ptr() + 128, s.data_ptr() + 128,
                                                                 z.data_ptr() + 128)
    for call in lib.batches:
        assert call["attrs"] == (1, 0, 0, 0, 0, 0) and call["idx"] == 0 and call["n_attrs"] == 1
        assert call["stream"] == want
        if version >= 13000:
            assert call["fail"] == "absent"
        else:
            assert call["fail"] not in (None, 0)  # a size_t the runtime may write


def test_pitched_batches_get_the_cuda_13_arguments():
    lib = CLib(13000, 13000)
    rt = cudart.CudaRuntime(lib, "fake")
    from hicache_core.backends.pitched import OP_WORDS

    ops = torch.zeros((20, OP_WORDS), dtype=torch.int64)
    rt.copy_3d_batch(ops, 0x55)
    rt.copy_3d_batch(ops[:3], 0)
    assert lib.batches3d == [(16, ops.data_ptr(), 0, 0x55), (4, ops.data_ptr() + 16 * OP_WORDS * 8, 0, 0x55),
                             (3, ops.data_ptr(), 0, cudart.STREAM_PER_THREAD)]


@pytest.mark.parametrize("runtime, driver, batch, pitched", [
    (12080, 12040, False, False),  # a 12.8 runtime on a 12.4 driver (minor-version compatibility): no batch call
    (12060, 12080, False, False),  # runtime 12.6: none
    (12090, 12090, True, False),
    (13000, 12090, True, False),  # the 3D call needs a CUDA 13 driver too
    (13000, 13000, True, True),
])
def test_which_entry_points_serve_follows_runtime_and_driver(runtime, driver, batch, pitched):
    rt = cudart.CudaRuntime(CLib(runtime, driver), "fake")
    assert (rt.has_batch, rt.has_batch3d) == (batch, pitched)


def test_without_the_batch_call_each_copy_goes_to_the_callers_stream_as_it_is():
    """cudaMemcpyAsync takes the legacy stream (0): it is passed as is, with ``cudaMemcpyDefault`` and size_t sizes."""
    lib = CLib(12080, 12040)
    rt = cudart.CudaRuntime(lib, "fake")
    d, s, z = _descriptors(3)
    z[1] = 2**33 + 5  # a size that needs all 64 bits
    rt.copy_batch(d, s, z, 0)
    rt.copy_batch(d[:1], s[:1], z[:1], 0x66)
    assert lib.batches == []
    assert lib.memcpys == [(a, b, c, 4, 0) for a, b, c in zip(d.tolist(), s.tolist(), z.tolist())] + \
        [(d[0].item(), s[0].item(), z[0].item(), 4, 0x66)]


def test_a_failed_plain_copy_says_how_many_were_queued_and_resets_the_last_error():
    lib = CLib(12060, 12080, memcpy_error_at=2)
    rt = cudart.CudaRuntime(lib, "fake")
    d, s, z = _descriptors(5)
    with pytest.raises(cudart.BatchSubmitError, match=r"cudaMemcpyAsync failed: fake error \(cudaError 700\); 2 of "
                                                      r"the 5 copies") as err:
        rt.copy_batch(d, s, z, 0)
    assert err.value.submitted == 2 and len(lib.memcpys) == 3 and lib.last_error_resets == 1


# --------------------------------------------------------------------------------------------------------- launch

from hicache_core import launch as launch_mod  # noqa: E402
from hicache_core.launch import Launcher  # noqa: E402


class _Compiled:
    def __init__(self, log: list, tag: tuple) -> None:
        self.log, self.tag = log, tag
        self.function, self.packed_metadata = 0xF00, object()

    def run(self, g0, g1, g2, stream, function, packed, meta, enter, exit_, *args):
        self.log.append(("fast", self.tag, g0, stream, args))


class _Kernel:
    """Records public launches; each returns a compiled handle tagged with the device and arguments it was made for."""

    arg_names = ["ptr", "n", "WIDTH"]
    constexprs = [2]

    def __init__(self, device: list) -> None:
        self.log: list = []
        self.device = device

    def __getitem__(self, grid):
        def launch(*args, num_warps, **opts):
            self.log.append(("public", self.device[0], args))
            return _Compiled(self.log, (self.device[0], args))
        return launch


@pytest.fixture
def launcher(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(launch_mod, "_ENABLED", [True])
    monkeypatch.setattr(launch_mod, "_DRIVER", [True])
    device = [0]
    kernel = _Kernel(device)
    lch = Launcher(kernel)
    lch._api = (lambda: device[0], lambda index: 0x700 + index,
                types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None))
    return kernel, lch, device


def test_a_static_key_never_serves_another_device(launcher):
    """A compiled kernel's function handle belongs to the device it was loaded on: a launch keyed by a static key on
    device 1 compiles (public launch) rather than running device 0's handle."""
    kernel, lch, device = launcher
    buf = torch.zeros(64, dtype=torch.int32)
    key = lch.static_key((buf, None, 8), (1,))
    lch(1, (buf, 100, 8), num_warps=4, static_key=key, dynamic=(1,))
    lch(1, (buf, 101, 8), num_warps=4, static_key=key, dynamic=(1,))
    device[0] = 1
    lch(1, (buf, 102, 8), num_warps=4, static_key=key, dynamic=(1,))
    assert [(e[0], e[1] if e[0] == "public" else e[1][0]) for e in kernel.log] == \
        [("public", 0), ("fast", 0), ("public", 1)]


def test_packs_without_a_static_key_are_ignored(launcher, monkeypatch):
    """Packed parameters bake every position outside ``dynamic``: without a static key (no dynamic positions named)
    the call must not take them, or a later call with other tensors would launch the first call's addresses."""
    kernel, lch, _ = launcher
    built = []
    monkeypatch.setattr(Launcher, "_driver_kernel", staticmethod(lambda compiled: built.append(compiled) or False))
    a, b = torch.zeros(64, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)
    packs: dict = {}
    for buf in (a, a, b):
        assert lch(1, (buf, 100, 8), num_warps=4, packs=packs) is None
    assert built == [] and packs == {}
    assert [e[0] for e in kernel.log] == ["public", "fast", "fast"] and kernel.log[-1][4][0] is b


def test_a_bool_argument_is_not_the_int_one(launcher):
    """``True == 1`` in Python, but Triton types a bool as ``i1`` and 1 as a specialised ``i32``: other kernels."""
    kernel, lch, _ = launcher
    buf = torch.zeros(64, dtype=torch.int32)
    lch(1, (buf, True, 8), num_warps=4)
    lch(1, (buf, 1, 8), num_warps=4)
    lch(1, (buf, 1, 8), num_warps=4)
    assert [e[0] for e in kernel.log] == ["public", "public", "fast"]


def test_the_interpreter_keeps_the_shortcut_off_whatever_set_fast_launch_asks(monkeypatch):
    monkeypatch.setattr(launch_mod, "_ENABLED", [False])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(launch_mod.ENV_FAST_LAUNCH, raising=False)
    assert launch_mod.set_fast_launch(True) is False and not launch_mod.driver_launch_enabled()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert launch_mod.set_fast_launch(True) is True


def test_descriptors_of_other_padding_are_other_keys():
    base = torch.zeros(64, dtype=torch.int32)
    desc = lambda padding: types.SimpleNamespace(base=base, shape=[8, 8], strides=[8, 1], block_shape=[8, 8],  # noqa: E731
                                                 padding=padding)
    assert launch_mod._traits(desc("zero")) != launch_mod._traits(desc("nan"))
    assert launch_mod._traits(desc("zero")) == launch_mod._traits(desc("zero"))


# ------------------------------------------------------------------------------------------------------- drvlaunch

from hicache_core import claunch, drvlaunch  # noqa: E402
from hicache_core.drvlaunch import DriverKernel, DriverLaunchError  # noqa: E402

_LAUNCH_T = ctypes.CFUNCTYPE(_int, _vp, *[ctypes.c_uint] * 7, _vp, ctypes.POINTER(_vp), _vp)


class DLib:
    """libcuda's cuLaunchKernel as a C function (reached through ctypes and through the compiled call alike)."""

    def __init__(self, n_params: int) -> None:
        self.n, self.calls, self.result = n_params, [], 0
        self.cuLaunchKernel = _LAUNCH_T(self._launch)

    def _launch(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        self.calls.append((gx, stream or 0, [ctypes.string_at(params[i], 8) for i in range(self.n)]))
        return self.result

    def cuGetErrorName(self, res, out):
        return 0


def _ptx(params: list[str]) -> str:
    body = ",\n".join(f"\t.param {p} K_param_{i}" + ("[128]" if p.endswith(".b8") else "") for i, p in enumerate(params))
    return f".visible .entry K(\n{body}\n)\n{{\n"


def _compiled_kernel(sig: dict, params: list[str], meta=None) -> types.SimpleNamespace:
    md = types.SimpleNamespace(name="K", num_warps=4, num_ctas=1, shared=0, global_scratch_size=0,
                               profile_scratch_size=0, launch_cooperative_grid=False, launch_pdl=False,
                               tensordesc_meta=meta)
    return types.SimpleNamespace(function=0xF00, asm={"ptx": _ptx(params)}, src=types.SimpleNamespace(signature=sig),
                                 metadata=md)


@pytest.fixture
def dlib(monkeypatch):
    lib = DLib(3)
    monkeypatch.setattr(drvlaunch, "_LIB", [lib])
    return lib


@pytest.mark.parametrize("tail", [[".u64"], [".u64", ".u64"]])
def test_up_to_two_trailing_scratch_pointers_are_accepted(dlib, tail):
    sig = {"p": "*i32", "n": "i32"}
    assert DriverKernel.build(_compiled_kernel(sig, [".u64 .ptr .global .align 1", ".u32", *tail])) is not None


@pytest.mark.parametrize("tail", [[".u64", ".u64", ".u64"], [".u32"], [".u64", ".u32"]])
def test_trailing_parameters_that_are_not_two_scratch_pointers_are_refused(dlib, tail):
    """Anything after the signature's parameters but Triton's two scratch pointers (an instrumentation pass's
    parameter, a 32-bit value) would be passed a null 8-byte value: refused, Triton's launcher keeps the kernel."""
    sig = {"p": "*i32", "n": "i32"}
    assert DriverKernel.build(_compiled_kernel(sig, [".u64 .ptr .global .align 1", ".u32", *tail])) is None


def test_a_descriptor_with_a_strided_inner_dimension_is_not_encoded(dlib):
    sig = {"d": "tensordesc<i32[8, 8]>"}
    meta = [{"swizzle": 0, "elem_size": 4, "block_size": [8, 8]}]
    k = DriverKernel.build(_compiled_kernel(sig, [".align 64 .b8", ".u32", ".u32", ".u64", ".u64"], meta))
    assert k is not None
    base = torch.zeros(256, dtype=torch.int32)
    desc = types.SimpleNamespace(base=base, shape=[8, 8], strides=[16, 2], block_shape=[8, 8], padding="zero")
    with pytest.raises(DriverLaunchError, match="not encodable"):
        k.pack([desc], dynamic=())


def test_relaunch_with_no_programs_launches_nothing(dlib):
    k = DriverKernel(dlib, types.SimpleNamespace(function=1), [("i64", 0, 0), ("i64", 1, 0), ("i64", 2, 0)], 0, 1, 0,
                     ())
    packed = k.pack([1, 2, 3], dynamic=[0])
    assert k.relaunch(0, 0, packed, (5,)) and dlib.calls == []
    assert k.relaunch(2, 0x9, packed, (5,)) and dlib.calls == [(2, 0x9, [(v).to_bytes(8, "little") for v in (5, 2, 3)])]


@pytest.mark.skipif(claunch.module() is None, reason="no compiled launch call here (no C compiler or Python headers)")
def test_more_dynamic_values_than_the_compiled_call_takes_keep_ctypes(monkeypatch):
    """The compiled call rewrites at most MAX_DYNAMIC values; a launch with more packs for ctypes (the compiled
    call's ``make`` would raise, and that error would escape the transfer)."""
    n = claunch.MAX_DYNAMIC + 1
    lib = DLib(n)
    monkeypatch.setattr(drvlaunch, "_LIB", [lib])
    k = DriverKernel(lib, types.SimpleNamespace(function=1), [("i64", i, 0) for i in range(n)], 0, 1, 0, ())
    packed = k.pack(list(range(n)), dynamic=range(n))
    assert packed.fast is None
    assert k.launch(1, 0, packed, list(range(100, 100 + n))) and \
        lib.calls[-1][2] == [v.to_bytes(8, "little") for v in range(100, 100 + n)]
    small = k.pack(list(range(n)), dynamic=range(n - 1))
    assert small.fast is not None


# ------------------------------------------------------------------------------------------- cudart: review fixes

def test_descriptor_arrays_on_a_device_without_memory_are_refused():
    """A ``meta`` tensor is not CUDA, but its data pointer is 0: the runtime would be handed NULL arrays."""
    rt = cudart.CudaRuntime.__new__(cudart.CudaRuntime)  # the checks come before any runtime call
    ok, meta = torch.arange(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="copy_batch: srcs must be a contiguous CPU int64 tensor .* on meta"):
        rt.copy_batch(ok, meta, ok, stream=0)
    from hicache_core.backends.pitched import OP_WORDS

    with pytest.raises(ValueError, match="copy_3d_batch: ops must be a contiguous CPU int64"):
        rt.copy_3d_batch(torch.zeros((2, OP_WORDS), dtype=torch.int64, device="meta"), stream=0)


def test_torchs_runtime_is_tried_before_other_runtimes_mapped_into_the_process(monkeypatch):
    """/proc/self/maps lists every libcudart in the process, sorted by path: an extension's bundled older runtime may
    sort first.  Torch's CUDA major (its soname) goes first, so the copy engine binds the runtime torch uses."""
    mapped = ["/opt/ext/bitsandbytes/libcudart.so.11.0", "/usr/local/cuda-13.0/lib64/libcudart.so.13",
              "/venv/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12"]
    monkeypatch.setattr(cudart, "loaded_cudart_paths", lambda: list(mapped))
    monkeypatch.setattr(cudart.ctypes.util, "find_library", lambda name: None)
    monkeypatch.setattr(cudart.torch.version, "cuda", "12.8", raising=False)
    assert cudart._candidate_paths()[:3] == [mapped[2], mapped[0], mapped[1]]
    monkeypatch.setattr(cudart.torch.version, "cuda", None, raising=False)  # a CPU build: the maps' order
    assert cudart._candidate_paths()[:3] == mapped


def test_among_runtimes_of_torchs_major_the_one_the_loader_resolves_goes_first(monkeypatch):
    """Two runtimes of torch's major mapped at once (a system CUDA and the pip wheel, say): the copy engine binds the
    one the dynamic loader resolves torch's soname to, not whichever path sorts first."""
    mapped = ["/usr/local/cuda-12.9/lib64/libcudart.so.12.9.79", "/venv/site-packages/nvidia/cuda_runtime/lib/"
              "libcudart.so.12", "/opt/ext/libcudart.so.11.0"]
    monkeypatch.setattr(cudart, "loaded_cudart_paths", lambda: list(mapped))
    monkeypatch.setattr(cudart.ctypes.util, "find_library", lambda name: None)
    monkeypatch.setattr(cudart.torch.version, "cuda", "12.8", raising=False)
    asked = []
    monkeypatch.setattr(cudart, "_loader_path", lambda soname: asked.append(soname) or mapped[1])
    assert cudart._candidate_paths()[:3] == [mapped[1], mapped[0], mapped[2]] and asked == ["libcudart.so.12"]
    monkeypatch.setattr(cudart, "_loader_path", lambda soname: None)  # not found: same-major ones by path
    assert cudart._candidate_paths()[:3] == mapped


def test_the_loader_lookup_names_a_loaded_library_and_loads_nothing():
    """``_loader_path`` asks the loader with RTLD_NOLOAD: the C library (always loaded) comes back as a mapped path;
    a soname nothing loaded gives None and stays unloaded."""
    import ctypes.util

    libc = ctypes.util.find_library("c")
    if not libc or not os.path.exists("/proc/self/maps"):
        pytest.skip("needs a Linux C library")
    path = cudart._loader_path(libc)
    if path is None:
        pytest.skip("this C library has no dlinfo")
    with open("/proc/self/maps") as f:
        assert path in {line.split()[-1] for line in f if "/" in line}
    assert cudart._loader_path("libhicache-never-there.so.7") is None


def test_a_runtime_without_the_batch_call_is_reported_once(monkeypatch, caplog):
    """Minor-version compatibility lets a 12.8 runtime run on a 12.4 driver, where the batch call fails: copies then go
    one runtime call per descriptor, a much slower submission that only a log line can tell about."""
    import logging

    libs = {"/x/libcudart.so.12": CLib(12080, 12040)}
    monkeypatch.setattr(cudart, "_runtime", None)
    monkeypatch.setattr(cudart, "_failure", None)
    monkeypatch.setattr(cudart.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cudart.torch.cuda, "init", lambda: None)
    monkeypatch.setattr(cudart, "_candidate_paths", lambda: list(libs))
    monkeypatch.setattr(cudart.ctypes, "CDLL", lambda path: libs[path])
    with caplog.at_level(logging.INFO, logger="hicache_core.backends.cudart"):
        rt = cudart.runtime()
        assert cudart.runtime() is rt and not rt.has_batch
    assert caplog.text.count("without cudaMemcpyBatchAsync") == 1
    assert "12080 on driver 12040" in caplog.text and "12.8" in caplog.text


# ------------------------------------------------------------------------------- drvlaunch / claunch: review fixes

def test_a_refused_driver_launch_names_the_switch_back_to_tritons_launcher(dlib):
    dlib.n = 1  # one parameter: the recorder reads only that
    k = DriverKernel(dlib, types.SimpleNamespace(function=1), [("i64", 0, 0)], 0, 8, 0, ())
    packed = k.pack([1], dynamic=[0])
    assert k.launch(1, 0, packed, [2]) and dlib.calls[-1][0] == 1
    dlib.result = 1  # CUDA_ERROR_INVALID_VALUE
    with pytest.raises(DriverLaunchError, match=r"cuLaunchKernel failed: \? \(1\); HICACHE_DRIVER_LAUNCH=0"):
        k.launch(1, 0, packed, [2])


def test_the_block_is_32_threads_per_warp(dlib):
    seen = []
    lib = types.SimpleNamespace(cuLaunchKernel=_LAUNCH_T(lambda fn, gx, gy, gz, bx, by, bz, *rest: seen.append(bx) or 0))
    for warps in (1, 8):
        k = DriverKernel(lib, types.SimpleNamespace(function=1), [("i64", 0, 0)], 0, warps, 0, ())
        assert k.launch(1, 0, k.pack([1], dynamic=[0]), [2])
    assert seen == [32, 256]


def test_an_unwritable_cache_directory_keeps_ctypes_and_names_the_fix(monkeypatch, tmp_path, caplog):
    import logging

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setattr(claunch, "_ON", [True])
    monkeypatch.setattr(claunch, "_MOD", [])
    monkeypatch.setenv(claunch.ENV_CACHE_DIR, str(blocker))
    with caplog.at_level(logging.INFO, logger="hicache_core.claunch"):
        assert claunch.module() is None
    assert "ctypes" in caplog.text and claunch.ENV_CACHE_DIR in caplog.text and "HICACHE_C_LAUNCH=0" in caplog.text


# ---------------------------------------------------------------------------------------------------------- replay

def test_a_recorded_step_keeps_no_batch_tensor_alive():
    """Steps outlive their batch (they serve every later batch of the same traits): a recording that kept the
    index tensors it was made with would hold them (and their device copies) for the pool's lifetime."""
    import gc
    import weakref

    from hicache_core import replay as replay_mod

    anchor, h, d = torch.zeros(4), torch.arange(4), torch.arange(4)
    alive = weakref.ref(h), weakref.ref(d)
    packed = types.SimpleNamespace(setters=((0, None, True), (1, None, True), (2, None, True), (3, None, False)))
    st = replay_mod.step((None, packed), None, [anchor, h, d, 4], (1, 2, 3), programs=2, tokens=1, per_tile=1,
                         fallback={})
    assert st.base == (anchor.data_ptr(), 0, 0, 0) and st.where == ((1, 0), (2, 1), (3, 2))
    del h, d
    gc.collect()
    assert alive[0]() is None and alive[1]() is None and st.template[0] is anchor


@pytest.mark.skipif(claunch.module() is None, reason="no compiled launch call here (no C compiler or Python headers)")
def test_more_parameters_than_the_compiled_call_copies_keep_ctypes(monkeypatch):
    n = claunch.MAX_PARAMS + 1
    lib = DLib(n)
    monkeypatch.setattr(drvlaunch, "_LIB", [lib])
    k = DriverKernel(lib, types.SimpleNamespace(function=1), [("i64", i, 0) for i in range(n)], 0, 1, 0, ())
    packed = k.pack(list(range(n)), dynamic=[0])
    assert packed.fast is None
    assert k.launch(1, 0, packed, [7, *range(1, n)]) and lib.calls[-1][2][:2] == [(7).to_bytes(8, "little"),
                                                                                  (1).to_bytes(8, "little")]
