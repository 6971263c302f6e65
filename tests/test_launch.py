"""hicache_core.launch: the compiled-handle shortcut must never launch a kernel specialised for other arguments."""

from __future__ import annotations

import types

import pytest
import torch

from hicache_core import launch as launch_mod
from hicache_core import LayerMap, PoolSpec
from hicache_core.launch import Launcher, launch_key, set_fast_launch


class FakeCompiled:
    def __init__(self, log: list, key: tuple) -> None:
        self.log, self.key = log, key
        self.function, self.packed_metadata = object(), object()

    def run(self, g0, g1, g2, stream, function, packed, meta, enter, exit_, *args):
        assert (g1, g2, function, packed, meta, enter, exit_) == (1, 1, self.function, self.packed_metadata,
                                                                    None, None, None)
        self.log.append(("fast", self.key, g0, stream, args))


class FakeKernel:
    """Records public launches; each returns a compiled handle tagged with the launch's arguments."""

    arg_names = ["ptr", "n", "WIDTH"]
    constexprs = [2]

    def __init__(self) -> None:
        self.log: list = []

    def __getitem__(self, grid):
        def launch(*args, num_warps, **opts):
            self.log.append(("public", grid[0], args, num_warps, *opts.items()))
            return FakeCompiled(self.log, (args, num_warps))
        return launch


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("HICACHE_FAST_LAUNCH", raising=False)
    kernel = FakeKernel()
    launcher = Launcher(kernel)
    launcher._api = (lambda: 0, lambda device: 777, types.SimpleNamespace(launch_enter_hook=None,
                                                                          launch_exit_hook=None))
    saved = launch_mod._ENABLED[0]
    assert set_fast_launch(True)
    yield kernel, launcher
    launch_mod._ENABLED[0] = saved


def test_second_launch_with_same_key_uses_compiled_handle(fast):
    kernel, launch = fast
    buf = torch.zeros(64, dtype=torch.int32)
    launch(4, (buf, 100, 8), num_warps=4)
    launch(5, (buf, 101, 8), num_warps=4)  # same traits: 100 and 101 are both non-multiples of 16 but 101 != 1
    assert [e[0] for e in kernel.log] == ["public", "fast"]
    assert kernel.log[1][2:4] == (5, 777) and kernel.log[1][4] == (buf, 101, 8)


def test_register_cap_is_passed_and_keyed(fast):
    """``maxnreg`` reaches Triton's launch, and a launch with another cap never reuses a compiled handle."""
    kernel, launch = fast
    buf = torch.zeros(64, dtype=torch.int32)
    launch(4, (buf, 100, 8), num_warps=4, maxnreg=64)
    launch(4, (buf, 100, 8), num_warps=4, maxnreg=64)
    launch(4, (buf, 100, 8), num_warps=4, maxnreg=32)
    launch(4, (buf, 100, 8), num_warps=4)
    assert [e[0] for e in kernel.log] == ["public", "fast", "public", "public"]
    assert kernel.log[0][4:] == (("maxnreg", 64),) and kernel.log[2][4:] == (("maxnreg", 32),)
    assert kernel.log[3][4:] == ()


def test_bind_takes_values_by_parameter_name(fast):
    kernel, launch = fast
    assert launch.bind({"WIDTH": 8, "n": 3, "ptr": "p", "unused": 1}) == ("p", 3, 8)
    assert launch.positions(["WIDTH", "absent", "ptr"]) == (0, 2)
    with pytest.raises(TypeError, match="'n'"):
        launch.bind({"ptr": "p", "WIDTH": 8})


@pytest.mark.parametrize("change", ["unaligned", "dtype", "constexpr", "warps", "int_one", "int_mult16", "int64"])
def test_any_specialisation_change_goes_public(fast, change):
    kernel, launch = fast
    buf = torch.zeros(64, dtype=torch.int32)
    args, warps = (buf, 100, 8), 4
    launch(1, args, num_warps=warps)
    new = {
        "unaligned": ((buf[1:], 100, 8), 4),
        "dtype": ((buf.view(torch.float32), 100, 8), 4),
        "constexpr": ((buf, 100, 16), 4),
        "warps": ((buf, 100, 8), 8),
        "int_one": ((buf, 1, 8), 4),
        "int_mult16": ((buf, 96, 8), 4),
        "int64": ((buf, 2**40 + 3, 8), 4),
    }[change]
    launch(1, new[0], num_warps=new[1])
    assert [e[0] for e in kernel.log] == ["public", "public"]


def test_disabled_by_env_and_by_hooks(fast, monkeypatch):
    kernel, launch = fast
    buf = torch.zeros(64, dtype=torch.int32)
    monkeypatch.setenv("HICACHE_FAST_LAUNCH", "0")
    assert not set_fast_launch(None)
    launch(1, (buf, 3, 8), num_warps=4)
    launch(1, (buf, 3, 8), num_warps=4)
    monkeypatch.delenv("HICACHE_FAST_LAUNCH")
    assert set_fast_launch(None)
    launch._api[2].launch_enter_hook = print  # a profiler hooked the public path
    launch(1, (buf, 3, 8), num_warps=4)
    launch(1, (buf, 3, 8), num_warps=4)
    assert [e[0] for e in kernel.log] == ["public"] * 4


def test_empty_hook_chain_is_no_hook(fast):
    """Triton >= 3.4 keeps an empty ``HookChain`` (``.calls == []``) instead of ``None``."""
    kernel, launch = fast
    launch._api[2].launch_enter_hook = types.SimpleNamespace(calls=[])
    launch._api[2].launch_exit_hook = types.SimpleNamespace(calls=[])
    buf = torch.zeros(64, dtype=torch.int32)
    launch(1, (buf, 3, 8), num_warps=4)
    launch(1, (buf, 3, 8), num_warps=4)
    assert [e[0] for e in kernel.log] == ["public", "fast"]


def test_static_key_checks_only_dynamic_positions(fast):
    kernel, launch = fast
    buf = torch.zeros(64, dtype=torch.int32)
    static = launch.static_key((buf, None, 8), dynamic=(1,))
    launch(1, (buf, 100, 8), num_warps=4, static_key=static, dynamic=(1,))
    launch(1, (buf, 101, 8), num_warps=4, static_key=static, dynamic=(1,))
    launch(1, (buf, 96, 8), num_warps=4, static_key=static, dynamic=(1,))  # multiple of 16: other kernel
    assert [e[0] for e in kernel.log] == ["public", "fast", "public"]
    assert static != launch.static_key((buf, None, 16), dynamic=(1,))


def test_wrong_argument_count_is_a_clear_error(fast):
    _, launch = fast
    with pytest.raises(TypeError, match="expected 3 arguments"):
        launch(1, (torch.zeros(4),), num_warps=4)


def test_key_is_value_for_constexprs_and_traits_otherwise():
    a = torch.zeros(8, dtype=torch.int64)
    k1 = launch_key((a, 17, 3), frozenset({2}), 4, 0)
    assert k1 == launch_key((a.clone(), 33, 3), frozenset({2}), 4, 0)
    assert k1 != launch_key((a, 17, 4), frozenset({2}), 4, 0)
    assert k1 != launch_key((a, 17, 3), frozenset({2}), 4, 1)


def test_index_memo_copies_once_and_sees_in_place_changes():
    from hicache_core.kernel_support import IndexMemo, kernel_indices

    memo, meta = IndexMemo(), torch.device("meta")  # "meta" stands in for the GPU on a CPU machine
    idx = torch.arange(8)
    first = kernel_indices(idx, meta, memo)
    assert first.device == meta and kernel_indices(idx, meta, memo) is first
    idx[0] = 3  # in place: the version counter moves, so the copy is made again
    assert kernel_indices(idx, meta, memo) is not first
    assert kernel_indices(idx.clone(), meta, memo) is not kernel_indices(idx, meta, memo)
    strided = torch.arange(16)[::2]
    assert kernel_indices(strided, meta, memo).is_contiguous()
    with torch.inference_mode():
        frozen = torch.arange(8)
    assert kernel_indices(frozen, meta, memo) is not kernel_indices(frozen, meta, memo)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="streams need CUDA")
def test_index_memo_is_per_stream():
    from hicache_core.kernel_support import IndexMemo, kernel_indices

    memo, cuda = IndexMemo(), torch.device("cuda")
    idx = torch.arange(8).pin_memory()
    first = kernel_indices(idx, cuda, memo)
    assert kernel_indices(idx, cuda, memo) is first
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        other = kernel_indices(idx, cuda, memo)
    side.synchronize()
    assert other is not first and torch.equal(other.cpu(), idx)


def test_int64_and_uint64_are_other_specialisations(fast):
    """Triton passes an int that fits int64 as i64 and a larger one as u64: never one compiled handle for both."""
    kernel, launch = fast
    buf = torch.zeros(64, dtype=torch.int32)
    launch(1, (buf, 2**40 + 3, 8), num_warps=4)
    launch(1, (buf, 2**63 + 3, 8), num_warps=4)
    launch(1, (buf, 2**40 + 5, 8), num_warps=4)
    assert [e[0] for e in kernel.log] == ["public", "public", "fast"]


def test_kernels_decline_rocm_devices(monkeypatch):
    """On ROCm (``torch.version.hip``) registered host memory has a device address of its own, which the kernels do
    not use: they decline the pool (``auto`` and the SGLang bridge then use the copy engine)."""
    import hicache_core.kernel_support as ks

    pytest.importorskip("triton")
    spec = types.SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.setattr(ks.torch.version, "hip", None, raising=False)
    assert ks.kernel_unsupported_reason(spec) is None  # type: ignore[arg-type]
    monkeypatch.setattr(ks.torch.version, "hip", "6.2.0", raising=False)
    assert "ROCm" in (ks.kernel_unsupported_reason(spec) or "")  # type: ignore[arg-type]


@pytest.mark.parametrize("setter, env, state", [
    ("set_fast_launch", "HICACHE_FAST_LAUNCH", "_ENABLED"),
    ("set_driver_launch", "HICACHE_DRIVER_LAUNCH", "_DRIVER"),
    ("set_c_launch", "HICACHE_C_LAUNCH", "_ON"),
])
@pytest.mark.parametrize("bad", ["0", "off", 0.0, [False]])
def test_launch_switches_refuse_what_is_not_a_switch(monkeypatch, setter, env, state, bad):
    """``set_driver_launch("0")`` would be truthy and turn the switch on: refused, naming the argument and the
    environment variable for text, the state unchanged."""
    from hicache_core import claunch as claunch_mod

    mod = claunch_mod if setter == "set_c_launch" else launch_mod
    monkeypatch.setattr(mod, state, ["unchanged"])
    with pytest.raises(TypeError, match=rf"{setter}\(enabled\) must be True, False or None .*{env}"):
        getattr(mod, setter)(bad)
    assert getattr(mod, state) == ["unchanged"]
    assert getattr(mod, setter)(False) is False


@pytest.mark.parametrize("version, refused", [("3.6.0", True), ("3.6.1+git1234", True), ("3.7.0", False),
                                              ("3.9.0", False), ("4.0", False), ("nightly", False)])
def test_an_interpreter_too_old_for_the_kernels_is_refused_with_the_fix(monkeypatch, version, refused):
    """Triton 3.6's CPU interpreter fails in the kernels' persistent loops: a CPU pool under TRITON_INTERPRET=1 is
    refused with the fix instead of failing at its first transfer (read from the install metadata, no import)."""
    import importlib.metadata

    from hicache_core import kernel_support as ks

    monkeypatch.setattr(importlib.metadata, "version", lambda name: version)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ks.interpreter_problem.cache_clear()
    try:
        spec = PoolSpec.mha(layer_map=LayerMap.unsharded(1), head_num=1, head_dim=8, dtype=torch.float16, page_size=4,
                            capacity=8)
        why = ks.kernel_unsupported_reason(spec)
        if refused:
            assert why == (f"Triton {version}'s CPU interpreter cannot run the kernels (it fails in their persistent "
                           "loops); install triton>=3.7 for TRITON_INTERPRET=1 on CPU, or use the direct io_backend")
        elif importlib.util.find_spec("triton") is not None:
            assert why is None
    finally:
        ks.interpreter_problem.cache_clear()


def test_interpreted_launches_take_turns_and_compiled_ones_never_wait(monkeypatch):
    """Triton's CPU interpreter keeps a launch's grid in process-wide state: two threads' launches at once failed
    ('x >= grid_dim[0]') or moved wrong bytes. Interpreted launches hold one lock; others never touch it."""
    import threading

    class Recording:
        def __init__(self) -> None:
            self.lock, self.held = threading.Lock(), []

        def __enter__(self) -> None:
            self.lock.acquire()
            self.held.append(True)

        def __exit__(self, *exc: object) -> None:
            self.lock.release()

    kernel = FakeKernel()
    launcher = Launcher(kernel)
    launcher._api = None  # the public path, as under the interpreter
    recording = Recording()
    monkeypatch.setattr(launch_mod, "_INTERPRETER_LOCK", recording)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launcher(4, (object(), 3, 8), num_warps=1)
    assert recording.held == [True] and kernel.log[-1][:2] == ("public", 4)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    launcher(4, (object(), 3, 8), num_warps=1)
    assert recording.held == [True] and len(kernel.log) == 2  # compiled: launched without the lock
