"""hicache_core.claunch: the compiled launch call builds here, launches exactly the packed parameters with the
new dynamic values, refuses what it cannot launch, and gives way to ctypes when off or unbuildable.

The driver is a ctypes callback with ``cuLaunchKernel``'s signature that records every parameter's bytes
(byte identity with the ctypes route over real strategies is in tests/test_replay.py)."""

from __future__ import annotations

import ctypes
import logging

import pytest

from hicache_core import claunch, drvlaunch

_LAUNCH_T = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                             ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)
needs_module = pytest.mark.skipif(claunch.module() is None,
                                  reason="no compiled launch call here (no C compiler or Python headers)")


class Driver:
    """Records ``(function, grid, block, shared, stream, parameter bytes)`` of each launch (8 bytes each)."""

    def __init__(self, n_params: int, result: int = 0) -> None:
        self.n, self.result, self.calls = n_params, result, []
        self.fn = _LAUNCH_T(self._launch)
        self.address = ctypes.cast(self.fn, ctypes.c_void_p).value

    def _launch(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        self.calls.append((fn, (gx, gy, gz), (bx, by, bz), shared, stream,
                           [ctypes.string_at(params[i], 8) for i in range(self.n)], extra))
        return self.result


_LAUNCH_EX_T = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(drvlaunch._LaunchConfig), ctypes.c_void_p,
                                ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)


class DriverEx(Driver):
    """:class:`Driver` with ``cuLaunchKernelEx``: records ``(function, grid, block, shared, stream, attributes,
    parameter bytes, extra)`` of each dependent launch."""

    def __init__(self, n_params: int, result: int = 0) -> None:
        super().__init__(n_params, result)
        self.fn_ex = _LAUNCH_EX_T(self._launch_ex)
        self.address_ex = ctypes.cast(self.fn_ex, ctypes.c_void_p).value

    def _launch_ex(self, cfg, fn, params, extra):
        c = cfg.contents
        self.calls.append(("ex", fn, (c.grid_x, c.grid_y, c.grid_z), (c.block_x, c.block_y, c.block_z), c.shared,
                           c.stream, [(c.attrs[i].id, c.attrs[i].value) for i in range(c.n_attrs)],
                           [ctypes.string_at(params[i], 8) for i in range(self.n)], extra))
        return self.result


def _storage(*values: int) -> tuple[list, object]:
    objs = [ctypes.c_uint64(v) for v in values]
    return objs, (ctypes.c_void_p * len(objs))(*[ctypes.addressof(o) for o in objs])


@needs_module
def test_a_launch_carries_the_static_parameters_and_the_new_dynamic_values():
    mod = claunch.module()
    drv = Driver(4)
    objs, array = _storage(11, 22, 33, 44)
    h = mod.make(drv.address, 0x1234, 128, 4096, ctypes.addressof(array), 4, (3, 1), objs)
    assert mod.launch(h, 7, 0x50, 2**40 + 5, -1) == 0
    fn, grid, block, shared, stream, body, extra = drv.calls[-1]
    assert (fn, grid, block, shared, stream, extra) == (0x1234, (7, 1, 1), (128, 1, 1), 4096, 0x50, None)
    assert body == [v.to_bytes(8, "little") for v in (11, 2**64 - 1, 33, 2**40 + 5)]  # -1: all bits (an i32 reads 4)
    assert [o.value for o in objs] == [11, 22, 33, 44]  # nothing shared written
    drv.result = 700
    assert mod.launch(h, 1, 0, 1, 2) == 700  # the driver's result, as is


@needs_module
def test_a_dependent_launch_goes_through_cuLaunchKernelEx_with_the_programmatic_attribute():
    """A handle made with ``cuLaunchKernelEx``'s address launches through it: the same function, grid, block, shared
    memory, stream and parameters as a plain launch, one attribute (programmatic stream serialization, 6, on)."""
    mod = claunch.module()
    drv = DriverEx(3)
    objs, array = _storage(11, 22, 33)
    h = mod.make(drv.address, 0x1234, 128, 4096, ctypes.addressof(array), 3, (1,), objs, drv.address_ex)
    assert mod.launch(h, 7, 0x50, 99) == 0
    assert drv.calls == [("ex", 0x1234, (7, 1, 1), (128, 1, 1), 4096, 0x50, [(6, 1)],
                          [v.to_bytes(8, "little") for v in (11, 99, 33)], None)]
    drv.result = 700
    assert mod.launch(h, 1, 0, 1) == 700
    plain = mod.make(drv.address, 0x1234, 128, 0, ctypes.addressof(array), 3, (), objs, 0)  # 0: a plain launch
    assert mod.launch(plain, 2, 0) == 700 and drv.calls[-1][0] == 0x1234


@needs_module
def test_bad_handles_and_values_are_refused_before_any_launch():
    mod = claunch.module()
    drv = Driver(2)
    _, array = _storage(1, 2)
    addr = ctypes.addressof(array)
    with pytest.raises(ValueError, match="dynamic index out of range"):
        mod.make(drv.address, 1, 32, 0, addr, 2, (2,), array)
    with pytest.raises(ValueError, match="out of range"):
        mod.make(drv.address, 1, 32, 0, addr, claunch.MAX_PARAMS + 1, (), array)
    with pytest.raises(ValueError, match="out of range"):
        mod.make(drv.address, 1, 32, 0, addr, 2, tuple(range(claunch.MAX_DYNAMIC + 1)), array)
    with pytest.raises(ValueError, match="out of range"):
        mod.make(0, 1, 32, 0, addr, 2, (), array)
    h = mod.make(drv.address, 1, 32, 0, addr, 2, (0,), array)
    with pytest.raises(TypeError, match="one value per dynamic parameter"):
        mod.launch(h, 1, 0)
    with pytest.raises(TypeError):
        mod.launch(h, 1, 0, "x")
    with pytest.raises(ValueError):
        mod.launch(object(), 1, 0, 5)

    class Index:  # converts, but after a bad grid must never be asked to
        asked = 0

        def __index__(self) -> int:
            Index.asked += 1
            return 3
    with pytest.raises(TypeError):  # the real error, not a SystemError from converting on with it set
        mod.launch(h, "x", 0, Index())
    with pytest.raises(OverflowError):
        mod.launch(h, 1, -1, Index())
    assert Index.asked == 0 and drv.calls == []


@needs_module
def test_a_handle_keeps_its_parameter_storage_alive():
    import gc
    import weakref

    class Storage(list):
        pass

    mod = claunch.module()
    drv = Driver(2)
    objs, array = _storage(5, 6)
    owner = Storage([objs, array])
    alive = weakref.ref(owner)
    h = mod.make(drv.address, 1, 32, 0, ctypes.addressof(array), 2, (1,), owner)
    del owner, objs, array
    gc.collect()
    assert alive() is not None
    assert mod.launch(h, 1, 0, 9) == 0 and drv.calls[-1][5] == [(5).to_bytes(8, "little"), (9).to_bytes(8, "little")]
    del h
    gc.collect()
    assert alive() is None


@needs_module
def test_a_packed_launch_takes_the_compiled_call_and_falls_back_when_switched_off():
    """DriverKernel.launch through the compiled call and through ctypes: the same bytes reach the driver."""
    import types

    drv = Driver(3)
    lib = types.SimpleNamespace(cuLaunchKernel=drv.fn)
    compiled = types.SimpleNamespace(function=0x77)
    kernel = drvlaunch.DriverKernel(lib, compiled, [("ptr", 0, 0), ("i32", 1, 0)], 1, 4, 0, ())

    class T:
        def __init__(self, ptr: int) -> None:
            self.ptr = ptr

        def data_ptr(self) -> int:
            return self.ptr

    packed = kernel.pack([T(0x1000), 5], dynamic=[0, 1])
    assert packed.fast is not None
    assert kernel.launch(3, 0x60, packed, [T(0x2000), 9])
    claunch.set_c_launch(False)
    try:
        assert kernel.launch(3, 0x60, packed, [T(0x2000), 9])
    finally:
        claunch.set_c_launch()
    a, b = drv.calls
    assert a[:5] == b[:5] == (0x77, (3, 1, 1), (128, 1, 1), 0, 0x60)
    # the i32 parameter's 4 bytes are what the kernel reads; the rest of an 8-byte read is the storage's
    assert [x[:4] for x in a[5][:2]] == [x[:4] for x in b[5][:2]] and a[5][0] == (0x2000).to_bytes(8, "little")
    assert a[5][1][:4] == (9).to_bytes(4, "little") and a[5][2] == bytes(8)  # scratch pointer: null


def test_off_by_environment(monkeypatch):
    monkeypatch.setenv(claunch.ENV_C_LAUNCH, "0")
    try:
        assert claunch.set_c_launch() is False and claunch.module() is None
    finally:
        monkeypatch.delenv(claunch.ENV_C_LAUNCH)
        claunch.set_c_launch()


def test_no_compiler_keeps_ctypes_and_says_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(claunch, "_ON", [True])  # whatever HICACHE_C_LAUNCH says here
    monkeypatch.setattr(claunch, "_MOD", [])
    monkeypatch.setattr(claunch, "_compiler", lambda: None)
    monkeypatch.setenv(claunch.ENV_CACHE_DIR, str(tmp_path))
    with caplog.at_level(logging.INFO, logger="hicache_core.claunch"):
        assert claunch.module() is None
    assert "no C compiler" in caplog.text and "ctypes" in caplog.text
    assert not list(tmp_path.rglob("*.so"))
    drv = Driver(1)
    import types

    kernel = drvlaunch.DriverKernel(types.SimpleNamespace(cuLaunchKernel=drv.fn), types.SimpleNamespace(function=1),
                                    [("i64", 0, 0)], 0, 1, 0, ())
    packed = kernel.pack([3], dynamic=[0])
    assert packed.fast is None and kernel.launch(1, 0, packed, [4]) and drv.calls[-1][5] == [(4).to_bytes(8, "little")]


@needs_module
def test_builds_into_the_cache_directory(monkeypatch, tmp_path):
    monkeypatch.setattr(claunch, "_MOD", [])
    monkeypatch.setenv(claunch.ENV_CACHE_DIR, str(tmp_path))
    mod = claunch.module()
    built = list(tmp_path.rglob("_hicache_claunch*"))
    assert mod is not None and [p.parent.parent.name for p in built] == ["claunch"]
    build = claunch._build

    def no_build(target):
        raise AssertionError("rebuilt although the file was there")
    monkeypatch.setattr(claunch, "_build", no_build)
    monkeypatch.setattr(claunch, "_MOD", [])
    assert claunch.module() is not None  # found and imported, not built again

    # a damaged file (never loaded: another cache directory) is built again, once, and imported
    monkeypatch.setattr(claunch, "_MOD", [])
    monkeypatch.setenv(claunch.ENV_CACHE_DIR, str(tmp_path / "other"))
    damaged = claunch._target()
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"not a shared object")
    calls = []
    monkeypatch.setattr(claunch, "_build", lambda target: (calls.append(target), build(target)))
    assert claunch.module() is not None and calls == [damaged] and damaged.read_bytes()[:4] == b"\x7fELF"
