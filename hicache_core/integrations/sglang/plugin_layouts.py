"""Every layout of the hicache registry selectable through SGLang's ``--hicache-mem-layout``.

SGLang 0.5.23 declares the argument with fixed choices and its host pools'
``init_kv_buffer`` raise on any other name.  With hicache installed:

* :func:`extend_layout_choices` (an AFTER hook on ``ServerArgs.add_cli_args``)
  adds every registered layout that can hold an MLA or an MHA pool; a layout
  that can hold neither is left out and the reason is logged.
* :func:`init_plugin_layout` (from the ``init_kv_buffer`` hook) allocates the
  host buffers our layout plans, in one block through SGLang's own allocator
  function (pinned and registered as SGLang does), and keeps them on the pool
  (:data:`~.adapter.HOST_BUFFERS_ATTR`) for the transfers and the page views.
  SGLang's ``kv_buffer`` becomes the whole block viewed as ``[L, n]`` (MLA) or
  ``[2, L, n]`` (MHA) so that its own per-layer bookkeeping builds; those
  views are not layers of the layout, and only hicache moves these bytes.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from ...errors import SpecError, UnknownLayoutError
from ...registry import Registry, default_registry
from ...spec import LayerMap, PoolSpec
from .adapter import HOST_BUFFERS_ATTR, describe, mha_spec, pool_kind
from .buffers import KV_SPLIT, alloc_host
from .mode import current_mode

__all__ = [
    "SGLANG_ALLOCATES", "LAYOUT_OPTION", "selectable_layouts", "extend_layout_choices", "wants_plugin_layout",
    "init_plugin_layout",
]

logger = logging.getLogger(__name__)

LAYOUT_OPTION = "--hicache-mem-layout"
#: Layouts SGLang 0.5.23's ``init_kv_buffer`` allocates itself off NPU, per pool kind
#: (``page_first_kv_split`` is :mod:`.buffers`' business).
SGLANG_ALLOCATES = {
    "mla": frozenset({"layer_first", "page_first", "page_first_direct", "page_unified"}),
    "mha": frozenset({"layer_first", "page_first", "page_first_direct", "page_head", "page_unified"}),
}
#: Alignment of each planned buffer inside the allocated block.
_ALIGN = 4096


def _probes() -> dict[str, PoolSpec]:
    """Small MLA and MHA pools, to ask a layout whether it can hold either kind at all."""
    two = LayerMap.unsharded(2)
    return {
        "MLA": PoolSpec.mla(layer_map=two, kv_lora_rank=32, qk_rope_head_dim=16, dtype=torch.bfloat16,
                            page_size=4, capacity=16),
        "MHA": PoolSpec.mha(layer_map=two, head_num=2, head_dim=16, dtype=torch.bfloat16, page_size=4, capacity=16),
    }


def _why_not(registry: Registry, name: str, spec: PoolSpec) -> str | None:
    try:
        return registry.layout(name).check(spec)
    except Exception as exc:  # a third-party check that breaks must not break SGLang's argument parsing
        return f"its check raised {type(exc).__name__}: {exc}"


def selectable_layouts(registry: Registry) -> tuple[list[str], dict[str, str]]:
    """``(names, left_out)``: registered layouts that can hold an MLA or MHA pool, and why the others cannot."""
    names, left_out = [], {}
    probes = _probes()
    for name in sorted(registry.layouts):
        reasons = {kind: _why_not(registry, name, spec) for kind, spec in probes.items()}
        if all(reasons.values()):
            left_out[name] = "; ".join(f"{kind}: {why}" for kind, why in reasons.items())
        else:
            names.append(name)
    return names, left_out


def extend_layout_choices(result: Any, parser: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook of ``ServerArgs.add_cli_args(parser)``: add hicache's layouts to ``--hicache-mem-layout``."""
    action = getattr(parser, "_option_string_actions", {}).get(LAYOUT_OPTION)
    if action is None or action.choices is None:
        return None
    if current_mode() == "off":
        return None
    names, left_out = selectable_layouts(default_registry())
    added = [n for n in names if n not in action.choices]
    action.choices = list(action.choices) + added
    if added:
        action.help = f"{action.help or ''} Layouts from hicache: {', '.join(added)}.".strip()
    for name, why in left_out.items():
        logger.info("hicache: layout %r is not offered to SGLang: it can hold neither pool kind (%s)", name, why)
    return None


def wants_plugin_layout(host: Any) -> bool:
    """Whether ``host.init_kv_buffer`` names a layout SGLang does not allocate (and kv_split is not it)."""
    kind = pool_kind(host)
    layout = getattr(host, "layout", None)
    if kind not in SGLANG_ALLOCATES or layout == KV_SPLIT or layout in SGLANG_ALLOCATES[kind]:
        return False
    native = getattr(host, "_native_buffers", None) is not None  # NPU MLA buffers: SGLang's
    return not native and not getattr(host, "_is_dummy", False) and getattr(host, "dcp_size", 1) == 1


def _spec(host: Any, kind: str) -> PoolSpec:
    if kind == "mha":  # device tensors are captured after allocation; the spec needs none
        return mha_spec(host, torch.device(host._transfer_device))
    return describe(host, None).spec


def _plan(host: Any, kind: str) -> tuple[Any, PoolSpec]:
    registry = default_registry()
    try:
        layout = registry.layout(host.layout)
    except UnknownLayoutError:
        raise ValueError(f"Unsupported layout: {host.layout!r} (neither SGLang nor an installed hicache layout "
                         f"plugin provides it).\n{registry.inventory()}") from None
    spec = _spec(host, kind)
    reason = layout.check(spec)
    if reason is None:
        try:
            return layout.plan(spec), spec
        except SpecError as exc:
            reason = str(exc)
    raise ValueError(f"hicache layout {host.layout!r} cannot hold this SGLang {kind.upper()} host pool "
                     f"({spec.describe()}): {reason}")


def init_plugin_layout(host: Any) -> torch.Tensor:
    """Allocate our layout's host buffers for ``host``; returns what SGLang stores as ``kv_buffer``.

    :raises ValueError: the layout is not installed, or cannot hold this pool (the message says why).
    """
    kind = pool_kind(host)
    assert kind is not None
    plan, spec = _plan(host, kind)
    offsets, end = [], 0
    for b in plan.buffers:
        offsets.append(end)
        end += -(-math.prod(b.shape) * b.dtype.itemsize // _ALIGN) * _ALIGN
    item, layers = host.dtype.itemsize, int(host.layer_num)
    unit = (2 if kind == "mha" else 1) * layers * item
    block = alloc_host(host, (max(1, -(-end // unit)) * unit,), torch.uint8, None)
    host.__dict__[HOST_BUFFERS_ATTR] = {
        b.name: block[o : o + math.prod(b.shape) * b.dtype.itemsize].view(b.dtype).view(b.shape)
        for b, o in zip(plan.buffers, offsets)
    }
    row = host.kv_cache_dim if kind == "mla" else host.head_num * host.head_dim
    host.token_stride_size = row * item
    host.layout_dim = host.token_stride_size * layers
    logger.info("hicache: SGLang %s host pool in layout %r (%s): %d bytes allocated by hicache's plan",
                kind.upper(), host.layout, spec.describe(), block.numel())
    flat = block.view(host.dtype)
    return flat.view(2, layers, -1) if kind == "mha" else flat.view(layers, -1)
