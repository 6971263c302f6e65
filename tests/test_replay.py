"""hicache_core.replay: a replayed call launches exactly what the normal path launches, and only when nothing
it depends on changed (tensors, versions, stream, device, driver switches, launch hooks).

On CPU the CUDA driver is a recording fake and the kernels are fake compiled handles, so what is compared is the
launches themselves: function, grid, block, shared memory, stream and every parameter's bytes.  On a GPU the
replayed bursts are checked byte for byte against the rows they must move.
"""

from __future__ import annotations

import ctypes
import inspect
import itertools
import os
import types

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest  # noqa: E402

from hicache_core import claunch, drvlaunch, kernel_support, launch as launch_mod, replay as replay_mod, rowcopy  # noqa: E402
from hicache_core.bench import SHAPES  # noqa: E402
from hicache_core.drvlaunch import DriverKernel, expected_params  # noqa: E402
from hicache_core.launch import Launcher, set_driver_launch  # noqa: E402
from hicache_core.errors import IndexLengthMismatchError  # noqa: E402
from hicache_core.pool import HostKVPool, allocate_host_buffers  # noqa: E402
from hicache_core.registry import create_registry  # noqa: E402

GPU = torch.cuda.is_available()
_FN = itertools.count(0x1000)


_LAUNCH_T = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                             ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)


class RecordingLib:
    """A CUDA driver that records each launch with every parameter's bytes (sizes per function handle).

    Its ``cuLaunchKernel`` is a C function (a ctypes callback), so launches reach it both through ctypes and
    through the compiled call of :mod:`hicache_core.claunch`, which takes its address."""

    def __init__(self) -> None:
        self.sizes: dict[int, list[int]] = {}
        self.positions: dict[int, list[int]] = {}  # argument position of each parameter
        self.launches: list[tuple] = []
        self.result = 0
        self.cuLaunchKernel = _LAUNCH_T(self._launch)

    def _launch(self, fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        fn, stream = fn or 0, stream or 0
        body = tuple(ctypes.string_at(params[i], size) for i, size in enumerate(self.sizes[fn]))
        if self.result == 0:
            self.launches.append((fn, (gx, gy, gz), (bx, by, bz), shared, stream, body))
        return self.result

    def cuGetErrorName(self, res, out):
        return 0


class FakeKernel:
    """Stands for a ``@triton.jit`` kernel: its public launch returns a compiled handle whose ``run`` records."""

    def __init__(self, real, lib: RecordingLib, runs: list) -> None:
        self.arg_names = list(real.arg_names)
        params = inspect.signature(getattr(real, "fn", real)).parameters
        self.constexprs = [i for i, p in enumerate(params.values()) if "constexpr" in str(p.annotation)]
        self.lib, self.runs, self.public = lib, runs, 0

    def _sig(self, args) -> dict:
        def one(i, a):
            if i in self.constexprs:
                return "constexpr"
            if isinstance(a, torch.Tensor):
                return {torch.int64: "*i64", torch.int32: "*i32"}.get(a.dtype, "*u8")
            return "i64" if abs(a) >= 2**31 else "i32"
        return {n: one(i, a) for i, (n, a) in enumerate(zip(self.arg_names, args))}

    def __getitem__(self, grid):
        def launch(*args, num_warps, **opts):
            self.public += 1
            fn = next(_FN)
            sig = self._sig(args)
            plan = expected_params(sig, None)
            self.lib.sizes[fn] = [drvlaunch._size(kind) for kind, _, _ in plan] + [8, 8]
            self.lib.positions[fn] = [pos for _, pos, _ in plan]
            return types.SimpleNamespace(
                function=fn, packed_metadata=object(), sig=sig, num_warps=num_warps,
                run=lambda grid_x, gy, gz, stream, *rest: self.runs.append((fn, grid_x, stream)))
        return launch


def _driver_kernel(compiled):
    plan = expected_params(compiled.sig, None)
    return DriverKernel(drvlaunch._LIB[0], compiled, plan, 2, compiled.num_warps, 0, ())


class World:
    """A CPU pool whose kernel launches go through the fake driver; ``stream``/``device`` are what the replay
    module sees as current."""

    def __init__(self, monkeypatch, layout: str, *, validate: str = "shapes") -> None:
        self.lib, self.runs, self.stream, self.device = RecordingLib(), [], 0x50, 0
        monkeypatch.setattr(drvlaunch, "_LIB", [self.lib])
        monkeypatch.setattr(Launcher, "_driver_kernel", staticmethod(_driver_kernel))
        monkeypatch.setattr(replay_mod, "current_device_index", lambda: self.device)
        monkeypatch.setattr(replay_mod, "current_stream_handle", lambda index: self.stream)
        monkeypatch.setattr(replay_mod, "DEVICE_TYPES", ("cuda", "cpu"))
        monkeypatch.setattr(replay_mod, "_ON", [True])  # whatever HICACHE_REPLAY says; restored after the test
        monkeypatch.setenv("HICACHE_KERNEL_TMA", "0")  # the row kernel only: TMA has no fake here
        monkeypatch.setattr(rowcopy, "interpreting", lambda: False)  # replays are made for this CPU pool
        monkeypatch.setattr(kernel_support, "interpreting", lambda: True)  # a CPU pool may take kernels (on GPU hosts too)
        # the launches are faked: no interpreter runs them, whatever Triton is installed (3.6's cannot)
        monkeypatch.setattr(kernel_support, "interpreter_problem", lambda: None)
        monkeypatch.setattr(launch_mod, "_ENABLED", [True])
        monkeypatch.setattr(launch_mod, "_DRIVER", [True])
        reg = create_registry()
        spec = SHAPES["mla61x576-bf16"](64, 16, torch.device("cpu"))
        self.spec = spec
        dev = {c.name: [torch.zeros(160, c.row_bytes // c.itemsize, dtype=c.dtype)
                        for _ in range(spec.layer_map.num_device_layers)] for c in spec.components}
        host = allocate_host_buffers(reg.layout(layout).plan(spec), pin_memory=False)
        self.pool = HostKVPool(spec, layout, "kernel", dev, host_buffers=host, registry=reg, validate=validate,
                               strategy_options={"programs": 3})
        prep = self.pool.binding.scratch[self.pool.strategy.name]
        self.prep, self.replays = prep, prep.replays
        self.hook = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
        self.launcher = prep.launcher
        for launcher in (prep.launcher, prep.page_launcher):  # the row kernel, and page loads where the layout has them
            if launcher is None:
                continue
            monkeypatch.setattr(launcher, "kernel", FakeKernel(launcher.kernel, self.lib, self.runs))
            monkeypatch.setattr(launcher, "_api", (lambda: 0, lambda device: self.stream, self.hook))
            monkeypatch.setattr(launcher, "_compiled", {})
            monkeypatch.setattr(launcher, "_driver", {})
        self.layers = list(spec.layer_map.device_layers)

    def burst(self, h, d) -> list[tuple]:
        """Every layer's load, then one backup of all layers; the launches they made."""
        start = len(self.lib.launches)
        for layer in self.layers:
            assert self.pool.load_layer(layer, h, d)
        self.pool.backup_all_layers(h, d)
        return self.lib.launches[start:]


@pytest.fixture(params=["compiled", "ctypes"])
def route(request) -> str:
    """Driver launches through the compiled call (:mod:`hicache_core.claunch`) or through ctypes."""
    if request.param == "compiled" and claunch.module() is None:
        pytest.skip("no compiled launch call here (no C compiler or Python headers)")
    claunch.set_c_launch(request.param == "compiled")
    request.addfinalizer(claunch.set_c_launch)
    return request.param


def _idx(seed: int, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pages_h, pages_d = torch.randperm(4, generator=g)[: n // 16], torch.randperm(10, generator=g)[: n // 16]
    ex = lambda p: (p.unsqueeze(1) * 16 + torch.arange(16)).reshape(-1)  # noqa: E731
    return ex(pages_h), ex(pages_d)


def _forget(w: "World") -> None:
    """Drop every batch and recorded step: the next calls take the normal path (and record again)."""
    w.replays._steps.clear()
    w.replays._batches[:] = [None, None]


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_replayed_launches_equal_the_normal_path(monkeypatch, layout, route):
    """The same burst replayed and then through the normal path: byte-identical launches (function, grid, block,
    shared memory, stream, every parameter), for a batch seen before and a new one."""
    w = World(monkeypatch, layout)
    assert w.replays is not None
    h, d = _idx(1)
    w.burst(h, d)  # compiles (Triton's public launch: nothing recorded for that call)
    w.burst(h, d)  # packs and records
    assert all((st.packed.fast is not None) == (route == "compiled") for sts in w.replays._steps.values() for st in sts)
    hits = w.replays.hits
    replayed = w.burst(h, d)
    assert w.replays.hits - hits == len(w.layers) + 1  # every call of the burst
    _forget(w)
    assert w.burst(h, d) == replayed and w.replays.hits - hits == len(w.layers) + 1
    h2, d2 = _idx(2)
    replayed = w.burst(h2, d2)  # a new batch: resolved by its first call, replayed from its first call
    assert w.replays.hits - hits == 2 * (len(w.layers) + 1)
    _forget(w)
    assert w.burst(h2, d2) == replayed
    assert replayed and not w.runs  # everything went through the (fake) driver, nothing through Triton


def _replayed(w: World, call) -> bool:
    before = w.replays.hits
    call()
    return w.replays.hits > before


def test_replays_only_while_nothing_they_depend_on_changed(monkeypatch):
    w = World(monkeypatch, "layer_first")
    h, d = _idx(3)
    layer = w.layers[1]
    load = lambda: w.pool.load_layer(layer, h, d)  # noqa: E731
    w.burst(h, d)
    w.burst(h, d)
    assert _replayed(w, load)
    batch = w.replays._batches[False]
    assert _replayed(w, load) and w.replays._batches[False] is batch  # same tensors, same versions: same batch
    h[:16], h[16:32] = h[16:32].clone(), h[:16].clone()  # in place: the version moves, the batch is resolved again
    assert _replayed(w, load) and w.replays._batches[False] is not batch
    assert w.replays._batches[False].host_version == h._version
    batch = w.replays._batches[False]
    w.stream = 0x60  # another stream: resolved again (a CPU index copy is reused only on its own stream)
    assert _replayed(w, load) and w.replays._batches[False] is not batch
    assert w.replays._batches[False].stream == 0x60 and w.lib.launches[-1][4] == 0x60
    w.device = 1  # another current device: the normal path (it switches devices)
    assert not _replayed(w, load)
    w.device = 0
    assert _replayed(w, load)
    set_driver_launch(False)
    runs = len(w.runs)
    assert not _replayed(w, load) and len(w.runs) == runs + 1  # Triton's launcher, no replay
    set_driver_launch(True)
    w.hook.launch_enter_hook = lambda *a: None  # a profiler's hook: the public path, never a replay
    assert not _replayed(w, load)
    w.hook.launch_enter_hook = None
    assert _replayed(w, load)
    monkeypatch.setenv("HICACHE_REPLAY", "0")
    assert not replay_mod.set_replay(None) and not _replayed(w, load)
    monkeypatch.delenv("HICACHE_REPLAY")
    assert replay_mod.set_replay(None) and _replayed(w, load)
    with torch.inference_mode():
        hi, di = h.clone(), d.clone()  # no version counter: never replayed
    assert not _replayed(w, lambda: w.pool.load_layer(layer, hi, di))
    assert not _replayed(w, lambda: w.pool.load_layer(layer, hi, di))


@pytest.mark.parametrize("bad", ["0", "off", b"", [], 0.0])
def test_set_replay_refuses_what_is_not_a_switch(monkeypatch, bad):
    """``set_replay("0")`` would be truthy and turn replays on: refused, naming the argument, the state unchanged."""
    monkeypatch.setattr(replay_mod, "_ON", [False])
    with pytest.raises(TypeError, match=r"set_replay\(enabled\) must be True, False or None .*HICACHE_REPLAY"):
        replay_mod.set_replay(bad)
    assert replay_mod.replay_enabled() is False
    assert replay_mod.set_replay(1) is True and replay_mod.set_replay(False) is False


def test_indices_of_other_traits_record_their_own_steps(monkeypatch):
    """int32 indices specialise the kernel differently from int64 ones: steps are recorded per traits, never
    shared across them."""
    w = World(monkeypatch, "layer_first")
    h, d = _idx(4)
    w.burst(h, d)
    w.burst(h, d)
    h1, d1 = h[:16].to(torch.int32), d[:16].to(torch.int32)
    layer = w.layers[2]
    load = lambda: w.pool.load_layer(layer, h1, d1)  # noqa: E731
    assert not _replayed(w, load) and not _replayed(w, load)  # compiled (public launch), then recorded
    assert _replayed(w, load)
    assert w.lib.launches[-1] == w.lib.launches[-2]
    assert _replayed(w, lambda: w.pool.load_layer(layer, h, d))  # the int64 steps are still there


def test_counts_on_either_side_of_a_split_record_their_own_steps(monkeypatch):
    """A strategy whose launches change with the count (a TMA row limit) splits replays there: steps recorded for
    counts up to the split never serve a call above it."""
    w = World(monkeypatch, "layer_first")
    w.replays.splits = (40,)
    h, d = _idx(6, 32)
    w.burst(h, d)
    w.burst(h, d)
    layer = w.layers[3]
    assert _replayed(w, lambda: w.pool.load_layer(layer, h, d))
    h2, d2 = _idx(7, 48)  # above the split: same launch-key traits, other side
    below = w.replays._batches[False].traits
    above = w.replays.batch(h2, d2, 48, False, w.launcher).traits
    assert above[:3] == below[:3] and above != below
    load = lambda: w.pool.load_layer(layer, h2, d2)  # noqa: E731
    assert not _replayed(w, load) and _replayed(w, load)  # recorded by its own first call, then replayed


def test_no_context_on_this_thread_falls_back_to_tritons_launcher(monkeypatch, route):
    w = World(monkeypatch, "layer_first")
    h, d = _idx(5)
    w.burst(h, d)
    w.burst(h, d)
    w.lib.result = 201  # CUDA_ERROR_INVALID_CONTEXT: nothing launched by the driver
    runs = len(w.runs)
    assert _replayed(w, lambda: w.pool.load_layer(w.layers[0], h, d))
    assert len(w.runs) == runs + 1  # the step's launch went through the launcher, which took Triton's path


@pytest.mark.parametrize("validate", ["full", "strict"])
def test_pools_that_check_every_call_never_replay(monkeypatch, validate):
    w = World(monkeypatch, "layer_first", validate=validate)
    assert w.replays is None


def test_a_data_swap_is_seen_and_same_device_views_are_not_replayed(monkeypatch):
    """``.data`` replaced keeps the tensor's identity and version counter: its pointer and count still tell.  A
    non-contiguous index tensor on the pool's device would be replayed from a contiguous copy that writes torch
    does not count could leave stale: it takes the normal path every call."""
    w = World(monkeypatch, "layer_first")
    h, d = _idx(11)
    w.burst(h, d)
    w.burst(h, d)
    layer = w.layers[4]
    load = lambda: w.pool.load_layer(layer, h, d)  # noqa: E731
    batch = w.replays._batches[False]
    assert _replayed(w, load) and w.replays._batches[False] is batch
    version = h._version
    h.data = h.data[16:].clone()  # 16 positions, same object, same version counter
    d.data = d.data[16:].clone()
    assert h._version == version
    assert _replayed(w, load) and w.replays._batches[False] is not batch
    assert w.replays._batches[False].n == 16
    full = d.data
    d.data = full[:8]  # a view of the same storage: same object, version and address, 8 positions
    with pytest.raises(IndexLengthMismatchError):
        load()  # not replayed with the 16 positions of before: the pool's check sees the mismatch
    d.data = full
    base = torch.stack([d, d + 1000], dim=1)  # d as a strided view
    view = base[:, 0]
    assert not view.is_contiguous()
    assert w.replays.batch(h, view, 16, False, w.launcher) is None
    assert not _replayed(w, lambda: w.pool.load_layer(layer, h, view))
    assert not _replayed(w, lambda: w.pool.load_layer(layer, h, view))


def test_the_lane_never_skips_a_check_the_pool_would_make(monkeypatch):
    """The pool's fast path (:meth:`Replays.lane`) runs before the pool's checks: it replays only a layer id that is
    an ``int`` and was served before, and only index tensors the pool checked, unchanged; anything else reaches
    the checks, which raise before any launch."""
    from hicache_core.errors import IndexRangeError, LayerIdError

    w = World(monkeypatch, "layer_first")
    h, d = _idx(13)
    w.burst(h, d)
    w.burst(h, d)
    assert _replayed(w, lambda: w.pool.load_layer(1, h, d))
    launches = len(w.lib.launches)
    for bad in (True, 1.0, torch.tensor(1), len(w.layers), -1):  # equal to a served layer's key, or out of range
        with pytest.raises(LayerIdError):
            w.pool.load_layer(bad, h, d)
        with pytest.raises(LayerIdError):
            w.pool.backup_layer(bad, h, d)
    assert len(w.lib.launches) == launches

    class Layer(int):
        pass

    checks = []
    real = w.pool._check
    w.pool._check = lambda *a, **k: checks.append(a) or real(*a, **k)  # an instance attribute over the method
    assert w.pool.load_layer(1, h, d) and not checks  # the lane
    assert w.pool.load_layer(Layer(1), h, d) and len(checks) == 1  # a subclass: the pool's checks, then the launch
    assert w.lib.launches[-1] == w.lib.launches[-2]
    del w.pool._check
    launches = len(w.lib.launches)
    h[0] = w.spec.capacity + 5  # in place, out of range: the version moves, the pool checks again
    with pytest.raises(IndexRangeError):
        w.pool.load_layer(1, h, d)
    with pytest.raises(IndexRangeError):
        w.pool.load_all_layers(h, d)
    assert len(w.lib.launches) == launches  # nothing launched


@pytest.mark.parametrize("change", ["in place", ".data"])
def test_the_lane_sees_device_indices_change(monkeypatch, change):
    """A CPU device-index tensor changed after a batch was resolved (in place: its version counter moves; ``.data``
    swapped for other values of the same length: its address moves) is checked and copied again, never replayed
    from the batch's stale device copy."""
    from hicache_core.errors import IndexRangeError

    w = World(monkeypatch, "layer_first")
    h, d = _idx(15)
    w.burst(h, d)
    w.burst(h, d)
    assert _replayed(w, lambda: w.pool.load_layer(1, h, d))
    before = w.lib.launches[-1]
    if change == "in place":
        d[0] = 10_000  # out of every device layer's rows
        with pytest.raises(IndexRangeError):
            w.pool.load_layer(1, h, d)
        assert w.lib.launches[-1] is before
        return
    other = _idx(16)[1]
    assert not torch.equal(other, d)
    d.data = other.clone()  # same length, same object, same version counter, other storage
    w.pool.load_layer(1, h, d)
    assert w.lib.launches[-1] != before  # the device copy the launch reads is the new one
    assert w.replays._batches[False].device_where[0] == d.data_ptr()


@pytest.mark.parametrize("order", [(0, 1, 2, 3, 4), (3, 2, 0, 4, 1), (4, 0, 1, 2), (0, 1, 3, 4)])
def test_a_resolution_takes_the_values_the_normal_launch_would(order):
    """A step's dynamic values resolved for a batch equal :meth:`Packed.values` of the normal path's arguments,
    whatever order the launch's setters list the batch parameters in (and with one of them left out)."""
    names = ["host_idx", "dev_idx", "n", "ents", "n_ents"]
    ents, h, d = torch.arange(3), torch.arange(32), torch.arange(32)
    args = [ents, h, d, 32, 3]  # positions: ents 0, host_idx 1, dev_idx 2, n 3, n_ents 4
    pos = {"ents": 0, "host_idx": 1, "dev_idx": 2, "n": 3, "n_ents": 4}
    setters = tuple((pos[names[i]], None, names[i] in ("host_idx", "dev_idx", "ents")) for i in order)
    packed = types.SimpleNamespace(setters=setters, values=lambda a: drvlaunch.Packed.values(packed, a))
    st = replay_mod.step((None, packed), None, args, (1, 2, 3), programs=8, tokens=16, per_tile=1, fallback={})
    b = replay_mod.Batch(h, 0, h.data_ptr(), d, 0, d.data_ptr(), 0, h, d, 32, (), (h.data_ptr(), d.data_ptr(), 32))
    _, grid, values = replay_mod._resolve(st, b)
    assert values == packed.values(args) and grid == 2


def test_every_operation_replays_through_its_lane(monkeypatch):
    """``backup_layer``, ``load_all_layers`` and ``backup_all_layers`` take their direction's lane too, and launch
    byte for byte what the normal path launches."""
    w = World(monkeypatch, "page_first")
    h, d = _idx(14)
    calls = [lambda: w.pool.backup_layer(2, h, d), lambda: w.pool.load_all_layers(h, d),
             lambda: w.pool.backup_all_layers(h, d), lambda: w.pool.load_layer(3, h, d)]
    def checked(*a, **k):
        raise AssertionError("a lane call reached the pool's checks")

    for call in calls:
        call()
        call()
        start = len(w.lib.launches)
        w.pool._check = checked  # an instance attribute over the method
        try:
            assert _replayed(w, call)  # through the lane: the pool's checks were made by the calls before
        finally:
            del w.pool._check
        replayed = w.lib.launches[start:]
        replay_mod.set_replay(False)
        start = len(w.lib.launches)
        assert not _replayed(w, call)
        assert w.lib.launches[start:] == replayed and replayed
        replay_mod.set_replay(True)


@pytest.mark.skipif(claunch.module() is None, reason="no compiled launch call here (no C compiler or Python headers)")
@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_the_compiled_call_launches_what_ctypes_launches_and_writes_nothing_shared(monkeypatch, layout):
    """Bursts through the compiled call and through ctypes: byte-identical launches, replayed or not; the compiled
    call never writes a packed launch's shared parameter storage (so threads need no lock around it)."""
    w = World(monkeypatch, layout)
    (h1, d1), (h2, d2) = _idx(15), _idx(16)
    w.burst(h1, d1)
    w.burst(h1, d1)
    packs = [st.packed for steps in w.replays._steps.values() for st in steps]
    assert packs and all(p.fast is not None for p in packs)
    stored = [tuple(o.value for o in p.objs) for p in packs]
    compiled = [w.burst(h1, d1), w.burst(h2, d2)]
    assert [tuple(o.value for o in p.objs) for p in packs] == stored  # the stack copies took the new values
    claunch.set_c_launch(False)
    try:
        through_ctypes = [w.burst(h1, d1), w.burst(h2, d2)]
        assert [tuple(o.value for o in p.objs) for p in packs] != stored  # (ctypes writes them, under the lock)
    finally:
        claunch.set_c_launch()
    assert compiled == through_ctypes and all(compiled)
    assert len({body for *_rest, body in compiled[0]} - {body for *_rest, body in compiled[1]}) > 0


def test_the_compiled_call_is_built_with_the_pool_not_in_its_first_transfer(monkeypatch, tmp_path):
    monkeypatch.setattr(claunch, "_MOD", [])
    monkeypatch.setenv(claunch.ENV_CACHE_DIR, str(tmp_path))
    w = World(monkeypatch, "layer_first")
    assert claunch._MOD and w.lib.launches == []  # asked for (built, or found unbuildable) before any launch
    assert (claunch._MOD[0] is not None) == bool(list(tmp_path.rglob("_hicache_claunch*")))


def test_resolved_launches_belong_to_the_current_batch_only(monkeypatch):
    """A layer's launches are resolved once per batch (grid and parameter values); a new batch drops the last
    batch's (they would keep its index tensors alive), and a batch never launches another batch's values."""
    w = World(monkeypatch, "layer_first")
    h, d = _idx(13)
    w.burst(h, d)
    w.burst(h, d)
    replayed = w.burst(h, d)
    ready = w.replays._ready[False]
    assert set(ready) == set(w.layers) and all(r[0] is w.replays._batches[False] for r in ready.values())
    stale = ready[w.layers[1]]
    h2, d2 = _idx(14)
    assert _replayed(w, lambda: w.pool.load_layer(w.layers[0], h2, d2))
    ready = w.replays._ready[False]
    assert set(ready) == {w.layers[0]} and ready[w.layers[0]][0] is w.replays._batches[False]
    assert w.replays._ready[True] and all(r[0] is w.replays._batches[True] for r in w.replays._ready[True].values())
    # a thread still running the first batch (it matched before the second replaced it) launches it, but does not
    # store its resolution where the second batch's live (it would keep the first batch's tensors alive)
    assert w.replays.run(stale[0], w.layers[2], False) and w.layers[2] not in w.replays._ready[False]
    # an entry resolved for another batch (stored by a thread that lost a race) is never used: resolved again
    w.replays._ready[False][w.layers[1]] = stale
    start = len(w.lib.launches)
    assert _replayed(w, lambda: w.pool.load_layer(w.layers[1], h2, d2))
    _forget(w)
    assert w.pool.load_layer(w.layers[1], h2, d2) and w.lib.launches[-1] == w.lib.launches[start]
    assert w.burst(h, d) == replayed  # and the first batch, resolved again, launches what it launched


def test_a_dropped_pool_frees_its_buffers_without_the_garbage_collector(monkeypatch):
    import gc
    import weakref

    w = World(monkeypatch, "layer_first")
    h, d = _idx(12)
    w.burst(h, d)
    w.burst(h, d)
    host = weakref.ref(next(iter(w.pool.binding.host_buffers.values())))
    gc.disable()
    try:
        w.pool = w.prep = w.replays = None
        assert host() is None  # no reference cycle through the replays
    finally:
        gc.enable()


def test_a_load_thread_and_a_backup_thread_never_mix_their_batches(monkeypatch, route):
    """An engine's load and backup threads share one pool: every launch carries one batch's host and device
    indices, never one of each."""
    import threading

    w = World(monkeypatch, "layer_first")
    (h1, d1), (h2, d2) = _idx(13), _idx(14)
    w.burst(h1, d1)
    w.burst(h2, d2)
    start = len(w.lib.launches)
    errors = []

    def loads():
        try:
            for _ in range(30):
                for layer in w.layers:
                    w.pool.load_layer(layer, h1, d1)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def backups():
        try:
            for _ in range(300):
                w.pool.backup_all_layers(h2, d2)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
    threads = [threading.Thread(target=loads), threading.Thread(target=backups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    names = w.launcher.arg_names
    ih, idv = names.index("host_idx"), names.index("dev_idx")
    pairs = set()
    for fn, *_rest, body in w.lib.launches[start:]:
        pos = w.lib.positions[fn]
        ptr = lambda i: int.from_bytes(body[pos.index(i)], "little")  # noqa: E731
        pairs.add((ptr(ih), ptr(idv)))
    assert pairs == {(h1.data_ptr(), d1.data_ptr()), (h2.data_ptr(), d2.data_ptr())}
    assert len(w.lib.launches) - start == 30 * len(w.layers) + 300


@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_first_kv_split"])
@pytest.mark.parametrize("where", ["cuda", "cpu"])
def test_gpu_replayed_bursts_move_the_right_rows(layout, where):
    """Bursts of loads with the same indices (replayed), an in-place change, another stream: bit-exact, canaries kept."""
    reg = create_registry()
    spec = SHAPES["mla61x576-bf16"](256, 16, torch.device("cuda"))
    rows = 768
    dev = {c.name: [torch.randint(0, 256, (rows, c.row_bytes), dtype=torch.uint8, device="cuda").view(c.dtype)
                    for _ in range(spec.layer_map.num_device_layers)] for c in spec.components}
    host = allocate_host_buffers(reg.layout(layout).plan(spec), pin_memory=True)
    # page loads wherever the host pages allow them, whatever the automatic floor (rowcopy_pages.AUTO_MIN_PART_BYTES)
    pool = HostKVPool(spec, layout, "kernel", dev, host_buffers=host, registry=reg, strategy_options={"pages": True})
    replays = pool.binding.scratch[pool.strategy.name].replays
    assert replays is not None
    g = torch.Generator().manual_seed(7)
    src = (torch.randperm(rows // 16, generator=g)[:8].unsqueeze(1) * 16 + torch.arange(16)).reshape(-1)
    hidx = (torch.randperm(16, generator=g)[:8].unsqueeze(1) * 16 + torch.arange(16)).reshape(-1)
    pool.backup_all_layers(hidx.cuda(), src.cuda())
    free = sorted(set(range(rows // 16)) - set((src // 16).tolist()))
    layers = list(spec.layer_map.device_layers)

    def burst(h, d, stream=None):
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())  # the index edits below run on the default stream
        with torch.cuda.stream(stream) if stream is not None else torch.cuda.device(0):
            for layer in layers:
                pool.load_layer(layer, h, d)
        torch.cuda.synchronize()

    def check(h_rows, d_rows, canary_rows):
        pos = (h_rows.cpu().unsqueeze(1) == hidx.unsqueeze(0)).nonzero()[:, 1].cuda()  # h_rows[i] == hidx[pos[i]]
        for name, lst in dev.items():
            for layer in layers:
                t = lst[layer].view(torch.uint8)
                assert torch.equal(t[d_rows], t_src[name][layer][pos]), (name, layer)
                assert torch.equal(t[canary_rows], canaries[name][layer]), (name, layer)

    t_src = {name: [lst[layer].view(torch.uint8)[src.cuda()].clone() for layer in layers] for name, lst in dev.items()}
    for round_, stream in ((0, None), (1, None), (2, torch.cuda.Stream())):
        pages = torch.tensor(free[round_ * 8:(round_ + 1) * 8])
        d_rows = (pages.unsqueeze(1) * 16 + torch.arange(16)).reshape(-1)
        canary_pages = torch.tensor(free[-4:])
        canary_rows = ((canary_pages.unsqueeze(1) * 16 + torch.arange(16)).reshape(-1)).cuda()
        for lst in dev.values():
            for layer in layers:
                lst[layer].view(torch.uint8)[canary_rows] = 0xA5
        canaries = {name: [lst[layer].view(torch.uint8)[canary_rows].clone() for layer in layers]
                    for name, lst in dev.items()}
        h = hidx.clone() if where == "cpu" else hidx.cuda()
        d = d_rows.clone() if where == "cpu" else d_rows.cuda()
        before = replays.hits
        burst(h, d, stream)
        burst(h, d, stream)
        # the second burst at least, recorded by the first (but for a layer whose first call compiled the kernel)
        assert replays.hits - before >= len(layers) - 1
        check(hidx, d_rows.cuda(), canary_rows)
        h[:16] = h[16:32].clone()  # in place: the next burst must read the new indices
        h[16:32] = (hidx[:16]).to(h.device)
        burst(h, d, stream)
        check(h.cpu(), d_rows.cuda(), canary_rows)


@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_gpu_replays_on_either_side_of_the_tma_row_limit(monkeypatch):
    """Token-major host rows with the automatic TMA row limit scaled down to 64: calls of 64 rows (TMA) and of 128
    (row kernel) alternate, each replayed from its own steps, bit-exact against the rows backed up."""
    from hicache_core import rowcopy_tma

    monkeypatch.delenv("HICACHE_KERNEL_TMA", raising=False)
    monkeypatch.setattr(rowcopy_tma, "AUTO_MAX_STRIDED_ROWS", 64)
    reg = create_registry()
    spec = SHAPES["mla61x576-bf16"](256, 16, torch.device("cuda"))
    rows = 512
    dev = {c.name: [torch.randint(0, 256, (rows, c.row_bytes), dtype=torch.uint8, device="cuda").view(c.dtype)
                    for _ in range(spec.layer_map.num_device_layers)] for c in spec.components}
    pool = HostKVPool(spec, "page_first", "kernel", dev, registry=reg)
    prep = pool.binding.scratch[pool.strategy.name]
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("automatic TMA loads need compute capability 9.x")
    assert prep.tma_rows == (64,) and prep.replays.splits == (64,)
    g = torch.Generator().manual_seed(8)
    hidx = (torch.randperm(16, generator=g)[:8].unsqueeze(1) * 16 + torch.arange(16)).reshape(-1).cuda()
    src = (torch.randperm(8, generator=g).unsqueeze(1) * 16 + torch.arange(16)).reshape(-1).cuda()  # rows 0..127
    pool.backup_all_layers(hidx, src)
    layers = list(spec.layer_map.device_layers)
    name = next(iter(dev))
    want = [dev[name][layer].view(torch.uint8)[src].clone() for layer in layers]
    small = (hidx[:64], (torch.arange(64) + 256).cuda())  # 64 rows: TMA
    large = (hidx, (torch.arange(128) + 384).cuda())  # 128 rows: the row kernel
    before = prep.replays.hits
    for round_ in range(4):
        if round_ == 2:  # recorded by now on both sides (a first call that compiles records nothing)
            before = prep.replays.hits
        for (h, d), cut in ((small, 64), (large, 128)):
            for layer in layers:
                dev[name][layer].view(torch.uint8)[d] = 0
            for layer in layers:
                pool.load_layer(layer, h, d)
            torch.cuda.synchronize()
            for layer in layers:
                assert torch.equal(dev[name][layer].view(torch.uint8)[d], want[layer][:cut]), (cut, layer)
    assert prep.replays.hits - before == 4 * len(layers)  # the last two rounds replay every call on both sides


@pytest.mark.parametrize("swap", ["strided view", "int32 view"])
def test_a_data_swap_to_another_view_at_the_same_address_is_not_replayed(monkeypatch, swap):
    """``t.data = view`` where the view starts at the same address with the same length (``store[::2]`` for
    ``store[:n]``, or the int32 view of an int64 tensor) keeps identity, version, address and length: the batch
    compares dtype and strides too, so the call is checked and copied again, never replayed from the old reading."""
    from hicache_core.errors import DuplicateIndexError

    w = World(monkeypatch, "layer_first")
    h, _ = _idx(16)
    n = h.numel()
    store = torch.arange(2 * n) + 16  # store[:n] and store[::2] both name distinct rows in range
    view = store[:n]
    for _ in range(2):
        w.burst(h, view)
    assert _replayed(w, lambda: w.pool.load_layer(1, h, view))
    version, before = view._version, len(w.lib.launches)
    if swap == "strided view":
        view.data = store.as_strided((n,), (2,), 0)
        assert view._version == version and view.data_ptr() == store.data_ptr() and view.numel() == n
        assert not _replayed(w, lambda: w.pool.load_layer(1, h, view))
        assert len(w.lib.launches) > before  # launched by the normal path, which reads the strided values
    else:
        view.data = store.view(torch.int32)[:n]  # each int64 value's low and high halves: row 0 repeats
        assert view._version == version and view.numel() == n
        with pytest.raises(DuplicateIndexError):
            w.pool.load_layer(1, h, view)
        assert len(w.lib.launches) == before  # refused before any launch, replayed or not
