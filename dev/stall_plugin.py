"""A pytest plugin that makes the machine look stalled, to find tests whose outcome depends on real elapsed time.

Every executed line of test code (``tests/``, ``plugins/*/tests/``, ``hicache_core/testing/``) moves the real clocks
(``time.perf_counter``, ``time.monotonic``, ``time.time``, and every ``hicache_core`` class whose ``__init__`` takes
one of them as a default) forward by ``$STALL_S`` seconds (default 1.1: past the host-pace measures' 1 s staleness).
Clocks a test injects (``now=lambda: t[0]``) stand still, so only a test that asserts something real time decides
fails.  Usage, from the repository root::

    PYTHONPATH=dev .venv/bin/python -m pytest -q -p stall_plugin tests/test_pace.py

A test that fails here and passes without the plugin reads a real clock where its assertion depends on it: give the
object a fake clock.  Tests that time something on purpose (the benchmarks' own tests only check structure) pass.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import sys
import time
from types import FrameType
from typing import Any, Callable

STALL_S = float(os.environ.get("STALL_S", "1.1"))
_offset = [0.0]
_real = {"perf_counter": time.perf_counter, "monotonic": time.monotonic, "time": time.time}


def _stalled(name: str) -> Callable[[], float]:
    real = _real[name]

    def clock() -> float:
        return real() + _offset[0]

    clock.__name__ = name
    return clock


_clocks = {name: _stalled(name) for name in _real}
_TEST_DIRS = tuple(os.sep + d + os.sep for d in ("tests", os.path.join("hicache_core", "testing")))


def _is_test_code(filename: str) -> bool:
    return any(d in filename for d in _TEST_DIRS) and os.sep + ".venv" + os.sep not in filename


def _line(frame: FrameType, event: str, arg: Any) -> Any:
    if event == "line":
        _offset[0] += STALL_S
    return _line


def _call(frame: FrameType, event: str, arg: Any) -> Any:
    return _line if event == "call" and _is_test_code(frame.f_code.co_filename) else None


def _patch_defaults() -> list[str]:
    """Point every ``__init__`` default that is a real clock, in every ``hicache_core`` module, at its stalled clock."""
    import hicache_core

    swap = {id(real): _clocks[name] for name, real in _real.items()}
    patched = []
    for info in pkgutil.walk_packages(hicache_core.__path__, "hicache_core."):
        try:
            module = importlib.import_module(info.name)
        except Exception:  # a module that needs a GPU or an optional package: its clocks are not reached on CPU
            continue
        for cls in vars(module).values():
            init = getattr(cls, "__init__", None) if inspect.isclass(cls) and cls.__module__ == info.name else None
            defaults = getattr(init, "__defaults__", None)
            if init is not None and defaults and any(id(d) in swap for d in defaults):
                init.__defaults__ = tuple(swap.get(id(d), d) for d in defaults)
                patched.append(f"{info.name}.{cls.__name__}")
    return patched


def pytest_configure(config: Any) -> None:
    config.stall_plugin_patched = _patch_defaults()  # first: a module imported later would bind a stalled default
    for name, clock in _clocks.items():
        setattr(time, name, clock)


def pytest_report_header(config: Any) -> str:
    return f"stall_plugin: +{STALL_S:g} s per test line; clock defaults of {', '.join(config.stall_plugin_patched)}"


def pytest_runtest_call(item: Any) -> None:
    sys.settrace(_call)


def pytest_runtest_teardown(item: Any) -> None:
    sys.settrace(None)
