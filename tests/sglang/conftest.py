"""Fixtures for the SGLang bridge tests: SGLang's real pool classes, on CPU or on a GPU.

The whole directory is skipped when sglang is not installed.  Device pools live
on CUDA when it is present (``HICACHE_SGLANG_TEST_DEVICE`` overrides); without
it Triton kernels run under the interpreter.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed (tests/sglang/install.sh)", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
import sglang_harness as H  # noqa: E402

H.prepare()  # import stubs first: on a GPU without sgl_kernel / IPython, sglang imports only through them
pytest.importorskip("sglang")


_INHERITED = object()


def _target_owner(target: str):
    import pkgutil

    owner, attr = target.rsplit(".", 1)
    return pkgutil.resolve_name(owner), attr


@pytest.fixture
def sglang_hooks():
    """Snapshot SGLang's hook registry and the hooked class attributes; restore them afterwards."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from hicache_core.integrations.sglang import AFTER_TARGETS, HOOK_TARGETS

    saved = {t: _target_owner(t) for t in (*HOOK_TARGETS, *AFTER_TARGETS)}
    # an inherited method (MLATokenToKVPoolHost.destroy) is not in the class's own dict: deleted again afterwards
    attrs = {t: owner.__dict__.get(attr, _INHERITED) for t, (owner, attr) in saved.items()}
    hooks = {k: list(v) for k, v in HookRegistry._hooks.items()}
    patched = set(HookRegistry._patched)
    yield HookRegistry
    for t, (owner, attr) in saved.items():
        if attrs[t] is not _INHERITED:
            setattr(owner, attr, attrs[t])
        elif attr in owner.__dict__:
            delattr(owner, attr)
    HookRegistry._hooks.clear()
    HookRegistry._hooks.update(hooks)
    HookRegistry._patched.clear()
    HookRegistry._patched.update(patched)


@pytest.fixture
def hooked(sglang_hooks, monkeypatch):
    """Our hooks applied (mode ``all``), undone after the test."""
    from hicache_core.integrations.sglang import load_plugin

    monkeypatch.setenv("HICACHE_SGLANG", "all")
    load_plugin()
    return sglang_hooks


@pytest.fixture
def stock_kernels(monkeypatch):
    """Pretend SGLang's stock kernels are importable (CPU): stock cells are then left to SGLang, whose
    original raises its CPU ``NameError`` -- proof that the call was not ours."""
    if torch.cuda.is_available():
        pytest.skip("CPU-only: SGLang's NameError proves which side served the call")
    from hicache_core.integrations.sglang import mode

    monkeypatch.setattr(mode, "stock_kernels_available", lambda kind: True)
