"""The oracle of the bridge tests: SGLang's host tensors indexed the way SGLang indexes them."""

from __future__ import annotations

import os

import pytest
import torch

CANARY = 0xA5
KERNEL_SKIP = "kernel io needs CUDA or TRITON_INTERPRET=1"


def host_tensors(host) -> list[torch.Tensor]:
    """Every host tensor SGLang holds for ``host``'s rows (MLA kv_split: latent then rope)."""
    if hasattr(host, "index_k_with_scale_buffer"):
        return [host.index_k_with_scale_buffer]
    if host.layout == "page_first_kv_split" and hasattr(host, "kv_lora_rank"):
        return [t for t in (host.k_buffer, host.v_buffer) if t is not None]
    return [host.kv_buffer]


def fill_canary(host) -> list[torch.Tensor]:
    """Fill every host tensor with canary bytes; return clones to build the expectation in."""
    out = []
    for t in host_tensors(host):
        t.view(torch.uint8).fill_(CANARY)
        out.append(t.clone())
    return out


def layer_views(kind: str, layout: str, tensors: list[torch.Tensor], hl: int, h: torch.Tensor, ps: int):
    """Slot-indexable views of host layer ``hl`` in ``tensors`` (SGLang's shapes) and the index for slots ``h``."""
    page, off = h // ps, h % ps
    if kind == "dsa_indexer":
        (t,) = tensors
        return [t[hl] if layout == "layer_first" else t[:, hl, 0]], (h,)
    parts = [tensors[0][0], tensors[0][1]] if kind == "mha" else tensors  # MHA kv_buffer = (2, ...)
    if layout in ("layer_first", "page_first"):
        sel = [p[hl] if layout == "layer_first" else p[:, hl] for p in parts]
        return sel, (h,)
    return [p[:, hl] for p in parts], (page, off)


def write_rows(views: list[torch.Tensor], index: tuple, rows: list[torch.Tensor]) -> None:
    """``views[index] = rows``; one MLA row over several views (kv_split) is split by the views' widths."""
    if len(rows) == 1 and len(views) > 1:
        flat = rows[0].reshape(rows[0].shape[0], -1)
        rows, start = [], 0
        for v in views:
            w = v.shape[-1]
            rows.append(flat[:, start : start + w])
            start += w
    for v, r in zip(views, rows):
        v[index] = r.reshape(v[index].shape).to(v.device)  # host views on the CPU, rows maybe on the GPU


def read_rows(views: list[torch.Tensor], index: tuple) -> torch.Tensor:
    """Rows at ``index`` of ``views``, concatenated per token as bytes."""
    return torch.cat([v[index].reshape(v[index].shape[0], -1).view(torch.uint8) for v in views], dim=1)


def settle() -> None:
    """Wait for queued GPU work before the host reads host rows.

    Transfers only enqueue work (SGLang's cache controller waits on an event
    before it trusts host bytes); a test that reads host memory right after a
    backup must wait too.  On the CPU transfers are synchronous.
    """
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality of two tensors wherever they live (host rows vs device rows on a GPU)."""
    a, b = a.contiguous().view(torch.uint8).cpu(), b.contiguous().view(torch.uint8).cpu()
    return a.shape == b.shape and torch.equal(a, b)


def placed(io_backend: str, host_indices: torch.Tensor, device_indices: torch.Tensor, device: str):
    """Indices where SGLang's cache controller puts them (``HiCacheController.move_indices``):
    ``kernel`` -> both on the device, ``direct`` -> both on the CPU."""
    if io_backend == "kernel":
        return host_indices.to(device), device_indices.to(device)
    return host_indices.cpu(), device_indices.cpu()


def kernel_available(layout: str, sharded: bool) -> str | None:
    """``None`` when a ``kernel`` strategy is registered for the key and can run here, else a skip reason."""
    from hicache_core import create_registry

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return KERNEL_SKIP
    if not create_registry().candidates(layout, "kernel", sharded):
        return f"no kernel strategy is registered for ({layout}, kernel, sharded={sharded})"
    return None


def refuse_hicache_kernel(monkeypatch) -> None:
    """hicache's ``kernel`` pools raise ResolutionError when built (standing in for a host without Triton); the
    bridge's decisions are made again."""
    from hicache_core.errors import ResolutionError
    from hicache_core.integrations.sglang import adapter, hooks

    real = adapter.HostKVPool

    def refusing(spec, layout, io_backend, *args, **kwargs):  # type: ignore[no-untyped-def]
        if io_backend == "kernel":
            raise ResolutionError("kernel: cannot run here (stood in for a host without Triton)")
        return real(spec, layout, io_backend, *args, **kwargs)

    monkeypatch.setattr(adapter, "HostKVPool", refusing)
    hooks._decided.clear()


def sglangs_own_op(name: str):
    """``pytest.raises`` for a call that SGLang's own code serves, ending in its kvcacheio op ``name``.  Proof on either
    machine: on the CPU SGLang leaves the op unbound (``NameError``); on a GPU the tests stand a strict import stub in
    for ``sgl_kernel`` (sglang_harness.prepare), whose call raises a RuntimeError naming the op."""
    if torch.cuda.is_available():
        return pytest.raises(RuntimeError, match=rf"kvcacheio\.{name} is an import stub")
    return pytest.raises(NameError, match=name)
