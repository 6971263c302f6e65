"""benchmarks/launch_floor.py on the CPU: its C loop through ``cuLaunchKernelEx`` hands the driver the configuration
cuda.h lays out (grid, block, shared bytes, stream; the programmatic stream serialization attribute exactly when asked
for a dependent launch), and the replayed backups' launch count counts driver relaunches."""

from __future__ import annotations

import ctypes
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # launch_floor imports launch_cost

from benchmarks import launch_floor as lf  # noqa: E402
from hicache_core import drvlaunch  # noqa: E402


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.parametrize("pdl", [0, 1])
def test_the_c_loop_launches_through_cuLaunchKernelEx_with_the_attribute_only_when_dependent(pdl):
    seen = []
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)

    def fake_ex(cfg, fn, params, extra):
        c = ctypes.cast(cfg, ctypes.POINTER(drvlaunch._LaunchConfig)).contents
        attrs = [(c.attrs[i].id, c.attrs[i].value) for i in range(c.n_attrs)]
        seen.append(((c.grid_x, c.grid_y, c.grid_z), (c.block_x, c.block_y, c.block_z), c.shared, c.stream, attrs,
                     fn, params, extra))
        return 0
    cb = proto(fake_ex)
    params = (ctypes.c_void_p * 1)(None)
    h = lf._helper()
    res = h.loop_launch_ex(ctypes.cast(cb, ctypes.c_void_p).value, 0x1234, 3, 128, 64, 0x55, params, 4, pdl)
    assert res == 0 and len(seen) == 4
    assert all(s[:4] == ((3, 1, 1), (128, 1, 1), 64, 0x55) and s[5] == 0x1234 for s in seen)
    assert all(s[6] == ctypes.addressof(params) and s[7] is None for s in seen)
    assert all(s[4] == ([(drvlaunch._PDL_ATTRIBUTE, 1)] if pdl else []) for s in seen)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_the_c_loop_stops_at_the_first_driver_error():
    calls = []
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
    cb = proto(lambda *a: calls.append(a) or (700 if len(calls) == 2 else 0))
    assert lf._helper().loop_launch_ex(ctypes.cast(cb, ctypes.c_void_p).value, 1, 1, 32, 0, 0, None, 10, 1) == 700
    assert len(calls) == 2


def test_relaunches_counts_the_driver_relaunches_of_one_call_and_restores_the_method(monkeypatch):
    real = drvlaunch.DriverKernel.relaunch
    ran = []
    monkeypatch.setattr(drvlaunch.DriverKernel, "relaunch", lambda self, *a: ran.append(a) or True)
    inner = drvlaunch.DriverKernel.relaunch
    kernel = object.__new__(drvlaunch.DriverKernel)
    assert lf._relaunches(lambda: [kernel.relaunch(g, 0, None, ()) for g in range(5)]) == 5
    assert len(ran) == 5 and drvlaunch.DriverKernel.relaunch is inner
    with pytest.raises(ZeroDivisionError):
        lf._relaunches(lambda: 1 // 0)
    assert drvlaunch.DriverKernel.relaunch is inner
    monkeypatch.undo()
    assert drvlaunch.DriverKernel.relaunch is real
