"""Fakes shared by test modules (tests/conftest.py puts this directory on ``sys.path``; the suite imports test
modules with ``--import-mode=importlib``, so they cannot import one another)."""

from __future__ import annotations

from typing import Any


class FakeEvent:
    """A timing event whose end lands when the test says (``done``), ``ms`` after its start."""

    def __init__(self, log: list, done: list, ms: list) -> None:
        self.log, self.done, self.ms = log, done, ms

    def record(self, stream: object) -> None:
        self.log.append(stream)

    def query(self) -> bool:
        return self.done[0]

    def elapsed_time(self, other: "FakeEvent") -> float:
        return self.ms[0]


def check_moved_generation_drops_the_pick(auto, generation: str, binding, h, d) -> None:  # type: ignore[no-untyped-def]
    """A pick of ``auto`` decided while ``generation`` (``_pace_gen``, ``_watch_gen``) moved, as another thread's call
    seeing a new measure or verdict moves it, is not memoised; the same pick decided undisturbed is."""
    from hicache_core.backends.auto_rules import pick_key

    step = auto._decide

    def moving(*args, **kwargs):  # type: ignore[no-untyped-def]
        pick = step(*args, **kwargs)
        value = getattr(auto, generation)
        if isinstance(value, list):  # by direction: the loads' (the pick below is a load's)
            value[0] += 1
        else:
            setattr(auto, generation, value + 1)
        return pick

    auto._decide = moving
    auto.pick(binding, h, d, 1, to_host=False)
    assert pick_key(h, d, 1, False) not in auto._picks
    auto._decide = step
    auto.pick(binding, h, d, 1, to_host=False)
    assert pick_key(h, d, 1, False) in auto._picks


def auto_over(pool, paces, **options):  # type: ignore[no-untyped-def]
    """An ``auto`` strategy choosing between ``pool``'s strategy (as its copy engine) and a stand-in kernel, with the
    calibration's shipped values and ``paces.paces`` (a test's host paces on a fake clock; ``None``: none)."""
    from hicache_core.backends.auto import AutoStrategy
    from hicache_core.calibration import DEFAULT

    auto = AutoStrategy(**options)
    auto.direct, auto.kernel, auto.calibration = pool.strategy, object(), DEFAULT
    auto.paces = paces.paces if paces is not None else None
    return auto


def pool_device(backend: str) -> str:
    """Where a test builds a pool served by ``backend``: a kernel pool on the GPU where there is one (a CPU pool's
    kernel runs only in Triton's interpreter, which the repository's conftest.py turns on only where CUDA is missing),
    any other pool on the CPU."""
    import torch

    return "cuda" if backend == "kernel" and torch.cuda.is_available() else "cpu"


def odd_stride_layout() -> object:
    """``layer_first`` with each row's one chunk given ``chunk_stride=3`` (a plan written for several heads, used with
    one): the same bytes in the same places, a stride no step ever takes. Registered as ``layer_first_odd_stride``."""
    return readdressed_layer_first("layer_first_odd_stride", lambda a, width: {"chunk_stride": 3})


def chunked_rows_layout(pieces: int, stride_zero: bool) -> object:
    """``layer_first`` with each row described as ``pieces`` chunks that follow each other (``chunk_stride`` equal to
    ``chunk_bytes``, or 0 when ``stride_zero``): the same bytes in the same places, a contiguous row in several chunks.
    Registered as ``layer_first_chunked``."""
    return readdressed_layer_first("layer_first_chunked", lambda a, width: {
        "chunk_bytes": width // pieces, "chunk_stride": 0 if stride_zero else width // pieces})


def readdressed_layer_first(name: str, change: Any) -> object:
    """``layer_first`` registered as ``name``, each segment's Addressing replaced with ``change(addressing, width)``'s
    fields."""
    from dataclasses import replace

    from hicache_core import HostPlan, PoolSpec
    from hicache_layer_first.layout import LayerFirstLayout

    class Readdressed(LayerFirstLayout):
        def plan(self, spec: PoolSpec) -> HostPlan:
            base = super().plan(spec)
            return HostPlan(base.buffers, tuple(
                replace(seg, addressing=replace(seg.addressing, **change(seg.addressing, seg.width)))
                for seg in base.segments))

    Readdressed.name = name
    return Readdressed()


def give_replays(pool):  # type: ignore[no-untyped-def]
    """``pool`` (a kernel strategy's) with replays and lanes as ``prepare()`` makes them on CUDA, recording split calls
    of both directions (for the fake driver launches of CPU tests); returns its ``Replays``."""
    from dataclasses import replace

    name = pool.strategy_name
    prep = pool.binding.scratch[name]
    rp = pool.strategy._replays(pool.binding, prep, splitting=(True, True))
    pool.binding.scratch[name] = replace(prep, replays=rp)
    pool._lanes = (pool.strategy.lane(pool.binding, False), pool.strategy.lane(pool.binding, True))
    return rp


class _NoRelaunch:
    """A driver kernel that never relaunches: a replay then takes the step's fallback (the launcher itself)."""

    pdl = False

    def relaunch(self, grid, stream, packed, values):  # type: ignore[no-untyped-def]  # noqa: ARG002
        return False


class _NoSetters:
    setters = ()


def fake_pdl_driver(monkeypatch, spy) -> None:  # type: ignore[no-untyped-def]
    """Row launches only (TMA and page loads off), PDL forced on (the CPU has none), and every launch handed to
    ``spy(launcher, grid, args, kw)`` instead of run, then reported as a driver launch (so calls record steps), with a
    current device and stream on the CPU."""
    from hicache_core import replay, rowcopy_launch
    from hicache_core.launch import Launcher

    monkeypatch.setenv("HICACHE_KERNEL_TMA", "0")
    monkeypatch.setenv("HICACHE_KERNEL_PAGES", "0")
    monkeypatch.setattr(rowcopy_launch, "dependent", lambda t, g: t.pdl)

    def reporting(self, grid, args, **kw):  # type: ignore[no-untyped-def]
        spy(self, grid, args, kw)
        return _NoRelaunch(), _NoSetters()
    monkeypatch.setattr(Launcher, "__call__", reporting)
    monkeypatch.setattr(Launcher, "driver_ready", lambda self: True)
    monkeypatch.setattr(replay, "current_device_index", lambda: 0)
    monkeypatch.setattr(replay, "current_stream_handle", lambda index: 0)


def compiled_json(script: str, cache: Any = None, timeout: int = 600) -> Any:
    """Run ``script`` (``python -c``, from the checkout's root) outside Triton's interpreter, so that it compiles real
    kernels for a GPU (Triton's bundled tools, no GPU needed), with its own Triton cache under ``cache`` where given
    (nothing left in the user's); the JSON of its last line of output.  A failing script fails the test with its
    error output."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if cache is not None:
        env["TRITON_CACHE_DIR"] = str(cache)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])
